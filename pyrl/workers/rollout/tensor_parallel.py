"""Rollout tensor parallelism (actor_rollout_ref.rollout.tensor_model_parallel_size = TP > 1).

Ranks [g*TP, (g+1)*TP) share one vLLM engine (vLLM's ``external_launcher`` executor over the workers' own
torch.distributed world: each rank holds 1/TP of every layer, and the TP ranks run every engine step together,
so they must make the same engine calls in the same order). The driver still deals prompts to every rank
(DP_COMPUTE_PROTO); inside a group:

1. the group's first rank, the leader, gathers the group's prompts;
2. it generates for all of them (one turn, or the agent loop's many), and broadcasts each engine call to the
   other ranks, the followers, before making it: each follower makes the same call on its shard;
3. it broadcasts "done" and scatters each rank its own rows (or broadcasts its error, which every follower raises
   naming the leader's rank, so no rank waits on a call that will never come). A follower whose own engine call
   fails (vLLM refuses the same input on every rank) keeps following until the leader's word, then raises.

vLLM never exchanges sampled tokens between the TP ranks: each samples from the same logits, so each must draw the
same random numbers. A call without a seed gets one drawn by the leader, which the followers receive with the call.
The objects travel over a gloo group of the TP ranks (CPU objects, whatever the training backend).
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec

GENERATE, DONE, FAILED = "generate", "done", "failed"


class TensorParallelGroup:
    """This rank's TP group. Every rank of the world must construct it together (new_group is collective)."""

    def __init__(self, rank: int, world_size: int, size: int, timeout_s: float):
        if size < 1 or world_size % size:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the "
                             f"{world_size} rollout worker processes")
        self.size, self.leader = size, rank - rank % size
        self.is_leader = rank == self.leader
        timeout = datetime.timedelta(seconds=timeout_s)
        groups = [dist.new_group(list(range(first, first + size)), backend="gloo", timeout=timeout)
                  for first in range(0, world_size, size)]
        self.group = groups[rank // size]
        self.name = self.broadcast(f"pyrl-tp-{uuid.uuid4().hex[:12]}")  # this group's, in this run

    def gather(self, obj) -> list | None:
        """Every rank's obj, in rank order, on the leader (None elsewhere)."""
        out = [None] * self.size if self.is_leader else None
        dist.gather_object(obj, out, dst=self.leader, group=self.group)
        return out

    def scatter(self, objs: list | None):
        """objs[i] (given on the leader) to the group's i-th rank."""
        box = [None]
        dist.scatter_object_list(box, objs, src=self.leader, group=self.group)
        return box[0]

    def broadcast(self, obj=None):
        """The leader's obj on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def lead(self, work: Callable[[], list]) -> object:
        """Leader: run work() (whose engine calls reach the followers through LeaderEngine), which returns one
        result per rank of the group; hand them out and return the leader's own."""
        try:
            pieces = work()
            if len(pieces) != self.size:
                raise RuntimeError(f"rollout tensor-parallel group: {len(pieces)} results for {self.size} ranks")
        except BaseException as error:
            self.broadcast((FAILED, f"{type(error).__name__}: {error}"))
            raise
        self.broadcast((DONE,))
        return self.scatter(pieces)

    def follow(self, engine: RolloutEngine) -> object:
        """Follower: make each engine call the leader broadcasts until it is done; return this rank's result."""
        own_error = None
        while True:
            call = self.broadcast()
            if call[0] == GENERATE:
                try:
                    engine.generate(*call[1:])
                except Exception as error:  # the leader's call fails too: its word comes next
                    own_error = own_error or error
            elif call[0] == FAILED:
                raise RuntimeError(f"rollout tensor-parallel group: its leader, rank {self.leader}, failed: {call[1]}")
            else:
                result = self.scatter(None)
                if own_error is not None:
                    raise own_error
                return result


class LeaderEngine(RolloutEngine):
    """The leader's engine: each generate call is broadcast to the followers before it runs, so that the TP ranks
    run it together; the rest goes to the engine as it is (every rank makes those calls itself)."""

    def __init__(self, engine: RolloutEngine, group: TensorParallelGroup):
        self.engine, self.group, self.dtype = engine, group, engine.dtype

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, max_tokens: list[int] | None = None,
                 seeds: list[int] | None = None):
        if spec.seed is None and seeds is None and not spec.greedy:  # the ranks must sample alike (module's note)
            spec = dataclasses.replace(spec, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
        self.group.broadcast((GENERATE, prompt_ids, spec, max_tokens, seeds))
        return self.engine.generate(prompt_ids, spec, max_tokens, seeds)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.engine.load_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()
