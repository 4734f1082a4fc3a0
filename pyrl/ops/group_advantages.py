"""Group-relative outcome advantages over samples of the same prompt, as per-sample values [B]
(verl's compute_*_outcome_advantage before the broadcast over tokens). s_i: score, g: i's group,
n_g: group size, mu_g / sigma_g: group mean and unbiased std (a singleton group has mu = 0, sigma = 1).

  grpo:                          (s_i - mu_g) / (sigma_g + eps), or s_i - mu_g if not norm_by_std
  rloo:                          n_g / (n_g - 1) * (s_i - mu_g) = s_i - mean_{j != i} s_j; singleton: s_i
  reinforce_plus_plus_baseline:  s_i - mu_g (the caller whitens over tokens)
  opo:                           s_i - sum_j L_j s_j / sum_j L_j, L = response lengths; singleton or
                                 all-empty group: baseline 0
  grpo_passk:                    the group's first best sample gets (s_max - s_2nd) [/ (sigma_g + eps)],
                                 every other sample 0; groups need >= 2 samples
  gpg:                           B / max(1, #{s_i != 0}) * (s_i - mu_g)

Segment reductions: no Python loop over groups on any backend.
"""

from __future__ import annotations

import math

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import as_buffer, check_tensor, choose_backend, maybe_buffer
from pyrl.ops.codes import GROUP_ESTIMATORS


def group_advantages(scores, group_index, estimator="grpo", norm_by_std=True, eps=1e-6, lengths=None):
    """Per-sample advantages [B] float32 from scores [B] and integer group ids [B] (any values)."""
    check_tensor("scores", scores)
    check_tensor("group_index", group_index, floating=False)
    if scores.dim() != 1:
        raise ValueError(f"scores: expected [B], got shape {tuple(scores.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index: shape {tuple(group_index.shape)} does not match scores shape "
                         f"{tuple(scores.shape)}")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool or group_index.is_complex():
        raise TypeError(f"group_index: expected an integer tensor, got {group_index.dtype}")
    if group_index.device != scores.device:
        raise ValueError(f"group_index: on {group_index.device}, but scores are on {scores.device}")
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator: unknown {estimator!r}, expected one of {', '.join(GROUP_ESTIMATORS)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")
    if estimator == "opo":
        if lengths is None:
            raise ValueError("lengths: the opo estimator needs the response lengths [B]")
        check_tensor("lengths", lengths, floating=False)
        if lengths.shape != scores.shape:
            raise ValueError(f"lengths: shape {tuple(lengths.shape)} does not match scores shape {tuple(scores.shape)}")
    else:
        lengths = None
    backend = choose_backend(scores)
    if backend == "torch":
        # in float64 like the C++ and Triton accumulators: a group whose scores nearly agree has a tiny std,
        # and float32 rounding of (score - mean) / std then shows in the 4th digit
        return reference.group_advantages(scores.double(), group_index, estimator, norm_by_std, eps, lengths).float()
    scores32 = scores.detach().to(torch.float32).contiguous()
    ids = group_index.to(torch.int64).contiguous()
    lens = None if lengths is None else lengths.detach().to(torch.float32).contiguous()
    code = GROUP_ESTIMATORS[estimator]
    if backend == "cpp":
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        out = torch.empty_like(scores32)
        _C.group_advantages(as_buffer(scores32), as_buffer(ids), maybe_buffer(lens), code, bool(norm_by_std),
                            float(eps), as_buffer(out))
        return out
    from pyrl.kernels import group_advantages as triton_group  # lazy: triton is optional (pyrl.kernels imports it)

    return triton_group.group_advantages(scores32, ids, lens, code, bool(norm_by_std), float(eps))
