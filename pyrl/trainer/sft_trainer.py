"""python -m pyrl.trainer.sft_trainer [key=value ...]: verl 0.9.1's supervised fine-tuning trainer
(`verl.trainer.sft_trainer`, config sft_trainer_engine.yaml) with the module name changed.

    python -m pyrl.trainer.sft_trainer data.train_files=sft.parquet data.messages_key=messages \\
        model.path=Qwen/Qwen2.5-0.5B optim.lr=1e-5 data.train_batch_size=64 trainer.total_epochs=2 \\
        checkpoint.save_contents=[model,optimizer,extra,hf_model]

Data: verl's MultiTurnSFTDataset (pyrl.data.sft_dataset): conversations in data.messages_key, the loss on the
assistant turns' tokens only. Each step takes data.train_batch_size conversations, spread over the trainer's ranks
(trainer.nnodes x n_gpus_per_node, or n_cpu_workers_per_node CPU processes: pyrl's FSDP2 actor workers on Ray, as
in RL training) with their tokens balanced (trainer.balance_batch), each rank in micro-batches of
data.micro_batch_size_per_gpu rows or (data.use_dynamic_bsz) data.max_token_len_per_gpu tokens, packed
(data.pad_mode=no_padding). The loss is verl's: the negative log-likelihood's mean over every trained token of the
global batch, whatever the rank count or micro-batching. LoRA with model.lora_rank. Checkpoints as the PPO
trainer's (global_step_N with a manifest, latest_checkpointed_iteration.txt, resume auto | disable | resume_path,
trainer.max_ckpt_to_keep); with hf_model in checkpoint.save_contents, global_step_N/huggingface is a whole
Hugging Face model (adapters merged) that `python -m pyrl.ppo actor_rollout_ref.model.path=...` takes as is.

Metrics (verl's names): train/loss, train/grad_norm, train/lr (the step's own; verl logs the next step's),
train/global_tokens, train/total_tokens(B), train/mfu, val/loss (the token mean over the whole validation set;
verl averages its batches' means).

Keys pyrl does not implement stop the run at start naming them (SFT_LIMITS); keys verl 0.9.1 reads nowhere are
refused other than at their defaults, except trainer.seed (the shuffle's seed here) and trainer.balance_batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import hydra
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

import pyrl.ppo as ppo_module
from pyrl.config import (
    FLOAT16_TRAINING,
    TRAINING_DTYPES,
    CheckpointConfig,
    FSDPConfig,
    ModelConfig,
    OptimConfig,
    apply_mixed_precision,
    plus_dropped_for_known,
    typed_config,
    unwrap_model_config,
)
from pyrl.trainer.metrics import reduce_metrics

log = logging.getLogger("pyrl")


@dataclass
class SFTDataConfig:
    train_batch_size: int = 256  # conversations per step, over all ranks
    micro_batch_size_per_gpu: int = 4  # rows per micro-batch without use_dynamic_bsz
    max_token_len_per_gpu: int = 8192  # tokens per micro-batch with use_dynamic_bsz
    use_dynamic_bsz: bool = True
    train_files: Any = "~/data/gsm8k/train.parquet"
    val_files: Any = None
    train_max_samples: int = -1
    val_max_samples: int = -1
    messages_key: str = "messages"
    tools_key: str = "tools"
    enable_thinking_key: str = "enable_thinking"
    enable_thinking_default: Optional[bool] = None  # verl's YAML has the string "none", which reads as true there
    pad_mode: str = "no_padding"
    max_length: int = 1024
    truncation: str = "error"  # error | left (keep the last max_length tokens) | right (the first)
    balance_dp_token: bool = False  # verl: "to be implemented"; refused when true
    custom_cls: dict = field(default_factory=lambda: {"path": None, "name": None})
    use_shm: bool = False
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    num_workers: int = 8
    ignore_input_ids_mismatch: bool = False
    shuffle: bool = False  # verl's: max_samples keeps a random subset (seeded by data.seed), not the first rows
    seed: Optional[int] = None  # the max_samples subset's seed (null: trainer.seed)


@dataclass
class SFTModelConfig(ModelConfig):
    """pyrl's model keys plus verl 0.9.1's hf_model.yaml's others (each one pyrl does not implement is limited)."""
    path: str = "~/models/deepseek-llm-7b-chat"
    hf_config_path: Optional[str] = None
    external_lib: Optional[str] = None
    enable_activation_offload: bool = False
    use_liger: bool = False
    fused_kernel_options: dict = field(default_factory=lambda: {"impl_backend": "torch"})
    tiled_mlp: dict = field(default_factory=lambda: {"enabled": False, "num_shards": 4})
    mtp: dict = field(default_factory=lambda: {"enable": False})
    lora: dict = field(default_factory=dict)  # verl's Megatron LoRA section
    target_parameters: Any = None


@dataclass
class SFTEngineConfig(FSDPConfig):
    """verl 0.9.1's engine/fsdp.yaml."""
    strategy: str = "fsdp"
    wrap_policy: dict = field(default_factory=lambda: {"min_num_params": 0})
    offload_policy: bool = False
    forward_prefetch: bool = False
    use_orig_params: bool = False
    seed: int = 42
    full_determinism: bool = False
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    use_torch_compile: bool = True
    entropy_checkpointing: bool = False
    use_no_sync_for_gradient_accumulation: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    qat: dict = field(default_factory=lambda: {"enable": False})


@dataclass
class SFTOptimConfig(OptimConfig):
    """verl 0.9.1's optim/fsdp.yaml."""
    lr: float = 1e-3
    optimizer_impl: str = "torch.optim"
    zero_indexed_step: bool = True
    override_optimizer_config: Optional[dict] = None


@dataclass
class SFTTrainerSection:
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    default_hdfs_dir: Optional[str] = None
    project_name: str = "gsm8k-sft"
    experiment_name: str = "test"
    total_epochs: int = 4
    total_training_steps: Optional[int] = None
    logger: Any = field(default_factory=lambda: ["console", "wandb"])
    seed: int = 1  # each epoch's shuffle (verl 0.9.1 reads it nowhere: its sampler's seed is 0)
    save_freq: Any = -1  # steps, or after_each_epoch; the last step always saves
    test_freq: Any = -1  # steps, or after_each_epoch; the last step always validates (with data.val_files)
    max_ckpt_to_keep: Optional[int] = None
    balance_batch: bool = True  # the ranks get equal tokens (verl 0.9.1's SFT trainer reads it nowhere)
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    device: str = "auto"  # auto | cuda | cpu (verl: cuda)
    nnodes: int = 1
    n_gpus_per_node: int = -1  # -1: this machine's GPUs (verl's torchrun sets the world instead); 0: CPU workers
    n_cpu_workers_per_node: int = 1
    ray_address: Optional[str] = None
    profile_interval: list = field(default_factory=lambda: [-1, -1])


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    engine: SFTEngineConfig = field(default_factory=SFTEngineConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        save_contents=["model", "optimizer", "extra"], load_contents="${checkpoint.save_contents}"))
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)
    profiler: dict = field(default_factory=lambda: {"enable": False})
    nccl_timeout: int = 600  # pyrl's: seconds a collective waits for the other ranks


ConfigStore.instance().store(name="sft_trainer_schema", node=SFTConfig)

CONSOLE_COLUMNS = [("train/loss", "loss"), ("val/loss", "val_loss"), ("train/lr", "lr"),
                   ("train/grad_norm", "grad_norm"), ("train/global_tokens", "tokens"), ("timing_s/step", "step_s")]

# key -> (allowed values, why): what pyrl does not implement, or what verl reads nowhere
SFT_LIMITS = {
    "data.pad_mode": (("no_padding",), "verl 0.9.1's engine runs no_padding only (right is refused there too)"),
    "data.balance_dp_token": ((False,), "verl 0.9.1: to be implemented (trainer.balance_batch balances tokens)"),
    "data.use_shm": ((False,), "verl 0.9.1's SFT dataset reads it nowhere"),
    "data.custom_cls": (({"path": None, "name": None},), "a custom SFT dataset class is not implemented"),
    "model.hf_config_path": ((None,), "the model's own config is read"),
    "model.external_lib": ((None,), "not implemented"),
    "model.enable_activation_offload": ((False,), "not implemented"),
    "model.use_liger": ((False,), "pyrl's fused kernels are model.use_fused_kernels"),
    "model.tiled_mlp": (({"enabled": False, "num_shards": 4},), "not implemented (verl's FSDP engine reads it "
                                                                "nowhere either)"),
    "model.mtp": (({"enable": False},), "multi-token prediction is not implemented"),
    "model.lora": (({},), "verl's Megatron LoRA section; FSDP LoRA is model.lora_rank"),
    "model.target_parameters": ((None,), "LoRA on bare parameters is not implemented"),
    "engine.strategy": (("fsdp", "fsdp2"), "both run FSDP2; Megatron and fsdp_turbo are not implemented"),
    "engine.ulysses_sequence_parallel_size": ((1,), "Ulysses sequence parallelism is not implemented"),
    "engine.forward_only": ((False,), "SFT trains"),
    **{f"engine.{key}": (TRAINING_DTYPES, FLOAT16_TRAINING) for key in ("dtype", "model_dtype")},
    "engine.offload_policy": ((False,), "not implemented (param_offload offloads)"),
    "engine.full_determinism": ((False,), "not implemented"),
    "engine.pad_to_length": ((False,), "not implemented"),
    "engine.qat": (({"enable": False},), "quantization-aware training is not implemented"),
    "engine.wrap_policy": (({"min_num_params": 0},), "pyrl wraps each decoder layer"),
    "engine.forward_prefetch": ((False,), "not implemented"),
    "engine.use_orig_params": ((False,), "an FSDP1 option; pyrl runs FSDP2"),
    "engine.seed": ((42,), "read with engine.full_determinism only, which is not implemented"),
    "engine.entropy_from_logits_with_chunking": ((False,), "SFT computes no entropy"),
    "engine.entropy_from_logits_chunk_size": ((2048,), "SFT computes no entropy"),
    "engine.entropy_checkpointing": ((False,), "SFT computes no entropy"),
    "engine.use_torch_compile": ((True,), "verl compiles its entropy function with it; SFT computes no entropy"),
    "engine.use_no_sync_for_gradient_accumulation": ((False,), "not implemented"),
    "engine.pad_to_length_bucket": ((1024,), "read with engine.pad_to_length only, which is not implemented"),
    "model.fused_kernel_options": (({"impl_backend": "torch"},), "pyrl's fused log-probs are its own "
                                                                 "(model.use_fused_kernels)"),
    "optim.optimizer": (("AdamW",), "pyrl's optimizer is AdamW"),
    "optim.optimizer_impl": (("torch.optim",), "pyrl's optimizer is torch's"),
    "optim.override_optimizer_config": ((None,), "not implemented"),
    "optim.zero_indexed_step": ((True,), "pyrl's schedules count steps from zero, verl's default"),
    "trainer.default_hdfs_dir": ((None,), "HDFS copies are not implemented"),
    "trainer.profile_interval": (([-1, -1],), "the profiler is not implemented"),
    "profiler": (({"enable": False},), "the profiler is not implemented"),
}


def _value(config, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def check_sft_config(config: SFTConfig) -> None:
    # lazy: the checks load torch
    from pyrl.trainer.checks import GRAD_CLIP, MICRO, NON_NEGATIVE, POSITIVE, UNIT, check_device, check_ranges
    from pyrl.verl_features import Unsupported  # lazy: as in pyrl.config
    from pyrl.workers.lora import check_lora_config  # lazy: as above

    ranges = {"optim.lr": NON_NEGATIVE, "optim.weight_decay": NON_NEGATIVE,  # a table of RANGES' form
              "optim.clip_grad": GRAD_CLIP, "optim.min_lr_ratio": UNIT,
              "data.train_batch_size": POSITIVE, "data.micro_batch_size_per_gpu": POSITIVE,
              "data.max_token_len_per_gpu": POSITIVE,
              "data.max_length": ("expected >= 2 (a token before the first trained one)", lambda v: v >= 2),
              "trainer.total_epochs": POSITIVE, "trainer.total_training_steps": MICRO, "nccl_timeout": POSITIVE}

    for key, (allowed, why) in SFT_LIMITS.items():
        value = _value(config, key)
        if value not in allowed:
            raise Unsupported(f"{key}={value!r} is not supported ({why}); expected {' or '.join(map(repr, allowed))}")
    data, trainer = config.data, config.trainer
    for key in ("save_freq", "test_freq"):
        value = getattr(trainer, key)
        if value != "after_each_epoch" and (not isinstance(value, int) or isinstance(value, bool) or value == 0):
            raise ValueError(f"trainer.{key}={value!r}: expected a positive step count, -1 (off) or after_each_epoch")
    if trainer.test_freq != -1 and not data.val_files:
        raise ValueError(f"trainer.test_freq={trainer.test_freq!r} validates, and data.val_files is empty")
    if trainer.resume_mode not in ("auto", "disable", "resume_path"):
        raise ValueError(f"trainer.resume_mode: expected auto, disable or resume_path, got {trainer.resume_mode!r}")
    check_ranges(config, ranges)
    check_lora_config(config.model, "model", "CAUSAL_LM")
    check_device(config.trainer)
    apply_mixed_precision(config.engine, "engine", trains=True)
    ppo_module.migrate_warmup_style(config.optim, "optim")
    for key in ("save_contents", "load_contents"):  # a resume always loads what a save always writes
        contents = set(getattr(config.checkpoint, key))
        if not {"model", "optimizer", "extra"} <= contents <= {"model", "optimizer", "extra", "hf_model"}:
            raise ValueError(f"checkpoint.{key}={sorted(contents)}: checkpoints always hold model, optimizer and "
                             f"extra (and hf_model if asked)")


def ppo_config_of(config: SFTConfig):
    """The PPO config pyrl's actor workers take, from the SFT keys: its model, the engine as the actor's
    fsdp_config, the optimizer, the micro-batching, the pools."""
    from pyrl.config import PPOConfig  # lazy: the PPO schema loads only for a run

    ppo = PPOConfig()
    arr, actor = ppo.actor_rollout_ref, ppo.actor_rollout_ref.actor
    arr.nccl_timeout = config.nccl_timeout
    arr.model = ModelConfig(**{name: getattr(config.model, name) for name in ModelConfig.__dataclass_fields__})
    if arr.model.use_fused_kernels is None:  # pyrl's fast path (verl 0.9.1: false): the same loss, less memory
        arr.model.use_fused_kernels = True
    actor.fsdp_config = FSDPConfig(**{name: getattr(config.engine, name) for name in FSDPConfig.__dataclass_fields__})
    actor.optim = OptimConfig(**{name: getattr(config.optim, name) for name in OptimConfig.__dataclass_fields__})
    actor.strategy = config.engine.strategy
    actor.ppo_micro_batch_size_per_gpu = None if config.data.use_dynamic_bsz else config.data.micro_batch_size_per_gpu
    actor.use_dynamic_bsz = config.data.use_dynamic_bsz
    actor.ppo_max_token_len_per_gpu = config.data.max_token_len_per_gpu
    actor.data_loader_seed = config.trainer.seed
    # the whole model goes to global_step_N/huggingface once (SFTTrainer.save), not also into the actor's directory
    actor.checkpoint = dataclasses.replace(
        config.checkpoint, save_contents=[c for c in config.checkpoint.save_contents if c != "hf_model"])
    for key in ("nnodes", "n_gpus_per_node", "n_cpu_workers_per_node", "ray_address", "device", "project_name",
                "experiment_name"):
        setattr(ppo.trainer, key, getattr(config.trainer, key))
    ppo.trainer.memory_plan = "off"
    ppo.data.train_batch_size = config.data.train_batch_size
    return ppo


def freq_hit(freq, step: int, epoch_end: bool) -> bool:
    return epoch_end if freq == "after_each_epoch" else freq > 0 and step % freq == 0


def total_steps(config: SFTConfig, rows: int) -> int:
    """The run's steps (the PPO trainer's rule, steps_within_epochs): an epoch is the whole batches of `rows`
    conversations."""
    from pyrl.trainer.ppo_trainer import steps_within_epochs  # lazy: the trainer's modules load torch

    batch = config.data.train_batch_size
    return steps_within_epochs(config.trainer, rows // batch,
                               f"{rows} conversations, data.train_batch_size={batch}")


class SFTTrainer:
    """The loop: per step a batch of conversations, balanced over the ranks, one optimizer step; validation and
    checkpoints on their schedules and at the last step; resume from the newest intact checkpoint. train, val: the
    conversations' (input_ids, loss_mask) lists (tokenized)."""

    def __init__(self, config: SFTConfig, workers, tokenizer, train, val):
        from pyrl.data.dataset import StatefulSampler  # lazy: torch

        self.config, self.workers, self.train, self.val = config, workers, train, val
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        data, trainer = config.data, config.trainer
        # every epoch reshuffled, as verl's DistributedSampler(shuffle=True) (data.shuffle is the subset's)
        self.sampler = StatefulSampler(len(train), data.train_batch_size, True, trainer.seed)
        self.steps_per_epoch = self.sampler.batches_per_epoch
        self.total_steps = total_steps(config, len(train))
        self.run_dir = os.path.abspath(trainer.default_local_dir)
        self.global_step, self.total_tokens = 0, 0

    def batch(self, samples, indices):
        """The conversations as the actor's batch, balanced over the ranks; a count that does not split over them
        (validation's last batch) is made up with copies of the first conversation that carry no loss."""
        # lazy: the trainer's modules load torch
        from pyrl.data.sft_dataset import sft_batch
        from pyrl.trainer.ppo_trainer import balance_batch

        chosen = [samples[i] for i in indices]
        chosen += [(chosen[0][0], [0] * len(chosen[0][0]))] * (-len(chosen) % self.workers.world_size)
        batch = sft_batch(chosen, self.pad)
        if self.config.trainer.balance_batch:
            balance_batch(batch, self.workers.world_size)
        return batch

    def validate(self) -> dict:
        """val/loss: the token mean over the whole validation set (each batch's loss weighted by its tokens)."""
        size = self.config.data.train_batch_size
        total, tokens = 0.0, 0
        for start in range(0, len(self.val), size):
            batch = self.batch(self.val, range(start, min(start + size, len(self.val))))
            batch_tokens = int(batch.batch["response_mask"].sum())
            out = self.workers.actor.eval_sft(batch)
            total += reduce_metrics(out.meta_info["metrics"])["val/loss"] * batch_tokens
            tokens += batch_tokens
        return {"val/loss": total / max(tokens, 1)}

    def step_dir(self) -> str:
        from pyrl.trainer import checkpoints  # lazy: torch

        return checkpoints.step_dir(self.run_dir, self.global_step)

    def save(self) -> None:
        from pyrl.trainer import checkpoints  # lazy: torch

        step_dir = self.step_dir()
        shutil.rmtree(step_dir, ignore_errors=True)
        os.makedirs(step_dir)
        self.workers.actor.save_checkpoint(os.path.join(step_dir, "actor"))
        if "hf_model" in self.config.checkpoint.save_contents:
            self.workers.actor.export_hf(os.path.join(step_dir, "huggingface"))
        checkpoints.save_trainer_state(step_dir, {"global_steps": self.global_step,
                                                  "sampler": self.sampler.state_dict(),
                                                  "total_tokens": self.total_tokens})
        checkpoints.commit(self.run_dir, self.global_step, self.config.trainer.max_ckpt_to_keep, None)

    def resume(self) -> None:
        """From the checkpoint trainer.resume_mode picks; metrics.jsonl keeps the steps up to it (a fresh start in a
        used run directory starts it afresh)."""
        # lazy: loaded with the run
        from pyrl.trainer import checkpoints
        from pyrl.trainer.tracking import truncate_metrics

        trainer = self.config.trainer
        # verl 0.9.1's SFT trainer: auto with a resume_from_path resumes from that path (its PPO trainer's auto
        # ignores it)
        mode = "resume_path" if trainer.resume_mode == "auto" and trainer.resume_from_path else trainer.resume_mode
        path = checkpoints.to_resume(self.run_dir, mode, trainer.resume_from_path if mode == "resume_path" else None)
        if path is None:
            truncate_metrics(self.run_dir, -1)
            return
        state = checkpoints.load_trainer_state(path)
        self.workers.actor.load_checkpoint(os.path.join(path, "actor"))
        self.global_step, self.total_tokens = state["global_steps"], state["total_tokens"]
        self.sampler.load_state_dict(state["sampler"])
        truncate_metrics(self.run_dir, self.global_step)
        log.info("resumed from %s (step %d)", path, self.global_step)

    def fit(self, tracker, after_save=None) -> dict:
        """after_save(step, step_dir) -> stop: called after each checkpoint is written; a true answer ends the run
        there (pyrl's warm-starts stop at a greedy validation target this way, pyrl.models.warm_start)."""
        trainer = self.config.trainer
        last = {}
        while self.global_step < self.total_steps:
            indices = self.sampler.next_batch()
            epoch = self.sampler.epoch
            self.global_step += 1
            start = time.perf_counter()
            batch = self.batch(self.train, indices)
            out = self.workers.actor.train_sft(batch)
            metrics = reduce_metrics(out.meta_info["metrics"])  # the ranks' values (all-reduced: the same)
            tokens = int(batch.batch["attention_mask"].sum())
            self.total_tokens += tokens
            metrics = {"train/loss": metrics["train/loss"], "train/grad_norm": metrics["train/grad_norm"],
                       "train/lr": metrics["train/lr"], "train/mfu": metrics["perf/mfu/train"],
                       "train/global_tokens": tokens, "train/total_tokens(B)": self.total_tokens / 1e9,
                       "train/epoch": epoch, "timing_s/step": time.perf_counter() - start,
                       **{k: v for k, v in metrics.items() if k.startswith("perf/") and "mfu" not in k}}
            is_last = self.global_step >= self.total_steps
            # the sampler's next batch would start the next epoch (it drops the last partial batch)
            epoch_end = self.sampler.position + self.sampler.batch_size > self.sampler.size
            if self.val is not None and (is_last or freq_hit(trainer.test_freq, self.global_step, epoch_end)):
                metrics.update(self.validate())
            tracker.log(metrics, self.global_step)
            last = metrics
            if is_last or freq_hit(trainer.save_freq, self.global_step, epoch_end):
                self.save()
                if after_save is not None and after_save(self.global_step, self.step_dir()):
                    break
        return last


def tokenized(dataset, num_workers: int) -> list:
    """Every conversation's (input_ids, loss_mask), once, before any worker starts (a bad row stops the run here,
    named), in data.num_workers processes (at most one per core and per 64 rows; 0: this process)."""
    import torch  # lazy: torch loads with the data

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(num_workers, len(dataset) // 64, cores)
    if workers:  # the tokenizer's own threads do not survive the fork
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=workers, collate_fn=list)
    return [sample for chunk in loader for sample in chunk]


def run_sft(config: SFTConfig, after_save=None) -> dict:
    """The whole SFT run; returns the last step's metrics. after_save: SFTTrainer.fit's."""
    # lazy: torch, Ray and the models load only when a run starts
    from pyrl.data.sft_dataset import MultiTurnSFTDataset
    from pyrl.models import resolve_model_path
    from pyrl.trainer.checks import check_vocabulary, model_config_with_overrides
    from pyrl.trainer.run_plan import sft_run_plan
    from pyrl.trainer.tracking import Tracking
    from pyrl.trainer.workers import build_workers
    from pyrl.workers.models import load_tokenizer

    check_sft_config(config)
    unwrap_model_config(config.model, "model")
    for key in ("train_files", "val_files"):  # pyrl:toy_addition_sft[:split], a built-in task's conversations
        value = getattr(config.data, key)
        if isinstance(value, str) and value.startswith("pyrl:"):
            setattr(config.data, key, ppo_module.builtin_task_file(value, f"data.{key}",
                                                                   "train" if key == "train_files" else "val")[0])
    config.model.path = resolve_model_path(os.path.expanduser(config.model.path), "model.path")
    if config.model.tokenizer_path:
        config.model.tokenizer_path = resolve_model_path(config.model.tokenizer_path, "model.tokenizer_path")
    ppo = ppo_config_of(config)
    plan = sft_run_plan(ppo)
    log.info("%s", plan.describe())
    tokenizer = load_tokenizer(ppo.actor_rollout_ref.model)
    # the model's config as the workers will build it, checked before they start (as check_models does for RL)
    check_vocabulary("model", config.model, model_config_with_overrides("model", config.model), tokenizer)
    data = config.data
    if data.seed is None:
        data.seed = config.trainer.seed
    train = tokenized(MultiTurnSFTDataset(data.train_files, tokenizer, data, max_samples=data.train_max_samples,
                                          chat_template=config.model.custom_chat_template), data.num_workers)
    val = tokenized(MultiTurnSFTDataset(data.val_files, tokenizer, data, max_samples=data.val_max_samples,
                                        chat_template=config.model.custom_chat_template),
                    data.num_workers) if data.val_files else None
    if len(train) < data.train_batch_size:
        raise ValueError(f"data.train_batch_size={data.train_batch_size}: the training set has {len(train)} rows")
    if data.train_batch_size % plan.world_size:
        raise ValueError(f"data.train_batch_size={data.train_batch_size} does not split over the {plan.world_size} "
                         f"ranks")
    steps = total_steps(config, len(train))  # checked before any worker starts
    optim = ppo.actor_rollout_ref.actor.optim
    if optim.total_training_steps < 0:  # the LR schedule spans the run unless set (as the PPO trainer's)
        optim.total_training_steps = steps
    ppo_module.WORKERS_STARTED = True
    with build_workers(ppo, plan) as workers:
        trainer = SFTTrainer(config, workers, tokenizer, train, val)
        trainer.resume()
        tracker = Tracking(config.trainer.logger, trainer.run_dir, config.trainer.project_name,
                           config.trainer.experiment_name, OmegaConf.to_container(OmegaConf.structured(config)),
                           trainer.total_steps, initial_step=trainer.global_step, columns=CONSOLE_COLUMNS)
        try:
            return trainer.fit(tracker, after_save)
        finally:
            tracker.close()


def compose_sft_config(overrides: list[str]) -> SFTConfig:
    """The config `python -m pyrl.trainer.sft_trainer OVERRIDES` runs with (Hydra's composition, checked against
    the schema), for a run started from Python: `run_sft(compose_sft_config([...]))`."""
    overrides = plus_dropped_for_known(list(overrides), SFTConfig)  # verl's +key= spellings, as schema_cli
    with initialize_config_module("pyrl.configs", version_base=None):
        return typed_config(compose("sft_trainer_engine", overrides=overrides), SFTConfig)


@hydra.main(config_path="pkg://pyrl.configs", config_name="sft_trainer_engine", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[pyrl] %(message)s")
    run_sft(typed_config(cfg, SFTConfig))


def cli() -> int | None:
    return ppo_module.schema_cli(main, SFTConfig)  # verl's +key= spellings (+data.shuffle=...) name keys it has


if __name__ == "__main__":
    sys.exit(cli())
