"""One-step-off-policy rollout (verl 0.9.1's experimental one_step_off_policy): with
actor_rollout_ref.hybrid_engine=false the rollout runs in its own workers (the top-level `rollout` section:
rollout.nnodes x rollout.n_gpus_per_node, or rollout.n_cpu_workers_per_node on CPU) and generates the next batch
while the actor trains on the current one.

Step k (as verl's OneStepOffRayTrainer):
  1. take batch k: collected in the background during step k-1 (the trainer's wait for it is timing_s/gen);
     step 1, and a resumed step whose checkpoint held no batch, collect it now;
  2. push the actor's weights to the rollout workers if the actor has updated since the last push (the weights
     after update k-1; timing_s/update_weights);
  3. start collecting batch k+1 in the background with those weights (generation, reward and dynamic sampling:
     PPOTrainer.collect_batch, in a driver thread; its generation time is timing_s/generate_async);
  4. train on batch k (old log-probs, reference, values, advantages, updates, as in the hybrid loop).
So batch k+1 is generated with the weights of step k-1 while the actor trains on batch k: each batch is one
update older than the policy that trains on it (batches 1 and 2 both come from the initial weights). The rollout's
log-probs (rollout.calculate_log_probs, on in verl's one_step_off_ppo_trainer) let algorithm.rollout_correction
weight the stale samples, and training/rollout_probs_diff_* (without bypass_mode) shows the staleness; without them
the old log-probs are the trainer's, as in verl.

Validation first waits for the batch in flight and pushes the current weights: it scores the current policy.
A checkpoint waits for the batch in flight and stores it (with its metrics) in data.pt, and the data sampler as
that batch's collection left it (dynamic sampling draws more prompts while it runs), so a resumed run trains on
exactly the batch the uninterrupted run did, generated with the weights it was (every generate call is seeded by
its step, so no rollout RNG state is needed), and draws the next batch's prompts where it would have.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from pyrl.config import RolloutPoolConfig
from pyrl.trainer import metrics as M

log = logging.getLogger("pyrl")


def check_one_step_off(config) -> None:
    """What actor_rollout_ref.hybrid_engine and the rollout section ask for, checked before any worker starts:
    the rollout section only means something without the hybrid engine, and one-step-off needs a rollout that keeps
    its cache (verl's one_step_off_ppo_trainer sets it)."""
    arr = config.actor_rollout_ref
    if arr.hybrid_engine:
        default = RolloutPoolConfig()
        for f in dataclasses.fields(RolloutPoolConfig):
            if getattr(config.rollout, f.name) != getattr(default, f.name):
                raise ValueError(f"rollout.{f.name}={getattr(config.rollout, f.name)!r}: the rollout has workers of "
                                 f"its own only with actor_rollout_ref.hybrid_engine=false (one-step-off-policy "
                                 f"rollout); the hybrid engine generates in the actor's workers")
        return
    if arr.rollout.free_cache_engine:
        raise ValueError("actor_rollout_ref.rollout.free_cache_engine=true: with actor_rollout_ref.hybrid_engine=false "
                         "the rollout workers only generate and never free their cache for training; set it to false "
                         "(verl's one_step_off_ppo_trainer does)")
    if not arr.rollout.calculate_log_probs:  # as verl 0.9.1's trainer then: recomputed, nothing corrected
        log.info("actor_rollout_ref.rollout.calculate_log_probs=false with actor_rollout_ref.hybrid_engine=false: the "
                 "samples are one update older than the policy and their log-probs are not kept, so the old "
                 "log-probs are the trainer's (the current policy's) and nothing weighs the staleness; set it true "
                 "for algorithm.rollout_correction (verl's one_step_off_ppo_trainer does)")


class WeightPush:
    """The actor group's weights into the separate rollout group: every actor rank takes part in the gather, rank 0
    puts them in Ray's object store once, and every rollout worker loads them from there (never through the
    driver), in the engine's dtype."""

    def __init__(self, actor, rollout):
        self.actor, self.rollout = actor, rollout
        self.dtype = rollout.engine_dtype()[0]

    def __call__(self) -> int:
        """Pushes; returns the bytes each rollout worker loaded."""
        reference = self.actor.publish_weights(self.dtype)[0]
        return self.rollout.load_weights(reference)[0]["perf/update_weights_bytes"]


class OneStepOff:
    """The schedule above. collect(step) -> (batch, timing, metrics) collects one step's batch; push() pushes the
    actor's weights to the rollout workers and returns the step metrics it reports."""

    def __init__(self, collect: Callable, push: Callable[[], dict], total_steps: int):
        self.collect, self.push, self.total_steps = collect, push, total_steps
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pyrl-next-batch")
        self.next: tuple[int, Future] | None = None  # (the step it is for, its collection)
        self.weights_behind = False  # the actor updated since the last push

    def batch(self, step: int, timing: dict, metrics: dict):
        """Step `step`'s batch (collected now when none was collected for it); then the push and the next step's
        collection in the background."""
        if self.next is not None and self.next[0] == step:
            with M.timer("gen", timing):  # the part of the generation the training did not hide
                batch, collect_timing, collect_metrics = self.next[1].result()
            timing["generate_async"] = collect_timing.pop("gen")
            timing.update(collect_timing)
            metrics.update(collect_metrics)
        else:
            if self.next is not None:
                raise RuntimeError(f"one-step-off rollout: step {step} found the batch of step {self.next[0]} in "
                                   "flight")
            batch, collect_timing, collect_metrics = self.collect(step)
            timing.update(collect_timing)
            metrics.update(collect_metrics)
        self.next = None
        self.sync(timing, metrics)
        if step < self.total_steps:
            self.next = (step + 1, self.pool.submit(self.collect, step + 1))
        return batch

    def actor_updated(self) -> None:
        """The actor's weights changed: push them before anything generates for the current policy."""
        self.weights_behind = True

    def sync(self, timing: dict, metrics: dict) -> None:
        """Wait for the batch in flight (generated with the weights it started with), then push the actor's weights
        if they changed since the last push: what generates next sees the current policy."""
        if self.next is not None:
            self.next[1].result()
        if self.weights_behind:
            with M.timer("update_weights", timing):
                metrics.update(self.push())
            self.weights_behind = False

    def state_dict(self) -> dict:
        """The next step's batch, waited for: a checkpoint holds it (its step, the batch, the collection's
        metrics), or None when nothing is in flight."""
        if self.next is None:
            return {"next_batch": None}
        step, future = self.next
        batch, timing, metrics = future.result()
        return {"next_batch": {"step": step, "batch": batch, "timing": timing, "metrics": metrics}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("next_batch")
        if saved is None:
            return
        future: Future = Future()
        future.set_result((saved["batch"], dict(saved["timing"]), dict(saved["metrics"])))
        self.next = (saved["step"], future)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
