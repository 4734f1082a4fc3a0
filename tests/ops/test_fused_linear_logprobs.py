import math

import numpy as np
import pytest
import torch

from pyrl.ops import fused_linear_logprobs
from pyrl.ops import reference as ref
from pyrl.ops.fused_linear_logprobs import default_chunk_size


def oracle_logprob_rows(z_all, labels, temperature):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs) for logits z_all [N, V]
    (numpy float64), row by row: with x = z / T and p = softmax(x),
        logp = x_y - log sum_v e^{x_v},   H = -sum_{v: p_v > 0} p_v log p_v,
        d logp / d z = (onehot(y) - p) / T,   d H / d z = -p (log p + H) / T  (derived by hand).
    (logp [N], H [N], d logp / d z [N, V], d H / d z [N, V]) as numpy float64."""
    n, vocab = z_all.shape
    logp, ent = np.zeros(n), np.zeros(n)
    dlogp, dent = np.zeros((n, vocab)), np.zeros((n, vocab))
    for i, y in enumerate(labels.tolist()):
        x = z_all[i] / temperature
        top = x.max()
        e = np.exp(x - top)
        log_total = top + math.log(e.sum())
        p = e / e.sum()
        log_p = np.where(p > 0, x - log_total, 0.0)
        logp[i] = x[y] - log_total
        ent[i] = -(p * log_p).sum()
        dlogp[i] = -p
        dlogp[i, y] += 1.0
        dent[i] = -p * (log_p + ent[i])
    return logp, ent, dlogp / temperature, dent / temperature


def oracle_fused_linear(hidden, weight, labels, temperature):
    """The oracle above on logits formed row by row, z_i = W h_i, in float64. Returns (logp, H, d logp / d z,
    d H / d z, chain) as float64 torch tensors, where chain(dL/dz) = (dL/dh, dL/dW) = (dL/dz W, (dL/dz)^T h), the chain
    rule through z = h W^T written by hand."""
    h, w = hidden.detach().cpu().double().numpy(), weight.detach().cpu().double().numpy()
    z = np.stack([w @ h_i for h_i in h]) if len(h) else np.zeros((0, w.shape[0]))
    logp, ent, dlogp, dent = (torch.from_numpy(a) for a in oracle_logprob_rows(z, labels.cpu(), temperature))
    h, w = torch.from_numpy(h), torch.from_numpy(w)
    return logp, ent, dlogp, dent, lambda dz: (dz @ w, dz.T @ h)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_matches_float64_reference(backend, device, chunk_size, return_entropy):
    n, h, v = 23, 16, 301
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = (torch.randn(v, h, device=device) / 4).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    out = fused_linear_logprobs(hidden, weight, labels, temperature=0.9, chunk_size=chunk_size,
                                return_entropy=return_entropy)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    out64 = ref.fused_linear_logprobs(h64, w64, labels, 0.9, return_entropy)
    outs, outs64 = (out, out64) if return_entropy else ((out,), (out64,))
    # the independent oracle too (for the torch backend, reference.py is the code under test)
    logp_o, ent_o, dlogp_o, dent_o, chain = oracle_fused_linear(hidden, weight, labels, 0.9)
    loss, loss64, dz_o = 0, 0, 0
    for o, o64, o_o, do_o in zip(outs, outs64, (logp_o, ent_o), (dlogp_o, dent_o)):
        assert o.dtype == torch.float32 and o.shape == (n,)
        torch.testing.assert_close(o.double(), o64, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(o.double().cpu(), o_o, atol=2e-5, rtol=1e-5)
        g = torch.randn(n, device=device)
        loss, loss64 = loss + (o * g).sum(), loss64 + (o64 * g.double()).sum()
        dz_o = dz_o + g.double().cpu()[:, None] * do_o
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=2e-5, rtol=1e-4)
    grad_h_o, grad_w_o = chain(dz_o)
    torch.testing.assert_close(hidden.grad.double().cpu(), grad_h_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double().cpu(), grad_w_o, atol=2e-5, rtol=1e-4)


def test_bf16(backend, device):
    hidden = torch.randn(9, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(130, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 130, (9,), device=device)
    logp = fused_linear_logprobs(hidden, weight, labels, chunk_size=4)
    # the op's bf16 logits (rounded to bf16, as every backend forms them)
    logits = hidden.detach() @ weight.detach().t()
    expected = ref.logprobs_from_logits(logits, labels)
    torch.testing.assert_close(logp, expected.float(), atol=1e-4, rtol=1e-4)
    logp_o, _, dlogp_o, _ = oracle_logprob_rows(logits.double().cpu().numpy(), labels.cpu(), 1.0)  # independent
    torch.testing.assert_close(logp.double().cpu(), torch.from_numpy(logp_o), atol=1e-4, rtol=1e-4)
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all() and torch.isfinite(weight.grad.float()).all()
    # gradients: d logp / d logits chained by hand through the bf16 operands, to bf16 precision
    h, w, dz = hidden.detach().double().cpu(), weight.detach().double().cpu(), torch.from_numpy(dlogp_o)
    torch.testing.assert_close(hidden.grad.double().cpu(), dz @ w, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad.double().cpu(), dz.T @ h, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_reference_matches_independent_oracle(return_entropy):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: values and autograd gradients wrt hidden and weight; one row, and a batch."""
    for n, h, v in ((1, 3, 5), (13, 8, 61)):
        hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, v, (n,))
        out = ref.fused_linear_logprobs(hidden, weight, labels, 0.7, return_entropy)
        logp_o, ent_o, dlogp_o, dent_o, chain = oracle_fused_linear(hidden, weight, labels, 0.7)
        outs = out if return_entropy else (out,)  # zip stops at logp when there is no entropy
        loss, dz = 0, 0
        for o, o_o, do_o in zip(outs, (logp_o, ent_o), (dlogp_o, dent_o)):
            torch.testing.assert_close(o, o_o, atol=1e-10, rtol=1e-10)
            g = torch.randn(n, dtype=torch.float64)
            loss, dz = loss + (o * g).sum(), dz + g[:, None] * do_o
        loss.backward()
        grad_h, grad_w = chain(dz)
        torch.testing.assert_close(hidden.grad, grad_h, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(weight.grad, grad_w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_into_weight_accumulates_as_autograd_does(backend, device, dtype):
    """grad_into_weight over three micro-batches, the weight also read by an embedding lookup (tied, as a Qwen2
    head): weight.grad ends as autograd's own accumulation gives it (to rounding: chunks are added one by one).
    Every backward adds into a float32 .grad in place (the first makes it) and hands autograd nothing for the
    weight: what reaches the weight's hook is the lookup's gradient alone, and the first backward's sum is made in
    .grad, not beside it; a bf16 weight's gradient is left to autograd."""
    n, h, v = 11, 16, 97
    weight0 = torch.randn(v, h, device=device, dtype=dtype) / 4
    batches = [(torch.randn(n, h, device=device, dtype=dtype), torch.randint(0, v, (n,), device=device),
                torch.randint(0, v, (5,), device=device), torch.randn(n, device=device)) for _ in range(3)]

    def lookup_loss(ids, weight):
        return torch.nn.functional.embedding(ids, weight).float().square().sum()

    grads, seen = {}, {}
    for into in (False, True):
        weight = weight0.clone().requires_grad_()
        seen[into] = []
        weight.register_hook(lambda g, arrived=seen[into]: arrived.append(g.detach().clone()))
        for hidden, labels, ids, g in batches:
            logp = fused_linear_logprobs(hidden, weight, labels, chunk_size=4, grad_into_weight=into)
            ((logp * g).sum() + lookup_loss(ids, weight)).backward()
        grads[into] = weight.grad.double()
    torch.testing.assert_close(grads[True], grads[False], atol=1e-5 if dtype == torch.float32 else 0, rtol=1e-5)
    in_place = backend != "torch" and dtype == torch.float32  # the torch backend is plain autograd
    for k, (_, _, ids, _) in enumerate(batches):
        leaf = weight0.clone().requires_grad_()
        (lookup_only,) = torch.autograd.grad(lookup_loss(ids, leaf), leaf)
        for into in (False, True):
            assert torch.equal(seen[into][k], lookup_only) == (into and in_place), (into, k)


def test_only_hidden_requires_grad(backend, device):
    hidden = torch.randn(5, 8, device=device, requires_grad=True)
    weight = torch.randn(40, 8, device=device)
    fused_linear_logprobs(hidden, weight, torch.randint(0, 40, (5,), device=device)).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_one_logits_block_per_pass(kernel_backend, device):
    """The forward and the backward each make one [chunk, V] block and write every chunk's logits into it (and, in
    the backward, their gradient over them): no second block while the next chunk is made or its gradient taken.
    (The torch backend materializes the logits.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, h, v, chunk = 37, 8, 503, 8

    class Blocks(TorchDispatchMode):
        made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            returns = func._schema.returns
            for t, ret in zip(out if isinstance(out, (tuple, list)) else (out,), returns):
                new = isinstance(t, torch.Tensor) and ret.alias_info is None  # not a view, not written in place
                if new and t.dim() == 2 and t.shape[1] == v:
                    Blocks.made.append((func.__name__, tuple(t.shape)))
            return out

    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = torch.randn(v, h, device=device, requires_grad=True)
    labels = torch.randint(0, v, (n,), device=device)
    with Blocks():
        logp, ent = fused_linear_logprobs(hidden, weight, labels, chunk_size=chunk, return_entropy=True)
        forward_blocks = list(Blocks.made)
        (logp.sum() + ent.sum()).backward()
    assert forward_blocks == [("empty.memory_format", (chunk, v))]
    assert Blocks.made == forward_blocks * 2  # the backward's one block
    logp_o, ent_o, dlogp_o, dent_o, chain = oracle_fused_linear(hidden, weight, labels, 1.0)
    dh, dw = chain(dlogp_o + dent_o)
    torch.testing.assert_close(hidden.grad.double(), dh, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), dw, atol=1e-4, rtol=1e-4)


def test_default_chunk_size_bounds_memory():
    # chunk * V is about N * H, so the logits chunk is about the size of the hidden states
    assert default_chunk_size(16384, 151936, 4096) * 151936 <= 2 * 16384 * 4096
    assert default_chunk_size(100000, 151936, 64) == 256  # never thinner than MIN_CHUNK_ROWS
    assert default_chunk_size(3, 10, 100) == 3
    assert default_chunk_size(1, 151936, 64) == 1
    # CUDA: at least MIN_CHUNK_ROWS_CUDA rows (each chunk re-reads and re-writes the float32 weight gradient)
    assert default_chunk_size(16384, 151936, 4096, on_cuda=True) == 1024
    assert default_chunk_size(100000, 151936, 64, on_cuda=True) == 1024
    assert default_chunk_size(500, 151936, 4096, on_cuda=True) == 500
    assert default_chunk_size(100000, 32000, 8192, on_cuda=True) == 32768  # where Liger's rule gives more, it stands


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)),
         ValueError, "weight: hidden size 7"),
        ((torch.randn(4, 8), torch.randn(10, 8).double(), torch.zeros(4, dtype=torch.long)),
         TypeError, "hidden/weight"),
        ((torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long)), ValueError, "labels: shape"),
        ((torch.randn(4, 8), torch.randn(10, 8), torch.full((4,), 10)), ValueError, "labels: value 10"),
        ((torch.randn(4, 2, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)),
         ValueError, r"expected \[N, H\]"),
    ],
)
def test_bad_input(backend, args, err, match):
    with pytest.raises(err, match=match):
        fused_linear_logprobs(*args)


def test_bad_chunk_size(backend):
    with pytest.raises(ValueError, match="chunk_size: must be a positive int"):
        fused_linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_size=0)
