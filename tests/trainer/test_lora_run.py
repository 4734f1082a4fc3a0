"""LoRA runs through the trainer: the rollout engines get the merged adapters every step, so their log-probs match
the trainer's at float32 noise (training/rollout_probs_diff_*) over several updates; a critic with LoRA trains
and resumes; the merged checkpoint is what the run trained."""

import os

import pytest
from trainer_helpers import FP32, SMALL, assert_rollout_matches_trainer, compose, read_metrics

LORA = ["actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.actor.optim.lr=0.003"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_lora_rollout_log_probs_match_the_trainer(engine, tmp_path, ray_session):
    if engine == "vllm":
        pytest.importorskip("vllm")
    from pyrl.ppo import run_ppo

    # 32 prompts: the 8 of SMALL's first batches drew no right answer from the toy warm-start at seed 0 (no
    # advantage, no update, nothing for the KL check to see)
    config = compose(*SMALL, *LORA, *FP32, f"actor_rollout_ref.rollout.name={engine}", "data.train_batch_size=32",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                     "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.ppo_epochs=2",
                     "actor_rollout_ref.actor.use_kl_loss=true", "trainer.total_training_steps=3",
                     f"trainer.default_local_dir={tmp_path}")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert_rollout_matches_trainer(rows, 3)
    # the adapters moved the policy away from the reference (the base model), which the KL loss measures
    assert rows[-1]["actor/kl_loss"] > 1e-6


def test_lora_actor_and_critic_train_and_resume(tmp_path, ray_session):
    """GAE with LoRA on both models, checkpointed every step; pointed back at the step-1 checkpoint (as a run killed
    after it), the rerun's step 2 equals the first run's: the adapters, the critic's value head and both optimizers
    come back exactly."""
    from pyrl.ppo import run_ppo

    keys = [*SMALL, *LORA, "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=gae",
            "critic.model.lora_rank=4", "critic.model.lora_alpha=8", "critic.optim.lr=0.003",
            "trainer.total_training_steps=2", "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path}"]
    run_ppo(compose(*keys))
    straight = read_metrics(tmp_path)
    assert os.path.isfile(tmp_path / "global_step_1" / "critic" / "lora_adapter" / "adapter_config.json")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    run_ppo(compose(*keys))
    resumed = read_metrics(tmp_path)
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert straight[1][key] != 0, key
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-7), key
