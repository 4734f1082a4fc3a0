import math

import numpy as np
import pytest
import torch

from pyrl.ops import entropy_from_logits, logprobs_from_logits
from pyrl.ops import reference as ref
from pyrl.ops.logprobs import implementation

TOL = {torch.float32: 5e-5, torch.bfloat16: 5e-5, torch.float16: 5e-5}
GRAD_TOL = {torch.float32: 3e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def oracle_logprobs(logits, labels, temperature):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs): row by row in numpy from
    the definitions, with z = logits / T, p = softmax(z) (shifted by the row max, -inf logits give p = 0):
        logp = z_y - log sum_v e^{z_v},   H = -sum_{v: p_v > 0} p_v log p_v
    and the gradients wrt the logits derived by hand:
        d logp / d logits = (onehot(y) - p) / T,   d H / d logits = -p (log p + H) / T
    (logp, H, d logp / d logits, d H / d logits), float64, shaped like labels / logits."""
    vocab = logits.shape[-1]
    z_all = logits.detach().cpu().double().reshape(-1, vocab).numpy() / temperature
    y_all = labels.detach().cpu().reshape(-1).tolist()
    n = z_all.shape[0]
    logp, ent = np.zeros(n), np.zeros(n)
    dlogp, dent = np.zeros((n, vocab)), np.zeros((n, vocab))
    for i, (z, y) in enumerate(zip(z_all, y_all)):
        top = z.max()
        e = np.exp(z - top)
        total = e.sum()
        p = e / total
        log_p = np.where(p > 0, z - top - math.log(total), 0.0)
        logp[i] = z[y] - top - math.log(total)
        ent[i] = -(p * log_p).sum()
        dlogp[i] = -p
        dlogp[i, y] += 1.0
        dent[i] = -p * (log_p + ent[i])
    as_t = lambda a, shape: torch.from_numpy(a).view(shape)  # noqa: E731
    return (as_t(logp, labels.shape), as_t(ent, labels.shape), as_t(dlogp / temperature, logits.shape),
            as_t(dent / temperature, logits.shape))


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
        if logits.dtype == torch.float32 and grad_atol is None:
            # float32 rounds the log-probs to ~eps * max|z / T|, and the entropy's gradient multiplies them by p / T:
            # the bound grows with the scaled logits (seen: 3.3e-5 at max|z / T| ~ 33, once in ~10^5 elements)
            largest = float(logits.detach().abs().max()) if logits.numel() else 0.0
            grad_atol = max(tol, 2e-6 * largest / temperature)
        torch.testing.assert_close(logits.grad.double(), x64.grad, atol=grad_atol or tol, rtol=tol)
    # and against the independent oracle (for the torch backend the lines above compare reference.py with itself)
    logp_o, ent_o, dlogp_o, dent_o = oracle_logprobs(logits, labels, temperature)
    torch.testing.assert_close(logp.double().cpu(), logp_o, atol=TOL[logits.dtype], rtol=1e-5)
    torch.testing.assert_close(ent.double().cpu(), ent_o, atol=TOL[logits.dtype], rtol=1e-5)
    if grads:
        expected = g1.double().cpu()[..., None] * dlogp_o + g2.double().cpu()[..., None] * dent_o
        torch.testing.assert_close(logits.grad.double().cpu(), expected, atol=grad_atol or tol, rtol=tol)


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
    _, ent_o, _, dent_o = oracle_logprobs(logits, labels, 0.8)  # independent of reference.py
    torch.testing.assert_close(ent.double().cpu(), ent_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double().cpu(), dent_o, atol=1e-5, rtol=1e-5)
    logits.grad = None
    logp = logprobs_from_logits(logits, labels)
    logp.sum().backward()
    x64.grad = None
    ref.logprobs_from_logits(x64, labels).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    logp_o, _, dlogp_o, _ = oracle_logprobs(logits, labels, 1.0)
    torch.testing.assert_close(logp.double().cpu(), logp_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double().cpu(), dlogp_o, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.3, 1.7])
def test_reference_matches_independent_oracle(temperature):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: values and autograd gradients, on vocab 1, a peaked row, -inf entries and an ordinary batch."""
    cases = [
        (torch.randn(1, 1), torch.zeros(1, dtype=torch.long)),
        (torch.randn(4, 3, 37) * 4, torch.randint(0, 37, (4, 3))),
        (torch.randn(5, 33) * 30, torch.randint(0, 33, (5,))),
    ]
    masked = torch.randn(3, 50)
    masked[:, :20] = float("-inf")
    masked[1, 30:] = float("-inf")
    cases.append((masked, torch.tensor([20, 29, 49])))
    for logits, labels in cases:
        x = logits.double().requires_grad_()
        logp, ent = ref.logprobs_from_logits(x, labels, temperature, return_entropy=True)
        logp_o, ent_o, dlogp_o, dent_o = oracle_logprobs(x, labels, temperature)
        torch.testing.assert_close(logp, logp_o, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ent, ent_o, atol=1e-10, rtol=1e-10)
        g1, g2 = torch.randn_like(logp), torch.randn_like(ent)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        torch.testing.assert_close(x.grad, g1[..., None] * dlogp_o + g2[..., None] * dent_o, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ref.entropy_from_logits(x.detach(), temperature), ent_o, atol=1e-10, rtol=1e-10)


def test_int32_labels(backend, device):
    logits = torch.randn(4, 50, device=device)
    labels = torch.randint(0, 50, (4,), device=device, dtype=torch.int32)
    logp = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(logp, ref.logprobs_from_logits(logits, labels.long()))
    torch.testing.assert_close(logp.double().cpu(), oracle_logprobs(logits, labels, 1.0)[0], atol=1e-5, rtol=1e-5)


def test_no_grad_mode(backend, device):
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    with torch.no_grad():
        logp = logprobs_from_logits(logits, torch.randint(0, 50, (4,), device=device))
    assert not logp.requires_grad


@pytest.mark.parametrize(
    "logits, labels, kwargs, err, match",
    [
        (torch.randn(2, 5), torch.tensor([0, 5]), {},
         ValueError, r"labels: value 5 is outside the vocabulary \[0, 5\)"),
        (torch.randn(2, 5), torch.tensor([-1, 0]), {}, ValueError, "labels: value -1"),
        (torch.randn(2, 5), torch.tensor([0, 1, 2]), {}, ValueError, "labels: shape"),
        (torch.randn(2, 5), torch.tensor([0.0, 1.0]), {}, TypeError, "labels: expected an integer tensor"),
        (torch.randn(2, 5).double(), torch.tensor([0, 1]), {},
         TypeError, "logits: expected float32, bfloat16 or float16"),
        (torch.randint(0, 3, (2, 5)), torch.tensor([0, 1]), {}, TypeError, "logits: expected a floating-point"),
        (torch.randn(2, 0), torch.tensor([0, 1]), {}, ValueError, "logits: needs a non-empty vocabulary"),
        (torch.randn(2, 5), torch.tensor([0, 1]), {"temperature": 0.0},
         ValueError, "temperature: must be a finite number > 0"),
        (torch.randn(2, 5), torch.tensor([0, 1]), {"temperature": float("nan")}, ValueError, "temperature"),
        ([[1.0, 2.0]], torch.tensor([0]), {}, TypeError, "logits: expected a torch.Tensor"),
    ],
)
def test_bad_input(backend, logits, labels, kwargs, err, match):
    with pytest.raises(err, match=match):
        logprobs_from_logits(logits, labels, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_in_place_equals_out_of_place(kernel_backend, device, dtype):
    """The kernels' backward writes d logits over the logits themselves (out=logits2d, what the fused linear
    log-prob op does with its one chunk block) bit for bit as into a new tensor, entropy gradient included."""
    impl = implementation(kernel_backend)
    vocab = 4099 + int(torch.randint(0, 300, ()))
    logits = (torch.randn(5, vocab, device=device) * 3).to(dtype)
    labels = torch.randint(0, vocab, (5,), device=device)
    logp, lse, entropy = impl.forward(logits, labels, 1 / 0.7, True)
    grads = torch.randn(5, device=device), torch.randn(5, device=device)
    expected = impl.backward(logits, labels, 1 / 0.7, lse, entropy, *grads)
    in_place = logits.clone()
    got = impl.backward(in_place, labels, 1 / 0.7, lse, entropy, *grads, out=in_place)
    assert got.data_ptr() == in_place.data_ptr()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_backward_out_checked(kernel_backend, device):
    impl = implementation(kernel_backend)
    logits, labels = torch.randn(3, 10, device=device), torch.randint(0, 10, (3,), device=device)
    _, lse, _ = impl.forward(logits, labels, 1.0, False)
    g = torch.ones(3, device=device)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \(3, 10\) torch.float32"):
        impl.backward(logits, labels, 1.0, lse, None, g, None, out=torch.empty(3, 11, device=device))
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        impl.backward(logits, labels, 1.0, lse, None, g, None, out=torch.empty(10, 3, device=device).t())
    strided = torch.randn(3, 12, device=device)[:, :10]
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        impl.backward(strided, labels, 1.0, lse, None, g, None, out=strided)
