"""verl 0.9.1's features pyrl does not implement, named from the config keys that ask for them.

A verl command line that sets one of verl 0.9.1's keys pyrl lacks (or names one of verl's configs pyrl lacks, such
as ppo_megatron_trainer) stops before Hydra composes, with one line naming the feature and the key:
"Megatron strategy: not implemented in pyrl (actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 asks for
it; see README: Not supported)". A key neither verl 0.9.1 nor pyrl has stays an unknown key, named with the nearest
known names. Every override form (`key=`, `+key=`, `++key=`, `~key`) goes through the same check; keys a config file
adds are checked after composition (pyrl.config.check_known_keys), with the same words.

FEATURES is checked against every leaf of verl 0.9.1's generated configs by tests/verl_corpus/test_verl_corpus.py.
"""

from __future__ import annotations

import re
import sys


class Unsupported(ValueError):
    """A setting pyrl refuses by design (a verl value or feature it does not implement); str() is the one line the
    run stops with."""


class NotImplementedFeature(Unsupported):
    """A verl 0.9.1 feature pyrl does not implement was asked for."""

    def __init__(self, feature: str, asked_by: str, instead: str = ""):
        self.feature = feature
        super().__init__(f"{feature}: not implemented in pyrl ({asked_by} asks for it; see README: Not supported)"
                         + (f"; {instead}" if instead else ""))


# verl 0.9.1's configs (--config-name) pyrl has no counterpart for
CONFIG_FEATURES = {
    "ppo_megatron_trainer": "Megatron strategy",
    "one_step_off_ppo_megatron_trainer": "Megatron strategy",
    "ppo_torchtitan_trainer": "torchtitan engine",
    "ppo_veomni_trainer": "VeOmni engine",
}
# verl 0.9.1's rollout engines pyrl lacks (actor_rollout_ref.rollout.name)
ROLLOUT_FEATURES = {"sglang": "SGLang rollout", "trtllm": "TensorRT-LLM rollout"}

_ROLE = r"^(actor_rollout_ref\.(actor|ref)|critic)\."
# (pattern on the dotted key, feature): the first match names the feature; the order puts the specific first
FEATURES: list[tuple[str, str]] = [
    (r"(^|\.)_target_$", "verl's dataclass targets (_target_: verl's own config classes)"),
    (r"(^|\.)megatron(\.|$)|\.checkpoint\.mbridge_config$", "Megatron strategy"),
    (r"\.optim\.(exp_avg_dtype|exp_avg_sq_dtype|lr_decay_steps|lr_decay_style|lr_warmup_init|lr_wsd_decay_steps|"
     r"lr_wsd_decay_style|main_grads_dtype|min_lr|muon_\w+|use_checkpoint_opt_param_scheduler|"
     r"use_layer_wise_distributed_optimizer|use_precision_aware_optimizer|weight_decay_incr_style)$",
     "Megatron's optimizer options (Muon, its LR decay styles, precision-aware and distributed optimizers)"),
    (r"^actor_rollout_ref\.actor\.use_fused_kernels$", "the Megatron actor's fused kernels (pyrl's: "
                                                        "actor_rollout_ref.model.use_fused_kernels)"),
    (r"^critic\.nccl_timeout$", "a collective timeout of the critic's own (pyrl's critic uses "
                                "actor_rollout_ref.nccl_timeout)"),
    (r"(^|\.)profiler(\.|$)|^global_profiler(\.|$)", "verl's profilers (nsys, torch, torch_memory, npu, "
                                                      "precision debugger)"),
    (r"(^|\.)qat(\.|$)", "quantization-aware training (qat)"),
    (r"(^|\.)turbo_config(\.|$)", "verl's FSDP turbo plans (turbo_config: tensor and expert parallel FSDP)"),
    (r"^transfer_queue(\.|$)", "verl's transfer queue"),
    (r"^trainer\.(v1(\.|$)|use_v1$)", "verl's v1 trainer (trainer.v1, trainer.use_v1)"),
    (r"^skip(\.|$)", "rollout dumps and replays (skip.*)"),
    (r"(^|\.)mtp(\.|$)", "multi-token prediction (mtp)"),
    (r"\.model\.lora(\.|$)", "Megatron's LoRA block (model.lora.*; pyrl's LoRA keys are model.lora_rank, "
                             "lora_alpha, target_modules, ...)"),
    (r"(^|\.)tiled_mlp(\.|$)", "tiled MLP"),
    (r"(^|\.)disaggregation(\.|$)", "prefill/decode disaggregation"),
    (r"^reward_model\.(reward_loop_source|reward_loop_module_path|reward_loop_class_name)$",
     "verl's reward-loop classes (reward_model.reward_loop_*)"),
    (r"^data\.(image_key|video_key|audio_key|image_patch_size|return_multi_modal_inputs|mm_processor_kwargs)$"
     r"|(^|\.)freeze_vision_tower$|(^|\.)limit_images$", "multimodal (image, video, audio) inputs"),
    (r"(^|\.)(entropy_from_logits_with_chunking|entropy_from_logits_chunk_size|entropy_checkpointing)$",
     "verl's chunked and checkpointed entropy (pyrl's fused entropy: model.use_fused_kernels)"),
    (r"(^|\.)enable_activation_offload$", "activation offloading"),
    (r"(^|\.)(use_liger|fused_kernel_options(\.|$))", "Liger kernels and verl's fused-kernel backends (pyrl's "
                                                      "fused kernels: model.use_fused_kernels)"),
    (r"\.model\.(external_lib|hf_config_path)$", "external model code and configs (model.external_lib, "
                                                 "hf_config_path)"),
    (r"\.model\.target_parameters$", "LoRA on parameters that are not linear layers (model.target_parameters: "
                                      "PEFT's for mixture-of-experts weights)"),
    (r"(^|\.)(pad_to_length|pad_to_length_bucket)$|^actor_rollout_ref\.actor\.use_remove_padding$",
     "verl's engine padding settings (pyrl's: model.use_remove_padding)"),
    (rf"{_ROLE}(fsdp_config|fsdp)\.(offload_policy|forward_prefetch|use_orig_params|seed|full_determinism|"
     r"use_no_sync_for_gradient_accumulation|strategy|wrap_policy\.min_num_params)$",
     "FSDP options pyrl does not expose (offload_policy, forward_prefetch, use_orig_params, seed, "
     "full_determinism, use_no_sync_for_gradient_accumulation, fsdp_config.strategy, wrap_policy)"),
    (r"\.checkpoint\.(async_save|strict)$", "asynchronous checkpoint saving and non-strict loading"),
    (r"\.optim\.(optimizer_impl|zero_indexed_step|override_optimizer_config)$",
     "verl's engine optimizer options (optim.optimizer_impl, zero_indexed_step, override_optimizer_config)"),
    (r"^actor_rollout_ref\.rollout\.(nnodes|n_gpus_per_node|data_parallel_size|expert_parallel_size|"
     r"pipeline_model_parallel_size)$", "rollout data, expert and pipeline parallelism and a rollout pool of its "
                                        "own in the hybrid engine"),
    (r"^actor_rollout_ref\.rollout\.(quantization|quantization_config_file)$", "quantized rollout"),
    (r"^actor_rollout_ref\.rollout\.(prometheus|trace)(\.|$)", "rollout tracing and Prometheus metrics"),
    (r"^actor_rollout_ref\.rollout\.(enable_rollout_routing_replay|moe_load_balance_metrics_interval|"
     r"router_config_path)$", "MoE routing replay and router settings"),
    (r"^actor_rollout_ref\.rollout\.(full_determinism|cudagraph_capture_sizes|scheduling_policy|disable_log_stats|"
     r"over_sample_rate|multi_stage_wake_up)$",
     "verl's rollout-server options (full_determinism, cudagraph_capture_sizes, scheduling_policy, "
     "disable_log_stats, over_sample_rate, multi_stage_wake_up)"),
    (r"^algorithm\.(use_pf_ppo$|pf_ppo(\.|$))", "PF-PPO (algorithm.use_pf_ppo)"),
    (r"^algorithm\.filter_groups\.max_inflight_gen_batches$", "asynchronous dynamic-sampling generation "
                                                              "(filter_groups.max_inflight_gen_batches)"),
    (r"^trainer\.(esi_redundant_time|checkpoint_callback_class|default_hdfs_dir|del_local_ckpt_after_load)$",
     "verl's checkpoint services (HDFS copies, ESI timing, callbacks, deleting local checkpoints)"),
    (r"^trainer\.ray_wait_register_center_timeout$", "verl's worker register center"),
    (r"^data\.(use_shm|return_raw_input_ids|return_full_prompt|validation_shuffle|"
     r"filter_overlong_prompts_workers|trust_remote_code)$",
     "verl's dataset options (use_shm, return_raw_input_ids, return_full_prompt, validation_shuffle, "
     "filter_overlong_prompts_workers, trust_remote_code)"),
]
_COMPILED = [(re.compile(pattern), feature) for pattern, feature in FEATURES]


def feature_of(key: str) -> str | None:
    """The verl feature a config key asks for (FEATURES), or None for a key no rule names. A key inside one of
    verl's free-form sections (override_optimizer_config, mm_processor_kwargs, ...) is named by its section."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        feature = next((feature for pattern, feature in _COMPILED if pattern.search(name)), None)
        if feature:
            return feature
    return None


# verl 0.9.1 keys whose value changes nothing there either: accepted at any value, dropped before Hydra composes,
# each said in one log line (pyrl's schema lacks them)
WITHOUT_EFFECT: list[tuple[str, str]] = [
    (r"^(actor_rollout_ref\.(actor|ref)\.(fsdp_config\.)?|critic\.fsdp\.)use_torch_compile$",
     "verl 0.9.1's FSDP engine compiles only its entropy function with it, a speed setting; pyrl's entropy is its "
     "own fused kernel"),
    (r"^actor_rollout_ref\.rollout\.skip_tokenizer_init$",
     "verl 0.9.1's vLLM server starts the policy's engine with its tokenizer whatever it says"),
    (r"^(actor_rollout_ref\.(actor|ref)|critic)\.rollout_n$",
     "verl 0.9.1's engine workers check that it is set and read it nowhere else; pyrl reads "
     "actor_rollout_ref.rollout.n"),
    (r"^actor_rollout_ref\.ref\.(entropy_from_logits_with_chunking|entropy_from_logits_chunk_size|"
     r"entropy_checkpointing)$", "verl 0.9.1's reference pass computes no entropy"),
    (r"(^|\.)fused_kernel_options\.impl_backend$",
     "the backend of verl's fused log-prob kernel, a speed setting; pyrl's fused kernels choose theirs by device "
     "(PYRL_OPS_BACKEND)"),
    (r"^algorithm\.pf_ppo\.", "PF-PPO's options, and PF-PPO is off (algorithm.use_pf_ppo=true is refused)"),
]
# verl 0.9.1 keys of features pyrl lacks, at the value that turns the feature off (its default, which is how pyrl
# runs): dropped and said the same way; any other value names the feature (FEATURES). `~key` (back to the
# default) counts as the off value.
OFF_VALUES: list[tuple[str, set[str], str]] = [
    (r"^algorithm\.use_pf_ppo$", {"false"}, "PF-PPO off, verl 0.9.1's default"),
    (r"^algorithm\.filter_groups\.max_inflight_gen_batches$", {"1"},
     "one dynamic-sampling generation batch in flight at a time, verl 0.9.1's default and how pyrl generates"),
    (r"(^|\.)(use_liger|enable_activation_offload|tiled_mlp\.enabled|mtp\.enable)$", {"false"},
     "the feature off, verl 0.9.1's default"),
    (r"^actor_rollout_ref\.actor\.(entropy_from_logits_with_chunking|entropy_checkpointing)$", {"false"},
     "verl 0.9.1's default"),
    (r"\.model\.(external_lib|hf_config_path)$", {"null"}, "verl 0.9.1's default"),
]
_WITHOUT_EFFECT = [(re.compile(pattern), why) for pattern, why in WITHOUT_EFFECT]
_OFF_VALUES = [(re.compile(pattern), values, why) for pattern, values, why in OFF_VALUES]
DEFAULT = object()  # the value of a `~key` override: the key back to its default


def no_effect(key: str, value=None) -> str | None:
    """Why a key set to `value` (as written after `=`; DEFAULT for `~key`) changes nothing: a WITHOUT_EFFECT key at
    any value, an OFF_VALUES key at its off value; None otherwise (value None: the key at any value)."""
    why = next((why for pattern, why in _WITHOUT_EFFECT if pattern.search(key)), None)
    if why or value is None:
        return why
    return next((why for pattern, values, why in _OFF_VALUES if pattern.search(key)
                 and (value is DEFAULT or value.strip("'\"").lower() in values)), None)


def without_effect(argv: list[str]) -> list[str]:
    """The command line less its overrides of WITHOUT_EFFECT keys, and of OFF_VALUES keys at their off value,
    each said on stderr with why it changes nothing (before Hydra configures logging)."""
    dropped = {}
    for key, arg in override_keys(argv):
        why = no_effect(key, arg.split("=", 1)[1] if "=" in arg else DEFAULT)
        if why:
            dropped[arg] = why
    for arg, why in dropped.items():
        print(f"pyrl: {arg.lstrip('+')}: accepted, with no effect ({why})", file=sys.stderr, flush=True)
    return [arg for arg in argv if arg not in dropped]


CONFIG_GROUPS = ("preset",)  # pyrl's config groups (configs/preset): `preset=toy` chooses, it sets no key


def override_keys(argv: list[str]) -> list[tuple[str, str]]:
    """(dotted key, the override as written) of each config override in a command line: `key=`, `+key=`,
    `++key=`, `~key`; Hydra's own (hydra.*, flags) and config-group choices (preset, a key with / or @) left out."""
    found = []
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if not key or key.split(".")[0] == "hydra" or key in CONFIG_GROUPS or "/" in key or "@" in key:
            continue
        found.append((key, arg))
    return found


def config_name_of(argv: list[str]) -> str | None:
    """--config-name / -cn as given (without .yaml), else None."""
    for i, arg in enumerate(argv):
        for flag in ("--config-name", "-cn"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1].removesuffix(".yaml")
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1].strip("'\"").removesuffix(".yaml")
    return None


def check_command_line(argv: list[str]) -> None:
    """Before Hydra composes: a verl config pyrl lacks, or an override of a verl key pyrl lacks, stops the run
    naming the feature (NotImplementedFeature); an override of a key neither has, naming the key and the nearest
    known names (ValueError). `key=`, `+key=`, `++key=` and `~key` are checked the same way here. What this does
    not parse (a whole section given as a dict, `group@package=` choices) is checked as Hydra composes it, and the
    keys it adds by check_known_keys after."""
    from pyrl.config import describe_unknown, unknown_node  # lazy: import cycle (pyrl.config imports this module)

    name = config_name_of(argv)
    if name in CONFIG_FEATURES:
        raise NotImplementedFeature(CONFIG_FEATURES[name], f"--config-name={name}")
    unknown = []
    for key, arg in dict(override_keys(argv)).items():  # a key given twice is named once
        found = unknown_node(key)
        if found is None:
            continue
        feature = feature_of(key)
        if feature:
            raise NotImplementedFeature(feature, arg.lstrip("+"))
        if found[0] not in dict(unknown):
            unknown.append(found)
    if unknown:
        raise ValueError(describe_unknown(unknown))
