// Group-relative outcome advantages (GRPO, RLOO, REINFORCE++-baseline, OPO, GRPO pass@k, GPG) with
// segment reductions: group ids are compacted by an open-addressing hash, then every statistic is one
// linear pass. No loop over groups, no sort.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "pyrl/ops.h"

namespace pyrl {
namespace {

// Maps arbitrary int64 ids to 0..k-1 in order of first appearance.
std::vector<int64_t> compact_ids(const int64_t* ids, int64_t n, int64_t* n_groups) {
  int64_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  std::vector<int64_t> keys(cap), slots(cap, -1), out(n);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t h = static_cast<uint64_t>(ids[i]) * 0x9E3779B97F4A7C15ull;
    int64_t pos = static_cast<int64_t>(h >> 20) & (cap - 1);
    while (slots[pos] >= 0 && keys[pos] != ids[i]) pos = (pos + 1) & (cap - 1);
    if (slots[pos] < 0) {
      keys[pos] = ids[i];
      slots[pos] = k++;
    }
    out[i] = slots[pos];
  }
  *n_groups = k;
  return out;
}

}  // namespace

void group_advantages(const float* scores, const int64_t* group_ids, const float* lengths, int64_t n,
                      GroupEstimator estimator, bool norm_by_std, float eps, float* out) {
  const int est = static_cast<int>(estimator);
  check(est >= 0 && est <= 5, "estimator: unknown group estimator code " + std::to_string(est));
  check(n >= 0, "scores: size must be >= 0");
  check(n == 0 || (scores && group_ids && out), "scores/group_index: null data pointer");
  check(estimator != GroupEstimator::OPO || lengths != nullptr, "lengths: the opo estimator needs response lengths");
  check(std::isfinite(eps) && eps >= 0.0f, "eps: must be finite and >= 0");
  if (n == 0) return;

  int64_t k = 0;
  const std::vector<int64_t> g = compact_ids(group_ids, n, &k);
  std::vector<int64_t> count(k, 0);
  std::vector<double> sum(k, 0.0), wsum(k, 0.0), wtot(k, 0.0), sq(k, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    count[g[i]] += 1;
    sum[g[i]] += scores[i];
    if (lengths) {
      wsum[g[i]] += static_cast<double>(lengths[i]) * scores[i];
      wtot[g[i]] += lengths[i];
    }
  }
  // Baseline per group (verl: a singleton group has mean 0 and std 1).
  std::vector<double> mean(k), stdev(k, 1.0);
  for (int64_t j = 0; j < k; ++j) mean[j] = count[j] > 1 ? sum[j] / count[j] : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double c = scores[i] - mean[g[i]];
    sq[g[i]] += c * c;
  }
  for (int64_t j = 0; j < k; ++j)
    if (count[j] > 1) stdev[j] = std::sqrt(sq[j] / (count[j] - 1));  // unbiased, as torch.std

  switch (estimator) {
    case GroupEstimator::GRPO:
      for (int64_t i = 0; i < n; ++i) {
        const double a = scores[i] - mean[g[i]];
        out[i] = static_cast<float>(norm_by_std ? a / (stdev[g[i]] + eps) : a);
      }
      break;
    case GroupEstimator::RLOO:
      for (int64_t i = 0; i < n; ++i) {
        const double c = static_cast<double>(count[g[i]]);
        out[i] = static_cast<float>(c > 1 ? (scores[i] - mean[g[i]]) * c / (c - 1.0) : scores[i]);
      }
      break;
    case GroupEstimator::RPP_BASELINE:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(scores[i] - mean[g[i]]);
      break;
    case GroupEstimator::OPO:
      // Length-weighted baseline; a group whose responses are all empty gets baseline 0 (verl: 0/0 = NaN).
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = g[i];
        const double b = (count[j] > 1 && wtot[j] > 0.0) ? wsum[j] / wtot[j] : 0.0;
        out[i] = static_cast<float>(scores[i] - b);
      }
      break;
    case GroupEstimator::GRPO_PASSK: {
      std::vector<int64_t> best(k, -1);
      std::vector<double> second(k, -std::numeric_limits<double>::infinity());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = g[i];
        if (best[j] < 0 || scores[i] > scores[best[j]]) {
          if (best[j] >= 0) second[j] = scores[best[j]];
          best[j] = i;
        } else if (scores[i] > second[j]) {
          second[j] = scores[i];
        }
      }
      for (int64_t j = 0; j < k; ++j)
        if (count[j] < 2)
          fail("group_index: grpo_passk needs at least 2 samples per group, group " +
               std::to_string(group_ids[best[j]]) + " has " + std::to_string(count[j]));
      for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        double a = scores[best[j]] - second[j];
        if (norm_by_std) a /= stdev[j] + eps;
        out[best[j]] = static_cast<float>(a);
      }
      break;
    }
    case GroupEstimator::GPG: {
      int64_t nonzero = 0;
      for (int64_t i = 0; i < n; ++i) nonzero += scores[i] != 0.0f;
      const double alpha = static_cast<double>(n) / static_cast<double>(nonzero > 0 ? nonzero : 1);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(alpha * (scores[i] - mean[g[i]]));
      break;
    }
  }
}

}  // namespace pyrl
