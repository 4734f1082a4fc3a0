"""A gated MLP that keeps less for its backward: down(silu(x W_g^T) * (x W_u^T)) W_d^T, as transformers' Llama-style
MLPs (Qwen2, Qwen3, Llama, Mistral) compute it, with the same operations in the same order, so its outputs and
gradients are transformers' own (bit for bit on CPU in float32 and bfloat16, the tests check).

Autograd through transformers' forward keeps four [tokens, intermediate] tensors per layer for the backward: the
gate projection g, silu(g), the up projection u (the product's inputs) and h = silu(g) * u (the down projection's
input). `gated_mlp` keeps g and u only and recomputes silu(g) and h in the backward (two elementwise passes): half
of the MLP's activations, the larger part of a layer's (intermediate is 3-5.5x the hidden size). Liger-Kernel's
SwiGLU keeps three (it recomputes silu(g), but the down projection still keeps h); here the down projection is
inside the function, so h is recomputed too.

`patch_gated_mlps(model)` makes every such MLP of a model (GATED_MLP_CLASSES) use it (the trainers do with
model.use_fused_kernels); an MLP it cannot run (another class, LoRA or other wrapped projections, biases, another
activation) keeps its own forward, checked at each call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from pyrl.models.patch import patch_forwards
from pyrl.ops._dispatch import choose_backend


class GatedMLPFunction(torch.autograd.Function):
    # The elementwise part runs as one Triton kernel each way where pyrl's ops would take Triton (CUDA tensors; the
    # kernels round as torch's do, pyrl.kernels.swiglu); elsewhere as torch's ops, each [tokens, intermediate]
    # tensor written in place where its input is not needed after: a fresh CPU tensor of that size costs its page
    # faults, about as much as the pass that fills it.
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        if choose_backend(gate) == "triton":
            from pyrl.kernels import swiglu  # lazy: triton is optional (pyrl.kernels imports it)

            return F.linear(swiglu.swiglu_forward(gate, up), w_down)
        return F.linear(F.silu(gate).mul_(up), w_down)

    @staticmethod
    @once_differentiable  # its in-place and out= operations are not themselves differentiable
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        needs_x, needs_gate, needs_up, needs_down = ctx.needs_input_grad
        grad_hidden = grad_out.matmul(w_down)
        if choose_backend(gate) == "triton":
            from pyrl.kernels import swiglu  # lazy: triton is optional (pyrl.kernels imports it)

            hidden, grad_up, grad_gate = swiglu.swiglu_backward(gate, up, grad_hidden)
            grad_w_down = flat(grad_out).t().mm(flat(hidden)) if needs_down else None
            del hidden
        else:
            # the product's and silu's backward as autograd runs them on transformers' forward
            activated = F.silu(gate)  # recomputed, as the forward made it
            grad_up = grad_hidden * activated
            hidden = activated.mul_(up)  # the down projection's input, recomputed
            grad_w_down = flat(grad_out).t().mm(flat(hidden)) if needs_down else None
            grad_gate = torch.ops.aten.silu_backward.grad_input(grad_hidden.mul_(up), gate, grad_input=hidden)
        del grad_hidden
        grad_x = grad_gate.matmul(w_gate).add_(grad_up.matmul(w_up)) if needs_x else None
        grad_w_gate = flat(grad_gate).t().mm(flat(x)) if needs_gate else None
        grad_w_up = flat(grad_up).t().mm(flat(x)) if needs_up else None
        return grad_x, grad_w_gate, grad_w_up, grad_w_down


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """(silu(x W_gate^T) * (x W_up^T)) W_down^T, keeping x and the two projections for the backward.
    x: [..., hidden]; w_gate, w_up: [intermediate, hidden]; w_down: [hidden, intermediate]."""
    return GatedMLPFunction.apply(x, w_gate, w_up, w_down)


# transformers' MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)), no more: others with the same
# attributes scale or clamp (Falcon-H1's multipliers, DeepSeek-V4's swiglu limit) and keep their own forward
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def runs_gated(mlp: nn.Module) -> bool:
    """Whether `mlp` is one of transformers' GATED_MLP_CLASSES with plain bias-free linear layers (not LoRA-wrapped)
    and a SiLU activation."""
    cls = type(mlp)
    if cls.__name__ not in GATED_MLP_CLASSES or not cls.__module__.startswith("transformers.models."):
        return False
    import transformers.activations  # lazy: transformers loads with the first model

    silu = (nn.SiLU, getattr(transformers.activations, "SiLUActivation", nn.SiLU))  # F.silu: ACT2FN["silu"]
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(type(p) is nn.Linear and p.bias is None for p in projections)
            and isinstance(getattr(mlp, "act_fn", None), silu))


def _forward(self, x):
    if not runs_gated(self):  # e.g. LoRA wrapped a projection after the patch
        return type(self).forward(self, x)
    return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def patch_gated_mlps(model: nn.Module) -> int:
    """Make each MLP of `model` that `runs_gated` run `gated_mlp`. Returns how many were patched."""
    return patch_forwards(model, runs_gated, _forward)
