"""Triton GAE: each lane of a program owns one sequence and walks it backwards, so a block of BLOCK
sequences advances in lock-step (see pyrl.ops.gae for the recurrence)."""

import torch
import triton
import triton.language as tl

BLOCK = 64


@triton.jit
def _gae_kernel(rewards_ptr, values_ptr, mask_ptr, cu_ptr, adv_ptr, ret_ptr, n_seqs, seq_len, max_len, gamma, lam,
                HAS_MASK: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    seq = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = seq < n_seqs
    if PACKED:
        begin = tl.load(cu_ptr + seq, mask=live, other=0)
        end = tl.load(cu_ptr + seq + 1, mask=live, other=0)
    else:
        begin = seq.to(tl.int64) * seq_len
        end = begin + seq_len
    next_value = tl.zeros((BLOCK,), tl.float32)
    last_adv = tl.zeros((BLOCK,), tl.float32)
    for step in range(0, max_len):
        pos = end - 1 - step
        active = live & (pos >= begin)
        r = tl.load(rewards_ptr + pos, mask=active, other=0.0)
        v = tl.load(values_ptr + pos, mask=active, other=0.0)
        if HAS_MASK:
            m = tl.load(mask_ptr + pos, mask=active, other=0.0)
        else:
            m = tl.where(active, 1.0, 0.0)
        adv = r + gamma * next_value - v + gamma * lam * last_adv
        next_value = tl.where(active, v * m + (1.0 - m) * next_value, next_value)
        last_adv = tl.where(active, adv * m + (1.0 - m) * last_adv, last_adv)
        tl.store(adv_ptr + pos, last_adv, mask=active)
        tl.store(ret_ptr + pos, last_adv + v, mask=active)


def gae(rewards, values, mask, cu_seqlens, n_seqs, seq_len, gamma, lam):
    advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
    if cu_seqlens is not None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if n_seqs else 0
    else:
        max_len = seq_len
    if n_seqs and max_len:
        _gae_kernel[(triton.cdiv(n_seqs, BLOCK),)](
            rewards, values, mask if mask is not None else rewards, cu_seqlens if cu_seqlens is not None else rewards,
            advantages, returns, n_seqs, seq_len, max_len, gamma, lam,
            HAS_MASK=mask is not None, PACKED=cu_seqlens is not None, BLOCK=BLOCK,
        )
    return advantages, returns
