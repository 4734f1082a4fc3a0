"""What the FSDP2 workers (actor/ref, critic, reward model) share: sharding, the optimizer and its
schedule, micro-batching under a token budget, full weights for the rollout engine and atomic
torch.distributed.checkpoint save/load."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pyrl.config import torch_dtype
from pyrl.protocol import DataProto, balanced_partitions, token_budget_micro_batches


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


def fsdp_wrap(model: nn.Module, layers, fsdp_config, device: torch.device) -> nn.Module:
    """fully_shard each decoder layer, then the root (embedding, final norm, head). On CUDA the forward
    runs in fsdp_config.dtype with float32 gradient reduction; CPU runs in the master dtype."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model.to(device=device, dtype=torch_dtype(fsdp_config.model_dtype, "fsdp_config.model_dtype"))
    if not is_distributed():
        return model  # a plain single-process module: nothing to shard
    mp = MixedPrecisionPolicy()
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch_dtype(fsdp_config.dtype, "fsdp_config.dtype"), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if fsdp_config.param_offload and device.type == "cuda" else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=fsdp_config.reshard_after_forward, offload_policy=offload)
    fully_shard(model, mp_policy=mp, reshard_after_forward=fsdp_config.reshard_after_forward, offload_policy=offload)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered whole on every rank (a collective); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_items(model: nn.Module, strip_prefix: str = "", dtype=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) one parameter at a time, so at most one unsharded tensor exists at once.
    Every rank must iterate it to the end: each step is a collective."""
    for name, tensor in model.state_dict().items():
        whole = full_tensor(tensor.detach())
        if dtype is not None:
            whole = whole.to(dtype)
        yield name[len(strip_prefix):] if name.startswith(strip_prefix) else name, whole


def build_optimizer(params, optim_config) -> torch.optim.Optimizer:
    if optim_config.optimizer.lower() != "adamw":
        raise ValueError(f"optim.optimizer: only AdamW is supported, got {optim_config.optimizer!r}")
    return torch.optim.AdamW(params, lr=optim_config.lr, betas=tuple(optim_config.betas),
                             weight_decay=optim_config.weight_decay)


def build_lr_scheduler(optimizer, optim_config) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over lr_warmup_steps (or lr_warmup_steps_ratio x total_training_steps), then constant,
    or cosine down to min_lr_ratio over the remaining steps (verl's schedules)."""
    total = optim_config.total_training_steps
    warmup = optim_config.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim_config.lr_warmup_steps_ratio * max(total, 0))
    kind = optim_config.lr_scheduler_type
    if kind not in ("constant", "cosine"):
        raise ValueError(f"optim.lr_scheduler_type: expected 'constant' or 'cosine', got {kind!r}")
    if kind == "cosine" and total <= 0:
        raise ValueError("optim.lr_scheduler_type=cosine needs optim.total_training_steps > 0")
    min_ratio, cycles = optim_config.min_lr_ratio, optim_config.num_cycles

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * max(0.0, 0.5 * (1 + math.cos(math.pi * cycles * 2.0 * progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """The global gradient norm (over every rank's shards), gradients scaled to max_norm when above it."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    return float(full_tensor(norm))


def micro_batch_indices(seqlens: torch.Tensor, micro_batch_size: int | None, use_dynamic_bsz: bool,
                        max_token_len: int, device: torch.device) -> list[list[int]]:
    """Row indices of each micro-batch. Fixed size, or (dynamic) the fewest token-balanced micro-batches
    under max_token_len tokens each. FSDP ranks must run the same number of forwards (every forward
    is a collective), so the count is the maximum over ranks and shorter lists are rebalanced to it."""
    rows = int(seqlens.numel())
    if not use_dynamic_bsz:
        size = micro_batch_size or rows
        return [list(range(s, min(s + size, rows))) for s in range(0, rows, size)] or [[]]
    batches = token_budget_micro_batches(seqlens.tolist(), int(max_token_len), balanced=True)
    count = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    count = int(all_reduce(count, dist.ReduceOp.MAX).item())
    if count > len(batches):
        batches = [sorted(b) for b in balanced_partitions(seqlens.tolist(), min(count, rows), equal_size=False)]
        batches.sort(key=lambda b: b[0])
        batches += [[] for _ in range(count - len(batches))]
    return batches


def mini_batches(data: DataProto, size: int, epochs: int, shuffle: bool, seed: int, method: str, hint: str = ""):
    """The PPO mini-batches of this rank's rows: `epochs` passes, each in order or reshuffled (seeded), in
    pieces of `size` rows (at most all of them), which must divide the rows."""
    size = min(len(data), max(1, size))
    if len(data) % size:
        raise ValueError(f"{method}: {len(data)} rows per rank is not a multiple of the mini-batch of {size}{hint}")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator) if shuffle else torch.arange(len(data))
        for start in range(0, len(data), size):
            yield data.select_idxs(order[start:start + size])


def global_batch_info(response_mask: torch.Tensor, device: torch.device, dp_size: int) -> dict:
    """agg_loss's global_batch_info for a mini-batch: valid tokens and non-empty sequences over all ranks."""
    counts = all_reduce(torch.tensor([float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())],
                                     dtype=torch.float64, device=device))
    return {"batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item(), "dp_size": dp_size}


@contextlib.contextmanager
def optimizer_state_on(optimizer, device: torch.device, fsdp_config):
    """fsdp_config.optimizer_offload: the optimizer's state (Adam's moments) waits on the CPU between
    updates and comes to the device only for them (verl's load/offload_fsdp_optimizer). With param_offload
    FSDP2 keeps the state on the CPU already; on CPU workers there is nothing to move."""
    if not fsdp_config.optimizer_offload or fsdp_config.param_offload or device.type == "cpu":
        yield
        return
    _move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        _move_optimizer_state(optimizer, torch.device("cpu"))


def _move_optimizer_state(optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # Adam keeps its step count on the CPU
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_step(model: nn.Module, optimizer, grad_clip: float) -> float:
    """Clip, then step; a step whose gradient norm is not finite is skipped (as verl). Returns the norm."""
    grad_norm = clip_grad_norm(model, grad_clip)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def memory_metrics(device: torch.device) -> dict:
    """verl's perf/ memory metrics of an update: peak CUDA memory of this process (GPU only) and the
    machine's used RAM."""
    import psutil

    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def response_forward(data: DataProto, micro_batches, forward) -> tuple:
    """Run forward(tensors, kept_response_length) -> tuple of [b, kept] tensors on each micro-batch (trimmed
    of all-padding columns) and return the outputs as [B, R] CPU tensors in row order. An empty micro-batch
    (a rank with fewer rows than another's micro-batch count) still runs one row for FSDP's collectives."""
    response_length = data.batch["responses"].shape[-1]
    pieces, order = [], []
    for idx in micro_batches:
        tensors, kept = trimmed(data.select_idxs(idx or [0]), response_length)
        outputs = forward(tensors, kept)
        if idx:
            pieces.append([pad_response(out, response_length).cpu() for out in outputs])
            order.extend(idx)
    inverse = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
    return tuple(torch.cat(column)[inverse] for column in zip(*pieces))


def trimmed(data: DataProto, response_length: int) -> tuple[dict, int]:
    """A micro-batch's tensors with the columns that are padding in every row cut off (prompt columns on
    the left, response columns on the right); returns (tensors, kept response length >= 1)."""
    mask = data.batch["attention_mask"]
    prompt_width = mask.shape[1] - response_length
    prompt_pad = int((mask[:, :prompt_width].cumsum(-1) == 0).sum(-1).min().item()) if prompt_width else 0
    prompt_pad = min(prompt_pad, prompt_width - 1)
    kept_response = max(1, int(mask[:, prompt_width:].sum(-1).max().item()))
    end = prompt_width + kept_response
    out = {}
    for key, value in data.batch.items():
        if value.dim() == 2 and value.shape[1] == mask.shape[1]:
            out[key] = value[:, prompt_pad:end]
        elif value.dim() == 2 and value.shape[1] == response_length:
            out[key] = value[:, :kept_response]
        else:
            out[key] = value
    return out, kept_response


def pad_response(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """[b, r] -> [b, response_length], zeros on the right."""
    return torch.nn.functional.pad(values, (0, response_length - values.shape[1]))


# ---- checkpoints ----

def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def save_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int, extra: dict | None = None) -> None:
    """Sharded model + optimizer state through torch.distributed.checkpoint, and each rank's LR schedule,
    RNG states and `extra` beside it, written into PATH.tmp and renamed to PATH when every rank is done:
    a checkpoint directory is complete or absent."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.save(state, checkpoint_id=tmp)
    extra = {**(extra or {}), "lr_scheduler": lr_scheduler.state_dict(), "rng": rng_state()}
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer, lr_scheduler, rank: int) -> dict:
    """Restore what save_checkpoint wrote (any world size for the model and optimizer), the LR schedule and
    the RNG states; returns the rest of `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint {path!r}: not a directory written by save_checkpoint (no .metadata)")
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    extra_file = os.path.join(path, f"extra_rank{rank}.pt")
    extra = torch.load(extra_file, weights_only=False) if os.path.exists(extra_file) else {}
    if "lr_scheduler" in extra:
        lr_scheduler.load_state_dict(extra.pop("lr_scheduler"))
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return extra


def export_hf(path: str, hf_model: nn.Module, wrapped: nn.Module, strip_prefix: str, tokenizer, rank: int) -> None:
    """The whole model as a Hugging Face directory (save_pretrained) at PATH, via PATH.tmp + rename."""
    state = dict(full_state_items(wrapped, strip_prefix))
    if rank == 0:
        path = os.path.abspath(path)
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hf_model.save_pretrained(tmp, state_dict={k: v.cpu() for k, v in state.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    _barrier()


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
