"""Masked reductions and loss aggregation, verl's definitions (verl/utils/torch_functional.py and
core_algos.agg_loss). Plain torch: each is one or two reductions that already run at memory speed."""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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
        if mask_sum == 0:
            raise ValueError("mask: the variance needs at least one unmasked element, the mask sums to 0")
        if mask_sum == 1:
            raise ValueError("mask: the unbiased variance needs at least two unmasked elements, the mask sums to 1")
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


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
    """Aggregate a [B, T] per-token loss into a scalar.

    token-mean:              sum(l * m) / (sum(m) + 1e-8)
    seq-mean-token-sum:      mean over non-empty rows of sum_t(l * m)
    seq-mean-token-mean:     mean over non-empty rows of sum_t(l * m) / (sum_t(m) + 1e-8)
    seq-mean-token-sum-norm: sum(l * m) / C, C = loss_scale_factor or T (Dr.GRPO's constant)
    An input with no unmasked token gives 0.

    global_batch_info {"batch_num_tokens": N, "global_batch_size": S, "dp_size": D} makes this one micro-batch's
    share of the whole (data-parallel, gradient-accumulated) batch's aggregate: the means divide by the batch's
    N valid tokens / S non-empty sequences instead of this input's, times D because data-parallel training
    averages gradients over the D ranks. Summing the shares over micro-batches and averaging over ranks gives
    the global token or sequence mean exactly, however the batch was split (verl's engine-path losses).
    """
    _check_pair(loss_mat, loss_mask, "loss_mat")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown mode {loss_agg_mode!r}, expected one of {', '.join(LOSS_AGG_MODES)}")
    dp_size = 1
    if global_batch_info:
        dp_size = global_batch_info.get("dp_size", 1)
        if loss_agg_mode == "token-mean":
            return masked_sum(loss_mat, loss_mask) / max(global_batch_info["batch_num_tokens"], 1) * dp_size
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_mat.dim() < 2:
        raise ValueError(f"loss_mat: {loss_agg_mode} needs [batch, tokens], got shape {tuple(loss_mat.shape)}")
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_scale_factor if loss_scale_factor is not None else loss_mat.shape[-1]
        if not scale > 0:
            raise ValueError(f"loss_scale_factor: must be > 0, got {scale}")
        return seq_sums.sum() / scale * dp_size
    tokens = loss_mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / (tokens + 1e-8)
    non_empty = (tokens > 0).to(seq_sums.dtype)
    if global_batch_info:
        return (seq_sums * non_empty).sum() / max(global_batch_info["global_batch_size"], 1) * dp_size
    return (seq_sums * non_empty).sum() / non_empty.sum().clamp(min=1)
