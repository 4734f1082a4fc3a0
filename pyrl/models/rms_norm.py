"""RMSNorm as transformers' Llama-style norms compute it, y = w * round(x * rstd), rstd = (mean(x^2) + eps)^-1/2 in
float32 (round: back to x's dtype), with a hand-written backward:

    dw = sum_rows dy * round(x * rstd),   g = float32(round(dy * w)),   dx = rstd * (g - x rstd * mean(g * x rstd))

Autograd through transformers' forward runs eight operations forward and about twice as many backward, each a
pass over [tokens, hidden] in float32 (the upcast, square, mean, rsqrt, the products and casts), and keeps the
float32 upcast and the rounded normalized values; this keeps x and rstd (one float32 per row) and recomputes the
rest, as torch's operations (fewer of them), or as one Triton kernel each way (pyrl.kernels.rms_norm) where
PYRL_OPS_BACKEND=triton asks for it (see _takes_triton: no GPU has run those kernels yet). The torch path's
forward is transformers' own operations (bit for bit); the gradients, and the kernels' forward (their sum runs in
another order), equal transformers' to float32 rounding of the same formula.

`patch_rms_norms(model)` makes every such norm of a model (RMS_NORM_CLASSES) use it (the trainers do with
model.use_fused_kernels)."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from pyrl.models.patch import patch_forwards
from pyrl.ops._dispatch import choose_backend, forced_backend

MAX_TRITON_HIDDEN = 8192  # pyrl.kernels.rms_norm holds a row in registers; compiled without spills up to here


def _takes_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Only where PYRL_OPS_BACKEND=triton asks for it, CUDA included: the kernels compile for sm_80 and sm_90
    # (tests/ops/test_triton_compile.py) and match transformers under the interpreter, but no GPU has run them yet
    # (tests/models/test_rms_norm.py's cuda-triton cases, benchmarks/gpu_suite.sh, will); until one has, CUDA
    # takes the torch operations below by default.
    return (forced_backend() == "triton" and choose_backend(x) == "triton"
            and weight.dtype == x.dtype and weight.dim() == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < x.shape[-1] <= MAX_TRITON_HIDDEN)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if _takes_triton(x, weight):
            from pyrl.kernels import rms_norm  # lazy: triton is optional (pyrl.kernels imports it)

            rows = x.reshape(-1, x.shape[-1]).contiguous()
            y, rstd = rms_norm.rms_norm_forward(rows, weight.contiguous(), eps)
            ctx.save_for_backward(x, weight, rstd)
            ctx.triton = True
            return y.view(x.shape)
        # transformers' operations, in its order: the same output bit for bit
        upcast = x.to(torch.float32)
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.triton = False
        return weight * (upcast * rstd).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        needs_x, needs_weight, _ = ctx.needs_input_grad
        if ctx.triton:
            from pyrl.kernels import rms_norm  # lazy: triton is optional (pyrl.kernels imports it)

            hidden = x.shape[-1]
            dx, dw = rms_norm.rms_norm_backward(x.reshape(-1, hidden).contiguous(), weight.contiguous(), rstd,
                                                grad_y.reshape(-1, hidden).contiguous(), weight_grad=needs_weight)
            return dx.view(x.shape), dw, None
        normed = x.to(torch.float32) * rstd
        dw = None
        if needs_weight:  # the weight's product with the normalized values cast back, summed over the rows
            dw = (grad_y * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if needs_x:
            grad_normed = (grad_y * weight).to(x.dtype).to(torch.float32)  # the gradient reaching the cast back
            dot = (grad_normed * normed).mean(-1, keepdim=True)
            dx = grad_normed.sub_(normed.mul_(dot)).mul_(rstd).to(x.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * round(x / sqrt(mean(x^2, -1) + eps)), as transformers' Llama-style RMSNorm. x: [..., hidden]."""
    return RMSNormFunction.apply(x, weight, eps)


# transformers' norms whose forward is exactly the formula above (Gemma's scale by 1 + w and others differ)
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def runs_fused_norm(module: nn.Module) -> bool:
    """Whether `module` is one of transformers' RMS_NORM_CLASSES with its one weight."""
    cls = type(module)
    return (cls.__name__ in RMS_NORM_CLASSES and cls.__module__.startswith("transformers.models.")
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _forward(self, x):
    return rms_norm(x, self.weight, self.variance_epsilon)


def patch_rms_norms(model: nn.Module) -> int:
    """Make each norm of `model` that `runs_fused_norm` run `rms_norm`. Returns how many were patched."""
    return patch_forwards(model, runs_fused_norm, _forward)
