import math

import pytest
import torch

from pyrl.ops import kl_penalty
from pyrl.ops import reference as ref

KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
ALL_KINDS = KINDS + [k + "+" for k in ("k1", "abs", "k2", "k3", "low_var_kl")]


def oracle_kl(logp, ref_logp, kind):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs): element by element in
    Python floats from the estimators' definitions, with the derivative d/d logp derived by hand (d/d ref_logp is its
    negative). (value, derivative), float64, shaped like logp.
      k1: d -> 1     abs: |d| -> sign(d) (0 at 0)     k2: d^2 / 2 -> d
      k3: u = clamp(-d, -20, 20), v = e^u - u - 1, value clamp(v, -10, 10) -> 1 - e^u where neither clamp is active
      "+": value of the base estimator, derivative of k2 (d)."""
    base, straight_through = (kind[:-1], True) if kind.endswith("+") else (kind, False)
    values, derivs = [], []
    for a, b in zip(logp.detach().double().flatten().tolist(), ref_logp.detach().double().flatten().tolist()):
        d = a - b
        if base in ("kl", "k1"):
            v, dv = d, 1.0
        elif base == "abs":
            v, dv = abs(d), float((d > 0) - (d < 0))
        elif base in ("mse", "k2"):
            v, dv = d * d / 2, d
        elif base in ("low_var_kl", "k3"):
            u = min(max(-d, -20.0), 20.0)
            raw = math.exp(u) - u - 1.0
            v = min(max(raw, -10.0), 10.0)
            dv = 1.0 - math.exp(u) if (-20.0 <= -d <= 20.0 and raw <= 10.0) else 0.0
        else:
            raise AssertionError(kind)
        values.append(v)
        derivs.append(d if straight_through else dv)
    as_t = lambda x: torch.tensor(x, dtype=torch.float64).view(logp.shape)  # noqa: E731
    return as_t(values), as_t(derivs)


@pytest.mark.parametrize("kind", ALL_KINDS)
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
    # and against the independent oracle (for the torch backend the lines above compare reference.py with itself)
    value, deriv = oracle_kl(logp, ref_logp, kind)
    torch.testing.assert_close(out.double().cpu(), value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp.grad.double().cpu(), g.double().cpu() * deriv, atol=tol, rtol=tol)
    torch.testing.assert_close(ref_logp.grad.double().cpu(), -g.double().cpu() * deriv, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reference_matches_independent_oracle(kind):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: values and autograd gradients, the clamp regions of k3 and delta = 0 included."""
    logp = (torch.randn(6, 9, dtype=torch.float64) * 4).requires_grad_()
    ref_logp = (torch.randn(6, 9, dtype=torch.float64) * 4).requires_grad_()
    with torch.no_grad():
        logp[0, :5] = torch.tensor([-30.0, 25.0, -4.0, 1.5, 0.0], dtype=torch.float64)
        ref_logp[0, :5] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    out = ref.kl_penalty(logp, ref_logp, kind)
    value, deriv = oracle_kl(logp, ref_logp, kind)
    torch.testing.assert_close(out, value, atol=1e-12, rtol=1e-12)
    g = torch.randn(6, 9, dtype=torch.float64)
    (out * g).sum().backward()
    torch.testing.assert_close(logp.grad, g * deriv, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ref_logp.grad, -g * deriv, atol=1e-12, rtol=1e-12)


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
