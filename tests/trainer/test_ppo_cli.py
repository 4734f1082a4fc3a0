"""python -m pyrl.ppo end to end: the default run (shortened), every estimator, verl command lines, bad
input failing clearly and leaving nothing behind."""

import glob
import json
import re
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import FP32, SMALL, assert_rollout_matches_trainer, compose, read_metrics, run_cli

from pyrl.algos import ADV_ESTIMATOR_REGISTRY, advantage

STEP_KEYS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
             "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
             "response_length/mean", "prompt_length/mean", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
             "timing_s/adv", "timing_s/update_actor", "timing_s/update_weights", "timing_s/step", "perf/throughput",
             "perf/cpu_memory_used_gb", "perf/mfu/gen", "perf/mfu/actor_infer", "perf/mfu/actor"]


def test_default_run_shortened(tmp_path):
    """The default command with fewer, smaller steps: the vLLM engine, the warm-started tiny model, the
    toy task, validation before and after; prints its outputs."""
    run_dir = tmp_path / "run"
    proc = run_cli(["trainer.total_training_steps=3", "trainer.test_freq=3", "data.train_batch_size=16",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                    f"trainer.default_local_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    val_key = "val-core/pyrl/toy_addition/acc/mean@1"  # the scorer returns a number: verl's "acc"
    assert val_key in rows[0] and val_key in rows[3] and "val-aux/pyrl/toy_addition/reward/mean@1" in rows[3]
    assert rows[0][val_key] > 0.1  # the warm-started policy solves some prompts
    for key in STEP_KEYS:
        assert key in rows[1], key
    for key in ("perf/mfu/gen", "perf/mfu/actor_infer", "perf/mfu/actor"):
        assert 0 < rows[1][key] < 1, (key, rows[1][key])
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert f"run directory: {run_dir}" in proc.stdout and "metrics.png" in proc.stdout
    shown = proc.stdout.split("validation generations at step 3:\n")[1].splitlines()[:3]  # log_val_generations: 3
    assert all(re.match(r"  score [01] +'.*\d+\+\d+=.*' -> '.*'  \(expected \d+\)$", line) for line in shown), shown
    assert not (tmp_path / "outputs").exists()  # Hydra leaves no output directories behind
    assert "no data and no model given: the toy preset" in proc.stdout + proc.stderr


def test_tool_use_run_shortened(tmp_path):
    """preset=tool_calc (the README's tool-use command) with fewer steps: the tool agent loop on vLLM, the
    calculator, the warm-started tool model. Its validation reward rises already, the samples call the tool and
    the tool-response turns are in the metrics (verl's num_turns / tool_call_counts)."""
    run_dir = tmp_path / "run"
    proc = run_cli(["preset=tool_calc", "trainer.total_training_steps=3", "trainer.test_freq=3",
                    f"trainer.default_local_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    val_key = "val-core/pyrl/tool_calc/acc/mean@1"
    assert rows[3][val_key] >= rows[0][val_key] + 0.2, (rows[0][val_key], rows[3][val_key])
    assert rows[3]["val-aux/tool_calls/sample_ratio"] > rows[0]["val-aux/tool_calls/sample_ratio"]
    for key in STEP_KEYS + ["num_turns/mean", "num_turns/max", "tool_call_counts/mean", "tool_error_counts/mean",
                            "tool_calls/sample_ratio", "timing_s/agent_loop/tool_calls/mean", "val-aux/num_turns/mean"]:
        assert key in rows[1] or key in rows[3], key
    assert rows[1]["num_turns/max"] == 4  # prompt, tool call, tool response, answer
    shown = proc.stdout.split("validation generations at step 3:\n")[1].splitlines()[:3]
    assert any("<tool_call>" in line and "<tool_response>" in line for line in shown), shown


def test_two_runs_started_at_once_both_finish(tmp_path):
    """Each run starts its own private Ray instance: two on one machine at the same moment do not meet. verl's
    ray_kwargs reach ray.init (the first run's CPUs; a key a script adds with +) and the timeline is written."""
    import subprocess

    ray_kwargs = [[f"ray_kwargs.timeline_json_file={tmp_path / 'timeline.json'}"],
                  ["ray_kwargs.ray_init.num_cpus=3", "+ray_kwargs.ray_init.log_to_driver=false"]]
    procs = [subprocess.Popen([sys.executable, "-m", "pyrl.ppo", *SMALL, "actor_rollout_ref.rollout.name=hf",
                               "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / str(i)}",
                               *ray_kwargs[i]],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert [len(read_metrics(tmp_path / str(i))) for i in range(2)] == [1, 1]
    events = json.loads((tmp_path / "timeline.json").read_text())
    assert isinstance(events, list) and events  # Ray's chrome-tracing events of the run's tasks


ESTIMATORS = sorted(ADV_ESTIMATOR_REGISTRY)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_runs_two_steps(estimator, tmp_path, ray_session):
    from pyrl.ppo import run_ppo

    extra = ["actor_rollout_ref.actor.use_kl_loss=true"] if estimator == "grpo" else []
    if estimator == "reinforce_plus_plus":
        extra = ["algorithm.use_kl_in_reward=true"]  # its usual pairing: KL in the reward, fed to the return
    if "sum_pi_squared" in advantage.ESTIMATORS.needs(estimator).tensors:
        extra = ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    if estimator == "gdpo":  # reward components, normalized one by one: a scorer returning them
        scorer = tmp_path / "components.py"
        scorer.write_text("from pyrl.rewards import default_compute_score\n"
                          "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    score = default_compute_score(data_source, solution_str, ground_truth)\n"
                          "    return {'score': score, 'acc': score, 'format': float('<answer>' in solution_str)}\n")
        extra = [f"reward.custom_reward_function.path={scorer}", "algorithm.gdpo_reward_keys=[acc,format]"]
    config = compose(*SMALL, f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=2",
                     "actor_rollout_ref.rollout.name=hf", f"trainer.default_local_dir={tmp_path}", *extra)
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for key in STEP_KEYS:
        assert key in rows[-1], key
    if estimator == "gae":
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "timing_s/values",
                    "timing_s/update_critic"):
            assert key in rows[-1], key
    if estimator == "remax":
        assert "timing_s/gen_max" in rows[-1]
    if extra and "use_kl_loss" in extra[0]:
        assert "actor/kl_loss" in rows[-1] and "timing_s/ref" in rows[-1]
    if estimator == "reinforce_plus_plus":
        assert "actor/reward_kl_penalty" in rows[-1]


def test_two_cpu_workers_with_a_critic_dynamic_batches_and_sampled_validation(tmp_path, ray_session):
    """The distributed path on a CPU machine: 2 FSDP2 ranks over gloo for the actor and for the critic,
    batches balanced across them, token-budget micro-batches; validation samples 2 answers per prompt. The critic
    warms up for a step (trainer.critic_warmup=2: as in verl the actor updates from the step numbered 2, counting
    from 1), and the weights are pushed into the engine every step (an engine asleep on CUDA needs them back)."""
    from pyrl.ppo import run_ppo

    config = compose(*SMALL, "algorithm.adv_estimator=gae", "trainer.n_cpu_workers_per_node=2",
                     "trainer.total_training_steps=2", "trainer.test_freq=2", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
                     "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                     "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", f"trainer.default_local_dir={tmp_path}",
                     "trainer.critic_warmup=2")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert "actor/pg_loss" not in rows[0] and "actor/pg_loss" in rows[1]
    for row in rows:
        assert row["perf/update_weights_bytes"] > 0
        # 32 samples of equal-length prompts over 2 ranks: the rank totals differ by at most one response
        assert row["global_seqlen/minmax_diff"] <= 8 and row["global_seqlen/mean"] == row["perf/total_num_tokens"] / 2
        assert row["perf/throughput"] == pytest.approx(row["perf/total_num_tokens"] / (2 * row["timing_s/step"]))
        assert "critic/vf_loss" in row and "critic/values/mean" in row
    for key in ("val-core/pyrl/toy_addition/acc/mean@2", "val-core/pyrl/toy_addition/acc/best@2/mean",
                "val-aux/pyrl/toy_addition/acc/worst@2/mean", "val-aux/pyrl/toy_addition/reward/std@2"):
        assert 0 <= rows[-1][key] <= 1, key


def test_dapo_pieces_with_dynamic_sampling(tmp_path, ray_session):
    """clip-higher, token-mean, overlong reward shaping and dynamic sampling (groups whose samples all
    scored alike are dropped and more prompts generated, in batches of data.gen_batch_size, until the batch is
    full)."""
    from pyrl.ppo import run_ppo

    config = compose(*SMALL, "actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "actor_rollout_ref.rollout.name=hf",
                     "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}",
                     "data.gen_batch_size=12", "trainer.save_freq=2",
                     "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true",
                     "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
                     "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
                     "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=0.5",
                     f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["training/num_gen_batches"] > 1 for r in rows)  # groups were dropped and more generated
    sampler = torch.load(tmp_path / "global_step_2" / "data.pt", weights_only=False)["sampler"]
    assert sampler["epoch"] == 0 and sampler["position"] == 12 * sum(r["training/num_gen_batches"] for r in rows)
    assert any(r["critic/score/min"] < 0 for r in rows)  # responses past max_len - buffer are penalized
    for step in (1, 2):  # the batch is full: 8 prompts whose 4 samples each scored differently
        samples = [json.loads(line) for line in open(tmp_path / "rollouts" / f"{step}.jsonl")]
        groups: dict = {}
        for sample in samples:
            groups.setdefault(sample["uid"], []).append(sample)
        assert len(groups) == 8 and all(len(g) == 4 for g in groups.values())
        assert all(len({s["input"] for s in g}) == 1 and len({s["score"] for s in g}) > 1 for g in groups.values())


def remote_code_model(directory) -> str:
    """pyrl:tiny as a model that brings its own code (config.json's auto_map names a Qwen2 subclass in the
    directory, under a model_type transformers does not know): it loads only with trust_remote_code."""
    import shutil

    from pyrl.models import resolve_model_path

    shutil.copytree(resolve_model_path("pyrl:tiny", "model"), directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="pyrl_remote_qwen2",
                  auto_map={"AutoConfig": "configuration_remote.RemoteQwen2Config",
                            "AutoModelForCausalLM": "modeling_remote.RemoteQwen2ForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_remote.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass RemoteQwen2Config(Qwen2Config):\n"
        "    model_type = 'pyrl_remote_qwen2'\n")
    (directory / "modeling_remote.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\nfrom .configuration_remote import RemoteQwen2Config\n\n\n"
        "class RemoteQwen2ForCausalLM(Qwen2ForCausalLM):\n    config_class = RemoteQwen2Config\n")
    return str(directory)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_rollout_engine_runs_the_model_the_actor_trains(engine, tmp_path, ray_session):
    """The engine loads the policy as the actor does: with actor_rollout_ref.model.override_config (here
    rms_norm_eps 1e-6 -> 100, which moves every log-prob; hf: from_pretrained's overrides, vLLM: hf_overrides), so
    its log-probs equal the trainer's at float32 noise, and with model.trust_remote_code (a model of its own code,
    which neither engine loaded before: only the actor passed it). verl 0.9.1 starts its engines from config.json
    alone."""
    from pyrl.ppo import run_ppo

    model = remote_code_model(tmp_path / "model")
    run_ppo(compose(*[o for o in SMALL if not o.startswith("actor_rollout_ref.model.path=")], *FP32,
                    f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.trust_remote_code=true",
                    f"actor_rollout_ref.rollout.name={engine}",
                    "+actor_rollout_ref.model.override_config.rms_norm_eps=100.0",
                    "actor_rollout_ref.rollout.calculate_log_probs=true", "trainer.total_training_steps=1",
                    f"trainer.default_local_dir={tmp_path / 'run'}"))
    rows = read_metrics(tmp_path / "run")
    assert_rollout_matches_trainer(rows, 1)
    # one step, before any update: the same weights in float32 (measured 3e-9 on both engines; 4.7e-3 when the
    # engine ran config.json's eps)
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-6


def test_a_start_that_fails_in_a_worker_gives_back_its_processes_and_pool(tmp_path, ray_session):
    """A model whose weights cannot load passes the driver's checks (they read its config and tokenizer) and fails
    in the worker's init_model: the run stops naming it, and the Ray it ran on is left as it was (the next run of
    a notebook or of this test session places its pools there): no placement group held, no pool of this process
    placed, every CPU free again."""
    import shutil
    import time

    from ray.util import placement_group_table

    from pyrl.controller.worker_group import _PLACED
    from pyrl.models import resolve_model_path
    from pyrl.ppo import run_ppo

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("pyrl:tiny", "model"), model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    cpus = ray_session.cluster_resources()["CPU"]
    config = compose(*[o for o in SMALL if not o.startswith("actor_rollout_ref.model.path=")],
                     f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=hf",
                     "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'run'}")
    with pytest.raises(Exception, match="init_model"):
        run_ppo(config)
    assert not _PLACED
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    deadline = time.monotonic() + 30  # Ray frees a killed actor's CPUs asynchronously
    while ray_session.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_session.available_resources().get("CPU", 0) == cpus


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_verl_command_line_trains_with_verls_defaults(engine, tmp_path, ray_session):
    """Nothing but data, model, sizes and the logger named, as a verl user would: verl 0.9.1's defaults for the
    rest (gae with a critic, unfused log-probs, gradient checkpointing, the engine's log-probs checked against
    the trainer's, vLLM's dummy load and CUDA-graph setting), two steps."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    from pyrl.data import toy_task_files
    from pyrl.ppo import run_ppo

    train, val, _ = toy_task_files()
    config = compose(f"data.train_files={train}", f"data.val_files={val}", "data.val_max_samples=16",
                     "data.max_prompt_length=32", "data.max_response_length=8", "data.train_batch_size=4",
                     "actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     f"actor_rollout_ref.rollout.name={engine}", "trainer.total_training_steps=2",
                     "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={tmp_path}")
    assert config.algorithm.adv_estimator == "gae" and not config.actor_rollout_ref.model.use_fused_kernels
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val-core/pyrl/toy_addition/acc/mean@1" in rows[0]  # val_before_train, as verl
    for key in ("critic/vf_loss", "actor/pg_loss", "training/rollout_probs_diff_mean", "rollout_corr/kl",
                "timing_s/old_log_prob"):
        assert key in rows[-1], key
    # bf16 training compute (this CPU has it) against the fp32 rollout: ~1e-3; fp32 on both sides: ~1e-7
    assert rows[-1]["training/rollout_probs_diff_mean"] < 5e-3


def test_a_grpo_run_with_two_ranks_sharing_a_tensor_parallel_vllm_engine(tmp_path, ray_session):
    """verl's typical GRPO command line sets rollout.tensor_model_parallel_size=2: here 2 CPU workers train over
    FSDP and generate with one vLLM engine split over both (vLLM's external launcher over the workers' gloo world).
    In float32 on both sides the engine's log-probs equal the trainer's: every pushed weight reached both halves."""
    pytest.importorskip("vllm")
    from pyrl.ppo import run_ppo

    fp32 = [f"actor_rollout_ref.{role}.fsdp_config.dtype=float32" for role in ("actor", "ref")]
    config = compose(*SMALL, *fp32, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.calculate_log_probs=true",
                     "trainer.n_cpu_workers_per_node=2", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "trainer.total_training_steps=2",
                     "trainer.test_freq=2", f"trainer.default_local_dir={tmp_path}")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["training/rollout_probs_diff_mean"] < 1e-4 and row["actor/kl_loss"] >= 0
        assert 0 < row["perf/mfu/gen"] < 1 and row["response_length/mean"] > 0
    assert "val-core/pyrl/toy_addition/acc/mean@1" in rows[-1]


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], "tensor_model_parallel_size=0: expected 1"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=hf",
      "trainer.n_cpu_workers_per_node=2"], "tensor_model_parallel_size=2 needs actor_rollout_ref.rollout.name=vllm"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
      "trainer.n_cpu_workers_per_node=3", "data.train_batch_size=12",
      "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     "the 3 rollout worker processes per node .* do not split into groups of 2"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.free_cache_engine=false",
      "actor_rollout_ref.rollout.calculate_log_probs=true", "rollout.n_cpu_workers_per_node=2"],
     "tensor-parallel rollout across nodes: not implemented in pyrl .*=4 with 2 rollout workers per node "
     "\\(rollout.n_gpus_per_node, or rollout.n_cpu_workers_per_node on CPU\\)"),
])
def test_rollout_tensor_parallelism_that_cannot_run_stops_at_start(overrides, message):
    from pyrl.trainer.checks import check_config
    from pyrl.trainer.run_plan import resolve_run_plan

    config = compose(*SMALL, "trainer.n_gpus_per_node=0", *overrides)
    with pytest.raises(ValueError, match=message):
        check_config(config, resolve_run_plan(config))


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.ref.fsdp_config.fsdp_size=3", "trainer.n_cpu_workers_per_node=4"],
     "actor_rollout_ref.ref.fsdp_config.fsdp_size=3: expected -1 \\(shard over all 4 ranks\\) or a divisor of 4"),
    (["critic.fsdp.fsdp_size=0", "trainer.n_cpu_workers_per_node=2", "algorithm.adv_estimator=gae"],
     "critic.fsdp.fsdp_size=0: expected -1 \\(shard over all 2 ranks\\) or a divisor of 2"),
])
def test_fsdp_sizes_that_do_not_divide_the_ranks_stop_at_start(overrides, message):
    from pyrl.trainer.checks import check_config
    from pyrl.trainer.run_plan import resolve_run_plan

    def checked(config):
        check_config(config, resolve_run_plan(config))

    with pytest.raises(ValueError, match=message):
        checked(compose(*SMALL, "trainer.n_gpus_per_node=0", *overrides))
    for size in (-1, 1, 2, 8):  # verl's readings: every rank; groups of 1 or 2; at least the world: every rank
        checked(compose(*SMALL, "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=2",
                        "algorithm.adv_estimator=gae", f"critic.fsdp.fsdp_size={size}"))
    # a model that does not run ignores its section, as in verl (grpo: no critic)
    checked(compose(*SMALL, "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=2",
                    "critic.fsdp.fsdp_size=0"))


def test_verl_command_lines_are_accepted():
    config = compose("data.train_batch_size=256", "actor_rollout_ref.actor.optim.lr=1e-6",
                     "trainer.project_name=MyExperiment", "algorithm.adv_estimator=grpo", "trainer.logger=['wandb']",
                     "data.train_files=/data/train.parquet", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
                     "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "trainer.total_epochs=15",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
                     "reward.custom_reward_function.path=my_reward.py",
                     "reward.custom_reward_function.name=compute_reward",
                     "data.custom_cls.path=my_module.py", "data.custom_cls.name=MyDataset")
    assert config.data.train_batch_size == 256 and config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert config.trainer.project_name == "MyExperiment" and config.algorithm.adv_estimator == "grpo"
    assert config.trainer.logger == ["wandb"] and config.critic.model.path == config.actor_rollout_ref.model.path
    assert config.actor_rollout_ref.rollout.prompt_length == config.data.max_prompt_length
    assert config.reward.custom_reward_function.name == "compute_reward"


def test_fast_paths_default_on_where_they_give_the_same_numbers(caplog):
    """model.use_fused_kernels and actor.use_prefix_grouper default to null, resolved at start: fused log-probs for
    the actor (the critic has no LM head), shared prompts when there are several samples of packed sequences; an
    explicit value is kept; one log line names what was chosen."""
    import logging

    from pyrl.ppo import resolve_fast_paths

    def resolved(*overrides):
        config = compose("data.train_files=d.parquet", "actor_rollout_ref.model.path=m", *overrides)
        with caplog.at_level(logging.INFO, logger="pyrl"):
            caplog.clear()
            resolve_fast_paths(config)
        return (config.actor_rollout_ref.model.use_fused_kernels, config.actor_rollout_ref.actor.use_prefix_grouper,
                config.critic.model.use_fused_kernels, caplog.text)

    fused, shared, critic, text = resolved("actor_rollout_ref.rollout.n=8")
    assert (fused, shared, critic) == (True, True, False)
    assert "actor_rollout_ref.model.use_fused_kernels=true, actor_rollout_ref.actor.use_prefix_grouper=true" in text
    assert resolved()[:3] == (True, False, False)  # n = 1: nothing to share
    assert resolved("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.model.use_remove_padding=false")[:3] == (
        True, False, False)
    fused, shared, _, text = resolved("actor_rollout_ref.rollout.n=8",
                                      "actor_rollout_ref.model.use_fused_kernels=false",
                                      "actor_rollout_ref.actor.use_prefix_grouper=false")
    assert (fused, shared, text) == (False, False, "")


def test_builtin_task_files_by_name_and_split():
    """data.train_files=pyrl:<task> is the task's train split (and its val split for validation unless
    data.val_files is given); pyrl:<task>:<split> names a split, the held-out test one included; unknown tasks and
    splits stop the run naming the key and what exists."""
    from pyrl.data import tool_calc_task_files, toy_task_files
    from pyrl.ppo import resolve_builtin_files

    tool, toy = tool_calc_task_files(), toy_task_files()
    for overrides, train, val in ((["data.train_files=pyrl:tool_calc"], tool.train, tool.val),
                                  (["data.train_files=pyrl:tool_calc", "data.val_files=pyrl:tool_calc:test"],
                                   tool.train, tool.test),
                                  (["data.train_files=pyrl:toy_addition:train",
                                    "data.val_files=pyrl:toy_addition:test"],
                                   toy.train, toy.test),
                                  (["data.train_files=/data/x.parquet", "data.val_files=pyrl:toy_addition:val"],
                                   "/data/x.parquet", toy.val)):
        config = compose(*overrides)
        resolve_builtin_files(config)
        assert (config.data.train_files, config.data.val_files) == (train, val), overrides
    for override, message in (("data.train_files=pyrl:sudoku",
                               "data.train_files='pyrl:sudoku': pyrl's built-in tasks"),
                              ("data.val_files=pyrl:tool_calc:dev",
                               "data.val_files='pyrl:tool_calc:dev': no split 'dev'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_builtin_files(compose(override))


@pytest.mark.parametrize("override", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                      "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
                                      "critic.checkpoint.load_contents=[model,optimizer,extra,lora]",
                                      "actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron",
                                      "actor_rollout_ref.rollout.mode=server",
                                      "actor_rollout_ref.actor.fsdp_config.forward_only=true"])
def test_verl_values_pyrl_does_not_implement_stop_the_run(override):
    from pyrl.config import check_supported

    key = override.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(key) + ".* is not supported.*"):
        check_supported(compose(override))
    check_supported(compose("actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",  # verl's defaults pass
                            "critic.strategy=fsdp2",
                            "actor_rollout_ref.rollout.mode=async",
                            "critic.checkpoint.save_contents=[optimizer,model,extra,hf_model]"))


def test_without_vllm_the_hf_engine_generates_and_says_so(monkeypatch, caplog):
    from pyrl.ppo import resolve_defaults

    monkeypatch.setitem(sys.modules, "vllm", None)  # what find_spec sees when vLLM is not installed
    config = compose("preset=toy")
    with caplog.at_level("WARNING", logger="pyrl"):
        resolve_defaults(config)
    assert config.actor_rollout_ref.rollout.name == "hf"
    assert [r.getMessage() for r in caplog.records] == [
        "vLLM is not installed: generating with the hf engine (transformers generate) instead"]
    assert config.data.train_files and config.data.val_files  # the toy task, made if missing


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def good_row(content="03+47="):
    return {"data_source": "pyrl/toy_addition", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": "50"}}


@pytest.mark.parametrize("case", ["unknown_key", "added_unknown_key", "verl_feature", "ill_typed", "missing_prompt",
                                  "wrong_type", "empty_file", "empty_table", "overlong_error", "full_error"])
def test_bad_input_fails_clearly_and_writes_nothing(case, tmp_path):
    """Each error found before the workers start is the last line of stderr, alone, with no traceback, and the
    exit code is 2; HYDRA_FULL_ERROR=1 brings the traceback back."""
    run_dir = tmp_path / "run"
    args = [*SMALL, f"trainer.default_local_dir={run_dir}"]
    data = tmp_path / "train.parquet"
    expect = {
        "unknown_key": (["data.nope=1"], "nope"),
        "added_unknown_key": (["+data.nope=1"], "unknown config key: data.nope"),
        "full_error": (["+data.nope=1"], "unknown config key: data.nope"),
        "verl_feature": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                         "NotImplementedFeature: Megatron strategy: not implemented in pyrl (actor_rollout_ref.actor."
                         "megatron.tensor_model_parallel_size=2 asks for it; see README: Not supported)"),
        "ill_typed": (["data.train_batch_size=abc"], "train_batch_size"),
        "missing_prompt": ([], "missing column 'prompt'"),
        "wrong_type": ([], "row 0: column 'prompt' must be a non-empty list"),
        "empty_file": ([], "not a readable parquet file"),
        "empty_table": ([], "has no rows"),
        "overlong_error": (["data.max_prompt_length=8"], "row 0: the prompt has"),
    }[case]
    if case == "missing_prompt":
        write_parquet(data, [{"data_source": "pyrl/toy_addition", "question": "1+1="}])
    elif case == "wrong_type":
        write_parquet(data, [{"data_source": "a", "prompt": [1, 2]}, {"data_source": "a", "prompt": [3]}])
    elif case == "empty_file":
        data.write_bytes(b"")
    elif case == "empty_table":
        pq.write_table(pa.table({"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), data)
    else:
        write_parquet(data, [good_row("1234567890 " * 3), good_row()])
    if case not in ("unknown_key", "added_unknown_key", "verl_feature", "ill_typed", "full_error"):
        args += [f"data.train_files={data}", f"data.val_files={data}"]
    if case in ("missing_prompt", "wrong_type", "empty_file", "empty_table"):
        # the data's checks, in this process (a fresh one costs ~10 s of imports and tokenizer): the command line
        # turns their errors into its last line as it does overlong_error's, which goes through it
        from pyrl.ppo import run_ppo

        with pytest.raises(ValueError, match=re.escape(expect[1])) as raised:
            run_ppo(compose(*args, *expect[0]))
        assert case == "empty_table" or str(data) in str(raised.value)  # the message names the file
        assert not run_dir.exists()
        return
    proc = run_cli(args + expect[0], cwd=tmp_path, timeout=300,
                   env={"HYDRA_FULL_ERROR": "1" if case == "full_error" else "0"})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    if case == "full_error":
        assert "Traceback" in proc.stderr and expect[1] in last
    else:
        assert (proc.returncode == 2
                and last.startswith("pyrl: stopped before any worker started: ")), proc.stderr[-2000:]
        assert expect[1] in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists()


def test_reward_model_loggers_and_generation_dumps(tmp_path, ray_session, monkeypatch):
    """reward_model.enable with a model (the tiny one with a fresh score head) scores training and validation
    samples (verl 0.9.1's _validate scores with the reward model too). All four loggers at once; every training and
    validation sample dumped; three validation samples shown."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pyrl.ppo import run_ppo

    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    config = compose(*SMALL, "actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "actor_rollout_ref.rollout.name=hf",
                     "trainer.total_training_steps=2", "trainer.val_before_train=true", "trainer.test_freq=2",
                     f"trainer.default_local_dir={run_dir}", "reward_model.enable=true",
                     "reward_model.model.path=pyrl:tiny", "trainer.logger=[console,jsonl,wandb,tensorboard]",
                     f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                     f"trainer.validation_data_dir={tmp_path / 'validation'}", "trainer.log_val_generations=3")
    run_ppo(config)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    val_key = "val-core/pyrl/toy_addition/reward/mean@1"  # no reward function ran: no acc
    for step, row in zip((1, 2), rows[1:]):
        dumped = [json.loads(line) for line in open(tmp_path / "rollouts" / f"{step}.jsonl")]
        assert len(dumped) == 8 * 4 and {d["step"] for d in dumped} == {step}
        scores = [d["score"] for d in dumped]
        assert np.mean(scores) == pytest.approx(row["critic/score/mean"], rel=1e-6)
        assert any(s not in (0.0, 1.0) for s in scores)  # the reward model's scores, not the rule's 0/1
        assert all(re.search(r"\d+\+\d+=", d["input"]) and d["gts"].isdigit() for d in dumped)
    for step, row in ((0, rows[0]), (2, rows[2])):
        dumped = [json.loads(line) for line in open(tmp_path / "validation" / f"{step}.jsonl")]
        assert len(dumped) == 256 and any(d["score"] not in (0.0, 1.0) for d in dumped)  # the model's scores
        assert np.mean([d["score"] for d in dumped]) == pytest.approx(row[val_key], rel=1e-6)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = events.Scalars("critic/score/mean")  # float32 in the event file
    assert [e.step for e in logged] == [1, 2]
    assert [e.value for e in logged] == pytest.approx([r["critic/score/mean"] for r in rows[1:]], rel=1e-6)
    assert [e.step for e in events.Tensors("val/generations/text_summary")] == [0, 2]
    tables = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "table" / "val" / "*.table.json"))
    assert sorted(len(json.load(open(t))["data"]) for t in tables) == [3, 3]
