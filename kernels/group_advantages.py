"""Triton group advantages: samples are sorted by group (one torch sort), then one program per group
walks its contiguous segment: sums, unbiased std, top-2 for pass@k, and writes each sample's advantage
back to its original position (see pyrl.ops.group_advantages for the formulas). Sums and the std are
taken in float64, as the C++ core does: a group whose scores nearly agree has a tiny std, and float32
rounding of (score - mean) / std would show in the 4th digit."""

import torch
import triton
import triton.language as tl

from pyrl.ops.codes import GroupEstimator

# the estimators, named (tl.constexpr: compiled kernels may read no other kind of global); codes from pyrl.ops.codes
GRPO, RLOO, RPP_BASELINE, OPO, GRPO_PASSK = (
    tl.constexpr(int(e)) for e in (GroupEstimator.grpo, GroupEstimator.rloo,
                                   GroupEstimator.reinforce_plus_plus_baseline, GroupEstimator.opo,
                                   GroupEstimator.grpo_passk))

BLOCK = 128


@triton.jit
def _group_kernel(scores_ptr, lengths_ptr, order_ptr, offsets_ptr, alpha_ptr, out_ptr, eps,
                  ESTIMATOR: tl.constexpr, NORM: tl.constexpr, HAS_LENGTHS: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    begin = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    count = (end - begin).to(tl.float64)
    total = tl.zeros((), tl.float64)
    wsum = tl.zeros((), tl.float64)
    wtot = tl.zeros((), tl.float64)
    best = tl.full((), float("-inf"), tl.float64)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        idx = tl.load(order_ptr + offs, mask=valid, other=0)
        s = tl.load(scores_ptr + idx, mask=valid, other=0.0).to(tl.float64)
        total += tl.sum(s, 0)
        best = tl.maximum(best, tl.max(tl.where(valid, s, float("-inf")), 0))
        if HAS_LENGTHS:
            length = tl.load(lengths_ptr + idx, mask=valid, other=0.0).to(tl.float64)
            wsum += tl.sum(length * s, 0)
            wtot += tl.sum(length, 0)
    mean = tl.where(count > 1, total / count, 0.0)
    sq = tl.zeros((), tl.float64)
    best_pos = tl.full((), 2147483647, tl.int32)  # first position (in sorted order) holding the max
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        idx = tl.load(order_ptr + offs, mask=valid, other=0)
        s = tl.load(scores_ptr + idx, mask=valid, other=0.0).to(tl.float64)
        c = tl.where(valid, s - mean, 0.0)
        sq += tl.sum(c * c, 0)
        # offs is int64 (the offsets are): back to int32, which a loop-carried value must keep (the
        # compiler refuses a type change; an int64 best_pos also made sm_80's ptxas spill for grpo_passk)
        best_pos = tl.minimum(best_pos, tl.min(tl.where(valid & (s == best), offs, 2147483647), 0).to(tl.int32))
    std = tl.where(count > 1, tl.sqrt(sq / tl.maximum(count - 1.0, 1.0)), 1.0)
    second = tl.full((), float("-inf"), tl.float64)
    if ESTIMATOR == GRPO_PASSK:
        for start in range(begin, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = (offs < end) & (offs != best_pos)
            idx = tl.load(order_ptr + offs, mask=valid, other=0)
            s = tl.load(scores_ptr + idx, mask=valid, other=0.0).to(tl.float64)
            second = tl.maximum(second, tl.max(tl.where(valid, s, float("-inf")), 0))
    alpha = tl.load(alpha_ptr)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        idx = tl.load(order_ptr + offs, mask=valid, other=0)
        s = tl.load(scores_ptr + idx, mask=valid, other=0.0).to(tl.float64)
        if ESTIMATOR == GRPO:
            adv = s - mean
            if NORM:
                adv = adv / (std + eps)
        elif ESTIMATOR == RLOO:
            adv = tl.where(count > 1, (s - mean) * count / tl.maximum(count - 1.0, 1.0), s)
        elif ESTIMATOR == RPP_BASELINE:
            adv = s - mean
        elif ESTIMATOR == OPO:
            base = tl.where((count > 1) & (wtot > 0), wsum / tl.where(wtot > 0, wtot, 1.0), 0.0)
            adv = s - base
        elif ESTIMATOR == GRPO_PASSK:
            top = best - second
            if NORM:
                top = top / (std + eps)
            adv = tl.where(offs == best_pos, top, 0.0)
        else:
            adv = alpha * (s - mean)
        tl.store(out_ptr + idx, adv.to(tl.float32), mask=valid)


def group_advantages(scores, ids, lengths, code, norm_by_std, eps):
    n = scores.numel()
    out = torch.empty_like(scores)
    if n == 0:
        return out
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    if code == GroupEstimator.grpo_passk and bool((counts < 2).any()):
        bad = int(unique[counts < 2][0])
        raise ValueError(f"group_index: grpo_passk needs at least 2 samples per group, group {bad} has 1")
    order = torch.sort(inverse, stable=True).indices
    offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=scores.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    alpha = (n / torch.count_nonzero(scores).clamp(min=1)).to(torch.float32).reshape(1)
    _group_kernel[(unique.numel(),)](
        scores, lengths if lengths is not None else scores, order, offsets, alpha, out, eps,
        ESTIMATOR=int(code), NORM=norm_by_std, HAS_LENGTHS=lengths is not None, BLOCK=BLOCK,
    )
    return out
