// KL estimators between the policy and the reference, elementwise on delta = logp - ref_logp (verl's
// kl_penalty, including its clamps), with fused backward.
#include <cmath>
#include <string>

#include "pyrl/ops.h"

namespace pyrl {
namespace {

void check_kl_args(const float* logp, const float* ref_logp, int64_t n, KLKind kind) {
  check(n >= 0, "logp: size must be >= 0");
  check(n == 0 || (logp && ref_logp), "logp/ref_logp: null data pointer");
  const int k = static_cast<int>(kind);
  check(k >= 0 && k <= 3, "kind: unknown KL estimator code " + std::to_string(k));
}

template <KLKind K>
PYRL_MULTIVERSION void kl_forward_kind(const float* logp, const float* ref_logp, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = logp[i] - ref_logp[i];
    float v;
    if constexpr (K == KLKind::K1) {
      v = d;
    } else if constexpr (K == KLKind::ABS) {
      v = std::fabs(d);
    } else if constexpr (K == KLKind::K2) {
      v = 0.5f * d * d;
    } else {  // k3: exp(u) - u - 1 with u = clamp(ref - logp, -20, 20), then clamped to [-10, 10]
      float u = -d;
      u = u < -20.0f ? -20.0f : (u > 20.0f ? 20.0f : u);
      v = fast_exp(u) - u - 1.0f;
      v = v < -10.0f ? -10.0f : (v > 10.0f ? 10.0f : v);
    }
    out[i] = v;
  }
}

// d kl / d logp; torch.clamp passes the gradient on its bounds, so do the comparisons here.
template <KLKind K, bool STRAIGHT_THROUGH>
PYRL_MULTIVERSION void kl_backward_kind(const float* logp, const float* ref_logp, const float* grad_out, int64_t n, float* grad_logp) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = logp[i] - ref_logp[i];
    float dd;
    if constexpr (STRAIGHT_THROUGH || K == KLKind::K2) {
      dd = d;
    } else if constexpr (K == KLKind::K1) {
      dd = 1.0f;
    } else if constexpr (K == KLKind::ABS) {
      dd = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f);
    } else {
      const float u = -d;
      const float uc = u < -20.0f ? -20.0f : (u > 20.0f ? 20.0f : u);
      const float e = fast_exp(uc);
      const bool inside = u >= -20.0f && u <= 20.0f && e - uc - 1.0f <= 10.0f;
      dd = inside ? 1.0f - e : 0.0f;
    }
    grad_logp[i] = grad_out[i] * dd;
  }
}

}  // namespace

void kl_forward(const float* logp, const float* ref_logp, int64_t n, KLKind kind, float* out) {
  check_kl_args(logp, ref_logp, n, kind);
  check(n == 0 || out, "out: null data pointer");
  switch (kind) {
    case KLKind::K1: return kl_forward_kind<KLKind::K1>(logp, ref_logp, n, out);
    case KLKind::ABS: return kl_forward_kind<KLKind::ABS>(logp, ref_logp, n, out);
    case KLKind::K2: return kl_forward_kind<KLKind::K2>(logp, ref_logp, n, out);
    default: return kl_forward_kind<KLKind::K3>(logp, ref_logp, n, out);
  }
}

void kl_backward(const float* logp, const float* ref_logp, const float* grad_out, int64_t n, KLKind kind,
                 bool straight_through, float* grad_logp) {
  check_kl_args(logp, ref_logp, n, kind);
  check(n == 0 || (grad_out && grad_logp), "grad_out/grad_logp: null data pointer");
  if (straight_through) return kl_backward_kind<KLKind::K2, true>(logp, ref_logp, grad_out, n, grad_logp);
  switch (kind) {
    case KLKind::K1: return kl_backward_kind<KLKind::K1, false>(logp, ref_logp, grad_out, n, grad_logp);
    case KLKind::ABS: return kl_backward_kind<KLKind::ABS, false>(logp, ref_logp, grad_out, n, grad_logp);
    case KLKind::K2: return kl_backward_kind<KLKind::K2, false>(logp, ref_logp, grad_out, n, grad_logp);
    default: return kl_backward_kind<KLKind::K3, false>(logp, ref_logp, grad_out, n, grad_logp);
  }
}

}  // namespace pyrl
