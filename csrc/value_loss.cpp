// Per-token clipped value loss (verl's compute_value_loss) and its derivative in one pass, plus the
// masked sums behind vf_clipfrac.
#include <cmath>
#include <string>

#include "pyrl/ops.h"

namespace pyrl {

void value_loss_forward(const float* values, const float* old_values, const float* returns, const float* mask,
                        int64_t n, float cliprange, float* loss, float* dloss_dvalues, double* sums) {
  check(n >= 0, "values: size must be >= 0");
  check(n == 0 || (values && old_values && returns && mask && loss && dloss_dvalues), "values: null data pointer");
  check(std::isfinite(cliprange) && cliprange >= 0.0f, "cliprange_value: must be >= 0, got " + std::to_string(cliprange));
  double s_clip = 0.0, s_mask = 0.0;
#pragma omp parallel for simd reduction(+ : s_clip, s_mask) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float v = values[i], lo = old_values[i] - cliprange, hi = old_values[i] + cliprange;
    const float vc = v < lo ? lo : (v > hi ? hi : v);
    const bool inside = v >= lo && v <= hi;
    const float e1 = v - returns[i], e2 = vc - returns[i];
    const float l1 = e1 * e1, l2 = e2 * e2;
    const float d1 = 2.0f * e1, d2 = inside ? 2.0f * e2 : 0.0f;
    loss[i] = l1 > l2 ? l1 : l2;
    dloss_dvalues[i] = l1 > l2 ? d1 : (l2 > l1 ? d2 : 0.5f * (d1 + d2));
    s_clip += static_cast<double>(mask[i] * (l2 > l1 ? 1.0f : 0.0f));
    s_mask += static_cast<double>(mask[i]);
  }
  if (sums) {
    sums[0] = s_clip;
    sums[1] = s_mask;
  }
}

}  // namespace pyrl
