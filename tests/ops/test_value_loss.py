import pytest
import torch

from pyrl.ops import LOSS_AGG_MODES, value_loss
from pyrl.ops import reference as ref


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cliprange", [0.0, 0.2, 0.5])
def test_matches_float64_reference(backend, device, loss_agg_mode, cliprange):
    b, t = 5, 9
    values = torch.randn(b, t, device=device, requires_grad=True)
    old = values.detach() + torch.randn(b, t, device=device) * 0.5
    returns = torch.randn(b, t, device=device)
    mask = (torch.rand(b, t, device=device) > 0.3).float()
    mask[0] = 0
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange, loss_agg_mode)
    v64 = values.detach().double().requires_grad_()
    loss64, clipfrac64 = ref.value_loss(v64, old.double(), returns.double(), mask.double(), cliprange, loss_agg_mode)
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clipfrac.double(), clipfrac64, atol=1e-6, rtol=1e-6)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(values.grad.double(), v64.grad, atol=1e-6, rtol=1e-5)


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
