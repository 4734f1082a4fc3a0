"""The single controller on real Ray actors: dispatch modes, torch.distributed over gloo, errors."""

import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

from pyrl.controller import (
    Dispatch,
    Execute,
    ResourcePool,
    Worker,
    WorkerError,
    WorkerGroup,
    register,
    register_dispatch_mode,
)
from pyrl.controller.worker_group import process_state
from pyrl.protocol import DataProto

# timing-bound (Ray's view of free resources, signals, hang detection): run alone, after the parallel tests
pytestmark = pytest.mark.serial

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests package


def _reverse_split(world_size, args, kwargs):
    (items,) = args
    return [(items[world_size - 1 - r],) for r in range(world_size)], [{}] * world_size, None


register_dispatch_mode("reverse_split", _reverse_split, lambda outputs, ctx: sorted(outputs))


class UnpicklableError(Exception):
    """Like vLLM's pydantic ValidationError: holds something pickle cannot take."""

    def __init__(self, message):
        super().__init__(message)
        self.hook = lambda: None

    def __reduce__(self):
        raise TypeError("cannot pickle ArgsKwargs")


def raise_deep(rank):
    raise UnpicklableError(f"prompt + response exceed the context on rank {rank}")


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_unpicklable(self):
        raise_deep(self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag):
        return (tag, self.rank, self.world_size)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def double(self, x):
        return 2 * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict({"y": data.batch["x"] + 100 * self.rank, "rank": torch.full((len(data),), self.rank)},
                                  {"uid": data.non_tensor_batch["uid"]})
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def repeat_rows(self, data: DataProto, times: int) -> DataProto:
        """`times` rows per input row, each input's together (as generation returns n samples per prompt)."""
        return data.repeat(times, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def count(self, data: DataProto):
        return {"rows": len(data), "rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow_rank(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value):
        t = torch.tensor([float(value + self.rank)])
        torch.distributed.all_reduce(t)
        return float(t), torch.distributed.get_backend()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lone_all_reduce(self, rank):
        """Only `rank` enters the collective, as when the ranks' code paths diverge."""
        if self.rank == rank:
            torch.distributed.all_reduce(torch.ones(1))
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_on(self, rank):
        if self.rank == rank:
            os._exit(3)
        time.sleep(600)  # the surviving rank is stuck, as in a collective with the dead one

    @register(dispatch_mode="reverse_split")
    def take(self, x):
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def enter_cgroup(self, procs_files):
        for path in procs_files:
            with open(path, "w") as f:
                f.write(str(os.getpid()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allocate(self, nbytes):
        block = bytearray(nbytes)
        block[::4096] = b"1" * len(range(0, nbytes, 4096))  # every page written: resident
        return len(block)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spin(self, seconds):
        """Collectives for `seconds`, as a training step's are: every rank waits on every other."""
        t, end = torch.ones(1), time.monotonic() + seconds
        while time.monotonic() < end:
            torch.distributed.all_reduce(t)
            time.sleep(0.01)
        return self.rank


@pytest.fixture(scope="module")
def group(ray_session):
    wg = WorkerGroup(ResourcePool([2]), EchoWorker)
    yield wg
    wg.kill()


def test_one_to_all_and_all_to_all(group):
    assert group.whoami("t") == [("t", 0, 2), ("t", 1, 2)]
    assert group.double([1, 5]) == [2, 10]
    with pytest.raises(ValueError, match="argument 0: this dispatch mode needs a list of 2 items"):
        group.double([1, 2, 3])


def test_dp_compute_proto_pads_and_strips(group):
    data = DataProto.from_dict({"x": torch.arange(5)}, {"uid": list("abcde")})
    out = group.add_rank(data)
    assert len(out) == 5  # padded to 6 for two ranks, the padding stripped again
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.batch["y"].tolist() == [0, 1, 2, 103, 104]
    assert out.non_tensor_batch["uid"].tolist() == list("abcde")
    assert group.count(data) == [{"rows": 3, "rank": 0}, {"rows": 3, "rank": 1}]
    # three rows back per row: the padding row's three are stripped too (was: one, leaving two padding rows)
    out = group.repeat_rows(data, 3)
    assert out.batch["x"].tolist() == [i for i in range(5) for _ in range(3)]


def test_rank_zero_non_blocking_and_custom_modes(group):
    assert group.only_rank_zero() == 0
    refs = group.slow_rank()
    assert ray.get(refs) == [0, 1]
    assert group.take(["a", "b"]) == ["a", "b"] and group.take(["x", "y"]) == ["x", "y"]


def test_torch_distributed_over_gloo(group):
    total, backend = group.all_reduce(10)[0]
    assert backend == "gloo" and total == 10 + 11


def test_worker_exception_names_class_rank_and_method(group):
    with pytest.raises(WorkerError, match=r"EchoWorker rank 1 \(node [0-9a-f]{8}, [^,]+, [^,]+, pid \d+\) "
                                           r"raised in fail_on\(\): ValueError: bad input on rank 1"):
        group.fail_on(1)
    assert group.fail_on(5) == [0, 1]  # the group still works


def test_unpicklable_worker_exception_arrives_with_type_message_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail_unpicklable()
    text = str(info.value)
    assert re.match(r"EchoWorker rank \d \(node .*\) raised in fail_unpicklable\(\): UnpicklableError: "
                    r"prompt \+ response exceed the context on rank \d", text), text
    assert "the worker's traceback" in text and "in raise_deep" in text and "isn't serializable" not in text


def test_killed_worker_ends_the_call_quickly(ray_session):
    wg = WorkerGroup(ResourcePool([2]), EchoWorker, init_distributed=False)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"EchoWorker rank 0 \(node .*\) died during exit_on\(\): ended by a signal "
                                                      r"no handler sees \(SIGKILL\), or exited without a Python error"):
        wg.exit_on(0)
    assert time.monotonic() - start < 60
    wg.kill()


def test_a_collective_the_other_ranks_never_join_times_out(ray_session):
    """dist_timeout_s (verl's actor_rollout_ref.nccl_timeout) bounds the wait: an error, not a hang."""
    wg = WorkerGroup(ResourcePool([2]), EchoWorker, dist_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"EchoWorker rank 0 \(node .*\) raised in lone_all_reduce\(\)"):
        wg.lone_all_reduce(0)
    assert time.monotonic() - start < 30
    wg.kill()


def _signal_rank_during_spin(wg, rank, signum, timeout_s=60):
    """Send `signum` to rank's process 2 s into a 120 s spin; returns (the WorkerError, seconds from the signal to
    the error, the group's pids)."""
    pids = [p["pid"] for p in wg.placements]
    sent = []

    def send():
        time.sleep(2)
        os.kill(pids[rank], signum)
        sent.append(time.monotonic())

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    with pytest.raises(WorkerError) as info:
        wg.spin(120)
    thread.join()
    return info.value, time.monotonic() - sent[0], pids


def _all_gone(pids, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if process_state(pid) not in (None, "Z")]
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("signum, cause", [
    (signal.SIGKILL, r"ended by a signal no handler sees \(SIGKILL\), or exited without a Python error"),
    (signal.SIGSEGV, r"killed by SIGSEGV \(its faulthandler: 'Fatal Python error: Segmentation fault'\)"),
], ids=["SIGKILL", "SIGSEGV"])
def test_a_worker_killed_mid_step_is_named_with_its_node_and_signal(ray_session, signum, cause, caplog):
    """A rank killed in the middle of collectives: the call ends within 30 s, the error's first line names the
    group, the rank, its node and process and what ended it (a fatal signal's Python stacks logged), and after
    kill() no worker process is left."""
    wg = WorkerGroup(ResourcePool([2]), EchoWorker, group_name="actor_rollout_ref")
    with caplog.at_level("ERROR", logger="pyrl"):
        error, seconds, pids = _signal_rank_during_spin(wg, 1, signum)
    if signum == signal.SIGSEGV:
        assert "its faulthandler's report:\nFatal Python error: Segmentation fault" in caplog.text
        assert "in spin" in caplog.text  # the stack of the thread that was running the call
    first = str(error).splitlines()[0]
    assert re.fullmatch(rf"actor_rollout_ref rank 1 \(node [0-9a-f]{{8}}, [^,]+, [^,]+, pid {pids[1]}\) died during "
                        rf"spin\(\): {cause}", first), str(error)
    assert seconds < 30
    wg.kill()
    assert _all_gone(pids)


def test_a_worker_the_oom_killer_ends_is_named_so(ray_session):
    """A worker in a memory-limited cgroup (a container's limit, here one made for the test) that outgrows it: the
    kernel's OOM killer SIGKILLs it, and the error says so from the cgroup's own count, not from a guess."""
    from pyrl.sandbox.cgroup import probe

    hierarchy = probe()
    if hierarchy is None:
        pytest.skip("needs a writable memory cgroup (cgroup v2 with memory delegated, or v1 as root)")
    import psutil

    wg = WorkerGroup(ResourcePool([1]), EchoWorker, init_distributed=False)
    limited = hierarchy.create(psutil.Process(wg.placements[0]["pid"]).memory_info().rss + (200 << 20), 64)
    try:
        wg.enter_cgroup(list(limited.procs))
        wg.placements = wg.execute_all("placement")  # where it runs now, as a container's worker would from its start
        assert wg.placements[0]["oom_kills"] == 0, wg.placements[0]
        with pytest.raises(WorkerError) as info:
            wg.allocate(2 << 30)
        first = str(info.value).splitlines()[0]
        assert re.fullmatch(r"EchoWorker rank 0 \(node [0-9a-f]{8}, [^,]+, [^,]+, pid \d+\) died during allocate\(\): "
                            r"most likely the kernel's OOM killer \(SIGKILL\): its memory cgroup recorded an OOM kill "
                            r"since it started \(oom_kill 0 -> 1, /.*/memory\.(events|oom_control)\)", first), first
    finally:
        wg.kill()
        assert limited.remove(within_s=10)


class FailingWorker(Worker):
    def __init__(self):
        super().__init__()
        raise ValueError("no such model: /nowhere")


def test_a_worker_whose_constructor_raises_is_named_with_its_error(ray_session):
    """Not a signal: Ray's account of the constructor's exception comes with the error."""
    with pytest.raises(WorkerError) as info:
        WorkerGroup(ResourcePool([1]), FailingWorker, group_name="critic")
    first, *rest = str(info.value).splitlines()
    assert re.fullmatch(r"critic rank 0 died during master_address\(\): its constructor raised \(Ray's account "
                        r"follows\)", first), first
    assert "Ray's account: " in rest[0] and "no such model: /nowhere" in rest[0]


def test_a_stopped_worker_is_named_after_the_bounded_wait(ray_session):
    """SIGSTOP: the process neither answers nor dies. After dist_timeout_s (verl's nccl_timeout) the call ends
    naming the stopped rank, whether the wait or the other rank's collective timing out ends it first."""
    wg = WorkerGroup(ResourcePool([2]), EchoWorker, group_name="critic", dist_timeout_s=4)
    error, seconds, pids = _signal_rank_during_spin(wg, 1, signal.SIGSTOP)
    first = str(error).splitlines()[0]
    assert re.match(rf"critic rank 1 \(node [0-9a-f]{{8}}, [^,]+, [^,]+, pid {pids[1]}\) stopped responding during "
                    rf"spin\(\): its process is stopped \(SIGSTOP, state T\)", first), str(error)
    assert 4 <= seconds < 30
    wg.kill()  # a stopped process still dies by SIGKILL
    assert _all_gone(pids)


def test_register_rejects_unknown_modes():
    with pytest.raises(ValueError, match="dispatch_mode: unknown 'nope'"):
        register(dispatch_mode="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("reverse_split", _reverse_split, list)
