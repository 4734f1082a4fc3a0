"""verl 0.9.1's policy losses sapo, clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl and bypass_mode against float64
transcriptions of verl's code (trainer/ppo/core_algos.py, trainer/ppo/rollout_corr_helper.py): loss, metrics and
d loss / d log_prob. A reference returns verl's per-token loss matrix, aggregated here with pyrl.ops.agg_loss (tested
against verl's agg_loss in tests/ops), except where the loss fixes its own aggregation (sapo, geo_mean). Every loss
also with the trainer's rollout-correction weights (rollout_is_weights), applied as verl applies them; vanilla, gspo,
gpg and cispo (pyrl.ops.ppo_policy_loss, float32) only with them (tests/ops covers them without)."""

import dataclasses
import math

import pytest
import torch

from pyrl import ops
from pyrl.algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from pyrl.config import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig

NEW_LOSSES = ("sapo", "clip_cov", "kl_cov", "geo_mean", "dro", "dppo_tv", "dppo_kl", "bypass_mode")
SHAPES = [(7, 13), (3, 1), (1, 5)]  # odd sizes, length-1 responses, one row


def vmean(values, mask, axis=None):  # verl_F.masked_mean
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def vsum(values, mask, axis=None):  # verl_F.masked_sum
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis)


def make_inputs(b, t):
    """float64 (old_log_prob, log_prob, advantages, mask): ratios on both sides of the clip ranges, a few beyond the
    +-20 log-ratio clamp, mixed-sign token advantages and sequence-level ones, an all-masked row and a length-1 row."""
    logp = -torch.rand(b, t, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, dtype=torch.float64) * 0.4
    adv = torch.randn(b, t, dtype=torch.float64)
    mask = (torch.rand(b, t) > 0.2).double()
    mask[0, 0] = 1.0
    if b >= 3:
        adv[1] = -1.5  # a sequence-level (GRPO-like) advantage
        mask[2] = 0.0  # an all-masked row
        if t > 1:
            mask[1, 1:] = 0.0  # a length-1 response
    if b * t > 20:
        old[0, 1], old[0, 2] = logp[0, 1] + 30.0, logp[0, 2] - 30.0
    return old, logp, adv, mask


def make_weights(shape, seed=0):
    """Random positive rollout_is_weights, some 0 (IcePop's out-of-bounds tokens), some above 1, on masked tokens too;
    drawn from their own generator, not to move the global seed."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(shape, generator=generator, dtype=torch.float64) * 2.5
    return torch.where(torch.rand(shape, generator=generator) < 0.25, 0.0, weights)


def weighted(pg_losses, rollout_is_weights):  # verl: "if rollout_is_weights is not None: pg_losses = pg_losses * ..."
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def actor_config(**policy_loss):
    extra = {k: policy_loss.pop(k) for k in ("tau_pos", "tau_neg", "clip_ratio_c") if k in policy_loss}
    return ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=PolicyLossConfig(**policy_loss), **extra)


# ---- verl 0.9.1, transcribed (per-token loss matrix, metrics) ----

def verl_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return weighted(-gates * adv, rollout_is_weights), {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
                                                        "ppo_kl": vmean(-negative_approx_kl, mask)}


def verl_dppo(old, logp, adv, mask, kind, low=0.2, high=0.28, clip_ratio_c=3.0, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= high
        valid_negative_mask = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    valid_mask = torch.where(adv > 0, valid_positive_mask, valid_negative_mask).detach().double()
    pg_losses = weighted(-adv * truncated_ratio * logp * valid_mask, rollout_is_weights)
    return pg_losses, {"pg_clipfrac": vmean(1.0 - valid_mask, mask),
                       "pg_clipfrac_lower": vmean((ratio > clip_ratio_c).double() * valid_mask, mask),
                       "ppo_kl": vmean(-negative_approx_kl, mask)}


def verl_clip_cov(old, logp, adv, mask, clip_cov_ratio, clip_cov_lb, clip_cov_ub, low=0.2, high=0.28,
                  rollout_is_weights=None):
    negative_approx_kl = logp - old
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = vmean(-negative_approx_kl, mask)
    pg_losses1 = -adv * ratio
    corr = torch.ones_like(adv)
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (adv - vmean(adv, mask)) * (logp - vmean(logp.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    return pg_losses, {"pg_clipfrac": vmean((corr == 0).double(), mask), "ppo_kl": ppo_kl}


def verl_kl_cov(old, logp, adv, mask, kl_cov_ratio, ppo_kl_coef, rollout_is_weights=None):
    negative_approx_kl = logp - old
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = vmean(negative_approx_kl.abs(), mask)
    pg_losses1 = -adv * ratio
    pg_losses_kl = -adv * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = adv[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = logp[all_valid].detach().reshape(-1).cpu()
    if min(kl_cov_ratio, len(all_valid_adv)) != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
        rows, cols = large_cov_idxs // adv.shape[1], large_cov_idxs % adv.shape[1]
        pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    pg_losses = weighted(pg_losses, rollout_is_weights)
    return pg_losses, {"ppo_kl": ppo_kl_abs}


def verl_geo_mean(old, logp, adv, mask, low=0.2, high=0.28, rollout_is_weights=None):
    """verl's loss: torch.mean over the rows (pyrl: over the non-empty rows, so compare on those)."""
    negative_approx_kl = logp - old
    ppo_kl = vmean(-negative_approx_kl, mask)
    sgn_advantage = torch.sign(adv)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -low, high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (adv * mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    return pg_losses, {"pg_clipfrac": vmean((clipped * (adv > 0)).double(), mask),
                       "pg_clipfrac_lower": vmean((clipped * (adv < 0)).double(), mask), "ppo_kl": ppo_kl}


def verl_dro(old, logp, adv, mask, beta, rollout_is_weights=None):
    log_ratio = logp - old
    pg_losses = weighted(-(logp * adv - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    return pg_losses, {"ppo_kl": vmean(-log_ratio, mask)}


def verl_vanilla(old, logp, adv, mask, low=0.2, high=0.28, clip_ratio_c=3.0, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = weighted(torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1), rollout_is_weights)
    return pg_losses, {"pg_clipfrac": vmean(torch.gt(pg_losses2, pg_losses1).double(), mask),
                       "pg_clipfrac_lower": vmean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).double(), mask),
                       "ppo_kl": vmean(-negative_approx_kl, mask)}


def verl_gspo(old, logp, adv, mask, low=0.2, high=0.28, rollout_is_weights=None):
    negative_approx_kl = logp - old
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = logp - logp.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -adv * seq_importance_ratio
    pg_losses2 = -adv * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    pg_losses = weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    return pg_losses, {"pg_clipfrac": vmean(torch.gt(pg_losses2, pg_losses1).double(), mask), "pg_clipfrac_lower": 0.0,
                       "ppo_kl": vmean(-negative_approx_kl, mask)}


def verl_gpg(old, logp, adv, mask, rollout_is_weights=None):
    return weighted(-logp * adv, rollout_is_weights), {}


def verl_cispo(old, logp, adv, mask, low=0.2, high=0.28, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = weighted(-clipped_ratio.detach() * adv * logp, rollout_is_weights)
    return pg_losses, {"pg_clipfrac": vmean((ratio != clipped_ratio).double(), mask), "pg_clipfrac_lower": 0.0,
                       "ppo_kl": vmean(-negative_approx_kl, mask)}


def verl_rollout_correction(log_ratio, mask, rollout_is=None, is_upper=2.0, is_lower=None,
                            batch_normalize=False, rs=()):
    """compute_rollout_correction_and_rejection_mask with thresholds parsed: rs = [(option, lower, upper)] with k1
    bounds as ratios. Returns (weights or None, modified mask, the metrics pyrl reports)."""
    metrics = {"kl": vmean(-log_ratio, mask), "k3_kl": vmean(torch.exp(log_ratio) - log_ratio - 1, mask),
               "chi2_token": vmean(torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0)).square(), mask) - 1.0}
    weights = None
    if rollout_is is not None:
        if rollout_is == "token":
            raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
        else:
            raw = torch.exp(torch.clamp(vsum(log_ratio, mask, axis=-1).unsqueeze(-1),
                                        min=-20.0, max=20.0)).expand_as(log_ratio)
        raw = raw * mask
        if is_lower is None:
            weights = raw.clamp(max=is_upper)
        else:
            weights = torch.where((raw >= is_lower) & (raw <= is_upper), raw, torch.zeros_like(raw))
            metrics["rollout_is_oob_ratio"] = vmean(((raw < is_lower) | (raw > is_upper)).double(), mask)
        metrics["rollout_is_mean"] = vmean(weights, mask)
        if rollout_is == "token":
            lower = 1.0 / is_upper if is_lower is None else is_lower
            metrics["rollout_is_ratio_fraction_high"] = vmean((raw > is_upper).double(), mask)
            metrics["rollout_is_ratio_fraction_low"] = vmean((raw < lower).double(), mask)
        if batch_normalize:
            if rollout_is == "token":
                weights_mean = vmean(weights, mask)
            else:
                seq_weights = vmean(weights, mask, axis=-1)
                seq_mask = (mask.sum(dim=-1) > 0).double()
                weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
            if weights_mean > 1e-8:
                weights = weights / weights_mean
    combined_mask = torch.ones_like(mask)
    if rs:
        log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
        token_k = {"k1": -log_ratio_safe, "k2": 0.5 * log_ratio_safe**2,
                   "k3": torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe}
        for option, lower, upper in rs:
            stat = token_k[option[-2:]]
            if option.startswith("seq_sum"):
                stat = vsum(stat, mask, axis=-1).unsqueeze(-1).expand_as(mask)
            elif option.startswith("seq_mean"):
                stat = vmean(stat, mask, axis=-1).unsqueeze(-1).expand_as(mask)
            elif option.startswith("seq_max"):
                max_values = stat.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
                stat = torch.where(max_values == float("-inf"),
                                   torch.zeros_like(max_values), max_values).unsqueeze(-1).expand_as(mask)
            if option.endswith("k1"):
                keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
            else:
                keep = stat <= upper
            combined_mask = combined_mask * keep.double()
            metrics[f"rollout_rs_{option}_mean"] = vmean(stat, mask)
            metrics[f"rollout_rs_{option}_masked_fraction"] = vmean(1 - keep.double(), mask)
        metrics["rollout_rs_masked_fraction"] = vmean(1 - combined_mask, mask)
    return weights, mask * combined_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def verl_bypass(old, logp, adv, mask, loss_type, **correction):
    with torch.no_grad():
        weights, effective_mask, metrics = verl_rollout_correction(logp.detach() - old, mask, **correction)
    if loss_type == "reinforce":
        pg_losses = -adv * logp * weights if weights is not None else -adv * logp
        base = {"ppo_kl": vmean(-(logp - old), effective_mask)}
    else:
        pg_losses, base = verl_vanilla(old, logp, adv, effective_mask)
    return pg_losses, effective_mask, {**base, **metrics}


# ---- comparison ----

def check(name, config, reference, shape, loss_agg_mode="token-mean", global_batch_info=None, atol=1e-9, seed=None,
          weights=False, magnitude=None):
    """pyrl's loss `name` on fresh float64 inputs vs reference(old, logp, adv, mask) -> (loss, metrics); with weights,
    both given the same make_weights as rollout_is_weights. magnitude (a float32 kernel's): a reference of the same
    form aggregating the per-token losses' absolute values, which scales the loss's tolerance: a sum of terms of both
    signs keeps float32's error relative to the terms, not to the sum (measured: <= 2.5e-7 of it over 2,880 draws,
    where the error relative to the loss reached 1.2e-4, and a fixed 2e-6 failed once in CI)."""
    old, logp, adv, mask = make_inputs(*shape)
    logp = logp.requires_grad_()
    extra = {"rollout_is_weights": make_weights(shape)} if weights else {}
    if seed is not None:
        torch.manual_seed(seed)
    loss, metrics = get_policy_loss_fn(name)(old, logp, adv, mask, loss_agg_mode, config, global_batch_info, **extra)
    lp64 = logp.detach().clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    loss64, metrics64 = reference(old, lp64, adv, mask, **extra)
    assert loss.dim() == 0 and set(metrics) == set(metrics64)  # the names verl 0.9.1's loss reports
    loss_atol = atol
    if magnitude is not None:
        with torch.no_grad():
            loss_atol = atol * max(1.0, float(magnitude(old, lp64.detach(), adv, mask, **extra)[0]))
    torch.testing.assert_close(loss.double(), loss64.double(), atol=loss_atol, rtol=atol)
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
        torch.testing.assert_close(value.double(), torch.as_tensor(metrics64[key], dtype=torch.float64),
                                   atol=atol, rtol=atol, msg=lambda m: f"{key}: {m}")
    (grad,) = torch.autograd.grad(loss, logp)
    (grad64,) = torch.autograd.grad(loss64, lp64)
    torch.testing.assert_close(grad.double(), grad64, atol=atol, rtol=atol)
    return old, logp.detach(), adv, mask, grad


def absolute(verl_fn):
    """verl_fn with its per-token losses' absolute values (the size of what a loss aggregation sums)."""
    def fn(*args, **kwargs):
        pg_losses, metrics = verl_fn(*args, **kwargs)
        return pg_losses.abs(), metrics
    return fn


def aggregated(verl_fn, loss_agg_mode, global_batch_info, **kwargs):
    def reference(old, logp, adv, mask, rollout_is_weights=None):
        pg_losses, metrics = verl_fn(old, logp, adv, mask, rollout_is_weights=rollout_is_weights, **kwargs)
        return ops.agg_loss(pg_losses, mask, loss_agg_mode, global_batch_info=global_batch_info), metrics
    return reference


GLOBAL_INFOS = [None, {"batch_num_tokens": 150.0, "global_batch_size": 9.0, "dp_size": 2}]
TOKEN_LOSSES = {
    "dppo_tv": (actor_config(), dict(verl_fn=verl_dppo, kind="tv")),
    "dppo_tv_dict_config": ({"clip_ratio": 0.25},
                            dict(verl_fn=verl_dppo, kind="tv", low=0.25, high=0.25, clip_ratio_c=20.0)),
    "dppo_kl": (actor_config(clip_ratio_c=1.2), dict(verl_fn=verl_dppo, kind="kl", clip_ratio_c=1.2)),
    "dro": (actor_config(dro_beta=0.3), dict(verl_fn=verl_dro, beta=0.3)),
    "kl_cov": (actor_config(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
               dict(verl_fn=verl_kl_cov, kl_cov_ratio=0.2, ppo_kl_coef=0.5)),
    "clip_cov": (actor_config(clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=0.5),
                 dict(verl_fn=verl_clip_cov, clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=0.5)),
}


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("global_batch_info", GLOBAL_INFOS)
@pytest.mark.parametrize("loss_agg_mode", ops.LOSS_AGG_MODES)
@pytest.mark.parametrize("case", sorted(TOKEN_LOSSES))
def test_token_losses_match_verl(case, loss_agg_mode, global_batch_info, shape, weights):
    config, kwargs = TOKEN_LOSSES[case]
    reference = aggregated(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info, **kwargs)
    check(case.split("_dict")[0], config, reference, shape, loss_agg_mode, global_batch_info,
          seed=1234, weights=weights)


# the kernel is float32
PPO_FAMILY = [(name, mode) for name in ("vanilla", "gpg", "cispo", "gspo") for mode in ops.LOSS_AGG_MODES]
PPO_FAMILY_REFERENCES = {"vanilla": verl_vanilla, "gpg": verl_gpg, "cispo": verl_cispo, "gspo": verl_gspo}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("global_batch_info", GLOBAL_INFOS)
@pytest.mark.parametrize("name, loss_agg_mode", PPO_FAMILY)
def test_ppo_family_with_rollout_is_weights_matches_verl(name, loss_agg_mode, global_batch_info, shape):
    reference = aggregated(PPO_FAMILY_REFERENCES[name], loss_agg_mode, global_batch_info)
    magnitude = aggregated(absolute(PPO_FAMILY_REFERENCES[name]), loss_agg_mode, global_batch_info)
    check(name, actor_config(), reference, shape, loss_agg_mode, global_batch_info, atol=2e-6, weights=True,
          magnitude=magnitude)


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("global_batch_info", GLOBAL_INFOS)
@pytest.mark.parametrize("loss_agg_mode", ops.LOSS_AGG_MODES)
def test_sapo_matches_verl_and_is_always_seq_mean_token_mean(loss_agg_mode, global_batch_info, shape, weights):
    def reference(old, logp, adv, mask, rollout_is_weights=None):
        pg_losses, metrics = verl_sapo(old, logp, adv, mask, tau_pos=1.5, tau_neg=2.5,
                                       rollout_is_weights=rollout_is_weights)
        lengths = mask.sum(-1)
        seq_losses = (pg_losses * mask).sum(-1) / (lengths + 1e-8)
        non_empty = (lengths > 0).double()
        if global_batch_info is None:
            return (seq_losses * non_empty).sum() / non_empty.sum(), metrics
        return ((seq_losses * non_empty).sum() / global_batch_info["global_batch_size"] * global_batch_info["dp_size"],
                metrics)

    check("sapo", actor_config(tau_pos=1.5, tau_neg=2.5), reference, shape, loss_agg_mode, global_batch_info,
          weights=weights)


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("global_batch_info", GLOBAL_INFOS)
@pytest.mark.parametrize("loss_agg_mode", ops.LOSS_AGG_MODES)
def test_geo_mean_matches_verl_on_the_non_empty_rows(loss_agg_mode, global_batch_info, shape, weights):
    old, logp, adv, mask = make_inputs(*shape)
    logp = logp.requires_grad_()
    w = make_weights(shape) if weights else None
    loss, metrics = get_policy_loss_fn("geo_mean")(old, logp, adv, mask, loss_agg_mode, actor_config(),
                                                   global_batch_info, rollout_is_weights=w)
    rows = mask.sum(-1) > 0
    lp64 = logp.detach()[rows].clone().requires_grad_()
    seq_losses, metrics64 = verl_geo_mean(old[rows], lp64, adv[rows], mask[rows],
                                          rollout_is_weights=None if w is None else w[rows])
    # verl: torch.mean(seq_losses) over the micro-batch; the global batch's mean here
    loss64 = seq_losses.mean() if global_batch_info is None else \
        seq_losses.sum() / global_batch_info["global_batch_size"] * global_batch_info["dp_size"]
    torch.testing.assert_close(loss, loss64)
    for key in metrics64:
        torch.testing.assert_close(metrics[key].double(), metrics64[key])
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad[rows], torch.autograd.grad(loss64, lp64)[0])
    assert (grad[~rows] == 0).all()


@pytest.mark.parametrize("name", ["geo_mean", "sapo", "dppo_kl", "dro"])
def test_micro_batches_with_global_batch_info_sum_to_the_batch_loss(name):
    """verl's geo_mean ignores global_batch_info (torch.mean per micro-batch); pyrl's shares add up."""
    old, logp, adv, mask = make_inputs(8, 9)
    config = actor_config(dro_beta=0.2)
    mode = "token-mean" if name in ("dppo_kl", "dro") else "seq-mean-token-mean"
    info = {"batch_num_tokens": mask.sum().item(), "global_batch_size": (mask.sum(-1) > 0).sum().item(), "dp_size": 1}
    whole, _ = get_policy_loss_fn(name)(old, logp, adv, mask, mode, config, None)
    halves = [get_policy_loss_fn(name)(old[s], logp[s], adv[s], mask[s], mode, config, info)[0]
              for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(sum(halves), whole)


BYPASS_CASES = {
    "ppo_clip_plain": ({}, dict(loss_type="ppo_clip")),
    "reinforce_no_is": ({"loss_type": "reinforce"}, dict(loss_type="reinforce")),
    "reinforce_token_tis": ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.3},
                            dict(loss_type="reinforce", rollout_is="token", is_upper=1.3)),
    "reinforce_sequence_icepop_normalized": (
        {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": "0.5_3.0",
         "rollout_is_batch_normalize": True},
        dict(loss_type="reinforce", rollout_is="sequence", is_upper=3.0, is_lower=0.5, batch_normalize=True)),
    "reinforce_token_normalized_rs_token_k1": (
        {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "2",
         "rollout_is_batch_normalize": True, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.5"},
        dict(loss_type="reinforce", rollout_is="token", is_upper=2.0, batch_normalize=True,
             rs=[("token_k1", 0.7, 1.5)])),
    "ppo_clip_rs_chain": (
        {"rollout_is": "token", "rollout_rs": "seq_mean_k3,token_k1,seq_max_k2, seq_sum_k1",
         "rollout_rs_threshold": "0.05, 1.4, 0.3, 0.2_4"},
        dict(loss_type="ppo_clip", rollout_is="token", rs=[("seq_mean_k3", None, 0.05), ("token_k1", 1 / 1.4, 1.4),
                                                           ("seq_max_k2", None, 0.3), ("seq_sum_k1", 0.2, 4.0)])),
    "reinforce_shared_rs_threshold": (
        {"loss_type": "reinforce",
         "rollout_rs": "token_k2,seq_sum_k2,seq_mean_k2,token_k3,seq_sum_k3,seq_max_k3,seq_mean_k1",
         "rollout_rs_threshold": 1.6},
        dict(loss_type="reinforce",
             rs=[(o, None, 1.6) for o in ("token_k2", "seq_sum_k2", "seq_mean_k2", "token_k3", "seq_sum_k3",
                                          "seq_max_k3")] + [("seq_mean_k1", 1 / 1.6, 1.6)])),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss_agg_mode", ops.LOSS_AGG_MODES)
@pytest.mark.parametrize("case", sorted(BYPASS_CASES))
def test_bypass_mode_matches_verl(case, loss_agg_mode, shape):
    settings, kwargs = BYPASS_CASES[case]
    config = actor_config(rollout_correction={**dataclasses.asdict(RolloutCorrectionConfig()), **settings})

    def reference(old, logp, adv, mask):
        pg_losses, effective_mask, metrics = verl_bypass(old, logp, adv, mask, **kwargs)
        return ops.agg_loss(pg_losses, effective_mask, loss_agg_mode), metrics

    # ppo_clip runs pyrl's float32 PPO kernel
    check("bypass_mode", config, reference, shape, loss_agg_mode,
          atol=1e-9 if kwargs["loss_type"] == "reinforce" else 2e-6)


def test_bypass_mode_rejects_and_weights_what_it_should():
    """Hand-made: token 0 within every bound, token 1 beyond token_k1's ratio bound, row 1 beyond seq_sum_k2."""
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 1.0, -0.2], [0.65, 0.65, 0.65]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    settings = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.2,
                "rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "0.5_2.0,0.6"}
    loss, metrics = get_policy_loss_fn("bypass_mode")(rollout, logp, adv, mask, "seq-mean-token-sum",
                                                      {"policy_loss": {"rollout_correction": settings}})
    # row 0: token 1 (k1 = -1 < log 0.5) rejected, sum of l^2 / 2 = 0.525 <= 0.6; row 1: 3 x 0.65^2 / 2 = 0.634 > 0.6,
    # rejected whole (and then not counted by the sequence mean)
    (grad,) = torch.autograd.grad(loss, logp)
    weights = torch.exp(torch.tensor([0.1, -0.2], dtype=torch.float64)).clamp(max=1.2)
    expected = torch.zeros(2, 3, dtype=torch.float64)
    expected[0, [0, 2]] = -weights
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(metrics["rollout_corr/rollout_rs_masked_fraction"].double(),
                               torch.tensor(4 / 6, dtype=torch.float64))


def test_clip_cov_cuts_the_known_candidates():
    """Covariance (A - mean A)(log pi - mean log pi): only the tokens with it in (lb, ub) and unclipped are candidates;
    a ratio that asks for more cuts exactly them, a smaller one cuts max(1, int(ratio x tokens)) of them."""
    old, logp, adv, mask = make_inputs(6, 10)
    logp = old.clone().requires_grad_()  # r = 1: PPO clips nothing
    cov = (adv - vmean(adv, mask)) * (logp.detach() - vmean(logp.detach(), mask))
    lb, ub = -0.3, 0.4
    candidates = (mask > 0) & (cov > lb) & (cov < ub)
    n_valid = int(mask.sum())
    for ratio, n_cut in [(1.0, int(candidates.sum())), (3.5 / n_valid, 3), (1e-9, 1)]:
        config = actor_config(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
        loss, metrics = get_policy_loss_fn("clip_cov")(old, logp, adv, mask, "token-mean", config)
        (grad,) = torch.autograd.grad(loss, logp)
        cut = (grad == 0) & (mask > 0) & (adv != 0)
        assert int(cut.sum()) == n_cut and bool(candidates[cut].all())
        assert metrics["pg_clipfrac"].item() == pytest.approx(n_cut / n_valid)


def test_kl_cov_penalizes_the_top_covariance_tokens():
    old, logp, adv, mask = make_inputs(6, 10)
    valid = mask > 0
    cov = torch.full_like(adv, -torch.inf)
    cov[valid] = (adv[valid] - adv[valid].mean()) * (logp[valid] - logp[valid].mean())
    n_valid = int(valid.sum())
    for ratio in (1e-9, 4.5 / n_valid, 1.0):
        k = max(1, int(n_valid * ratio))
        top = torch.zeros_like(valid)
        top.view(-1)[cov.view(-1).topk(k).indices] = True
        lp = logp.clone().requires_grad_()
        config = actor_config(kl_cov_ratio=ratio, ppo_kl_coef=0.7)
        loss, _ = get_policy_loss_fn("kl_cov")(old, lp, adv, mask, "seq-mean-token-sum", config)
        (grad,) = torch.autograd.grad(loss, lp)
        (grad_plain,) = torch.autograd.grad(ops.agg_loss(-adv * torch.exp(lp - old), mask, "seq-mean-token-sum"), lp)
        penalized = ~torch.isclose(grad, grad_plain, rtol=0, atol=1e-12)
        assert torch.equal(penalized, top & (lp.detach() != old))


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_all_masked_input_gives_zero_loss_and_the_same_metric_names(name):
    old, logp, adv, mask = make_inputs(4, 6)
    config = actor_config(dro_beta=0.1, rollout_correction={**dataclasses.asdict(RolloutCorrectionConfig()),
                                                            "rollout_is": "token", "rollout_rs": "token_k1,seq_max_k3",
                                                            "rollout_rs_threshold": "2,1"})
    logp = logp.requires_grad_()
    _, metrics = get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", config)
    loss, empty_metrics = get_policy_loss_fn(name)(old, logp, adv, torch.zeros_like(mask), "token-mean", config)
    assert loss.item() == 0.0 and set(empty_metrics) == set(metrics)
    assert all(torch.isfinite(v) for v in empty_metrics.values())
    assert (torch.autograd.grad(loss, logp)[0] == 0).all()


def test_bypass_mode_ignores_rollout_is_weights():
    """verl's bypass_mode computes its own weights from old_log_prob (the rollout's) and ignores the trainer's."""
    old, logp, adv, mask = make_inputs(5, 7)
    for loss_type in ("reinforce", "ppo_clip"):
        config = {"policy_loss": {"rollout_correction": {"loss_type": loss_type, "rollout_is": "token"}}}
        plain, _ = get_policy_loss_fn("bypass_mode")(old, logp, adv, mask, "token-mean", config)
        loss, _ = get_policy_loss_fn("bypass_mode")(old, logp, adv, mask, "token-mean", config,
                                                    rollout_is_weights=make_weights(mask.shape))
        assert torch.equal(loss, plain)


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSS_REGISTRY) - {"bypass_mode"}))
def test_rollout_is_weights_of_the_wrong_shape_are_refused(name):
    old, logp, adv, mask = make_inputs(3, 4)
    for shape in [(3, 5), (3, 1), (4,)]:
        with pytest.raises(ValueError, match=r"rollout_is_weights: shape \(.*\) "
                                             r"does not match log_prob shape \(3, 4\)"):
            get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", actor_config(dro_beta=0.1),
                                     rollout_is_weights=torch.ones(shape, dtype=torch.float64))


def test_registered_with_formula_docstrings():
    for name in NEW_LOSSES:
        doc = POLICY_LOSS_REGISTRY[name].__doc__
        assert doc and "(" in doc.split("\n")[0], f"{name}: its formula opens its docstring"
    with pytest.raises(ValueError, match="Unknown policy loss 'clip-cov'; "
                                         "known: .*bypass_mode.*clip_cov.*dppo_kl.*sapo"):
        get_policy_loss_fn("clip-cov")


def test_config_defaults_are_verl_091s():
    loss = PolicyLossConfig()
    assert (loss.loss_mode, loss.clip_cov_ratio, loss.clip_cov_lb, loss.clip_cov_ub, loss.kl_cov_ratio,
            loss.ppo_kl_coef, loss.dro_beta) == ("vanilla", 0.0002, 1.0, 5.0, 0.0002, 0.1, None)
    assert loss.rollout_correction is None  # filled from algorithm.rollout_correction at start
    assert dataclasses.asdict(RolloutCorrectionConfig()) == {
        "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
        "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}
    assert (ActorConfig().tau_pos, ActorConfig().tau_neg) == (1.0, 1.05)
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(ActorConfig),
                             {"policy_loss": {"loss_mode": "bypass_mode", "kl_cov_ratio": 0.01}})
    assert OmegaConf.to_object(merged).policy_loss.kl_cov_ratio == 0.01


def correcting(**settings):
    return actor_config(rollout_correction=settings)


@pytest.mark.parametrize("name, config, match", [
    ("clip_cov", actor_config(clip_cov_ratio=-0.1), r"policy_loss.clip_cov_ratio: must be a number > 0, got -0.1"),
    ("clip_cov", actor_config(clip_cov_lb=2.0, clip_cov_ub=1.0),
     r"policy_loss.clip_cov_ub: must be a number > policy_loss.clip_cov_lb"),
    ("clip_cov", {"policy_loss": {"clip_cov_lb": "low"}}, r"policy_loss.clip_cov_lb: must be a number"),
    ("kl_cov", actor_config(kl_cov_ratio=0.0), r"policy_loss.kl_cov_ratio: must be a number > 0"),
    ("kl_cov", actor_config(ppo_kl_coef=-1.0), r"policy_loss.ppo_kl_coef: must be a number >= 0"),
    ("dro", actor_config(), r"policy_loss.dro_beta: must be a number > 0 for loss_mode=dro, got None"),
    ("dro", actor_config(dro_beta=-0.5), r"policy_loss.dro_beta"),
    ("sapo", actor_config(tau_pos=0.0), r"tau_pos: must be a number > 0"),
    ("sapo", {"tau_neg": -1}, r"tau_neg: must be a number > 0"),
    ("dppo_tv", {"clip_ratio_c": -3.0}, r"clip_ratio_c: must be a number > 0"),
    ("bypass_mode", correcting(loss_type="ppo"),
     r"rollout_correction.loss_type: expected one of \('ppo_clip', 'reinforce'\)"),
    ("bypass_mode", correcting(rollout_is="tokens"),
     r"rollout_correction.rollout_is: expected token, sequence or None"),
    ("bypass_mode", correcting(rollout_is="token", rollout_is_threshold="3_2"),
     r"thresholds must be positive, lower <= upper"),
    ("bypass_mode", correcting(rollout_is="token", rollout_is_threshold=-2.0), r"rollout_is_threshold"),
    ("bypass_mode", correcting(rollout_is="token", rollout_is_threshold=True),
     r"rollout_is_threshold: expected a positive number"),
    ("bypass_mode", correcting(rollout_rs="token_k9", rollout_rs_threshold=2),
     r"rollout_rs: unknown option\(s\) \['token_k9'\]"),
    ("bypass_mode", correcting(rollout_rs="token_k1"), r"rollout_rs_threshold: required when rollout_rs is set"),
    ("bypass_mode", correcting(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"),
     r"rollout_rs_threshold \(token_k2\): expected a positive number, got '0.1_2'"),
    ("bypass_mode", correcting(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="1,2,3"),
     r"one threshold for all 2 rollout_rs options or one each"),
])
def test_bad_values_name_the_key(name, config, match):
    old, logp, adv, mask = make_inputs(3, 4)
    with pytest.raises(ValueError, match=match):
        get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", config)


def test_actor_update_in_bypass_mode_needs_rollout_log_probs():
    from pyrl.config import ActorRolloutRefConfig
    from pyrl.protocol import DataProto
    from pyrl.workers.actor import ActorRolloutRefWorker

    config = ActorRolloutRefConfig(actor=actor_config(loss_mode="bypass_mode"))
    ones = torch.ones(2, 3, dtype=torch.long)
    data = DataProto.from_dict({"input_ids": ones, "position_ids": ones, "attention_mask": ones,
                                "responses": ones[:, :2], "response_mask": ones[:, :2], "advantages": torch.zeros(2, 2),
                                "old_log_probs": torch.zeros(2, 2)})
    with pytest.raises(KeyError, match="actor.policy_loss.loss_mode=bypass_mode needs the batch's rollout_log_probs"):
        ActorRolloutRefWorker(config, role="actor").update_actor(data)
