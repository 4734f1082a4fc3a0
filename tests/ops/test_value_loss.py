import math

import pytest
import torch

from pyrl.ops import LOSS_AGG_MODES, value_loss
from pyrl.ops import reference as ref


def oracle_value_loss(values, old_values, returns, response_mask, cliprange_value=0.5, loss_agg_mode="token-mean"):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs, nor pyrl.ops.masked, which
    every backend aggregates with): token by token in Python floats from verl's compute_value_loss,
        v_clip = clip(v, v_old - c, v_old + c),  l = max((v - R)^2, (v_clip - R)^2),  loss = 0.5 agg(l)
    with d l / d v = 2 (v - R) where the unclipped term is the larger (ties: v inside the clip range, where both terms
    are one), else 0 (v_clip is flat there); aggregated with per-token weights written out per loss_agg_mode (N valid
    tokens, S non-empty rows, n_i tokens of row i, T the width). Returns (loss, vf_clipfrac, d loss / d values)."""
    v, ov, ret, m = (x.detach().double().cpu().tolist() for x in (values, old_values, returns, response_mask))
    n_valid = sum(k for row in m for k in row)
    n_rows = sum(1 for row in m if sum(row) > 0)
    loss_terms, grad, n_clipped = [], [[0.0] * len(row) for row in v], 0
    for i, row in enumerate(v):
        n_i = sum(m[i])
        for t, x in enumerate(row):
            if not m[i][t]:
                continue
            coef = {"token-mean": 1.0 / n_valid, "token-sum": 1.0, "seq-mean-token-sum": 1.0 / n_rows,
                    "seq-mean-token-mean": 1.0 / (n_rows * (n_i + 1e-8)),
                    "seq-mean-token-sum-norm": 1.0 / (n_rows * len(row))}[loss_agg_mode]
            clipped_v = min(max(x, ov[i][t] - cliprange_value), ov[i][t] + cliprange_value)
            l1, l2 = (x - ret[i][t]) ** 2, (clipped_v - ret[i][t]) ** 2
            n_clipped += l2 > l1
            loss_terms.append(0.5 * coef * max(l1, l2))
            grad[i][t] = 0.5 * coef * (2.0 * (x - ret[i][t]) if l1 >= l2 else 0.0)
    return (math.fsum(loss_terms), n_clipped / (n_valid + 1e-8),
            torch.tensor(grad, dtype=torch.float64).view(values.shape))


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cliprange", [0.0, 0.2, 0.5])
def test_matches_float64_reference(backend, device, loss_agg_mode, cliprange):
    b, t = 5, 9
    values = torch.randn(b, t, device=device, requires_grad=True)
    old = values.detach() + torch.randn(b, t, device=device) * 0.5
    returns = torch.randn(b, t, device=device)
    mask = (torch.rand(b, t, device=device) > 0.3).float()
    mask[0] = 0
    mask[1, 1:] = 0  # a length-1 row
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange, loss_agg_mode)
    v64 = values.detach().double().requires_grad_()
    loss64, clipfrac64 = ref.value_loss(v64, old.double(), returns.double(), mask.double(), cliprange, loss_agg_mode)
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clipfrac.double(), clipfrac64, atol=1e-6, rtol=1e-6)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(values.grad.double(), v64.grad, atol=1e-6, rtol=1e-5)
    # the independent oracle too (for the torch backend, reference.py is the code under test)
    loss_o, clipfrac_o, grad_o = oracle_value_loss(values, old, returns, mask, cliprange, loss_agg_mode)
    torch.testing.assert_close(loss.double().cpu(), torch.tensor(loss_o, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clipfrac.double().cpu(), torch.tensor(clipfrac_o, dtype=torch.float64),
                               atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(values.grad.double().cpu(), grad_o, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_reference_matches_independent_oracle(loss_agg_mode):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: loss, clip fraction and the autograd gradient, with an all-masked row and a length-1 row."""
    for cliprange in (0.0, 0.2, 0.5):
        values = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
        old = values.detach() + torch.randn(5, 9, dtype=torch.float64) * 0.5
        returns = torch.randn(5, 9, dtype=torch.float64)
        mask = (torch.rand(5, 9) > 0.3).double()
        mask[0], mask[1, 1:] = 0, 0
        loss, clipfrac = ref.value_loss(values, old, returns, mask, cliprange, loss_agg_mode)
        loss_o, clipfrac_o, grad_o = oracle_value_loss(values, old, returns, mask, cliprange, loss_agg_mode)
        torch.testing.assert_close(loss, torch.tensor(loss_o, dtype=torch.float64), atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(clipfrac, torch.tensor(clipfrac_o, dtype=torch.float64), atol=1e-9, rtol=1e-9)
        loss.backward()
        torch.testing.assert_close(values.grad, grad_o, atol=1e-9, rtol=1e-9)


def test_bf16_against_independent_oracle(backend, device):
    values = torch.randn(4, 7, device=device).bfloat16().requires_grad_()
    old = (values.detach().float() + torch.randn(4, 7, device=device) * 0.5).bfloat16()
    returns = torch.randn(4, 7, device=device).bfloat16()
    mask = torch.rand(4, 7, device=device) > 0.3
    mask[2] = False
    loss, clipfrac = value_loss(values, old, returns, mask, 0.2, "seq-mean-token-mean")
    loss.backward()
    assert values.grad.dtype == torch.bfloat16
    loss_o, clipfrac_o, grad_o = oracle_value_loss(values, old, returns, mask.double(), 0.2, "seq-mean-token-mean")
    torch.testing.assert_close(loss.double().cpu(), torch.tensor(loss_o, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clipfrac.double().cpu(), torch.tensor(clipfrac_o, dtype=torch.float64),
                               atol=1e-6, rtol=1e-6)
    # the gradient is stored in bf16
    torch.testing.assert_close(values.grad.double().cpu(), grad_o, atol=1e-5, rtol=1e-2)


def test_hand_computed(backend, device):
    v = torch.tensor([[1.0, 0.0]], device=device, requires_grad=True)
    old = torch.tensor([[0.0, 0.0]], device=device)
    ret = torch.tensor([[0.0, 2.0]], device=device)
    # token 0: v clipped to 0.5, l = max(1, 0.25) = 1; token 1: v in range, l = 4
    loss, clipfrac = value_loss(v, old, ret, torch.ones(1, 2, device=device), 0.5)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (1 + 4) / 2, device=device))
    assert clipfrac.item() == 0.0
    loss.backward()
    torch.testing.assert_close(v.grad.cpu(), torch.tensor([[0.5 * 2 * 1.0 / 2, 0.5 * 2 * -2.0 / 2]]))


def test_bad_input(backend):
    with pytest.raises(ValueError, match="returns: shape"):
        value_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(3, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), -1.0)
