import pytest
import torch

from pyrl.ops import fused_linear_logprobs
from pyrl.ops import reference as ref
from pyrl.ops.fused_linear_logprobs import default_chunk_size


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_matches_float64_reference(backend, device, chunk_size, return_entropy):
    n, h, v = 23, 16, 301
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = (torch.randn(v, h, device=device) / 4).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    out = fused_linear_logprobs(hidden, weight, labels, temperature=0.9, chunk_size=chunk_size, return_entropy=return_entropy)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    out64 = ref.fused_linear_logprobs(h64, w64, labels, 0.9, return_entropy)
    outs, outs64 = (out, out64) if return_entropy else ((out,), (out64,))
    loss, loss64 = 0, 0
    for o, o64 in zip(outs, outs64):
        assert o.dtype == torch.float32 and o.shape == (n,)
        torch.testing.assert_close(o.double(), o64, atol=2e-5, rtol=1e-5)
        g = torch.randn(n, device=device)
        loss, loss64 = loss + (o * g).sum(), loss64 + (o64 * g.double()).sum()
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=2e-5, rtol=1e-4)


def test_bf16(backend, device):
    hidden = torch.randn(9, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(130, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 130, (9,), device=device)
    logp = fused_linear_logprobs(hidden, weight, labels, chunk_size=4)
    expected = ref.logprobs_from_logits(hidden.detach() @ weight.detach().t(), labels)  # same bf16 logits
    torch.testing.assert_close(logp, expected.float(), atol=1e-4, rtol=1e-4)
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all() and torch.isfinite(weight.grad.float()).all()


def test_only_hidden_requires_grad(backend, device):
    hidden = torch.randn(5, 8, device=device, requires_grad=True)
    weight = torch.randn(40, 8, device=device)
    fused_linear_logprobs(hidden, weight, torch.randint(0, 40, (5,), device=device)).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_default_chunk_size_bounds_memory():
    # chunk * V is about N * H, so the logits chunk is about the size of the hidden states
    assert default_chunk_size(16384, 151936, 4096) * 151936 <= 2 * 16384 * 4096
    assert default_chunk_size(100000, 151936, 64) == 256  # never thinner than MIN_CHUNK_ROWS
    assert default_chunk_size(3, 10, 100) == 3
    assert default_chunk_size(1, 151936, 64) == 1


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)), ValueError, "weight: hidden size 7"),
        ((torch.randn(4, 8), torch.randn(10, 8).double(), torch.zeros(4, dtype=torch.long)), TypeError, "hidden/weight"),
        ((torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long)), ValueError, "labels: shape"),
        ((torch.randn(4, 8), torch.randn(10, 8), torch.full((4,), 10)), ValueError, "labels: value 10"),
        ((torch.randn(4, 2, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)), ValueError, r"expected \[N, H\]"),
    ],
)
def test_bad_input(backend, args, err, match):
    with pytest.raises(err, match=match):
        fused_linear_logprobs(*args)


def test_bad_chunk_size(backend):
    with pytest.raises(ValueError, match="chunk_size: must be a positive int"):
        fused_linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_size=0)
