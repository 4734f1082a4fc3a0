// Per-token clipped policy-gradient loss and its derivative in one pass (verl's vanilla PPO with
// clip-higher and dual-clip, CISPO, GPG), plus the masked sums behind pg_clipfrac, pg_clipfrac_lower
// and ppo_kl.
#include <cmath>
#include <string>

#include "pyrl/ops.h"

namespace pyrl {

void policy_loss_forward(PolicyLossMode mode, const float* logp, const float* old_logp, const float* advantages,
                         const float* mask, int64_t n, float clip_low, float clip_high, float clip_c, float* loss,
                         float* dloss_dlogp, double* sums) {
  const int m = static_cast<int>(mode);
  check(m >= 0 && m <= 2, "loss_mode: unknown policy loss code " + std::to_string(m));
  check(n >= 0, "log_prob: size must be >= 0");
  check(n == 0 || (logp && old_logp && advantages && mask && loss && dloss_dlogp), "log_prob: null data pointer");
  // clip_low >= 1: the lower bound 1 - clip_low <= 0 lies under every ratio, so there is no lower clip
  check(std::isfinite(clip_low) && clip_low >= 0.0f, "clip_ratio_low: must be >= 0, got " + std::to_string(clip_low));
  check(std::isfinite(clip_high) && clip_high >= 0.0f, "clip_ratio_high: must be >= 0, got " + std::to_string(clip_high));
  check(mode != PolicyLossMode::VANILLA || clip_c > 1.0f,
        "clip_ratio_c: dual-clip bound must be > 1, got " + std::to_string(clip_c));
  const float lo = 1.0f - clip_low, hi = 1.0f + clip_high;
  double s_clip = 0.0, s_lower = 0.0, s_kl = 0.0, s_mask = 0.0;
#pragma omp parallel for simd reduction(+ : s_clip, s_lower, s_kl, s_mask) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float a = advantages[i];
    const float w = mask[i];
    const float raw = logp[i] - old_logp[i];
    const bool in_range = raw >= -20.0f && raw <= 20.0f;
    const float delta = raw < -20.0f ? -20.0f : (raw > 20.0f ? 20.0f : raw);
    const float ratio = std::exp(delta);
    const float dratio = in_range ? ratio : 0.0f;  // d ratio / d logp
    const float clipped_ratio = ratio < lo ? lo : (ratio > hi ? hi : ratio);
    const bool ratio_inside = ratio >= lo && ratio <= hi;
    float l, dl, f_clip = 0.0f, f_lower = 0.0f;
    if (mode == PolicyLossMode::VANILLA) {
      const float l1 = -a * ratio, l2 = -a * clipped_ratio;
      const float dl1 = -a * dratio, dl2 = ratio_inside ? dl1 : 0.0f;
      l = l1 > l2 ? l1 : l2;
      dl = l1 > l2 ? dl1 : (l2 > l1 ? dl2 : 0.5f * (dl1 + dl2));
      f_clip = l2 > l1 ? 1.0f : 0.0f;
      if (a < 0.0f) {
        const float l3 = -a * clip_c;
        f_lower = l > l3 ? 1.0f : 0.0f;
        dl = l < l3 ? dl : (l > l3 ? 0.0f : 0.5f * dl);
        l = l < l3 ? l : l3;
      }
    } else if (mode == PolicyLossMode::CISPO) {
      // -sg(clip(ratio)) * A * logp: the clipped ratio only weights the REINFORCE gradient.
      l = -clipped_ratio * a * logp[i];
      dl = -clipped_ratio * a;
      f_clip = clipped_ratio != ratio ? 1.0f : 0.0f;
    } else {
      l = -a * logp[i];
      dl = -a;
    }
    loss[i] = l;
    dloss_dlogp[i] = dl;
    s_clip += static_cast<double>(w * f_clip);
    s_lower += static_cast<double>(w * f_lower);
    s_kl += static_cast<double>(-delta * w);
    s_mask += static_cast<double>(w);
  }
  if (sums) {
    sums[0] = s_clip;
    sums[1] = s_lower;
    sums[2] = s_kl;
    sums[3] = s_mask;
  }
}

}  // namespace pyrl
