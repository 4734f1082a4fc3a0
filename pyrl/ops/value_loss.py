"""Clipped value loss (verl's compute_value_loss).

v_clip = clip(v, v_old - c, v_old + c);  l = max((v - R)^2, (v_clip - R)^2)
loss = 0.5 * agg_loss(l, mask, loss_agg_mode);  vf_clipfrac = mean over unmasked tokens of [(v_clip - R)^2 > (v - R)^2]
One fused kernel writes l, d l / d v and the clip-fraction sums.
"""

from __future__ import annotations

import math

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import as_buffer, check_same_shape, check_tensor, choose_backend, float32_contiguous
from pyrl.ops.masked import agg_loss
from pyrl.ops.policy_loss import PerTokenLossFunction


def value_loss(values, old_values, returns, response_mask, cliprange_value=0.5, loss_agg_mode="token-mean",
               global_batch_info=None):
    """(vf_loss, vf_clipfrac), float32 0-dim tensors; differentiable wrt values. global_batch_info: see agg_loss."""
    check_tensor("values", values)
    check_tensor("old_values", old_values)
    check_tensor("returns", returns)
    check_tensor("response_mask", response_mask, floating=False)
    check_same_shape("values", values, old_values=old_values, returns=returns, response_mask=response_mask)
    if not isinstance(cliprange_value, (int, float)) or not math.isfinite(cliprange_value) or cliprange_value < 0:
        raise ValueError(f"cliprange_value: must be a finite number >= 0, got {cliprange_value!r}")
    agg_loss(values.new_zeros((1, 1)), values.new_ones((1, 1)), loss_agg_mode)  # validates the mode early
    backend = choose_backend(values)
    if backend == "torch" or old_values.requires_grad or returns.requires_grad:
        loss, clipfrac = reference.value_loss(
            values.float(), old_values.float(), returns.float(), response_mask.float(), cliprange_value, loss_agg_mode,
            global_batch_info
        )
        return loss.float(), clipfrac.detach().float()
    flat = lambda t: float32_contiguous(t).view(-1)  # noqa: E731
    v, ov, r, m = flat(values), flat(old_values), flat(returns), flat(response_mask)
    if backend == "cpp":
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        loss, dloss = torch.empty_like(v), torch.empty_like(v)
        sums = torch.tensor(_C.value_loss_forward(as_buffer(v), as_buffer(ov), as_buffer(r), as_buffer(m),
                                                  float(cliprange_value), as_buffer(loss), as_buffer(dloss)),
                            dtype=torch.float64)
    else:
        from pyrl.kernels import value_loss as triton_value_loss  # lazy: triton is optional (pyrl.kernels imports it)

        loss, dloss, sums = triton_value_loss.value_loss_forward(v, ov, r, m, float(cliprange_value))
    loss_mat = PerTokenLossFunction.apply(values, loss, dloss)
    clipfrac = (sums[0] / (sums[1] + 1e-8)).to(device=values.device, dtype=torch.float32)
    return (0.5 * agg_loss(loss_mat, m.view(values.shape), loss_agg_mode, global_batch_info=global_batch_info).float(),
            clipfrac)
