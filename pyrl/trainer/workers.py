"""Placing the workers: one resource pool over the nodes; the actor, rollout and reference share each
process (the hybrid engine); the critic and the reward model are processes colocated on the same
bundles. trainer.n_gpus_per_node=0 gives CPU workers on gloo (trainer.n_cpu_workers_per_node of them)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pyrl")


@dataclass
class Workers:
    actor: Any
    critic: Any
    reward_model: Any
    world_size: int
    pool: Any

    def shutdown(self) -> None:
        for group in (self.reward_model, self.critic, self.actor):
            if group is not None:
                group.kill()


def gpus_per_node(trainer_config) -> int:
    if trainer_config.n_gpus_per_node >= 0:
        return trainer_config.n_gpus_per_node
    import torch

    return torch.cuda.device_count() if trainer_config.device in ("auto", "cuda") else 0


def worker_count(trainer_config) -> int:
    """Worker processes (data-parallel ranks) over all nodes: a GPU each, or n_cpu_workers_per_node."""
    gpus = gpus_per_node(trainer_config)
    per_node = gpus if gpus > 0 else trainer_config.n_cpu_workers_per_node
    if per_node < 1:
        raise ValueError("trainer.n_cpu_workers_per_node must be >= 1 when trainer.n_gpus_per_node is 0")
    return per_node * trainer_config.nnodes


def uses_critic(config) -> bool:
    """critic.enable, or (None) exactly when the estimator is gae."""
    return config.critic.enable if config.critic.enable is not None else config.algorithm.adv_estimator == "gae"


def build_workers(config) -> Workers:
    import torch

    from pyrl.controller import ResourcePool, WorkerGroup, init_ray
    from pyrl.workers.actor import ActorRolloutRefWorker
    from pyrl.workers.critic import CriticWorker
    from pyrl.workers.perf import peak_flops
    from pyrl.workers.reward_model import RewardModelWorker

    trainer = config.trainer
    gpus = gpus_per_node(trainer)
    use_critic = uses_critic(config)
    use_rm = config.reward.reward_model.enable
    groups = 1 + use_critic + use_rm
    per_node = worker_count(trainer) // trainer.nnodes
    cpus = max(1, (os.cpu_count() or 1) // per_node)
    init_ray(trainer.ray_address, num_cpus=max(os.cpu_count() or 1, per_node * trainer.nnodes))  # a local one's CPUs
    pool = ResourcePool([per_node] * trainer.nnodes, gpus_per_process=1 if gpus > 0 else 0, cpus_per_process=cpus,
                        max_colocate_count=groups)
    world = pool.world_size
    if gpus == 0:  # the CPU's peak FLOP rate for perf/mfu/*, measured now (once per machine, cached) while
        # nothing else runs: workers measuring it at once would each see a fraction of it
        for dtype in (torch.float32, torch.bfloat16):
            peak_flops(torch.device("cpu"), dtype)
    # vLLM logs every in-place weight reload at INFO; keep the console to the training table unless asked
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if gpus == 0:
        env["OMP_NUM_THREADS"] = max(1, cpus // groups)
    group_options = {"env": env, "dist_timeout_s": config.actor_rollout_ref.nccl_timeout}
    role = "actor_rollout_ref" if (config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward) \
        else "actor_rollout"
    actor = WorkerGroup(pool, ActorRolloutRefWorker, config.actor_rollout_ref, role, **group_options)
    actor.init_model()
    critic = reward_model = None
    if use_critic:
        critic = WorkerGroup(pool, CriticWorker, config.critic, config.actor_rollout_ref.rollout.n, **group_options)
        critic.init_model()
    if use_rm:
        reward_model = WorkerGroup(pool, RewardModelWorker, config.reward_model, config.actor_rollout_ref.model.path,
                                   **group_options)
        reward_model.init_model()
    log.info("workers: %d process(es) x %s, roles %s%s%s", world, f"{gpus} GPU(s)" if gpus else "CPU (gloo)", role,
             " + critic" if use_critic else "", " + reward model" if use_rm else "")
    return Workers(actor, critic, reward_model, world, pool)
