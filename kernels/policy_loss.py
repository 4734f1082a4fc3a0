"""Triton per-token policy loss (vanilla with dual clip, cispo, gpg): loss, d loss / d logp and the
metric sums (clipped, clipped_lower, -delta, mask) in one pass; see pyrl.ops.policy_loss."""

import torch
import triton
import triton.language as tl

from pyrl.ops.codes import PolicyLossMode

# the modes, named (tl.constexpr: compiled kernels may read no other kind of global); codes from pyrl.ops.codes
VANILLA, CISPO = tl.constexpr(int(PolicyLossMode.vanilla)), tl.constexpr(int(PolicyLossMode.cispo))

BLOCK = 1024


@triton.jit
def _policy_loss_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, loss_ptr, dloss_ptr, sums_ptr, n, clip_low, clip_high,
                        clip_c, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    a = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    w = tl.load(mask_ptr + offs, mask=valid, other=0.0)
    raw = logp - tl.load(old_ptr + offs, mask=valid, other=0.0)
    delta = tl.minimum(tl.maximum(raw, -20.0), 20.0)
    ratio = tl.exp(delta)
    dratio = tl.where((raw >= -20.0) & (raw <= 20.0), ratio, 0.0)
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    clipped_ratio = tl.minimum(tl.maximum(ratio, lo), hi)
    f_lower = tl.zeros((BLOCK,), tl.float32)
    if MODE == VANILLA:
        l1 = -a * ratio
        l2 = -a * clipped_ratio
        dl1 = -a * dratio
        dl2 = tl.where((ratio >= lo) & (ratio <= hi), dl1, 0.0)
        loss = tl.maximum(l1, l2)
        dl = tl.where(l1 > l2, dl1, tl.where(l2 > l1, dl2, 0.5 * (dl1 + dl2)))
        f_clip = tl.where(l2 > l1, 1.0, 0.0)
        l3 = -a * clip_c
        neg = a < 0
        f_lower = tl.where(neg & (loss > l3), 1.0, 0.0)
        dl = tl.where(neg, tl.where(loss < l3, dl, tl.where(loss > l3, 0.0, 0.5 * dl)), dl)
        loss = tl.where(neg, tl.minimum(loss, l3), loss)
    elif MODE == CISPO:
        loss = -clipped_ratio * a * logp
        dl = -clipped_ratio * a
        f_clip = tl.where(clipped_ratio != ratio, 1.0, 0.0)
    else:
        loss = -a * logp
        dl = -a
        f_clip = tl.zeros((BLOCK,), tl.float32)
    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(dloss_ptr + offs, dl, mask=valid)
    tl.atomic_add(sums_ptr + 0, tl.sum(w * f_clip, 0))
    tl.atomic_add(sums_ptr + 1, tl.sum(w * f_lower, 0))
    tl.atomic_add(sums_ptr + 2, tl.sum(-delta * w, 0))
    tl.atomic_add(sums_ptr + 3, tl.sum(w, 0))


def policy_loss_forward(code, logp, old_logp, advantages, mask, clip_low, clip_high, clip_c):
    loss, dloss = torch.empty_like(logp), torch.empty_like(logp)
    sums = torch.zeros(4, dtype=torch.float32, device=logp.device)
    n = logp.numel()
    if n:
        _policy_loss_kernel[(triton.cdiv(n, BLOCK),)](
            logp, old_logp, advantages, mask, loss, dloss, sums, n, clip_low, clip_high, clip_c, MODE=int(code),
            BLOCK=BLOCK,
        )
    return loss, dloss, sums
