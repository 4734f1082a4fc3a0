"""Masked reductions and loss aggregation, verl's definitions (verl/utils/torch_functional.py and
core_algos.agg_loss). Plain torch: each is one or two reductions that already run at memory speed."""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_pair(values, mask, name="values"):
    if not isinstance(values, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}/mask: expected torch.Tensors")
    if values.shape != mask.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match {name} shape {tuple(values.shape)}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """sum(values * mask); positions where mask == 0 never contribute, even if they hold NaN/inf."""
    _check_pair(values, mask)
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    total = valid * mask
    return total.sum() if axis is None else total.sum(axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """sum(values * mask) / (sum(mask) + 1e-8): 0 for an all-masked input, as verl."""
    s = masked_sum(values, mask, axis)
    return s / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Masked variance around the masked mean, with Bessel's correction when unbiased."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        check_unbiased_count(float(mask_sum))
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def check_unbiased_count(mask_sum: float) -> None:
    """The unbiased variance divides by mask_sum - 1: refuse a mask summing to 0 or 1, naming it."""
    if mask_sum == 0:
        raise ValueError("mask: the variance needs at least one unmasked element, the mask sums to 0")
    if mask_sum == 1:
        raise ValueError("mask: the unbiased variance needs at least two unmasked elements, the mask sums to 1")


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) with masked mean and unbiased masked variance; every position
    is transformed (verl), the statistics come from the unmasked ones."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    global_batch_info: dict | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss into a scalar (verl 0.9.1's core_algos.agg_loss). With S the number of
    rows holding a valid token and N the number of valid tokens (with global_batch_info: its global_batch_size and
    batch_num_tokens, pyrl's trainers passing every row and the tokens before rejection, as verl 0.9.1's engine):

    token-mean:              sum(l * m) / N
    token-sum:               sum(l * m)
    seq-mean-token-sum:      sum_i sum_t(l * m) / S
    seq-mean-token-mean:     sum_i [sum_t(l * m) / (sum_t(m) + 1e-8)] / S
    seq-mean-token-sum-norm: seq-mean-token-sum / C, C = loss_scale_factor (Dr.GRPO's constant), else
                             global_batch_info["loss_scale_factor"], else T
    An input with no valid token gives 0 (verl divides 0 by 0 there when not given global sizes).

    global_batch_info {"batch_num_tokens": N, "global_batch_size": S, "dp_size": D[, "loss_scale_factor": C]} makes
    this one micro-batch's share of the whole (data-parallel, gradient-accumulated) batch's aggregate: the means
    divide by the batch's N valid tokens / S sequences instead of this input's, times D because
    data-parallel training averages gradients over the D ranks (token-sum too is times D: the sum over the
    whole batch). Summing the shares over micro-batches and averaging over ranks gives the global aggregate
    exactly, however the batch was split.
    """
    _check_pair(loss_mat, loss_mask, "loss_mat")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown mode {loss_agg_mode!r}, expected one of {', '.join(LOSS_AGG_MODES)}")
    info = global_batch_info or {}
    dp_size = info.get("dp_size", 1)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode == "token-mean":
        if global_batch_info:
            return masked_sum(loss_mat, loss_mask) / max(info["batch_num_tokens"], 1) * dp_size
        return masked_mean(loss_mat, loss_mask)
    if loss_mat.dim() < 2:
        raise ValueError(f"loss_mat: {loss_agg_mode} needs [batch, tokens], got shape {tuple(loss_mat.shape)}")
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    tokens = loss_mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / (tokens + 1e-8)
    non_empty = (tokens > 0).to(seq_sums.dtype)
    if global_batch_info:
        loss = (seq_sums * non_empty).sum() / max(info["global_batch_size"], 1) * dp_size
    else:
        loss = (seq_sums * non_empty).sum() / non_empty.sum().clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = next((c for c in (loss_scale_factor, info.get("loss_scale_factor")) if c is not None),
                     loss_mat.shape[-1])
        if not scale > 0:
            raise ValueError(f"loss_scale_factor: must be > 0, got {scale}")
        loss = loss / scale
    return loss
