"""Policy losses, registered by name (verl's `actor.policy_loss.loss_mode`).

Each is called as fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info,
rollout_is_weights=None) and returns (pg_loss, metrics): 0-dim tensors, each a token mean over the response mask
(the actor weights them by the micro-batch's token share and reports them as actor/<name>), the names verl 0.9.1's
loss reports (the PPO-style ones "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"; fewer for gpg, clip_cov, kl_cov, dro
and bypass_mode's reinforce, whose docstrings name theirs), the same whatever the input, an all-masked one
included. config is the actor config (pyrl.config.ActorConfig) or a dict with the same keys (policy-loss options
under "policy_loss") or None: a missing key takes verl 0.9.1's default; clip_ratio (default 0.2), clip_ratio_low /
clip_ratio_high (default clip_ratio) and clip_ratio_c (3.0) are the PPO ones. global_batch_info (optional) is passed to
pyrl.ops.agg_loss. rollout_is_weights (optional, [B, T]) are verl's decoupled-mode rollout-correction IS weights,
computed by the trainer: as verl, every loss multiplies its per-token loss by them before aggregating (geo_mean its
sequence losses by their geometric mean over the sequence's tokens; bypass_mode ignores them: it computes its own);
the metrics do not use them. Below, r = exp(log_prob - old_log_prob), A = advantages, w = rollout_is_weights (1 when
None), sg = stop-gradient, means are over unmasked tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from pyrl import ops
from pyrl.algos.registry import Needs, Registry
from pyrl.config import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig
from pyrl.ops._dispatch import check_same_shape

POLICY_LOSSES = Registry("policy loss")
POLICY_LOSS_REGISTRY = POLICY_LOSSES.functions
# @register_policy_loss(name, needs=Needs(...)) registers a function (verl's decorator; needs is pyrl's);
# get_policy_loss_fn(name) returns it or raises a ValueError listing the known names.
register_policy_loss, get_policy_loss_fn = POLICY_LOSSES.register, POLICY_LOSSES.get
ACTOR = "actor_rollout_ref.actor."  # the section a loss's settings are read from, for the start check's errors


def checked_at_start(settings: Callable) -> Needs:
    """The needs of a loss whose knobs `settings(config, key)` reads and checks: the same check runs at start on the
    actor config (pyrl.trainer.checks), naming the knobs in full."""
    return Needs(check=functools.partial(settings, key=ACTOR))

SAFETY_BOUND = 20.0  # verl's clamp of log ratios before exp: finite ratios and weights


def config_value(config, path: str, default):
    """config.<path> (e.g. "policy_loss.kl_cov_ratio"), through attributes or dict keys; default where a key is
    absent or None."""
    for key in path.split("."):
        config = None if config is None else config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if config is None else config


def checked_value(config, path: str, default, valid: Callable[[float], bool], requirement: str, key: str = ""):
    """config_value, a number for which valid(value) holds, else a ValueError naming the key (`key` + path)."""
    value = config_value(config, path, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not valid(value):
        raise ValueError(f"{key}{path}: must be a number{' ' + requirement if requirement else ''}, got {value!r}")
    return value


def clip_ratios(config) -> dict:
    base = config_value(config, "clip_ratio", 0.2)
    return {
        "clip_ratio_low": config_value(config, "clip_ratio_low", base),
        "clip_ratio_high": config_value(config, "clip_ratio_high", base),
        "clip_ratio_c": config_value(config, "clip_ratio_c", 3.0),
    }


def _ppo(loss_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info,
         rollout_is_weights=None):
    return ops.ppo_policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, loss_mode=loss_mode,
        global_batch_info=global_batch_info, rollout_is_weights=rollout_is_weights, **clip_ratios(config),
    )


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, global_batch_info=None, *, rollout_is_weights=None):
    """PPO: w max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), the max dual-clipped at -A c for A < 0."""
    return _ppo("vanilla", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info,
                rollout_is_weights)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                                   global_batch_info=None, *, rollout_is_weights=None):
    """GSPO: w max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) on the sequence ratio s = exp(mean_t log r),
    token-level gradients, aggregated by loss_agg_mode (verl 0.9.1; the GSPO paper's is seq-mean-token-mean)."""
    return _ppo("gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info,
                rollout_is_weights)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                                   global_batch_info=None, *, rollout_is_weights=None):
    """GPG: -w A log pi (no ratio, no clipping). No metrics (verl 0.9.1 reports none)."""
    pg_loss, _ = _ppo("gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                      global_batch_info, rollout_is_weights)
    return pg_loss, {}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, global_batch_info=None, *, rollout_is_weights=None):
    """CISPO: -w sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi."""
    return _ppo("cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch_info,
                rollout_is_weights)


def _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl) -> dict:
    return {"pg_clipfrac": pg_clipfrac.detach(), "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
            "ppo_kl": ppo_kl.detach()}


def _fraction(condition, mask):
    """The fraction of unmasked tokens where condition holds."""
    return ops.masked_mean(condition.float(), mask)


def _aggregate(pg_losses, response_mask, loss_agg_mode, global_batch_info, rollout_is_weights):
    """agg_loss(w pg_losses): verl's rollout-correction weights applied to the per-token loss."""
    if rollout_is_weights is not None:
        check_same_shape("log_prob", pg_losses, rollout_is_weights=rollout_is_weights)
        pg_losses = pg_losses * rollout_is_weights
    return ops.agg_loss(pg_losses, response_mask, loss_agg_mode, global_batch_info=global_batch_info)


def _clamped_log_ratio(log_prob, old_log_prob):
    return torch.clamp(log_prob - old_log_prob, min=-SAFETY_BOUND, max=SAFETY_BOUND)


def sapo_settings(config, key: str = "") -> tuple[float, float]:
    """(tau_pos, tau_neg), both > 0."""
    return (checked_value(config, "tau_pos", ActorConfig.tau_pos, lambda v: v > 0, "> 0", key),
            checked_value(config, "tau_neg", ActorConfig.tau_neg, lambda v: v > 0, "> 0", key))


@register_policy_loss("sapo", needs=checked_at_start(sapo_settings))
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, global_batch_info=None, *, rollout_is_weights=None):
    """SAPO: -w f(r, tau) A with the soft gate f(r, tau) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos where A > 0
    else tau_neg (actor.tau_pos / tau_neg), log r clamped to [-20, 20]; always aggregated seq-mean-token-mean (as
    verl: loss_agg_mode is not used). pg_clipfrac = pg_clipfrac_lower = 0, ppo_kl = mean(-log r)."""
    tau_pos, tau_neg = sapo_settings(config)
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_loss = _aggregate(-gate * advantages, response_mask, "seq-mean-token-mean", global_batch_info,
                         rollout_is_weights)
    zero = log_prob.new_zeros(())
    return pg_loss, _metrics(zero, zero, ops.masked_mean(-log_ratio, response_mask))


def dppo_truncation(config, key: str = "") -> float:
    """clip_ratio_c (> 0): it truncates the IS ratio (TIS) instead of a dual clip; verl falls back to 20 where the
    config lacks the key (an actor config has it: 3.0 by default)."""
    return checked_value(config, "clip_ratio_c", 20.0, lambda v: v > 0, "> 0", key)


def _dppo(keep_where_positive, keep_where_negative, log_ratio, log_prob, advantages, response_mask, loss_agg_mode,
          config, global_batch_info, rollout_is_weights):
    truncation = dppo_truncation(config)
    ratio = torch.exp(log_ratio)
    kept = torch.where(advantages > 0, keep_where_positive, keep_where_negative).to(log_prob.dtype)
    pg_losses = -advantages * torch.clamp(ratio, max=truncation).detach() * log_prob * kept
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, global_batch_info, rollout_is_weights)
    truncated = (ratio > truncation).to(log_prob.dtype) * kept
    return pg_loss, _metrics(ops.masked_mean(1.0 - kept, response_mask), ops.masked_mean(truncated, response_mask),
                             ops.masked_mean(-log_ratio, response_mask))


@register_policy_loss("dppo_tv", needs=checked_at_start(dppo_truncation))
def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, global_batch_info=None, *, rollout_is_weights=None):
    """DPPO-Binary-TV: -w A sg(min(r, c)) log pi on the tokens whose probability moved within the TV threshold
    (pi - pi_old <= clip_ratio_high where A > 0, pi - pi_old >= -clip_ratio_low where A <= 0), 0 on the others;
    c = clip_ratio_c (verl's fallback 20), log r clamped to [-20, 20]. pg_clipfrac = mean(outside),
    pg_clipfrac_lower = mean(inside and r > c), ppo_kl = mean(-log r)."""
    clip = clip_ratios(config)
    moved = (torch.exp(log_prob) - torch.exp(old_log_prob)).detach()
    return _dppo(moved <= clip["clip_ratio_high"], moved >= -clip["clip_ratio_low"],
                 _clamped_log_ratio(log_prob, old_log_prob), log_prob, advantages, response_mask, loss_agg_mode, config,
                 global_batch_info, rollout_is_weights)


@register_policy_loss("dppo_kl", needs=checked_at_start(dppo_truncation))
def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, global_batch_info=None, *, rollout_is_weights=None):
    """DPPO-Binary-KL: dppo_tv with the binary KL D = pi_old log(pi_old / pi) + (1 - pi_old) log((1 - pi_old + 1e-8)
    / (1 - pi + 1e-8)) as the divergence: kept where A > 0 if D <= clip_ratio_high or pi <= pi_old, where A <= 0 if
    D <= clip_ratio_low or pi >= pi_old."""
    clip = clip_ratios(config)
    prob, old_prob = torch.exp(log_prob.detach()), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob.detach()) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    keep_where_positive = (binary_kl <= clip["clip_ratio_high"]) | (prob <= old_prob)
    keep_where_negative = (binary_kl <= clip["clip_ratio_low"]) | (prob >= old_prob)
    return _dppo(keep_where_positive, keep_where_negative, _clamped_log_ratio(log_prob, old_log_prob), log_prob,
                 advantages, response_mask, loss_agg_mode, config, global_batch_info, rollout_is_weights)


def clip_cov_settings(config, key: str = "") -> tuple[float, float, float]:
    """(policy_loss.clip_cov_ratio > 0, clip_cov_lb, clip_cov_ub > clip_cov_lb)."""
    share = checked_value(config, "policy_loss.clip_cov_ratio", PolicyLossConfig.clip_cov_ratio, lambda v: v > 0,
                          "> 0", key)
    lower = checked_value(config, "policy_loss.clip_cov_lb", PolicyLossConfig.clip_cov_lb, lambda v: True, "", key)
    upper = checked_value(config, "policy_loss.clip_cov_ub", PolicyLossConfig.clip_cov_ub, lambda v: v > lower,
                          f"> policy_loss.clip_cov_lb ({lower})", key)
    return share, lower, upper


@register_policy_loss("clip_cov", needs=checked_at_start(clip_cov_settings))
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, global_batch_info=None, *, rollout_is_weights=None):
    """Clip-Cov: w max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) (no dual clip, no log-ratio clamp),
    times 0 on n = max(1, int(clip_cov_ratio x unmasked tokens)) tokens drawn at random (torch.randperm, as verl)
    among the unmasked ones PPO did not clip whose covariance (A - mean A)(log pi - mean log pi) lies in
    (clip_cov_lb, clip_cov_ub): their gradient is cut. pg_clipfrac = mean(cut), ppo_kl = mean(-log r) (no
    pg_clipfrac_lower, as verl)."""
    share, lower, upper = clip_cov_settings(config)
    clip = clip_ratios(config)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip["clip_ratio_low"], 1 + clip["clip_ratio_high"])
    # the per-token covariance of the Clip-Cov / KL-Cov paper (Entropy-Mechanism-of-RL), means over unmasked tokens
    covariance = ((advantages - ops.masked_mean(advantages, response_mask))
                  * (log_prob.detach() - ops.masked_mean(log_prob.detach(), response_mask)))
    candidates = torch.nonzero((response_mask > 0) & ~(pg_losses2 > pg_losses1) & (covariance > lower)
                               & (covariance < upper))
    if len(candidates):
        candidates = candidates[torch.randperm(len(candidates))[: max(int(share * response_mask.sum().item()), 1)]]
    kept = torch.ones_like(advantages)
    kept[candidates[:, 0], candidates[:, 1]] = 0.0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * kept
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, global_batch_info, rollout_is_weights)
    return pg_loss, {"pg_clipfrac": _fraction(kept == 0, response_mask).detach(),
                     "ppo_kl": ops.masked_mean(-log_ratio, response_mask).detach()}


def kl_cov_settings(config, key: str = "") -> tuple[float, float]:
    """(policy_loss.kl_cov_ratio > 0, policy_loss.ppo_kl_coef >= 0)."""
    return (checked_value(config, "policy_loss.kl_cov_ratio", PolicyLossConfig.kl_cov_ratio, lambda v: v > 0, "> 0",
                          key),
            checked_value(config, "policy_loss.ppo_kl_coef", PolicyLossConfig.ppo_kl_coef, lambda v: v >= 0, ">= 0",
                          key))


@register_policy_loss("kl_cov", needs=checked_at_start(kl_cov_settings))
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, global_batch_info=None, *, rollout_is_weights=None):
    """KL-Cov: w (-A r + ppo_kl_coef |log r| on the n = max(1, int(kl_cov_ratio x
    unmasked tokens)) unmasked tokens of largest covariance (A - mean A)(log pi - mean log pi)), no clipping, no
    log-ratio clamp. Its one metric, as verl's: ppo_kl = mean(|log r|) (verl's value under that name)."""
    share, coef = kl_cov_settings(config)
    log_ratio = log_prob - old_log_prob
    valid = torch.nonzero(response_mask.reshape(-1) > 0).squeeze(-1)
    penalized = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
    if len(valid):
        valid_advantages, valid_log_probs = advantages.reshape(-1)[valid].detach(), log_prob.detach().reshape(-1)[valid]
        covariance = (valid_advantages - valid_advantages.mean()) * (valid_log_probs - valid_log_probs.mean())
        penalized[valid[torch.topk(covariance, max(1, int(len(valid) * share))).indices]] = True
    penalized = penalized.view_as(advantages)
    pg_losses = -advantages * torch.exp(log_ratio)
    pg_losses = torch.where(penalized, pg_losses + coef * log_ratio.abs(), pg_losses)
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, global_batch_info, rollout_is_weights)
    return pg_loss, {"ppo_kl": ops.masked_mean(log_ratio.abs(), response_mask).detach()}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, global_batch_info=None, *, rollout_is_weights=None):
    """GMPO: per sequence -W mean_t(A) exp(mean_t(sign(A) min(sign(A) log r, sign(A) clip(log r, -clip_ratio_low,
    clip_ratio_high)))), W = exp(mean_t log(w + 1e-10)) (1 without w), averaged over the sequences, an empty one
    counting 0 (over the global batch's rows with global_batch_info); loss_agg_mode is not used.
    pg_clipfrac = mean(log r clipped and A > 0), pg_clipfrac_lower = mean(log r clipped and A < 0),
    ppo_kl = mean(-log r)."""
    clip = clip_ratios(config)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clipped = torch.clamp(log_ratio, -clip["clip_ratio_low"], clip["clip_ratio_high"])
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * clipped)
    lengths = response_mask.sum(-1)
    seq_ratio = torch.exp(ops.masked_sum(log_ratio_min, response_mask, axis=-1) / (lengths + 1e-8))
    seq_advantage = ops.masked_sum(advantages, response_mask, axis=-1) / (lengths + 1e-8)
    seq_losses = (-seq_advantage * seq_ratio)[:, None]
    if rollout_is_weights is not None:  # verl: times the weights' geometric mean over the sequence's tokens
        check_same_shape("log_prob", log_prob, rollout_is_weights=rollout_is_weights)
        seq_losses = seq_losses * torch.exp(
            ops.masked_sum(torch.log(rollout_is_weights + 1e-10), response_mask, axis=-1) / (lengths + 1e-8))[:, None]
    # verl takes torch.mean over the micro-batch's rows (empty rows counted), not the global batch's mean
    pg_loss = ops.agg_loss(seq_losses, (lengths > 0).to(seq_losses.dtype)[:, None], "seq-mean-token-sum",
                           global_batch_info=global_batch_info)
    was_clipped = log_ratio != clipped
    return pg_loss, _metrics(_fraction(was_clipped & (advantages > 0), response_mask),
                             _fraction(was_clipped & (advantages < 0), response_mask),
                             ops.masked_mean(-log_ratio, response_mask))


def dro_beta(config, key: str = "") -> float:
    """policy_loss.dro_beta, required (> 0)."""
    return checked_value(config, "policy_loss.dro_beta", PolicyLossConfig.dro_beta, lambda v: v > 0,
                         "> 0 for loss_mode=dro", key)


@register_policy_loss("dro", needs=checked_at_start(dro_beta))
def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                            global_batch_info=None, *, rollout_is_weights=None):
    """DRO: -w (A log pi - dro_beta / 2 (log r)^2), policy_loss.dro_beta required (> 0). Its one metric, as
    verl's: ppo_kl = mean(-log r)."""
    beta = dro_beta(config)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, global_batch_info, rollout_is_weights)
    return pg_loss, {"ppo_kl": ops.masked_mean(-log_ratio, response_mask).detach()}


ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _threshold(spec, key: str, pair: bool) -> tuple:
    """A positive number, or where `pair` also a "lower_upper" string, -> (lower or None, upper)."""
    parts = spec.strip().split("_", 1) if isinstance(spec, str) else [spec]
    try:
        if isinstance(spec, bool) or (len(parts) == 2 and not pair):
            raise ValueError
        values = [float(part) for part in parts]
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a positive number{' or a lower_upper string' if pair else ''}, "
                         f"got {spec!r}") from None
    lower, upper = (None, values[0]) if len(values) == 1 else values
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}: thresholds must be positive, lower <= upper, got {spec!r}")
    return lower, upper


def _rejection_thresholds(options: list, spec) -> list:
    """(lower log-ratio bound or None, upper bound) per rollout_rs option: one spec shared, or one per option."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{key}: required when rollout_rs is set")
    specs = [part.strip() for part in spec.split(",") if part.strip()] if isinstance(spec, str) else [spec]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{key}: one threshold for all {len(options)} rollout_rs options or one each, got {spec!r}")
    bounds = []
    for option, option_spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        lower, upper = _threshold(option_spec, f"{key} ({option})", pair=option.endswith("k1"))
        # k1 bounds are on the ratio pi_rollout / pi, compared in log space; a lone bound U means [1/U, U]
        bounds.append((math.log(1.0 / upper if lower is None else lower), math.log(upper)) if option.endswith("k1")
                      else (None, upper))
    return bounds


def rollout_correction_settings(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None,
                                rollout_rs_threshold=None) -> tuple:
    """The settings of rollout_correction, checked: ((lower or None, upper) IS bounds, or None with IS off;
    [(rollout_rs option, (lower log-ratio bound or None, upper bound)), ...]). Run at start (pyrl.trainer.checks)
    and by each call, so a bad value stops the run before any worker starts."""
    bounds = None
    if rollout_is is not None and rollout_is_threshold is not None:
        if rollout_is not in ("token", "sequence"):
            raise ValueError(f"algorithm.rollout_correction.rollout_is: expected token, sequence or None, got "
                             f"{rollout_is!r}")
        bounds = _threshold(rollout_is_threshold, "algorithm.rollout_correction.rollout_is_threshold", pair=True)
    rejections = []
    if rollout_rs is not None:
        options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
        unknown = [option for option in options if option not in ROLLOUT_RS_OPTIONS]
        if not options or unknown:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs: unknown option(s) {unknown or rollout_rs!r}, "
                             f"expected a comma-separated list of {', '.join(ROLLOUT_RS_OPTIONS)}")
        rejections = list(zip(options, _rejection_thresholds(options, rollout_rs_threshold)))
    return bounds, rejections


def rollout_correction(log_ratio, response_mask, rollout_is=None, rollout_is_threshold=2.0,
                       rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None):
    """verl's compute_rollout_correction_and_rejection_mask, for log_ratio = log pi - log pi_rollout (no gradient):
    (IS weights or None, keep mask (1 = not rejected), metrics "rollout_corr/<name>", each a token mean).

    IS (rollout_is "token" | "sequence", off when it or rollout_is_threshold is None): w = exp(clamp(log ratio, +-20))
    per token, or exp(clamp(sum_t log ratio, +-20)) per sequence, 0 where masked; a threshold U truncates (TIS:
    min(w, U)), "L_U" zeroes w outside [L, U] (IcePop); rollout_is_batch_normalize divides w by its mean (over the
    tokens, or the sequences), over this input (verl all-reduces it across data-parallel ranks).
    RS (rollout_rs: comma-separated options, all must pass): with l = clamp(log ratio, +-20), k1 = -l, k2 = l^2 / 2,
    k3 = exp(l) - 1 - l per token; token_kN judges each token, seq_{sum,mean,max}_kN the whole sequence by the sum /
    mean / max over its tokens; k1 options keep log L <= k1 <= log U ("L_U", or U alone for [1/U, U]), the others
    keep kN <= U. rollout_rs_threshold: one threshold for all options, or one per option (comma-separated)."""
    bounds, rejections = rollout_correction_settings(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold)
    mask = response_mask.to(log_ratio.dtype)
    lengths = mask.sum(-1)
    metrics = {"kl": ops.masked_mean(-log_ratio, mask),
               "k3_kl": ops.masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
               "chi2_token": ops.masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask)
               - 1.0}
    weights = None
    if bounds is not None:
        lower, upper = bounds
        per_token = log_ratio if rollout_is == "token" else ops.masked_sum(log_ratio, mask, axis=-1)[:, None]
        raw = torch.exp(per_token.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask
        inside = (raw >= lower) & (raw <= upper) if lower is not None else None
        weights = raw.clamp(max=upper) if lower is None else torch.where(inside, raw, torch.zeros_like(raw))
        metrics["rollout_is_mean"] = ops.masked_mean(weights, mask)
        if lower is not None:
            metrics["rollout_is_oob_ratio"] = _fraction(~inside, mask)
        if rollout_is == "token":
            metrics["rollout_is_ratio_fraction_high"] = _fraction(raw > upper, mask)
            metrics["rollout_is_ratio_fraction_low"] = _fraction(raw < (1.0 / upper if lower is None else lower), mask)
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean = ops.masked_mean(weights, mask)
            else:
                non_empty = (lengths > 0).to(weights.dtype)
                mean = (ops.masked_mean(weights, mask, axis=-1) * non_empty).sum() / non_empty.sum().clamp_min(1e-8)
            weights = weights / mean if mean > 1e-8 else weights
    keep = torch.ones_like(mask)
    if rejections:
        bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        divergences = {"k1": -bounded, "k2": 0.5 * bounded.square(), "k3": torch.exp(bounded) - 1.0 - bounded}
        for option, (lower, upper) in rejections:
            level, kind = option.rsplit("_", 1)
            statistic = divergences[kind]
            if level == "seq_sum":
                statistic = ops.masked_sum(statistic, mask, axis=-1)[:, None].expand_as(mask)
            elif level == "seq_mean":
                statistic = ops.masked_mean(statistic, mask, axis=-1)[:, None].expand_as(mask)
            elif level == "seq_max":
                peak = statistic.masked_fill(mask == 0, float("-inf")).max(-1).values
                statistic = torch.where(lengths > 0, peak, torch.zeros_like(peak))[:, None].expand_as(mask)
            passes = (statistic <= upper) if lower is None else (statistic >= lower) & (statistic <= upper)
            keep = keep * passes.to(keep.dtype)
            metrics[f"rollout_rs_{option}_mean"] = ops.masked_mean(statistic, mask)
            metrics[f"rollout_rs_{option}_masked_fraction"] = _fraction(~passes, mask)
        metrics["rollout_rs_masked_fraction"] = ops.masked_mean(1.0 - keep, mask)
    return weights, keep, {f"rollout_corr/{name}": value.detach() for name, value in metrics.items()}


BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")  # algorithm.rollout_correction.loss_type
# losses whose per-token terms use statistics of the micro-batch they run in (clip_cov's and kl_cov's covariances and
# counts): their update depends on how the mini-batch is cut, so pyrl runs them as configured, never re-cut
MICRO_BATCH_STATISTICS = ("clip_cov", "kl_cov")


def bypass_settings(config) -> RolloutCorrectionConfig:
    """bypass_mode's settings (actor.policy_loss.rollout_correction); a plain dict (tests, other trainers): the keys
    it lacks take verl's defaults."""
    settings = config_value(config, "policy_loss.rollout_correction", {})
    return RolloutCorrectionConfig(**settings) if isinstance(settings, dict) else settings


def uses_micro_batch_statistics(actor_config) -> bool:
    """Whether the actor's loss reads statistics of each micro-batch (MICRO_BATCH_STATISTICS, or bypass_mode with
    rollout_is_batch_normalize: the IS weights' mean over the micro-batch), so that a different cut changes it."""
    mode = config_value(actor_config, "policy_loss.loss_mode", "vanilla")
    return mode in MICRO_BATCH_STATISTICS or (
        mode == "bypass_mode" and bool(bypass_settings(actor_config).rollout_is_batch_normalize))


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, global_batch_info=None, *, rollout_is_weights=None):
    """Bypass mode: old_log_prob is the rollout's log-probs. rollout_correction (algorithm.rollout_correction's
    rollout_is / rollout_rs keys) of log r = log pi - log pi_rollout gives IS weights w and a rejection mask, then by
    loss_type: "ppo_clip" (default) vanilla PPO on the unrejected tokens, without w (r already is the IS ratio);
    "reinforce" -sg(w) A log pi (w = 1 without rollout_is) on them, its one metric (as verl) ppo_kl =
    mean(log pi_rollout - log pi). Plus the rollout_corr/<name> metrics. rollout_is_weights is ignored (as verl)."""
    settings = bypass_settings(config)
    if settings.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type: expected one of {BYPASS_LOSS_TYPES}, "
                         f"got {settings.loss_type!r}")
    with torch.no_grad():
        weights, keep, correction_metrics = rollout_correction(
            log_prob.detach() - old_log_prob, response_mask, settings.rollout_is, settings.rollout_is_threshold,
            settings.rollout_is_batch_normalize, settings.rollout_rs, settings.rollout_rs_threshold)
    mask = response_mask * keep
    if settings.loss_type == "ppo_clip":
        pg_loss, metrics = _ppo("vanilla", old_log_prob, log_prob, advantages, mask, loss_agg_mode, config,
                                global_batch_info)
    else:
        pg_losses = -advantages * log_prob * (1.0 if weights is None else weights)
        pg_loss = ops.agg_loss(pg_losses, mask, loss_agg_mode, global_batch_info=global_batch_info)
        metrics = {"ppo_kl": ops.masked_mean(old_log_prob - log_prob, mask).detach()}
    return pg_loss, {**metrics, **correction_metrics}
