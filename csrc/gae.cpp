// Generalized advantage estimation as a reverse scan per sequence (verl's compute_gae_advantage_return,
// masked positions carry the next value and advantage), plus verl's masked whitening.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "pyrl/ops.h"

namespace pyrl {
namespace {

// Masked moments of the advantages, gathered during the scan so that whitening needs one more pass
// (the apply) instead of three.
struct Moments {
  double count = 0.0, sum = 0.0, sum_sq = 0.0;
  void add(const Moments& o) {
    count += o.count;
    sum += o.sum;
    sum_sq += o.sum_sq;
  }
};

// One step of the recurrence, verl's
//   A' = r + gamma nextV - V + gamma lam lastA;  nextV <- m V + (1-m) nextV;  lastA <- m A' + (1-m) lastA
// rearranged so that each carried value goes through a single FMA per step (lastA <- lastA k + m c):
// the scan is latency-bound, and this cuts its chain from three dependent operations to one.
inline float gae_step(float r, float v, float m, float gamma, float gl, float& next_value, float& last_adv) {
  const float masked_delta = m * (r - v + gamma * next_value);
  last_adv = last_adv * (1.0f + m * (gl - 1.0f)) + masked_delta;
  next_value = next_value * (1.0f - m) + m * v;
  return last_adv;
}

// kRows consecutive sequences of length len, scanned side by side: one sequence's scan is a serial
// chain of FMAs, so independent rows interleaved keep the FMA units busy. Scalar on purpose: gathering
// rows that sit a power of two apart into SIMD lanes hits the same cache sets and runs slower.
template <int kRows>
PYRL_MULTIVERSION Moments scan_rows(const float* r, const float* v, const float* mask, int64_t len, float gamma, float gl,
                                    float* adv, float* ret) {
  float next_value[kRows] = {}, last_adv[kRows] = {};
  double count[kRows] = {}, sum[kRows] = {}, sum_sq[kRows] = {};
  for (int64_t t = len - 1; t >= 0; --t) {
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j) {
      const int64_t i = j * len + t;
      const float m = mask ? mask[i] : 1.0f;
      const float a = gae_step(r[i], v[i], m, gamma, gl, next_value[j], last_adv[j]);
      adv[i] = a;
      ret[i] = a + v[i];
      const double wa = static_cast<double>(a) * m;
      count[j] += m;
      sum[j] += wa;
      sum_sq[j] += wa * a;
    }
  }
  Moments out;
  for (int j = 0; j < kRows; ++j) out.add({count[j], sum[j], sum_sq[j]});
  return out;
}

// verl's masked_whiten from the moments: mean = S/(C + 1e-8), var = (Q - 2 mean S + mean^2 C)/(C + 1e-8)
// * C/(C - 1); returns {mean, rsqrt(var + 1e-8)}. Needs count >= 2 (checked by the caller).
std::pair<float, float> whitening_of(const Moments& mom) {
  const double mean = mom.sum / (mom.count + 1e-8);
  const double centered_sq = std::max(0.0, mom.sum_sq - 2.0 * mean * mom.sum + mean * mean * mom.count);
  const double var = centered_sq / (mom.count + 1e-8) * (mom.count / (mom.count - 1.0));
  return {static_cast<float>(mean), static_cast<float>(1.0 / std::sqrt(var + 1e-8))};
}

PYRL_MULTIVERSION void whiten_range(float* x, int64_t begin, int64_t end, float mean, float inv_std) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) x[i] = (x[i] - mean) * inv_std;
}

}  // namespace

void gae(const float* rewards, const float* values, const float* mask, const int64_t* cu_seqlens, int64_t n_seqs,
         int64_t seq_len, float gamma, float lam, bool whiten, float* advantages, float* returns) {
  check(n_seqs >= 0, "rewards: number of sequences must be >= 0");
  check(std::isfinite(gamma) && std::isfinite(lam), "gamma/lam: must be finite");
  if (cu_seqlens) {
    check(cu_seqlens[0] == 0, "cu_seqlens: must start at 0, got " + std::to_string(cu_seqlens[0]));
    for (int64_t i = 0; i < n_seqs; ++i)
      if (cu_seqlens[i + 1] < cu_seqlens[i])
        fail("cu_seqlens: must be non-decreasing, entry " + std::to_string(i + 1) + " (" +
             std::to_string(cu_seqlens[i + 1]) + ") < entry " + std::to_string(i) + " (" +
             std::to_string(cu_seqlens[i]) + ")");
  } else {
    check(seq_len >= 0, "rewards: sequence length must be >= 0");
  }
  const float gl = gamma * lam;
  const int64_t n = cu_seqlens ? cu_seqlens[n_seqs] : n_seqs * seq_len;
  // Padded rows go kRows at a time; a work item is a block of rows (padded) or one sequence (packed).
  constexpr int kRows = 4;
  const int64_t n_items = cu_seqlens ? n_seqs : (n_seqs + kRows - 1) / kRows;
  const auto item_range = [&](int64_t item) -> std::pair<int64_t, int64_t> {
    if (cu_seqlens) return {cu_seqlens[item], cu_seqlens[item + 1]};
    return {item * kRows * seq_len, std::min(n_seqs, (item + 1) * kRows) * seq_len};
  };
  Moments total;
  std::pair<float, float> mean_inv_std;
  // One parallel region for scan and whitening with the same static split, so each thread whitens the
  // advantages it wrote while they are still in its cache.
#pragma omp parallel if (n >= 32768 && n_items > 1)
  {
    Moments mine;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < n_items; ++item) {
      const auto [begin, end] = item_range(item);
      const auto scan = [&](auto rows, int64_t at, int64_t len) {
        mine.add(scan_rows<decltype(rows)::value>(rewards + at, values + at, mask ? mask + at : nullptr, len, gamma,
                                                  gl, advantages + at, returns + at));
      };
      if (cu_seqlens) {
        scan(std::integral_constant<int, 1>{}, begin, end - begin);
      } else if (end - begin == kRows * seq_len) {
        scan(std::integral_constant<int, kRows>{}, begin, seq_len);
      } else {
        for (int64_t at = begin; at < end; at += seq_len) scan(std::integral_constant<int, 1>{}, at, seq_len);
      }
    }
#pragma omp critical(pyrl_gae_moments)
    total.add(mine);
#pragma omp barrier
    // Exceptions must not leave a parallel region: a bad mask skips the whitening and fails below.
    if (whiten && total.count != 0.0 && total.count != 1.0) {
#pragma omp single
      mean_inv_std = whitening_of(total);
#pragma omp for schedule(static)
      for (int64_t item = 0; item < n_items; ++item) {
        const auto [begin, end] = item_range(item);
        whiten_range(advantages, begin, end, mean_inv_std.first, mean_inv_std.second);
      }
    }
  }
  if (whiten && total.count == 0.0) fail("mask: whitening needs at least one unmasked element, the mask sums to 0");
  if (whiten && total.count == 1.0)
    fail("mask: whitening needs at least two unmasked elements (unbiased variance), the mask sums to 1");
}

}  // namespace pyrl
