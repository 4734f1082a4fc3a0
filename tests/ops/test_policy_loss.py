import pytest
import torch

from pyrl.ops import LOSS_AGG_MODES, ppo_policy_loss
from pyrl.ops import reference as ref


def _inputs(b=6, t=11, device="cpu"):
    logp = -torch.rand(b, t) * 3
    old = logp + torch.randn(b, t) * 0.3  # ratios on both sides of the clip range
    old[0, :2] = logp[0, :2] + torch.tensor([30.0, -30.0])  # beyond the +-20 log-ratio clamp
    adv = torch.randn(b, t)
    adv[1, :] = -2.0  # dual clip region for large ratios
    old[1, :4] = logp[1, :4] - 2.0
    mask = (torch.rand(b, t) > 0.25).float()
    mask[2] = 0.0  # an all-masked row
    mask[3, 1:] = 0.0  # a length-1 response
    return [x.to(device) for x in (logp, old, adv, mask)]


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_matches_float64_reference(backend, device, loss_mode, loss_agg_mode):
    logp, old, adv, mask = _inputs(device=device)
    logp = logp.requires_grad_()
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode, loss_mode=loss_mode)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, **kwargs)
    lp64 = logp.detach().double().requires_grad_()
    loss64, metrics64 = ref.ppo_policy_loss(lp64, old.double(), adv.double(), mask.double(), **kwargs)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for name in metrics:
        torch.testing.assert_close(metrics[name].double().cpu(), metrics64[name].detach().double().cpu(), atol=1e-5, rtol=1e-5)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(logp.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)


def _weights(like):
    """Random positive rollout_is_weights, about a quarter exactly 0, some above 1."""
    weights = torch.rand(like.shape, device=like.device) * 2.5
    return torch.where(torch.rand(like.shape, device=like.device) < 0.25, 0.0, weights)


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_rollout_is_weights_match_float64(backend, device, loss_mode, loss_agg_mode):
    """The per-token loss times the weights before aggregation: against the float64 torch formulation, and against
    the unweighted one given the weighted loss matrix; metrics unweighted; gradients to log_prob only."""
    logp, old, adv, mask = _inputs(device=device)
    weights = _weights(logp)
    logp = logp.requires_grad_()
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode, loss_mode=loss_mode)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights, **kwargs)
    lp64 = logp.detach().double().requires_grad_()
    loss64, metrics64 = ref.ppo_policy_loss(lp64, old.double(), adv.double(), mask.double(), rollout_is_weights=weights.double(),
                                            **kwargs)
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    _, unweighted_metrics = ppo_policy_loss(logp.detach(), old, adv, mask, **kwargs)
    for name in metrics:
        torch.testing.assert_close(metrics[name], unweighted_metrics[name])
        torch.testing.assert_close(metrics[name].double().cpu(), metrics64[name].detach().double().cpu(), atol=1e-5, rtol=1e-5)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(logp.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    assert weights.grad is None
    # d loss / d log_prob = w x the unweighted per-token derivative, for a token-sum aggregation (linear in each token)
    lp = logp.detach().double().requires_grad_()
    kwargs["loss_agg_mode"] = "token-sum"
    (plain,) = torch.autograd.grad(ref.ppo_policy_loss(lp, old.double(), adv.double(), mask.double(), **kwargs)[0], lp)
    (grad,) = torch.autograd.grad(ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights, **kwargs)[0], logp)
    torch.testing.assert_close(grad.double(), plain * weights.double(), atol=1e-6, rtol=1e-5)


def test_rollout_is_weights_of_ones_change_nothing_and_get_gradients_when_asked(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    torch.testing.assert_close(ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=torch.ones_like(logp))[0], plain)
    weights = _weights(logp).requires_grad_()
    ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights)[0].backward()
    w64 = weights.detach().double().requires_grad_()
    ref.ppo_policy_loss(logp.double(), old.double(), adv.double(), mask.double(), rollout_is_weights=w64)[0].backward()
    torch.testing.assert_close(weights.grad.double(), w64.grad, atol=1e-6, rtol=1e-5)


def test_hand_computed_vanilla(backend, device):
    # ratio = e^{delta}; A = +1 and ratio 1.5 -> clipped at 1.2 (flat, no grad); A = -1 and ratio 5 -> dual clip at 3
    logp = torch.log(torch.tensor([[1.5, 5.0, 1.0]], device=device)).requires_grad_()
    old = torch.zeros(1, 3, device=device)
    adv = torch.tensor([[1.0, -1.0, 2.0]], device=device)
    mask = torch.ones(1, 3, device=device)
    loss, m = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0)
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 3.0 - 2.0) / 3, device=device))
    torch.testing.assert_close(m["pg_clipfrac"].cpu(), torch.tensor(1 / 3))  # token 0: l2 = -1.2 > l1 = -1.5
    torch.testing.assert_close(m["pg_clipfrac_lower"].cpu(), torch.tensor(1 / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad.cpu(), torch.tensor([[0.0, 0.0, -2.0 / 3]]))


def test_bf16_and_bool_mask(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    lp16 = logp.bfloat16().requires_grad_()
    loss, _ = ppo_policy_loss(lp16, old.bfloat16(), adv.bfloat16(), mask.bool())
    loss64, _ = ref.ppo_policy_loss(lp16.detach().double(), old.bfloat16().double(), adv.bfloat16().double(), mask.double())
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert lp16.grad.dtype == torch.bfloat16


def test_grad_flows_to_advantages_when_asked(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    adv = adv.requires_grad_()
    loss, _ = ppo_policy_loss(logp, old, adv, mask)
    loss.backward()
    adv64 = adv.detach().double().requires_grad_()
    ref.ppo_policy_loss(logp.double(), old.double(), adv64, mask.double())[0].backward()
    torch.testing.assert_close(adv.grad.double(), adv64.grad, atol=1e-6, rtol=1e-5)


def test_all_masked_gives_zero_loss(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    loss, metrics = ppo_policy_loss(logp, old, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"loss_mode": "ppo2"}, ValueError, "loss_mode: unknown 'ppo2'"),
        ({"loss_agg_mode": "sum"}, ValueError, "loss_agg_mode: unknown mode 'sum'"),
        ({"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c: the dual-clip bound must be > 1"),
        ({"clip_ratio_low": 1.5}, ValueError, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, ValueError, "clip_ratio_high"),
    ],
)
def test_bad_options(backend, kwargs, err, match):
    logp, old, adv, mask = _inputs()
    with pytest.raises(err, match=match):
        ppo_policy_loss(logp, old, adv, mask, **kwargs)


def test_bad_shapes(backend):
    with pytest.raises(ValueError, match="advantages: shape"):
        ppo_policy_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3))
    with pytest.raises(TypeError, match="old_log_prob: expected a torch.Tensor"):
        ppo_policy_loss(torch.randn(2, 3), None, torch.randn(2, 3), torch.ones(2, 3))
    for weights in (torch.ones(2, 4), torch.ones(2, 1), torch.ones(3)):
        with pytest.raises(ValueError, match=r"rollout_is_weights: shape \(.*\) does not match log_prob shape \(2, 3\)"):
            ppo_policy_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), rollout_is_weights=weights)
