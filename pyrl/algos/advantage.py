"""Advantage estimators, registered by name (verl's `algorithm.adv_estimator`).

Each takes token-level tensors [B, T] (rewards with the outcome score on the last valid token, and the
response mask) and returns (advantages, returns), both [B, T] float32. Group-based estimators take
`index`: one group id per sample (verl's `uid`: strings, ints, a numpy array or a tensor). What else an estimator
reads it declares where it is registered (pyrl.algos.registry.Needs): the trainer passes exactly that.
"""

from __future__ import annotations

import numpy as np
import torch

from pyrl import ops
from pyrl.algos.registry import VERL_OPTIONAL, Needs, Registry

ESTIMATORS = Registry("advantage estimator", default_needs=VERL_OPTIONAL)
ADV_ESTIMATOR_REGISTRY = ESTIMATORS.functions
# @register_adv_est(name, needs=Needs(...)) registers a function (verl's decorator; needs is pyrl's);
# get_adv_estimator_fn(name) returns it or raises a ValueError listing the known names.
register_adv_est, get_adv_estimator_fn = ESTIMATORS.register, ESTIMATORS.get


def group_ids(index, device) -> torch.Tensor:
    """Group labels (uids of any hashable kind, or a tensor) -> int64 ids 0..G-1 on `device`, one per label."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index.reshape(-1), return_inverse=True)[1].to(device)
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64).reshape(-1)).to(device)


def _outcome(token_level_rewards, response_mask, index, estimator, **kwargs):
    scores = token_level_rewards.sum(-1)
    per_sample = ops.group_advantages(scores, group_ids(index, scores.device), estimator, **kwargs)
    advantages = per_sample.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gae", needs=Needs(tensors=("values",)))
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0, **_):
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1} (masked tokens carried);
    returns = A + V; advantages whitened over the batch."""
    return ops.compute_gae(token_level_rewards, values, response_mask, gamma, lam)


@register_adv_est("grpo", needs=Needs())
@register_adv_est("grpo_vectorized", needs=Needs())  # verl's vectorized twin: the same numbers (no loop here either)
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, **_):
    """A_i = (s_i - mean_g) / (std_g + eps) (or s_i - mean_g for Dr.GRPO), broadcast over valid tokens."""
    return _outcome(token_level_rewards, response_mask, index, "grpo", norm_by_std=norm_adv_by_std_in_grpo,
                    eps=epsilon)


@register_adv_est("grpo_passk", needs=Needs())
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True, **_):
    """Only each group's best sample gets A = s_max - s_second (/ (std_g + eps)); needs >= 2 per group."""
    return _outcome(token_level_rewards, response_mask, index, "grpo_passk", norm_by_std=norm_adv_by_std_in_grpo,
                    eps=epsilon)


@register_adv_est("rloo", needs=Needs())
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = s_i - mean_{j != i in g} s_j; a singleton keeps s_i."""
    return _outcome(token_level_rewards, response_mask, index, "rloo")


@register_adv_est("rloo_vectorized", needs=Needs())
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = s_i - mean_{j != i in g} s_j; a singleton gets 0 (verl's vectorized RLOO; its loop version, `rloo`,
    keeps s_i)."""
    advantages, _ = _outcome(token_level_rewards, response_mask, index, "rloo")
    ids = group_ids(index, advantages.device)
    advantages = advantages * (torch.bincount(ids)[ids] > 1).unsqueeze(-1)
    return advantages, advantages


def gdpo_components(config, non_tensor_batch=None) -> tuple[list[str], list[float]]:
    """(algorithm.gdpo_reward_keys, their weights: gdpo_reward_weights or 1 each), checked (and, given the batch's
    non_tensor_batch, each key found there)."""
    keys = list(config.gdpo_reward_keys or [])
    if not keys:
        raise ValueError("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys, which is empty: "
                         "algorithm.gdpo_reward_keys must list the reward components to normalize one by one, fields "
                         "of the dicts compute_score returns (e.g. ['format_reward', 'accuracy_reward'])")
    for key in keys if non_tensor_batch is not None else ():
        if key not in non_tensor_batch:
            raise KeyError(f"gdpo: reward component {key!r} (algorithm.gdpo_reward_keys) is not in the batch, "
                           f"which has {sorted(non_tensor_batch)}; compute_score must return a dict holding it")
    weights = config.gdpo_reward_weights if config.gdpo_reward_weights is not None else [1.0] * len(keys)
    if len(weights) != len(keys):
        raise ValueError(f"gdpo: {len(weights)} algorithm.gdpo_reward_weights for {len(keys)} gdpo_reward_keys")
    return keys, [float(w) for w in weights]


def gdpo_metrics(batch, config) -> dict:
    """verl's gdpo/<key>/mean|std|max|min of each reward component."""
    components = {key: np.asarray(batch.non_tensor_batch[key], dtype=np.float32) for key in config.gdpo_reward_keys}
    return {f"gdpo/{key}/{stat}": float(getattr(np, stat)(values))
            for key, values in components.items() for stat in ("mean", "std", "max", "min")}


@register_adv_est("gdpo", needs=Needs(non_tensor_batch=True, check=gdpo_components, metrics=gdpo_metrics))
def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None, non_tensor_batch=None, **_):
    """A = whiten(sum_k w_k A_k m, m) * m (GDPO): A_k is the GRPO advantage of reward component k alone, so a
    dominant component cannot drown the others; whiten over the batch's valid tokens. Components:
    non_tensor_batch[key] (one score per sample) for key in config.gdpo_reward_keys, weights
    config.gdpo_reward_weights (default 1 each); without config or non_tensor_batch, the one component
    token_level_rewards.sum(-1)."""
    device = token_level_rewards.device
    if config is None or non_tensor_batch is None:
        components, weights = [token_level_rewards.sum(-1)], [1.0]
    else:
        keys, weights = gdpo_components(config, non_tensor_batch)
        components = [torch.as_tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=device)
                      for key in keys]
    ids = group_ids(index, device)
    combined = sum(float(weight) * ops.group_advantages(scores, ids, "grpo", norm_adv_by_std_in_grpo, epsilon)
                   for weight, scores in zip(weights, components))
    advantages = combined.unsqueeze(-1) * response_mask
    advantages = ops.masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("opo", needs=Needs())
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = s_i - sum_j L_j s_j / sum_j L_j over the group, L = response length."""
    return _outcome(token_level_rewards, response_mask, index, "opo", lengths=response_mask.sum(-1))


@register_adv_est("gpg", needs=Needs())
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """A_i = B / max(1, #{s != 0}) * (s_i - mean_g)."""
    return _outcome(token_level_rewards, response_mask, index, "gpg")


@register_adv_est("reinforce_plus_plus_baseline", needs=Needs())
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index, **_):
    """a_i = s_i - mean_g over every valid token, then whitened over the batch: A = whiten(a, m) * m."""
    advantages, _ = _outcome(token_level_rewards, response_mask, index, "reinforce_plus_plus_baseline")
    advantages = ops.masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus", needs=Needs())
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0, **_):
    """G_t = r_t + gamma G_next on valid tokens (m_t = 1), where G_next is the return of the next valid token;
    tokens outside the mask (a tool's output inside a multi-turn response) are skipped: their reward is dropped
    and the return passes through them undiscounted, as verl 0.9.1 does. returns = G m, advantages =
    whiten(G, m) * m."""
    with torch.no_grad():
        mask = response_mask.to(torch.float32)
        returns = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        running = torch.zeros_like(returns[:, 0])
        for t in reversed(range(returns.shape[-1])):  # a linear recurrence that skips masked tokens
            step = token_level_rewards[:, t] + gamma * running
            returns[:, t] = step * mask[:, t]
            running = torch.where(mask[:, t] != 0, step, running)
        advantages = ops.masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("remax", needs=Needs(tensors=("reward_baselines",)))
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask, **_):
    """G_t = sum_{t' >= t} r_t' m_t'; A_t = G_t - b m_t with b the reward of the greedy rollout; returns = G."""
    with torch.no_grad():
        masked = (token_level_rewards * response_mask).to(torch.float32)
        returns = masked.flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.to(torch.float32).unsqueeze(-1) * response_mask
    return advantages, returns


# the optimal token baselines read the old policy's per-token statistics before the update: old_log_probs and the
# actor's sum_pi_squared (actor_rollout_ref.actor.calculate_sum_pi_squared), with rollout correction's IS weights
OPTIMAL_TOKEN_BASELINE = Needs(tensors=("old_log_probs", "sum_pi_squared"), optional_tensors=("rollout_is_weights",),
                               old_log_probs_before_update=True)


def _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                            rollout_is_weights, handle_zero_tail, epsilon, by_valid_token):
    """The two OTB estimators; by_valid_token: a token's time step counts only the valid tokens before it (and a
    response with none is in no group), else it is the column."""
    with torch.no_grad():
        # float64: w is near 0 on near-certain tokens, and the baseline is a ratio of sums of them
        mask = response_mask.double()
        returns = (token_level_rewards.double() * mask).flip(-1).cumsum(-1).flip(-1)
        w = 1 - 2 * old_log_probs.double().exp() + sum_pi_squared.double()
        if rollout_is_weights is not None:
            w = w * rollout_is_weights.double() ** 2
        path_variance = (w * mask).cumsum(-1) * mask  # W_t on valid tokens, 0 elsewhere
        rows, width = mask.shape
        lengths = mask.sum(-1).long()
        ids = group_ids(index, mask.device)
        groups = int(ids.max()) + 1 if rows else 0
        if by_valid_token:
            step = (mask.cumsum(-1) - 1).clamp(min=0).long()
        else:
            step = torch.arange(width, device=mask.device).expand(rows, width)
        slot = (ids[:, None] * width + step).reshape(-1)  # (group, time step) of each token
        numerator = mask.new_zeros(groups * width).index_add_(0, slot, (returns * path_variance).reshape(-1))
        denominator = mask.new_zeros(groups * width).index_add_(0, slot, path_variance.reshape(-1))
        baselines = (numerator / (denominator + epsilon))[slot].reshape(rows, width)
        members = lengths > 0 if by_valid_token else torch.ones_like(lengths, dtype=torch.bool)
        size = torch.bincount(ids, weights=members.double(), minlength=groups)[ids]
        baselines = baselines * (size > 1).unsqueeze(-1)  # a lone response keeps its return
        if handle_zero_tail:  # a group's unique longest response: no baseline past the second longest's length
            longest = lengths.new_zeros(groups).scatter_reduce(0, ids, lengths, "amax")[ids]
            is_longest = lengths == longest
            unique = torch.bincount(ids[is_longest], minlength=groups)[ids] == 1
            second = lengths.new_zeros(groups).scatter_reduce(0, ids, torch.where(is_longest, 0, lengths), "amax")[ids]
            tail = (is_longest & unique & (size > 1)).unsqueeze(-1) & (step >= second.unsqueeze(-1))
            baselines = baselines.masked_fill(tail, 0.0)
        advantages = torch.where(response_mask.bool(), returns - baselines, 0.0)
    return advantages.float(), returns.float()


@register_adv_est("optimal_token_baseline", needs=OPTIMAL_TOKEN_BASELINE)
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                             rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **_):
    """A_t = G_t - B_t, B_t = sum_{i in g} G_{i,t} W_{i,t} m_{i,t} / (sum_{i in g} W_{i,t} m_{i,t} + eps) per
    column t (Optimal Token Baseline): G_t = sum_{t' >= t} r_t' m_t' the return, W_t = sum_{j <= t} w_j m_j the
    path variance with w_j = (1 - 2 pi_j + sum_v pi_v^2) rho_j^2 (pi_j = exp(old_log_probs), rho the rollout IS
    weights or 1); a singleton group has B = 0; handle_zero_tail: a group's unique longest response has B = 0
    from the second longest's length on. returns = G."""
    return _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights, handle_zero_tail, epsilon, by_valid_token=False)


@register_adv_est("tir_optimal_token_baseline", needs=OPTIMAL_TOKEN_BASELINE)
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                        sum_pi_squared, rollout_is_weights=None, handle_zero_tail=True,
                                                        epsilon=1e-8, **_):
    """optimal_token_baseline with time counted in valid tokens (multi-turn / tool-use responses whose mask has
    holes): B_k = sum_{i in g} G_{i,(k)} W_{i,(k)} / (sum_{i in g} W_{i,(k)} + eps), (k) = a response's k-th valid
    token; responses with no valid token are left out of their group. returns = G."""
    return _optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights, handle_zero_tail, epsilon, by_valid_token=True)
