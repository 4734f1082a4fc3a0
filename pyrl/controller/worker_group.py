"""ResourcePool and WorkerGroup: Ray actors in a placement group, driven from one controller.

Every @register'ed method of the worker class becomes a WorkerGroup method: the driver calls
`group.method(data)`, the dispatch mode splits `data` across the ranks, every rank runs, and the
collect function merges the results. A worker that raises, or whose process dies or is stopped, ends the
call with a WorkerError naming the group, rank, node, process and method; for a process that died, what ended it
(the fatal signal its faulthandler reported, the kernel's OOM killer, Ray's memory monitor, or a signal nothing
could catch such as SIGKILL), and for one stopped (SIGSTOP) longer than dist_timeout_s, that.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pyrl.cgroups import oom_kill_count
from pyrl.controller.decorator import DISPATCH_MODES, PYRL_REGISTER_ATTR, Execute
from pyrl.controller.worker import FAULT_DIR_ENV, RemoteError, fault_file

log = logging.getLogger("pyrl")


class WorkerError(RuntimeError):
    """A worker failed; the message's first line names its group, rank, node, process and the method."""


PROBE_S = 2.0  # while a call is outstanding, how often the pending ranks' processes are looked at
# how long a failed call waits for another node's account of the ranks it still waits on: the error is coming
# anyway, and its first line should name the cause
CULPRIT_WAIT_S = 15.0
# faulthandler's words for the fatal signals it reports
FATAL_SIGNALS = {"Segmentation fault": "SIGSEGV", "Floating-point exception": "SIGFPE", "Aborted": "SIGABRT",
                 "Bus error": "SIGBUS", "Illegal instruction": "SIGILL"}


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter on this node (/proc: R, S, D, T stopped, t traced, Z zombie), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_report(pid: int, fault_dir: str, oom_file: str | None = None) -> dict:
    """What this node says of process `pid`: its state (process_state), what its faulthandler wrote (a fatal
    signal: the first line, and the report with the threads' stacks, up to 8 KiB) or "", and the OOM kill count in
    oom_file (its memory cgroup's, from its placement). Runs in the driver for its own node, in the group's
    NodeProbe on any other."""
    state = process_state(pid)
    report = ""
    try:
        with open(fault_file(fault_dir, pid)) as f:
            report = f.read(8192)
    except OSError:
        pass
    fault = next((line.strip() for line in report.splitlines() if line.strip()), "")
    return {"state": state, "fault": fault, "fault_report": report, "oom_kills": oom_kill_count(oom_file)}


class NodeProbe:
    """process_report on one node other than the driver's. The group starts one per such node with its workers, so
    a process is looked at by a warm actor: a task at failure time would wait seconds for a cold worker process,
    longer than the failed call should (on a loaded node, longer than PROBE_S)."""

    def report(self, pid: int, fault_dir: str, oom_file: str | None) -> dict:
        return process_report(pid, fault_dir, oom_file)


def death_cause(report: dict | None, placement: dict, ray_detail: str) -> str:
    """Why a worker's process ended, from the evidence there is: its faulthandler's report, Ray's memory monitor,
    its memory cgroup's OOM kill count against the one at its placement."""
    if report and report["fault"]:
        for words, name in FATAL_SIGNALS.items():
            if words in report["fault"]:
                return f"killed by {name} (its faulthandler: {report['fault']!r})"
        return f"its faulthandler reported {report['fault']!r}"
    if "memory monitor" in ray_detail or "low on memory" in ray_detail:
        return "killed by Ray's memory monitor (the node ran low on memory)"
    if "creation task" in ray_detail:
        return "its constructor raised (Ray's account follows)"
    if "node has died" in ray_detail or "node died" in ray_detail:
        return "its node died (Ray's account follows)"
    before, after = placement.get("oom_kills"), (report or {}).get("oom_kills")
    if before is not None and after is not None and after > before:
        return (f"most likely the kernel's OOM killer (SIGKILL): its memory cgroup recorded an OOM kill since it "
                f"started (oom_kill {before} -> {after}, {placement['oom_file']})")
    return "ended by a signal no handler sees (SIGKILL), or exited without a Python error"


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs) -> None:
    """Join the cluster at `address` ("auto", "host:port", "ray://head:10001") or, without one, at $RAY_ADDRESS
    (ray.init reads it, which is how verl joins one); otherwise start a private local instance with num_cpus
    CPUs. Never joins by accident: a bare ray.init() would also attach to whatever cluster Ray's temp dir
    advertises (someone's `ray start --head`, a crashed run's leftover address file) and then reject num_cpus."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kwargs)  # the cluster has its own resources: num_cpus does not apply
        return
    # Ray (2.60 here) turns token authentication on for every new local cluster and warns each time that it did;
    # keep Ray's secure default, without the warning. (RAY_AUTH_MODE, Ray's switch, is read when ray is imported:
    # "token" set later breaks the start, GCS waiting for a token that was never made; "disabled" drops auth.)
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    # Ray starts an idle Python worker per CPU when the first driver connects, for tasks to come; pyrl's workers
    # are actors whose runtime_env (their rank's env vars) no prestarted process has, so those would only burn CPU
    # at every start (1.2 CPU-seconds for the 2 of a 2-CPU instance, measured; a process per CPU on a large node)
    system_config = {"prestart_worker_first_driver": False, **kwargs.pop("_system_config", {})}
    try:
        ray.init(**{"address": "local", "num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": True,
                    **kwargs, "_system_config": system_config})  # kwargs (ray_kwargs.ray_init) may override the
        # options before them
    finally:
        auth_log.setLevel(level)


# Ray labels every node with its id; a bundle whose label selector names it can only be placed there.
NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(RuntimeError):
    """The cluster cannot host the pool: too few suitable nodes, or a node's bundles never became ready."""


@dataclass(frozen=True)
class Node:
    """An alive Ray node: its id, address, host name, total CPU / GPU resources and the part of them still free
    (not reserved by a placement group, this run's earlier pools included, nor held by a task or actor)."""

    id: str
    ip: str
    hostname: str
    cpus: float
    gpus: float
    free_cpus: float
    free_gpus: float

    @classmethod
    def from_ray(cls, info: dict, available: dict) -> "Node":
        resources = info.get("Resources", {})
        return cls(info["NodeID"], info["NodeManagerAddress"], info.get("NodeManagerHostname", ""),
                   resources.get("CPU", 0.0), resources.get("GPU", 0.0), available.get("CPU", 0.0),
                   available.get("GPU", 0.0))

    def __str__(self) -> str:
        return (f"{self.id[:8]} ({self.ip}, {self.hostname}): CPU {self.cpus:g} ({self.free_cpus:g} free), "
                f"GPU {self.gpus:g} ({self.free_gpus:g} free)")


def alive_nodes() -> list[Node]:
    """The alive nodes with what is free on each now. Ray's GCS takes a placement group's bundles off its node's
    available resources when the group is committed, before pg.ready() resolves, so a pool placed just before
    shows here (Ray's per-node view is a DeveloperAPI of ray._private.state; a resource at 0 is left out)."""
    from ray._private.state import available_resources_per_node  # lazy: a private Ray API, needed only here

    available = available_resources_per_node()
    return [Node.from_ray(info, available.get(info["NodeID"], {})) for info in ray.nodes() if info.get("Alive")]


def choose_nodes(nodes: list[Node], processes_per_node: list, cpus_per_process: float, gpus_per_process: float,
                 first: str | None = None) -> list[Node]:
    """A distinct node for each entry of processes_per_node, whose free CPUs and GPUs hold that many processes
    (what other pools already reserve does not count: a second pool goes to the nodes with room); the node with id
    `first` (the driver's) is tried first, the others in the order given. Raises a PlacementError listing every
    node when there are too few."""
    ordered = sorted(nodes, key=lambda node: node.id != first)
    chosen: list[Node] = []
    for count in processes_per_node:
        fits = [node for node in ordered if node not in chosen and node.free_cpus >= count * cpus_per_process
                and node.free_gpus >= count * gpus_per_process]
        if not fits:
            wanted = ", ".join(f"{c} x {{CPU: {cpus_per_process:g}, GPU: {gpus_per_process:g}}}"
                               for c in processes_per_node)
            listed = "; ".join(str(node) for node in nodes) or "none"
            raise PlacementError(f"{len(processes_per_node)} distinct node(s) wanted, one per entry of [{wanted}], "
                                 f"but only {len(chosen)} of the cluster's alive nodes have them free. Nodes: {listed}")
        chosen.append(fits[0])
    return chosen


@dataclass
class ResourcePool:
    """processes_per_node[i] worker processes on node i, each with `gpus_per_process` GPUs (0: CPU workers on
    gloo) and `cpus_per_process` CPUs (None: each chosen node's free CPUs shared equally by its processes, the
    smallest share over the nodes, at least 1). Node i is a distinct Ray node: its placement group is pinned
    to it by its node id, so two "nodes" never share one Ray node. Up to max_colocate_count worker groups may
    share the pool (e.g. the critic next to the actor), each taking an equal slice of every bundle."""

    processes_per_node: list = field(default_factory=lambda: [1])
    gpus_per_process: int = 0
    cpus_per_process: float | None = 1.0
    max_colocate_count: int = 1
    nodes: list = field(default_factory=list)  # the Node each entry of processes_per_node runs on, once placed
    _groups: list = field(default_factory=list, repr=False)
    _users: int = field(default=0, repr=False)  # live WorkerGroups on the pool; the last one's kill() releases it

    @property
    def world_size(self) -> int:
        return sum(self.processes_per_node)

    def placement_groups(self, timeout_s: float = 60.0):
        """One STRICT_PACK placement group per node, on the nodes choose_nodes picks (the driver's first);
        raises a PlacementError when the cluster cannot host them, or when Ray put a group elsewhere than the
        node its bundles' label selector names (Ray ignored the label selectors of STRICT_PACK groups until
        ray-project/ray#60170, merged in January 2026: hence pyproject's ray>=2.54, the first release after it)."""
        if self._groups:
            return self._groups
        self.nodes = self._wait_for_nodes(timeout_s)
        if self.cpus_per_process is None:
            self.cpus_per_process = max(1, min(int(node.free_cpus // count)
                                               for node, count in zip(self.nodes, self.processes_per_node)))
        bundle = {"CPU": self.cpus_per_process}
        if self.gpus_per_process:
            bundle["GPU"] = self.gpus_per_process
        try:
            for index, (node, count) in enumerate(zip(self.nodes, self.processes_per_node)):
                pg = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                                     bundle_label_selector=[{NODE_ID_LABEL: node.id} for _ in range(count)])
                self._groups.append(pg)
                ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
                if not ready:
                    raise PlacementError(
                        f"resource pool: node {index}, {node}, cannot host {count} processes of {bundle} within "
                        f"{timeout_s:.0f} s (other jobs hold its resources?); the cluster's available resources: "
                        f"{ray.available_resources()}")
                landed = set(placement_group_table(pg)["bundles_to_node_id"].values())
                if landed != {node.id}:
                    raise PlacementError(
                        f"resource pool: node {index} was to be {node}, but Ray placed its bundles on "
                        f"{', '.join(sorted(n[:8] for n in landed))}: this Ray ({ray.__version__}) does not honor "
                        f"bundle label selectors of STRICT_PACK placement groups (ray-project/ray#60170); "
                        f"install ray>=2.54")
        except BaseException:
            self.release()
            raise
        _PLACED.append(self)
        return self._groups

    def _wait_for_nodes(self, timeout_s: float) -> list[Node]:
        """choose_nodes on the nodes' free resources, waiting up to timeout_s for resources other jobs or released
        pools hold now (a pool released just before, e.g. the last run's, comes back within a fraction of a second);
        when the nodes cannot fit it even with those back (too few nodes, or this process's own live pools hold the
        rest) it raises at once."""
        driver = ray.get_runtime_context().get_node_id()
        choose = functools.partial(choose_nodes, processes_per_node=self.processes_per_node,
                                   cpus_per_process=self.cpus_per_process or 1, gpus_per_process=self.gpus_per_process,
                                   first=driver)
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = alive_nodes()
            try:
                return choose(nodes)
            except PlacementError:
                choose(_without_others(nodes))  # raises at once when even that cannot fit
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def release(self) -> None:
        for pg in self._groups:
            remove_placement_group(pg)
        self._groups.clear()
        _PLACED[:] = [pool for pool in _PLACED if pool is not self]


_PLACED: list[ResourcePool] = []  # this process's pools holding placement groups now


def _without_others(nodes: list[Node]) -> list[Node]:
    """The nodes as if every reservation but this process's live pools' were released."""
    held: dict[str, list] = {}
    for pool in _PLACED:
        for node, count in zip(pool.nodes, pool.processes_per_node):
            cpus, gpus = held.get(node.id, (0.0, 0.0))
            held[node.id] = (cpus + count * pool.cpus_per_process, gpus + count * pool.gpus_per_process)
    return [dataclasses.replace(n, free_cpus=n.cpus - held.get(n.id, (0, 0))[0],
                                free_gpus=n.gpus - held.get(n.id, (0, 0))[1]) for n in nodes]


class WorkerGroup:
    def __init__(self, resource_pool: ResourcePool, worker_cls, *args, init_distributed: bool = True,
                 env: dict | None = None, dist_timeout_s: float = 600.0, group_name: str | None = None, **kwargs):
        """dist_timeout_s: how long a collective may wait for the other ranks before failing (verl's
        actor_rollout_ref.nccl_timeout), and how long a stopped (SIGSTOP) worker is waited for. group_name: the role
        the errors name (e.g. "actor_rollout_ref"; default the worker class's name)."""
        self.worker_cls = worker_cls
        self.name = group_name or worker_cls.__name__
        self.dist_timeout_s = dist_timeout_s
        self.fault_dir = tempfile.mkdtemp(prefix="pyrl-worker-faults-")
        self.placements: list = []
        self.resource_pool = resource_pool
        self.world_size = resource_pool.world_size
        share = 1.0 / resource_pool.max_colocate_count
        remote_cls = ray.remote(worker_cls)
        self.workers = []
        self.probes: dict = {}  # node id -> its NodeProbe actor, for every node but the driver's
        self._killed = False
        resource_pool._users += 1
        try:  # a group that fails to start gives back what it took: its processes, and an unshared pool
            rank = 0
            for pg in resource_pool.placement_groups():
                for bundle_index in range(pg.bundle_count):
                    env_vars = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                                "LOCAL_RANK": str(bundle_index), FAULT_DIR_ENV: self.fault_dir,
                                **{k: str(v) for k, v in (env or {}).items()}}
                    options = {
                        "num_cpus": resource_pool.cpus_per_process * share,
                        "num_gpus": resource_pool.gpus_per_process * share,
                        "scheduling_strategy": PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=bundle_index),
                        "runtime_env": {"env_vars": env_vars},
                    }
                    self.workers.append(remote_cls.options(**options).remote(*args, **kwargs))
                    rank += 1
            self._bind_registered_methods()
            if init_distributed:
                master = self._gather(self._submit("master_address", [()], [{}], [0]), "master_address", ranks=[0])[0]
                self.execute_all("setup_distributed", *master, None, dist_timeout_s)
            self.placements = self.execute_all("placement")  # where each rank runs, in rank order
            self._start_probes()
        except BaseException:
            self.kill()
            raise

    def describe_placements(self) -> list[str]:
        """One line per rank: its node (short id, IP, host name), process id, device and process group."""
        lines = []
        for p in self.placements:
            group = f", {p['backend']} world {p['dist_world_size']}" if p["backend"] else ""
            lines.append(f"rank {p['rank']} (local {p['local_rank']}) -> node {p['node_id'][:8]} ({p['node_ip']}, "
                         f"{p['hostname']}), pid {p['pid']}, {p['device']}{group}")
        return lines

    # ---- calling workers ----
    def _gather(self, refs, method: str, ranks=None):
        """Results in rank order; the first failure (exception, dead process, or a process stopped for longer than
        dist_timeout_s) raises a WorkerError at once, without waiting for ranks that may be blocked in a collective
        with the failed one."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        results, pending = {}, list(refs)
        stopped_since: dict[int, float] = {}  # rank -> when its process was first seen stopped
        next_probe: dict[int, float] = {}  # rank on another node -> when its process is next looked at
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=PROBE_S)
            if not ready:
                self._check_stopped([rank_of[ref] for ref in pending], stopped_since, next_probe, method)
                continue
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[ref] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                detail = f"{type(cause).__name__}: {cause}"
                if isinstance(cause, RemoteError):
                    detail = f"{cause}\n--- the worker's traceback ---\n{cause.traceback_text.rstrip()}"
                raised = f"{self.where(rank)} raised in {method}(): {detail}"
                culprit = self._dead_or_stopped([rank_of[r] for r in pending])
                if culprit is None:
                    raise WorkerError(raised) from None
                # a collective failing on this rank because another one died or stopped: the cause comes first
                other, report = culprit
                self._log_fault_report(other, report)
                first = self._stopped_line(other, method, report) if report["state"] in ("T", "t") else \
                    self._died_line(other, method, report, "")
                raise WorkerError(f"{first}\nthen {raised}") from None
            except ray.exceptions.RayActorError as e:
                account = " ".join(str(e).split())
                if isinstance(e, ray.exceptions.ActorUnavailableError):  # not dead: Ray cannot reach it now
                    raise WorkerError(f"{self.where(rank)} became unavailable during {method}()\nRay's account: "
                                      f"{account}") from None
                report = self._report(rank, CULPRIT_WAIT_S)
                self._log_fault_report(rank, report)
                raise WorkerError(f"{self._died_line(rank, method, report, str(e))}\nRay's account: "
                                  f"{account}") from None
        return [results[ref] for ref in refs]

    def where(self, rank: int) -> str:
        """'<group> rank R (node ID8, IP, host, pid P)': as much as is known (placements come after start-up)."""
        if rank < len(self.placements):
            p = self.placements[rank]
            return (f"{self.name} rank {rank} (node {p['node_id'][:8]}, {p['node_ip']}, {p['hostname']}, "
                    f"pid {p['pid']})")
        return f"{self.name} rank {rank}"

    def _start_probes(self) -> None:
        """A NodeProbe on each node holding a rank, other than the driver's, and a first answer from each: a node
        whose probe does not start within 60 s is only warned of (its ranks' failures are then named with less)."""
        nodes = {p["node_id"] for rank, p in enumerate(self.placements) if not self._is_local(rank)}
        probe_cls = ray.remote(num_cpus=0)(NodeProbe)
        for node in sorted(nodes):
            self.probes[node] = probe_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        answers = {node: probe.report.remote(0, self.fault_dir, None) for node, probe in self.probes.items()}
        ready, _ = ray.wait(list(answers.values()), num_returns=len(answers), timeout=60)
        for node, ref in answers.items():
            if ref not in ready:
                log.warning("%s: the process probe on node %s did not start within 60 s", self.name, node[:8])

    def _reports(self, ranks: list, timeout_s: float = PROBE_S) -> dict:
        """{rank: process_report of its process, read where it runs}: a rank on the driver's node read here, the
        others asked of their nodes' probes at once; a rank without an answer within timeout_s (its node may be
        gone), or before placements are known, is left out."""
        reports, asked = {}, {}
        for rank in ranks:
            if rank >= len(self.placements):
                continue
            p = self.placements[rank]
            if self._is_local(rank):
                reports[rank] = process_report(p["pid"], self.fault_dir, p.get("oom_file"))
            elif p["node_id"] in self.probes:
                asked[self.probes[p["node_id"]].report.remote(p["pid"], self.fault_dir, p.get("oom_file"))] = rank
        if asked:
            ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
            for ref in ready:
                try:
                    reports[asked[ref]] = ray.get(ref)
                except Exception:  # noqa: BLE001 - the probe died with its node: no evidence, not an error of its own
                    pass
        return reports

    def _report(self, rank: int, timeout_s: float = PROBE_S) -> dict | None:
        return self._reports([rank], timeout_s).get(rank)

    def _is_local(self, rank: int) -> bool:
        return rank < len(self.placements) and \
            self.placements[rank]["node_id"] in ("local", ray.get_runtime_context().get_node_id())

    def _check_stopped(self, ranks: list, stopped_since: dict, next_probe: dict, method: str) -> None:
        """Raise once a pending rank's process has been stopped (state T or t) for dist_timeout_s: it answers
        nothing, and the ranks in a collective with it would only fail later, naming themselves. A process on
        another node is looked at every dist_timeout_s / 4 (the bound then stretches by as much)."""
        now = time.monotonic()
        due = []
        for rank in ranks:
            if not self._is_local(rank):  # another node's process is asked of its probe, less often
                if now < next_probe.get(rank, 0.0):
                    continue
                next_probe[rank] = now + max(PROBE_S, self.dist_timeout_s / 4)
            due.append(rank)
        reports = self._reports(due)
        for rank in due:
            report = reports.get(rank)
            if report is None:  # no answer this time: the clock of a rank seen stopped keeps running
                continue
            if report["state"] not in ("T", "t"):
                stopped_since.pop(rank, None)
                continue
            since = stopped_since.setdefault(rank, now)
            if now - since >= self.dist_timeout_s:
                raise WorkerError(self._stopped_line(rank, method, report)
                                  + f" for {now - since:.0f} s (dist_timeout_s={self.dist_timeout_s:g}, verl's "
                                    "actor_rollout_ref.nccl_timeout)")

    def _log_fault_report(self, rank: int, report: dict | None) -> None:
        if report and report["fault_report"]:  # the Python stacks at the fatal signal
            log.error("%s: its faulthandler's report:\n%s", self.where(rank), report["fault_report"].rstrip())

    def _died_line(self, rank: int, method: str, report: dict | None, ray_detail: str) -> str:
        placement = self.placements[rank] if rank < len(self.placements) else {}
        return f"{self.where(rank)} died during {method}(): {death_cause(report, placement, ray_detail)}"

    def _stopped_line(self, rank: int, method: str, report: dict) -> str:
        return (f"{self.where(rank)} stopped responding during {method}(): its process is stopped (SIGSTOP, "
                f"state {report['state']})")

    def _dead_or_stopped(self, ranks: list):
        """(rank, its process_report) of the first of these ranks whose process is gone or stopped, else None."""
        reports = self._reports(ranks, CULPRIT_WAIT_S)
        for rank in ranks:
            report = reports.get(rank)
            if report and report["state"] in (None, "Z", "T", "t"):
                return rank, report
        return None

    def _submit(self, method: str, per_rank_args, per_rank_kwargs, ranks):
        return [self.workers[r].call_method.remote(method, *per_rank_args[i], **per_rank_kwargs[i])
                for i, r in enumerate(ranks)]

    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; results in rank order."""
        refs = self._submit(method, [args] * self.world_size, [kwargs] * self.world_size, range(self.world_size))
        return self._gather(refs, method)

    def _call_registered(self, method, dispatch_mode, execute_mode, blocking, *args, **kwargs):
        mode = DISPATCH_MODES[dispatch_mode]
        per_rank_args, per_rank_kwargs, context = mode.dispatch(self.world_size, args, kwargs)
        if execute_mode == Execute.RANK_ZERO:
            refs = self._submit(method, per_rank_args[:1], per_rank_kwargs[:1], [0])
            return refs[0] if not blocking else self._gather(refs, method, ranks=[0])[0]
        refs = self._submit(method, per_rank_args, per_rank_kwargs, range(self.world_size))
        if not blocking:
            return refs
        return mode.collect(self._gather(refs, method), context)

    def _bind_registered_methods(self):
        for name, fn in inspect.getmembers(self.worker_cls, predicate=callable):
            spec = getattr(fn, PYRL_REGISTER_ATTR, None)
            if spec is None:
                continue
            if hasattr(type(self), name):
                raise ValueError(f"{self.worker_cls.__name__}.{name}: the name clashes with a WorkerGroup attribute")
            bound = functools.partial(self._call_registered, name, *spec)
            functools.update_wrapper(bound, fn)
            setattr(self, name, bound)

    def kill(self) -> None:
        """End the worker processes; the last group on a resource pool also gives its placement groups back."""
        if self._killed:
            return
        self._killed = True
        for actor in [*self.workers, *self.probes.values()]:
            ray.kill(actor, no_restart=True)
        self.workers, self.probes = [], {}
        shutil.rmtree(self.fault_dir, ignore_errors=True)
        self.resource_pool._users -= 1
        if self.resource_pool._users == 0:
            self.resource_pool.release()
