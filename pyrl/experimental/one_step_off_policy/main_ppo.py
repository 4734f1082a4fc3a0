"""python -m pyrl.experimental.one_step_off_policy.main_ppo [key=value ...]: verl 0.9.1's one-step-off-policy
entry with the module name changed. It is pyrl.ppo with configs/one_step_off_ppo_trainer.yaml, verl's config of the
same name (actor_rollout_ref.hybrid_engine=false, the rollout's own workers from the top-level rollout section,
rollout.free_cache_engine=false, calculate_log_probs=true, algorithm.rollout_correction.bypass_mode=true); the
schedule is pyrl.trainer.one_step_off. `--config-name one_step_off_ppo_trainer` on the command line (as verl's
examples pass it) names the same config."""

import sys

import hydra
from omegaconf import DictConfig

import pyrl.ppo as ppo

CONFIG_NAME = "one_step_off_ppo_trainer"


@hydra.main(config_path="pkg://pyrl.configs", config_name=CONFIG_NAME, version_base=None)
def main(cfg: DictConfig) -> None:
    ppo.run_from_hydra(cfg)


def cli() -> int | None:
    return ppo.cli(main)


if __name__ == "__main__":
    sys.exit(cli())
