"""CPU workers keep the memory they free (pyrl.trainer.workers.CPU_MALLOC_ENV): glibc would give each large freed
block back to the kernel, and an update would fault its activations in afresh on every micro-batch."""

import sys

import pytest
import torch

from pyrl.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
from pyrl.trainer.workers import CPU_MALLOC_ENV, cpu_malloc_env

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests package

MIB = 64


class PageFaultWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def faults_of_refilled_blocks(self, mib: int, blocks: int) -> list[int]:
        """Minor page faults of each of `blocks` fresh `mib` MiB tensors, filled and freed one after another."""
        import resource

        faults = []
        for _ in range(blocks):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            torch.ones(mib << 18)  # float32: mib MiB, every page written, freed at once
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return faults


def test_a_cpu_worker_reuses_the_pages_it_freed(ray_session):
    """Above glibc's largest mmap threshold (32 MiB) every freed block goes back to the kernel by default. Kept, the
    heap settles after its first few blocks (the runtime's own allocations land between them) and later blocks
    reuse its pages."""
    faults = {}
    for name, env in (("kept", CPU_MALLOC_ENV), ("glibc's default", {})):
        group = WorkerGroup(ResourcePool([1]), PageFaultWorker, init_distributed=False, env=env)
        try:
            faults[name] = group.faults_of_refilled_blocks(MIB, 10)[0]
        finally:
            group.kill()
    pages = (MIB << 20) // 4096
    assert min(faults["glibc's default"][5:]) > pages // 2, faults  # every block faulted in afresh
    assert sum(faults["kept"][5:]) < pages // 2, faults


def test_the_drivers_own_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert "MALLOC_MMAP_MAX_" not in cpu_malloc_env()
    assert cpu_malloc_env()["MALLOC_TRIM_THRESHOLD_"] == CPU_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]
