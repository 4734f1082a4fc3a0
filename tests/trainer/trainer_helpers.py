"""Running `python -m pyrl.ppo` for the trainer tests: as a subprocess (the real command line) or in-process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SMALL = ["preset=toy", "actor_rollout_ref.model.path=pyrl:tiny", "data.train_batch_size=8",
         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "trainer.val_before_train=false", "trainer.test_freq=-1"]
FP32 = ["actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.ref.fsdp_config.dtype=float32", "critic.fsdp.dtype=float32"]


def run_cli(args, cwd, timeout=600, env=None):
    """python -m pyrl.ppo ARGS in `cwd`; returns the CompletedProcess (stdout and stderr captured)."""
    return subprocess.run([sys.executable, "-m", "pyrl.ppo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def kill_after_checkpoint(args, run_dir, step: int, cwd, timeout=400, env=None) -> None:
    """Start `python -m pyrl.ppo ARGS trainer.default_local_dir=RUN_DIR` and SIGKILL its process group as soon as
    its step-`step` checkpoint is committed (latest_checkpointed_iteration.txt names it): a run that dies there."""
    killed = subprocess.Popen([sys.executable, "-m", "pyrl.ppo", *args, f"trainer.default_local_dir={run_dir}"],
                              cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    latest = Path(run_dir) / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout
    try:
        while not (latest.exists() and latest.read_text().strip() == str(step)):
            assert killed.poll() is None, f"the run ended before its step-{step} checkpoint"
            assert time.monotonic() < deadline, f"no step-{step} checkpoint after {timeout} s"
            time.sleep(0.05)
    finally:  # the driver; the cluster ends its workers and frees their resources
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()


def marked_processes(marker: str) -> list:
    """The processes whose environment has PYRL_TEST_INTERRUPT=marker: a run started with it, Ray's processes and
    the workers included (they inherit it)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PYRL_TEST_INTERRUPT") == marker:
                found.append(proc)
        except (psutil.Error, OSError):  # another user's process, or one gone meanwhile
            continue
    return found


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compose(*overrides, config_name="ppo_trainer"):
    """The typed config exactly as `python -m pyrl.ppo OVERRIDES` builds it (config_name: the entry's config, e.g.
    one_step_off_ppo_trainer)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    import pyrl.ppo  # noqa: F401 - registers the schema
    from pyrl.config import check_known_keys

    with initialize_config_module("pyrl.configs", version_base=None):
        cfg = hydra_compose(config_name, overrides=list(overrides))
    check_known_keys(cfg)  # as pyrl.ppo.run_from_hydra does
    return OmegaConf.to_object(cfg)


def assert_rollout_matches_trainer(rows: list[dict], steps: int) -> None:
    """Every step of a run logged: the rollout engine's log-probs equal the trainer's at float32 noise
    (training/rollout_probs_diff_*, the check verl logs after each weight push)."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["training/rollout_probs_diff_valid"] == 1
        assert row["training/rollout_probs_diff_mean"] < 1e-4, row["training/rollout_probs_diff_mean"]
        assert row["training/rollout_probs_diff_max"] < 1e-2
