"""python -m pyrl.ppo [key=value ...]: train with PPO / GRPO / ... as verl's main_ppo, with verl's keys.

With no arguments it trains GRPO on the built-in toy task with pyrl's tiny model, offline, on this
machine, and prints where its run directory, metrics and plot are.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import logging
import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pyrl.config import (
    PPOConfig,
    apply_mixed_precision,
    check_known_keys,
    check_supported,
    migrate_legacy_reward,
    plus_dropped_for_known,
    resolve_teacher_entries,
    unwrap_model_config,
)
from pyrl.models import resolve_model_path
from pyrl.plot import plot_run
from pyrl.trainer.run_plan import ConfigValue, RunPlan, resolve_run_plan, trainer_pool
from pyrl.trainer.workers import build_workers
from pyrl.usercode import load_object
from pyrl.verl_features import ROLLOUT_FEATURES, NotImplementedFeature, check_command_line, without_effect

ConfigStore.instance().store(name="ppo_trainer_schema", node=PPOConfig)
log = logging.getLogger("pyrl")


def prompt_batches(config: PPOConfig, tokenizer, files, max_samples: int, tool_schemas: list[dict] | None = None):
    """The data set (pyrl's RLHFDataset or data.custom_cls, built with verl's constructor) tokenized for rollout,
    with the tools' schemas in the chat template of the rows the tool agent runs (as verl's loops render them)."""
    # lazy: pyrl.data and the rollout load torch; the CLI's --help does not need it
    from pyrl.data import PromptBatches, RLHFDataset
    from pyrl.workers.rollout.agent_loop import prompt_tools

    dataset_cls = RLHFDataset
    if config.data.custom_cls.path:
        dataset_cls = load_object(config.data.custom_cls.path, "data.custom_cls.path", name=config.data.custom_cls.name,
                                  name_key="data.custom_cls.name")
    # verl's datasets read their options with config.get(key, default): an OmegaConf view, read-only
    data_config = OmegaConf.structured(config.data, flags={"readonly": True})
    dataset = dataset_cls(data_files=files, tokenizer=tokenizer, processor=None, config=data_config,
                          max_samples=max_samples)
    tools_for = functools.partial(prompt_tools, tool_schemas,
                                  config.actor_rollout_ref.rollout.agent.default_agent_loop) if tool_schemas else None
    return PromptBatches(dataset, tokenizer, config.data, config.actor_rollout_ref.model.custom_chat_template,
                         tools_for)


def resolve_model_paths(config: PPOConfig, plan: RunPlan) -> None:
    """Every model and tokenizer path the run's roles use -> its local directory (hub ids through the Hugging Face
    cache, pyrl:tiny... made on first use), once, in the driver: a missing model stops the run here, naming its key."""
    for role in plan.model_roles():
        model = ConfigValue(role.model_section).read(config)
        # the key the user set: the model's path, or (the reward model) verl's reward.reward_model.model_path
        key = role.model_key if role.model_key.endswith("model_path") else f"{role.model_section}.path"
        model.path = resolve_model_path(model.path, key)
        if role.kind == "served":  # the servers read verl's key
            config.reward.reward_model.model_path = model.path
            resolve_served_max_model_len(config.reward.reward_model)
        if model.tokenizer_path:
            model.tokenizer_path = resolve_model_path(model.tokenizer_path, f"{role.model_section}.tokenizer_path")
    if plan.runs("teacher"):  # on-policy distillation's teachers (in the actor's workers or their own servers)
        from pyrl.algos.distillation import teachers_of  # lazy: the algorithms load torch

        for name, teacher in teachers_of(config.distillation):
            teacher.model_path = resolve_model_path(teacher.model_path,
                                                    f"distillation.teacher_models.{name}.model_path")


def resolve_served_max_model_len(section) -> None:
    """A vLLM-served reward model's rollout.max_model_len left null is its model's max_position_embeddings, as verl
    0.9.1's vLLM server resolves it: a judge's prompt (the policy's prompt and response in the judge's template) may
    run past rollout.prompt_length, up to the model's context, and vLLM's KV cache is sized by memory, not by it.
    pyrl's hf engine (verl has none) keeps prompt_length + response_length: its KV cache grows with the longest
    request it batches, and the memory plan counts max_num_seqs of them."""
    if section.rollout.max_model_len is None and section.rollout.name == "vllm":
        from transformers import AutoConfig  # lazy: transformers loads only for a served reward model

        hf = AutoConfig.from_pretrained(section.model_path)
        positions = getattr(hf, "max_position_embeddings", None)
        if positions:
            section.rollout.max_model_len = int(positions)
            log.info("reward.reward_model.rollout.max_model_len: %d, the model's max_position_embeddings (verl 0.9.1's "
                     "default)", positions)


def apply_rollout_correction_config(config: PPOConfig) -> None:
    """algorithm.rollout_correction reaches the actor's loss (as verl's apply_bypass_mode does at each step); the
    modes that compare the engines' log-probs need the rollout engine to return them."""
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    correction = config.algorithm.rollout_correction
    if actor.policy_loss.rollout_correction is not None:
        raise ValueError("actor_rollout_ref.actor.policy_loss.rollout_correction is filled from "
                         "algorithm.rollout_correction: set that instead")
    actor.policy_loss.rollout_correction = correction
    used = [key for key, on in (("bypass_mode", correction.bypass_mode), ("rollout_is", correction.rollout_is),
                                ("rollout_rs", correction.rollout_rs)) if on]
    if used and not rollout.calculate_log_probs:
        raise ValueError(f"algorithm.rollout_correction.{used[0]} compares the rollout engine's log-probs with the "
                         f"trainer's: set actor_rollout_ref.rollout.calculate_log_probs=true")
    if correction.bypass_mode:
        if actor.policy_loss.loss_mode not in ("vanilla", "bypass_mode"):
            raise ValueError(f"algorithm.rollout_correction.bypass_mode=true uses the bypass_mode loss (loss_type="
                             f"{correction.loss_type}), not actor_rollout_ref.actor.policy_loss.loss_mode="
                             f"{actor.policy_loss.loss_mode}")
        actor.policy_loss.loss_mode = "bypass_mode"
        log.info("algorithm.rollout_correction.bypass_mode: the rollout's log-probs are the old ones (no old-log-prob "
                 "pass), policy loss bypass_mode with loss_type=%s", correction.loss_type)


# pyrl.data's; toy_addition_sft: the toy task's conversations for pyrl.trainer.sft_trainer
BUILTIN_TASKS = {"pyrl:toy_addition": "toy_task_files", "pyrl:tool_calc": "tool_calc_task_files",
                 "pyrl:toy_addition_sft": "toy_sft_task_files"}


def builtin_task_file(value: str, key: str, default_split: str) -> tuple[str, str | None]:
    """A data file named as one of pyrl's built-in tasks: "pyrl:<task>" (its `default_split`) or
    "pyrl:<task>:<split>" (train, val or test: the held-out split) -> (that file, the task's val file)."""
    import pyrl.data  # lazy: pyrl.data loads torch; the CLI's --help does not need it

    task, _, split = value.rpartition(":") if value.count(":") == 2 else (value, "", default_split)
    if task not in BUILTIN_TASKS:
        raise ValueError(f"{key}={value!r}: pyrl's built-in tasks are {sorted(BUILTIN_TASKS)} (with :train, :val "
                         f"or :test to name a split)")
    files = getattr(pyrl.data, BUILTIN_TASKS[task])()
    if split not in files._fields:
        raise ValueError(f"{key}={value!r}: no split {split!r}; the splits are {list(files._fields)}")
    return getattr(files, split), files.val


def resolve_builtin_files(config: PPOConfig) -> None:
    """pyrl's own files named on the command line or in a preset: data.train_files=pyrl:tool_calc (the tool task,
    made on first use; its validation split too unless data.val_files is given), data.val_files=pyrl:tool_calc:test
    (a split by name: the held-out test split here), and tool or interaction configs as pyrl:tools/calculator.yaml
    (the YAML shipped in pyrl's configs/)."""
    data, multi_turn = config.data, config.actor_rollout_ref.rollout.multi_turn
    if isinstance(data.val_files, str) and data.val_files.startswith("pyrl:"):
        data.val_files, _ = builtin_task_file(data.val_files, "data.val_files", "val")
    if isinstance(data.train_files, str) and data.train_files.startswith("pyrl:"):
        data.train_files, val = builtin_task_file(data.train_files, "data.train_files", "train")
        data.val_files = data.val_files or val
    for owner, key in ((multi_turn, "tool_config_path"), (multi_turn, "interaction_config_path"),
                       (data, "tool_config_path")):
        value = getattr(owner, key)
        if isinstance(value, str) and value.startswith("pyrl:"):
            path = importlib.resources.files("pyrl.configs").joinpath(value.removeprefix("pyrl:"))
            if not path.is_file():
                raise FileNotFoundError(f"{key}={value!r}: pyrl ships no such file ({path})")
            setattr(owner, key, str(path))


def resolve_fast_paths(config: PPOConfig) -> None:
    """pyrl's fast paths where the config leaves them null (its default; verl 0.9.1's are false): they change speed
    and memory, not results (tests/workers/test_actor_worker.py checks log-probs, losses and an optimizer step
    against the plain paths, 1 and 2 ranks, packed and padded). model.use_fused_kernels: log-probs straight from
    the hidden states, no [tokens, vocab] logits, gated MLPs that keep half their activations and RMSNorms that
    keep their input only (pyrl.models.gated_mlp, pyrl.models.rms_norm), for the actor and reference (the critic
    and reward model have no LM head);
    actor.use_prefix_grouper: each prompt's tokens run once for its samples, when there are several (rollout.n > 1)
    and sequences are packed (model.use_remove_padding). An explicit true or false is kept."""
    rollout, actor_model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    actor, chosen = config.actor_rollout_ref.actor, []
    if actor_model.use_fused_kernels is None:
        actor_model.use_fused_kernels = True
        chosen.append("actor_rollout_ref.model.use_fused_kernels=true")
    for model in (config.critic.model, config.reward_model.model):
        model.use_fused_kernels = bool(model.use_fused_kernels)
    if actor.use_prefix_grouper is None:
        actor.use_prefix_grouper = rollout.n > 1 and actor_model.use_remove_padding
        if actor.use_prefix_grouper:
            chosen.append("actor_rollout_ref.actor.use_prefix_grouper=true")
    if chosen:
        log.info("pyrl's fast paths (same numbers, less time and memory; verl 0.9.1 defaults them off, set them false "
                 "to match): %s", ", ".join(chosen))


def migrate_warmup_style(optim, key: str) -> None:
    """verl 0.9.1's deprecated optim.warmup_style (section `key`), copied into lr_scheduler_type with a warning
    (constant or cosine, as verl asserts)."""
    if optim.warmup_style is not None:
        if optim.warmup_style not in ("constant", "cosine"):
            raise ValueError(f"{key}.warmup_style: expected constant or cosine, got {optim.warmup_style!r} (it is "
                             f"deprecated: set {key}.lr_scheduler_type)")
        log.warning("%s.warmup_style is deprecated (verl 0.9.1): use %s.lr_scheduler_type; taking %s", key, key,
                    optim.warmup_style)
        optim.lr_scheduler_type = optim.warmup_style


def migrate_deprecated_keys(config: PPOConfig, ranks: int) -> None:
    """verl 0.9.1's deprecated spellings, accepted as it accepts them, each with a warning: optim.warmup_style
    (migrate_warmup_style); a global micro-batch size (ppo_micro_batch_size,
    log_prob_micro_batch_size, critic.forward_micro_batch_size) becomes the per-rank one, divided by the `ranks`
    data-parallel ranks as verl's FSDP workers did (verl 0.9.1 checks these keys but its engine workers never read
    them: there they do nothing). Both spellings at once is verl's error."""
    for key, optim in (("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim),
                       ("critic.optim", config.critic.optim)):
        migrate_warmup_style(optim, key)
    arr, critic = config.actor_rollout_ref, config.critic
    pairs = [("actor_rollout_ref.actor", "ppo_micro_batch_size", arr.actor, arr.actor.ppo_mini_batch_size),
             ("actor_rollout_ref.rollout", "log_prob_micro_batch_size", arr.rollout, None),
             ("actor_rollout_ref.ref", "log_prob_micro_batch_size", arr.ref, None),
             ("critic", "ppo_micro_batch_size", critic, critic.ppo_mini_batch_size),
             ("critic", "forward_micro_batch_size", critic, None)]
    for section, name, node, mini in pairs:
        size, per_rank = getattr(node, name), getattr(node, f"{name}_per_gpu")
        if size is None:
            continue
        if per_rank is not None:
            raise ValueError(f"[{section}] You have set both '{section}.{name}' AND '{section}.{name}_per_gpu'. Please "
                             f"remove '{section}.{name}' because only '*_{name}_per_gpu' is supported (the former is "
                             "deprecated).")
        if size < ranks or (mini is not None and mini % size):
            raise ValueError(f"{section}.{name}={size}: a global micro-batch size must be at least the {ranks} "
                             f"data-parallel ranks"
                             + (f" and divide {section}.ppo_mini_batch_size={mini}" if mini else ""))
        setattr(node, f"{name}_per_gpu", size // ranks)
        log.warning("%s.%s is deprecated (verl 0.9.1): %s.%s_per_gpu = %d / %d ranks = %d", section, name, section,
                    name, size, ranks, size // ranks)


def resolve_defaults(config: PPOConfig) -> RunPlan:
    """resolve_settings, then the models' local paths (a hub id is downloaded here, once, before workers start)."""
    plan = resolve_settings(config)
    resolve_model_paths(config, plan)
    return plan


def resolve_settings(config: PPOConfig) -> RunPlan:
    """Fill what depends on this machine (the toy task files, the rollout engine), check every value that needs no
    model or data file, and resolve the run's plan (pyrl.trainer.run_plan): what runs where, which passes."""
    from pyrl.trainer.checks import check_config  # lazy: the checks import torch; the CLI's --help does not need it

    migrate_legacy_reward(config)
    migrate_deprecated_keys(config, trainer_pool(config.trainer).world_size)
    resolve_teacher_entries(config)
    arr = config.actor_rollout_ref
    for key, model in (("actor_rollout_ref.model", arr.model), ("critic.model", config.critic.model),
                       ("reward_model.model", config.reward_model.model)):
        unwrap_model_config(model, key)
    for key, section, trains in (("actor_rollout_ref.actor.fsdp_config", arr.actor.fsdp_config, True),
                                 ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config, False),
                                 ("critic.fsdp", config.critic.fsdp, True),
                                 ("reward_model.fsdp_config", config.reward_model.fsdp_config, False)):
        apply_mixed_precision(section, key, trains)
    check_supported(config)
    if not config.actor_rollout_ref.model.path:
        raise ValueError("actor_rollout_ref.model.path: no model given; name a local Hugging Face model directory, a "
                         "hub id, or pyrl:tiny-toy-sft (or give no data either, for the toy preset)")
    resolve_builtin_files(config)
    if not config.data.train_files:
        from pyrl.data import toy_task_files  # lazy: pyrl.data loads torch; the CLI's --help does not need it

        log.info("data.train_files is empty: training on pyrl's toy task (two-digit addition)")
        toy = toy_task_files()
        config.data.train_files, config.data.val_files = toy.train, config.data.val_files or toy.val
    if config.data.output_path:
        raise ValueError(f"data.output_path={config.data.output_path!r} is batch generation's output "
                         f"(python -m pyrl.trainer.main_generation_server); the PPO trainer writes no such file")
    resolve_rollout_engine(config)
    apply_rollout_correction_config(config)
    resolve_fast_paths(config)
    plan = resolve_run_plan(config)
    check_config(config, plan)  # names and batch sizes: before any model is downloaded or built
    return plan


def resolve_rollout_engine(config: PPOConfig) -> None:
    """actor_rollout_ref.rollout.name: vllm (hf where vLLM is not installed, said once) or hf."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        log.warning("vLLM is not installed: generating with the hf engine (transformers generate) instead")
        rollout.name = "hf"
    if rollout.name in ROLLOUT_FEATURES:
        raise NotImplementedFeature(ROLLOUT_FEATURES[rollout.name], f"actor_rollout_ref.rollout.name={rollout.name}")
    if rollout.name not in ("vllm", "hf"):
        raise ValueError(f"actor_rollout_ref.rollout.name: {rollout.name!r} is not supported; use vllm or hf")


def run_ppo(config: PPOConfig) -> dict:
    # lazy: torch, Ray and the models load only when a run starts; the CLI's --help does not need them
    from pyrl.rewards import load_reward_manager
    from pyrl.rewards.managers import close_scoring_pools
    from pyrl.trainer.checks import check_agent_loops, check_default_scorer, check_models, check_multi_turn
    from pyrl.trainer.memory_plan import check_memory_plan
    from pyrl.trainer.ppo_trainer import PPOTrainer, training_steps
    from pyrl.workers.models import load_tokenizer

    plan = resolve_defaults(config)
    log.info("%s", plan.describe())
    tokenizer = load_tokenizer(config.actor_rollout_ref.model)
    check_models(config, plan, tokenizer)  # lengths and vocabulary against the models, before workers start
    check_memory_plan(config, plan)  # each phase's peak memory per rank against the device, before workers start
    tool_schemas = check_multi_turn(config)  # the tools load here first: a bad tool file stops the run now
    train = prompt_batches(config, tokenizer, config.data.train_files, config.data.train_max_samples, tool_schemas)
    val = prompt_batches(config, tokenizer, config.data.val_files, config.data.val_max_samples, tool_schemas) \
        if config.data.val_files else None
    check_agent_loops(config, [train] + ([val] if val else []))
    steps = training_steps(config, len(train))  # from trainer.total_epochs too: the LR schedules span the run (verl)
    for optim in (config.actor_rollout_ref.actor.optim, config.critic.optim):
        if optim.total_training_steps < 0:
            optim.total_training_steps = steps
    check_default_scorer(config, [train] + ([val] if val else []))  # every row scorable, code safely
    reward_fn = load_reward_manager(config, tokenizer)
    val_reward_fn = load_reward_manager(config, tokenizer)  # its own state (counts, limiters' clients)
    run_dir = os.path.abspath(config.trainer.default_local_dir)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(config)))
    global WORKERS_STARTED
    WORKERS_STARTED = True
    trainer = None
    with build_workers(config, plan) as workers:
        try:
            trainer = PPOTrainer(config, tokenizer, train, val, reward_fn, val_reward_fn, workers, plan)
            final_val = trainer.fit()
        finally:
            if trainer is not None and trainer.reward_server is not None:
                trainer.reward_server.close()
            if config.ray_kwargs.timeline_json_file:  # verl's: Ray's task timeline, written as the run ends
                import ray  # lazy: Ray stays off the CLI's import path

                ray.timeline(filename=config.ray_kwargs.timeline_json_file)
            close_scoring_pools()  # the reward function's process pools (made at the first scoring)
    outputs = {"run_dir": run_dir}
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        outputs["metrics"] = metrics_path
        outputs["plot"] = plot_run(run_dir)
    print(f"run directory: {run_dir}")
    for key in ("metrics", "plot"):
        if key in outputs:
            print(f"{key}: {outputs[key]}")
    for key, value in sorted(final_val.items()):
        if key.startswith("val-core/"):
            print(f"{key} = {value:.4f}")
    return {**outputs, "val": final_val}


TOY_PRESET = "toy"
SELECTS_TOY = ("data.train_files", "actor_rollout_ref.model.path", "preset")


def wants_toy_preset(argv: list[str]) -> bool:
    """A command line that names no data, no model, no preset and no config of its own runs the toy preset;
    decided before Hydra composes, so `--cfg job` shows what will run."""
    keys = {arg.split("=", 1)[0].lstrip("+~") for arg in argv if "=" in arg and not arg.startswith("-")}
    own_config = any(arg.startswith(("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"))
                     for arg in argv)
    return not own_config and not keys.intersection(SELECTS_TOY)


@hydra.main(config_path="pkg://pyrl.configs", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_from_hydra(cfg)


def run_from_hydra(cfg: DictConfig, run=None) -> None:
    """An entry's Hydra config -> the run: logging, the preset's line, the typed config (every value's type
    checked), `run` (run_ppo; batch generation passes its own)."""
    logging.basicConfig(level=logging.INFO, format="[pyrl] %(message)s")
    if not sys.stderr.isatty():  # a log file (CI, nohup): no progress-bar redraws from transformers or the hub
        # lazy: transformers loads only when a run starts (not for --help or --cfg)
        import huggingface_hub.utils
        import transformers

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    if AUTO_PRESET:
        log.info("no data and no model given: the toy preset (configs/preset/%s.yaml: GRPO on two-digit addition "
                 "with pyrl's tiny model); name data.train_files and actor_rollout_ref.model.path to train your own",
                 TOY_PRESET)
    check_known_keys(cfg)  # `+key=` / `++key=` bypass Hydra's own check of the key's name
    config: PPOConfig = OmegaConf.to_object(cfg)  # resolves interpolations, checks every value's type
    (run or run_ppo)(config)


def cli(hydra_main=None, toy_preset: bool = True, ppo_command_line: bool = True) -> int | None:
    """hydra_main: the Hydra entry to run (main; pyrl.experimental.one_step_off_policy.main_ppo's names its own
    config); toy_preset: a command line naming no data and no model runs the toy preset; ppo_command_line: the
    command line is checked against the PPO config's keys and verl's features before Hydra (not for an entry with a
    config of another schema: pyrl.trainer.main_eval). An error found before any
    worker starts (a bad key or value, the data, a model, a batch that does not split) is printed as one line, the
    last, without a traceback, and the exit code is 2; HYDRA_FULL_ERROR=1 shows the traceback, as Hydra's own switch
    does. Errors after the workers started keep theirs, except a worker's failure and Ctrl-C: the trainer logs the
    whole account and the run ends with one line, the last, saying at which step, why, and where a rerun resumes
    (exit code 1, or 130 for Ctrl-C)."""
    global AUTO_PRESET
    AUTO_PRESET = toy_preset and wants_toy_preset(sys.argv[1:])
    if AUTO_PRESET:
        sys.argv.append(f"preset={TOY_PRESET}")
    show_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises its composition errors here instead of printing them
    try:
        if ppo_command_line:  # every override form, and verl's features pyrl lacks, named before Hydra
            sys.argv[1:] = without_effect(sys.argv[1:])
            check_command_line(sys.argv[1:])
        (hydra_main or main)()
    except SystemExit as e:
        if not hasattr(e, "line"):  # pyrl.trainer.ppo_trainer.RunStopped's line: the run's last word
            raise
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()  # Ray's buffered worker output comes out now, before the line
        sys.stdout.flush()
        print(f"pyrl: {e.line}", file=sys.stderr, flush=True)
        return e.code
    except Exception as e:  # noqa: BLE001 - shown as one line only when no worker had started
        if show_traceback or WORKERS_STARTED:
            raise
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"pyrl: stopped before any worker started: {type(e).__name__}: {message}", file=sys.stderr, flush=True)
        return 2
    return None


def schema_cli(hydra_main, schema) -> int | None:
    """cli for an entry with a config schema of its own (SFT, evaluation): verl's `+key=` spellings of the keys the
    schema has taken, no toy preset, the command line checked by Hydra and the schema (typed_config)."""
    sys.argv = plus_dropped_for_known(sys.argv, schema)
    return cli(hydra_main, toy_preset=False, ppo_command_line=False)


AUTO_PRESET = False
WORKERS_STARTED = False  # set as run_ppo starts the workers: from then on errors keep their tracebacks

if __name__ == "__main__":
    sys.exit(cli())
