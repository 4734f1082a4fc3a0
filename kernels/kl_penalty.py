"""Triton KL-estimator kernels: elementwise forward and backward (see pyrl.ops.kl_penalty)."""

import torch
import triton
import triton.language as tl

from pyrl.ops.codes import KLKind

# the estimators, named (tl.constexpr: compiled kernels may read no other kind of global); codes from pyrl.ops.codes
K1, ABS, K2 = (tl.constexpr(int(kind)) for kind in (KLKind.k1, KLKind.abs, KLKind.k2))

BLOCK = 1024


@triton.jit
def _kl_fwd_kernel(logp_ptr, ref_ptr, out_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    d = tl.load(logp_ptr + offs, mask=valid, other=0.0) - tl.load(ref_ptr + offs, mask=valid, other=0.0)
    if KIND == K1:
        v = d
    elif KIND == ABS:
        v = tl.abs(d)
    elif KIND == K2:
        v = 0.5 * d * d
    else:
        u = tl.minimum(tl.maximum(-d, -20.0), 20.0)
        v = tl.minimum(tl.maximum(tl.exp(u) - u - 1.0, -10.0), 10.0)
    tl.store(out_ptr + offs, v, mask=valid)


@triton.jit
def _kl_bwd_kernel(logp_ptr, ref_ptr, grad_out_ptr, grad_ptr, n, KIND: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    d = tl.load(logp_ptr + offs, mask=valid, other=0.0) - tl.load(ref_ptr + offs, mask=valid, other=0.0)
    g = tl.load(grad_out_ptr + offs, mask=valid, other=0.0)
    if STRAIGHT_THROUGH or KIND == K2:
        dd = d
    elif KIND == K1:
        dd = tl.full(d.shape, 1.0, tl.float32)
    elif KIND == ABS:
        dd = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    else:
        u = -d
        uc = tl.minimum(tl.maximum(u, -20.0), 20.0)
        v = tl.exp(uc) - uc - 1.0
        inside = (u >= -20.0) & (u <= 20.0) & (v <= 10.0)
        dd = tl.where(inside, 1.0 - tl.exp(uc), 0.0)
    tl.store(grad_ptr + offs, g * dd, mask=valid)


def forward(logp, ref_logp, code):
    out = torch.empty_like(logp)
    n = logp.numel()
    if n:
        _kl_fwd_kernel[(triton.cdiv(n, BLOCK),)](logp, ref_logp, out, n, KIND=int(code), BLOCK=BLOCK)
    return out


def backward(logp, ref_logp, grad_out, code, straight_through):
    grad = torch.empty_like(logp)
    n = logp.numel()
    if n:
        _kl_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            logp, ref_logp, grad_out, grad, n, KIND=int(code), STRAIGHT_THROUGH=straight_through, BLOCK=BLOCK
        )
    return grad
