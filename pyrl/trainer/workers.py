"""Placing the workers: one resource pool over the nodes; the actor, rollout and reference share each
process (the hybrid engine); the critic and the reward model are processes colocated on the same
bundles. trainer.n_gpus_per_node=0 gives CPU workers on gloo (trainer.n_cpu_workers_per_node of them).
Without the hybrid engine (actor_rollout_ref.hybrid_engine=false) the rollout has a pool and workers of its own
(pyrl.trainer.one_step_off)."""

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
    rollout: Any = None  # the group that generates: the actor's (the hybrid engine) unless one of its own

    def __post_init__(self):
        if self.rollout is None:
            self.rollout = self.actor

    def shutdown(self) -> None:
        for group in (self.reward_model, self.critic, self.actor, self.rollout):
            if group is not None:
                group.kill()


def gpus_per_node(trainer_config) -> int:
    if trainer_config.n_gpus_per_node >= 0:
        return trainer_config.n_gpus_per_node
    import torch

    return torch.cuda.device_count() if trainer_config.device in ("auto", "cuda") else 0


def workers_per_node(trainer_config) -> int:
    """The trainer's worker processes on each node: a GPU each, or n_cpu_workers_per_node."""
    gpus = gpus_per_node(trainer_config)
    per_node = gpus if gpus > 0 else trainer_config.n_cpu_workers_per_node
    if per_node < 1:
        raise ValueError("trainer.n_cpu_workers_per_node must be >= 1 when trainer.n_gpus_per_node is 0")
    return per_node


def worker_count(trainer_config) -> int:
    """Worker processes (data-parallel ranks) over all nodes."""
    return workers_per_node(trainer_config) * trainer_config.nnodes


def uses_critic(config) -> bool:
    """critic.enable, or (None) exactly when the estimator is gae."""
    return config.critic.enable if config.critic.enable is not None else config.algorithm.adv_estimator == "gae"


def place(pool, section, prefix: str = "trainer") -> None:
    """Reserve the pool's bundles on section.nnodes distinct Ray nodes now, before any worker starts; a cluster
    with too few nodes with room stops the run naming the keys that ask for them: `prefix` is the section's name,
    trainer (config.trainer) or rollout (config.rollout, the one-step-off rollout's pool, placed after the
    trainer's on what that leaves free)."""
    from pyrl.controller.worker_group import PlacementError

    per_node = pool.processes_per_node[0]
    if pool.gpus_per_process:
        asked = f"{prefix}.n_gpus_per_node={per_node}: {per_node} GPU worker(s)"
    else:
        asked = (f"{prefix}.n_gpus_per_node={section.n_gpus_per_node}: CPU workers, "
                 f"{prefix}.n_cpu_workers_per_node={per_node}")
    try:
        pool.placement_groups()
    except PlacementError as e:
        raise ValueError(f"{prefix}.nnodes={section.nnodes} ({asked} per node) cannot be placed: {e}. Join a "
                         "cluster with that many nodes with room (trainer.ray_address, see the README's \"Running on "
                         "a Ray cluster\") or ask for fewer nodes or workers.") from None


def threads_per_process(pool, groups: int) -> int:
    """OMP threads of each CPU worker: its CPUs shared by the groups colocated on it. Processes on this machine
    also share its cores (several Ray nodes may run on one machine, as in a test cluster, and a node may
    advertise more CPUs than the machine has)."""
    import ray

    here = ray.util.get_node_ip_address()
    local = sum(count for node, count in zip(pool.nodes, pool.processes_per_node) if node.ip == here)
    cpus = pool.cpus_per_process
    if local:
        cpus = min(cpus, (os.cpu_count() or 1) // local)
    return max(1, int(cpus // groups))


def ray_init_kwargs(config) -> dict:
    """ray_kwargs.ray_init as ray.init takes it (verl 0.9.1's main_ppo hands it over the same way): unset (null)
    entries dropped, runtime_env's too. num_cpus is for a local instance: joining a cluster with it set stops here,
    since Ray would refuse it after the cluster was contacted."""
    ray_init = {key: value for key, value in config.ray_kwargs.ray_init.items() if value is not None}
    runtime_env = {key: value for key, value in (ray_init.pop("runtime_env", None) or {}).items() if value is not None}
    if runtime_env:
        ray_init["runtime_env"] = runtime_env
    if "address" in ray_init:
        raise ValueError("ray_kwargs.ray_init.address: set trainer.ray_address (pyrl's key for the cluster to join)")
    if ray_init.get("num_cpus") is not None and (config.trainer.ray_address or os.environ.get("RAY_ADDRESS")):
        raise ValueError("ray_kwargs.ray_init.num_cpus sizes a local Ray instance; this run joins a cluster "
                         "(trainer.ray_address or $RAY_ADDRESS), whose nodes have their own CPUs: unset it")
    return ray_init


def start_ray(config, processes: int = 1) -> None:
    """Join the run's cluster or start a local Ray instance (pyrl.controller.init_ray) with ray_kwargs.ray_init;
    a local one gets at least a CPU per worker process unless ray_init.num_cpus says otherwise."""
    from pyrl.controller import init_ray

    ray_init = ray_init_kwargs(config)
    num_cpus = ray_init.pop("num_cpus", None) or max(os.cpu_count() or 1, processes)
    init_ray(config.trainer.ray_address, num_cpus=num_cpus, **ray_init)


def build_workers(config) -> Workers:
    import torch

    from pyrl.controller import ResourcePool, WorkerGroup
    from pyrl.trainer.one_step_off import (
        build_rollout_workers,
        rollout_processes,
        rollout_resource_pool,
        shared_cpus_per_process,
    )
    from pyrl.workers.actor import ActorRolloutRefWorker
    from pyrl.workers.critic import CriticWorker
    from pyrl.workers.perf import peak_flops
    from pyrl.workers.reward_model import RewardModelWorker

    trainer = config.trainer
    gpus = gpus_per_node(trainer)
    use_critic = uses_critic(config)
    use_rm = config.reward.reward_model.enable
    groups = 1 + use_critic + use_rm
    per_node = workers_per_node(trainer)
    processes = per_node * trainer.nnodes + rollout_processes(config)  # the rollout's own workers too
    start_ray(config, processes)
    # each node's CPUs (the cluster's count, not this machine's) shared by its processes
    pool = ResourcePool([per_node] * trainer.nnodes, gpus_per_process=1 if gpus > 0 else 0, cpus_per_process=None,
                        max_colocate_count=groups)
    if not config.actor_rollout_ref.hybrid_engine:  # the rollout's processes share the nodes' CPUs
        pool.cpus_per_process = shared_cpus_per_process(config, per_node)
    place(pool, trainer)
    rollout_pool = None
    if not config.actor_rollout_ref.hybrid_engine:  # placed now too, on what the trainer's pool leaves free
        rollout_pool = rollout_resource_pool(config, pool.cpus_per_process)
        try:
            place(rollout_pool, config.rollout, "rollout")
        except ValueError:
            pool.release()
            raise
    world = pool.world_size
    if gpus == 0:  # the CPU's peak FLOP rate for perf/mfu/*, measured now (once per machine, cached) while
        # nothing else runs: workers measuring it at once would each see a fraction of it
        for dtype in (torch.float32, torch.bfloat16):
            peak_flops(torch.device("cpu"), dtype)
    # vLLM logs every in-place weight reload at INFO; keep the console to the training table unless asked
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if gpus == 0:
        env["OMP_NUM_THREADS"] = threads_per_process(pool, groups)
    group_options = {"env": env, "dist_timeout_s": config.actor_rollout_ref.nccl_timeout}
    role = "actor_rollout_ref" if (config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward) \
        else "actor_rollout"
    if not config.actor_rollout_ref.hybrid_engine:  # the rollout runs in workers of its own
        role = role.replace("_rollout", "")
    actor = WorkerGroup(pool, ActorRolloutRefWorker, config.actor_rollout_ref, role, group_name=role, **group_options)
    for line in actor.describe_placements():
        log.info("placement: %s", line)
    actor.init_model()
    critic = reward_model = None
    if use_critic:
        critic = WorkerGroup(pool, CriticWorker, config.critic, config.actor_rollout_ref.rollout.n, group_name="critic",
                             **group_options)
        critic.init_model()
    if use_rm:
        reward_model = WorkerGroup(pool, RewardModelWorker, config.reward_model, config.actor_rollout_ref.model.path,
                                   group_name="reward_model", **group_options)
        reward_model.init_model()
    log.info("workers: %d process(es) x %s, roles %s%s%s", world, f"{gpus} GPU(s)" if gpus else "CPU (gloo)", role,
             " + critic" if use_critic else "", " + reward model" if use_rm else "")
    rollout = None if rollout_pool is None else build_rollout_workers(config, rollout_pool, env)
    return Workers(actor, critic, reward_model, world, pool, rollout)
