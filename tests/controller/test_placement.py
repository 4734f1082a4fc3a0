"""choose_nodes: which Ray node each entry of a ResourcePool runs on (distinct nodes, the driver's first, only
nodes whose free resources hold the processes), and the error listing the nodes when there are too few; on the
session's Ray, a pool placed after another takes only what that one left free."""

import dataclasses
import time

import pytest

from pyrl.controller.worker_group import Node, PlacementError, alive_nodes, choose_nodes

# timing-bound (Ray's view of free resources, signals, hang detection): run alone, after the parallel tests
pytestmark = pytest.mark.serial

HEAD = Node("aa" * 28, "10.0.0.1", "head", cpus=8, gpus=0, free_cpus=8, free_gpus=0)
GPU_A = Node("bb" * 28, "10.0.0.2", "gpu-a", cpus=32, gpus=8, free_cpus=32, free_gpus=8)
GPU_B = Node("cc" * 28, "10.0.0.3", "gpu-b", cpus=32, gpus=8, free_cpus=32, free_gpus=8)


def test_distinct_nodes_the_drivers_first():
    assert choose_nodes([GPU_A, GPU_B, HEAD], [2, 2], 1, 0, first=HEAD.id) == [HEAD, GPU_A]
    assert choose_nodes([GPU_A, GPU_B, HEAD], [2, 2], 1, 0, first=GPU_B.id) == [GPU_B, GPU_A]


def test_nodes_without_the_resources_are_passed_over():
    assert choose_nodes([HEAD, GPU_A, GPU_B], [8, 8], 1, 1, first=HEAD.id) == [GPU_A, GPU_B]  # the head has no GPU
    assert choose_nodes([HEAD, GPU_A], [1], 16, 0, first=HEAD.id) == [GPU_A]  # 16 CPUs: not the head's 8


def test_too_few_nodes_name_every_node():
    with pytest.raises(PlacementError, match=r"2 distinct node\(s\) wanted, one per entry of \[8 x \{CPU: 1, GPU: 1\}, "
                                             r"8 x \{CPU: 1, GPU: 1\}\], but only 1 .*Nodes: aaaaaaaa \(10\.0\.0\.1, "
                                             r"head\): CPU 8 \(8 free\), GPU 0 \(0 free\); bbbbbbbb \(10\.0\.0\.2, "
                                             r"gpu-a\): CPU 32 \(32 free\), GPU 8 \(8 free\)"):
        choose_nodes([HEAD, GPU_A], [8, 8], 1, 1, first=HEAD.id)


def test_a_second_pool_goes_to_the_nodes_with_room():
    """verl's one-step-off layout, trainer.nnodes=1 x 8 GPUs and rollout.nnodes=1 x 8 GPUs on two 8-GPU nodes: the
    trainer's pool holds the driver's node whole, so the rollout's goes to the other one; with both nodes held
    nothing fits, and the error shows what each node has free."""
    trainer_node = dataclasses.replace(GPU_A, free_cpus=24, free_gpus=0)  # 8 bundles of {CPU: 1, GPU: 1} placed
    assert choose_nodes([trainer_node, GPU_B], [8], 1, 1, first=GPU_A.id) == [GPU_B]
    half = dataclasses.replace(GPU_B, free_gpus=4)  # another job holds 4 of its GPUs
    assert choose_nodes([trainer_node, half, HEAD], [4], 1, 1, first=GPU_A.id) == [half]
    with pytest.raises(PlacementError, match=r"only 0 .*bbbbbbbb \(10\.0\.0\.2, gpu-a\): CPU 32 \(24 free\), GPU 8 "
                                             r"\(0 free\); cccccccc \(10\.0\.0\.3, gpu-b\): CPU 32 \(32 free\), GPU 8 "
                                             r"\(4 free\)"):
        choose_nodes([trainer_node, half], [8], 1, 1, first=GPU_A.id)


def test_pools_placed_one_after_another_share_what_is_free(ray_session):
    """Real placement groups on the session's one-node Ray: a pool's bundles are off the node's free CPUs as soon
    as it is placed, so the next pool fits in what is left and the one after that, finding none, is refused at once
    (not after pg.ready()'s 60 s) with the node listed as full; releasing a pool frees its CPUs."""
    from pyrl.controller import ResourcePool

    node = ray_session.get_runtime_context().get_node_id()
    free = int(next(n for n in alive_nodes() if n.id == node).free_cpus)
    assert free >= 2, f"the session's Ray has {free} free CPU(s); the test needs 2"
    first, second, third = ResourcePool([free - 1]), ResourcePool([1]), ResourcePool([1])
    try:
        first.placement_groups()
        assert [n.id for n in first.nodes] == [node]
        assert next(n for n in alive_nodes() if n.id == node).free_cpus == 1
        second.placement_groups()
        assert [n.id for n in second.nodes] == [node]
        # Ray's view of the node's free CPUs follows a placement within ~0.1 s, later on a loaded machine: the
        # refusal below names the node from that view
        deadline = time.monotonic() + 10
        while next(n for n in alive_nodes() if n.id == node).free_cpus > 0:
            assert time.monotonic() < deadline, "the second pool's CPU never left Ray's view of the free ones"
            time.sleep(0.05)
        with pytest.raises(PlacementError, match=rf"only 0 .*Nodes: {node[:8]} \(.*\): CPU \d+ \(0 free\)"):
            third.placement_groups(timeout_s=5)
    finally:
        first.release()
        second.release()
    deadline = time.monotonic() + 10  # Ray's view of a removed group's resources follows within ~0.1 s
    while next(n for n in alive_nodes() if n.id == node).free_cpus < free:
        assert time.monotonic() < deadline, "the released pools' CPUs never came back"
        time.sleep(0.05)


def test_the_rollout_pool_that_finds_no_room_names_the_rollout_keys(ray_session):
    """The one-step-off rollout's pool goes through the same start-time error as the trainer's, naming rollout.*
    and listing the nodes with what the trainer's pool left free."""
    from pyrl.config import RolloutPoolConfig
    from pyrl.controller import ResourcePool
    from pyrl.trainer.workers import place

    node = ray_session.get_runtime_context().get_node_id()
    free = int(next(n for n in alive_nodes() if n.id == node).free_cpus)
    trainer = ResourcePool([free])
    try:
        trainer.placement_groups()
        rollout = ResourcePool([2], cpus_per_process=1)
        with pytest.raises(ValueError, match=r"rollout\.nnodes=1 \(rollout\.n_gpus_per_node=0: CPU workers, "
                                             r"rollout\.n_cpu_workers_per_node=2 per node\) cannot be placed: "
                                             r"1 distinct node\(s\) wanted.*only 0 .*Nodes: "
                                             rf"{node[:8]} \(.*\): CPU \d+ \(0 free\)"):
            place(rollout, RolloutPoolConfig(nnodes=1, n_gpus_per_node=0, n_cpu_workers_per_node=2), "rollout")
    finally:
        trainer.release()


def test_a_pool_waits_for_resources_another_job_releases(ray_session):
    """CPUs reserved by someone else's placement group (here a raw one, as another job's) are waited for: released
    a second later, the pool is placed then instead of refused."""
    import threading

    from ray.util.placement_group import placement_group, remove_placement_group

    from pyrl.controller import ResourcePool

    node = ray_session.get_runtime_context().get_node_id()
    cpus = int(next(n for n in alive_nodes() if n.id == node).cpus)
    other = placement_group([{"CPU": 1}] * cpus, strategy="STRICT_PACK")  # every CPU, once earlier tests let go
    ray_session.get(other.ready(), timeout=30)
    released = []
    threading.Timer(1.0, lambda: (remove_placement_group(other), released.append(time.monotonic()))).start()
    pool = ResourcePool([1])
    try:
        pool.placement_groups(timeout_s=30)
        placed = time.monotonic()
        assert [n.id for n in pool.nodes] == [node] and released and placed >= released[0]
    finally:
        pool.release()
