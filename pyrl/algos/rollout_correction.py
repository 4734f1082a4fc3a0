"""Rollout vs trainer: the log-prob check after every weight push and verl 0.9.1's rollout correction
(verl/utils/debug/metrics.py calculate_debug_metrics, verl/trainer/ppo/rollout_corr_helper.py).

With pi the trainer's probability of each response token (old_log_probs) and mu the rollout engine's
(rollout_log_probs), over the valid response tokens:
  training/rollout_probs_diff_{mean,max,std} = mean / max / std (unbiased) of |pi - mu|
  training/rollout_actor_probs_pearson_corr  = Pearson correlation of pi and mu
  training/rollout_probs_diff_valid          = 1 (0, with the others NaN, when no token is valid)
Right after a push both engines hold the same weights, so these are rounding-level; stale or corrupted weights
show at once.

Decoupled correction (algorithm.rollout_correction.rollout_is / rollout_rs, bypass_mode off): importance weights
w(pi / mu) go into the batch as rollout_is_weights (the policy losses multiply their per-token terms by them),
rejected tokens leave response_mask, and rollout_corr/* reports the mismatch (verl's compute_offpolicy_metrics:
with r_i = mean_t log pi - mean_t log mu per sequence, training_ppl = mean_i exp(-mean_t log pi), ...).
"""

from __future__ import annotations

import torch

from pyrl import ops
from pyrl.algos.policy_loss import SAFETY_BOUND, rollout_correction


def rollout_probs_diff(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict:
    valid = response_mask.bool()
    if not valid.any():
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan}
    pi, mu = old_log_probs.double().exp()[valid], rollout_log_probs.double().exp()[valid]
    diff = (pi - mu).abs()
    pearson = torch.corrcoef(torch.stack([pi, mu]))[0, 1].item() if diff.numel() > 1 else float("nan")
    return {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std().item(), "training/rollout_actor_probs_pearson_corr": pearson}


def offpolicy_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                      response_mask: torch.Tensor) -> dict:
    """verl's compute_offpolicy_metrics (names without the rollout_corr/ prefix)."""
    mask = response_mask.double()
    old, rollout = old_log_probs.double(), rollout_log_probs.double()
    mean_old, mean_rollout = ops.masked_mean(old, mask, axis=-1), ops.masked_mean(rollout, mask, axis=-1)
    log_ratio = old - rollout
    log_ppl_diff = mean_rollout - mean_old
    seq_log_ratio = ops.masked_sum(log_ratio, mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics = {
        "training_ppl": torch.exp(-mean_old).mean(), "training_log_ppl": (-mean_old).mean(),
        "kl": ops.masked_mean(rollout - old, mask),
        "k3_kl": ops.masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-mean_rollout).mean(), "rollout_log_ppl": (-mean_rollout).mean(),
        "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(), "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": ops.masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {name: value.item() for name, value in metrics.items()}


def apply_rollout_correction(batch, config) -> dict:
    """Decoupled mode on the whole batch (one pass, before the advantages, as verl): rejected tokens leave
    response_mask (loss_mask keeps the mask before rejection: the losses divide by its tokens, as verl 0.9.1's
    engine does), rollout_is_weights joins the batch when rollout_is is set; returns the rollout_corr/ metrics."""
    mask = batch.batch["response_mask"]
    if not mask.any():
        return {}
    old, rollout = batch.batch["old_log_probs"].float(), batch.batch["rollout_log_probs"].float()
    weights, keep, metrics = rollout_correction(old - rollout, mask, config.rollout_is, config.rollout_is_threshold,
                                                config.rollout_is_batch_normalize, config.rollout_rs,
                                                config.rollout_rs_threshold)
    out = {name: float(value) for name, value in metrics.items()}
    out.update({f"rollout_corr/{name}": value for name, value in offpolicy_metrics(old, rollout, mask).items()})
    if config.rollout_rs:  # the losses' denominators count the tokens before rejection, as verl's loss_mask
        batch.batch["loss_mask"] = mask
    batch.batch["response_mask"] = (mask * keep).to(mask.dtype)
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights.float()
    return out
