"""Triton kernels of RMSNorm as transformers' Llama-style norms compute it (see pyrl.models.rms_norm, which takes
them where PYRL_OPS_BACKEND=triton: they compile for sm_80/sm_90 and match under the interpreter; no GPU has run
them yet):
y = w * (x * rstd) rounded to x's dtype, rstd = 1 / sqrt(mean(x^2) + eps) in float32; one pass over x forward
(torch runs eight kernels: the upcast, square, mean, add, rsqrt, multiply, downcast and the weight's multiply), and
one pass over x and dy backward, each program summing the weight gradient of its rows in float32."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, hidden, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < hidden
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + cols, mask=valid, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = (x * rstd).to(dtype).to(tl.float32)  # transformers casts back to the input's dtype before the weight
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * hidden + cols, (w * normed).to(dtype), mask=valid)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, rows, hidden, rows_per_program,
                         WEIGHT_GRAD: tl.constexpr, BLOCK_H: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < hidden
    dtype = dx_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        x = tl.load(x_ptr + row * hidden + cols, mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * hidden + cols, mask=valid, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        if WEIGHT_GRAD:
            dw += dy * normed.to(dtype).to(tl.float32)
        grad_normed = (dy * w).to(dtype).to(tl.float32)  # the gradient reaching the cast back, in x's dtype
        dot = tl.sum(grad_normed * normed, axis=0) / hidden
        tl.store(dx_ptr + row * hidden + cols, (rstd * (grad_normed - normed * dot)).to(dtype), mask=valid)
    if WEIGHT_GRAD:
        tl.store(dw_partial_ptr + program * hidden + cols, dw, mask=valid)


def _warps(hidden: int) -> int:
    return min(max(triton.next_power_of_2(hidden) // 256, 4), 16)


def _programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)  # the interpreter


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(y, rstd) for x: [rows, hidden] contiguous, weight: [hidden] of x's dtype; rstd float32 [rows]. A row is one
    block of registers: wider rows than pyrl.models.rms_norm.MAX_TRITON_HIDDEN take torch's operations there."""
    rows, hidden = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_fwd_kernel[(rows,)](x, weight, y, rstd, hidden, eps, BLOCK_H=triton.next_power_of_2(hidden),
                                      num_warps=_warps(hidden))
    return y, rstd


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor,
                      weight_grad: bool = True):
    """(dx, dw): dw summed over rows in float32, returned in the weight's dtype (None without weight_grad: a frozen
    weight, as under LoRA, costs no partial sums)."""
    rows, hidden = x.shape
    dx = torch.empty_like(x)
    programs = _programs(rows, x.device)
    if not programs:
        return dx, torch.zeros_like(weight) if weight_grad else None
    partial = torch.empty(programs if weight_grad else 1, hidden, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x, weight, rstd, grad_y, dx, partial, rows, hidden,
                                      triton.cdiv(rows, programs), WEIGHT_GRAD=weight_grad,
                                      BLOCK_H=triton.next_power_of_2(hidden), num_warps=_warps(hidden))
    return dx, partial.sum(0).to(weight.dtype) if weight_grad else None
