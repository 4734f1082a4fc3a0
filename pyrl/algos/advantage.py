"""Advantage estimators, registered by name (verl's `algorithm.adv_estimator`).

Each takes token-level tensors [B, T] (rewards with the outcome score on the last valid token, and the
response mask) and returns (advantages, returns), both [B, T] float32. Group-based estimators take
`index`: one group id per sample (verl's `uid`: strings, ints, a numpy array or a tensor).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pyrl import ops
from pyrl.algos.registry import make_registry

ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}

# @register_adv_est(name) registers a function;
# get_adv_estimator_fn(name) returns it or raises a ValueError listing the known names.
register_adv_est, get_adv_estimator_fn = make_registry("advantage estimator", ADV_ESTIMATOR_REGISTRY)


def group_ids(index, device) -> torch.Tensor:
    """Group labels (uids of any hashable kind) -> int64 ids on `device`."""
    if isinstance(index, torch.Tensor):
        return index.to(device=device, dtype=torch.int64)
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64).reshape(-1)).to(device)


def _outcome(token_level_rewards, response_mask, index, estimator, **kwargs):
    scores = token_level_rewards.sum(-1)
    per_sample = ops.group_advantages(scores, group_ids(index, scores.device), estimator, **kwargs)
    advantages = per_sample.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gae")
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0, **_):
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1} (masked tokens carried);
    returns = A + V; advantages whitened over the batch."""
    return ops.compute_gae(token_level_rewards, values, response_mask, gamma, lam)


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_):
    """A_i = (s_i - mean_g) / (std_g + eps) (or s_i - mean_g for Dr.GRPO), broadcast over valid tokens."""
    return _outcome(token_level_rewards, response_mask, index, "grpo", norm_by_std=norm_adv_by_std_in_grpo, eps=epsilon)


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_):
    """Only each group's best sample gets A = s_max - s_second (/ (std_g + eps)); needs >= 2 per group."""
    return _outcome(token_level_rewards, response_mask, index, "grpo_passk", norm_by_std=norm_adv_by_std_in_grpo, eps=epsilon)


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = s_i - mean_{j != i in g} s_j; a singleton keeps s_i."""
    return _outcome(token_level_rewards, response_mask, index, "rloo")


@register_adv_est("opo")
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = s_i - sum_j L_j s_j / sum_j L_j over the group, L = response length."""
    return _outcome(token_level_rewards, response_mask, index, "opo", lengths=response_mask.sum(-1))


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = B / max(1, #{s != 0}) * (s_i - mean_g)."""
    return _outcome(token_level_rewards, response_mask, index, "gpg")


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """a_i = s_i - mean_g over every valid token, then whitened over the batch: A = whiten(a, m) * m."""
    advantages, _ = _outcome(token_level_rewards, response_mask, index, "reinforce_plus_plus_baseline")
    advantages = ops.masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0, **_):
    """G_t = r_t + gamma G_{t+1}, the running return reset by the mask (G_{t+1} counts only if m_{t+1});
    returns = G, advantages = whiten(G, m) * m."""
    with torch.no_grad():
        mask = response_mask.to(torch.float32)
        returns = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        running = torch.zeros_like(returns[:, 0])
        for t in reversed(range(returns.shape[-1])):  # a linear recurrence with a data-dependent reset
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]
        advantages = ops.masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("remax")
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask, **_):
    """G_t = sum_{t' >= t} r_t' m_t'; A_t = G_t - b m_t with b the reward of the greedy rollout; returns = G."""
    with torch.no_grad():
        masked = (token_level_rewards * response_mask).to(torch.float32)
        returns = masked.flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.to(torch.float32).unsqueeze(-1) * response_mask
    return advantages, returns
