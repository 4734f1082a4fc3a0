"""A run killed (SIGKILL) right after its step-2 checkpoint and started again with the same command gives
the same metrics for steps 3 and 4 as a run that was never interrupted, with either rollout engine; a worker
killed mid-step stops the run with one line and the rerun resumes; a rerun in a used run directory."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from trainer_helpers import SMALL, kill_after_checkpoint, marked_processes, read_metrics, run_cli

COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/entropy", "actor/grad_norm", "actor/lr", "critic/advantages/max"]
TOLERANCE = 1e-6  # relative; in practice the runs agree exactly (same seeds, same float operations)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_kill_and_resume_reproduces_the_uninterrupted_run(engine, tmp_path, ray_session):
    """The killed run and its rerun on the command line; the uninterrupted one in this process, on the session's
    Ray (the same config, and a fresh interpreter's ~10 CPU-seconds less)."""
    from trainer_helpers import compose

    from pyrl.ppo import run_ppo

    if engine == "vllm":
        pytest.importorskip("vllm")
    args = [*SMALL, "trainer.total_training_steps=4", "trainer.save_freq=2", f"actor_rollout_ref.rollout.name={engine}",
            "actor_rollout_ref.actor.optim.lr=0.002"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_ppo(compose(*args, f"trainer.default_local_dir={full}"))

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
    from trainer_helpers import compose

    from pyrl.ppo import run_ppo

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


# timing-bound (the run must stop within 30 s of the signal): run alone, after the parallel tests; the tests above
# are not (the kill waits on a file, whatever the load)
@pytest.mark.serial
@pytest.mark.parametrize("signum, what", [
    (signal.SIGKILL, r"died during \w+\(\): ended by a signal no handler sees \(SIGKILL\), "
                     r"or exited without a Python error"),
    (signal.SIGSTOP, r"stopped responding during \w+\(\): its process is stopped \(SIGSTOP, state T\)( for \d+ s "
                     r"\(dist_timeout_s=10, verl's actor_rollout_ref.nccl_timeout\))?"),
], ids=["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_stopped_mid_step_stops_the_run_in_one_line_and_the_rerun_resumes(tmp_path, signum, what):
    """A rank's process SIGKILLed (or SIGSTOPped, with actor_rollout_ref.nccl_timeout=10 as the bound) in step 2,
    after step 1's checkpoint: the run stops within 30 s; its last line says the step, the role, rank, node and
    process and what happened to it, and where a rerun resumes; no process of the run outlives it; the same command
    then resumes from step 1 and finishes."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "trainer.total_training_steps=3", "trainer.save_freq=1", "actor_rollout_ref.rollout.name=hf",
            "trainer.n_cpu_workers_per_node=2", "actor_rollout_ref.nccl_timeout=10",
            f"trainer.default_local_dir={run_dir}"]
    env = {**os.environ, "PYRL_TEST_INTERRUPT": str(tmp_path)}  # inherited by Ray's processes and the workers
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = subprocess.Popen([sys.executable, "-m", "pyrl.ppo", *args], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=open(out_path, "w"), stderr=open(err_path, "w"))
    latest = run_dir / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 400
    try:
        while not (latest.exists() and latest.read_text().strip() == "1"):
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.05)
        logged = out_path.read_text() + err_path.read_text()
        pids = dict(re.findall(r"placement: rank (\d+) \(local \d+\) -> node [0-9a-f]{8} .*?, pid (\d+),", logged))
        assert set(pids) == {"0", "1"}, logged[-3000:]
        os.kill(int(pids["1"]), signum)
        killed_at = time.monotonic()
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - killed_at < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = out_path.read_text(), err_path.read_text()
    last = err.rstrip().splitlines()[-1]
    assert re.fullmatch(
        rf"pyrl: stopped at step 2 of 3: actor_rollout(_ref)? rank 1 \(node [0-9a-f]{{8}}, [^,]+, [^,]+, "
        rf"pid {pids['1']}\) {what}; rerunning the same command resumes from "
        rf"{re.escape(str(run_dir / 'global_step_1'))}", last), err[-3000:]
    # no traceback of the driver's; a worker's own, when one raised (the other rank's collective timing out), is
    # part of the logged account
    assert (out + err).count("Traceback (most recent call last)") == (out + err).count("--- the worker's traceback ---")
    deadline = time.monotonic() + 15  # Ray's processes end on their own once the driver is gone
    while (left := marked_processes(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [(p.pid, p.name()) for p in left]

    again = run_cli(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir / 'global_step_1'} (step 1)" in again.stdout + again.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
