"""The typed config tree, with verl's key names (verl's `_generated_ppo_trainer.yaml`).

Hydra merges configs/ppo_trainer.yaml and the command line onto these dataclasses, so an unknown key or
a value of the wrong type stops the run at start with a message naming the key. Workers receive the
dataclass objects themselves (`OmegaConf.to_object`), so they read plain attributes.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from pyrl.verl_features import NotImplementedFeature, Unsupported, feature_of, no_effect

log = logging.getLogger("pyrl")


@dataclass
class OptimConfig:
    optimizer: str = "AdamW"
    lr: float = 1e-6
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1  # <= 0: lr_warmup_steps_ratio x total_training_steps
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    warmup_style: Optional[str] = None  # verl 0.9.1's deprecated spelling of lr_scheduler_type, copied there at start
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # set by the trainer
    clip_grad: float = 1.0  # the gradient norm's bound (verl 0.9.1's engine clips with it)


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    model_dtype: str = "fp32"  # the sharded master parameters
    dtype: str = "bfloat16"  # compute dtype (mixed precision): on CUDA, and on CPUs with native bf16 (else model_dtype)
    # verl 0.9.1's FSDP engine's: param_dtype is its compute dtype (it reads dtype nowhere); taken into dtype at start
    mixed_precision: dict = field(default_factory=dict)
    forward_only: bool = False
    ulysses_sequence_parallel_size: int = 1  # verl's; LIMITS: 1 (Ulysses is not implemented)


@dataclass
class CheckpointConfig:
    save_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list = "${.save_contents}"  # type: ignore[assignment]


@dataclass
class ModelConfig:
    # a local HF model directory, a hub id, pyrl:tiny or pyrl:tiny-toy-sft; empty (no model given, with no data given:
    # the toy preset)
    path: str = ""
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    use_shm: bool = False  # each node loads the model from its copy in shared memory (pyrl.models.hub.shm_copy)
    use_remove_padding: bool = True
    # null (pyrl's default for the actor and critic; verl's is true): resolved at start by the memory plan
    # (pyrl.trainer.memory_plan.resolve_gradient_checkpointing): off where every phase fits in half the memory
    # without it. A worker given null (built outside a run) recomputes, as verl does (recomputes)
    enable_gradient_checkpointing: Optional[bool] = None
    # true: log-probs from hidden states without [tokens, vocab] logits; null (pyrl's default; verl's is false): true
    # for the actor and reference, which have an LM head, false for the critic and reward model
    # (pyrl.ppo.resolve_fast_paths)
    use_fused_kernels: Optional[bool] = None
    override_config: dict = field(default_factory=dict)
    custom_chat_template: Optional[str] = None  # a Jinja chat template used instead of the tokenizer's
    # LoRA through PEFT (pyrl/workers/lora.py), verl's keys: rank 0 trains the whole model
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # PEFT's: all-linear, a module name list, or a regex
    exclude_modules: Any = None
    lora_adapter_path: Optional[str] = None  # a PEFT adapter directory to start from (trainable)


def unwrap_model_config(model: ModelConfig, key: str) -> None:
    """verl 0.9.1 takes override_config.model_config, where given, as the Hugging Face config's overrides (its
    Megatron-shaped spelling); pyrl reads them there too. Other entries beside it, which verl then ignores, are
    refused."""
    overrides = dict(model.override_config or {})
    if "model_config" not in overrides:
        return
    others = sorted(set(overrides) - {"model_config"})
    if others:
        raise ValueError(f"{key}.override_config: {others} beside model_config, which verl 0.9.1 would ignore; put "
                         f"them inside {key}.override_config.model_config")
    model.override_config = dict(overrides["model_config"] or {})


def engine_max_model_len(rollout) -> int:
    """The longest sequence a rollout engine admits (a RolloutConfig or a served reward model's rollout section):
    rollout.max_model_len, else prompt_length + response_length."""
    return rollout.max_model_len or rollout.prompt_length + rollout.response_length


def recomputes(model: ModelConfig) -> bool:
    """Whether the model's backward recomputes each layer's forward (model.enable_gradient_checkpointing); null,
    unresolved, is verl's default: it does."""
    return model.enable_gradient_checkpointing is not False


def is_on_policy(actor_config, rollout_n: int, rows: int) -> bool:
    """Whether an update of `rows` samples takes exactly one optimizer step on each (one epoch, one mini-batch),
    so that its old log-probs equal its own."""
    return actor_config.ppo_epochs == 1 and actor_config.ppo_mini_batch_size * rollout_n >= rows


@dataclass
class RolloutCorrectionConfig:
    """verl 0.9.1's algorithm.rollout_correction: correcting for the rollout engine's log-probs differing from the
    trainer's (pyrl.algos.rollout_correction; needs actor_rollout_ref.rollout.calculate_log_probs)."""

    rollout_is: Optional[str] = None  # token | sequence: importance weights pi / mu into the policy loss
    rollout_is_threshold: Any = 2.0  # U (truncate at U) or "L_U" (zero outside [L, U])
    rollout_rs: Optional[str] = None  # rejection options, comma-separated (token_k1, seq_mean_k3, ...)
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False  # the rollout's log-probs are the old ones: no old-log-prob pass, loss bypass_mode
    loss_type: str = "ppo_clip"  # bypass_mode's loss: ppo_clip | reinforce
    rollout_is_batch_normalize: bool = False


@dataclass
class PolicyLossConfig:
    """verl 0.9.1's actor.policy_loss: the loss's name and the options of the losses that read them."""

    loss_mode: str = "vanilla"  # a pyrl.algos.POLICY_LOSS_REGISTRY name
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: candidates have lb < covariance < ub
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens (top covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of |log ratio| on those tokens
    dro_beta: Optional[float] = None  # dro: quadratic log-ratio penalty, required (> 0) by loss_mode=dro
    # not a key to set: pyrl copies algorithm.rollout_correction here at start for the bypass_mode loss (as verl's
    # apply_bypass_mode does)
    rollout_correction: Optional[RolloutCorrectionConfig] = None


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # fsdp | fsdp2: both run FSDP2
    ppo_mini_batch_size: int = 256  # prompts; x rollout.n inside the worker
    ppo_micro_batch_size: Optional[int] = None  # deprecated (verl): global, / data-parallel ranks at start
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
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's divisor (None: the response width)
    entropy_coeff: float = 0.0
    tau_pos: float = 1.0  # sapo: gate temperature where A > 0
    tau_neg: float = 1.05  # sapo: gate temperature where A <= 0
    calculate_entropy: bool = False
    # the old-log-prob pass also returns sum_pi_squared [B, R] (sum over the vocabulary of pi^2), which the
    # optimal-token-baseline estimators need
    calculate_sum_pi_squared: bool = False
    use_kl_loss: bool = False
    # each prompt's tokens run once for all its samples in the actor's and the reference's forwards (needs
    # model.use_remove_padding); the batch is balanced by prompt group so samples of a prompt stay together.
    # null (pyrl's default; verl's is false): true when rollout.n > 1 and model.use_remove_padding (resolve_fast_paths)
    use_prefix_grouper: Optional[bool] = None
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    grad_clip: float = 1.0  # read nowhere by verl 0.9.1 (its engine clips at optim.clip_grad): limited
    ulysses_sequence_parallel_size: int = 1
    data_loader_seed: int = 42
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class RefConfig:
    strategy: str = "${actor_rollout_ref.actor.strategy}"
    log_prob_micro_batch_size: Optional[int] = None  # deprecated (verl): global, / data-parallel ranks at start
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ulysses_sequence_parallel_size: int = "${oc.select:actor_rollout_ref.actor.ulysses_sequence_parallel_size,1}"  # type: ignore[assignment]
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(forward_only=True))


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = False


@dataclass
class CustomClassConfig:
    """A class loaded from a Python file: path to the file, name of the class (or function)."""

    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class MultiTurnConfig:
    """verl 0.9.1's rollout.multi_turn: the tool agent loop's turns, tools and limits
    (pyrl/workers/rollout/agent_loop.py)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None: until no tool is called or the response budget is spent
    tool_config_path: Optional[str] = None  # verl's YAML: tools: [{class_name, config, tool_schema}]
    function_tool_path: Optional[str] = None  # a Python file of plain functions, each a tool
    max_user_turns: Optional[int] = None  # tool-response and interaction turns
    max_parallel_calls: int = 1  # calls run per assistant turn (the rest are dropped, as verl)
    max_tool_response_length: int = 256  # characters of a tool's text kept
    tool_response_truncate_side: str = "middle"  # left | right | middle
    use_inference_chat_template: bool = False
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"  # the tool-call parser (pyrl/workers/rollout/tool_parser.py)
    num_repeat_rollouts: Optional[int] = None
    # earlier verl's key (0.9.1 dropped interactions): YAML interaction: [{name, class_name, config}]
    interaction_config_path: Optional[str] = None
    tool_timeout_s: float = 60.0  # pyrl's: a call still running after this is answered with an error


@dataclass
class AgentLoopConfig:
    """verl 0.9.1's rollout.agent: which loop runs a sample (its agent_name column, else default_agent_loop)."""

    num_workers: int = 8
    default_agent_loop: str = "single_turn_agent"  # single_turn_agent | tool_agent | a loop the file below names
    agent_loop_config_path: Optional[str] = None
    custom_async_server: CustomClassConfig = field(default_factory=CustomClassConfig)


@dataclass
class CheckpointEngineConfig:
    """verl 0.9.1's rollout.checkpoint_engine: how the actor's weights reach the rollout engines. pyrl moves them
    itself (LIMITS): in-process into each actor rank's own engine with the hybrid engine (verl's naive), and without
    it the actor ranks gather the whole weights, rank 0 puts them in Ray's object store once and every rollout
    worker loads them (where verl 0.9.1's one_step_off_ppo_trainer names nccl)."""

    backend: str = "naive"
    update_weights_bucket_megabytes: int = 2048
    engine_kwargs: dict = field(default_factory=dict)
    custom_backend_module: Optional[str] = None


@dataclass
class RolloutConfig:
    name: str = "vllm"  # vllm | hf
    mode: str = "async"  # async only: verl 0.9.1 removed sync (pyrl generates in-process)
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    ignore_eos: bool = False
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    dtype: str = "bfloat16"  # the engine's weights and compute; a CPU without native bf16 runs float32
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    free_cache_engine: bool = True
    # verl's: gather LoRA-merged weights layer by layer for the push (LIMITS: pyrl's push always gathers one tensor
    # at a time, which bounds the memory at least as tightly)
    layered_summon: bool = False
    load_format: str = "dummy"  # dummy: random weights until the actor's first push
    logprobs_mode: str = "processed_logprobs"
    # verl's: options for the engine named by `name` (vllm: vllm.LLM's keywords, over pyrl's own as in verl; a
    # null value is dropped); another engine's non-empty section stops the run
    engine_kwargs: dict = field(default_factory=lambda: {"vllm": {}, "sglang": {}, "trtllm": {}})
    calculate_log_probs: bool = True
    log_prob_micro_batch_size: Optional[int] = None  # deprecated (verl): global, / data-parallel ranks at start
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    seed: int = 42
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)


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
    strategy: str = "fsdp"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="${actor_rollout_ref.model.path}"))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size: Optional[int] = None  # deprecated (verl): global, / data-parallel ranks at start
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    forward_micro_batch_size: Optional[int] = "${oc.select:critic.ppo_micro_batch_size,null}"  # type: ignore[assignment]
    forward_micro_batch_size_per_gpu: Optional[int] = "${critic.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"  # type: ignore[assignment]
    # seq-mean-token-sum-norm's divisor (None: the response width)
    loss_scale_factor: Optional[float] = "${actor_rollout_ref.actor.loss_scale_factor}"  # type: ignore[assignment]
    grad_clip: float = 1.0  # read nowhere by verl 0.9.1 (its engine clips at optim.clip_grad): limited
    ulysses_sequence_parallel_size: int = 1  # verl's; LIMITS: 1
    data_loader_seed: int = 42
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # verl 0.9.1's name (actor and ref: fsdp_config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # a Python file
    name: Optional[str] = "compute_score"  # the function in it
    reward_kwargs: dict = field(default_factory=dict)  # bound to the function as keywords


@dataclass
class RewardManagerConfig:
    """verl 0.9.1's reward.reward_manager: which manager scores the responses."""

    source: str = "register"  # pyrl's registered managers (verl's importlib source: a class of verl's own API)
    name: str = "naive"  # naive | dapo | batch | gdpo | rate_limited | remote
    module: CustomClassConfig = field(default_factory=lambda: CustomClassConfig(name="custom_reward_manager"))


@dataclass
class DisaggregationConfig:
    """verl 0.9.1's rollout.disaggregation (prefill/decode on separate replicas; LIMITS: off)."""

    enabled: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    decode_tensor_model_parallel_size: Optional[int] = None
    transfer_backend: str = "nixl"
    bootstrap_port: Optional[int] = None
    ib_device: Optional[str] = None


@dataclass
class RewardModelRolloutConfig:
    """verl 0.9.1's reward.reward_model.rollout: the engine a served reward model runs behind
    (pyrl.workers.reward_server), with verl's defaults. name null: pyrl's FSDP scorer instead
    (pyrl.workers.reward_model, configured by the reward_model.* section); verl has no such mode and requires a
    name."""

    name: Optional[str] = None  # vllm | hf: served; null: pyrl's FSDP sequence-classification worker
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: Optional[list] = None
    free_cache_engine: bool = True  # asleep (KV cache freed, weights off the GPU) outside the reward step
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    layered_summon: bool = False
    scheduling_policy: str = "fcfs"
    full_determinism: bool = False
    seed: int = 42
    multi_stage_wake_up: bool = False
    engine_kwargs: dict = field(default_factory=dict)
    limit_images: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False
    ignore_eos: bool = False
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    prompt_length: int = 2048
    response_length: int = 2048
    quantization: Optional[str] = None
    quantization_config_file: Optional[str] = None
    mtp: Optional[dict] = None
    disaggregation: DisaggregationConfig = field(default_factory=lambda: DisaggregationConfig())


@dataclass
class LegacyRewardModelRolloutConfig:
    """verl 0.9.1's legacy reward_model.rollout.* (null: not given); moved to reward.reward_model.rollout at start."""

    name: Optional[str] = None
    dtype: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None
    enforce_eager: Optional[bool] = None
    cudagraph_capture_sizes: Optional[list] = None
    free_cache_engine: Optional[bool] = None
    data_parallel_size: Optional[int] = None
    expert_parallel_size: Optional[int] = None
    tensor_model_parallel_size: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    load_format: Optional[str] = None
    engine_kwargs: Optional[dict] = None
    limit_images: Optional[int] = None
    enable_chunked_prefill: Optional[bool] = None
    enable_prefix_caching: Optional[bool] = None
    disable_log_stats: Optional[bool] = None
    skip_tokenizer_init: Optional[bool] = None
    prompt_length: Optional[int] = None
    response_length: Optional[int] = None


@dataclass
class RewardModelSwitchConfig:
    """verl 0.9.1's reward.reward_model: whether a model scores the responses, which, and (rollout.name set) the
    engine and pool that serve it; with rollout.name null pyrl's FSDP scorer runs it (the reward_model.* section)."""

    enable: bool = False
    # the served model's own pool: n_gpus_per_node x nnodes devices (CPU runs: that many CPU server processes);
    # false: colocated on the trainer's pool, asleep outside the reward step (rollout.free_cache_engine)
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    model_path: Optional[str] = None
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)


@dataclass
class SandboxFusionConfig:
    """verl 0.9.1's reward.sandbox_fusion: code-execution scoring (pyrl.rewards.code_exec) runs its test cases on
    this Sandbox Fusion server instead of in pyrl.sandbox when url is set."""

    url: Optional[str] = None  # the server's /run_code url
    max_concurrent: int = 64  # requests in flight, over all scoring processes together
    memory_limit_mb: int = 1024  # each test run's memory (the local sandbox's too)


@dataclass
class LocalSandboxConfig:
    """pyrl's reward.sandbox: the local sandbox (pyrl.sandbox) that code-execution scoring runs programs in."""

    # run untrusted programs even where the kernel cannot isolate them (no namespaces or seccomp): the audit hook
    # and resource limits only, one warning logged per process; false (default): such a machine refuses to score
    allow_unisolated: bool = False


@dataclass
class RewardConfig:
    """verl 0.9.1's reward section (its legacy spellings, reward_model.reward_manager, custom_reward_function,
    reward_model.enable / model.path / overlong_buffer, are moved here at start as verl's migrate_legacy_reward_impl
    does)."""

    num_workers: int = 8  # processes scoring a batch's samples in parallel (1: in the driver)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_model: RewardModelSwitchConfig = field(default_factory=RewardModelSwitchConfig)
    # the manager's options; dapo: overlong_buffer_cfg {enable, len, penalty_factor} and max_resp_len
    reward_kwargs: dict = field(default_factory=dict)
    strict: bool = False  # pyrl: a scorer that raises or times out stops the run instead of scoring 0
    timeout_s: float = 10.0  # pyrl: per-sample scorer time limit (every manager but rate_limited)
    # verl 0.9.1's rate_limited manager reads these from reward.* with these defaults (its yaml does not list them:
    # verl command lines add them, +reward.max_rpm=...): calls at once, requests and tokens per minute (null: no
    # limit), the tokens one call counts against max_tpm, and each call's time limit in seconds (null: none)
    max_concurrent: int = 1
    max_rpm: Optional[int] = None
    max_tpm: Optional[int] = None
    estimated_tokens_per_request: int = 2000
    timeout: Optional[float] = 300.0
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    sandbox: LocalSandboxConfig = field(default_factory=LocalSandboxConfig)


@dataclass
class RewardModelConfig:
    """The reward model worker (pyrl's FSDP sequence-classification scorer). enable, reward_manager,
    overlong_buffer and model.path are verl's legacy spellings of reward.* keys (None / empty: not given)."""

    enable: Optional[bool] = None
    strategy: str = "fsdp2"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="", enable_gradient_checkpointing=False))
    micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # type: ignore[assignment]
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # type: ignore[assignment]
    reward_manager: Optional[str] = None
    num_workers: Optional[int] = None  # verl's legacy spelling of reward.num_workers
    # verl's legacy spellings of reward.reward_model.{enable_resource_pool, n_gpus_per_node, nnodes, rollout.*}
    enable_resource_pool: Optional[bool] = None
    n_gpus_per_node: Optional[int] = None
    nnodes: Optional[int] = None
    rollout: LegacyRewardModelRolloutConfig = field(default_factory=LegacyRewardModelRolloutConfig)
    # verl's DAPO recipe spelling of reward.reward_kwargs.overlong_buffer_cfg (moved there when enabled)
    overlong_buffer: dict = field(default_factory=lambda: {"enable": False, "len": 0, "penalty_factor": 1.0})
    # verl's DAPO scripts' `+reward_model.reward_kwargs.*` (overlong_buffer_cfg, max_resp_len): moved to
    # reward.reward_kwargs at start (verl 0.9.1's main_ppo drops them; only its fully-async entry moves them)
    reward_kwargs: dict = field(default_factory=dict)
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
    metric: str = "reward"  # reward: the sequence score; another name: that reward_extra_info field
    max_num_gen_batches: int = 0  # <= 0: no limit


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
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # gdpo: the reward components (fields of the dicts compute_score returns) normalized within each group one
    # by one before their weighted sum; weights default to 1 each
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None


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
    # verl's: prompts per generation batch; dynamic sampling (algorithm.filter_groups) generates batches of this
    # many until train_batch_size prompts with varied rewards are kept. None: train_batch_size
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None
    return_raw_chat: bool = True
    shuffle: bool = True
    seed: Optional[int] = None  # None: 0, every run the same order (verl's unseeded generator is a constant seed)
    dataloader_num_workers: int = 8
    filter_overlong_prompts: bool = False
    truncation: str = "error"  # error | left | right | middle
    apply_chat_template: bool = True
    apply_chat_template_kwargs: dict = field(default_factory=dict)  # e.g. {enable_thinking: false}
    train_max_samples: int = -1  # > 0: that many rows (a seeded random subset when shuffling)
    val_max_samples: int = -1
    # a Dataset class (verl's constructor: data_files, tokenizer, processor, config, max_samples) whose items are
    # verl's dicts with raw_prompt
    custom_cls: CustomClassConfig = field(default_factory=CustomClassConfig)
    # the tools' schemas reach the chat template (tools=) when prompts are tokenized, as the agent loop sees them
    tool_config_path: Optional[str] = "${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path,null}"
    function_tool_path: Optional[str] = "${oc.select:actor_rollout_ref.rollout.multi_turn.function_tool_path,null}"
    # batch generation's output parquet (python -m pyrl.trainer.main_generation_server; verl's command lines add it as
    # +data.output_path); the PPO trainer refuses it
    output_path: Optional[str] = None


@dataclass
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    logger: Any = field(default_factory=lambda: ["console", "wandb"])
    log_val_generations: int = 0  # validation samples shown per validation (console, wandb, tensorboard)
    rollout_data_dir: Optional[str] = None  # every training sample of step k -> DIR/k.jsonl
    validation_data_dir: Optional[str] = None  # every validation sample -> DIR/k.jsonl
    nnodes: int = 1
    n_gpus_per_node: int = -1  # -1: the GPUs this machine has, 0 (no GPU) meaning CPU workers on gloo
    n_cpu_workers_per_node: int = 1  # worker processes per node when n_gpus_per_node is 0
    # join this Ray cluster (auto, host:port); None: $RAY_ADDRESS, else a private local one
    ray_address: Optional[str] = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    critic_warmup: int = 0
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None  # older checkpoints keep their actor but lose their critic/
    device: str = "auto"  # auto | cuda | cpu
    # pyrl's: before workers start, each phase's peak memory per rank is estimated from the model config and the
    # batch settings (pyrl/trainer/memory_plan.py) and logged; check: a phase over the device's memory (GPU, or
    # on CPU the available RAM per process) stops the run naming the keys to turn; warn: logs that and runs; off: skip
    memory_plan: str = "check"


@dataclass
class RolloutPoolConfig:
    """verl 0.9.1's one-step-off-policy `rollout` section: the rollout's own workers, used with
    actor_rollout_ref.hybrid_engine=false (pyrl.trainer.one_step_off); any other value with the hybrid engine stops
    the run at start."""

    nnodes: int = 1
    # -1: the GPUs this machine has beyond trainer.n_gpus_per_node (verl: 8); 0 (no GPU): CPU workers on gloo
    n_gpus_per_node: int = -1
    n_cpu_workers_per_node: int = 1  # pyrl's, as trainer.n_cpu_workers_per_node: rollout processes per node on CPU


@dataclass
class RayKwargsConfig:
    """verl 0.9.1's ray_kwargs: ray_init is handed to ray.init (free-form, as in verl: num_cpus, runtime_env, and
    whatever else a script adds with +ray_kwargs.ray_init.<key>); timeline_json_file: Ray's task timeline written there
    when the run ends."""

    ray_init: dict = field(default_factory=lambda: {"num_cpus": None, "runtime_env": {"py_executable": None}})
    timeline_json_file: Optional[str] = None


@dataclass
class LegacySandboxFusionConfig:
    """verl's top-level sandbox_fusion, its legacy spelling of reward.sandbox_fusion (moved there at start)."""

    url: Optional[str] = None
    max_concurrent: Optional[int] = None
    memory_limit_mb: Optional[int] = None


@dataclass
class DistillationLossConfig:
    """verl 0.9.1's distillation.distillation_loss (its YAML's defaults; pyrl.algos.distillation has the formulas)."""

    loss_mode: str = "k3"  # forward_kl_topk, or a single-sample estimator: kl | k1 | abs | mse | k2 | low_var_kl | k3
    topk: Optional[int] = 32  # forward_kl_topk's k: the teacher's top-k tokens at each position
    use_task_rewards: bool = True  # the policy loss on the task's advantages + distillation_loss_coef x this loss
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None  # per-token losses clamped to [-c, c]
    log_prob_min_clamp: Optional[float] = None  # forward_kl_topk: both top-k log-probs clamped below at it
    use_policy_gradient: bool = False  # the negative per-token loss as the advantage of a PPO-clip loss
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # verl's dataclass fields its YAML lacks (set with +key=): forward_kl_topk's student log-probs a chunk of
    # chunked_topk_chunk_size tokens at a time (the same numbers)
    use_chunked_topk: bool = False
    chunked_topk_chunk_size: int = 4096


@dataclass
class TeacherInferenceConfig:
    """verl 0.9.1's distillation.teacher_models.<name>.inference: how the teacher is served. In the actor's workers
    (distillation.nnodes=0) dtype is the teacher's compute dtype and max_num_batched_tokens its pass's token budget
    per micro-batch; the server keys keep their defaults (others stop the run at start). In the teachers' own pool
    (pyrl.workers.teacher_server) name picks the engine (vllm, or pyrl's hf) and a vLLM teacher takes verl's server
    keys too (pyrl.algos.distillation.VLLM_POOL_READ). max_model_len, prompt_length and response_length are checked
    as verl."""

    name: Optional[str] = "${oc.select:actor_rollout_ref.rollout.name}"
    dtype: Optional[str] = "${oc.select:actor_rollout_ref.rollout.dtype}"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: Optional[list] = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)
    limit_images: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = True
    prompt_length: Optional[int] = "${oc.select:actor_rollout_ref.rollout.prompt_length}"  # type: ignore
    response_length: Optional[int] = "${oc.select:actor_rollout_ref.rollout.response_length}"  # type: ignore
    temperature: Optional[float] = "${oc.select:actor_rollout_ref.rollout.temperature}"  # type: ignore


@dataclass
class TeacherModelConfig:
    """verl 0.9.1's distillation.teacher_models.<name>: the teacher's model (an HF causal LM sharing the student's
    vocabulary) and how it is served."""

    key: Optional[str] = None  # the routing value of distillation.teacher_key (several teachers)
    model_path: Optional[str] = None
    num_replicas: Optional[int] = 0
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)


@dataclass
class DistillationConfig:
    """verl 0.9.1's on-policy distillation (distillation.*): the student generates, the teacher scores the
    student's tokens, and the actor's loss takes the distillation loss (pyrl.algos.distillation)."""

    enabled: bool = False
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    n_gpus_per_node: int = 8  # the teachers' own pool: n_gpus_per_node x nnodes devices; nnodes=0: none
    nnodes: int = 0
    # entries typed Any: verl's `+distillation.teacher_models.<new>.key=...` adds one key at a time, which Hydra
    # cannot do inside a dict of dataclasses; resolve_teacher_entries makes each a TeacherModelConfig
    teacher_models: dict[str, Any] = field(default_factory=lambda: {"teacher_model": TeacherModelConfig()},
                                           metadata={"entries": TeacherModelConfig})
    teacher_key: str = "data_source"


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # verl's legacy spelling of reward.custom_reward_function
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=lambda: CustomRewardFunctionConfig(name=None))
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    sandbox_fusion: LegacySandboxFusionConfig = field(default_factory=LegacySandboxFusionConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)


FSDP2_STRATEGIES = ("fsdp", "fsdp2")  # verl's FSDP1 and FSDP2 both run FSDP2 here: the same numbers
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")  # always all three; hf_model may be added
CONTENTS_KEYS = tuple(f"{role}.checkpoint.{name}" for role in ("actor_rollout_ref.actor", "critic")
                      for name in ("save_contents", "load_contents"))

# the dtypes a trained model computes and keeps its master weights in: float16 would need loss scaling
TRAINING_DTYPES = ("float32", "fp32", "bfloat16", "bf16")
FLOAT16_TRAINING = ("float16 training needs loss scaling, which pyrl does not implement (verl 0.9.1 adds a "
                    "ShardedGradScaler): bfloat16 keeps float32's range")
# verl keys pyrl accepts so that verl command lines parse, with the values it implements: key -> (allowed values,
# why). Anything else stops the run at start instead of being silently ignored.
LIMITS: dict[str, tuple[tuple, str]] = {
    **{f"{section}.{key}": (TRAINING_DTYPES, FLOAT16_TRAINING)
       for section in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp") for key in ("dtype", "model_dtype")},
    "reward.reward_manager.source": (("register",), "pyrl's registered managers: naive, dapo, batch, gdpo, "
                                                    "rate_limited, remote (verl's importlib managers are classes of "
                                                    "verl's own reward-loop API)"),
    "reward.reward_manager.module.path": ((None,), "only with reward.reward_manager.source=importlib"),
    "reward.reward_manager.module.name": (("custom_reward_manager",),
                                          "only with reward.reward_manager.source=importlib"),
    # the critic and the reward model score the actor's tokens: no LM head, no chat template of their own
    **{f"{role}.use_fused_kernels": ((False, None), "no LM head: nothing to fuse") for role in ("critic.model",
                                                                                           "reward_model.model")},
    **{f"{role}.custom_chat_template": ((None,), "the prompts are the actor's (actor_rollout_ref.model."
                                                 "custom_chat_template)")
       for role in ("critic.model", "reward_model.model")},
    "actor_rollout_ref.rollout.layered_summon": ((False, True), "either way the push gathers one tensor at a time"),
    # verl's weight transports (pyrl.config.CheckpointEngineConfig): pyrl's own push stands for naive (the hybrid
    # engine's in-process load) and nccl (to separate rollout workers, through Ray's object store)
    "actor_rollout_ref.rollout.checkpoint_engine.backend": (
        ("naive", "nccl"), "pyrl pushes the weights itself: in-process with the hybrid engine, through Ray's object "
                           "store to the rollout's own workers without it; verl's nixl, hccl, mooncake, "
                           "kimi_ckpt_engine and delta_sharded transports are not implemented"),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": (
        (2048,), "pyrl's push moves one whole tensor at a time, not buckets"),
    "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs": (({},), "options of verl's transport backends; "
                                                                         "pyrl's push has none"),
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": (
        (None,), "verl's pluggable transports (CheckpointEngineRegistry) are not implemented"),
    # verl's reward model has no LoRA keys: it never trains
    **{f"reward_model.model.{key}": ((value,), "the reward model never trains")
       for key, value in (("lora_rank", 0), ("lora_alpha", 16), ("target_modules", "all-linear"),
                          ("exclude_modules", None), ("lora_adapter_path", None))},
    "data.tokenizer": ((None,), "verl 0.9.1 reads it nowhere either; the tokenizer is "
                                "actor_rollout_ref.model.tokenizer_path, else the model's own"),
    "actor_rollout_ref.actor.strategy": (FSDP2_STRATEGIES, "Megatron is not implemented"),
    "actor_rollout_ref.ref.strategy": (FSDP2_STRATEGIES, "Megatron is not implemented"),
    "critic.strategy": (FSDP2_STRATEGIES, "Megatron is not implemented"),
    "reward_model.strategy": (FSDP2_STRATEGIES, "Megatron is not implemented"),
    "actor_rollout_ref.rollout.mode": (("async",), "verl 0.9.1 removed rollout mode 'sync' (its error: set mode=async "
                                                 "or remove the setting)"),
    **{f"{section}.grad_clip": ((1.0,), f"verl 0.9.1 reads it nowhere: its engine clips the gradient norm at "
                                        f"{section}.optim.clip_grad; set that")
       for section in ("actor_rollout_ref.actor", "critic")},
    "trainer.resume_mode": (("auto", "disable", "resume_path"), "verl 0.9.1's three modes"),
    # refused under every key that names it, as verl 0.9.1 has them
    **{key: ((1,), "Ulysses sequence parallelism is not implemented") for key in (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
        "critic.fsdp.ulysses_sequence_parallel_size",
        "reward_model.fsdp_config.ulysses_sequence_parallel_size")},
    # forward_only says which models train: the actor and critic do, the reference and reward model never
    "actor_rollout_ref.actor.fsdp_config.forward_only": ((False,), "the actor trains"),
    "critic.fsdp.forward_only": ((False,), "the critic trains"),
    "actor_rollout_ref.ref.fsdp_config.forward_only": ((True,), "the reference model never trains"),
    "reward_model.fsdp_config.forward_only": ((True,), "the reward model never trains"),
    # and so keep no optimizer state, nor activations to recompute in a backward pass
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": ((False,), "the reference model has no optimizer"),
    "reward_model.fsdp_config.optimizer_offload": ((False,), "the reward model has no optimizer"),
    "reward_model.model.enable_gradient_checkpointing": ((False,), "the reward model has no backward pass"),
    # the agent loop keeps the model's own tokens and renders only the appended messages, so there is no second
    # tokenization to check or to choose a template for; verl 0.9.1 reads these nowhere either
    **{f"actor_rollout_ref.rollout.multi_turn.{key}": ((value,), "verl 0.9.1 reads it nowhere either")
       for key, value in (("use_inference_chat_template", False), ("tokenization_sanity_check_mode", "strict"),
                          ("num_repeat_rollouts", None))},
    **{f"actor_rollout_ref.rollout.agent.custom_async_server.{key}": ((None,), "pyrl's engines run in the rollout "
                                                                               "workers, not behind a server")
       for key in ("path", "name")},
    # a served reward model (pyrl.workers.reward_server): a replica split by tensor parallelism alone, the
    # checkpoint's own weights
    "reward.reward_model.rollout.name": ((None, "vllm", "hf"), "pyrl serves a reward model with vllm or hf (null: "
                                                               "pyrl's FSDP scorer)"),
    **{f"reward.reward_model.rollout.{key}": ((1,), "pyrl splits a served reward model's replica by tensor "
                                                     "parallelism only (more replicas: more devices in its pool)")
       for key in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size")},
    "reward.reward_model.rollout.n": ((1,), "a served reward model generates one answer per request"),
    **{f"reward.reward_model.rollout.{key}": ((None,), "not implemented for a served reward model")
       for key in ("cudagraph_capture_sizes", "limit_images", "quantization", "quantization_config_file", "mtp")},
    "reward.reward_model.rollout.disaggregation.enabled": ((False,), "prefill/decode disaggregation"),
    **{f"reward.reward_model.rollout.disaggregation.{f.name}": ((f.default,), "prefill/decode disaggregation")
       for f in dataclasses.fields(DisaggregationConfig) if f.name != "enabled"},
    "reward.reward_model.rollout.disable_log_stats": ((True,), "pyrl's engines log no engine statistics"),
    "reward.reward_model.rollout.skip_tokenizer_init": ((False,), "a reward model needs its tokenizer (verl asserts "
                                                                  "it too)"),
    "reward.reward_model.rollout.multi_stage_wake_up": ((False,), "the served reward model wakes in one stage"),
    "reward.reward_model.rollout.layered_summon": ((False,), "a served reward model's weights are never pushed"),
    "reward.reward_model.rollout.scheduling_policy": (("fcfs",), "pyrl's engines serve first come, first served"),
    "reward.reward_model.rollout.full_determinism": ((False,), "not implemented for a served reward model (its "
                                                               "classifier scores each request alone already)"),
    "reward.reward_model.rollout.load_format": (("auto", "safetensors", "pt"), "the served model loads its own "
                                                                               "checkpoint"),
}


ROLLOUT_INTERPOLATED = ("name", "dtype", "prompt_length", "response_length", "temperature")  # TeacherInferenceConfig's


def resolve_teacher_entries(config: PPOConfig) -> None:
    """Teacher entries added on the command line (verl's `+distillation.teacher_models.<name>.key=...`) arrive as
    plain dicts: each becomes a TeacherModelConfig, a key the schema lacks refused by name, its inference defaults
    those of the default entry (name, dtype, prompt_length, response_length, temperature: the rollout's)."""
    rollout = config.actor_rollout_ref.rollout
    for name, entry in list(config.distillation.teacher_models.items()):
        if isinstance(entry, TeacherModelConfig):
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"distillation.teacher_models.{name}: expected a teacher's keys (key, model_path, "
                             f"num_replicas, inference.*), got {entry!r}")
        entry = dict(entry)
        inference = entry.pop("inference", None) or {}
        for keys, schema, where in ((entry, TeacherModelConfig, name), (inference, TeacherInferenceConfig,
                                                                          f"{name}.inference")):
            unknown = unknown_keys(keys, schema, f"distillation.teacher_models.{where}")
            if unknown:
                raise ValueError(describe_unknown(unknown))
        defaults = {key: getattr(rollout, key) for key in ROLLOUT_INTERPOLATED}
        config.distillation.teacher_models[name] = TeacherModelConfig(
            **entry, inference=TeacherInferenceConfig(**{**defaults, **dict(inference)}))


def migrate_legacy_reward(config: PPOConfig) -> None:
    """verl 0.9.1's migrate_legacy_reward_impl: the legacy spellings move to reward.*; one key given both ways
    with different values is an error naming both."""
    reward, legacy = config.reward, config.reward_model

    def move(old_key: str, old, new_key: str, set_new, current) -> None:
        if old is None or old == "":
            return
        default = _value(PPOConfig(), new_key)
        if current != default and current != old:
            raise ValueError(f"{old_key}={old!r} and {new_key}={current!r} disagree: set only {new_key}")
        set_new(old)
        log.info("%s=%r: moved to %s (verl 0.9.1's fully-async entry migrates it so; its main_ppo reads it nowhere)",
                 old_key, old, new_key)

    move("reward_model.reward_manager", legacy.reward_manager, "reward.reward_manager.name",
         lambda v: setattr(reward.reward_manager, "name", v), reward.reward_manager.name)
    move("reward_model.num_workers", legacy.num_workers, "reward.num_workers",
         lambda v: setattr(reward, "num_workers", v), reward.num_workers)
    move("reward_model.enable", legacy.enable, "reward.reward_model.enable",
         lambda v: setattr(reward.reward_model, "enable", v), reward.reward_model.enable)
    move("reward_model.model.path", legacy.model.path, "reward.reward_model.model_path",
         lambda v: setattr(reward.reward_model, "model_path", v), reward.reward_model.model_path)
    old_fn = config.custom_reward_function
    if old_fn.path is not None or old_fn.name is not None or old_fn.reward_kwargs:
        move("custom_reward_function.path", old_fn.path, "reward.custom_reward_function.path",
             lambda v: setattr(reward.custom_reward_function, "path", v), reward.custom_reward_function.path)
        move("custom_reward_function.name", old_fn.name, "reward.custom_reward_function.name",
             lambda v: setattr(reward.custom_reward_function, "name", v), reward.custom_reward_function.name)
        if old_fn.reward_kwargs:
            reward.custom_reward_function.reward_kwargs = {**old_fn.reward_kwargs,
                                                           **reward.custom_reward_function.reward_kwargs}
    if legacy.reward_kwargs:
        for key, value in legacy.reward_kwargs.items():
            if key in reward.reward_kwargs and reward.reward_kwargs[key] != value:
                raise ValueError(f"reward_model.reward_kwargs.{key}={value!r} and reward.reward_kwargs.{key}="
                                 f"{reward.reward_kwargs[key]!r} disagree: set only reward.reward_kwargs.{key}")
        reward.reward_kwargs = {**legacy.reward_kwargs, **reward.reward_kwargs}
    for name in ("url", "max_concurrent", "memory_limit_mb"):
        move(f"sandbox_fusion.{name}", getattr(config.sandbox_fusion, name), f"reward.sandbox_fusion.{name}",
             lambda v, name=name: setattr(reward.sandbox_fusion, name, v), getattr(reward.sandbox_fusion, name))
    if legacy.overlong_buffer.get("enable"):
        if "overlong_buffer_cfg" in reward.reward_kwargs:
            raise ValueError("reward_model.overlong_buffer and reward.reward_kwargs.overlong_buffer_cfg are both set: "
                             "set only reward.reward_kwargs.overlong_buffer_cfg")
        reward.reward_kwargs = {"max_resp_len": config.data.max_response_length, **reward.reward_kwargs,
                                "overlong_buffer_cfg": dict(legacy.overlong_buffer)}
    for name in ("enable_resource_pool", "n_gpus_per_node", "nnodes"):
        move(f"reward_model.{name}", getattr(legacy, name), f"reward.reward_model.{name}",
             lambda v, name=name: setattr(reward.reward_model, name, v), getattr(reward.reward_model, name))
    for name in field_types(LegacyRewardModelRolloutConfig):
        value = getattr(legacy.rollout, name)
        move(f"reward_model.rollout.{name}", value, f"reward.reward_model.rollout.{name}",
             lambda v, name=name: setattr(reward.reward_model.rollout, name, v),
             getattr(reward.reward_model.rollout, name))
    # the worker reads its model where pyrl's reward_model section keeps it
    legacy.model.path = reward.reward_model.model_path or ""


def generation_batch_size(data: "DataConfig") -> int:
    """Prompts each generation batch samples (data.gen_batch_size, else data.train_batch_size)."""
    return data.gen_batch_size or data.train_batch_size


def field_types(schema) -> dict:
    """A config dataclass's field names -> their types, Optional[X] read as X (the schema's one rule for nesting)."""
    types = {}
    for name, kind in typing.get_type_hints(schema).items():
        if typing.get_origin(kind) is typing.Union:
            kind = next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)
        types[name] = kind
    return types


def unknown_keys(cfg, schema=None, path: str = "") -> list[tuple[str, list[str]]]:
    """(key, the field names beside it) for each key of a composed config (a DictConfig or dict) that the schema
    (PPOConfig's dataclasses) does not have. Hydra's `key=value` refuses those itself, but `+key=value` and
    `++key=value` add them to any node; so every composed config is walked: a key is known where its dataclass has
    the field, and anything goes only inside the free-form sections (fields typed dict or Any: override_config,
    engine_kwargs, reward_kwargs, apply_chat_template_kwargs, ray_kwargs.ray_init, ...), as in verl 0.9.1."""
    schema = schema or PPOConfig
    types = field_types(schema)
    found = []
    for key in cfg.keys():
        name = f"{path}.{key}" if path else str(key)
        if key not in types:
            found.append((name, list(types)))
            continue
        value = cfg[key] if not hasattr(cfg, "_get_node") else cfg._get_node(key)
        entries = ENTRY_SCHEMAS.get((schema, key))
        if dataclasses.is_dataclass(types[key]) and hasattr(value, "keys"):
            found += unknown_keys(value, types[key], name)
        elif entries is not None and hasattr(value, "keys"):  # a dict of dataclasses typed Any (DistillationConfig's)
            for entry in value.keys():
                node = value[entry] if not hasattr(value, "_get_node") else value._get_node(entry)
                if hasattr(node, "keys"):
                    found += unknown_keys(node, entries, f"{name}.{entry}")
    return found


def entry_schemas(schema) -> dict:
    """{(dataclass, field): the dataclass of its entries} for the schema's dict fields whose entries are dataclasses
    (field metadata "entries"), found through the nested dataclasses."""
    out = {}
    for f in dataclasses.fields(schema):
        if "entries" in f.metadata:
            out[(schema, f.name)] = f.metadata["entries"]
    for kind in field_types(schema).values():
        if dataclasses.is_dataclass(kind):
            out.update(entry_schemas(kind))
    return out


ENTRY_SCHEMAS = entry_schemas(PPOConfig)


def known_leaves(schema, prefix: str = "") -> set[str]:
    """The dotted keys of a config dataclass's fields (a nested dataclass's own, not those inside free-form dicts)."""
    keys = set()
    for name, kind in field_types(schema).items():
        if dataclasses.is_dataclass(kind):
            keys |= known_leaves(kind, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def plus_dropped_for_known(argv: list[str], schema=None) -> list[str]:
    """verl's command lines add with `+key=value` keys its own YAML lacks; where pyrl's schema has the key, Hydra
    would refuse to add it ("already at"), so the `+` goes (a known key's value is set either way)."""
    known = known_leaves(schema or PPOConfig)
    return [arg[1:] if arg.startswith("+") and not arg.startswith("++") and arg[1:].split("=", 1)[0] in known
            else arg for arg in argv]


def typed_config(cfg, schema):
    """A composed config of another entry's schema (SFT, evaluation) -> its dataclass: every key known (`+key=`
    too), every value's type checked, no NaN (check_no_nan)."""
    from omegaconf import OmegaConf  # lazy: as the entries load it

    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ValueError(describe_unknown(unknown))
    config = OmegaConf.to_object(cfg)
    check_no_nan(config)
    return config


def check_no_nan(value, key: str = "") -> None:
    """Stop naming the first key whose value is NaN (`algorithm.gamma=nan` parses as a float): a NaN setting would
    turn every number it touches into NaN, or compare false in every check, where verl takes it silently. Free-form
    sections and lists are searched too; infinities pass (a limit may be meant to be none)."""
    if isinstance(value, float) and value != value:
        raise ValueError(f"{key}=nan: expected a number")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # read whole (asdict): not a consumer
        items = dataclasses.asdict(value).items()
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return
    for name, item in items:
        check_no_nan(item, f"{key}.{name}" if key else str(name))


def unknown_node(key: str) -> tuple[str, list[str]] | None:
    """For one dotted key (as an override names it): (its first node the schema lacks, the field names beside it),
    or None when the schema has it or it lies in a free-form section (unknown_keys' rule)."""
    tree: dict = {}
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = None
    found = unknown_keys(tree)
    return found[0] if found else None


def check_known_keys(cfg) -> None:
    """Stop naming the first key the schema lacks that asks for a verl feature pyrl does not implement
    (pyrl.verl_features), else each key the schema lacks (unknown_keys) with the nearest known names. A key a
    config file set that changes nothing (pyrl.verl_features.no_effect: at any value, or at the value that turns
    its feature off) is dropped with one log line, as on the command line."""
    from omegaconf import OmegaConf, open_dict  # lazy: as the entries load it

    unknown = []
    for name, siblings in unknown_keys(cfg):
        value = OmegaConf.select(cfg, name)
        why = no_effect(name, "null" if value is None else str(value))
        if not why:
            unknown.append((name, siblings))
            continue
        log.info("%s=%s: accepted, with no effect (%s)", name, value, why)
        parent, _, leaf = name.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        with open_dict(node):
            del node[leaf]
    for name, _ in unknown:
        feature = feature_of(name)
        if feature:
            raise NotImplementedFeature(feature, f"{name}, set in the composed config,")
    if unknown:
        raise ValueError(describe_unknown(unknown))


def describe_unknown(unknown: list[tuple[str, list[str]]]) -> str:
    """The one line naming unknown keys (unknown_keys' pairs), each with the nearest names beside it."""
    lines = []
    for name, siblings in unknown:
        parent, _, leaf = name.rpartition(".")
        near = difflib.get_close_matches(leaf, siblings, n=3)
        lines.append(f"{name}" + (f" (did you mean {', '.join(f'{parent}.{n}' if parent else n for n in near)}?)"
                                  if near else ""))
    return (f"unknown config key{'s' if len(lines) > 1 else ''}: {'; '.join(lines)}. pyrl has verl 0.9.1's "
            "keys (pyrl/config.py); `+key=` / `++key=` add keys only inside free-form sections "
            "(override_config, engine_kwargs, reward_kwargs, ray_kwargs.ray_init, ...)")


def _value(config, key: str):
    for name in key.split("."):
        config = getattr(config, name)
    return config


def check_supported(config: PPOConfig, acts_on=None) -> None:
    """Every LIMITS key holds an allowed value; checkpoint contents hold model, optimizer and extra. acts_on(key):
    only the keys the entry acts on (batch generation: its data, model and rollout; no checkpoints)."""
    acts_on = acts_on or (lambda key: True)
    for key, (allowed, why) in LIMITS.items():
        if not acts_on(key):
            continue
        value = _value(config, key)
        if value not in allowed:
            raise Unsupported(f"{key}={value!r} is not supported ({why}); expected "
                             f"{' or '.join(map(repr, allowed))}")
    for key in filter(acts_on, CONTENTS_KEYS):
        contents = set(_value(config, key))
        # hf_model: a whole HF model in <checkpoint>/huggingface on save; loading ignores it (verl too)
        if not set(CHECKPOINT_CONTENTS) <= contents <= {*CHECKPOINT_CONTENTS, "hf_model"}:
            raise Unsupported(f"{key}={sorted(contents)} is not supported: checkpoints always hold "
                             f"{', '.join(CHECKPOINT_CONTENTS)} (and hf_model if asked)")


TORCH_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                "fp16": "float16", "float16": "float16"}


def apply_mixed_precision(section, key: str, trains: bool) -> None:
    """verl 0.9.1's FSDP engine computes in `{key}.mixed_precision.param_dtype` (bf16 unless given) and reads
    `{key}.dtype` nowhere (Megatron's key); pyrl computes in `{key}.dtype`. A given param_dtype becomes dtype (the
    two given and different: an error); reduce and buffer dtypes other than float32 are refused (pyrl reduces
    gradients and keeps buffers in float32); float16 where the model trains is refused (FLOAT16_TRAINING)."""
    given = dict(section.mixed_precision or {})
    if not given:
        return
    unknown = sorted(set(given) - {"param_dtype", "reduce_dtype", "buffer_dtype"})
    if unknown:
        raise ValueError(f"{key}.mixed_precision: unknown {unknown}; verl's FSDP engine reads param_dtype, "
                         f"reduce_dtype and buffer_dtype")
    for name, value in given.items():
        torch_dtype(value, f"{key}.mixed_precision.{name}")  # a known name
    for name in ("reduce_dtype", "buffer_dtype"):
        if name in given and TORCH_DTYPES[given[name]] != "float32":
            raise Unsupported(f"{key}.mixed_precision.{name}={given[name]!r} is not supported (pyrl reduces "
                              f"gradients and keeps buffers in float32); expected fp32")
    param = given.get("param_dtype")
    if param is None:
        return
    if trains and TORCH_DTYPES[param] == "float16":
        raise Unsupported(f"{key}.mixed_precision.param_dtype={param!r} is not supported ({FLOAT16_TRAINING})")
    if section.dtype != FSDPConfig.dtype and TORCH_DTYPES.get(section.dtype) != TORCH_DTYPES[param]:
        raise ValueError(f"{key}.dtype={section.dtype!r} and {key}.mixed_precision.param_dtype={param!r}: two "
                         f"compute dtypes; give one (verl 0.9.1's FSDP engine reads param_dtype)")
    section.dtype = param


def torch_dtype(name: str, key: str):
    """'bf16' / 'bfloat16' / ... -> torch dtype; `key` names the config key in the error."""
    import torch  # lazy: torch stays off the config-check path

    if name not in TORCH_DTYPES:
        raise ValueError(f"{key}: unknown dtype {name!r}, expected one of {', '.join(TORCH_DTYPES)}")
    return getattr(torch, TORCH_DTYPES[name])
