"""The update loop the actor and the critic share: PPO epochs over mini-batches, each accumulated over
micro-batches, then clip and step; metrics by name, reduced over micro-batches and ranks, averaged over
mini-batches; the LR schedule steps once per update; MFU of the whole update."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from pyrl.protocol import DataProto
from pyrl.workers import batching, fsdp, perf
from pyrl.workers.distributed import all_reduce
from pyrl.workers.optim import optimizer_state_on, optimizer_step


@dataclass
class UpdatePlan:
    """How one update walks the data (the actor's or the critic's keys)."""

    prefix: str  # "actor" / "critic": the metrics' namespace
    mini_batch_size: int  # rows per rank
    epochs: int
    shuffle: bool
    seed: int
    micro_batch_size: int | None
    use_dynamic_bsz: bool
    max_token_len: int
    grad_clip: float
    # seq-mean-token-sum-norm's divisor: the config's loss_scale_factor, else the full response width (a constant
    # through training, Dr.GRPO's; verl 0.9.1 takes each micro-batch's padded width, which varies with batching)
    loss_scale_factor: float
    hint: str = ""  # names the keys behind mini_batch_size in errors
    share_prompts: bool = False  # micro-batches keep the samples of a prompt together (actor.use_prefix_grouper)
    recut: bool = True  # batching.micro_batching may cut an unset pass by tokens (not a loss of micro-batch statistics)


REDUCE = {"sum": (lambda a, b: a + b, dist.ReduceOp.SUM), "min": (min, dist.ReduceOp.MIN),
          "max": (max, dist.ReduceOp.MAX)}


def _reduction(name: str) -> str:
    return "min" if name.endswith("_min") else "max" if name.endswith("_max") else "sum"


def _reduced_over_ranks(shares: dict, device) -> dict:
    """The micro-batches' shares of every rank, reduced by name: sums, minima, maxima. A minimum or maximum over no
    token (+inf / -inf, the neutral values) is left out."""
    out = {}
    for how, (_, op) in REDUCE.items():
        names = sorted(n for n in shares if _reduction(n) == how)
        if names:
            values = torch.tensor([shares[n] for n in names], dtype=torch.float64, device=device)
            out.update((name, value) for name, value in zip(names, all_reduce(values, op).tolist())
                       if abs(value) != float("inf"))
    return out


def gradient_sync_can_wait(model: nn.Module, fsdp_config, device: torch.device) -> bool:
    """Whether FSDP2 may leave the gradients unreduced until a mini-batch's last micro-batch: where each rank holds
    the weights whole (one rank, or fsdp_size=1), its unreduced gradients are no larger than its reduced ones, so
    waiting costs no memory, and it saves a reduction (on one rank, a copy of every gradient; replicated, an
    all-reduce) per micro-batch. Not with param_offload on CUDA (FSDP2 moves gradients to the CPU only once
    reduced, so unreduced ones would wait on the device), nor on sharded ranks, which reduce after every backward
    as verl does, because their unreduced gradients would be whole. The micro-batches' gradients accumulate in the
    reduce dtype (float32 with bf16 compute) either way (FSDP2 keeps an unsharded float32 accumulator): on one rank
    the same sum bit for bit; replicated, the mean of the ranks' sums instead of the sum of their means, equal to
    rounding."""
    return (isinstance(model, FSDPModule) and not fsdp.offloads_params(fsdp_config, device)
            and fsdp.holds_whole_weights(model))


@contextlib.contextmanager
def gradient_sync_deferrable(model: nn.Module, fsdp_config, device: torch.device):
    """Yields whether the update may defer the gradient sync (gradient_sync_can_wait); sync is back on after it,
    however it ends."""
    deferred = gradient_sync_can_wait(model, fsdp_config, device)
    try:
        yield deferred
    finally:
        if deferred:
            model.set_requires_gradient_sync(True)


def run_update(model: nn.Module, optimizer, lr_scheduler, data: DataProto, plan: UpdatePlan, fsdp_config,
               device: torch.device, world_size: int, hf_config, compute_dtype: torch.dtype,
               micro_step: Callable[[DataProto, list, dict], dict]) -> dict:
    """micro_step(mini_batch, row indices, global_batch_info) runs one micro-batch's forward and backward and
    returns {metric name: this micro-batch's share}, shares that sum over the micro-batches of every rank to
    the mini-batch's value (the same names on every rank and every micro-batch, an empty one included); a name
    ending in _min or _max is the micro-batch's own minimum or maximum instead (+inf / -inf over no token),
    reduced by min or max."""
    history: dict[str, list] = {}
    seqlens, tokens = [], 0  # the rows' lengths; the tokens run (fewer when prompts are shared)
    start = time.perf_counter()
    model.train()
    with optimizer_state_on(optimizer, device, fsdp_config), \
            gradient_sync_deferrable(model, fsdp_config, device) as defer_sync:
        for mini in batching.mini_batches(data, plan.mini_batch_size, plan.epochs, plan.shuffle, plan.seed,
                                          f"update_{plan.prefix}", plan.hint):
            info = batching.global_batch_info(mini.batch["response_mask"], device, world_size,
                                              mini.batch["loss_mask"] if "loss_mask" in mini.batch else None)
            info["loss_scale_factor"] = plan.loss_scale_factor
            lengths = batching.row_lengths(mini)
            seqlens += lengths.tolist()
            shares: dict[str, float] = {}
            optimizer.zero_grad(set_to_none=True)
            groups = batching.prompt_groups(mini) if plan.share_prompts else None
            tokens += sum(groups[1]) if groups else int(lengths.sum())
            micro_batches = batching.micro_batch_indices(lengths, plan.micro_batch_size, plan.use_dynamic_bsz,
                                                         plan.max_token_len, device, groups, plan.recut)
            for k, idx in enumerate(micro_batches):
                if defer_sync:  # reduce once, after the mini-batch's last backward
                    model.set_requires_gradient_sync(k == len(micro_batches) - 1)
                for name, value in micro_step(mini, idx, info).items():
                    shares[name] = REDUCE[_reduction(name)][0](shares[name], value) if name in shares else value
            grad_norm = optimizer_step(model, optimizer, plan.grad_clip)
            for name, value in _reduced_over_ranks(shares, device).items():
                history.setdefault(f"{plan.prefix}/{name}", []).append(value)
            history.setdefault(f"{plan.prefix}/grad_norm", []).append(grad_norm)
        # stepped: the gradients (a float32 copy of every trained weight) would otherwise be held through the
        # generation and log-prob passes until the next update's first zero_grad
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    history[f"{plan.prefix}/lr"] = [lr_scheduler.get_last_lr()[0]]
    lr_scheduler.step()
    metrics = {name: float(np.mean(values)) for name, values in history.items()}
    metrics[f"perf/mfu/{plan.prefix}"] = perf.mfu(hf_config, seqlens, elapsed, device, compute_dtype,
                                                  lm_head=plan.prefix != "critic", tokens=tokens)
    return metrics
