"""The PPO loop, in the seeds' order: sample prompts -> generate -> reward -> old log-prob -> ref
log-prob -> values -> advantages -> update critic -> update actor -> push weights; validation and
checkpoints on their schedules. The driver holds the algorithm; workers hold the models."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import numpy as np
import torch

from pyrl import ops
from pyrl.algos import get_kl_controller
from pyrl.algos.advantage import ESTIMATORS
from pyrl.algos.registry import FIELD_SOURCES
from pyrl.algos.rollout_correction import apply_rollout_correction, rollout_probs_diff
from pyrl.controller import WorkerError
from pyrl.data import StatefulSampler
from pyrl.protocol import DataProto, balanced_partitions, response_lengths
from pyrl.seeding import derive_seed
from pyrl.trainer import checkpoints
from pyrl.trainer import metrics as M
from pyrl.trainer.generations import dump_generations, generation_records, pick_for_logging
from pyrl.trainer.one_step_off import OneStepOff, WeightPush
from pyrl.trainer.tracking import Tracking, truncate_metrics
from pyrl.workers.reward_server import ServedRewardModel
from pyrl.workers.rollout.agent_loop import AGENT_LOOP_COLUMNS
from pyrl.workers.teacher_server import score_batch

log = logging.getLogger("pyrl")


def compute_advantage(batch: DataProto, algorithm) -> dict:
    """advantages and returns [B, R] from the estimator algorithm.adv_estimator (an AlgorithmConfig), written into
    the batch, given what its registry entry declares it needs (pyrl.algos.registry.Needs); returns the metrics
    the entry reports (gdpo's gdpo/<key>/mean|std|max|min)."""
    estimator = algorithm.adv_estimator
    fn, needs = ESTIMATORS.get(estimator), ESTIMATORS.needs(estimator)
    kwargs = {"token_level_rewards": batch.batch["token_level_rewards"], "response_mask": batch.batch["response_mask"],
              "index": batch.non_tensor_batch["uid"], "gamma": algorithm.gamma, "lam": algorithm.lam,
              "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo, "config": algorithm}
    missing = [key for key in needs.tensors if key not in batch.batch]
    if missing:
        raise KeyError(f"algorithm.adv_estimator={estimator} needs {missing} in the batch, which has "
                       f"{sorted(batch.batch.keys())}; " + "; ".join(f"{key} comes from {FIELD_SOURCES[key]}"
                                                                      for key in missing if key in FIELD_SOURCES))
    kwargs.update({key: batch.batch[key] for key in needs.tensors})
    kwargs.update({key: batch.batch[key] for key in needs.optional_tensors if key in batch.batch})
    if needs.non_tensor_batch:
        kwargs["non_tensor_batch"] = batch.non_tensor_batch
    advantages, returns = fn(**kwargs)
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
    return needs.metrics(batch, algorithm) if needs.metrics else {}


def apply_kl_penalty(batch: DataProto, kl_ctrl, kl_penalty: str) -> dict:
    """token_level_rewards = token_level_scores - beta * kl(old, ref) on response tokens; updates beta."""
    mask = batch.batch["response_mask"].float()
    kl = ops.kl_penalty(batch.batch["old_log_probs"], batch.batch["ref_log_prob"], kl_penalty) * mask
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"] - kl_ctrl.value * kl
    # reduced in float64: k1 terms of both signs cancel in the sum, and float32 lost ~1e-5 of the mean there
    current_kl = (kl.double().sum(-1) / mask.double().sum(-1).clamp(min=1)).mean().item()
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_ctrl.value}
    kl_ctrl.update(current_kl, n_steps=len(batch))
    return metrics


def rollout_vs_trainer(batch: DataProto) -> dict:
    """verl's training/rollout_probs_diff_* metrics: the trainer's old log-probs (from the old-log-prob pass, or on
    policy from the update before its optimizer step) against the rollout engine's."""
    return rollout_probs_diff(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                              batch.batch["response_mask"])


def packed_tokens(batch: DataProto) -> DataProto:
    """The batch as it travels to the model workers: prompt + response tokens (input_ids, position_ids) packed,
    the attention mask turned into their layout, and without the left-padded `prompts` (a copy of input_ids'
    first columns that no worker reads); response-level [B, R] fields stay as they are (shared)."""
    out = batch.to_packed("attention_mask", keys=["input_ids", "position_ids"])
    out.batch.pop("prompts", None)
    return out


def balance_batch(batch: DataProto, world_size: int, by_group: bool = False) -> dict:
    """Reorder rows so each data-parallel rank gets the same count and near-equal token sums. by_group
    (actor.use_prefix_grouper, as verl): whole uid groups are balanced, each group's rows kept together, when the
    groups can give every rank the same rows; otherwise rows are balanced, and a group split over two ranks
    shares its prompt within each rank's part (the same numbers, a little less saved)."""
    lengths = batch.batch["attention_mask"].sum(-1)
    parts = None
    if by_group:
        groups: dict = {}
        for row, uid in enumerate(batch.non_tensor_batch["uid"]):
            groups.setdefault(uid, []).append(row)
        members = list(groups.values())
        if len(members) % world_size == 0:
            picked = balanced_partitions([int(lengths[rows].sum()) for rows in members], world_size, equal_size=True)
            parts = [[row for g in part for row in members[g]] for part in picked]
            if len({len(part) for part in parts}) > 1:  # groups of unequal sizes
                parts = None
    if parts is None:
        parts = balanced_partitions(lengths.tolist(), world_size, equal_size=True)
    batch.reorder(torch.as_tensor([i for part in parts for i in part]))
    sums = [int(lengths[part].sum()) for part in parts]
    return {"global_seqlen/min": min(sums), "global_seqlen/max": max(sums),
            "global_seqlen/minmax_diff": max(sums) - min(sums), "global_seqlen/mean": float(np.mean(sums))}


def filter_groups(batch: DataProto, metric: str) -> DataProto:
    """DAPO's dynamic sampling: drop the groups (same uid) of more than one sample where every sample scored the
    same `metric` (zero advantage under group baselines); a group of one is kept, as verl 0.9.1's replay buffer
    keeps it. `metric`: "reward" (verl 0.9.1's canonical one): the sequence's score; any other name: that field
    of what the reward function returned, or for "seq_reward" (the DAPO recipe's name, which verl 0.9.1 reads
    from the reward function only) the sequence's score where the function returned no such field."""
    if metric in batch.non_tensor_batch and metric != "reward":
        values = np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
    elif metric in ("reward", "seq_reward"):
        values = batch.batch["token_level_scores"].sum(-1).numpy()
    else:
        raise KeyError(f"algorithm.filter_groups.metric: {metric!r} is neither reward, seq_reward nor a field"
                       f" the reward function returned")
    uids = batch.non_tensor_batch["uid"]
    spread = {}
    for uid, value in zip(uids, values):
        lo, hi, count = spread.get(uid, (value, value, 0))
        spread[uid] = (min(lo, value), max(hi, value), count + 1)
    keep = [i for i, uid in enumerate(uids) if spread[uid][2] == 1 or spread[uid][1] > spread[uid][0]]
    return batch.select_idxs(keep)


class RunStopped(SystemExit):
    """The run stopped (a worker failed, Ctrl-C) with `line` to say so: pyrl.ppo.cli prints it last, after the
    workers and Ray are gone (their own late output would otherwise follow it)."""

    def __init__(self, code: int, line: str):
        super().__init__(code)
        self.line = line


def steps_within_epochs(trainer, per_epoch: int, batches: str) -> int:
    """The run's steps: trainer.total_training_steps, else trainer.total_epochs epochs of `per_epoch` steps (verl's
    count; `batches` says what an epoch is made of, for the message). verl 0.9.1 stops after total_epochs whatever
    total_training_steps says (short of its last step: without the last step's save and validation), so a count
    the epochs do not hold is refused, naming the epochs it needs."""
    in_epochs = per_epoch * trainer.total_epochs
    if trainer.total_training_steps is None:
        return in_epochs
    if trainer.total_training_steps > in_epochs:
        needed = -(-trainer.total_training_steps // max(per_epoch, 1))
        raise ValueError(f"trainer.total_training_steps={trainer.total_training_steps} is more than "
                         f"trainer.total_epochs={trainer.total_epochs} epochs of {per_epoch} steps ({batches}) hold: "
                         f"verl 0.9.1 would stop after {in_epochs} steps; set trainer.total_epochs={needed} or fewer "
                         f"steps")
    return trainer.total_training_steps


def training_steps(config, train_prompts: int) -> int:
    """The run's steps (steps_within_epochs): an epoch is the prompts' whole training batches, as verl 0.9.1's
    default trainer (trainer/ppo/v1) counts them, whatever dynamic sampling generates."""
    batch = config.data.train_batch_size
    return steps_within_epochs(config.trainer, train_prompts // batch,
                               f"{train_prompts} prompts, data.train_batch_size={batch}")


class PPOTrainer:
    def __init__(self, config, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn, workers, plan):
        """workers: pyrl.trainer.workers.Workers (the actor/rollout/ref group, or the actor/ref and the rollout groups,
        and optional critic / reward model); plan: the run's RunPlan (pyrl.trainer.run_plan), which says which of
        them run and which passes a step makes."""
        self.config, self.tokenizer, self.plan = config, tokenizer, plan
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.workers = workers
        algorithm = config.algorithm
        self.use_critic = plan.has("critic")
        # a fixed stand-in where KL is not in the reward (its keys are then read nowhere, as in verl 0.9.1)
        self.kl_ctrl = get_kl_controller(algorithm.kl_ctrl if algorithm.use_kl_in_reward
                                         else dataclasses.replace(algorithm.kl_ctrl, type="fixed"))
        self.run_dir = os.path.abspath(config.trainer.default_local_dir)
        self.global_steps = 0
        self.sampler = StatefulSampler(len(train_dataset), plan.prompts_per_step, config.data.shuffle,
                                       config.data.seed, key="data.gen_batch_size" if config.data.gen_batch_size
                                       else "data.train_batch_size")
        self.total_steps = training_steps(config, len(train_dataset))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.correction = algorithm.rollout_correction
        # without the hybrid engine: one-step-off-policy rollout in the rollout's own workers
        # (pyrl.trainer.one_step_off)
        self.weight_push = self.one_step_off = None
        if plan.rollout_pool is not None:
            self.weight_push = WeightPush(workers.actor, workers.rollout)
            self.one_step_off = OneStepOff(self.collect_step_batch,
                                           lambda: {"perf/update_weights_bytes": self.push_weights()},
                                           self.total_steps)
        # a served reward model (pyrl.workers.reward_server): its address and tokenizer go to the reward functions
        # (made last: nothing after it can fail and leave its router running)
        self.reward_server = None
        # colocated on GPUs, the rollout engine sleeps (its weights dropped) while the reward model is awake, and
        # the actor's weights are pushed again before the next generation (verl's sleep_replicas / update_weights)
        self.engine_yields_to_rm, self.engine_needs_push = False, False
        if plan.has("reward_model") and plan.role("reward_model").kind == "served":
            self.reward_server = ServedRewardModel(workers.reward_model, config, tokenizer)
            for fn in (reward_fn, val_reward_fn) if config.reward.custom_reward_function.path else ():
                fn.bind_reward_model(self.reward_server.router_address, self.reward_server.tokenizer)
            self.engine_yields_to_rm = plan.reward_model_pool is None and plan.trainer_pool.device == "cuda"

    # ---- batches ----
    def next_batch(self) -> DataProto:
        """The sampler's next prompts, each with a uid unique in the run (its epoch and place in the epoch's
        order), so prompts of several generation batches in one step (dynamic sampling) never share a group."""
        indices = self.sampler.next_batch()
        batch = self.train_dataset.batch(indices, self.pad_token_id)
        first = self.sampler.position - len(indices)
        batch.non_tensor_batch["uid"] = np.array([f"{self.sampler.epoch}-{first + i}" for i in range(len(indices))],
                                                 dtype=object)
        return batch

    def generate(self, batch: DataProto, refill: int = 0, metrics: dict | None = None, step: int | None = None,
                 **overrides) -> DataProto:
        """Rollouts with the configured sampling (`overrides` replace it). The seed depends on the step (`step`,
        else the current one) and on which generation batch of the step this is (`refill`: dynamic sampling's
        extra batches draw anew), never on what ran before, so a resumed run samples what the uninterrupted one
        did. The workers' metrics (perf/mfu/gen) go into `metrics` when given."""
        rollout = self.config.actor_rollout_ref.rollout
        meta = {"n": rollout.n, "temperature": rollout.temperature,
                "seed": derive_seed(self.plan.seed, "rollout", step=self.global_steps if step is None else step,
                                    refill=refill),
                # the agent loop renders appended messages as the dataset rendered the prompts
                "apply_chat_template_kwargs": dict(self.config.data.apply_chat_template_kwargs)}
        meta.update(overrides)
        batch.meta_info.update(meta)
        if self.engine_needs_push:  # the engine slept for the reward model (score) since the last push
            self.push_weights()
        out = self.workers.rollout.generate_sequences(batch)
        if metrics is not None:
            metrics.update(M.reduce_metrics(out.meta_info.get("metrics", {})))
        # later passes score with the sampling temperature; the rest (seed, n) would clash when batches concat
        out.meta_info = {"temperature": meta["temperature"]}
        return out

    # ---- the step ----
    def collect_batch(self, timing: dict, metrics: dict, step: int | None = None) -> DataProto:
        """Sample prompts, generate n responses each, score them; with dynamic sampling (DAPO) keep only groups
        whose rewards vary and generate more until the batch is full. `step`: the step the batch is for (else the
        current one; one-step-off rollout collects the next step's). The names of the per-sample fields the reward
        function returned go into meta_info["reward_extra_keys"] (the batch carries them into a checkpoint)."""
        cfg, algorithm = self.config, self.config.algorithm
        rollout = self.workers.rollout
        wanted = self.plan.rows_per_step
        batch, generated_batches, extra_keys = None, 0, set()
        while True:  # more than once only with dynamic sampling
            prompts = self.next_batch()
            with M.timer("gen", timing):
                gen = self.generate(prompts, refill=generated_batches, metrics=metrics, step=step)
            generated_batches += 1
            if algorithm.adv_estimator == "remax":
                with M.timer("gen_max", timing):
                    greedy = self.generate(prompts, n=1, do_sample=False, step=step)
                    baseline_scores, _, _ = self.score(greedy, self.reward_fn, metrics)
                    baselines = baseline_scores.sum(-1)
                gen.batch["reward_baselines"] = baselines.repeat_interleave(cfg.actor_rollout_ref.rollout.n)
            if not algorithm.filter_groups.enable:  # the step's last generation: the engine's memory goes to the
                rollout.sleep_rollout()  # reward model and the trainer (dynamic sampling sleeps it after the loop)
            with M.timer("reward", timing):
                scores, extra, reward_metrics = self.score(gen, self.reward_fn, metrics)
                gen.batch["token_level_scores"] = scores
                for key, values in extra.items():
                    gen.non_tensor_batch[key] = np.asarray(values, dtype=object)
                extra_keys.update(extra)
                for key, value in reward_metrics.items():
                    metrics[key] = metrics.get(key, 0) + value
            if not algorithm.filter_groups.enable:
                batch = gen
                break
            kept = filter_groups(gen, algorithm.filter_groups.metric)
            batch = kept if batch is None else DataProto.concat([batch, kept])
            limit = algorithm.filter_groups.max_num_gen_batches
            if len(batch) >= wanted:
                batch = batch.slice(0, wanted)
                break
            if 0 < limit <= generated_batches:
                raise RuntimeError(f"dynamic sampling: {generated_batches} generation batches gave {len(batch)} of "
                                   f"{wanted} samples from groups with varied rewards (algorithm.filter_groups."
                                   f"max_num_gen_batches={limit}); the task is too easy or too hard for the policy")
        rollout.sleep_rollout()  # (a no-op when asleep already)
        if self.reward_server is not None:
            metrics.update(self.reward_server.step_metrics())
        metrics["training/num_gen_batches"] = generated_batches
        metrics["training/epoch"] = self.sampler.epoch
        batch.meta_info["reward_extra_keys"] = sorted(extra_keys)
        return batch

    def score(self, gen: DataProto, reward_fn, metrics: dict | None = None) -> tuple[torch.Tensor, dict, dict]:
        """reward_fn's (token-level scores, extra info, metrics) for `gen`, after the reward model scored it (its
        rm_scores, which the reward function then returns; verl 0.9.1's rule). A served reward model is awake for
        the call only, and scores here only when no custom reward function does (a classifier's score); with one,
        that function is the score and asks the model itself. The server's request latencies go into `metrics`."""
        server = self.reward_server
        if server is None:
            if self.workers.reward_model is not None:
                gen.union(self.workers.reward_model.compute_rm_score(packed_tokens(gen)))
            return reward_fn(gen)
        if self.engine_yields_to_rm:
            self.workers.rollout.sleep_rollout()
            self.engine_needs_push = True
        server.wake_up()
        try:
            if not self.config.reward.custom_reward_function.path:
                gen.union(server.compute_rm_score(gen))
            out = reward_fn(gen)
        finally:
            server.sleep()
        server.collect_stats(keep=metrics is not None)  # validation's requests are not the step's
        failed = out[2].get("reward/scorer_errors", 0) + out[2].get("reward/scorer_timeouts", 0)
        if len(gen) and failed >= len(gen):  # verl fails the step when its reward model cannot be reached
            raise RuntimeError(f"reward: the reward function failed on all {len(gen)} samples with a served reward "
                               f"model at {server.router_address} (reward/scorer_errors, scorer_timeouts); is it "
                               "answering? The first failure is logged above")
        return out

    def collect_step_batch(self, step: int) -> tuple[DataProto, dict, dict]:
        """collect_batch for step `step`, with its own timing and metrics (one-step-off rollout runs it in the
        background while the step before trains)."""
        timing, metrics = {}, {}
        return self.collect_batch(timing, metrics, step), timing, metrics

    def push_weights(self) -> int:
        """The actor's current weights into the rollout engines; returns the bytes each engine loaded."""
        self.engine_needs_push = False
        if self.weight_push is None:  # the hybrid engine: each actor rank into its own engine, in-process
            return self.workers.actor.update_weights()[0]["perf/update_weights_bytes"]
        return self.weight_push()

    def train_step(self, timing: dict) -> tuple[DataProto, dict]:
        cfg, algorithm = self.config, self.config.algorithm
        actor = self.workers.actor
        metrics: dict = {}
        if self.one_step_off is None:
            batch = self.collect_batch(timing, metrics)
        else:  # collected while the last step trained; the next step's batch starts now (pyrl.trainer.one_step_off)
            batch = self.one_step_off.batch(self.global_steps, timing, metrics)
        if cfg.trainer.balance_batch:
            metrics.update(balance_batch(batch, self.workers.world_size,
                                         cfg.actor_rollout_ref.actor.use_prefix_grouper))
        if self.plan.old_log_probs_from == "rollout":  # verl's bypass mode: the rollout engine's are the old ones
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif self.plan.runs("old_log_prob"):  # else the update's own log-probs are the old ones (and give entropy)
            with M.timer("old_log_prob", timing):
                old = actor.compute_log_prob(packed_tokens(batch))
                metrics.update(M.reduce_metrics(old.meta_info.pop("metrics")))
                actor_cfg, mask = cfg.actor_rollout_ref.actor, batch.batch["response_mask"].float()
                entropy = ops.agg_loss(old.batch["entropys"], mask, actor_cfg.loss_agg_mode,
                                       loss_scale_factor=actor_cfg.loss_scale_factor or mask.shape[-1])
                metrics["actor/entropy"] = entropy.item()
                batch.union(old.select([key for key in ("old_log_probs", "sum_pi_squared") if key in old.batch]))
            if "rollout_log_probs" in batch.batch:  # weights pushed intact: both engines give the same log-probs
                metrics.update(rollout_vs_trainer(batch))
        if self.plan.runs("ref"):
            with M.timer("ref", timing):
                ref = actor.compute_ref_log_prob(packed_tokens(batch))
                metrics.update(M.reduce_metrics(ref.meta_info.pop("metrics")))
                batch.union(ref)
        if self.plan.runs("teacher"):  # on-policy distillation: the teacher's scores of the student's tokens
            with M.timer("teacher", timing):
                if self.plan.teacher_pool is not None:  # the teachers' own servers
                    scores = score_batch(self.workers.teacher, self.config.distillation, batch)
                else:  # in the actor's workers
                    scores = actor.compute_teacher_log_probs(packed_tokens(batch))
                    metrics.update(M.reduce_metrics(scores.meta_info.pop("metrics")))
                batch.union(scores)
        if self.plan.runs("values"):
            with M.timer("values", timing):
                batch.union(self.workers.critic.compute_values(packed_tokens(batch)))
        with M.timer("adv", timing):
            if algorithm.use_kl_in_reward:
                metrics.update(apply_kl_penalty(batch, self.kl_ctrl, algorithm.kl_penalty))
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            if ("rollout_log_probs" in batch.batch and "old_log_probs" in batch.batch
                    and self.plan.old_log_probs_from != "rollout"):
                metrics.update(apply_rollout_correction(batch, self.correction))  # IS weights, rejections: before
            metrics.update(compute_advantage(batch, algorithm))
        if self.plan.runs("update_critic"):
            with M.timer("update_critic", timing):
                metrics.update(M.reduce_metrics(self.workers.critic.update_critic(packed_tokens(batch)).meta_info["metrics"]))
        if cfg.trainer.critic_warmup <= self.global_steps:
            with M.timer("update_actor", timing):
                updated = actor.update_actor(packed_tokens(batch))
                metrics.update(M.reduce_metrics(updated.meta_info["metrics"]))
            if "old_log_probs" in updated.batch:  # on-policy: the update's own, from before its optimizer step, give
                batch.batch["old_log_probs"] = updated.batch["old_log_probs"]  # what the skipped pass would have
                metrics.update(rollout_vs_trainer(batch))
                metrics.update(apply_rollout_correction(batch, self.correction))  # metrics only: no IS, no rejection
            if self.one_step_off is not None:  # pushed once the batch in flight is generated, before the next one
                self.one_step_off.actor_updated()
        if self.one_step_off is None:  # also in the critic's warm-up: an engine asleep on CUDA has dropped its weights
            with M.timer("update_weights", timing):
                metrics["perf/update_weights_bytes"] = self.push_weights()
        return batch, metrics

    # ---- validation ----
    def validate(self) -> tuple[dict, list[dict]]:
        """-> (val-core / val-aux metrics, per-sample records when validation_data_dir or
        log_val_generations asks for them)."""
        if self.val_dataset is None:
            return {}, []
        trainer = self.config.trainer
        keep_records = bool(trainer.validation_data_dir) or trainer.log_val_generations > 0
        val = self.config.actor_rollout_ref.rollout.val_kwargs
        size = self.config.data.val_batch_size or len(self.val_dataset)
        sources, uids, lengths, records, batch_infos, agent_columns = [], [], [], [], [], []
        for start in range(0, len(self.val_dataset), size):
            indices = list(range(start, min(start + size, len(self.val_dataset))))
            batch = self.val_dataset.batch(indices, self.pad_token_id)
            batch.non_tensor_batch["uid"] = np.asarray([f"val-{i}" for i in indices], dtype=object)
            out = self.generate(batch, n=val.n, temperature=val.temperature, top_k=val.top_k, top_p=val.top_p,
                                seed=self.plan.seed)
            token_scores, extra, _ = self.score(out, self.val_reward_fn)
            sequence_scores = token_scores.sum(-1)
            batch_infos.append((len(out), {"reward": sequence_scores.tolist(), **extra}))
            sources += list(out.non_tensor_batch[self.config.data.reward_fn_key])
            uids += list(out.non_tensor_batch["uid"])
            lengths += response_lengths(out).tolist()
            if "__num_turns__" in out.non_tensor_batch:
                agent_columns.append({key: out.non_tensor_batch[key] for key in AGENT_LOOP_COLUMNS})
            if keep_records:
                for key, values in extra.items():
                    out.non_tensor_batch[key] = np.asarray(values, dtype=object)
                records += generation_records(self.tokenizer, out, sequence_scores, self.global_steps, extra)
        # the engine stays awake: the next step generates first (on CUDA an engine asleep has dropped its weights)
        # a field some batches lack (a scorer that returns it only sometimes) is None there
        infos = {key: [v for count, info in batch_infos for v in info.get(key, [None] * count)]
                 for key in dict.fromkeys(key for _, info in batch_infos for key in info)}
        metrics = M.validation_metrics(sources, uids, infos, lengths)
        if agent_columns:  # verl's val-aux/num_turns/*, with the tool calls' counts and errors
            columns = {key: np.concatenate([c[key] for c in agent_columns]) for key in AGENT_LOOP_COLUMNS}
            metrics.update({f"val-aux/{key}": value for key, value in M.agent_loop_metrics(columns).items()
                            if not key.startswith(("timing_s/", "training/"))})
        elif uids:  # every verl 0.9.1 rollout runs in an agent loop: a single-turn sample counts 2 turns there
            metrics.update({"val-aux/num_turns/min": 2, "val-aux/num_turns/max": 2, "val-aux/num_turns/mean": 2.0})
        return metrics, records

    def run_validation(self, tracker) -> dict:
        """validate(), then dump its generations and hand the chosen few to the loggers."""
        metrics, records = self.validate()
        trainer = self.config.trainer
        if trainer.validation_data_dir and records:
            dump_generations(records, trainer.validation_data_dir, self.global_steps)
        if trainer.log_val_generations > 0:
            tracker.log_generations(pick_for_logging(records, trainer.log_val_generations), self.global_steps)
        return metrics

    # ---- checkpoints ----
    def save_checkpoint(self) -> None:
        """The workers' shards, then data.pt, then the manifest (pyrl.trainer.checkpoints), last: a directory
        without one is an unfinished save. A directory of this step left by an earlier attempt (a run resumed from
        before it) is removed first, so that nothing of it is listed as this save's."""
        step_dir = checkpoints.step_dir(self.run_dir, self.global_steps)
        shutil.rmtree(step_dir, ignore_errors=True)
        os.makedirs(step_dir)
        self.workers.actor.save_checkpoint(os.path.join(step_dir, "actor"))
        if self.use_critic:
            self.workers.critic.save_checkpoint(os.path.join(step_dir, "critic"))
        state = {"global_steps": self.global_steps}
        if self.one_step_off is not None:  # the next step's batch, generated with older weights than these
            state.update(self.one_step_off.state_dict())  # waits for it: its collection draws from the sampler
        state.update(sampler=self.sampler.state_dict(), kl_ctrl=self.kl_ctrl.state_dict())
        checkpoints.save_trainer_state(step_dir, state)

    def commit_checkpoint(self) -> None:
        """Make the saved step the one to resume from, once its metrics are logged (a run killed between
        the two resumes from the checkpoint before and repeats the steps since, so no step's row is lost);
        then retention (checkpoints.apply_retention: max_actor_ckpt_to_keep, max_critic_ckpt_to_keep)."""
        trainer = self.config.trainer
        checkpoints.commit(self.run_dir, self.global_steps, trainer.max_actor_ckpt_to_keep,
                           trainer.max_critic_ckpt_to_keep)

    def checkpoint_to_resume(self, digests: bool = True) -> str | None:
        trainer = self.config.trainer
        path = trainer.resume_from_path if trainer.resume_mode == "resume_path" else None  # read where it counts
        return checkpoints.to_resume(self.run_dir, trainer.resume_mode, path, digests)

    def resume_hint(self) -> str:
        """Where a rerun would resume, for the run's last line: sizes checked, not digests (a run stopping does not
        read its checkpoints through), and never an error of its own in place of the one being reported."""
        try:
            path = self.checkpoint_to_resume(digests=False)
        except Exception as e:  # noqa: BLE001
            return f"the checkpoints could not be read ({type(e).__name__}: {e})"
        return f"rerunning the same command resumes from {path}" if path else \
            "no checkpoint to resume from, a rerun starts over"

    def load_checkpoint(self) -> None:
        """Resume from the checkpoint trainer.resume_mode picks; metrics.jsonl keeps the steps up to it (a
        fresh start in a used run directory starts it afresh instead of appending a second run)."""
        path = self.checkpoint_to_resume()
        if path is None:
            truncate_metrics(self.run_dir, -1)
            return
        state = checkpoints.load_trainer_state(path)
        self.workers.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.use_critic:
            self.workers.critic.load_checkpoint(os.path.join(path, "critic"))
        self.global_steps = state["global_steps"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.one_step_off is not None:
            self.one_step_off.load_state_dict(state)
        elif state.get("next_batch") is not None:
            log.warning("%s holds a one-step-off run's next batch, which the hybrid engine does not use: its prompts "
                        "are skipped", path)
        truncate_metrics(self.run_dir, self.global_steps)
        log.info("resumed from %s (step %d)", path, self.global_steps)

    # ---- the run ----
    def fit(self) -> dict:
        trainer = self.config.trainer
        self.load_checkpoint()
        if self.global_steps >= self.total_steps:
            log.info("the checkpoint is at step %d of %d: nothing left to train (trainer.resume_mode=disable starts "
                     "over)", self.global_steps, self.total_steps)
        self.push_weights()
        tracker = Tracking(trainer.logger, self.run_dir, trainer.project_name, trainer.experiment_name,
                           dataclasses.asdict(self.config), self.total_steps, initial_step=self.global_steps)
        last_val: dict = {}
        try:
            # val_only validates the weights the run starts from (a resumed checkpoint's too) whatever
            # val_before_train says; verl 0.9.1 validates only with val_before_train, and trains otherwise
            if trainer.val_only or (trainer.val_before_train and self.global_steps == 0):
                last_val = self.run_validation(tracker)
                tracker.log(last_val, step=self.global_steps, advance=False)
            if trainer.val_only:
                return last_val
            while self.global_steps < self.total_steps:
                self.global_steps += 1
                timing: dict = {}
                with M.timer("step", timing):
                    batch, metrics = self.train_step(timing)
                    if trainer.rollout_data_dir:
                        with M.timer("dump_rollout_generations", timing):
                            records = generation_records(self.tokenizer, batch,
                                                         batch.batch["token_level_scores"].sum(-1),
                                                         self.global_steps, batch.meta_info["reward_extra_keys"])
                            dump_generations(records, trainer.rollout_data_dir, self.global_steps)
                    last_step = self.global_steps == self.total_steps
                    if trainer.test_freq > 0 and (self.global_steps % trainer.test_freq == 0 or last_step):
                        with M.timer("testing", timing):
                            if self.one_step_off is not None:  # the batch in flight, then the current weights
                                self.one_step_off.sync(timing, metrics)
                            last_val = self.run_validation(tracker)
                            metrics.update(last_val)
                    saved = trainer.save_freq > 0 and (self.global_steps % trainer.save_freq == 0 or last_step)
                    if saved:
                        with M.timer("save_checkpoint", timing):
                            self.save_checkpoint()
                metrics.update(M.compute_data_metrics(batch, self.use_critic))
                metrics.update(M.compute_timing_metrics(batch, timing))
                metrics.update(M.compute_throughput_metrics(batch, timing, self.workers.world_size))
                metrics["training/global_step"] = self.global_steps
                tracker.log(metrics, step=self.global_steps)
                if saved:
                    self.commit_checkpoint()
        except KeyboardInterrupt:  # Ctrl-C: one line instead of a traceback; run_ppo's finally stops the workers
            tracker.close()  # first, so the bar's last redraw comes before the line
            raise RunStopped(130, f"interrupted at step {self.global_steps} of {self.total_steps}: "  # 128 + SIGINT
                                  f"{self.resume_hint()}") from None
        except WorkerError as e:  # the whole account in the log; the one line last (pyrl.ppo.cli prints it)
            tracker.close()
            log.error("%s", e)
            raise RunStopped(1, f"stopped at step {self.global_steps} of {self.total_steps}: {str(e).splitlines()[0]}; "
                                f"{self.resume_hint()}") from None
        finally:
            tracker.close()
            if self.one_step_off is not None:
                self.one_step_off.close()
        return last_val
