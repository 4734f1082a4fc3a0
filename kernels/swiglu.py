"""Triton kernels of the gated MLP's elementwise part (see pyrl.models.gated_mlp): h = silu(g) * u forward, and the
backward's h, du = dh * silu(g) and dg = (dh * u) * silu'(g), one pass each where torch runs two (forward) and
four or five (backward) kernels over [tokens, intermediate] tensors.

Each operation rounds where torch's CUDA kernels round, in their order, so that on CUDA the results are torch's
own bit for bit: silu(g) = g / (1 + exp(-g)) in float32 (precise exp and division, as torch is compiled) rounded
to the tensors' dtype, then each product of two such tensors computed in float32 and rounded; silu's backward is
torch's dy * s * (1 + g * (1 - s)), s = 1 / (1 + exp(-g)). Under the interpreter (CPU tensors, for tests) exp is
numpy's, so results there agree to a float32 rounding, not bitwise."""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024
# libdevice's exp (CUDA's expf, what torch's silu calls) where compiled; the interpreter has no libdevice
PRECISE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        e = libdevice.exp(x)
    else:
        e = tl.exp(x)
    return e


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    g = tl.load(gate_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    activated = tl.div_rn(g, 1.0 + _exp(-g, PRECISE)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (activated * u).to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _swiglu_bwd_kernel(gate_ptr, up_ptr, grad_hidden_ptr, hidden_ptr, grad_up_ptr, grad_gate_ptr, n,
                       PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    dtype = hidden_ptr.dtype.element_ty
    g = tl.load(gate_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    dh = tl.load(grad_hidden_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    e = _exp(-g, PRECISE)
    activated = tl.div_rn(g, 1.0 + e).to(dtype).to(tl.float32)
    tl.store(hidden_ptr + offs, (activated * u).to(dtype), mask=valid)
    tl.store(grad_up_ptr + offs, (dh * activated).to(dtype), mask=valid)
    dh_u = (dh * u).to(dtype).to(tl.float32)
    s = tl.div_rn(1.0, 1.0 + e)
    tl.store(grad_gate_ptr + offs, (dh_u * s * (1.0 + g * (1.0 - s))).to(dtype), mask=valid)


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
            raise ValueError(f"swiglu: expected contiguous tensors of one shape, dtype and device, got "
                             f"{[(tuple(x.shape), x.dtype, str(x.device), x.is_contiguous()) for x in tensors]}")


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, rounded as torch's silu then mul round it."""
    _check(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, PRECISE=PRECISE, BLOCK=BLOCK)
    return out


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad_hidden: torch.Tensor):
    """(hidden, grad_up, grad_gate) of h = silu(gate) * up given dL/dh: hidden recomputed for the down projection's
    weight gradient. grad_gate is written over grad_hidden (each element is read before it is written)."""
    _check(gate, up, grad_hidden)
    hidden, grad_up = torch.empty_like(gate), torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, grad_hidden, hidden, grad_up, grad_hidden, n,
                                                     PRECISE=PRECISE, BLOCK=BLOCK)
    return hidden, grad_up, grad_hidden
