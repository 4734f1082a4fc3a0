import math

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


def oracle_agg_weights(mask, loss_agg_mode):
    """c[i][t] with agg_loss(l, mask, mode) = sum_{i,t} c[i][t] l[i][t] (binary mask, no global_batch_info), written
    out per mode from verl 0.9.1's agg_loss; N valid tokens, S non-empty rows, n_i tokens of row i, T the width:
    token-mean 1/N, token-sum 1, seq-mean-token-sum 1/S, seq-mean-token-mean 1/(S (n_i + 1e-8)) (verl's epsilon),
    seq-mean-token-sum-norm 1/(S T); 0 where masked (and everywhere when nothing is valid)."""
    rows = [[float(k) for k in row] for row in mask]
    assert all(k in (0.0, 1.0) for row in rows for k in row)
    n_valid = sum(sum(row) for row in rows)
    n_rows = sum(1 for row in rows if sum(row) > 0)
    width = len(rows[0]) if rows else 0
    per_token = {
        "token-mean": lambda row: 1.0 / n_valid,
        "token-sum": lambda row: 1.0,
        "seq-mean-token-sum": lambda row: 1.0 / n_rows,
        "seq-mean-token-mean": lambda row: 1.0 / (n_rows * (sum(row) + 1e-8)),
        "seq-mean-token-sum-norm": lambda row: 1.0 / (n_rows * width),
    }[loss_agg_mode]
    return [[per_token(row) * k if k else 0.0 for k in row] for row in rows]


def oracle_policy_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                       clip_ratio_c=3.0, loss_agg_mode="token-mean", loss_mode="vanilla", rollout_is_weights=None):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs, nor pyrl.ops.masked, which
    every backend aggregates with): token by token in Python floats from the op's formulas (verl 0.9.1's policy
    losses), with the derivatives of the per-token loss l wrt log_prob and advantages derived by hand, then
    aggregated with oracle_agg_weights. Returns (loss, metrics, dloss/dlog_prob, dloss/dadvantages,
    dloss/drollout_is_weights); floats / float64 tensors."""
    lp, old, adv, m = (x.detach().double().cpu().tolist() for x in (log_prob, old_log_prob, advantages, response_mask))
    weights = None if rollout_is_weights is None else rollout_is_weights.detach().double().cpu().tolist()
    lo, hi, c = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high, clip_ratio_c
    coef = oracle_agg_weights(m, loss_agg_mode)
    loss_terms, n_clipped, n_lower, kl_terms, n_valid = [], 0, 0, [], 0
    g_lp, g_adv, g_w = ([[0.0] * len(row) for row in lp] for _ in range(3))
    for i, row in enumerate(lp):
        if loss_mode == "gspo":  # sequence log-ratio: mean over the row's valid tokens of the (unclamped) log-ratio
            valid = [row[t] - old[i][t] for t in range(len(row)) if m[i][t]]
            seq = math.fsum(valid) / max(1, len(valid))
            seq_ratio = math.exp(min(seq, 10.0))
        for t, x in enumerate(row):
            a, raw = adv[i][t], x - old[i][t]
            clipped = lower = False
            if loss_mode == "gpg":
                loss_t, dl, da, kl = -a * x, -a, -x, 0.0
            elif loss_mode == "gspo":  # value: the sequence ratio; gradient: d ratio / d logp_t = ratio (below the cap)
                ratio, dratio, kl = seq_ratio, (seq_ratio if seq <= 10.0 else 0.0), -raw
                clipped_ratio = min(max(ratio, lo), hi)
                clipped = -a * clipped_ratio > -a * ratio
                loss_t, dl, da = ((-a * clipped_ratio, 0.0, -clipped_ratio) if clipped
                                  else (-a * ratio, -a * dratio, -ratio))
            else:
                delta = min(max(raw, -20.0), 20.0)
                ratio, kl = math.exp(delta), -delta
                dratio = ratio if -20.0 <= raw <= 20.0 else 0.0
                clipped_ratio = min(max(ratio, lo), hi)
                if loss_mode == "cispo":  # the clipped ratio is a constant
                    loss_t, dl, da = -clipped_ratio * a * x, -clipped_ratio * a, -clipped_ratio * x
                    clipped = clipped_ratio != ratio
                else:  # vanilla: the clipped branch is flat in logp; dual clip for a < 0
                    clipped = -a * clipped_ratio > -a * ratio
                    loss_t, dl, da = ((-a * clipped_ratio, 0.0, -clipped_ratio) if clipped
                                      else (-a * ratio, -a * dratio, -ratio))
                    if a < 0 and loss_t > -a * c:
                        lower = True
                        loss_t, dl, da = -a * c, 0.0, -c
            w = 1.0 if weights is None else weights[i][t]
            loss_terms.append(coef[i][t] * w * loss_t)
            g_lp[i][t], g_adv[i][t], g_w[i][t] = coef[i][t] * w * dl, coef[i][t] * w * da, coef[i][t] * loss_t
            if m[i][t]:
                n_valid += 1
                n_clipped += clipped
                n_lower += lower
                kl_terms.append(kl)
    mean = lambda total: total / (n_valid + 1e-8)  # noqa: E731  (verl's masked_mean)
    metrics = {"pg_clipfrac": mean(n_clipped), "pg_clipfrac_lower": mean(n_lower), "ppo_kl": mean(math.fsum(kl_terms))}
    if loss_mode == "gpg":
        metrics = dict.fromkeys(metrics, 0.0)
    as_t = lambda x: torch.tensor(x, dtype=torch.float64).view(log_prob.shape)  # noqa: E731
    return math.fsum(loss_terms), metrics, as_t(g_lp), as_t(g_adv), as_t(g_w)


def _check_oracle(loss, metrics, grad, oracle):
    """A backend's (loss, metrics, d loss / d log_prob) against oracle_policy_loss's, at the float32 tolerances
    above."""
    loss_o, metrics_o, grad_o = oracle[:3]
    torch.testing.assert_close(loss.double().cpu(), torch.tensor(loss_o, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for name, value in metrics_o.items():
        torch.testing.assert_close(metrics[name].double().cpu(), torch.tensor(value, dtype=torch.float64), atol=1e-5,
                                   rtol=1e-5, msg=lambda text, name=name: f"metric {name}: {text}")
    torch.testing.assert_close(grad.double().cpu(), grad_o, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_matches_float64_reference(backend, device, loss_mode, loss_agg_mode):
    logp, old, adv, mask = _inputs(device=device)
    logp = logp.requires_grad_()
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode,
                  loss_mode=loss_mode)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, **kwargs)
    lp64 = logp.detach().double().requires_grad_()
    loss64, metrics64 = ref.ppo_policy_loss(lp64, old.double(), adv.double(), mask.double(), **kwargs)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for name in metrics:
        torch.testing.assert_close(metrics[name].double().cpu(), metrics64[name].detach().double().cpu(),
                                   atol=1e-5, rtol=1e-5)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(logp.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    # the independent oracle too (for the torch backend, and gspo on every backend, reference.py is the code under test)
    _check_oracle(loss, metrics, logp.grad, oracle_policy_loss(logp, old, adv, mask, **kwargs))


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
def test_a_lower_clip_ratio_of_one_or_more_leaves_no_lower_bound(backend, device, loss_mode):
    """clip_ratio_low >= 1 (verl 0.9.1's CISPO example sets 10): the lower bound 1 - low <= 0 lies under every
    ratio, so nothing is clipped below; as the float64 oracle, and as clip_ratio_low = 1."""
    logp, old, adv, mask = _inputs(device=device)
    logp = logp.requires_grad_()
    kwargs = dict(clip_ratio_low=10.0, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_mode=loss_mode)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, **kwargs)
    loss.backward()
    _check_oracle(loss, metrics, logp.grad, oracle_policy_loss(logp, old, adv, mask, **kwargs))
    at_one, _ = ppo_policy_loss(logp.detach(), old, adv, mask, **{**kwargs, "clip_ratio_low": 1.0})
    torch.testing.assert_close(loss.detach(), at_one, atol=1e-6, rtol=1e-6)


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
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode,
                  loss_mode=loss_mode)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights, **kwargs)
    lp64 = logp.detach().double().requires_grad_()
    loss64, metrics64 = ref.ppo_policy_loss(lp64, old.double(), adv.double(), mask.double(),
                                            rollout_is_weights=weights.double(), **kwargs)
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    _, unweighted_metrics = ppo_policy_loss(logp.detach(), old, adv, mask, **kwargs)
    for name in metrics:
        torch.testing.assert_close(metrics[name], unweighted_metrics[name])
        torch.testing.assert_close(metrics[name].double().cpu(), metrics64[name].detach().double().cpu(),
                                   atol=1e-5, rtol=1e-5)
    loss.backward()
    loss64.backward()
    torch.testing.assert_close(logp.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    assert weights.grad is None
    _check_oracle(loss, metrics, logp.grad,
                  oracle_policy_loss(logp, old, adv, mask, rollout_is_weights=weights, **kwargs))
    # d loss / d log_prob = w x the unweighted per-token derivative, for a token-sum aggregation (linear in each token)
    lp = logp.detach().double().requires_grad_()
    kwargs["loss_agg_mode"] = "token-sum"
    (plain,) = torch.autograd.grad(ref.ppo_policy_loss(lp, old.double(), adv.double(), mask.double(), **kwargs)[0], lp)
    (grad,) = torch.autograd.grad(ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights, **kwargs)[0], logp)
    torch.testing.assert_close(grad.double(), plain * weights.double(), atol=1e-6, rtol=1e-5)


def test_rollout_is_weights_of_ones_change_nothing_and_get_gradients_when_asked(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    torch.testing.assert_close(ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=torch.ones_like(logp))[0],
                               plain)
    weights = _weights(logp).requires_grad_()
    ppo_policy_loss(logp, old, adv, mask, rollout_is_weights=weights)[0].backward()
    w64 = weights.detach().double().requires_grad_()
    ref.ppo_policy_loss(logp.double(), old.double(), adv.double(), mask.double(), rollout_is_weights=w64)[0].backward()
    torch.testing.assert_close(weights.grad.double(), w64.grad, atol=1e-6, rtol=1e-5)
    grad_w_o = oracle_policy_loss(logp, old, adv, mask, rollout_is_weights=weights)[4]  # independent of reference.py
    torch.testing.assert_close(weights.grad.double().cpu(), grad_w_o, atol=1e-6, rtol=1e-5)


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
    loss64, _ = ref.ppo_policy_loss(lp16.detach().double(), old.bfloat16().double(), adv.bfloat16().double(),
                                    mask.double())
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert lp16.grad.dtype == torch.bfloat16
    # the independent oracle on the bf16 values; the gradient is stored in bf16 (8 significant bits)
    oracle = oracle_policy_loss(lp16, old.bfloat16(), adv.bfloat16(), mask)
    torch.testing.assert_close(loss.double().cpu(), torch.tensor(oracle[0], dtype=torch.float64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp16.grad.double().cpu(), oracle[2], atol=1e-5, rtol=1e-2)


def test_grad_flows_to_advantages_when_asked(backend, device):
    logp, old, adv, mask = _inputs(device=device)
    adv = adv.requires_grad_()
    loss, _ = ppo_policy_loss(logp, old, adv, mask)
    loss.backward()
    adv64 = adv.detach().double().requires_grad_()
    ref.ppo_policy_loss(logp.double(), old.double(), adv64, mask.double())[0].backward()
    torch.testing.assert_close(adv.grad.double(), adv64.grad, atol=1e-6, rtol=1e-5)
    # every backend runs reference.py when advantages require grad: the independent oracle is the real check
    grad_adv_o = oracle_policy_loss(logp, old, adv, mask)[3]
    torch.testing.assert_close(adv.grad.double().cpu(), grad_adv_o, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_reference_matches_independent_oracle(loss_mode, loss_agg_mode):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: loss, metrics and the autograd gradients wrt log_prob, advantages and rollout_is_weights, on the inputs
    above (the +-20 clamp, the dual clip, an all-masked row, a length-1 row)."""
    logp, old, adv, mask = (x.double() for x in _inputs())
    weights = _weights(logp).double()
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode,
                  loss_mode=loss_mode)
    for w in (None, weights):
        lp, a = logp.clone().requires_grad_(), adv.clone().requires_grad_()
        w = None if w is None else w.clone().requires_grad_()
        loss, metrics = ref.ppo_policy_loss(lp, old, a, mask, rollout_is_weights=w, **kwargs)
        loss_o, metrics_o, grad_lp_o, grad_adv_o, grad_w_o = oracle_policy_loss(logp, old, adv, mask,
                                                                                rollout_is_weights=w, **kwargs)
        torch.testing.assert_close(loss, torch.tensor(loss_o, dtype=torch.float64), atol=1e-9, rtol=1e-9)
        for name, value in metrics_o.items():
            torch.testing.assert_close(metrics[name].detach(), torch.tensor(value, dtype=torch.float64), atol=1e-9,
                                       rtol=1e-9, msg=lambda text, name=name: f"metric {name}: {text}")
        loss.backward()
        torch.testing.assert_close(lp.grad, grad_lp_o, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(a.grad, grad_adv_o, atol=1e-9, rtol=1e-9)
        if w is not None:
            torch.testing.assert_close(w.grad, grad_w_o, atol=1e-9, rtol=1e-9)


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
        ({"clip_ratio_low": -0.1}, ValueError, "clip_ratio_low"),
        ({"clip_ratio_low": float("nan")}, ValueError, "clip_ratio_low"),
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
        with pytest.raises(ValueError, match=r"rollout_is_weights: shape \(.*\) "
                                             r"does not match log_prob shape \(2, 3\)"):
            ppo_policy_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3),
                            rollout_is_weights=weights)
