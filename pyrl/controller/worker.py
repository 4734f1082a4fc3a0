"""Worker: the base class of every process the controller drives (one Ray actor per rank)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import traceback

import torch
import torch.distributed as dist

from pyrl.cgroups import oom_kill_count, oom_kill_file

FAULT_DIR_ENV = "PYRL_WORKER_FAULT_DIR"  # set by WorkerGroup: where each worker's fatal-signal report goes


def fault_file(directory: str, pid: int) -> str:
    """Where worker process `pid` writes what Python's faulthandler saw if a fatal signal (SIGSEGV, SIGFPE,
    SIGABRT, SIGBUS, SIGILL) ends it: the driver reads it to name the signal."""
    return os.path.join(directory, f"{pid}.txt")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RemoteError(Exception):
    """An exception a worker raised, as text: its type's name, its message and the worker's traceback. Always
    picklable, so it always reaches the driver (the original may not be: vLLM's pydantic validation errors hold
    objects that cannot be pickled, and Ray would deliver only "isn't serializable")."""

    def __init__(self, type_name: str, message: str, traceback_text: str):
        super().__init__(type_name, message, traceback_text)
        self.type_name, self.message, self.traceback_text = type_name, message, traceback_text

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class Worker:
    """Knows its rank and world size (from the environment its WorkerGroup sets: RANK, WORLD_SIZE,
    LOCAL_RANK) and sets up torch.distributed: gloo on CPU, nccl on CUDA, same code. Works standalone
    too (rank 0 of 1) for single-process use."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if os.environ.get(FAULT_DIR_ENV):  # started by a WorkerGroup: a crash must say which signal ended it
            try:
                os.makedirs(os.environ[FAULT_DIR_ENV], exist_ok=True)
                self._fault_report = open(fault_file(os.environ[FAULT_DIR_ENV], os.getpid()), "w")  # noqa: SIM115
            except OSError:  # evidence lost, not a reason to fail: Ray's stderr log keeps faulthandler's default
                pass
            else:
                faulthandler.enable(self._fault_report, all_threads=True)
                # a forked child (vLLM's engine processes) must not write its own crash into this process's report
                os.register_at_fork(after_in_child=faulthandler.disable)

    def call_method(self, method: str, *args, **kwargs):
        """How the driver calls every worker method: `method(*args, **kwargs)`, any exception it raises turned
        into a RemoteError carrying its type, message and traceback."""
        try:
            return getattr(self, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever it is, it must reach the driver intact
            raise RemoteError(type(e).__name__, str(e), traceback.format_exc()) from None

    def master_address(self) -> tuple[str, int]:
        """This process's node address and a free port, for rank 0 to host the rendezvous."""
        try:
            import ray  # lazy: Ray is optional for a worker (a standalone worker runs without it)

            address = ray.util.get_node_ip_address()
        except Exception:  # no Ray: a standalone worker
            address = "127.0.0.1"
        return address, _free_port()

    def put_object(self, value):
        """`value` in Ray's object store, once; the reference returned reaches other workers as a call's argument
        (each gets the value) without the data passing through the driver."""
        import ray  # lazy: Ray is optional for a worker (a standalone worker runs without it)

        return ray.put(value)

    def setup_distributed(self, master_addr: str, master_port: int, backend: str | None = None,
                          timeout_s: float = 600.0) -> str:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":  # Ray shows each GPU worker only its own GPU(s): local rank 1 may see one device
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return backend

    def placement(self) -> dict:
        """Where this rank runs: rank, local rank, Ray node id and IP, host name, process id, device, the
        torch.distributed backend and world size once set up (None before), and its memory cgroup's OOM kill count
        file and count (None where there is none)."""
        try:
            import ray  # lazy: Ray is optional for a worker (a standalone worker runs without it)

            node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        except Exception:  # no Ray: a standalone worker
            node_id, node_ip = "local", "127.0.0.1"
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        initialized = dist.is_available() and dist.is_initialized()
        oom_file = oom_kill_file()  # so the driver can tell an OOM kill from another SIGKILL after this process is gone
        return {"rank": self.rank, "local_rank": self.local_rank, "node_id": node_id, "node_ip": node_ip,
                "hostname": socket.gethostname(), "pid": os.getpid(), "device": device,
                "backend": dist.get_backend() if initialized else None,
                "dist_world_size": dist.get_world_size() if initialized else None,
                "oom_file": oom_file, "oom_kills": oom_kill_count(oom_file)}
