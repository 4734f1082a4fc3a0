"""FSDP2 sharding of the workers' models, and their whole weights gathered tensor by tensor (for the
rollout engine and exports)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pyrl.config import torch_dtype
from pyrl.workers.distributed import full_tensor, is_distributed


def fsdp_wrap(model: nn.Module, layers, fsdp_config, device: torch.device) -> torch.dtype:
    """fully_shard each decoder layer, then the root (embedding, final norm, head), in place. On CUDA the
    forward runs in fsdp_config.dtype with float32 gradient reduction; CPU runs in the master dtype.
    Returns the compute dtype."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    master = torch_dtype(fsdp_config.model_dtype, "fsdp_config.model_dtype")
    model.to(device=device, dtype=master)
    compute = torch_dtype(fsdp_config.dtype, "fsdp_config.dtype") if device.type == "cuda" else master
    if not is_distributed():
        return master  # a plain single-process module: nothing to shard
    mp = MixedPrecisionPolicy()
    if compute != master:
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if fsdp_config.param_offload and device.type == "cuda" else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=fsdp_config.reshard_after_forward, offload_policy=offload)
    fully_shard(model, mp_policy=mp, reshard_after_forward=fsdp_config.reshard_after_forward, offload_policy=offload)
    return compute


def full_state_items(model: nn.Module, strip_prefix: str = "", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) one parameter at a time, so at most one unsharded tensor exists at once.
    Every rank must iterate it to the end: each step is a collective."""
    for name, tensor in model.state_dict().items():
        whole = full_tensor(tensor.detach())
        if dtype is not None:
            whole = whole.to(dtype)
        yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, whole
