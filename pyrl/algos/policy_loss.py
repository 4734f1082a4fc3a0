"""Policy losses, registered by name (verl's `actor.policy_loss.loss_mode`).

Each is called as fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) and
returns (pg_loss, metrics) with metrics {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}. config holds
clip_ratio (default 0.2), clip_ratio_low / clip_ratio_high (default clip_ratio) and clip_ratio_c (3.0),
as a dict or an object with those attributes. global_batch_info (optional) is passed to pyrl.ops.agg_loss.
"""

from __future__ import annotations

from typing import Callable

from pyrl import ops
from pyrl.algos.registry import make_registry

POLICY_LOSS_REGISTRY: dict[str, Callable] = {}

# @register_policy_loss(name) registers a function;
# get_policy_loss_fn(name) returns it or raises a ValueError listing the known names.
register_policy_loss, get_policy_loss_fn = make_registry("policy loss", POLICY_LOSS_REGISTRY)


def clip_ratios(config) -> dict:
    get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    base = get("clip_ratio") if config is not None and get("clip_ratio") is not None else 0.2
    low = get("clip_ratio_low") if config is not None else None
    high = get("clip_ratio_high") if config is not None else None
    c = get("clip_ratio_c") if config is not None else None
    return {
        "clip_ratio_low": base if low is None else low,
        "clip_ratio_high": base if high is None else high,
        "clip_ratio_c": 3.0 if c is None else c,
    }


def _ppo(loss_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info):
    return ops.ppo_policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, loss_mode=loss_mode,
        global_batch_info=global_batch_info, **clip_ratios(config),
    )


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                                   global_batch_info=None):
    """PPO: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual-clipped at -A c for A < 0."""
    return _ppo("vanilla", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
                                   global_batch_info=None):
    """GSPO: the clipped objective on the sequence ratio exp(mean_t log r), token-level gradients,
    always aggregated seq-mean-token-mean."""
    return _ppo("gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                                   global_batch_info=None):
    """GPG: -A log pi (no ratio, no clipping)."""
    return _ppo("gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                                   global_batch_info=None):
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi."""
    return _ppo("cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info)
