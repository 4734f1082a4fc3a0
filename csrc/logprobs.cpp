// Log-probs and entropy of temperature-scaled logits: one online-softmax pass per row, in blocks
// that stay in L1, so the logits are read once and no [rows, vocab] float copy is ever made.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "pyrl/ops.h"

namespace pyrl {
namespace {

constexpr int64_t kBlock = 2048;
// Differences below this give exp() == 0 exactly; clamping keeps 0 * (-inf) out of the sums.
constexpr float kMinExponent = -100.0f;

template <FloatKind K>
inline void load_block(const void* row, int64_t start, int64_t len, float inv_t, float* buf) {
  if constexpr (K == FloatKind::F32) {
    const float* src = static_cast<const float*>(row) + start;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) buf[j] = src[j] * inv_t;
  } else if constexpr (K == FloatKind::BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(row) + start;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) buf[j] = bf16_to_float(src[j]) * inv_t;
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(row) + start;
    for (int64_t j = 0; j < len; ++j) buf[j] = f16_to_float(src[j]) * inv_t;
  }
}

template <FloatKind K>
inline void store_block(void* row, int64_t start, int64_t len, const float* buf) {
  if constexpr (K == FloatKind::F32) {
    std::memcpy(static_cast<float*>(row) + start, buf, len * sizeof(float));
  } else if constexpr (K == FloatKind::BF16) {
    uint16_t* dst = static_cast<uint16_t*>(row) + start;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) dst[j] = float_to_bf16(buf[j]);
  } else {
    uint16_t* dst = static_cast<uint16_t*>(row) + start;
    for (int64_t j = 0; j < len; ++j) dst[j] = float_to_f16(buf[j]);
  }
}

// Online softmax statistics of one row: max m, s = sum exp(z - m), sz = sum exp(z - m) * (z - m).
template <FloatKind K>
inline void forward_rows(const void* logits, int64_t row_begin, int64_t row_end, int64_t vocab, int64_t row_stride,
                         const int64_t* labels, float inv_t, float* logp, float* lse, float* entropy, float* buf) {
  const int64_t esize = static_cast<int64_t>(itemsize(K));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const char* row = static_cast<const char*>(logits) + r * row_stride * esize;
    float m = -std::numeric_limits<float>::max();  // finite: a block of -inf logits gives d = -inf, not NaN
    float s = 0.0f, sz = 0.0f;
    for (int64_t start = 0; start < vocab; start += kBlock) {
      const int64_t len = std::min(kBlock, vocab - start);
      load_block<K>(row, start, len, inv_t, buf);
      float bm = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : bm)
      for (int64_t j = 0; j < len; ++j) bm = buf[j] > bm ? buf[j] : bm;
      if (bm > m) {
        if (s > 0.0f) {
          const float scale = std::exp(m - bm);
          sz = scale * (sz + (m - bm) * s);
          s *= scale;
        }
        m = bm;
      }
      float bs = 0.0f, bsz = 0.0f;
#pragma omp simd reduction(+ : bs, bsz)
      for (int64_t j = 0; j < len; ++j) {
        float d = buf[j] - m;
        d = d < kMinExponent ? kMinExponent : d;
        const float e = fast_exp(d);
        bs += e;
        bsz += e * d;
      }
      s += bs;
      sz += bsz;
    }
    const float log_s = std::log(s);
    lse[r] = m + log_s;
    if (entropy) entropy[r] = log_s - sz / s;
    if (labels) logp[r] = load_as_float(row, K, labels[r]) * inv_t - lse[r];
  }
}

// d z_v = -(g_logp * p_v + g_ent * p_v * (z_v - E[z])) + g_logp * [v == label]; d x = d z * inv_t.
template <FloatKind K>
inline void backward_rows(const void* logits, int64_t row_begin, int64_t row_end, int64_t vocab, int64_t row_stride,
                          const int64_t* labels, float inv_t, const float* lse, const float* entropy,
                          const float* grad_logp, const float* grad_entropy, void* grad_logits, float* buf) {
  const int64_t esize = static_cast<int64_t>(itemsize(K));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const char* row = static_cast<const char*>(logits) + r * row_stride * esize;
    char* grow = static_cast<char*>(grad_logits) + r * vocab * esize;
    const float gl = grad_logp ? grad_logp[r] : 0.0f;
    const float ge = grad_entropy ? grad_entropy[r] : 0.0f;
    const float h = grad_entropy ? entropy[r] : 0.0f;
    const float row_lse = lse[r];
    const int64_t label = labels && grad_logp ? labels[r] : -1;
    for (int64_t start = 0; start < vocab; start += kBlock) {
      const int64_t len = std::min(kBlock, vocab - start);
      load_block<K>(row, start, len, inv_t, buf);
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        float d = buf[j] - row_lse;
        d = d < kMinExponent ? kMinExponent : d;
        const float p = fast_exp(d);
        buf[j] = -(gl * p + ge * p * (d + h)) * inv_t;  // z - E[z] = (z - lse) + H
      }
      if (label >= start && label < start + len) buf[label - start] += gl * inv_t;
      store_block<K>(grow, start, len, buf);
    }
  }
}

#define PYRL_DEFINE_KIND(KIND, SUFFIX)                                                                          \
  PYRL_MULTIVERSION void forward_##SUFFIX(const void* logits, int64_t b, int64_t e, int64_t vocab, int64_t stride, \
                                          const int64_t* labels, float inv_t, float* logp, float* lse,           \
                                          float* entropy, float* buf) {                                         \
    forward_rows<KIND>(logits, b, e, vocab, stride, labels, inv_t, logp, lse, entropy, buf);                   \
  }                                                                                                             \
  PYRL_MULTIVERSION void backward_##SUFFIX(const void* logits, int64_t b, int64_t e, int64_t vocab,             \
                                           int64_t stride, const int64_t* labels, float inv_t, const float* lse, \
                                           const float* entropy, const float* gl, const float* ge, void* grad,  \
                                           float* buf) {                                                         \
    backward_rows<KIND>(logits, b, e, vocab, stride, labels, inv_t, lse, entropy, gl, ge, grad, buf);          \
  }

PYRL_DEFINE_KIND(FloatKind::F32, f32)
PYRL_DEFINE_KIND(FloatKind::BF16, bf16)
PYRL_DEFINE_KIND(FloatKind::F16, f16)
#undef PYRL_DEFINE_KIND

void check_common(const void* logits, FloatKind kind, int64_t n_rows, int64_t vocab, int64_t row_stride,
                  const int64_t* labels, float inv_temperature) {
  check(kind == FloatKind::F32 || kind == FloatKind::BF16 || kind == FloatKind::F16,
        "logits: dtype must be float32, bfloat16 or float16");
  check(n_rows >= 0, "logits: number of rows must be >= 0");
  check(vocab > 0, "logits: vocabulary size (last dim) must be > 0, got " + std::to_string(vocab));
  check(row_stride >= vocab, "logits: row stride must be >= vocabulary size");
  check(n_rows == 0 || logits != nullptr, "logits: null data pointer");
  check(std::isfinite(inv_temperature) && inv_temperature > 0.0f, "temperature: must be a finite number > 0");
  if (labels) {
    for (int64_t r = 0; r < n_rows; ++r) {
      if (labels[r] < 0 || labels[r] >= vocab)
        fail("labels: entry " + std::to_string(r) + " is " + std::to_string(labels[r]) + ", outside [0, " +
             std::to_string(vocab) + ")");
    }
  }
}

template <class F>
void parallel_rows(int64_t n_rows, F&& body) {
#pragma omp parallel
  {
    std::vector<float> buf(kBlock);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) body(r, buf.data());
  }
}

}  // namespace

void logprobs_forward(const void* logits, FloatKind kind, int64_t n_rows, int64_t vocab, int64_t row_stride,
                      const int64_t* labels, float inv_temperature, float* logp, float* lse, float* entropy) {
  check_common(logits, kind, n_rows, vocab, row_stride, labels, inv_temperature);
  check(lse != nullptr, "lse: output required");
  check(labels == nullptr || logp != nullptr, "logp: output required when labels are given");
  auto fwd = kind == FloatKind::F32 ? forward_f32 : kind == FloatKind::BF16 ? forward_bf16 : forward_f16;
  parallel_rows(n_rows, [&](int64_t r, float* buf) {
    fwd(logits, r, r + 1, vocab, row_stride, labels, inv_temperature, logp, lse, entropy, buf);
  });
}

void logprobs_backward(const void* logits, FloatKind kind, int64_t n_rows, int64_t vocab, int64_t row_stride,
                       const int64_t* labels, float inv_temperature, const float* lse, const float* entropy,
                       const float* grad_logp, const float* grad_entropy, void* grad_logits) {
  check_common(logits, kind, n_rows, vocab, row_stride, labels, inv_temperature);
  check(lse != nullptr, "lse: saved log-sum-exp required");
  check(grad_logp == nullptr || labels != nullptr, "labels: required for the gradient of logp");
  check(grad_entropy == nullptr || entropy != nullptr, "entropy: saved entropy required for its gradient");
  check(n_rows == 0 || grad_logits != nullptr, "grad_logits: output required");
  auto bwd = kind == FloatKind::F32 ? backward_f32 : kind == FloatKind::BF16 ? backward_bf16 : backward_f16;
  parallel_rows(n_rows, [&](int64_t r, float* buf) {
    bwd(logits, r, r + 1, vocab, row_stride, labels, inv_temperature, lse, entropy, grad_logp, grad_entropy,
        grad_logits, buf);
  });
}

}  // namespace pyrl
