"""Triton log-prob/entropy kernels: forward is one program per row streaming the vocabulary in blocks
with an online softmax (one read of the logits); backward is a (row, vocab-block) grid that recomputes
softmax from the saved log-sum-exp and writes d_logits in the logits' dtype (one read, one write)."""

import torch
import triton
import triton.language as tl

from pyrl.ops.logprobs import gradient_buffer

# Exponents below this are 0 (masked -inf logits then add nothing, and 0 * (-inf) never happens). A
# tl.constexpr: compiled kernels may read no other kind of global (the interpreter reads any).
MIN_EXPONENT = tl.constexpr(-100.0)


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, row_stride, labels_ptr, logp_ptr, lse_ptr, entropy_ptr, vocab, inv_t,
    HAS_LABELS: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    m = tl.full((), -3.0e38, tl.float32)  # finite start: a block of -inf logits leaves no NaN behind
    s = tl.zeros((), tl.float32)
    sz = tl.zeros((), tl.float32)  # sum exp(z - m) * (z - m)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        new_m = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - new_m)
        sz = scale * (sz + (m - new_m) * s)
        s = s * scale
        d = tl.maximum(z - new_m, MIN_EXPONENT)
        e = tl.where(valid & (d > MIN_EXPONENT), tl.exp(d), 0.0)
        s += tl.sum(e, 0)
        sz += tl.sum(e * d, 0)
        m = new_m
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + row, lse)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, log_s - sz / s)
    if HAS_LABELS:
        label = tl.load(labels_ptr + row)
        z_label = tl.load(base + label).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, z_label - lse)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, row_stride, labels_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, grad_logits_ptr,
    vocab, inv_t, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    # the rows' base pointers as scalars: with them folded into the per-element addresses, ptxas (13.4, with
    # Triton's --regAllocOptLevel=2) spilled 12 bytes on sm_90 (fp16, vocab not a multiple of 16, both grads)
    src = logits_ptr + row * row_stride
    dst = grad_logits_ptr + row * vocab
    z = tl.load(src + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
    d = tl.maximum(z - tl.load(lse_ptr + row), MIN_EXPONENT)
    p = tl.where(d > MIN_EXPONENT, tl.exp(d), 0.0)
    grad = tl.zeros((BLOCK,), tl.float32)
    if HAS_GRAD_LOGP:
        gl = tl.load(grad_logp_ptr + row)
        label = tl.load(labels_ptr + row)
        grad = gl * (tl.where(cols == label, 1.0, 0.0) - p)
    if HAS_GRAD_ENTROPY:
        ge = tl.load(grad_entropy_ptr + row)
        h = tl.load(entropy_ptr + row)
        grad -= ge * p * (d + h)  # z - E[z] = (z - lse) + H
    tl.store(dst + cols, (grad * inv_t).to(grad_logits_ptr.dtype.element_ty), mask=valid)


def _block(vocab: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(vocab))


def forward(logits2d, labels, inv_t, want_entropy):
    n, vocab = logits2d.shape
    dev = logits2d.device
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev) if labels is not None else lse
    entropy = torch.empty(n, dtype=torch.float32, device=dev) if want_entropy else lse
    if n:
        _logprobs_fwd_kernel[(n,)](
            logits2d, logits2d.stride(0), labels if labels is not None else lse, logp, lse, entropy, vocab, inv_t,
            HAS_LABELS=labels is not None, HAS_ENTROPY=want_entropy, BLOCK=_block(vocab, 4096), num_warps=8,
        )
    return (logp if labels is not None else None), lse, (entropy if want_entropy else None)


def backward(logits2d, labels, inv_t, lse, entropy, grad_logp, grad_entropy, out=None):
    n, vocab = logits2d.shape
    grad_logits = gradient_buffer(logits2d, out)
    if n:
        block = _block(vocab, 4096)
        _logprobs_bwd_kernel[(n, triton.cdiv(vocab, block))](
            logits2d, logits2d.stride(0), labels if labels is not None else lse, lse,
            entropy if entropy is not None else lse, grad_logp if grad_logp is not None else lse,
            grad_entropy if grad_entropy is not None else lse, grad_logits, vocab, inv_t,
            HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, BLOCK=block,
            num_warps=8,
        )
    return grad_logits
