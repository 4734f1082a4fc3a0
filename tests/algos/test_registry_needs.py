"""What registry entries declare (pyrl.algos.registry.Needs) is what the trainer gives them and what the start
checks hold them to: compute_advantage passes an estimator exactly its declared fields (a missing one named), a
user's estimator registered verl's way gets verl's optional fields, and a loss's or estimator's settings are
checked before any worker starts, naming the key in full."""

import inspect

import numpy as np
import pytest
import torch

from pyrl.algos.advantage import ESTIMATORS, register_adv_est
from pyrl.algos.policy_loss import POLICY_LOSSES
from pyrl.config import AlgorithmConfig, PPOConfig
from pyrl.protocol import DataProto
from pyrl.trainer.checks import check_registered_needs
from pyrl.trainer.ppo_trainer import compute_advantage


def step_batch(rows=4, width=3, **extra):
    g = torch.Generator().manual_seed(7)
    tensors = {"token_level_rewards": torch.rand(rows, width, generator=g), "response_mask": torch.ones(rows, width)}
    tensors.update(extra)
    batch = DataProto.from_dict(tensors)
    batch.non_tensor_batch["uid"] = np.array(["a", "a", "b", "b"][:rows], dtype=object)
    return batch


def test_every_builtin_estimator_gets_what_it_declares():
    seen = {}
    for name in sorted(ESTIMATORS.functions):
        needs = ESTIMATORS.needs(name)
        extra = {key: torch.rand(4, 3) for key in needs.tensors}
        extra.update({key: torch.ones(4, 3) for key in needs.optional_tensors if key != "values"})
        if "reward_baselines" in extra:
            extra["reward_baselines"] = torch.rand(4)
        batch = step_batch(**extra)
        config = AlgorithmConfig(adv_estimator=name)
        if needs.non_tensor_batch:
            batch.non_tensor_batch["r"] = np.array([1.0, 0.0, 0.5, 0.5], dtype=object)
            config.gdpo_reward_keys = ["r"]
        seen[name] = compute_advantage(batch, config)
        assert batch.batch["advantages"].shape == (4, 3) and torch.isfinite(batch.batch["advantages"]).all(), name
        for key in needs.tensors:  # without a declared field: a KeyError naming it and the estimator
            missing = step_batch(**{k: v for k, v in extra.items() if k != key})
            with pytest.raises(KeyError, match=f"adv_estimator={name} needs \\['{key}'\\]"):
                compute_advantage(missing, config)
    assert set(seen["gdpo"]) == {f"gdpo/r/{stat}" for stat in ("mean", "std", "max", "min")}
    assert all(not metrics for name, metrics in seen.items() if name != "gdpo")


def test_a_users_estimator_registered_the_verl_way_gets_verls_optional_fields():
    received = {}

    @register_adv_est("test_user_estimator")
    def user_estimator(token_level_rewards, response_mask, index, **kwargs):
        received.update(kwargs)
        return token_level_rewards, token_level_rewards

    try:
        compute_advantage(step_batch(values=torch.zeros(4, 3)), AlgorithmConfig(adv_estimator="test_user_estimator"))
        assert "values" in received and "reward_baselines" not in received
    finally:
        del ESTIMATORS.functions["test_user_estimator"]


def test_the_trainer_names_no_algorithm():
    source = inspect.getsource(compute_advantage)
    assert not [name for name in ESTIMATORS.functions if f'"{name}"' in source]


@pytest.mark.parametrize("loss, settings, match", [
    ("dro", {}, r"actor_rollout_ref.actor.policy_loss.dro_beta: must be a number > 0 for loss_mode=dro, got None"),
    ("clip_cov", {"clip_cov_lb": 2.0, "clip_cov_ub": 1.0},
     r"actor_rollout_ref.actor.policy_loss.clip_cov_ub: must be a number > policy_loss.clip_cov_lb"),
    ("kl_cov", {"ppo_kl_coef": -1.0}, r"actor_rollout_ref.actor.policy_loss.ppo_kl_coef: must be a number >= 0"),
    ("sapo", {"tau_pos": 0.0}, r"actor_rollout_ref.actor.tau_pos: must be a number > 0"),
    ("dppo_kl", {"clip_ratio_c": -3.0}, r"actor_rollout_ref.actor.clip_ratio_c: must be a number > 0"),
])
def test_a_losss_settings_are_checked_at_start(loss, settings, match):
    config = PPOConfig()
    actor = config.actor_rollout_ref.actor
    actor.policy_loss.loss_mode = loss
    for key, value in settings.items():
        setattr(actor if key in ("tau_pos", "clip_ratio_c") else actor.policy_loss, key, value)
    assert POLICY_LOSSES.needs(loss).check is not None
    with pytest.raises(ValueError, match=match):
        check_registered_needs(config)
    if loss == "dro":
        actor.policy_loss.dro_beta = 0.1
        check_registered_needs(config)


def test_an_estimators_needs_are_checked_at_start():
    config = PPOConfig()
    config.algorithm.adv_estimator = "gdpo"
    with pytest.raises(ValueError, match="gdpo needs algorithm.gdpo_reward_keys"):
        check_registered_needs(config)
    config.algorithm.gdpo_reward_keys, config.algorithm.gdpo_reward_weights = ["a"], [1.0, 2.0]
    with pytest.raises(ValueError, match="2 algorithm.gdpo_reward_weights for 1 gdpo_reward_keys"):
        check_registered_needs(config)
    config.algorithm.adv_estimator = "optimal_token_baseline"
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        check_registered_needs(config)
    config.actor_rollout_ref.actor.calculate_sum_pi_squared = True
    config.algorithm.rollout_correction.bypass_mode = True
    with pytest.raises(ValueError, match="needs the old-log-prob pass"):
        check_registered_needs(config)
