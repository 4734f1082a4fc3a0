"""Plain-torch formulations of every pyrl op: verl's formulas, written plainly (log_softmax + gather, GAE as a
Python loop over time, one Python loop over groups). They are the "torch" backend, the baseline of the GAE, KL
and loss benchmarks, and what the tests compare the fused kernels with (in float64). They are not always verl's
code path: verl 0.9.1's log-probs run flash-attn's cross entropy or, without it, a loop over rows
(logprobs_from_logits_v2), and its grpo loops over samples; the log-prob and group-advantage benchmarks compare
with transcriptions of those (benchmarks/verl091.py).

Results come back in float32, or float64 when the inputs are float64.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pyrl.ops.masked import agg_loss, masked_mean, masked_whiten


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def logprobs_from_logits(logits, labels, temperature=1.0, return_entropy=False):
    z = logits.to(_compute_dtype(logits)) / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if return_entropy:
        return logp, entropy_from_logits(logits, temperature)
    return logp


def entropy_from_logits(logits, temperature=1.0):
    z = logits.to(_compute_dtype(logits)) / temperature
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z.masked_fill(p == 0, 0)).sum(-1)  # 0 * -inf counts as 0


def fused_linear_logprobs(hidden, weight, labels, temperature=1.0, return_entropy=False):
    return logprobs_from_logits(hidden @ weight.t(), labels, temperature, return_entropy)


def kl_penalty(logp, ref_logp, kind="low_var_kl"):
    if kind.endswith("+"):  # value of the estimator, gradient of k2
        value = kl_penalty(logp, ref_logp, kind[:-1])
        k2 = kl_penalty(logp, ref_logp, "k2")
        return k2 - k2.detach() + value.detach()
    delta = logp - ref_logp
    if kind in ("kl", "k1"):
        return delta
    if kind == "abs":
        return delta.abs()
    if kind in ("mse", "k2"):
        return 0.5 * delta.square()
    if kind in ("low_var_kl", "k3"):
        u = torch.clamp(-delta, min=-20, max=20)
        return torch.clamp(torch.exp(u) - u - 1, min=-10, max=10)
    raise ValueError(f"kind: unknown KL estimator {kind!r}")


def compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=True):
    """verl's compute_gae_advantage_return, loop for loop."""
    with torch.no_grad():
        mask = mask.to(rewards.dtype)
        next_values, last_adv, reversed_adv = 0, 0, []
        for t in reversed(range(rewards.shape[-1])):
            delta = rewards[:, t] + gamma * next_values - values[:, t]
            adv = delta + gamma * lam * last_adv
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            last_adv = adv * mask[:, t] + (1 - mask[:, t]) * last_adv
            reversed_adv.append(last_adv)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns


def compute_gae_packed(rewards, values, cu_seqlens, gamma=1.0, lam=1.0, mask=None, whiten=True):
    """GAE per packed sequence, each through the padded loop above."""
    with torch.no_grad():
        mask = torch.ones_like(rewards) if mask is None else mask.to(rewards.dtype)
        advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
        bounds = cu_seqlens.tolist()
        for begin, end in zip(bounds[:-1], bounds[1:]):
            if end > begin:
                a, r = compute_gae(rewards[None, begin:end], values[None, begin:end], mask[None, begin:end], gamma,
                                   lam, False)
                advantages[begin:end], returns[begin:end] = a[0], r[0]
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns


def group_advantages(scores, group_index, estimator="grpo", norm_by_std=True, eps=1e-6, lengths=None):
    """verl's group estimators (core_algos.compute_*_outcome_advantage) as one Python loop over groups, on
    per-sample scores."""
    scores = scores.to(_compute_dtype(scores))
    ids = group_index.tolist()
    members = defaultdict(list)
    for i, g in enumerate(ids):
        members[g].append(i)
    out = torch.zeros_like(scores)
    alpha = len(ids) / max(1, int(torch.count_nonzero(scores)))
    for g, idx in members.items():
        s = scores[idx]
        n = len(idx)
        mean = s.mean() if n > 1 else torch.zeros((), dtype=s.dtype)
        std = s.std() if n > 1 else torch.ones((), dtype=s.dtype)
        if estimator == "grpo":
            out[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
        elif estimator == "rloo":
            out[idx] = (s - mean) * n / (n - 1) if n > 1 else s
        elif estimator == "reinforce_plus_plus_baseline":
            out[idx] = s - mean
        elif estimator == "opo":
            lens = lengths.to(s.dtype)[idx]
            base = (lens * s).sum() / lens.sum() if n > 1 and lens.sum() > 0 else 0.0
            out[idx] = s - base
        elif estimator == "grpo_passk":
            if n < 2:
                raise ValueError(f"group_index: grpo_passk needs at least 2 samples per group, group {g} has {n}")
            top = torch.topk(s, 2)
            adv = top.values[0] - top.values[1]
            out[idx[int(top.indices[0])]] = adv / (std + eps) if norm_by_std else adv
        elif estimator == "gpg":
            out[idx] = alpha * (s - mean)
        else:
            raise ValueError(f"estimator: unknown {estimator!r}")
    return out


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
    """verl's compute_policy_loss_{vanilla,gspo,gpg,cispo}: (loss, metrics); the per-token loss is multiplied by
    rollout_is_weights (when given) before aggregation."""
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    delta = log_prob - old_log_prob
    if loss_mode == "gpg":
        loss_mat = -log_prob * advantages
        metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": zero}
    elif loss_mode == "gspo":
        lengths = response_mask.sum(-1).clamp(min=1)
        seq_delta = (delta * response_mask).sum(-1) / lengths
        log_ratio = log_prob - log_prob.detach() + seq_delta.detach().unsqueeze(-1)
        ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
        l1 = -advantages * ratio
        l2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        loss_mat = torch.maximum(l1, l2)
        metrics = {"pg_clipfrac": masked_mean(torch.gt(l2, l1).to(l1.dtype), response_mask), "pg_clipfrac_lower": zero,
                   "ppo_kl": masked_mean(-delta, response_mask)}
    elif loss_mode in ("cispo", "vanilla"):
        delta = torch.clamp(delta, min=-20.0, max=20.0)
        ratio = torch.exp(delta)
        ppo_kl = masked_mean(-delta, response_mask)
        clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        if loss_mode == "cispo":
            loss_mat = -clipped_ratio.detach() * advantages * log_prob
            clipfrac = masked_mean(torch.ne(ratio, clipped_ratio).to(ratio.dtype), response_mask)
            metrics = {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": zero, "ppo_kl": ppo_kl}
        else:
            l1 = -advantages * ratio
            l2 = -advantages * clipped_ratio
            clip1 = torch.maximum(l1, l2)
            l3 = -advantages * clip_ratio_c
            clip2 = torch.min(l3, clip1)
            loss_mat = torch.where(advantages < 0, clip2, clip1)
            metrics = {
                "pg_clipfrac": masked_mean(torch.gt(l2, l1).to(l1.dtype), response_mask),
                "pg_clipfrac_lower": masked_mean(torch.gt(clip1, l3).to(l1.dtype) * (advantages < 0), response_mask),
                "ppo_kl": ppo_kl,
            }
    else:
        raise ValueError(f"loss_mode: unknown {loss_mode!r}")
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    return agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info=global_batch_info), metrics


def value_loss(values, old_values, returns, response_mask, cliprange_value=0.5, loss_agg_mode="token-mean",
               global_batch_info=None):
    """verl's compute_value_loss: (0.5 * agg(max(l1, l2)), vf_clipfrac)."""
    clipped = torch.max(torch.min(values, old_values + cliprange_value), old_values - cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.max(l1, l2), response_mask, loss_agg_mode, global_batch_info=global_batch_info)
    return loss, masked_mean(torch.gt(l2, l1).to(l1.dtype), response_mask)
