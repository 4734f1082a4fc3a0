import pytest
import torch

from pyrl.ops import entropy_from_logits, logprobs_from_logits
from pyrl.ops import reference as ref

TOL = {torch.float32: 5e-5, torch.bfloat16: 5e-5, torch.float16: 5e-5}
GRAD_TOL = {torch.float32: 3e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _check(logits, labels, temperature, device, grads=True, grad_atol=None):
    logits = logits.to(device).requires_grad_(grads)
    labels = labels.to(device)
    logp, ent = logprobs_from_logits(logits, labels, temperature, return_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert logp.shape == labels.shape and ent.shape == labels.shape
    x64 = logits.detach().double().requires_grad_(grads)
    logp64, ent64 = ref.logprobs_from_logits(x64, labels, temperature, return_entropy=True)
    torch.testing.assert_close(logp.double(), logp64, atol=TOL[logits.dtype], rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent64, atol=TOL[logits.dtype], rtol=1e-5)
    if grads:
        g1, g2 = torch.randn_like(logp), torch.randn_like(ent)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        ((logp64 * g1.double()).sum() + (ent64 * g2.double()).sum()).backward()
        assert logits.grad.dtype == logits.dtype
        tol = GRAD_TOL[logits.dtype]
        torch.testing.assert_close(logits.grad.double(), x64.grad, atol=grad_atol or tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_matches_float64_reference(backend, device, dtype, temperature):
    vocab = 4099 + int(torch.randint(0, 300, ()))  # not a multiple of any block size
    logits = (torch.randn(3, 5, vocab) * 4).to(dtype)
    labels = torch.randint(0, vocab, (3, 5))
    _check(logits, labels, temperature, device)


def test_edge_shapes(backend, device):
    _check(torch.randn(1, 1), torch.zeros(1, dtype=torch.long), 1.0, device)  # vocab 1: logp = 0, H = 0
    _check(torch.randn(1, 7), torch.tensor([6]), 1.0, device)  # one row
    _check(torch.randn(4, 0, 11), torch.zeros(4, 0, dtype=torch.long), 1.0, device)  # no rows
    # peaked distributions: |z| ~ 300, so float32 rounding of z alone is ~3e-5
    _check(torch.randn(5, 33) * 30, torch.randint(0, 33, (5,)), 0.3, device, grad_atol=2e-4)


def test_masked_vocabulary_entries(backend, device):
    """-inf logits (banned tokens, padded vocab) add nothing, even a whole leading block of them."""
    logits = torch.randn(3, 5000)
    logits[:, :4200] = float("-inf")
    logits[1, 4500:] = float("-inf")
    labels = torch.tensor([4300, 4400, 4999])
    _check(logits, labels, 1.0, device)


def test_non_contiguous_inputs(backend, device):
    base = torch.randn(4, 9, 300)
    logits = base[:, 1:-1, :]  # verl slices the response part like this
    labels = torch.randint(0, 300, (4, 9))[:, 1:-1]
    _check(logits, labels, 1.0, device)
    transposed = torch.randn(300, 6).t()  # vocab dim not contiguous: copied, still right
    _check(transposed, torch.randint(0, 300, (6,)), 0.9, device)


def test_entropy_only_and_logp_only(backend, device):
    logits = torch.randn(6, 257, device=device, requires_grad=True)
    ent = entropy_from_logits(logits, temperature=0.8)
    x64 = logits.detach().double().requires_grad_()
    ent64 = ref.entropy_from_logits(x64, 0.8)
    torch.testing.assert_close(ent.double(), ent64, atol=1e-5, rtol=1e-5)
    ent.sum().backward()
    ent64.sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    labels = torch.randint(0, 257, (6,), device=device)
    logits.grad = None
    logp = logprobs_from_logits(logits, labels)
    logp.sum().backward()
    x64.grad = None
    ref.logprobs_from_logits(x64, labels).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)


def test_int32_labels(backend, device):
    logits = torch.randn(4, 50, device=device)
    labels = torch.randint(0, 50, (4,), device=device, dtype=torch.int32)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), ref.logprobs_from_logits(logits, labels.long()))


def test_no_grad_mode(backend, device):
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    with torch.no_grad():
        logp = logprobs_from_logits(logits, torch.randint(0, 50, (4,), device=device))
    assert not logp.requires_grad


@pytest.mark.parametrize(
    "logits, labels, kwargs, err, match",
    [
        (torch.randn(2, 5), torch.tensor([0, 5]), {}, ValueError, r"labels: value 5 is outside the vocabulary \[0, 5\)"),
        (torch.randn(2, 5), torch.tensor([-1, 0]), {}, ValueError, "labels: value -1"),
        (torch.randn(2, 5), torch.tensor([0, 1, 2]), {}, ValueError, "labels: shape"),
        (torch.randn(2, 5), torch.tensor([0.0, 1.0]), {}, TypeError, "labels: expected an integer tensor"),
        (torch.randn(2, 5).double(), torch.tensor([0, 1]), {}, TypeError, "logits: expected float32, bfloat16 or float16"),
        (torch.randint(0, 3, (2, 5)), torch.tensor([0, 1]), {}, TypeError, "logits: expected a floating-point"),
        (torch.randn(2, 0), torch.tensor([0, 1]), {}, ValueError, "logits: needs a non-empty vocabulary"),
        (torch.randn(2, 5), torch.tensor([0, 1]), {"temperature": 0.0}, ValueError, "temperature: must be a finite number > 0"),
        (torch.randn(2, 5), torch.tensor([0, 1]), {"temperature": float("nan")}, ValueError, "temperature"),
        ([[1.0, 2.0]], torch.tensor([0]), {}, TypeError, "logits: expected a torch.Tensor"),
    ],
)
def test_bad_input(backend, logits, labels, kwargs, err, match):
    with pytest.raises(err, match=match):
        logprobs_from_logits(logits, labels, **kwargs)
