"""Clipped policy-gradient losses (verl's policy-loss registry) with metrics.

Let delta = clamp(logp - old_logp, -20, 20), ratio = exp(delta), A = advantages.
  vanilla: l1 = -A ratio, l2 = -A clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high), l = max(l1, l2);
           dual clip for A < 0: l = min(l, -A clip_ratio_c).
           pg_clipfrac = mean[l2 > l1], pg_clipfrac_lower = mean[(max(l1, l2) > -A c) and A < 0]
  cispo:   l = -sg(clip(ratio, 1 - low, 1 + high)) A logp; pg_clipfrac = mean[clip(ratio) != ratio]
  gpg:     l = -A logp (no ratio, metrics 0)
  gspo:    with the unclamped log-ratio r = logp - old_logp (as verl 0.9.1), sequence ratio
           s_i = exp(sg(mean_t r_i) + logp - sg(logp)) (capped at exp(10)), clipped as vanilla without dual clip
           (aggregated by loss_agg_mode, as verl 0.9.1; the GSPO paper's is seq-mean-token-mean); its ppo_kl is
           mean(-r)
ppo_kl = mean(-delta) (gspo: above). Means over unmasked tokens; the loss is agg_loss(w l, mask, loss_agg_mode), w =
rollout_is_weights (verl's decoupled-mode rollout-correction IS weights, [B, T]; 1 when None), metrics without w.

vanilla/cispo/gpg run one fused kernel that writes the per-token loss, its derivative and the metric sums;
gspo (sequence-level) is composed from torch ops.
"""

from __future__ import annotations

import torch

from pyrl.ops import codes, reference
from pyrl.ops._dispatch import as_buffer, check_same_shape, check_tensor, choose_backend, float32_contiguous
from pyrl.ops.masked import agg_loss

POLICY_LOSS_MODES = {**codes.POLICY_LOSS_MODES, "gspo": None}  # gspo: sequence-level, the torch formula


def per_token_policy_loss(backend, code, logp, old_logp, advantages, mask, clip_low, clip_high, clip_c):
    """(loss [N], d loss / d logp [N], sums (clipped, clipped_lower, -delta, mask)) on flat float32 inputs."""
    if backend == "cpp":
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        loss, dloss = torch.empty_like(logp), torch.empty_like(logp)
        sums = _C.policy_loss_forward(code, as_buffer(logp), as_buffer(old_logp), as_buffer(advantages),
                                      as_buffer(mask), clip_low, clip_high, clip_c, as_buffer(loss), as_buffer(dloss))
        return loss, dloss, torch.tensor(sums, dtype=torch.float64)
    from pyrl.kernels import policy_loss as triton_policy_loss  # lazy: triton is optional (pyrl.kernels imports it)

    return triton_policy_loss.policy_loss_forward(code, logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)


class PerTokenLossFunction(torch.autograd.Function):
    """A per-token loss matrix (computed by a fused kernel) whose backward is grad * its saved derivative."""

    @staticmethod
    def forward(ctx, logp, loss, dloss):
        ctx.save_for_backward(dloss)
        return loss.view(logp.shape)

    @staticmethod
    def backward(ctx, grad):
        (dloss,) = ctx.saved_tensors
        return grad * dloss.view(grad.shape), None, None


def ppo_policy_loss(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    loss_mode="vanilla",
    global_batch_info=None,
    rollout_is_weights=None,
):
    """(loss, metrics) with metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} as 0-dim float32 tensors.
    Differentiable wrt log_prob (and wrt the other inputs too, through the torch formulation, when they
    require grad; rollout_is_weights are constants unless they require grad). global_batch_info: see agg_loss."""
    check_tensor("log_prob", log_prob)
    check_tensor("old_log_prob", old_log_prob)
    check_tensor("advantages", advantages)
    check_tensor("response_mask", response_mask, floating=False)
    if rollout_is_weights is not None:
        check_tensor("rollout_is_weights", rollout_is_weights)
    check_same_shape("log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages,
                     response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    if loss_mode not in POLICY_LOSS_MODES:
        raise ValueError(f"loss_mode: unknown {loss_mode!r}, expected one of {', '.join(POLICY_LOSS_MODES)}")
    for name, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        # clip_ratio_low >= 1 puts the lower bound 1 - low at or below 0, under every ratio: no lower clip (verl's
        # CISPO example sets 10)
        if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    if loss_mode == "vanilla" and not (isinstance(clip_ratio_c, (int, float)) and clip_ratio_c > 1):
        raise ValueError(f"clip_ratio_c: the dual-clip bound must be > 1, got {clip_ratio_c!r}")
    agg_loss(log_prob.new_zeros((1, 1)), log_prob.new_ones((1, 1)), loss_agg_mode)  # validates the mode early
    backend = choose_backend(log_prob)
    others_need_grad = any(t.requires_grad for t in (old_log_prob, advantages))
    if backend == "torch" or loss_mode == "gspo" or others_need_grad:
        loss, metrics = reference.ppo_policy_loss(
            log_prob.float(), old_log_prob.float(), advantages.float(), response_mask.float(),
            clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, loss_mode, global_batch_info,
            None if rollout_is_weights is None else rollout_is_weights.float(),
        )
        return loss.float(), {k: v.detach().float() for k, v in metrics.items()}
    mask = float32_contiguous(response_mask)
    loss_flat, dloss, sums = per_token_policy_loss(
        backend, POLICY_LOSS_MODES[loss_mode], float32_contiguous(log_prob).view(-1),
        float32_contiguous(old_log_prob).view(-1), float32_contiguous(advantages).view(-1), mask.view(-1),
        float(clip_ratio_low), float(clip_ratio_high), float(clip_ratio_c),
    )
    loss_mat = PerTokenLossFunction.apply(log_prob, loss_flat, dloss)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.float()
    denom = sums[3] + 1e-8
    zero = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    if loss_mode == "gpg":
        metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": zero}
    else:
        stats = (sums[:3] / denom).to(device=log_prob.device, dtype=torch.float32)
        metrics = {"pg_clipfrac": stats[0], "pg_clipfrac_lower": stats[1], "ppo_kl": stats[2]}
    return agg_loss(loss_mat, mask, loss_agg_mode, global_batch_info=global_batch_info).float(), metrics


