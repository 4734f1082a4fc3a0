"""Triton GAE as a scan: one program per sequence, BLOCK tokens at a time from the end, each block one parallel
associative scan (see pyrl.ops.gae for the recurrence).

Processing token t maps the carried state s = (nextV, lastA) affinely, s' = M_t s + b_t, with
    M_t = [[1 - m,  0               ],      b_t = (m V_t, m (r_t - V_t))
           [m g,    1 - m + m g lam ]]
(g = gamma), so the state after any run of tokens is the composition of their maps, which is associative: a
block's composites come from one tl.associative_scan over (p, q, r, b1, b2) = the map's three entries and two
offsets, applied to the state carried in from the later block. A_t is the lastA entry of the state after t,
returns_t = A_t + V_t. Loads and stores are contiguous (a block is read back to front), the sequential part is
T / BLOCK steps per sequence instead of T, and no host sync is needed for packed lengths. For the whitening the
kernel also leaves each sequence's mask-weighted moments of A (count, mean, M2, merged block by block), which the
op merges across sequences in float64: one pass over the tokens instead of masked_whiten's reductions.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _compose(p_a, q_a, r_a, b1_a, b2_a, p_b, q_b, r_b, b1_b, b2_b):
    """B after A (A holds the tokens processed first): M = M_B M_A, b = M_B b_A + b_B."""
    return (p_b * p_a, q_b * p_a + r_b * q_a, r_b * r_a, p_b * b1_a + b1_b, q_b * b1_a + r_b * b2_a + b2_b)


@triton.jit
def _gae_kernel(rewards_ptr, values_ptr, mask_ptr, cu_ptr, adv_ptr, ret_ptr, moments_ptr, seq_len, gamma, lam,
                HAS_MASK: tl.constexpr, PACKED: tl.constexpr, MOMENTS: tl.constexpr, BLOCK: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    if PACKED:
        begin = tl.load(cu_ptr + seq)
        end = tl.load(cu_ptr + seq + 1)
    else:
        begin = seq * seq_len
        end = begin + seq_len
    i = tl.arange(0, BLOCK)
    last = i == BLOCK - 1
    zero = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)  # a float32 scalar tensor: what the loop carries
    next_value, last_adv = zero, zero  # the state carried in from later blocks: none at the end
    count, mean, m2 = zero, zero, zero  # MOMENTS: the mask-weighted count, mean and M2 of A so far
    for k in range(0, tl.cdiv(end - begin, BLOCK)):
        pos = end - k * BLOCK - 1 - i  # element i is the i-th token of the block processed: back to front
        live = pos >= begin
        r = tl.load(rewards_ptr + pos, mask=live, other=0.0)
        v = tl.load(values_ptr + pos, mask=live, other=0.0)
        if HAS_MASK:
            m = tl.load(mask_ptr + pos, mask=live, other=0.0)
        else:
            m = tl.where(live, 1.0, 0.0)
        # tokens before `begin` (m = 0) are identity maps: they change neither the outputs nor the carry
        p = 1.0 - m
        q = m * gamma
        rr = 1.0 - m + m * (gamma * lam)
        b1 = m * v
        b2 = m * (r - v)
        p, q, rr, b1, b2 = tl.associative_scan((p, q, rr, b1, b2), 0, _compose)
        adv = q * next_value + rr * last_adv + b2
        tl.store(adv_ptr + pos, adv, mask=live)
        tl.store(ret_ptr + pos, adv + v, mask=live)
        next_value, last_adv = (tl.sum(tl.where(last, p * next_value + b1, 0.0), 0),
                                tl.sum(tl.where(last, adv, 0.0), 0))
        if MOMENTS:  # the block's moments (two passes over registers), merged into the sequence's (Chan et al.)
            block_count = tl.sum(m, 0)
            block_mean = tl.sum(m * adv, 0) / tl.maximum(block_count, 1e-30)
            centered = adv - block_mean
            block_m2 = tl.sum(m * centered * centered, 0)
            total = count + block_count
            share = block_count / tl.maximum(total, 1e-30)
            delta = block_mean - mean
            mean = mean + delta * share
            m2 = m2 + block_m2 + delta * delta * count * share
            count = total
    if MOMENTS:
        tl.store(moments_ptr + seq * 3, count)
        tl.store(moments_ptr + seq * 3 + 1, mean)
        tl.store(moments_ptr + seq * 3 + 2, m2)


def gae(rewards, values, mask, cu_seqlens, n_seqs, seq_len, gamma, lam, moments=False):
    """(advantages, returns, moments): moments [n_seqs, 3] float32 holds each sequence's mask-weighted count, mean and
    sum of squared deviations of its advantages (for the whitening), or None unless asked for."""
    advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
    stats = torch.zeros(n_seqs, 3, dtype=torch.float32, device=rewards.device) if moments else None
    if n_seqs and rewards.numel():
        _gae_kernel[(n_seqs,)](
            rewards, values, mask if mask is not None else rewards, cu_seqlens if cu_seqlens is not None else rewards,
            advantages, returns, stats if moments else rewards, seq_len, gamma, lam,
            HAS_MASK=mask is not None, PACKED=cu_seqlens is not None, MOMENTS=moments, BLOCK=BLOCK, num_warps=8,
        )
    return advantages, returns, stats
