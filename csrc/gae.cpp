// Generalized advantage estimation as a reverse scan per sequence (verl's compute_gae_advantage_return,
// masked positions carry the next value and advantage), plus verl's masked whitening.
#include <cmath>
#include <string>

#include "pyrl/ops.h"

namespace pyrl {

void gae(const float* rewards, const float* values, const float* mask, const int64_t* cu_seqlens, int64_t n_seqs,
         int64_t seq_len, float gamma, float lam, float* advantages, float* returns) {
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
#pragma omp parallel for schedule(static) if (n_seqs >= 16)
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t begin = cu_seqlens ? cu_seqlens[i] : i * seq_len;
    const int64_t end = cu_seqlens ? cu_seqlens[i + 1] : (i + 1) * seq_len;
    float next_value = 0.0f, last_adv = 0.0f;
    for (int64_t t = end - 1; t >= begin; --t) {
      const float m = mask ? mask[t] : 1.0f;
      const float delta = rewards[t] + gamma * next_value - values[t];
      const float adv = delta + gl * last_adv;
      next_value = values[t] * m + (1.0f - m) * next_value;
      last_adv = adv * m + (1.0f - m) * last_adv;
      advantages[t] = last_adv;
      returns[t] = last_adv + values[t];
    }
  }
}

void masked_whiten_inplace(float* x, const float* mask, int64_t n) {
  double msum = 0.0, xsum = 0.0;
#pragma omp simd reduction(+ : msum, xsum)
  for (int64_t i = 0; i < n; ++i) {
    const double m = mask ? mask[i] : 1.0;
    msum += m;
    xsum += static_cast<double>(x[i]) * m;
  }
  if (msum == 0.0) fail("mask: whitening needs at least one unmasked element, the mask sums to 0");
  if (msum == 1.0) fail("mask: whitening needs at least two unmasked elements (unbiased variance), the mask sums to 1");
  const double mean = xsum / (msum + 1e-8);
  double sq = 0.0;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) {
    const double c = static_cast<double>(x[i]) - mean;
    sq += c * c * (mask ? mask[i] : 1.0);
  }
  const double var = sq / (msum + 1e-8) * (msum / (msum - 1.0));
  const double inv_std = 1.0 / std::sqrt(var + 1e-8);
  const float mean_f = static_cast<float>(mean), inv_std_f = static_cast<float>(inv_std);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = (x[i] - mean_f) * inv_std_f;
}

}  // namespace pyrl
