"""Placing the workers as the RunPlan says (pyrl.trainer.run_plan): one resource pool over the trainer's nodes; the
actor, rollout and reference share each process (the hybrid engine); the critic and the reward model are processes
colocated on the same bundles. trainer.n_gpus_per_node=0 gives CPU workers on gloo (trainer.n_cpu_workers_per_node
of them). Without the hybrid engine (actor_rollout_ref.hybrid_engine=false) the rollout has a pool and workers of
its own, placed after the trainer's (pyrl.trainer.one_step_off runs them)."""

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


def shared_cpus_per_process(plan) -> int:
    """CPUs of each worker process when the rollout's processes share the driver's node with the trainer's (the
    pools place their first node there): the node's CPUs over both counts."""
    import ray  # lazy: ray starts only with the workers

    here = ray.get_runtime_context().get_node_id()
    cpus = next(node["Resources"].get("CPU", 1) for node in ray.nodes() if node["NodeID"] == here)
    return max(1, int(cpus // (plan.trainer_pool.processes_per_node + plan.rollout_pool.processes_per_node)))


def build_rollout_workers(config, pool, env: dict):
    """The one-step-off rollout's workers (role "rollout": tokenizer and engine, no FSDP model) on their own pool;
    each generates its share of a batch alone, so they form no process group, unless
    rollout.tensor_model_parallel_size > 1 makes groups of them share an engine."""
    from pyrl.controller import WorkerGroup  # lazy: ray starts only with the workers
    from pyrl.workers.actor import ActorRolloutRefWorker  # lazy: torch and the model code load with the workers

    gpus, cpus = pool.gpus_per_process, pool.cpus_per_process
    env = {**env, "OMP_NUM_THREADS": cpus} if gpus == 0 else env
    tensor_parallel = config.actor_rollout_ref.rollout.tensor_model_parallel_size > 1
    group = WorkerGroup(pool, ActorRolloutRefWorker, config.actor_rollout_ref, "rollout", group_name="rollout",
                        init_distributed=tensor_parallel, env=env, dist_timeout_s=config.actor_rollout_ref.nccl_timeout)
    group.init_model()
    return group


def build_workers(config, plan) -> Workers:
    """The worker groups of `plan` (a RunPlan), placed and initialized."""
    import torch  # lazy: torch and the model code load with the workers

    from pyrl.controller import ResourcePool, WorkerGroup  # lazy: ray starts only with the workers
    from pyrl.workers.actor import ActorRolloutRefWorker  # lazy: torch and the model code load with the workers
    from pyrl.workers.critic import CriticWorker  # lazy: as above
    from pyrl.workers.perf import peak_flops  # lazy: as above
    from pyrl.workers.reward_model import RewardModelWorker  # lazy: as above

    trainer = plan.trainer_pool
    use_critic, use_rm = plan.has("critic"), plan.has("reward_model")
    groups = 1 + use_critic + use_rm
    rollout_processes = plan.rollout_pool.world_size if plan.rollout_pool else 0
    start_ray(config, trainer.world_size + rollout_processes)  # the rollout's own workers too
    # each node's CPUs (the cluster's count, not this machine's) shared by its processes
    pool = ResourcePool([trainer.processes_per_node] * trainer.nnodes, gpus_per_process=trainer.gpus_per_process,
                        cpus_per_process=None, max_colocate_count=groups)
    if plan.rollout_pool is not None:  # the rollout's processes share the nodes' CPUs
        pool.cpus_per_process = shared_cpus_per_process(plan)
    place(pool, config.trainer)
    rollout_pool = None
    if plan.rollout_pool is not None:  # placed now too, on what the trainer's pool leaves free
        shape = plan.rollout_pool
        rollout_pool = ResourcePool([shape.processes_per_node] * shape.nnodes, gpus_per_process=shape.gpus_per_process,
                                    cpus_per_process=pool.cpus_per_process)
        try:
            place(rollout_pool, config.rollout, "rollout")
        except ValueError:
            pool.release()
            raise
    world = pool.world_size
    gpus = trainer.gpus_per_process
    if gpus == 0:  # the CPU's peak FLOP rate for perf/mfu/*, measured now (once per machine, cached) while
        # nothing else runs: workers measuring it at once would each see a fraction of it
        for dtype in (torch.float32, torch.bfloat16):
            peak_flops(torch.device("cpu"), dtype)
    # vLLM logs every in-place weight reload at INFO; keep the console to the training table unless asked
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if gpus == 0:
        env["OMP_NUM_THREADS"] = threads_per_process(pool, groups)
    group_options = {"env": env, "dist_timeout_s": config.actor_rollout_ref.nccl_timeout}
    role = plan.actor_group
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
    rollout = None if rollout_pool is None else build_rollout_workers(config, rollout_pool, env)
    return Workers(actor, critic, reward_model, world, pool, rollout)
