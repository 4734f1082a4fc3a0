// The pyrl C++ core: CPU kernels behind pyrl.ops. Plain pointers in, plain pointers out; no libtorch.
// Every function checks its arguments and throws std::invalid_argument naming the bad one.
#pragma once

#include <cstdint>

#include "pyrl/common.h"

namespace pyrl {

// ---- log-probs / entropy over a vocabulary (one online-softmax pass per row) ----
// logits: n_rows rows of `vocab` elements, row r starting at r * row_stride elements.
// labels (nullable: entropy only) in [0, vocab). Writes lse[n_rows] (of logits * inv_temperature),
// logp[n_rows] when labels are given, entropy[n_rows] when non-null.
void logprobs_forward(const void* logits, FloatKind kind, int64_t n_rows, int64_t vocab, int64_t row_stride,
                      const int64_t* labels, float inv_temperature, float* logp, float* lse, float* entropy);

// d_logits (contiguous [n_rows, vocab], same kind as logits) from the upstream grads of logp and/or
// entropy (either nullable). entropy must be given when grad_entropy is.
void logprobs_backward(const void* logits, FloatKind kind, int64_t n_rows, int64_t vocab, int64_t row_stride,
                       const int64_t* labels, float inv_temperature, const float* lse, const float* entropy,
                       const float* grad_logp, const float* grad_entropy, void* grad_logits);

// ---- KL estimators, elementwise on delta = logp - ref_logp ----
enum class KLKind : int { K1 = 0, ABS = 1, K2 = 2, K3 = 3 };
void kl_forward(const float* logp, const float* ref_logp, int64_t n, KLKind kind, float* out);
// grad wrt logp (grad wrt ref_logp is its negative). straight_through: gradient of k2 whatever `kind`.
void kl_backward(const float* logp, const float* ref_logp, const float* grad_out, int64_t n, KLKind kind,
                 bool straight_through, float* grad_logp);

// ---- GAE (verl's masked carry) over sequences ----
// Sequence i covers [cu_seqlens[i], cu_seqlens[i+1]); if cu_seqlens is null, sequence i covers
// [i * seq_len, (i + 1) * seq_len). mask nullable (= all ones); float weights allowed as in verl.
// whiten: then verl's masked_whiten of the advantages over all sequences, (A - mean) * rsqrt(var + 1e-8),
// mean and unbiased var over the mask.
void gae(const float* rewards, const float* values, const float* mask, const int64_t* cu_seqlens, int64_t n_seqs,
         int64_t seq_len, float gamma, float lam, bool whiten, float* advantages, float* returns);

// ---- group-relative outcome advantages ----
enum class GroupEstimator : int { GRPO = 0, RLOO = 1, RPP_BASELINE = 2, OPO = 3, GRPO_PASSK = 4, GPG = 5 };
// lengths (response lengths) are needed by OPO only.
void group_advantages(const float* scores, const int64_t* group_ids, const float* lengths, int64_t n,
                      GroupEstimator estimator, bool norm_by_std, float eps, float* out);

// ---- per-token clipped policy loss ----
enum class PolicyLossMode : int { VANILLA = 0, CISPO = 1, GPG = 2 };
// Writes the per-token loss and its derivative wrt logp; sums[0..3] = masked sums of
// (pg_clipfrac flag, pg_clipfrac_lower flag, -clamped log-ratio, mask).
void policy_loss_forward(PolicyLossMode mode, const float* logp, const float* old_logp, const float* advantages,
                         const float* mask, int64_t n, float clip_low, float clip_high, float clip_c, float* loss,
                         float* dloss_dlogp, double* sums);

// ---- per-token clipped value loss ----
// loss = max((v - R)^2, (clip(v, old - c, old + c) - R)^2); sums[0..1] = masked sums of (clip flag, mask).
void value_loss_forward(const float* values, const float* old_values, const float* returns, const float* mask,
                        int64_t n, float cliprange, float* loss, float* dloss_dvalues, double* sums);

}  // namespace pyrl
