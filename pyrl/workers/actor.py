"""The actor / rollout / reference worker (verl's hybrid engine): one process per rank holds the FSDP2
policy being trained, optionally a frozen FSDP2 reference copy, and a rollout engine that generates
with the policy's current weights, pushed in memory after each update.

Roles: "actor_rollout_ref" (all three), "actor_rollout", "actor", "ref" (reference only); without the hybrid
engine (one-step-off-policy rollout, pyrl.trainer.one_step_off) "actor" or "actor_ref" train and publish their
weights, and "rollout" workers (tokenizer and engine, no FSDP model) generate and load them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch

from pyrl import ops
from pyrl.algos import distillation, get_policy_loss_fn
from pyrl.algos.policy_loss import uses_micro_batch_statistics
from pyrl.config import is_on_policy
from pyrl.controller import Dispatch, Worker, register
from pyrl.interactions.registry import initialize_interactions_from_config
from pyrl.protocol import DataProto
from pyrl.seeding import derive_seed
from pyrl.tools.tool_registry import load_all_tools
from pyrl.workers import batching, checkpoint, fsdp, lora, optim, perf
from pyrl.workers.batching import ModelInputs
from pyrl.workers.distributed import all_reduce, full_tensor, local_tensor, worker_device
from pyrl.workers.models import load_policy, load_tokenizer, model_dir
from pyrl.workers.rollout import SamplingSpec, assemble_rollout, make_engine
from pyrl.workers.rollout.agent_loop import (
    agent_loop_logprobs,
    agent_name,
    trajectory_columns,
    uses_agent_loop,
    with_agent_loop_prompts,
)
from pyrl.workers.rollout.base import prompt_token_lists
from pyrl.workers.rollout.hf_engine import HFEngine
from pyrl.workers.rollout.tensor_parallel import LeaderEngine, TensorParallelGroup
from pyrl.workers.update import UpdatePlan, run_update

ROLES = ("actor_rollout_ref", "actor_rollout", "actor", "ref", "actor_ref", "rollout")


ROW = "_update_row"  # update_actor's own column: each row's place in its batch


class ActorRolloutRefWorker(Worker):
    def __init__(self, config, role: str = "actor_rollout_ref", distillation=None):
        """distillation: the run's distillation section (pyrl.config.DistillationConfig) when it is enabled: the
        actor then also holds the frozen teacher (colocated, as the reference) and trains on its scores."""
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        self.config, self.role = config, role
        self.distillation = distillation if distillation is not None and distillation.enabled else None
        self.has_actor = "actor" in role
        self.has_rollout = "rollout" in role
        self.has_ref = role.endswith("ref")
        self.device = worker_device(self.local_rank)
        self.packed = config.model.use_remove_padding
        self.engine = None
        self.tp_group = None  # with rollout.tensor_model_parallel_size > 1: the ranks sharing this rank's engine
        self.agent_loop_runner, self.agent_loop_stats = None, {}
        self.peft_model = None  # with model.lora_rank > 0: the policy's adapters (pyrl.workers.lora)

    # ---- setup ----
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.config.actor.data_loader_seed)  # any freshly initialized weight is equal on every rank
        self.tokenizer = load_tokenizer(self.config.model)
        self.model_path = model_dir(self.config.model)
        if self.has_actor:
            self.lm, self.policy = load_policy(self.config.model)
            if lora.uses_lora(self.config.model):  # only the adapters train; the reference is the same model without
                self.peft_model = lora.add_adapters(self.lm, self.config.model, "CAUSAL_LM", "actor_rollout_ref.model")
            self.compute_dtype = fsdp.fsdp_wrap(self.policy, self.lm.model.layers, self.config.actor.fsdp_config,
                                                self.device)
            self.optimizer = optim.build_optimizer([p for p in self.policy.parameters() if p.requires_grad],
                                                   self.config.actor.optim)
            self.lr_scheduler = optim.build_lr_scheduler(self.optimizer, self.config.actor.optim)
        if self.has_ref and self.peft_model is not None:  # the actor with its adapters off: no second copy
            self.ref_policy, self.ref_compute_dtype, self.ref_hf_config = (self.policy, self.compute_dtype,
                                                                           self.lm.config)
        elif self.has_ref:
            ref_lm, self.ref_policy = load_policy(self.config.model)
            self.ref_compute_dtype = fsdp.fsdp_wrap(self.ref_policy, ref_lm.model.layers, self.config.ref.fsdp_config,
                                                    self.device)
            self.ref_hf_config = ref_lm.config
            self.ref_policy.requires_grad_(False)
        self.teachers = []  # on-policy distillation: (TeacherModelConfig, policy, HF config, compute dtype) each
        # (none here when the teachers have a pool of their own: pyrl.workers.teacher_server)
        if self.has_actor and self.distillation is not None and not distillation.pool_devices(self.distillation):
            for _, teacher in distillation.teachers_of(self.distillation):
                model = dataclasses.replace(self.config.model, path=teacher.model_path, tokenizer_path=None,
                                            override_config={}, lora_rank=0, lora_adapter_path=None,
                                            enable_gradient_checkpointing=False)
                teacher_lm, policy = load_policy(model)
                dtype = fsdp.fsdp_wrap(policy, teacher_lm.model.layers, distillation.teacher_fsdp_config(
                    self.config.ref.fsdp_config, teacher), self.device)
                policy.requires_grad_(False)
                self.teachers.append((teacher, policy, teacher_lm.config, dtype))
        if self.has_rollout:
            from transformers import AutoConfig  # lazy: transformers loads with the first model

            overrides = dict(self.config.model.override_config)  # the engine runs the model the actor trains
            self.hf_config = self.lm.config if self.has_actor else AutoConfig.from_pretrained(
                self.model_path, trust_remote_code=self.config.model.trust_remote_code, **overrides)
            tp = self.config.rollout.tensor_model_parallel_size
            if tp > 1:
                self.tp_group = TensorParallelGroup(self.rank, self.world_size, tp, self.config.nccl_timeout)
            # the ranks of a tensor-parallel group share one engine, seeded as their leader's
            engine_rank = self.tp_group.leader if self.tp_group else self.rank
            rollout = dataclasses.replace(self.config.rollout,
                                          seed=derive_seed(self.config.rollout.seed, "engine", bits=32,
                                                           rank=engine_rank))
            self.engine = make_engine(rollout.name, self.model_path, rollout, self.device, self.tokenizer,
                                      self.tp_group.name if self.tp_group else "", config_overrides=overrides,
                                      trust_remote_code=self.config.model.trust_remote_code)
            if self.tp_group is not None and self.tp_group.is_leader:
                self.engine = LeaderEngine(self.engine, self.tp_group)
            self.engine_uses_actor_weights = self._engine_can_use_actor_weights()
        torch.manual_seed(derive_seed(self.config.actor.data_loader_seed, "dropout", rank=self.rank))

    # ---- rollout ----
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self) -> dict:
        """Push the actor's current weights into the rollout engine (in memory, tensor by tensor)."""
        start = time.perf_counter()
        if self.engine_uses_actor_weights:  # the engine's parameters are the actor's: nothing is copied
            self.engine.use_weights(fsdp.local_state_items(self.policy, "lm."))
            loaded = 0
        else:
            loaded = self.engine.load_weights(self._state_items(self.policy, "lm.", self.engine.dtype))
        return {"timing_s/update_weights": time.perf_counter() - start, "perf/update_weights_bytes": loaded}

    def _engine_can_use_actor_weights(self) -> bool:
        """The hf engine generates with the actor's own tensors where they are its whole weights as the engine
        computes them: this rank holds them whole (one rank, or groups of one), in the engine's dtype, on its device,
        no rollout tensor parallelism, and no LoRA (whose pushed weights are merged copies)."""
        if not (self.has_actor and isinstance(self.engine, HFEngine) and self.tp_group is None
                and self.peft_model is None and fsdp.holds_whole_weights(self.policy)):
            return False
        return all(t.dtype == self.engine.dtype and t.device.type == self.device.type
                   for _, t in fsdp.local_state_items(self.policy))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_dtype(self) -> torch.dtype:
        """The dtype the rollout engine computes in, which its weights are pushed in."""
        return self.engine.dtype

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def publish_weights(self, dtype: torch.dtype):
        """The actor's whole weights in `dtype` for rollout workers in other processes: every rank takes part in
        the gather (a collective, run to the end); rank 0 moves each whole tensor to CPU as it is gathered (its
        device never holds more than one, and the object store holds CPU tensors that each rollout engine copies to
        its own device), puts the (name, tensor) list in Ray's object store once and returns its reference, the
        other ranks None."""
        items = self._state_items(self.policy, "lm.", dtype)
        if self.rank != 0:
            for _ in items:
                pass
            return None
        return self.put_object([(name, tensor.cpu()) for name, tensor in items])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, named_tensors: list) -> dict:
        """Load the (name, tensor) list an actor published (Ray resolves its reference in each worker) into this
        worker's rollout engine."""
        start = time.perf_counter()
        loaded = self.engine.load_weights(iter(named_tensors))
        return {"timing_s/load_weights": time.perf_counter() - start, "perf/update_weights_bytes": loaded}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """prompts: input_ids / attention_mask (/ position_ids), left-padded. meta_info may override the
        rollout config's sampling (n, temperature, top_k, top_p, do_sample, response_length,
        calculate_log_probs). Returns n rows per prompt (interleaved) with verl's rollout fields. With rollout
        tensor parallelism the group's leader generates for the whole group (pyrl.workers.rollout.tensor_parallel)."""
        batching.require_keys("generate_sequences", prompts, ["input_ids", "attention_mask"])
        if self.tp_group is None:
            out, seconds = self._generate([prompts])[0]
        elif self.tp_group.is_leader:
            gathered = self.tp_group.gather(prompts)
            out, seconds = self.tp_group.lead(lambda: self._generate(gathered))
        else:
            self.tp_group.gather(prompts)
            out, seconds = self.tp_group.follow(self.engine)
        lengths = out.batch["attention_mask"].sum(-1).tolist()  # every rank takes part in mfu's all-reduce
        out.meta_info = {**out.meta_info, "metrics": {
            "perf/mfu/gen": perf.mfu(self.hf_config, lengths, seconds, self.device, self.engine.dtype, backward=False),
            **self.agent_loop_stats}}
        self.agent_loop_stats = {}
        return out

    def _generate(self, parts: list[DataProto]) -> list[tuple[DataProto, float]]:
        """One generation for the prompts of all parts: the rows of each part (n per prompt) in order, each with
        the generation's seconds."""
        prompts = parts[0] if len(parts) == 1 else DataProto.concat(parts)
        spec = SamplingSpec.from_config(self.config.rollout, prompts.meta_info)
        if spec.seed is not None:  # each rank (group) draws its own samples
            spec = dataclasses.replace(spec, seed=derive_seed(spec.seed, "rank", rank=self.rank))
        start = time.perf_counter()
        masks, columns = None, None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        rows = prompts.repeat(spec.n, interleave=True) if spec.n > 1 else prompts
        if len(prompts) == 0:
            responses, logprobs = [], [] if spec.logprobs else None
        elif uses_agent_loop(self.config.rollout, "agent_name" in prompts.non_tensor_batch):
            outputs = self._run_agent_loops(prompts, ids, spec)
            responses, masks = [o.response_ids for o in outputs], [o.response_mask for o in outputs]
            logprobs = agent_loop_logprobs(outputs) if spec.logprobs else None
            rows = with_agent_loop_prompts(rows, [o.prompt_ids for o in outputs], pad)
            columns = trajectory_columns(outputs)
        else:
            responses, logprobs = self.engine.generate(ids, spec)
        seconds = time.perf_counter() - start
        out = assemble_rollout(rows, responses, logprobs, spec.max_tokens, pad, masks)
        if columns is not None:
            out.non_tensor_batch.update(columns)
        if len(parts) == 1:
            return [(out, seconds)]
        # copies of each part's rows (a view would carry the whole batch's storage wherever it is sent)
        ends = np.cumsum([len(part) * spec.n for part in parts])
        return [(out.select_idxs(np.arange(end - len(part) * spec.n, end)), seconds) for part, end in zip(parts, ends)]

    def _run_agent_loops(self, prompts: DataProto, ids: list[list[int]], spec: SamplingSpec) -> list:
        """Every trajectory (spec.n per prompt, interleaved) through the loop its agent_name names, each a
        coroutine (pyrl.experimental.agent_loop). A loop gets the row's non-tensor fields as verl's do, and
        raw_prompt_ids, the prompt's tokens as the dataset rendered them."""
        runner = self._agent_loop_runner(prompts.meta_info)
        nt, default = prompts.non_tensor_batch, self.config.rollout.agent.default_agent_loop
        rows = []
        for i in range(len(prompts)):
            row = {key: values[i] for key, values in nt.items()}
            row["agent_name"] = agent_name(row.get("agent_name"), default)
            row["raw_prompt_ids"] = ids[i]
            rows += [dict(row) for _ in range(spec.n)]
        sampling_params = dict(temperature=0.0 if spec.greedy else spec.temperature, top_p=spec.top_p,
                               top_k=spec.top_k, repetition_penalty=1.0, logprobs=spec.logprobs)
        batch = runner.run(rows, sampling_params, spec)
        # the rollout server's: engine calls (steps, on vllm), requests, and the share of the rollout's wall time the
        # engine sat idle waiting for tools (a follower of a tensor-parallel group reports none)
        self.agent_loop_stats = {"agent_loop/engine_calls": batch.engine_calls, "agent_loop/requests": batch.requests,
                                 "agent_loop/engine_idle_fraction": batch.engine_idle_fraction}
        return batch.outputs

    def _agent_loop_runner(self, meta_info: dict):
        """Built on first use: the tools and interactions of rollout.multi_turn, loaded in this worker, and the
        data's chat template keywords (the trainer sends data.apply_chat_template_kwargs with the prompts)."""
        if self.agent_loop_runner is None:
            # lazy: the agent loops (pydantic, hydra) load only with an agent loop
            from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner

            multi_turn = self.config.rollout.multi_turn
            tools = load_all_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)
            interactions = (initialize_interactions_from_config(multi_turn.interaction_config_path)
                            if multi_turn.interaction_config_path else {})
            self.agent_loop_runner = AgentLoopRunner(self.engine, self.tokenizer, self.config, tools, interactions,
                                                     meta_info.get("apply_chat_template_kwargs"))
        return self.agent_loop_runner

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_rollout(self) -> None:
        self.engine.sleep()

    # ---- log-probs ----
    def _forward(self, module, hf_config, dtype, data: DataProto, micro_batch_size, use_dynamic_bsz: bool,
                 max_token_len: int, call, share_prompts: bool = False) -> tuple[tuple, float]:
        """call(module, inputs) -> a tuple of [rows, R, ...] outputs, over micro-batches (no gradients), each trimmed
        of all-padding columns; and the pass's MFU. share_prompts: a group's prompt once (actor.use_prefix_grouper)."""
        start = time.perf_counter()
        lengths, groups = batching.row_lengths(data), batching.prompt_groups(data) if share_prompts else None
        micro = batching.micro_batch_indices(lengths, micro_batch_size, use_dynamic_bsz, max_token_len, self.device,
                                             groups)

        def forward(tensors, kept):
            with torch.no_grad():
                return call(module, ModelInputs.responses(tensors, kept, self.packed, self.device,
                                                          share_prompts=share_prompts))

        outputs = batching.response_forward(data, micro, forward)
        mfu = perf.mfu(hf_config, lengths.tolist(), time.perf_counter() - start, self.device, dtype, backward=False,
                       tokens=sum(groups[1]) if groups else None)
        return outputs, mfu

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs and entropys [B, R] of the responses under the current policy, and sum_pi_squared [B, R]
        (sum over the vocabulary of pi^2) with actor.calculate_sum_pi_squared."""
        rollout, sum_pi_squared = self.config.rollout, self.config.actor.calculate_sum_pi_squared
        batching.require_tokens("compute_log_prob", data, ["responses"])
        temperature = data.meta_info.get("temperature", rollout.temperature)
        self.policy.eval()
        outputs, mfu = self._forward(self.policy, self.lm.config, self.compute_dtype, data,
                                     rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz,
                                     rollout.log_prob_max_token_len_per_gpu,
                                     lambda module, inputs: module(inputs, temperature, True, sum_pi_squared),
                                     share_prompts=self.config.actor.use_prefix_grouper)
        return DataProto.from_dict(dict(zip(("old_log_probs", "entropys", "sum_pi_squared"), outputs)),
                                   meta_info={"metrics": {"perf/mfu/actor_infer": mfu}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        ref = self.config.ref
        batching.require_tokens("compute_ref_log_prob", data, ["responses"])
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        self.ref_policy.eval()
        base = lora.adapters_disabled(self.peft_model) if self.peft_model is not None else contextlib.nullcontext()
        with base:
            (logp,), mfu = self._forward(self.ref_policy, self.ref_hf_config, self.ref_compute_dtype, data,
                                         ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz,
                                         ref.log_prob_max_token_len_per_gpu,
                                         lambda module, inputs: (module(inputs, temperature),),
                                         share_prompts=self.config.actor.use_prefix_grouper)
        return DataProto.from_dict({"ref_log_prob": logp}, meta_info={"metrics": {"perf/mfu/ref": mfu}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_probs(self, data: DataProto) -> DataProto:
        """The teacher's scores of the responses (pyrl.algos.distillation), at temperature 1, in micro-batches of
        the teacher's inference.max_num_batched_tokens tokens: teacher_log_probs [B, R] (estimator modes), or
        teacher_topk_log_probs and teacher_topk_ids [B, R, k] (forward_kl_topk)."""
        batching.require_tokens("compute_teacher_log_probs", data, ["responses"])
        loss = self.distillation.distillation_loss
        topk = loss.topk if distillation.uses_topk(loss) else 0
        chunk = distillation.topk_chunk_rows(loss)
        names = ("teacher_topk_log_probs", "teacher_topk_ids") if topk else ("teacher_log_probs",)

        def call(module, inputs):
            return module(inputs, 1.0, topk=topk, chunk_rows=chunk) if topk else (module(inputs, 1.0),)

        routes = distillation.route_rows(self.distillation, distillation.teacher_keys_of(self.distillation, data))
        outputs, mfus = {}, []
        for (teacher, policy, hf_config, dtype), rows in zip(self.teachers, routes):
            # every rank runs every teacher (FSDP's collectives), one row standing in where it routed none
            policy.eval()
            scores, mfu = self._forward(policy, hf_config, dtype, data.select_idxs(rows or [0]), None, True,
                                        teacher.inference.max_num_batched_tokens, call)
            if not rows:
                continue
            mfus.append((mfu, len(rows)))
            for name, score in zip(names, scores):
                if name not in outputs:
                    outputs[name] = torch.zeros((len(data), *score.shape[1:]), dtype=score.dtype)
                outputs[name][rows] = score
        mfu = sum(m * n for m, n in mfus) / max(1, sum(n for _, n in mfus))
        return DataProto.from_dict(outputs, meta_info={"metrics": {"perf/mfu/teacher": mfu}})

    # ---- training ----
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of ppo_mini_batch_size x n samples (split over the ranks), each in
        micro-batches with gradient accumulation; the losses are exact global token / sequence means over
        the mini-batch (see pyrl.ops.agg_loss's global_batch_info), so any rank count or micro-batching
        gives the same step. Returns meta_info["metrics"] with verl's names."""
        cfg = self.config.actor
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        plan = UpdatePlan("actor", cfg.ppo_mini_batch_size * self.config.rollout.n // self.world_size, cfg.ppo_epochs,
                          cfg.shuffle, cfg.data_loader_seed, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                          cfg.ppo_max_token_len_per_gpu, cfg.optim.clip_grad,
                          cfg.loss_scale_factor or data.batch["responses"].shape[-1],
                          hint=f" (actor.ppo_mini_batch_size={cfg.ppo_mini_batch_size} x rollout.n="
                               f"{self.config.rollout.n} / {self.world_size} ranks)",
                          share_prompts=cfg.use_prefix_grouper, recut=not uses_micro_batch_statistics(cfg))
        batching.require_tokens("update_actor", data, ["responses", "response_mask", "advantages"]
                                + (["ref_log_prob"] if cfg.use_kl_loss else []) + self._teacher_keys())
        # without old_log_probs the update must be on-policy (one epoch, one mini-batch: the weights that
        # generated are the ones being updated), and this forward's own detached log-probs stand in for them
        bypass = cfg.policy_loss.loss_mode == "bypass_mode"  # verl's: the rollout's log-probs are the old ones
        if bypass and "rollout_log_probs" not in data.batch:
            raise KeyError("update_actor: actor.policy_loss.loss_mode=bypass_mode needs the batch's rollout_log_probs "
                           "(the rollout engine's log-probs, rollout.calculate_log_probs=true)")
        on_policy = "old_log_probs" not in data.batch and not bypass
        if on_policy and not is_on_policy(cfg, self.config.rollout.n, len(data) * self.world_size):
            raise KeyError(f"update_actor: the batch lacks old_log_probs, which only an on-policy update "
                           f"(ppo_epochs=1, one mini-batch) can do without; got ppo_epochs={cfg.ppo_epochs}, "
                           f"ppo_mini_batch_size={cfg.ppo_mini_batch_size} x rollout.n={self.config.rollout.n} for "
                           f"{len(data) * self.world_size} rows")
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        response_length = data.batch["responses"].shape[-1]
        # on-policy with the rollout engine's log-probs to compare against: this update's own, taken before its one
        # optimizer step, are the old-log-prob pass's numbers; they go back to the trainer (own_log_probs[row])
        own_log_probs = torch.zeros(len(data), response_length) if on_policy and "rollout_log_probs" in data.batch \
            else None
        if own_log_probs is not None:
            data.batch[ROW] = torch.arange(len(data))

        def micro_step(mini: DataProto, idx: list, info: dict) -> dict:
            return self._micro_step(mini, idx, response_length, temperature, policy_loss_fn, info, on_policy,
                                    own_log_probs)

        try:
            metrics = run_update(self.policy, self.optimizer, self.lr_scheduler, data, plan, cfg.fsdp_config,
                                 self.device, self.world_size, self.lm.config, self.compute_dtype, micro_step)
        finally:
            if own_log_probs is not None:
                data.pop([ROW])
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        if self.distillation is not None:
            distillation.finish_metrics(metrics)
        metrics.update(perf.memory_metrics(self.device))
        if own_log_probs is None:
            return DataProto(meta_info={"metrics": metrics})
        return DataProto.from_dict({"old_log_probs": own_log_probs}, meta_info={"metrics": metrics})

    def _micro_step(self, mini: DataProto, idx, response_length, temperature, policy_loss_fn, info, on_policy,
                    own_log_probs=None) -> dict:
        """Forward and backward of one micro-batch; returns its shares of the mini-batch metrics (actor/ names
        without the prefix). The loss shares are scaled by dp_size for gradient averaging (see agg_loss), so
        their metric shares are divided by it. own_log_probs: where this forward's log-probs go, by the rows'
        ROW column (see update_actor)."""
        cfg = self.config.actor
        # on-policy there was no old-log-prob pass to report actor/entropy: the update does
        need_entropy = cfg.entropy_coeff != 0 or cfg.calculate_entropy or on_policy
        tensors, kept = batching.trimmed(mini.select_idxs(idx or [0]), response_length)
        to = lambda key: tensors[key].to(self.device)  # noqa: E731
        inputs = ModelInputs.responses(tensors, kept, self.packed, self.device, share_prompts=cfg.use_prefix_grouper)
        teacher = self._teacher_scores(tensors)
        if "teacher_topk_ids" in teacher:  # forward_kl_topk: the student's log-probs at the teacher's top-k too
            out = self.policy(inputs, temperature, need_entropy, at_ids=teacher["teacher_topk_ids"],
                              chunk_rows=distillation.topk_chunk_rows(self.distillation.distillation_loss))
            out, (teacher["student_topk_log_probs"], teacher["student_topk_ids"]) = out[:-2], out[-2:]
            out = out if need_entropy else out[0]
        else:
            out = self.policy(inputs, temperature, need_entropy)
        logp, entropy = out if need_entropy else (out, None)
        if own_log_probs is not None and idx:
            own_log_probs[tensors[ROW], :logp.shape[1]] = logp.detach().float().cpu()
        mask = to("response_mask").float() * (1.0 if idx else 0.0)  # an empty micro-batch adds zero gradient
        if cfg.policy_loss.loss_mode == "bypass_mode":
            old = to("rollout_log_probs").float()
        else:
            old = logp.detach() if on_policy else to("old_log_probs").float()
        # verl's decoupled-mode rollout-correction IS weights, when the trainer put them in the batch
        weights = {"rollout_is_weights": to("rollout_is_weights").float()} if "rollout_is_weights" in tensors else {}
        pg_loss, pg_metrics = policy_loss_fn(old, logp, to("advantages").float(), mask, cfg.loss_agg_mode, cfg, info,
                                             **weights)
        loss = pg_loss
        token_share = float(mask.sum()) / max(info["response_tokens"], 1)
        distill = {}
        if self.distillation is not None:  # pyrl.algos.distillation: its formula sheet says how the two combine
            loss_cfg = self.distillation.distillation_loss
            distill_loss, distill = distillation.distillation_loss(loss_cfg, cfg, mask, info, logp, old, teacher,
                                                                   weights.get("rollout_is_weights"))
            distill["distillation/loss"] = distill_loss.item() / info["dp_size"]
            if not loss_cfg.use_task_rewards:  # the distillation loss alone: no policy, entropy or KL term
                distill_loss.backward()
                return distill
            loss = loss + loss_cfg.distillation_loss_coef * distill_loss
        shares = {"pg_loss": pg_loss.item() / info["dp_size"]}
        for key, value in pg_metrics.items():  # token means: pg_clipfrac, pg_clipfrac_lower, ppo_kl and the loss's own
            shares[key] = float(value) * token_share
        if need_entropy:  # aggregated as the loss is (verl 0.9.1's actor/entropy_loss), over the micro-batches
            entropy_loss = ops.agg_loss(entropy, mask, cfg.loss_agg_mode, global_batch_info=info)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.entropy_coeff or cfg.calculate_entropy:
                shares["entropy_loss"] = entropy_loss.item() / info["dp_size"]
            if on_policy:  # the policy before its one step: what the skipped old-log-prob pass reports, which verl
                # aggregates over the response mask alone (its tokens, its non-empty rows)
                entropy_info = {**info, "batch_num_tokens": info["response_tokens"],
                                "global_batch_size": info["response_rows"]}
                shares["entropy"] = ops.agg_loss(entropy, mask, cfg.loss_agg_mode,
                                                 global_batch_info=entropy_info).item() / info["dp_size"]
        if cfg.use_kl_loss:
            kl = ops.kl_penalty(logp, to("ref_log_prob").float(), cfg.kl_loss_type)
            kl_loss = ops.agg_loss(kl, mask, cfg.loss_agg_mode, global_batch_info=info)
            loss = loss + cfg.kl_loss_coef * kl_loss
            shares["kl_loss"] = kl_loss.item() / info["dp_size"]
        loss.backward()
        return {**shares, **distill}

    def _teacher_keys(self) -> list[str]:
        """The teacher pass's fields the update reads (none without distillation)."""
        if self.distillation is None:
            return []
        if distillation.uses_topk(self.distillation.distillation_loss):
            return ["teacher_topk_log_probs", "teacher_topk_ids"]
        return ["teacher_log_probs"]

    def _teacher_scores(self, tensors: dict) -> dict:
        """A micro-batch's teacher fields, on the device (float32 log-probs, int64 ids)."""
        return {key: tensors[key].to(self.device).float() if "log_probs" in key else tensors[key].to(self.device).long()
                for key in self._teacher_keys()}

    # ---- supervised fine-tuning (pyrl.trainer.sft_trainer) ----
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_sft(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's rows of a global SFT batch (pyrl.data.sft_dataset.sft_batch's layout):
        the loss is the negative log-likelihood's token mean over every rank's trained tokens (verl 0.9.1's
        sft_loss), accumulated over micro-batches (actor.ppo_micro_batch_size_per_gpu, or a token budget), so any
        rank count or micro-batching gives the same step. meta_info["metrics"]: train/loss, train/grad_norm,
        train/lr (the step's), perf/mfu/train."""
        cfg = self.config.actor
        batching.require_tokens("train_sft", data, ["responses", "response_mask"])
        plan = UpdatePlan("train", len(data), 1, False, cfg.data_loader_seed, cfg.ppo_micro_batch_size_per_gpu,
                          cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, cfg.optim.clip_grad, 1.0,
                          hint=" (data.train_batch_size / ranks)")
        response_length = data.batch["responses"].shape[-1]

        def micro_step(mini: DataProto, idx: list, info: dict) -> dict:
            loss = self._sft_loss(mini, idx, response_length, info)
            loss.backward()
            return {"loss": loss.item() / info["dp_size"]}

        metrics = run_update(self.policy, self.optimizer, self.lr_scheduler, data, plan, cfg.fsdp_config, self.device,
                             self.world_size, self.lm.config, self.compute_dtype, micro_step)
        metrics.update(perf.memory_metrics(self.device))
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_sft(self, data: DataProto) -> DataProto:
        """train_sft's loss on a batch, without gradients or a step: meta_info["metrics"]["val/loss"] (the token
        mean over every rank's trained tokens)."""
        cfg = self.config.actor
        info = batching.global_batch_info(data.batch["response_mask"], self.device, self.world_size)
        response_length = data.batch["responses"].shape[-1]
        total = 0.0
        self.policy.eval()
        with torch.no_grad():
            for idx in batching.micro_batch_indices(batching.row_lengths(data), cfg.ppo_micro_batch_size_per_gpu,
                                                    cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, self.device):
                total += self._sft_loss(data, idx, response_length, info).item() / info["dp_size"]
        loss = all_reduce(torch.tensor([total], dtype=torch.float64, device=self.device)).item()
        return DataProto(meta_info={"metrics": {"val/loss": loss}})

    def _sft_loss(self, data: DataProto, idx: list, response_length: int, info: dict) -> torch.Tensor:
        """One micro-batch's share of the batch's token-mean negative log-likelihood (agg_loss token-mean over the
        global batch, scaled for gradient averaging over the ranks)."""
        tensors, kept = batching.trimmed(data.select_idxs(idx or [0]), response_length)
        inputs = ModelInputs.responses(tensors, kept, self.packed, self.device)
        logp = self.policy(inputs, 1.0, False)
        mask = tensors["response_mask"].to(self.device).float() * (1.0 if idx else 0.0)  # an empty one adds zero
        return ops.agg_loss(-logp, mask, "token-mean", global_batch_info=info)

    # ---- checkpoints ----
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        extra = {}
        if self.engine is not None and hasattr(self.engine, "generator"):
            extra["rollout_rng"] = self.engine.generator.get_state()
        checkpoint.save_checkpoint(path, self.policy, self.optimizer, self.lr_scheduler, self.rank, extra, self.lm,
                                   "lm.", self.tokenizer, "hf_model" in self.config.actor.checkpoint.save_contents,
                                   self.peft_model, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        extra = checkpoint.load_checkpoint(path, self.policy, self.optimizer, self.lr_scheduler, self.rank,
                                           trainable_only=self.peft_model is not None)
        if "rollout_rng" in extra and self.engine is not None and hasattr(self.engine, "generator"):
            self.engine.generator.set_state(extra["rollout_rng"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The current policy as a Hugging Face model directory (loadable by transformers and vLLM)."""
        checkpoint.export_hf(path, self.lm, self._state_items(self.policy, "lm."), self.tokenizer, self.rank)

    def _state_items(self, module, strip_prefix: str, dtype=None):
        """The policy's whole weights, one tensor at a time, adapters merged in with LoRA (a collective)."""
        if self.peft_model is not None:
            return lora.merged_state_items(module, strip_prefix, dtype)
        return fsdp.full_state_items(module, strip_prefix, dtype)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_digest(self) -> dict:
        """name -> whole parameter (CPU), optimizer step count: what tests compare across runs; and the parameter
        elements this rank holds (its shards)."""
        params = {name: tensor.cpu().clone() for name, tensor in fsdp.full_state_items(self.policy, "lm.")}
        optim = {}
        for name, param in self.policy.named_parameters():
            for key, value in self.optimizer.state.get(param, {}).items():
                optim[f"{name}.{key}"] = full_tensor(value).cpu().clone() if torch.is_tensor(value) else value
        held = sum(local_tensor(p).numel() for p in self.policy.parameters())
        return {"params": params, "optimizer": optim, "lr": self.lr_scheduler.get_last_lr()[0], "held_elements": held}
