"""Triton per-token clipped value loss: loss, d loss / d v and the clip-fraction sums in one pass; see
pyrl.ops.value_loss."""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _value_loss_kernel(v_ptr, old_ptr, ret_ptr, mask_ptr, loss_ptr, dloss_ptr, sums_ptr, n, cliprange,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    v = tl.load(v_ptr + offs, mask=valid, other=0.0)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0)
    r = tl.load(ret_ptr + offs, mask=valid, other=0.0)
    w = tl.load(mask_ptr + offs, mask=valid, other=0.0)
    lo = old - cliprange
    hi = old + cliprange
    vc = tl.minimum(tl.maximum(v, lo), hi)
    e1 = v - r
    e2 = vc - r
    l1 = e1 * e1
    l2 = e2 * e2
    d1 = 2.0 * e1
    d2 = tl.where((v >= lo) & (v <= hi), 2.0 * e2, 0.0)
    tl.store(loss_ptr + offs, tl.maximum(l1, l2), mask=valid)
    tl.store(dloss_ptr + offs, tl.where(l1 > l2, d1, tl.where(l2 > l1, d2, 0.5 * (d1 + d2))), mask=valid)
    tl.atomic_add(sums_ptr + 0, tl.sum(w * tl.where(l2 > l1, 1.0, 0.0), 0))
    tl.atomic_add(sums_ptr + 1, tl.sum(w, 0))


def value_loss_forward(values, old_values, returns, mask, cliprange):
    loss, dloss = torch.empty_like(values), torch.empty_like(values)
    sums = torch.zeros(2, dtype=torch.float32, device=values.device)
    n = values.numel()
    if n:
        _value_loss_kernel[(triton.cdiv(n, BLOCK),)](values, old_values, returns, mask, loss, dloss, sums, n, cliprange,
                                                     BLOCK=BLOCK)
    return loss, dloss, sums
