"""A command line that names its data and model gets verl 0.9.1's default for every key pyrl shares with verl;
the no-argument run gets the toy preset, announced; the deliberate differences are the README's list."""

import json
import os
import subprocess
import sys

from omegaconf import OmegaConf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "trainer"))
from trainer_helpers import compose  # noqa: E402

from pyrl.ppo import wants_toy_preset  # noqa: E402

# verl 0.9.1's verl/trainer/config/_generated_ppo_trainer.yaml, resolved, for the 249 keys pyrl shares with it
# and gives the same default (actor_rollout_ref.rollout.name=vllm, which verl leaves mandatory)
with open(os.path.join(os.path.dirname(__file__), "verl091_defaults.json")) as f:
    VERL_DEFAULTS = json.load(f)

# pyrl's deliberate differences (README, "Deliberate differences from verl 0.9.1"): key -> (pyrl, verl 0.9.1)
DELIBERATE = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (1, 2),
    "trainer.device": ("auto", "cuda"),
    "trainer.n_gpus_per_node": (-1, 8),
    "critic.model.path": ("m", "~/models/deepseek-llm-7b-chat"),  # pyrl: the actor's model
    "data.val_files": ("", "~/data/rlhf/gsm8k/test.parquet"),  # pyrl: no validation set unless named
    # pyrl's fast paths, resolved at start (pyrl.ppo.resolve_fast_paths): on where they give the same numbers
    "actor_rollout_ref.model.use_fused_kernels": (None, False),
    "actor_rollout_ref.actor.use_prefix_grouper": (None, False),
    "critic.model.use_fused_kernels": (None, False),
    # resolved at start by the memory plan (pyrl.trainer.memory_plan.resolve_gradient_checkpointing): off where the
    # update fits in half the memory without it
    "actor_rollout_ref.model.enable_gradient_checkpointing": (None, True),
    "critic.model.enable_gradient_checkpointing": (None, True),
    # verl's legacy reward-model spellings: unset either way (pyrl's worker settings keep their types)
    "reward_model.model.path": ("", None),
    "reward_model.model.trust_remote_code": (False, None),
}


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def composed(*overrides) -> dict:
    return flat(OmegaConf.to_container(OmegaConf.structured(compose(*overrides)), resolve=True))


def test_verl_command_line_gets_verl_defaults():
    ours = composed("data.train_files=d.parquet", "actor_rollout_ref.model.path=m")
    assert len(VERL_DEFAULTS) >= 249
    wrong = {key: (ours.get(key, "<missing>"), value) for key, value in VERL_DEFAULTS.items()
             if ours.get(key) != value and key not in DELIBERATE}
    assert not wrong, f"pyrl default vs verl 0.9.1: {wrong}"
    for key, (pyrl_value, verl_value) in DELIBERATE.items():
        assert ours[key] == pyrl_value and VERL_DEFAULTS.get(key, verl_value) == verl_value, key
    # the toy run's tuning stays out of a verl command line
    assert ours["actor_rollout_ref.actor.optim.lr"] == 1e-6 and ours["actor_rollout_ref.rollout.n"] == 1
    assert ours["data.max_response_length"] == 512 and ours["algorithm.adv_estimator"] == "gae"


def test_toy_preset_chosen_only_without_data_model_or_preset():
    assert wants_toy_preset([]) and wants_toy_preset(["trainer.total_training_steps=3", "--cfg", "job"])
    for argv in (["data.train_files=x.parquet"], ["actor_rollout_ref.model.path=m"], ["preset=toy"],
                 ["+preset=toy"], ["--config-name", "mine"], ["-cn=mine"]):
        assert not wants_toy_preset(argv), argv
    toy = composed("preset=toy")
    assert (toy["actor_rollout_ref.model.path"] == "pyrl:tiny-toy-sft"
            and toy["actor_rollout_ref.actor.optim.lr"] == 3e-4)
    # a user's key wins over the preset's
    assert composed("preset=toy", "actor_rollout_ref.actor.optim.lr=1e-5")["actor_rollout_ref.actor.optim.lr"] == 1e-5


def test_no_argument_command_line_composes_the_toy_preset(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pyrl.ppo", "--cfg", "job"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = OmegaConf.create(proc.stdout)
    assert job.actor_rollout_ref.model.path == "pyrl:tiny-toy-sft" and job.trainer.total_training_steps == 300
