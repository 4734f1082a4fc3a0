"""Running `python -m pyrl.ppo` for the trainer tests: as a subprocess (the real command line) or in-process."""

import json
import os
import subprocess
import sys

SMALL = ["preset=toy", "actor_rollout_ref.model.path=pyrl:tiny", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1"]


def run_cli(args, cwd, timeout=600, env=None):
    """python -m pyrl.ppo ARGS in `cwd`; returns the CompletedProcess (stdout and stderr captured)."""
    return subprocess.run([sys.executable, "-m", "pyrl.ppo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compose(*overrides):
    """The typed config exactly as `python -m pyrl.ppo OVERRIDES` builds it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    import pyrl.ppo  # noqa: F401 - registers the schema

    with initialize_config_module("pyrl.configs", version_base=None):
        cfg = hydra_compose("ppo_trainer", overrides=list(overrides))
    return OmegaConf.to_object(cfg)
