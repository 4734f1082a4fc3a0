"""FSDP2 sharding of the workers' models, and their whole weights gathered tensor by tensor (for the
rollout engine and exports)."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.utils import _apply_to_tensors  # FSDP2's own walk of the forward inputs

from pyrl.config import torch_dtype
from pyrl.workers.distributed import full_tensor, is_distributed, local_tensor
from pyrl.workers.precision import runnable_dtype


def compute_dtype(fsdp_config, device: torch.device) -> torch.dtype:
    """The dtype the forward and backward run in: fsdp_config.dtype (mixed precision over model_dtype master
    weights) where the device runs it natively (precision.runnable_dtype), else the master dtype."""
    master = torch_dtype(fsdp_config.model_dtype, "fsdp_config.model_dtype")
    return runnable_dtype(fsdp_config.dtype, "fsdp_config.dtype", device, fallback=master)


def shard_group_size(fsdp_size: int, world: int) -> int:
    """How many ranks one copy of a model's shards spreads over. fsdp_size -1 (or any size of at least the world,
    as verl reads it): all of them. A divisor k of the world: verl's hybrid sharding, groups of k consecutive ranks
    each hold a whole sharded copy and the world / k groups replicate it, their gradients averaged."""
    if fsdp_size < 0 or fsdp_size >= world:
        return world
    if fsdp_size == 0 or world % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size}: expected -1 (shard over all {world} ranks) or a divisor of {world}")
    return fsdp_size


_MESHES: dict = {}  # (device type, shard group size) -> the 2-D mesh, one per process: its groups are made once


def fsdp_mesh(fsdp_config, device: torch.device):
    """None (fully_shard's default: shard over the whole world), or the ("replicate", "shard") mesh of hybrid
    sharding (shard_group_size)."""
    world = dist.get_world_size()
    shards = shard_group_size(fsdp_config.fsdp_size, world)
    if shards == world:
        return None
    if (device.type, shards) not in _MESHES:
        _MESHES[device.type, shards] = init_device_mesh(device.type, (world // shards, shards),
                                                        mesh_dim_names=("replicate", "shard"))
    return _MESHES[device.type, shards]


def wraps_with_fsdp2(world: int, mixed_precision: bool, offloads: bool, device: torch.device) -> bool:
    """Whether fsdp_wrap hands a model to FSDP2: over more than one rank, and on one rank only for what a plain
    module does not do: param_offload on CUDA, and mixed precision (compute dtype != master dtype) on CUDA. On one
    rank FSDP2 computes the same numbers as the plain module with copies it does not need: every pass all-gathers
    each weight into an unsharded copy, and each reduction copies every gradient into the sharded one (on
    bench_memory's float32 GRPO step, ~0.3 GiB of the worker's peak; on a CPU's bf16 update ~0.6 s of 3.3:
    benchmarks/RESULTS.md). A CPU rank with mixed precision casts its weights per forward instead
    (cast_per_forward: the same numbers bit for bit). A CUDA rank keeps FSDP2, whose resharding after each
    layer's forward frees that layer's bf16 copy (a plain module's autograd keeps every copy until the backward)
    and whose gathers cost little at device bandwidth."""
    return world > 1 or offloads or (mixed_precision and torch.device(device).type == "cuda")


def offloads_params(fsdp_config, device: str | torch.device) -> bool:
    """Whether fsdp_config.param_offload takes effect: on CUDA only (FSDP2's CPUOffloadPolicy); on CPU the weights
    are in host memory already."""
    return bool(fsdp_config.param_offload) and torch.device(device).type == "cuda"


def fsdp_wrap(model: nn.Module, layers, fsdp_config, device: torch.device) -> torch.dtype:
    """fully_shard each decoder layer, then the root (embedding, final norm, head), in place, the forward in
    compute_dtype() with master weights, gradient reduction and the optimizer in fsdp_config.model_dtype;
    over every rank, or with fsdp_config.fsdp_size hybrid-sharded (fsdp_mesh). Returns the compute dtype. A
    single process without a process group is a plain module computing in the master dtype; so is one rank that
    needs nothing of FSDP2 (wraps_with_fsdp2), which with mixed precision casts its weights for each forward
    (cast_per_forward)."""
    # lazy: torch.distributed.fsdp loads only to wrap a model (pyrl.trainer.memory_plan imports this module)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    master = torch_dtype(fsdp_config.model_dtype, "fsdp_config.model_dtype")
    model.to(device=device, dtype=master)
    if not is_distributed():
        return master  # a plain single-process module: nothing to shard
    compute = compute_dtype(fsdp_config, device)
    offloads = offloads_params(fsdp_config, device)
    if not wraps_with_fsdp2(dist.get_world_size(), compute != master, offloads, device):
        if compute != master:
            cast_per_forward(model, layers, compute)
        return compute
    mp = MixedPrecisionPolicy()
    if compute != master:
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if offloads else OffloadPolicy()
    options = dict(mesh=fsdp_mesh(fsdp_config, device), mp_policy=mp,
                   reshard_after_forward=fsdp_config.reshard_after_forward, offload_policy=offload)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return compute


class _CastForCompute(torch.autograd.Function):
    """master.to(dtype), whose gradient the backward adds into a float32 master's .grad in place, as the fused
    log-prob head does (float32_grad_to_add_into): no float32 copy of it first, and the micro-batches' gradients
    accumulate in float32, as FSDP2's reduce_dtype float32 does. For losses reduced with .backward(), as the
    workers' updates: torch.autograd.grad(..., master) would find its result in master.grad instead."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.master = master
        return master.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from pyrl.ops.fused_linear_logprobs import float32_grad_to_add_into  # lazy: the memory plan imports this

        into = float32_grad_to_add_into(ctx.master)  # contiguous, as fused AdamW reads it
        if into is None:  # not a float32 leaf's plain .grad: autograd accumulates it
            return grad.to(ctx.master.dtype), None
        into.add_(grad)
        return None, None


def cast_per_forward(model: nn.Module, layers, dtype: torch.dtype) -> None:
    """FSDP2's mixed precision without FSDP2, for one rank: each decoder layer, and the root (the rest: embedding,
    final norm, head), swaps its parameters for copies in `dtype` for the length of its own forward (its floating
    inputs cast too), and puts the float32 masters back after it, even if it raises. The masters stay the module's
    parameters everywhere else: the optimizer, gradient clipping, checkpoints, exports and the rollout engine read
    them as they read a float32 one-rank module. A weight used twice (a tied embedding and head) is cast once per
    forward, its two gradients summed in `dtype`, as FSDP2's one unsharded copy. With gradient checkpointing the
    recomputed layer casts again, as FSDP2 gathers again. Not for a unit whose forward calls itself (its inner call
    would put the masters back early), nor for parameters replaced after wrapping (their hooks hold the originals).
    """
    def cast_floats(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() else x

    inner = {id(m) for layer in layers for m in layer.modules()}
    units = [(layer, list(layer.modules())) for layer in layers]
    units.append((model, [m for m in model.modules() if id(m) not in inner]))
    for unit, owners in units:
        slots = [(owner, name, p) for owner in owners for name, p in owner._parameters.items()
                 if p is not None and p.is_floating_point()]

        def swap_in(module, args, kwargs, slots=slots):
            casts = {}
            for owner, name, master in slots:
                if id(master) not in casts:
                    casts[id(master)] = _CastForCompute.apply(master, dtype)
                owner._parameters[name] = casts[id(master)]  # not setattr: a cast is no nn.Parameter
            return _apply_to_tensors(cast_floats, args), _apply_to_tensors(cast_floats, kwargs)

        def swap_out(module, args, output, slots=slots):
            for owner, name, master in slots:
                owner._parameters[name] = master

        unit.register_forward_pre_hook(swap_in, with_kwargs=True)
        unit.register_forward_hook(swap_out, always_call=True)


def local_state_items(model: nn.Module, strip_prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor): the parameter's storage itself, no copy (whole only where nothing is sharded:
    see holds_whole_weights)."""
    for name, tensor in model.state_dict().items():
        yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, local_tensor(tensor).detach()


def holds_whole_weights(model: nn.Module) -> bool:
    """Whether this rank's tensors of `model` are its whole weights (one rank, or not distributed)."""
    return all(local_tensor(t).shape == t.shape for t in model.state_dict().values())


def full_state_items(model: nn.Module, strip_prefix: str = "", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) one parameter at a time, so at most one unsharded tensor exists at once.
    Every rank must iterate it to the end: each step is a collective."""
    for name, tensor in model.state_dict().items():
        whole = full_tensor(tensor.detach())
        if dtype is not None:
            whole = whole.to(dtype)
        yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, whole
