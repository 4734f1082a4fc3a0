"""The process group as the workers use it: this rank's device, the world size, and collectives that are
no-ops in a single process (so a worker runs unchanged outside Ray, e.g. as a test's reference)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def worker_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_reduce(tensor: torch.Tensor, op=None) -> torch.Tensor:
    """In place over the default group (a no-op in a single process); gloo needs CPU tensors, nccl CUDA ones."""
    if is_distributed():
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered whole on every rank (a collective); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded DTensor, its storage itself (no copy); plain tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t
