"""A run killed (SIGKILL) right after its step-2 checkpoint and started again with the same command gives
the same metrics for steps 3 and 4 as a run that was never interrupted, with either rollout engine."""

import pytest

from trainer_helpers import SMALL, kill_after_checkpoint, read_metrics, run_cli

COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/entropy", "actor/grad_norm", "actor/lr", "critic/advantages/max"]
TOLERANCE = 1e-6  # relative; in practice the runs agree exactly (same seeds, same float operations)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_kill_and_resume_reproduces_the_uninterrupted_run(engine, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm")
    args = [*SMALL, "trainer.total_training_steps=4", "trainer.save_freq=2", f"actor_rollout_ref.rollout.name={engine}",
            "actor_rollout_ref.actor.optim.lr=0.002"]
    full, part = tmp_path / "full", tmp_path / "part"
    proc = run_cli(args + [f"trainer.default_local_dir={full}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    kill_after_checkpoint(args, part, 2, cwd=tmp_path)

    proc = run_cli(args + [f"trainer.default_local_dir={part}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, resumed = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(reference[2:], resumed[2:]):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=TOLERANCE, abs=1e-9), (got["step"], key)


def test_rerunning_in_a_used_run_directory(tmp_path, ray_session, caplog):
    """Without a checkpoint the same command starts over and metrics.jsonl holds the new run only (not the
    old one with a second run appended); max_actor_ckpt_to_keep keeps the newest checkpoints; with the
    final checkpoint there is nothing left to train."""
    from pyrl.ppo import run_ppo
    from trainer_helpers import compose

    args = [*SMALL, "trainer.total_training_steps=1", "actor_rollout_ref.rollout.name=hf",
            f"trainer.default_local_dir={tmp_path}"]
    run_ppo(compose(*args))
    first = read_metrics(tmp_path)
    run_ppo(compose(*args))
    again = read_metrics(tmp_path)
    assert [r["step"] for r in again] == [1]
    assert again[0]["critic/score/mean"] == first[0]["critic/score/mean"]  # the same seeded run

    saving = [*args, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2"]
    run_ppo(compose(*saving))
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    with caplog.at_level("INFO", logger="pyrl"):
        run_ppo(compose(*saving))
    assert "the checkpoint is at step 3 of 3: nothing left to train" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
