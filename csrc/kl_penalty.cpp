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

}  // namespace

void kl_forward(const float* logp, const float* ref_logp, int64_t n, KLKind kind, float* out) {
  check_kl_args(logp, ref_logp, n, kind);
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float d = logp[i] - ref_logp[i];
    float v;
    switch (kind) {
      case KLKind::K1: v = d; break;
      case KLKind::ABS: v = std::fabs(d); break;
      case KLKind::K2: v = 0.5f * d * d; break;
      default: {
        float u = -d;  // k3: exp(u) - u - 1 with u = clamp(ref - logp, -20, 20), then clamp to [-10, 10]
        u = u < -20.0f ? -20.0f : (u > 20.0f ? 20.0f : u);
        v = std::exp(u) - u - 1.0f;
        v = v < -10.0f ? -10.0f : (v > 10.0f ? 10.0f : v);
      }
    }
    out[i] = v;
  }
}

void kl_backward(const float* logp, const float* ref_logp, const float* grad_out, int64_t n, KLKind kind,
                 bool straight_through, float* grad_logp) {
  check_kl_args(logp, ref_logp, n, kind);
  check(n == 0 || (grad_out && grad_logp), "grad_out/grad_logp: null data pointer");
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float d = logp[i] - ref_logp[i];
    float dd;  // d kl / d delta
    if (straight_through || kind == KLKind::K2) {
      dd = d;
    } else if (kind == KLKind::K1) {
      dd = 1.0f;
    } else if (kind == KLKind::ABS) {
      dd = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f);
    } else {
      const float u = -d;
      const bool inside = u >= -20.0f && u <= 20.0f;  // torch.clamp passes the gradient on the bounds
      const float uc = u < -20.0f ? -20.0f : (u > 20.0f ? 20.0f : u);
      const float v = std::exp(uc) - uc - 1.0f;
      const bool out_inside = v >= -10.0f && v <= 10.0f;
      dd = (inside && out_inside) ? -(std::exp(uc) - 1.0f) : 0.0f;
    }
    grad_logp[i] = grad_out[i] * dd;
  }
}

}  // namespace pyrl
