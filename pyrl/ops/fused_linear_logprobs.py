"""Log-probs (and entropy) of lm_head(hidden) without materializing the [N, V] logits.

logits_c = hidden_c @ weight.T is formed one chunk of rows at a time, fed to the log-prob kernel and
dropped; backward recomputes each chunk's logits, has the kernel turn them into d_logits_c in place and
accumulates grad_hidden_c = d_logits_c @ weight and grad_weight += d_logits_c.T @ hidden_c. Peak extra memory is
one [chunk, V] block in the hidden dtype, reused by every chunk, plus the float32 [V, H] grad_weight, unless
grad_into_weight has the backward add into the float32 weight's .grad in place.
"""

from __future__ import annotations

import functools

import torch

from pyrl.ops import reference
from pyrl.ops._dispatch import check_positive, check_tensor, choose_backend
from pyrl.ops.codes import FLOAT_KIND
from pyrl.ops.logprobs import check_labels, implementation

MIN_CHUNK_ROWS = 256  # below this the matmuls get too thin to run at speed
# On CUDA each chunk also reads and writes the float32 [V, H] weight gradient once (8 V H bytes) against
# 6 rows V H FLOPs of matmuls: at 256 rows that traffic cost as much as the matmuls. Measured on an H200
# (N=8192, H=4096, V=151936, bf16, fwd+bwd): 256 rows 107 ms, 512 80, 1024 70, 2048 68, 4096 65; torch with
# the logits materialized 57 ms (+13 GB), Liger 84 ms (benchmarks/RESULTS.md, "pyrl's kernels on an H200").
MIN_CHUNK_ROWS_CUDA = 1024


def default_chunk_size(n: int, vocab: int, hidden: int, on_cuda: bool = False) -> int:
    """Rows per chunk so that a chunk of logits is about the size of the hidden states (Liger's rule),
    but at least MIN_CHUNK_ROWS rows (MIN_CHUNK_ROWS_CUDA on CUDA)."""
    chunks = max(1, -(-vocab // max(1, hidden)))
    rows = 1 << max(0, (-(-n // chunks) - 1).bit_length())
    return max(1, min(n, max(rows, MIN_CHUNK_ROWS_CUDA if on_cuda else MIN_CHUNK_ROWS)))


@functools.lru_cache(maxsize=None)
def fp32_accumulating_addmm(device: torch.device) -> bool:
    """Whether this torch's addmm on `device` takes bf16 operands into a float32 output in place (out_dtype, CUDA,
    torch >= 2.8): probed once per device on a 1 x 1 product."""
    one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
    out = torch.zeros(1, 1, dtype=torch.float32, device=device)
    try:
        torch.addmm(out, one, one, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def accumulate_grad_weight(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (float32 [V, H]) += grad_logits.T @ hidden, without a [V, H] temporary where torch allows.

    float32: addmm_ in place. bf16/fp16 on CUDA: one cuBLAS call with 16-bit operands accumulating into the
    float32 gradient in place (torch.addmm's out_dtype). Otherwise the 16-bit product is made and then added: on
    an H200 at N=8192, H=4096, V=151936 that temporary and its float32 copy cost more than the matmuls themselves
    (benchmarks/RESULTS.md, "pyrl's kernels on an H200")."""
    a = grad_logits.t()
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(a, hidden)
    elif grad_logits.is_cuda and fp32_accumulating_addmm(grad_logits.device):
        torch.addmm(grad_weight, a, hidden, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += (a @ hidden).float()


def chunk_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The one [chunk, V] block every chunk's logits (and, in the backward, their gradient) are written into: a
    new block per chunk would hold two at once while the next is made and the last freed."""
    return torch.empty(min(chunk_size, hidden.shape[0]), weight.shape[0], dtype=hidden.dtype, device=hidden.device)


class FusedLinearLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, return_entropy, chunk_size, backend, grad_into_weight):
        ctx.set_materialize_grads(False)
        ctx.weight_param = weight if grad_into_weight else None
        impl = implementation(backend)
        inv_t = 1.0 / temperature
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if return_entropy else None
        block = chunk_buffer(hidden, weight, chunk_size)
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            logits = torch.mm(hidden[start:end], weight.t(), out=block[: end - start])
            lp, ls, ent = impl.forward(logits, labels[start:end], inv_t, return_entropy)
            logp[start:end], lse[start:end] = lp, ls
            if return_entropy:
                entropy[start:end] = ent
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.impl, ctx.inv_t, ctx.chunk_size = impl, inv_t, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight, into = None, float32_grad_to_add_into(ctx.weight_param) if need_w else None
        if need_w:
            grad_weight = into if into is not None else torch.zeros(weight.shape, dtype=torch.float32,
                                                                    device=weight.device)
        as_f32 = lambda g: None if g is None else g.to(torch.float32).contiguous()  # noqa: E731
        grad_logp, grad_entropy = as_f32(grad_logp), as_f32(grad_entropy)
        block = chunk_buffer(hidden, weight, ctx.chunk_size)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(hidden.shape[0], start + ctx.chunk_size)
            logits = torch.mm(hidden[start:end], weight.t(), out=block[: end - start])
            grad_logits = ctx.impl.backward(  # in place: the chunk's logits become their gradient
                logits, labels[start:end], ctx.inv_t, lse[start:end],
                None if entropy is None else entropy[start:end],
                None if grad_logp is None else grad_logp[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
                out=logits,
            )
            if need_h:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if need_w:
                accumulate_grad_weight(grad_weight, grad_logits, hidden[start:end])
        if into is not None:  # added in place: nothing for autograd to add
            grad_weight = None
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None,
                None, None)


def float32_grad_to_add_into(weight: torch.Tensor | None) -> torch.Tensor | None:
    """weight.grad, where the backward adds the weight's gradient into it in place: a float32 leaf's .grad, made
    here (zeros) when it has none yet, so that the first micro-batch's other gradients of the weight (a tied
    embedding's lookup) are added into it too, instead of the sum of two [V, H] tensors made beside them. None (the
    caller returns its gradient for autograd to add) for other weights and for a .grad of another dtype, shape or
    layout. Also pyrl.models.embedding's."""
    if weight is None or not weight.is_leaf or weight.dtype != torch.float32:
        return None
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    grad = weight.grad
    if grad.dtype != torch.float32 or grad.shape != weight.shape or grad.layout != torch.strided:
        return None
    return grad


def fused_linear_logprobs(hidden, weight, labels, temperature=1.0, chunk_size=None, return_entropy=False,
                          grad_into_weight=False):
    """logprobs_from_logits(hidden @ weight.T, labels, temperature) for hidden [N, H], weight [V, H],
    labels [N], computed chunk by chunk; differentiable wrt hidden and weight.

    grad_into_weight: where weight is a float32 leaf, the backward adds the weight's gradient into weight.grad in
    place (making it, zeros, when there is none yet) and hands autograd nothing for the weight: gradients
    accumulated over micro-batches, and a tied embedding's, gather in one float32 [V, H] tensor instead of beside
    new ones. Only for losses reduced with .backward(): torch.autograd.grad(..., weight) would find its result in
    weight.grad instead."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden/weight: expected [N, H] and [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} does not match hidden's {hidden.shape[1]}")
    if hidden.dtype != weight.dtype or hidden.dtype not in FLOAT_KIND:
        raise TypeError(f"hidden/weight: need one dtype among float32/bfloat16/float16, got {hidden.dtype} and "
                        f"{weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"weight: on {weight.device}, but hidden is on {hidden.device}")
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary (dim 0) is empty")
    check_labels(labels, hidden.shape[:1], weight.shape[0], hidden.device)
    temperature = check_positive("temperature", temperature)
    n = hidden.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n, weight.shape[0], weight.shape[1], hidden.is_cuda)
    elif not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    backend = choose_backend(hidden)
    if backend == "torch":
        out = reference.fused_linear_logprobs(hidden, weight, labels, temperature, return_entropy)
        return tuple(t.float() for t in out) if return_entropy else out.float()
    logp, entropy = FusedLinearLogProbsFunction.apply(
        hidden, weight, labels.to(torch.int64).contiguous(), temperature, bool(return_entropy), max(1, chunk_size),
        backend, bool(grad_into_weight)
    )
    return (logp, entropy) if return_entropy else logp
