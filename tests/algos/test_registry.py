import numpy as np
import pytest
import torch

from pyrl.algos import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from pyrl.ops import masked_whiten
from pyrl.ops import reference as ref


def _batch(b=8, t=6):
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,))[:, None]).float()
    rewards = torch.zeros(b, t)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(b), last] = torch.randint(0, 2, (b,)).float()  # outcome on the last valid token
    index = np.array(["p0", "p0", "p1", "p1", "p1", "p2", "p2", "p3"], dtype=object)
    return rewards, mask, index


def test_registries_hold_the_issue_list():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "reinforce_plus_plus",
            "remax"} <= set(ADV_ESTIMATOR_REGISTRY)
    assert {"vanilla", "gspo", "gpg", "cispo"} <= set(POLICY_LOSS_REGISTRY)
    for fn in list(ADV_ESTIMATOR_REGISTRY.values()) + list(POLICY_LOSS_REGISTRY.values()):
        assert fn.__doc__ and len(fn.__doc__) > 20, f"{fn.__name__} needs its formula in its docstring"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'; known: .*grpo"):
        get_adv_estimator_fn("ppo")
    with pytest.raises(ValueError, match="Unknown policy loss 'clip'; known: .*vanilla"):
        get_policy_loss_fn("clip")


def test_register_custom_and_clash():
    @register_adv_est("test_constant")
    def constant(token_level_rewards, response_mask, **_):
        """A = 1 on every valid token."""
        return response_mask.clone(), response_mask.clone()

    assert get_adv_estimator_fn("test_constant") is constant
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("test_constant")(lambda **_: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a: None)
    del ADV_ESTIMATOR_REGISTRY["test_constant"]


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg"])
def test_group_estimators_broadcast_verl_values(name):
    rewards, mask, index = _batch()
    adv, ret = get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=index)
    ids = torch.tensor([int(s[1:]) for s in index])
    per_sample = ref.group_advantages(rewards.sum(-1).double(), ids, name, lengths=mask.sum(-1))
    torch.testing.assert_close(adv.double(), per_sample[:, None] * mask.double(), atol=1e-5, rtol=1e-5)
    assert torch.equal(adv, ret)


def test_grpo_passk_and_rpp_baseline():
    rewards, mask, index = _batch()
    adv, _ = get_adv_estimator_fn("grpo_passk")(rewards, mask, index[[0, 1, 2, 3, 4, 5, 6, 6]])
    assert adv.shape == rewards.shape
    adv, _ = get_adv_estimator_fn("reinforce_plus_plus_baseline")(rewards, mask, index)
    ids = torch.tensor([int(s[1:]) for s in index])
    base = ref.group_advantages(rewards.sum(-1).double(), ids, "reinforce_plus_plus_baseline")[:, None] * mask.double()
    torch.testing.assert_close(adv.double(), masked_whiten(base, mask.double()) * mask.double(), atol=1e-5, rtol=1e-5)


def test_gae_estimator():
    rewards, mask, _ = _batch()
    values = torch.randn_like(rewards)
    adv, ret = get_adv_estimator_fn("gae")(token_level_rewards=rewards, values=values, response_mask=mask,
                                           gamma=0.9, lam=0.8)
    adv64, ret64 = ref.compute_gae(rewards.double(), values.double(), mask.double(), 0.9, 0.8)
    torch.testing.assert_close(adv.double(), adv64, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_hand_computed():
    r = torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _, ret = get_adv_estimator_fn("reinforce_plus_plus")(r, m, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5 * (1 + 0.5 * 2), 1 + 0.5 * 2, 2.0], [1.5, 3.0, 0.0]]))


def test_remax_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator_fn("remax")(token_level_rewards=r, reward_baselines=torch.tensor([0.5, 2.0]),
                                             response_mask=m)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "cispo"])
@pytest.mark.parametrize("config", [None, {"clip_ratio": 0.2, "clip_ratio_high": 0.28}])
def test_policy_losses_match_reference(name, config):
    b, t = 4, 7
    log_prob = (-torch.rand(b, t)).requires_grad_()
    old = log_prob.detach() + torch.randn(b, t) * 0.2
    adv, mask = torch.randn(b, t), (torch.rand(b, t) > 0.2).float()
    loss, metrics = get_policy_loss_fn(name)(old, log_prob, adv, mask, "token-mean", config)
    high = 0.28 if config else 0.2
    loss64, _ = ref.ppo_policy_loss(log_prob.double(), old.double(), adv.double(), mask.double(), 0.2, high, 3.0,
                                    "token-mean", name)
    torch.testing.assert_close(loss.double(), loss64, atol=1e-5, rtol=1e-5)
    assert set(metrics) == (set() if name == "gpg" else {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"})  # as verl
