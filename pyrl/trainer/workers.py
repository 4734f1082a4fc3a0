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

from pyrl.trainer.run_plan import ConfigValue
from pyrl.usercode import load_object

log = logging.getLogger("pyrl")


@dataclass
class Workers:
    """The run's worker groups by name (RunPlan.groups), and the trainer's pool. `workers.<role>` is the group that
    hosts the role (the hybrid engine's one group hosts actor, rollout and ref), None when the run lacks it."""
    groups: dict[str, Any]
    plan: Any  # the RunPlan they were built from
    pool: Any  # the trainer's resource pool

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def __getattr__(self, role: str):
        if role.startswith("__") or role in ("groups", "plan", "pool"):
            raise AttributeError(role)
        try:
            group = self.plan.group_of(role)
        except KeyError:
            raise AttributeError(f"Workers has no attribute or role {role!r}") from None
        return None if group is None else self.groups[group.name]

    def shutdown(self) -> None:
        for group in reversed(list(self.groups.values())):
            group.kill()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:  # the workers go whatever happens: a caller's Ray (a test session, a
        self.shutdown()  # notebook) keeps running


def place(pool, section, prefix: str = "trainer") -> None:
    """Reserve the pool's bundles on section.nnodes distinct Ray nodes now, before any worker starts; a cluster
    with too few nodes with room stops the run naming the keys that ask for them: `prefix` is the section's name,
    trainer (config.trainer) or rollout (config.rollout, the one-step-off rollout's pool, placed after the
    trainer's on what that leaves free)."""
    from pyrl.controller.worker_group import PlacementError  # lazy: ray starts only with the workers

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
    import ray  # lazy: ray starts only with the workers

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
    from pyrl.controller import init_ray  # lazy: ray starts only with the workers

    ray_init = ray_init_kwargs(config)
    num_cpus = ray_init.pop("num_cpus", None) or max(os.cpu_count() or 1, processes)
    init_ray(config.trainer.ray_address, num_cpus=num_cpus, **ray_init)


def own_cpu_pools(plan) -> list:
    """The pools beside the trainer's whose processes share the nodes' CPUs with it: the one-step-off rollout's, and
    the servers' own pools (a served reward model's, the teachers') when they run on CPU."""
    pools = [plan.rollout_pool] + [pool for pool in plan.own_pools() if pool.gpus_per_process == 0]
    return [pool for pool in pools if pool is not None]


# the key that asks for each servers' pool (RunPlan.own_pools), for placement errors
OWN_POOL_KEYS = {"reward_model": "reward.reward_model.enable_resource_pool", "teacher": "distillation.nnodes"}


def shared_cpus_per_process(plan) -> int:
    """CPUs of each worker process when other pools' processes share the driver's node with the trainer's (the
    pools place their first node there): the node's CPUs over all their counts."""
    import ray  # lazy: ray starts only with the workers

    here = ray.get_runtime_context().get_node_id()
    cpus = next(node["Resources"].get("CPU", 1) for node in ray.nodes() if node["NodeID"] == here)
    return max(1, int(cpus // (plan.trainer_pool.processes_per_node
                               + sum(pool.processes_per_node for pool in own_cpu_pools(plan)))))


def build_workers(config, plan) -> Workers:
    """The worker groups of `plan` (a RunPlan: RunPlan.groups, each a worker class on a pool), placed and
    initialized in order."""
    import torch  # lazy: torch and the model code load with the workers

    from pyrl.controller import ResourcePool, WorkerGroup  # lazy: ray starts only with the workers
    from pyrl.controller.worker_group import PlacementError  # lazy: as above
    from pyrl.workers.perf import peak_flops  # lazy: torch and the model code load with the workers

    trainer = plan.trainer_pool
    colocated = sum(group.pool == "trainer" for group in plan.groups)
    others = sum(pool.world_size for pool in plan.pools()[1:] if pool is not None)
    start_ray(config, trainer.world_size + others)  # the rollout's and the servers' own workers too
    # each node's CPUs (the cluster's count, not this machine's) shared by its processes
    pools = {"trainer": ResourcePool([trainer.processes_per_node] * trainer.nnodes,
                                     gpus_per_process=trainer.gpus_per_process, cpus_per_process=None,
                                     max_colocate_count=colocated)}
    if own_cpu_pools(plan):  # their processes share the nodes' CPUs
        pools["trainer"].cpus_per_process = shared_cpus_per_process(plan)
    place(pools["trainer"], config.trainer)
    groups = {}
    try:
        if plan.rollout_pool is not None:  # placed now too, on what the trainer's pool leaves free
            shape = plan.rollout_pool
            pools["rollout"] = ResourcePool([shape.processes_per_node] * shape.nnodes,
                                            gpus_per_process=shape.gpus_per_process,
                                            cpus_per_process=pools["trainer"].cpus_per_process)
            place(pools["rollout"], config.rollout, "rollout")
        for shape in plan.own_pools():  # the servers' own pools, on what the others leave free
            pools[shape.name] = ResourcePool([shape.processes_per_node] * shape.nnodes,
                                             gpus_per_process=shape.gpus_per_process,
                                             cpus_per_process=pools["trainer"].cpus_per_process if
                                             shape.gpus_per_process == 0 else 1)
            try:
                pools[shape.name].placement_groups()
            except PlacementError as e:
                raise ValueError(f"{OWN_POOL_KEYS[shape.name]}: its pool, nnodes={shape.nnodes} x "
                                 f"{shape.processes_per_node} {'GPU' if shape.gpus_per_process else 'CPU'} server "
                                 f"process(es) of {max(shape.gpus_per_process, 1)} device(s), cannot be placed: {e}") \
                    from None
        on_cpu = trainer.gpus_per_process == 0
        if on_cpu:  # the CPU's peak FLOP rate for perf/mfu/*, measured now (once per machine, cached) while
            # nothing else runs: workers measuring it at once would each see a fraction of it
            for dtype in (torch.float32, torch.bfloat16):
                peak_flops(torch.device("cpu"), dtype)
        # vLLM logs every in-place weight reload at INFO; keep the console to the training table unless asked
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
        threads = {"trainer": threads_per_process(pools["trainer"], colocated) if on_cpu else None,
                   **{name: pools[name].cpus_per_process if on_cpu and name in pools else None
                      for name in ("rollout", "reward_model", "teacher")}}
        for group in plan.groups:
            worker = load_object(group.worker, f"the {group.name} group's worker class")
            section = ConfigValue(group.section).read(config)
            args = [a.read(config) if isinstance(a, ConfigValue) else a for a in group.args]
            group_env = {**env, "OMP_NUM_THREADS": threads[group.pool]} if threads[group.pool] else env
            groups[group.name] = WorkerGroup(pools[group.pool], worker, section, *args, group_name=group.name,
                                             init_distributed=group.distributed, env=group_env,
                                             dist_timeout_s=config.actor_rollout_ref.nccl_timeout)
            if len(groups) == 1:
                for line in groups[group.name].describe_placements():
                    log.info("placement: %s", line)
            groups[group.name].init_model()
        return Workers(groups, plan, pools["trainer"])
    except BaseException:  # a start that fails gives back what it took: a caller's Ray (a test session, a
        # notebook) keeps running, and the next run places its pools on it
        for release in [group.kill for group in reversed(list(groups.values()))] + \
                [pool.release for pool in pools.values()]:
            try:
                release()
            except Exception:  # the start's own error is the one to see (Ray itself may be what failed)
                log.exception("while giving back a failed start's workers and pools")
        raise
