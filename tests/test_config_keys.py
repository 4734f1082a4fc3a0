"""Every key of the config schema does something: the code that acts on it reads it by its full path while pyrl
starts and trains a step (tests/config_reads.py records each read with the key's whole dotted path, in the driver and
in the workers, so actor_rollout_ref.actor.optim.weight_decay read says nothing of critic.optim.weight_decay), or
pyrl.config.check_supported (LIMITS, CONTENTS_KEYS) stops the run at start when it holds a value pyrl does not
implement. Registry names are checked before any worker starts."""

import importlib.util
import pathlib
import re

import pytest
from config_reads import leaves, with_interpolation_sources

from pyrl.config import CONTENTS_KEYS, LIMITS, PPOConfig

SCORER = """from pyrl.rewards import default_compute_score
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    score = scale * default_compute_score(data_source, solution_str, ground_truth)
    return {'score': score, 'acc': score, 'format': float('<answer>' in solution_str)}
"""
# a generative judge's reward function (verl 0.9.1's contract): asks the served reward model, parses its answer
JUDGE = """import json, urllib.request
def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                  reward_model_tokenizer=None):
    body = {'messages': [{'role': 'user', 'content': 'Rate: ' + solution_str}], 'max_tokens': 4, 'temperature': 0}
    request = urllib.request.Request('http://' + reward_router_address + '/v1/chat/completions',
                                     data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = json.loads(answer.read())['choices'][0]['message']['content']
    return float(len(text) % 2)
"""
DATASET = "from pyrl.data import RLHFDataset\nclass Rows(RLHFDataset):\n    pass\n"
VLLM = importlib.util.find_spec("vllm") is not None


def runs(tmp: pathlib.Path) -> dict[str, list[str]]:
    """One training step each (one CPU worker per role, two in the first run), together turning on every feature
    whose keys are read only when it is on."""
    from trainer.trainer_helpers import SMALL

    scorer = f"reward.custom_reward_function.path={tmp / 'scorer.py'}"
    return {
        # gae: the critic (LoRA), the reference (KL loss, and KL in the reward with the adaptive controller), the
        # reward model (its scores are the rewards: no reward function beside it); validation before training, a
        # checkpoint, the steps from total_epochs; two ranks, over which FSDP2 shards each model (one rank computing
        # in its master dtype is a plain module: fsdp_size and reshard_after_forward act on more)
        "critic_reference_reward_model": [
            *SMALL, "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=gae", "critic.model.lora_rank=4",
            "trainer.n_cpu_workers_per_node=2",
            "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "reward.reward_model.enable=true",
            "reward.reward_model.model_path=pyrl:tiny",
            "trainer.val_before_train=true", "data.val_max_samples=8", "data.val_batch_size=4",
            "trainer.log_val_generations=1", f"trainer.validation_data_dir={tmp / 'validation'}", "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1",
            "trainer.total_training_steps=null",
            "trainer.total_epochs=1", "data.train_max_samples=8",
            # on-policy distillation beside the task's rewards, top-k as PPO advantages, in chunks
            "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=pyrl:tiny",
            "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=4",
            "distillation.distillation_loss.use_policy_gradient=true",
            "distillation.distillation_loss.use_chunked_topk=true",
            "distillation.distillation_loss.chunked_topk_chunk_size=8"],
        # the tool agent loop, dynamic sampling, the actor's LoRA, rollout correction's IS weights and rejection
        "tools": [
            "preset=tool_calc", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.total_training_steps=1", "actor_rollout_ref.rollout.name=hf",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=3", "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5"],
        # a generative reward model served in a pool of its own (one replica of verl's default tensor parallel 2),
        # asked by the reward function
        "served_reward_model": [
            *SMALL, "trainer.total_training_steps=1", "actor_rollout_ref.rollout.name=hf",
            "reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny",
            *(["reward.reward_model.rollout.name=vllm"] if VLLM else
              ["reward.reward_model.rollout.name=hf", "reward.reward_model.rollout.tensor_model_parallel_size=1"]),
            "reward.reward_model.enable_resource_pool=true",
            "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=2",
            "reward.reward_model.rollout.prompt_length=64", "reward.reward_model.rollout.response_length=8",
            f"reward.custom_reward_function.path={tmp / 'judge.py'}"],
        # one-step-off: the rollout in vLLM workers of its own, bypass mode, gdpo's reward components (the scorer's,
        # with its kwargs), a dataset class
        "one_step_off": [
            *SMALL, "trainer.total_training_steps=1", f"actor_rollout_ref.rollout.name={'vllm' if VLLM else 'hf'}",
            "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.free_cache_engine=false",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "rollout.n_gpus_per_node=0",
            "algorithm.rollout_correction.bypass_mode=true", "algorithm.adv_estimator=gdpo", scorer,
            "+reward.custom_reward_function.reward_kwargs.scale=2",
            "algorithm.gdpo_reward_keys=[acc,format]", "algorithm.gdpo_reward_weights=[1.0,0.5]",
            f"data.custom_cls.path={tmp / 'rows.py'}", "data.custom_cls.name=Rows",
            "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],  # for the losses called below
    }


@pytest.fixture(scope="module")
def keys_read(tmp_path_factory, ray_session) -> dict[str, set[str]]:
    """Each schema key read by pyrl's code in the runs -> the files (under pyrl/) that read it."""
    import config_reads
    import ray.cloudpickle
    import torch
    from trainer.trainer_helpers import compose

    import pyrl.ppo
    from pyrl.algos import POLICY_LOSS_REGISTRY

    tmp = tmp_path_factory.mktemp("config_reads")
    (tmp / "scorer.py").write_text(SCORER)
    (tmp / "rows.py").write_text(DATASET)
    (tmp / "judge.py").write_text(JUDGE)
    record = tmp / "reads.txt"
    ray.cloudpickle.register_pickle_by_value(config_reads)  # the workers cannot import tests/
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pyrl.ppo, "OmegaConf", config_reads.RecordingOmegaConf)
            for name, overrides in runs(tmp).items():
                config = config_reads.record_reads(compose(*overrides, f"trainer.default_local_dir={tmp / name}"),
                                                   str(record))
                pyrl.ppo.run_ppo(config)
        # each loss reads its own options (policy_loss.*, tau_*) from the actor's section, which the actor worker
        # passes it (here the last run's, one-step-off, dro_beta set); the runs train with the vanilla and
        # bypass_mode losses
        old, new = torch.randn(2, 4), torch.randn(2, 4)
        for loss in POLICY_LOSS_REGISTRY.values():
            loss(old, new, torch.randn(2, 4), torch.ones(2, 4), config=config.actor_rollout_ref.actor)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(config_reads)
        config_reads.restore_replace()
    return config_reads.read_keys(str(record))


# keys the runs leave unread, each with why (a feature the runs cannot turn on cheaply)
NOT_READ_HERE = {
    "data.filter_overlong_prompts": "read for a prompt longer than data.max_prompt_length; the runs' prompts fit "
                                    "(tests/data/test_dataset.py filters and truncates)",
    "trainer.resume_from_path": "read with trainer.resume_mode=resume_path, as verl "
                                "(tests/trainer/test_checkpoints.py)",
    "distillation.teacher_key": "routes rows among several teachers (tests/workers/test_distillation_worker.py); "
                                "one teacher takes every row, as in verl 0.9.1",
}
if not VLLM:  # the one-step-off run generates with the hf engine
    NOT_READ_HERE.update({
        f"actor_rollout_ref.rollout.{key}": "vLLM's engine options (vLLM is not installed)" for key in (
            "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "prompt_length",
            "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "load_format", "logprobs_mode")})
# the start-up checks and the memory plan read many keys to check or size them; a key counts as acted on there
# only where they are its consumer
START_CHECKS = {"trainer/checks.py", "trainer/memory_plan.py"}
CONSUMED_BY_START_CHECKS = {
    "trainer.memory_plan": "the memory plan's own switch",
    "data.function_tool_path": "check_multi_turn loads these tools for the prompts' chat template "
                               "(pyrl.ppo.prompt_batches)",
    "actor_rollout_ref.rollout.agent.num_workers": "accepted with a log line saying it has no effect: pyrl has no "
                                                  "separate agent-loop workers",
    **{key: "read nowhere, as in verl 0.9.1 (the temperature decides; the prompts' messages are always kept): a "
            "value asking for something else is said in a log line" for key in (
        "actor_rollout_ref.rollout.do_sample", "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "reward.reward_model.rollout.do_sample", "data.return_raw_chat")},
}


def test_every_schema_key_is_read_by_its_full_path_or_limited(keys_read):
    keys = list(leaves(PPOConfig))
    assert len(keys) > 200
    acting = with_interpolation_sources(
        {key for key, files in keys_read.items() if files - START_CHECKS or key in CONSUMED_BY_START_CHECKS})

    def read(key):  # or a whole section above it (policy_loss.rollout_correction, None unless pyrl fills it)
        parts = key.split(".")
        return any(".".join(parts[:i]) in acting for i in range(1, len(parts) + 1))

    unread = [key for key in keys if key not in LIMITS and key not in CONTENTS_KEYS and key not in NOT_READ_HERE
              and not read(key)]
    assert not unread, f"keys whose consumer never read them by their full path, nor limited in pyrl.config.LIMITS " \
                       f"(read only by {sorted(START_CHECKS)}: {[k for k in unread if k in keys_read]}): {unread}"
    for key in [*LIMITS, *NOT_READ_HERE, *CONSUMED_BY_START_CHECKS]:
        assert key in keys, f"{key} is not a key of the schema"
    stale = [key for key in NOT_READ_HERE if read(key)]
    assert not stale, f"NOT_READ_HERE names keys the runs read: {stale}"


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator='grpoo' is unknown; expected one of .*grpo"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=ppo", "loss_mode='ppo' is unknown; expected one of .*vanilla"),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", "actor.loss_agg_mode='mean' is unknown"),
    ("critic.loss_agg_mode=sum", "critic.loss_agg_mode='sum' is unknown"),
    ("actor_rollout_ref.actor.kl_loss_type=k4 actor_rollout_ref.actor.use_kl_loss=true",
     "kl_loss_type: kind: unknown KL estimator 'k4'"),
    ("algorithm.kl_penalty=full algorithm.use_kl_in_reward=true",
     "algorithm.kl_penalty: kind: 'full' needs the whole distributions"),
    ("algorithm.kl_ctrl.type=pid algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type='pid' is unknown"),
    ("algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.target_kl=0 algorithm.use_kl_in_reward=true",
     "algorithm.kl_ctrl: target_kl and horizon must be > 0"),
    ("reward.reward_manager.name=prime", "reward.reward_manager.name='prime' is unknown"),
    ("reward_model.reward_manager=prime", "reward.reward_manager.name='prime' is unknown"),  # the legacy spelling
    ("trainer.logger=[console,swanlab]", "trainer.logger: unknown \\['swanlab'\\]"),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=linear", "optim.lr_scheduler_type='linear' is unknown"),
    ("critic.optim.optimizer=SGD", "critic.optim.optimizer='sgd' is unknown"),
    ("algorithm.rollout_correction.rollout_is=batch",
     "algorithm.rollout_correction.rollout_is: expected token, sequence"),
    ("algorithm.rollout_correction.rollout_rs=token_k9", "algorithm.rollout_correction.rollout_rs: unknown option"),
    ("algorithm.adv_estimator=gdpo", "gdpo needs algorithm.gdpo_reward_keys"),
])
def test_registry_names_checked_before_workers(override, message):
    from trainer.trainer_helpers import compose

    from pyrl.config import migrate_legacy_reward
    from pyrl.trainer.checks import check_names

    config = compose("preset=toy", *override.split())
    migrate_legacy_reward(config)  # as resolve_defaults does first
    with pytest.raises(ValueError, match=message):
        check_names(config)


def test_kl_keys_are_checked_only_where_they_are_read():
    """verl 0.9.1 reads algorithm.kl_ctrl.* and kl_penalty only with use_kl_in_reward, and kl_loss_type only with
    use_kl_loss: a value they would refuse is then taken, as in verl."""
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_names

    check_names(compose("preset=toy", "algorithm.use_kl_in_reward=false", "algorithm.kl_ctrl.type=pid",
                        "algorithm.kl_ctrl.target_kl=0", "algorithm.kl_penalty=full",
                        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.kl_loss_type=k4"))


@pytest.mark.parametrize("override, message", [
    ("algorithm.gamma=nan", "algorithm.gamma=nan: expected a number"),
    ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr=nan"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=nan",  # a free-form section
     "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=nan"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n=0: expected >= 1"),
    ("data.train_batch_size=-3", "data.train_batch_size=-3: expected >= 1"),
    ("data.max_prompt_length=0", "data.max_prompt_length=0: expected >= 1"),
    ("data.max_response_length=0", "actor_rollout_ref.rollout.response_length (data.max_response_length unless "
                                   "set)=0: expected >= 1"),
    ("actor_rollout_ref.actor.ppo_epochs=0", "actor_rollout_ref.actor.ppo_epochs=0: expected >= 1"),
    ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr=-1.0: expected >= 0"),
    ("actor_rollout_ref.actor.clip_ratio_low=-0.2", "clip_ratio_low=-0.2: expected >= 0"),
    ("actor_rollout_ref.actor.clip_ratio_c=1", "clip_ratio_c=1.0: expected > 1"),
    ("algorithm.lam=-1", "algorithm.lam=-1.0: expected 0 <= value <= 1"),
    ("actor_rollout_ref.rollout.temperature=-1", "rollout.temperature=-1.0: expected >= 0"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p=1.5", "val_kwargs.top_p=1.5: expected 0 < top_p <= 1"),
    ("actor_rollout_ref.rollout.top_k=-5", "rollout.top_k=-5: expected -1 or 0 (off) or >= 1"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "ppo_micro_batch_size_per_gpu=0: expected null or >= 1"),
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16",
     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype='fp16' is not supported (float16 training"),
    ("+critic.fsdp.mixed_precision.reduce_dtype=bf16",
     "critic.fsdp.mixed_precision.reduce_dtype='bf16' is not supported (pyrl reduces gradients and keeps buffers"),
    (["actor_rollout_ref.actor.fsdp_config.dtype=float32",
      "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"], "two compute dtypes; give one"),
    ("+actor_rollout_ref.ref.fsdp_config.mixed_precision.cast_forward_inputs=true",
     "actor_rollout_ref.ref.fsdp_config.mixed_precision: unknown ['cast_forward_inputs']"),
    ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature=0.0: expected > 0"),
    ("actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.mode='sync' is not supported (verl 0.9.1 "
                                            "removed rollout mode 'sync'"),
    ("trainer.device=npu", "trainer.device='npu' is not supported"),
    (["trainer.device=cpu", "trainer.n_gpus_per_node=2"], "trainer.device=cpu with trainer.n_gpus_per_node=2"),
    (["trainer.device=cuda", "trainer.n_gpus_per_node=0"], "trainer.device=cuda with trainer.n_gpus_per_node=0: 0 "
                                                           "asks for CPU workers"),
    ("trainer.resume_mode=resume_path", "trainer.resume_mode=resume_path: trainer.resume_from_path names no"),
    ("trainer.resume_mode=latest", "trainer.resume_mode='latest' is not supported"),
    ("data.val_batch_size=-2", "data.val_batch_size=-2: expected null or >= 1"),
    ("data.seed=-1", "data.seed=-1: expected null or >= 0"),
    ("trainer.total_epochs=0", "trainer.total_epochs=0: expected >= 1"),
    ("trainer.total_training_steps=0", "trainer.total_training_steps=0: expected null or >= 1"),
    ("actor_rollout_ref.actor.optim.clip_grad=0", "actor_rollout_ref.actor.optim.clip_grad=0.0: expected > 0"),
    ("critic.optim.clip_grad=-1", "critic.optim.clip_grad=-1.0: expected > 0"),
    ("actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.grad_clip=0.5 is not supported (verl 0.9.1 "
                                              "reads it nowhere: its engine clips the gradient norm at "
                                              "actor_rollout_ref.actor.optim.clip_grad; set that)"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=-0.5", "optim.min_lr_ratio=-0.5: expected 0 <= value <= 1"),
    ("actor_rollout_ref.actor.fsdp_config.dtype=float16",
     "actor_rollout_ref.actor.fsdp_config.dtype='float16' is not supported (float16 training needs loss scaling"),
    ("critic.fsdp.model_dtype=fp16", "critic.fsdp.model_dtype='fp16' is not supported"),
    ("critic.forward_max_token_len_per_gpu=0",  # its default is a copy: the key it copies is named too
     "critic.forward_max_token_len_per_gpu (critic.ppo_max_token_len_per_gpu unless set)=0: expected >= 1"),
    (["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true",
      "actor_rollout_ref.actor.clip_ratio_c=0.5"],
     "clip_ratio_c=0.5: expected > 1"),  # bypass_mode's ppo_clip runs the vanilla loss
])
def test_bad_values_stop_the_run_before_workers(override, message):
    """Each stopped by resolve_defaults, where run_ppo checks what needs no model. Before: n=0 and top_p=1.5 stopped
    a worker at the first step; gamma=nan, lam=-1, a negative clip ratio and ppo_epochs=0 (no update) trained."""
    from trainer.trainer_helpers import compose

    from pyrl.ppo import resolve_defaults

    overrides = [override] if isinstance(override, str) else override
    resolve_defaults(compose("preset=toy"))  # the base passes
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_defaults(compose("preset=toy", *overrides))


def test_val_only_needs_a_validation_set():
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_trainer_section

    config = compose("preset=toy", "trainer.val_only=true")
    config.data.val_files = None  # as a command line with train files of its own and no val_files leaves it
    with pytest.raises(ValueError, match="trainer.val_only=true validates, and data.val_files is empty"):
        check_trainer_section(config)


def test_verls_mixed_precision_param_dtype_is_the_compute_dtype():
    """verl 0.9.1's FSDP engine computes in fsdp_config.mixed_precision.param_dtype (and reads fsdp_config.dtype
    nowhere): given, it is pyrl's compute dtype; float32 reduce and buffer dtypes are pyrl's own."""
    from trainer.trainer_helpers import compose

    from pyrl.ppo import resolve_defaults

    config = compose("preset=toy", "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
                     "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
                     "+critic.fsdp.mixed_precision.buffer_dtype=float32")
    resolve_defaults(config)
    assert config.actor_rollout_ref.actor.fsdp_config.dtype == "fp32"
    assert config.critic.fsdp.dtype == "bfloat16"  # its default: no param_dtype given


def test_more_steps_than_the_epochs_hold_are_refused():
    """verl 0.9.1 stops after trainer.total_epochs whatever trainer.total_training_steps says; pyrl refuses the count
    at start (run_ppo computes the steps before any worker), naming the epochs it needs. 3,000 prompts in batches of
    64: 46 steps an epoch, with dynamic sampling too (verl 0.9.1's default trainer, trainer/ppo/v1, counts an
    epoch in training batches)."""
    from trainer.trainer_helpers import compose

    from pyrl.trainer.ppo_trainer import training_steps

    def steps(*overrides):
        return training_steps(compose("preset=toy", "data.train_batch_size=64", *overrides), 3000)

    assert steps("trainer.total_training_steps=null", "trainer.total_epochs=2") == 92
    assert steps("trainer.total_training_steps=92", "trainer.total_epochs=2") == 92
    assert steps("trainer.total_training_steps=null", "trainer.total_epochs=2", "algorithm.filter_groups.enable=true",
                 "data.gen_batch_size=192") == 92
    with pytest.raises(ValueError, match=re.escape("trainer.total_training_steps=93 is more than "
                                                   "trainer.total_epochs=2 epochs of 46 steps (3000 prompts, "
                                                   "data.train_batch_size=64) hold: verl 0.9.1 would stop after 92 "
                                                   "steps; set trainer.total_epochs=3 or fewer steps")):
        steps("trainer.total_training_steps=93", "trainer.total_epochs=2")


def test_prefix_grouper_needs_the_packed_path():
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_names

    config = compose("preset=toy", "actor_rollout_ref.actor.use_prefix_grouper=true",
                     "actor_rollout_ref.model.use_remove_padding=false")
    with pytest.raises(ValueError, match="prefix sharing on padded batches: not implemented in pyrl "
                                         ".*use_prefix_grouper=true with .*use_remove_padding=false "
                                         ".*set use_remove_padding=true"):
        check_names(config)


@pytest.mark.parametrize("overrides, message", [
    (["data.train_batch_size=6", "actor_rollout_ref.rollout.n=1", "trainer.n_cpu_workers_per_node=4",
      "actor_rollout_ref.actor.ppo_mini_batch_size=2"], "6 x 1 = 6 samples do not split over the 4 worker"),
    (["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=24"],
     "actor.ppo_mini_batch_size=24 must divide data.train_batch_size=64"),
    (["data.train_batch_size=8", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
      "trainer.n_cpu_workers_per_node=2"], "ppo_mini_batch_size x actor_rollout_ref.rollout.n = 1 x 1 = 1 samples"),
    (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=48"], "critic.ppo_mini_batch_size=48 must divide"),
    (["data.gen_batch_size=96"], r"data.gen_batch_size=96 differs from data.train_batch_size=64, which only dynamic "
                                 r"sampling \(algorithm.filter_groups.enable=true\) uses"),
    (["data.gen_batch_size=0"], "data.gen_batch_size=0: expected a positive number of prompts"),
    (["data.gen_batch_size=3", "actor_rollout_ref.rollout.n=1", "trainer.n_cpu_workers_per_node=2",
      "algorithm.filter_groups.enable=true"], "data.gen_batch_size x actor_rollout_ref.rollout.n = 3 x 1 = 3 samples"),
])
def test_batch_sizes_checked_before_workers(overrides, message):
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_batch_sizes
    from pyrl.trainer.run_plan import resolve_run_plan

    config = compose("preset=toy", *overrides)
    with pytest.raises(ValueError, match=message):
        check_batch_sizes(config, resolve_run_plan(config))


def test_lengths_and_vocabulary_checked_against_the_models():
    from trainer.trainer_helpers import compose
    from transformers import AutoTokenizer

    from pyrl.config import unwrap_model_config
    from pyrl.models import tiny_model_path
    from pyrl.trainer.checks import check_models
    from pyrl.trainer.run_plan import resolve_run_plan

    def checked(config, tokenizer):
        check_models(config, resolve_run_plan(config), tokenizer)

    path = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = compose("preset=toy", f"actor_rollout_ref.model.path={path}")
    checked(config, tokenizer)  # the toy run fits
    too_long = compose("preset=toy", f"actor_rollout_ref.model.path={path}", "data.max_response_length=100000")
    with pytest.raises(ValueError, match=r"data.max_prompt_length \+ data.max_response_length = 32 \+ 100000 = 100032 "
                                         r"exceeds actor_rollout_ref.model.path's max_position_embeddings"):
        checked(too_long, tokenizer)
    short_engine = compose("preset=toy", f"actor_rollout_ref.model.path={path}",
                           "actor_rollout_ref.rollout.max_model_len=16")
    with pytest.raises(ValueError, match="rollout.max_model_len=16 is shorter than"):
        checked(short_engine, tokenizer)
    too_split = compose("preset=toy", f"actor_rollout_ref.model.path={path}",
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=4")  # 2 attention heads
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 does not divide actor_rollout_ref.model.path's "
                                         "2 attention heads"):
        checked(too_split, tokenizer)
    kv_split = compose("preset=toy", f"actor_rollout_ref.model.path={path}",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
                       "+actor_rollout_ref.model.override_config.num_attention_heads=6",
                       "+actor_rollout_ref.model.override_config.num_key_value_heads=4")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 and actor_rollout_ref.model.path's 4 key/value "
                                         "heads .*: one must divide the other"):
        checked(kv_split, tokenizer)
    checked(compose("preset=toy", f"actor_rollout_ref.model.path={path}",  # 2 heads split, 1 KV head copied
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2"), tokenizer)
    # override_config: fields of the model's config only (transformers would hand another key to the model's
    # constructor, vLLM's hf_overrides would set it unread), never from_pretrained's loading options
    for override, message in [("rope_theta=5000.0", r"\['rope_theta'\] are not fields of .*'s config \(Qwen2Config\)"),
                              ("dtype=float16", r"\['dtype'\] are loading options of from_pretrained"),
                              ("attn_implementation=eager", r"attn_implementation: pyrl chooses the attention itself")]:
        with pytest.raises(ValueError, match=r"actor_rollout_ref.model.override_config.? ?" + message):
            checked(compose("preset=toy", f"actor_rollout_ref.model.path={path}",
                            f"+actor_rollout_ref.model.override_config.{override}"), tokenizer)
    # verl 0.9.1's override_config.model_config spelling: its entries are the overrides (checked as such)
    nested = compose("preset=toy", f"actor_rollout_ref.model.path={path}",
                     "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=64",
                     "+critic.model.override_config.model_config.rope_theta=5000.0")
    unwrap_model_config(nested.actor_rollout_ref.model, "actor_rollout_ref.model")
    assert nested.actor_rollout_ref.model.override_config == {"max_position_embeddings": 64}
    checked(nested, tokenizer)
    unwrap_model_config(nested.critic.model, "critic.model")
    assert nested.critic.model.override_config == {"rope_theta": 5000.0}
    both = compose("preset=toy", "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=64",
                   "+actor_rollout_ref.model.override_config.rope_theta=5000.0")
    with pytest.raises(ValueError, match=r"override_config: \['rope_theta'\] beside model_config, which verl 0.9.1 "
                                         "would ignore"):
        unwrap_model_config(both.actor_rollout_ref.model, "actor_rollout_ref.model")
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(tokenizer.vocab_size + 10)])
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but actor_rollout_ref.model.path's vocab_size"):
        checked(config, tokenizer)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.agent.default_agent_loop=react_agent", "default_agent_loop='react_agent' is unknown"),
    ("actor_rollout_ref.rollout.multi_turn.format=llama3_json",  # vLLM has it, verl 0.9.1 does not
     "multi_turn.format='llama3_json' is unknown; expected one of deepseek_v4, gemma4, glm, gpt-oss, hermes, kimi, "
     "minimax, qwen3_coder, seed"),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=both", "tool_response_truncate_side='both'"),
    ("actor_rollout_ref.rollout.multi_turn.max_user_turns=-1", "max_user_turns=-1: expected null or 0"),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0", "max_parallel_calls=0: expected > 0"),
    ("actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0", "tool_timeout_s=0.0: expected > 0"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path=/no/such/tools.yaml", "tools.yaml"),
])
def test_multi_turn_settings_checked_before_workers(override, message):
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_multi_turn

    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_multi_turn(compose("preset=toy", override))


def test_agent_loops_checked_against_the_rows_before_workers(tmp_path):
    """The rows' agent_name, the tool agent's need for raw_prompt, enable without a tool-agent row, and each
    tool-agent row's interaction, all named before any worker starts."""
    from types import SimpleNamespace

    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_agent_loops

    def check(rows, *overrides):
        check_agent_loops(compose("preset=toy", *overrides), [SimpleNamespace(rows=rows)])

    check([{}, {"agent_name": "tool_agent"}])
    with pytest.raises(ValueError, match="data row 1: agent_name 'react' is not one of"):
        check([{}, {"agent_name": "react"}])
    check([{"agent_name": "tool_agent"}], "data.return_raw_chat=false")  # read nowhere: raw_prompt is always kept
    with pytest.raises(ValueError, match="multi_turn.enable=true, but no row runs the tool agent"):
        check([{}, {"agent_name": "single_turn_agent"}], "actor_rollout_ref.rollout.multi_turn.enable=true")
    config = tmp_path / "interactions.yaml"
    config.write_text("interaction:\n  - name: guess\n"
                      "    class_name: pyrl.interactions.guess_number.GuessNumberInteraction\n"
                      "  - name: other\n    class_name: pyrl.interactions.guess_number.GuessNumberInteraction\n")
    with_interactions = f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={config}"
    check([{"agent_name": "tool_agent", "interaction_kwargs": {"name": "guess"}}, {}], with_interactions)
    with pytest.raises(ValueError, match=r"data row 1: interaction_kwargs.name 'gues' is not one of the interactions "
                                         r"\['guess', 'other'\]"):
        check([{}, {"agent_name": "tool_agent", "interaction_kwargs": {"name": "gues"}}], with_interactions)
    with pytest.raises(ValueError, match="data row 0: interaction_kwargs.name None"):  # two configured: name one
        check([{"agent_name": "tool_agent"}], with_interactions)


ENGINE = "actor_rollout_ref.rollout.checkpoint_engine"


@pytest.mark.parametrize("override, key", [(f"{ENGINE}.backend=nixl", "backend"),
                                           (f"{ENGINE}.update_weights_bucket_megabytes=512",
                                            "update_weights_bucket_megabytes"),
                                           (f"+{ENGINE}.engine_kwargs.nccl.rebuild_group=true", "engine_kwargs"),
                                           (f"{ENGINE}.custom_backend_module=my_backend", "custom_backend_module")])
def test_checkpoint_engine_takes_the_transports_pyrl_has(override, key):
    """verl 0.9.1's rollout.checkpoint_engine: naive (its default) and nccl (its one_step_off_ppo_trainer's) run,
    as pyrl's own push; another transport, bucket size or backend option stops the run naming the key."""
    from trainer.trainer_helpers import compose

    from pyrl.config import check_supported

    for backend in ("naive", "nccl"):
        check_supported(compose(f"{ENGINE}.backend={backend}"))
    with pytest.raises(ValueError, match=re.escape(f"{ENGINE}.{key}=") + ".* is not supported"):
        check_supported(compose(override))


@pytest.mark.parametrize("override, message", [
    ("+actor_rollout_ref.actor.bogus_key=3", r"unknown config key: actor_rollout_ref\.actor\.bogus_key\. "),
    ("++actor_rollout_ref.actor.ppo_epoch=2",
     r"actor_rollout_ref\.actor\.ppo_epoch \(did you mean actor_rollout_ref\.actor\.ppo_epochs\?\)"),
    ("+trainer.bogus.deep=1", r"unknown config key: trainer\.bogus\. "),
    ("+bogus=1", r"unknown config key: bogus\. "),
    ("+critic.optim.warmup=1", r"unknown config key: critic\.optim\.warmup\b"),
    ("+reward_model.overlong_buffr.enable=true",
     r"reward_model\.overlong_buffr \(did you mean reward_model\.overlong_buffer\?\)"),
    # inside the teacher entries (a dict typed Any, so that `+` can add whole teachers as verl's command lines do)
    ("++distillation.teacher_models.teacher_model.model_pth=x",
     r"distillation\.teacher_models\.teacher_model\.model_pth \(did you mean "),
    ("+distillation.teacher_models.t2.inference.bogus=1", r"unknown config key: distillation\.teacher_models\.t2\."
                                                          r"inference\.bogus\b"),
])
def test_plus_overrides_go_through_the_key_check(override, message):
    """`+key=` / `++key=` add keys Hydra would refuse as `key=`: the composed config is checked against the schema."""
    from trainer.trainer_helpers import compose

    with pytest.raises(ValueError, match=message):
        compose("preset=toy", override)


def test_plus_overrides_inside_free_form_sections_are_kept():
    from trainer.trainer_helpers import compose

    config = compose("preset=toy", "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
                     "+reward.custom_reward_function.reward_kwargs.scale=2", "++actor_rollout_ref.actor.ppo_epochs=2",
                     "+ray_kwargs.ray_init.log_to_driver=false", "+ray_kwargs.ray_init.runtime_env.env_vars.A=1")
    assert config.actor_rollout_ref.model.override_config == {"attention_dropout": 0.1}
    assert config.reward.custom_reward_function.reward_kwargs == {"scale": 2}
    assert config.actor_rollout_ref.actor.ppo_epochs == 2


def test_keys_without_effect_in_the_composed_config_are_dropped():
    """What a config file (or a `+key=` the command line's early check did not see) sets: a verl key that changes
    nothing, at any value or at its feature's off value, is dropped as on the command line; on, it names the
    feature."""
    from trainer.trainer_helpers import compose

    from pyrl.verl_features import NotImplementedFeature

    config = compose("preset=toy", "+algorithm.use_pf_ppo=false", "+actor_rollout_ref.ref.rollout_n=4",
                     "+algorithm.filter_groups.max_inflight_gen_batches=1")
    assert not hasattr(config.algorithm, "use_pf_ppo") and not hasattr(config.actor_rollout_ref.ref, "rollout_n")
    with pytest.raises(NotImplementedFeature, match="PF-PPO"):
        compose("preset=toy", "+algorithm.use_pf_ppo=true")


def test_ray_kwargs_reach_ray_init():
    """verl 0.9.1's ray_kwargs.ray_init goes to ray.init as verl hands it over (unset entries dropped); num_cpus
    while joining a cluster, or an address there, stops the run naming the key."""
    from trainer.trainer_helpers import compose

    from pyrl.trainer.workers import ray_init_kwargs

    assert ray_init_kwargs(compose("preset=toy")) == {}
    config = compose("preset=toy", "ray_kwargs.ray_init.num_cpus=3", "+ray_kwargs.ray_init.log_to_driver=false",
                     "+ray_kwargs.ray_init.runtime_env.env_vars.A=1")
    assert ray_init_kwargs(config) == {"num_cpus": 3, "log_to_driver": False, "runtime_env": {"env_vars": {"A": 1}}}
    with pytest.raises(ValueError, match="ray_kwargs.ray_init.num_cpus sizes a local Ray instance"):
        ray_init_kwargs(compose("preset=toy", "ray_kwargs.ray_init.num_cpus=3", "trainer.ray_address=auto"))
    with pytest.raises(ValueError, match="ray_kwargs.ray_init.address: set trainer.ray_address"):
        ray_init_kwargs(compose("preset=toy", "+ray_kwargs.ray_init.address=auto"))


def test_the_command_line_refuses_an_added_unknown_key(tmp_path):
    """The entry itself (not only the test helper) checks: the run stops before any worker, naming the key."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pyrl.ppo", "+actor_rollout_ref.actor.bogus_key=3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unknown config key: actor_rollout_ref.actor.bogus_key" in proc.stderr + proc.stdout
    assert "ActorRolloutRefWorker" not in proc.stderr + proc.stdout  # no worker started


def test_verl_deprecated_spellings_are_accepted_with_a_warning(caplog):
    """verl 0.9.1's deprecated keys: optim.warmup_style becomes lr_scheduler_type; a global micro-batch size becomes
    the per-rank one over the data-parallel ranks (verl's FSDP workers' rule; 0.9.1's engine workers check these keys
    and then never read them); both spellings at once is verl's own error."""
    from trainer.trainer_helpers import compose

    from pyrl.ppo import migrate_deprecated_keys

    config = compose("preset=toy", "actor_rollout_ref.actor.ppo_micro_batch_size=16",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
                     "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
                     "critic.ppo_micro_batch_size=16", "actor_rollout_ref.actor.optim.warmup_style=cosine",
                     "critic.optim.warmup_style=constant", "critic.optim.lr_scheduler_type=cosine")
    with caplog.at_level("WARNING", logger="pyrl"):
        migrate_deprecated_keys(config, 4)
    arr = config.actor_rollout_ref
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.ref.log_prob_micro_batch_size_per_gpu) == (4, 2, 1)
    # critic.forward_micro_batch_size follows critic.ppo_micro_batch_size, as in verl's schema
    assert (config.critic.ppo_micro_batch_size_per_gpu, config.critic.forward_micro_batch_size_per_gpu) == (4, 4)
    assert (arr.actor.optim.lr_scheduler_type, config.critic.optim.lr_scheduler_type) == ("cosine", "constant")
    assert "actor_rollout_ref.actor.ppo_micro_batch_size is deprecated (verl 0.9.1): actor_rollout_ref.actor." \
           "ppo_micro_batch_size_per_gpu = 16 / 4 ranks = 4" in caplog.text
    assert "critic.optim.warmup_style is deprecated (verl 0.9.1): use critic.optim.lr_scheduler_type" in caplog.text

    for overrides, message in [
        (["actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
         r"\[actor_rollout_ref.actor\] You have set both 'actor_rollout_ref.actor.ppo_micro_batch_size' AND "
         r"'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu'"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size=2"],
         r"actor_rollout_ref.actor.ppo_micro_batch_size=2: a global "
         r"micro-batch size must be at least the 4 data-parallel ranks"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size=24"],
         r"and divide actor_rollout_ref.actor.ppo_mini_batch_size=32"),
        (["critic.optim.warmup_style=linear"], r"critic.optim.warmup_style: expected constant or cosine, got 'linear'"),
    ]:
        with pytest.raises(ValueError, match=message):
            migrate_deprecated_keys(compose("preset=toy", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                                            *overrides), 4)


@pytest.mark.parametrize("key", ["actor_rollout_ref.ref.ulysses_sequence_parallel_size",
                                 "critic.ulysses_sequence_parallel_size",
                                 "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
                                 "critic.fsdp.ulysses_sequence_parallel_size"])
def test_a_refused_feature_is_refused_under_every_key_that_names_it(key):
    """Ulysses sequence parallelism by any of verl 0.9.1's keys for it: the feature named, not Hydra's
    'Key ... not in'."""
    from trainer.trainer_helpers import compose

    from pyrl.config import check_supported

    with pytest.raises(ValueError, match=rf"{re.escape(key)}=2 is not supported \(Ulysses sequence parallelism is not "
                                         r"implemented\); expected 1"):
        check_supported(compose("preset=toy", f"{key}=2"))


@pytest.mark.parametrize("overrides, message", [
    (["+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton"],
     r"engine_kwargs\.sglang is set \(attention_backend\) but the rollout engine is hf .*would do nothing"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=3"], r"engine_kwargs\.vllm is set .* engine is hf"),
    (["+actor_rollout_ref.rollout.engine_kwargs.tgi.x=1"], r"engine_kwargs: unknown engine section\(s\) \['tgi'\]"),
])
def test_engine_kwargs_only_for_the_engine_that_runs(overrides, message):
    """verl's rollout.engine_kwargs: another engine's options would do nothing, so they stop the run."""
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_engine_kwargs

    config = compose("preset=toy", "actor_rollout_ref.rollout.name=hf", *overrides)
    with pytest.raises(ValueError, match=message):
        check_engine_kwargs(config.actor_rollout_ref.rollout)
    check_engine_kwargs(compose("preset=toy", "actor_rollout_ref.rollout.name=vllm",
                                "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=3").actor_rollout_ref.rollout)


def test_a_custom_reward_function_beside_pyrls_fsdp_reward_model_is_refused():
    """With pyrl's FSDP reward model the model's scores are the rewards: a custom function given too would never be
    called, so the run stops at start naming both."""
    from trainer.trainer_helpers import compose

    from pyrl.trainer.checks import check_fsdp_reward_model

    config = compose("preset=toy", "reward.reward_model.enable=true", "reward.custom_reward_function.path=f.py")
    with pytest.raises(ValueError, match="custom_reward_function.path with pyrl's FSDP reward model"):
        check_fsdp_reward_model(config)
    check_fsdp_reward_model(compose("preset=toy", "reward.reward_model.enable=true"))


def test_a_served_reward_models_context_defaults_to_its_models():
    """reward.reward_model.rollout.max_model_len null is, with vLLM, the model's max_position_embeddings, as verl
    0.9.1's server resolves it (a judge's prompt may run past rollout.prompt_length); a value given is kept."""
    from trainer.trainer_helpers import compose

    from pyrl.models import tiny_model_path
    from pyrl.ppo import resolve_served_max_model_len

    config = compose("preset=toy", "reward.reward_model.enable=true", "reward.reward_model.rollout.name=vllm",
                     f"reward.reward_model.model_path={tiny_model_path()}")
    resolve_served_max_model_len(config.reward.reward_model)
    assert config.reward.reward_model.rollout.max_model_len == 512  # pyrl:tiny's
    config.reward.reward_model.rollout.name, config.reward.reward_model.rollout.max_model_len = "hf", None
    resolve_served_max_model_len(config.reward.reward_model)
    assert config.reward.reward_model.rollout.max_model_len is None  # hf: prompt_length + response_length
    config.reward.reward_model.rollout.max_model_len = 300
    resolve_served_max_model_len(config.reward.reward_model)
    assert config.reward.reward_model.rollout.max_model_len == 300
