"""`python -m pyrl.ppo` on a Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head with 4
CPUs and a worker node with 1, in a subprocess with its own RAY_TMPDIR): one FSDP rank per node over gloo, each rank
logged with the node that holds it, and a run killed after its step-2 checkpoint resumes on the cluster to the
same step-3 metrics as an uninterrupted run. The placement itself: distinct nodes or a clear error. A rank stopped
(SIGSTOP) on the other node is named with its node."""

import json
import re
import subprocess
import sys

import pytest
from trainer_helpers import SMALL, compose, kill_after_checkpoint, read_metrics, run_cli

# hosts the cluster until its stdin closes; prints its address and node ids (head first). The head is big enough
# for both ranks: Ray alone packs two 1-CPU STRICT_PACK placement groups onto it (every time, as measured with
# Ray 2.60), so a rank on each node shows the pool's pinning at work.
HOST = """
import json, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
worker = cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address, "nodes": [cluster.head_node.node_id, worker.node_id]}), flush=True)
sys.stdin.read()
cluster.shutdown()
"""
PLACEMENT = re.compile(r"placement: rank (\d+) \(local (\d+)\) -> node ([0-9a-f]{8}) \(.*\), pid \d+, cpu, "
                       r"gloo world (\d+)")
COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/entropy", "actor/grad_norm", "actor/lr", "critic/advantages/max"]


@pytest.fixture
def two_nodes(ray_env):
    """(the cluster's address, [head node id, worker node id], the env that reaches it); shut down after the
    test, and whatever is left of it killed by ray_env's teardown."""
    host = subprocess.Popen([sys.executable, "-c", HOST], env=ray_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = host.stdout.readline()
        assert line, "the cluster host exited before the cluster came up"
        cluster = json.loads(line)
        yield cluster["address"], cluster["nodes"], ray_env
    finally:
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()


def test_two_node_run_places_a_rank_per_node_and_resumes(two_nodes, tmp_path):
    address, nodes, env = two_nodes
    args = [*SMALL, "actor_rollout_ref.rollout.name=hf", f"trainer.ray_address={address}", "trainer.nnodes=2",
            "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=1", "trainer.total_training_steps=3",
            "trainer.save_freq=2", "actor_rollout_ref.actor.optim.lr=0.002"]
    full, part = tmp_path / "full", tmp_path / "part"
    proc = run_cli(args + [f"trainer.default_local_dir={full}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = PLACEMENT.findall(proc.stdout + proc.stderr)
    assert [(rank, local, world) for rank, local, _, world in placed] == [("0", "0", "2"), ("1", "0", "2")], placed
    assert sorted(node for _, _, node, _ in placed) == sorted(node[:8] for node in nodes)  # one rank per node
    assert [r["step"] for r in read_metrics(full)] == [1, 2, 3]

    kill_after_checkpoint(args, part, 2, cwd=tmp_path, timeout=300, env=env)
    assert sorted(p.name for p in (part / "global_step_2" / "actor").glob("*.distcp")) == ["__0_0.distcp",
                                                                                         "__1_0.distcp"]

    proc = run_cli(args + [f"trainer.default_local_dir={part}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr and len(PLACEMENT.findall(proc.stdout + proc.stderr)) == 2
    reference, resumed = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in COMPARED:
        assert resumed[2][key] == pytest.approx(reference[2][key], rel=1e-6, abs=1e-9), key


def test_too_few_nodes_stop_the_run_naming_the_keys_and_the_nodes(ray_session):
    """The session's Ray has one node: nnodes=2 is refused before any worker starts, the message naming the
    keys and listing the node with its resources; two entries never share a node."""
    from pyrl.controller import ResourcePool
    from pyrl.trainer.workers import place

    config = compose("trainer.nnodes=2", "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=1")
    pool = ResourcePool([1, 1], cpus_per_process=None)
    node = ray_session.get_runtime_context().get_node_id()
    with pytest.raises(ValueError, match=r"trainer\.nnodes=2 \(trainer\.n_gpus_per_node=0: CPU workers, "
                                         r"trainer\.n_cpu_workers_per_node=1 per node\) cannot be placed: 2 distinct "
                                         rf"node\(s\) wanted.*only 1 .*Nodes: {node[:8]} \(.*\): CPU 4 \(\d+ free\), "
                                         r"GPU 0 \(0 free\)"):
        place(pool, config.trainer)


# joins the cluster, starts a group of one rank per node whose ranks run collectives, prints the placements, then
# the first line of the WorkerError that ends the call once the test has stopped rank 1 (on the other node)
STOPPED_REMOTE = """
import json, sys, time
import torch
from pyrl.controller import ResourcePool, Worker, WorkerError, WorkerGroup, init_ray, register, Dispatch

class Spinner(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spin(self, seconds):
        t, end = torch.ones(1), time.monotonic() + seconds
        while time.monotonic() < end:
            torch.distributed.all_reduce(t)
            time.sleep(0.01)

init_ray(sys.argv[1])
group = WorkerGroup(ResourcePool([1, 1]), Spinner, group_name="actor_rollout_ref", dist_timeout_s=6)
print(json.dumps(group.placements), flush=True)
try:
    group.spin(120)
except WorkerError as e:
    print(json.dumps(str(e).splitlines()[0]), flush=True)
group.kill()
"""


# timing-bound (the stop must be named between 6 and 40 s after the signal): run alone, after the parallel tests.
# The two-node run above is not (its kill waits on a checkpoint file, whatever the load)
@pytest.mark.serial
def test_a_stopped_rank_on_another_node_is_named(two_nodes, tmp_path):
    """SIGSTOP on the rank the other node holds: its state is read there (by the group's probe actor on that node),
    and the call ends naming it, its node and the signal, after the bounded wait (dist_timeout_s=6)."""
    import os
    import signal
    import time

    address, nodes, env = two_nodes
    script = tmp_path / "stopped_remote.py"
    script.write_text(STOPPED_REMOTE)
    proc = subprocess.Popen([sys.executable, str(script), address], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        placements = json.loads(proc.stdout.readline() or "null")
        assert placements, proc.stderr.read()[-3000:]
        remote = next(p for p in placements if p["node_id"] == nodes[1])
        time.sleep(2)
        os.kill(remote["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        line = json.loads(proc.stdout.readline() or "null")
        assert line, proc.stderr.read()[-3000:]
        assert 6 <= time.monotonic() - stopped_at < 40
        assert re.match(rf"actor_rollout_ref rank {remote['rank']} \(node {nodes[1][:8]}, [^,]+, [^,]+, pid "
                        rf"{remote['pid']}\) stopped responding during spin\(\): its process is stopped \(SIGSTOP, "
                        r"state T\)", line), line
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
