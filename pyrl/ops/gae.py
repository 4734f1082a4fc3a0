"""Generalized advantage estimation, verl's compute_gae_advantage_return, as one fused scan.

Backwards over t, per sequence, with nextV = lastA = 0 at the end:
    delta_t = r_t + gamma * nextV - V_t
    A'_t    = delta_t + gamma * lam * lastA
    nextV   = m_t * V_t + (1 - m_t) * nextV        (masked positions carry the later values, so
    lastA   = m_t * A'_t + (1 - m_t) * lastA        multi-turn observation tokens are skipped)
    A_t = lastA,  returns_t = A_t + V_t
then advantages = masked_whiten(A, m) over the whole batch (mean/unbiased var over unmasked tokens,
applied to every position), unless whiten=False. No gradient: outputs are detached, as in verl.
"""

from __future__ import annotations

import math

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import (
    as_buffer,
    check_same_shape,
    check_tensor,
    choose_backend,
    float32_contiguous,
    maybe_buffer,
)
from pyrl.ops.masked import check_unbiased_count


def _check_scalar(name, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    return value


def _gae(rewards, values, mask, cu_seqlens, n_seqs, seq_len, gamma, lam, whiten, backend):
    rewards, values = float32_contiguous(rewards), float32_contiguous(values)
    mask = None if mask is None else float32_contiguous(mask)
    if backend == "cpp":
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
        _C.gae(as_buffer(rewards), as_buffer(values), maybe_buffer(mask), maybe_buffer(cu_seqlens), n_seqs, seq_len,
               gamma, lam, whiten, as_buffer(advantages), as_buffer(returns))
        return advantages, returns
    from pyrl.kernels import gae as triton_gae  # lazy: triton is optional (pyrl.kernels imports it)

    advantages, returns, moments = triton_gae.gae(rewards, values, mask, cu_seqlens, n_seqs, seq_len, gamma, lam,
                                                  moments=whiten)
    if whiten:
        advantages = whiten_from_moments(advantages, moments)
    return advantages, returns


def whiten_from_moments(values: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """masked_whiten(values, mask) from per-sequence moments [S, 3] (mask-weighted count, mean, sum of squared
    deviations), merged in float64 (Chan et al.): (values - mean) * rsqrt(unbiased var + 1e-8) at every position.
    The count is read on the host, as masked_var reads the mask's sum, to refuse fewer than two tokens."""
    stats = moments.double()
    count, mean, m2 = stats[:, 0], stats[:, 1], stats[:, 2]
    total = count.sum()
    check_unbiased_count(float(total))
    grand_mean = (count * mean).sum() / total
    var = (m2.sum() + (count * (mean - grand_mean) ** 2).sum()) / (total - 1)
    return (values - grand_mean.float()) * torch.rsqrt(var + 1e-8).float()


def compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=True):
    """(advantages, returns) for padded [B, T] rewards/values/mask, float32; verl's numbers."""
    check_tensor("rewards", rewards)
    check_tensor("values", values)
    check_tensor("mask", mask, floating=False)
    check_same_shape("rewards", rewards, values=values, mask=mask)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected [batch, tokens], got shape {tuple(rewards.shape)}")
    gamma, lam = _check_scalar("gamma", gamma), _check_scalar("lam", lam)
    backend = choose_backend(rewards)
    if backend == "torch":
        adv, ret = reference.compute_gae(rewards, values, mask, gamma, lam, whiten)
        return adv.float(), ret.float()
    b, t = rewards.shape
    return _gae(rewards, values, mask, None, b, t, gamma, lam, whiten, backend)


def _unwrap_packed(name, value, layout):
    """A packed field (pyrl.protocol.PackedTensor, duck-typed so that pyrl.ops stays below pyrl.protocol)
    -> (values, its layout); plain tensors pass through."""
    if isinstance(value, torch.Tensor) or not (hasattr(value, "layout") and hasattr(value, "values")):
        return value, layout  # a tensor, None, or bad input that the checks below report
    if layout is not None and not layout.same_as(value.layout):
        raise ValueError(f"{name}: laid out differently from rewards (different cu_seqlens)")
    return value.values, value.layout


def compute_gae_packed(rewards, values, cu_seqlens=None, gamma=1.0, lam=1.0, mask=None, whiten=True):
    """(advantages, returns) for packed [N] rewards/values with sequence i at
    [cu_seqlens[i], cu_seqlens[i+1]); mask [N] optional (multi-turn observation tokens), float32.
    rewards/values/mask may be PackedTensors (DataProto's packed view): cu_seqlens then comes from their
    layout and the results are PackedTensors in it."""
    original = rewards
    rewards, layout = _unwrap_packed("rewards", rewards, None)
    packed_type = type(original) if rewards is not original else None
    values, layout = _unwrap_packed("values", values, layout)
    mask, layout = _unwrap_packed("mask", mask, layout)
    if cu_seqlens is None:
        if layout is None:
            raise ValueError("cu_seqlens: required unless rewards/values are packed tensors with a layout")
        cu_seqlens = layout.cu_seqlens
    check_tensor("rewards", rewards)
    check_tensor("values", values)
    check_same_shape("rewards", rewards, values=values)
    if mask is not None:
        check_tensor("mask", mask, floating=False)
        check_same_shape("rewards", rewards, mask=mask)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected packed [tokens], got shape {tuple(rewards.shape)}")
    check_tensor("cu_seqlens", cu_seqlens, floating=False)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [B + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(device=rewards.device, dtype=torch.int64).contiguous()
    bounds = cu.cpu() if cu.is_cuda else cu
    if bounds[0] != 0 or bounds[-1] != rewards.numel() or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(
            f"cu_seqlens: must start at 0, be non-decreasing and end at the number of tokens ({rewards.numel()}), "
            f"got {bounds.tolist()[:8]}{'...' if bounds.numel() > 8 else ''}"
        )
    gamma, lam = _check_scalar("gamma", gamma), _check_scalar("lam", lam)
    backend = choose_backend(rewards)
    if backend == "torch":
        adv, ret = reference.compute_gae_packed(rewards, values, cu, gamma, lam, mask, whiten)
        adv, ret = adv.float(), ret.float()
    else:
        adv, ret = _gae(rewards, values, mask, cu, cu.numel() - 1, 0, gamma, lam, whiten, backend)
    if packed_type is not None:
        return packed_type(adv, layout), packed_type(ret, layout)
    return adv, ret
