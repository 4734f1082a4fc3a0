"""python -m pyrl.ppo [key=value ...]: train with PPO / GRPO / ... as verl's main_ppo, with verl's keys.

With no arguments it trains GRPO on the built-in toy task with pyrl's tiny model, offline, on this
machine, and prints where its run directory, metrics and plot are.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pyrl.config import PPOConfig, check_supported

ConfigStore.instance().store(name="ppo_trainer_schema", node=PPOConfig)
log = logging.getLogger("pyrl")


def load_class(path: str, name: str, key: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}.path: {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"pyrl_user_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{key}.name: {path!r} defines no {name!r}")
    return getattr(module, name)


def resolve_defaults(config: PPOConfig) -> None:
    """Fill what depends on this machine: the toy task files, the rollout engine, the step count."""
    check_supported(config)
    if not config.data.train_files:
        from pyrl.data import toy_task_files

        config.data.train_files, toy_val = toy_task_files()
        config.data.val_files = config.data.val_files or toy_val
    rollout = config.actor_rollout_ref.rollout
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        log.warning("vLLM is not installed: generating with the hf engine (transformers generate) instead")
        rollout.name = "hf"
    if rollout.name not in ("vllm", "hf"):
        raise ValueError(f"actor_rollout_ref.rollout.name: {rollout.name!r} is not supported; use vllm or hf")
    optim_steps = config.trainer.total_training_steps
    for optim in (config.actor_rollout_ref.actor.optim, config.critic.optim):
        if optim.total_training_steps < 0 and optim_steps:
            optim.total_training_steps = optim_steps


def run_ppo(config: PPOConfig) -> dict:
    from pyrl.data import RLHFDataset
    from pyrl.rewards import load_reward_manager
    from pyrl.trainer.ppo_trainer import PPOTrainer
    from pyrl.trainer.workers import build_workers
    from pyrl.workers.actor import load_tokenizer

    resolve_defaults(config)
    tokenizer = load_tokenizer(config.actor_rollout_ref.model)
    dataset_cls = RLHFDataset
    if config.data.custom_cls.path:
        dataset_cls = load_class(config.data.custom_cls.path, config.data.custom_cls.name, "data.custom_cls")
    train = dataset_cls(config.data.train_files, tokenizer, config.data)
    val = dataset_cls(config.data.val_files, tokenizer, config.data) if config.data.val_files else None
    reward_fn = load_reward_manager(config, tokenizer)
    val_reward_fn = load_reward_manager(config, tokenizer, validation=True)
    run_dir = os.path.abspath(config.trainer.default_local_dir)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(config)))
    workers = build_workers(config)
    try:
        trainer = PPOTrainer(config, tokenizer, train, val, reward_fn, val_reward_fn, workers)
        final_val = trainer.fit()
    finally:
        workers.shutdown()
    outputs = {"run_dir": run_dir}
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        from pyrl.plot import plot_run

        outputs["metrics"] = metrics_path
        outputs["plot"] = plot_run(run_dir)
    print(f"run directory: {run_dir}")
    for key in ("metrics", "plot"):
        if key in outputs:
            print(f"{key}: {outputs[key]}")
    for key, value in sorted(final_val.items()):
        if key.startswith("val-core/"):
            print(f"{key} = {value:.4f}")
    return {**outputs, "val": final_val}


@hydra.main(config_path="pkg://pyrl.configs", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[pyrl] %(message)s")
    config: PPOConfig = OmegaConf.to_object(cfg)  # resolves interpolations, checks every value's type
    run_ppo(config)


if __name__ == "__main__":
    sys.exit(main())
