"""Log-probs of the chosen tokens and entropy, from temperature-scaled logits.

logp_i = z_{i,y_i} - logsumexp(z_i),   H_i = logsumexp(z_i) - sum_v softmax(z_i)_v z_{i,v},   z = logits / T

One online-softmax pass over the vocabulary per row (fp32 accumulation, bf16/fp16/fp32 in), so no
[..., V] float32 temporary exists; the backward pass writes d_logits directly, in the logits' dtype.
"""

from __future__ import annotations

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import as_buffer, check_positive, check_tensor, choose_backend, maybe_buffer
from pyrl.ops.codes import FLOAT_KIND


class CppLogProbs:
    """pyrl._C implementation of the two passes (CPU tensors)."""

    @staticmethod
    def forward(logits2d, labels, inv_t, want_entropy):
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        n = logits2d.shape[0]
        lse = torch.empty(n, dtype=torch.float32)
        logp = torch.empty(n, dtype=torch.float32) if labels is not None else None
        entropy = torch.empty(n, dtype=torch.float32) if want_entropy else None
        _C.logprobs_forward(
            as_buffer(logits2d), FLOAT_KIND[logits2d.dtype], maybe_buffer(labels), inv_t,
            maybe_buffer(logp), as_buffer(lse), maybe_buffer(entropy),
        )
        return logp, lse, entropy

    @staticmethod
    def backward(logits2d, labels, inv_t, lse, entropy, grad_logp, grad_entropy, out=None):
        from pyrl import _C  # lazy: pyrl._C loads only on the cpp backend

        grad_logits = gradient_buffer(logits2d, out)
        _C.logprobs_backward(
            as_buffer(logits2d), FLOAT_KIND[logits2d.dtype], maybe_buffer(labels), inv_t, as_buffer(lse),
            maybe_buffer(entropy), maybe_buffer(grad_logp), maybe_buffer(grad_entropy), as_buffer(grad_logits),
        )
        return grad_logits


def gradient_buffer(logits2d: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a backward writes d logits: `out` (contiguous, logits2d's shape and dtype; it may be logits2d itself,
    since both kernels read each block of a row before writing that block, and nothing else), or a new tensor."""
    if out is None:
        return torch.empty(logits2d.shape, dtype=logits2d.dtype, device=logits2d.device)
    if out.shape != logits2d.shape or out.dtype != logits2d.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {tuple(logits2d.shape)} {logits2d.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out


def implementation(backend: str):
    if backend == "cpp":
        return CppLogProbs
    from pyrl.kernels import logprobs as triton_logprobs  # lazy: triton is optional (pyrl.kernels imports it)

    return triton_logprobs


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V] with a unit-stride vocabulary dim (a copy only when no such view exists)."""
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


class LogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, return_entropy, backend):
        ctx.set_materialize_grads(False)
        impl = implementation(backend)
        rows = as_rows(logits)
        flat_labels = None if labels is None else labels.reshape(-1).to(torch.int64).contiguous()
        inv_t = 1.0 / temperature
        logp, lse, entropy = impl.forward(rows, flat_labels, inv_t, return_entropy)
        ctx.save_for_backward(rows, flat_labels, lse, entropy)
        ctx.impl, ctx.inv_t, ctx.logits_shape = impl, inv_t, logits.shape
        shape = logits.shape[:-1]
        return (
            None if logp is None else logp.view(shape),
            None if entropy is None else entropy.view(shape),
        )

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        rows, labels, lse, entropy = ctx.saved_tensors
        flat = lambda g: None if g is None else g.reshape(-1).to(torch.float32).contiguous()  # noqa: E731
        grad_rows = ctx.impl.backward(rows, labels, ctx.inv_t, lse, entropy, flat(grad_logp), flat(grad_entropy))
        return grad_rows.view(ctx.logits_shape), None, None, None, None


def check_logits(logits) -> None:
    check_tensor("logits", logits)
    if logits.dtype not in FLOAT_KIND:
        raise TypeError(f"logits: expected float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: needs a non-empty vocabulary (last) dim, got shape {tuple(logits.shape)}")


def check_labels(labels, batch_shape, vocab: int, device) -> None:
    check_tensor("labels", labels, floating=False)
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels: expected an integer tensor, got {labels.dtype}")
    if labels.shape != batch_shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match logits.shape[:-1] = {tuple(batch_shape)}")
    if labels.device != device:
        raise ValueError(f"labels: on {labels.device}, but logits are on {device}")
    if labels.numel() and bool(((labels < 0) | (labels >= vocab)).any()):
        bad = labels[(labels < 0) | (labels >= vocab)][0].item()
        raise ValueError(f"labels: value {bad} is outside the vocabulary [0, {vocab})")


def logprobs_from_logits(logits, labels, temperature=1.0, return_entropy=False):
    """Log-prob of `labels` under softmax(logits / temperature), float32, shaped like labels.

    logits [..., V] (fp32/bf16/fp16, any strides), labels [...] integer. With return_entropy=True also
    returns the entropy of the same distribution. Differentiable wrt logits (both outputs).
    """
    check_logits(logits)
    check_labels(labels, logits.shape[:-1], logits.shape[-1], logits.device)
    temperature = check_positive("temperature", temperature)
    backend = choose_backend(logits)
    if backend == "torch":
        out = reference.logprobs_from_logits(logits, labels, temperature, return_entropy)
        return tuple(t.float() for t in out) if return_entropy else out.float()
    logp, entropy = LogProbsFunction.apply(logits, labels, temperature, bool(return_entropy), backend)
    return (logp, entropy) if return_entropy else logp


def entropy_from_logits(logits, temperature=1.0):
    """Entropy of softmax(logits / temperature) over the last dim, float32, differentiable."""
    check_logits(logits)
    temperature = check_positive("temperature", temperature)
    backend = choose_backend(logits)
    if backend == "torch":
        return reference.entropy_from_logits(logits, temperature).float()
    return LogProbsFunction.apply(logits, None, temperature, True, backend)[1]
