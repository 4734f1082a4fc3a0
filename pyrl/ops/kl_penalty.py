"""KL estimators between the policy and the reference policy, per token (verl's kl_penalty).

delta = logp - ref_logp
  "kl"/"k1": delta      "abs": |delta|      "mse"/"k2": delta^2 / 2
  "low_var_kl"/"k3": exp(u) - u - 1 with u = clamp(-delta, -20, 20), the result clamped to [-10, 10]
A "+" suffix ("k3+", "low_var_kl+", ...) keeps the estimator's value with k2's gradient (straight
through: k2 - sg(k2) + sg(value)), an unbiased gradient of KL.
Forward and backward are one fused elementwise kernel each.
"""

from __future__ import annotations

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import as_buffer, check_same_shape, check_tensor, choose_backend, float32_contiguous
from pyrl.ops.codes import KL_KINDS, KLKind


def parse_kind(kind) -> tuple[KLKind, bool]:
    if not isinstance(kind, str):
        raise TypeError(f"kind: expected a string, got {type(kind).__name__}")
    base, straight_through = (kind[:-1], True) if kind.endswith("+") else (kind, False)
    if base not in KL_KINDS:
        if base == "full":
            raise ValueError("kind: 'full' needs the whole distributions, not per-token log-probs")
        names = ", ".join(sorted(KL_KINDS) + [k + "+" for k in sorted(KL_KINDS)])
        raise ValueError(f"kind: unknown KL estimator {kind!r}, expected one of {names}")
    return KL_KINDS[base], straight_through


class CppKL:
    @staticmethod
    def forward(logp, ref_logp, code):
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        out = torch.empty_like(logp)
        _C.kl_forward(as_buffer(logp), as_buffer(ref_logp), code, as_buffer(out))
        return out

    @staticmethod
    def backward(logp, ref_logp, grad_out, code, straight_through):
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        grad = torch.empty_like(logp)
        _C.kl_backward(as_buffer(logp), as_buffer(ref_logp), as_buffer(grad_out), code, straight_through,
                       as_buffer(grad))
        return grad


def implementation(backend: str):
    if backend == "cpp":
        return CppKL
    from pyrl.kernels import kl_penalty as triton_kl  # lazy: triton is optional (pyrl.kernels imports it)

    return triton_kl


class KLPenaltyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, code, straight_through, backend):
        impl = implementation(backend)
        lp, rp = float32_contiguous(logp), float32_contiguous(ref_logp)
        ctx.save_for_backward(lp, rp)
        ctx.impl, ctx.code, ctx.straight_through = impl, code, straight_through
        return impl.forward(lp, rp, code)

    @staticmethod
    def backward(ctx, grad_out):
        lp, rp = ctx.saved_tensors
        grad = ctx.impl.backward(lp, rp, grad_out.to(torch.float32).contiguous(), ctx.code, ctx.straight_through)
        grad_logp = grad if ctx.needs_input_grad[0] else None
        grad_ref = -grad if ctx.needs_input_grad[1] else None
        return grad_logp, grad_ref, None, None, None


def kl_penalty(logp, ref_logp, kind="low_var_kl"):
    """Per-token KL estimate between log-probs of the policy and of the reference, float32, same shape."""
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_same_shape("logp", logp, ref_logp=ref_logp)
    code, straight_through = parse_kind(kind)
    backend = choose_backend(logp)
    if backend == "torch":
        return reference.kl_penalty(logp.float(), ref_logp.float(), kind)
    return KLPenaltyFunction.apply(logp, ref_logp, code, straight_through, backend)
