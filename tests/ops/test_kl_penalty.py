import pytest
import torch

from pyrl.ops import kl_penalty
from pyrl.ops import reference as ref

KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@pytest.mark.parametrize("kind", KINDS + [k + "+" for k in ("k1", "abs", "k2", "k3", "low_var_kl")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(backend, device, kind, dtype):
    logp = (torch.randn(7, 13, device=device) * 3).to(dtype).requires_grad_()
    ref_logp = (torch.randn(7, 13, device=device) * 3).to(dtype).requires_grad_()
    # include the clamp regions of k3: |delta| > 20 and exp(u) - u - 1 > 10
    with torch.no_grad():
        logp[0, :3] = torch.tensor([-30.0, 25.0, -4.0], dtype=dtype)
        ref_logp[0, :3] = 0
    out = kl_penalty(logp, ref_logp, kind)
    assert out.dtype == torch.float32 and out.shape == logp.shape
    lp64, rp64 = logp.detach().double().requires_grad_(), ref_logp.detach().double().requires_grad_()
    out64 = ref.kl_penalty(lp64, rp64, kind)
    torch.testing.assert_close(out.double(), out64, atol=1e-5, rtol=1e-5)
    g = torch.randn(7, 13, device=device)
    (out * g).sum().backward()
    (out64 * g.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logp.grad.double(), lp64.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(ref_logp.grad.double(), rp64.grad, atol=tol, rtol=tol)


def test_hand_computed(backend, device):
    lp = torch.tensor([0.0, -1.0, -2.0, -50.0], device=device)
    rp = torch.tensor([0.0, -2.0, -1.0, 0.0], device=device)
    torch.testing.assert_close(kl_penalty(lp, rp, "k1"), torch.tensor([0.0, 1.0, -1.0, -50.0], device=device))
    torch.testing.assert_close(kl_penalty(lp, rp, "abs"), torch.tensor([0.0, 1.0, 1.0, 50.0], device=device))
    torch.testing.assert_close(kl_penalty(lp, rp, "k2"), torch.tensor([0.0, 0.5, 0.5, 1250.0], device=device))
    e = torch.exp(torch.tensor(1.0)).item()
    # k3 with u = ref - logp: [0, -1, 1, 50 -> clamped 20 -> exp(20)-21 -> clamped 10]
    expected = torch.tensor([0.0, 1 / e, e - 2, 10.0], device=device)
    torch.testing.assert_close(kl_penalty(lp, rp, "k3"), expected)


def test_straight_through_gradient_is_k2(backend, device):
    logp = torch.randn(50, device=device, requires_grad=True)
    ref_logp = torch.randn(50, device=device)
    value = kl_penalty(logp, ref_logp, "k3+")
    torch.testing.assert_close(value, kl_penalty(logp.detach(), ref_logp, "k3"))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref_logp).detach())


def test_empty(backend, device):
    assert kl_penalty(torch.zeros(0, 4, device=device), torch.zeros(0, 4, device=device)).shape == (0, 4)


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((torch.randn(3), torch.randn(4), "k1"), ValueError, "ref_logp: shape"),
        ((torch.randn(3), torch.randn(3), "k4"), ValueError, "kind: unknown KL estimator 'k4'"),
        ((torch.randn(3), torch.randn(3), "full"), ValueError, "kind: 'full'"),
        ((torch.randn(3), torch.randn(3), 3), TypeError, "kind: expected a string"),
        ((torch.randn(3), torch.arange(3), "k1"), TypeError, "ref_logp: expected a floating-point"),
    ],
)
def test_bad_input(backend, args, err, match):
    with pytest.raises(err, match=match):
        kl_penalty(*args)
