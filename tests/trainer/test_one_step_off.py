"""One-step-off-policy rollout (actor_rollout_ref.hybrid_engine=false): the rollout's own worker generates batch
k+1 with the weights of step k-1 while the actor trains on batch k. One uninterrupted run (real Ray workers: an
FSDP actor process and an hf-engine rollout process) serves three checks: each stored batch's rollout log-probs
equal an independent HF forward's under the weights of two steps before, not one (so the push delivered those
weights, and the schedule is one step off); the trainer's own staleness metric is fp32 noise at step 1 and not
after; a run killed after its step-2 checkpoint and started again reproduces it. The run uses dynamic sampling on
a field of what the reward function returns (more prompts drawn while the batch fills, in the background), so a
checkpoint must hold the sampler as the batch in flight left it, and the rollout dump the reward's fields also for
a batch a resumed run took from its checkpoint. Bad settings stop at start."""

import json
import subprocess
import sys

import pytest
import torch
from trainer_helpers import compose, kill_after_checkpoint, read_metrics, run_cli

ARGS = ["preset=toy", "actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false", "trainer.test_freq=2", "trainer.total_training_steps=4",
        "trainer.save_freq=1", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.optim.lr=0.0005", "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.free_cache_engine=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/entropy", "actor/grad_norm", "actor/lr", "critic/advantages/max", "training/rollout_probs_diff_mean",
            "rollout_corr/kl", "val-core/pyrl/toy_addition/acc/mean@1", "training/num_gen_batches"]
SCORER = """from pyrl.rewards import default_compute_score
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = default_compute_score(data_source, solution_str, ground_truth)
    return {'score': score, 'acc': score, 'format': float('<answer>' in solution_str)}
"""


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    """ARGS with a scorer returning fields besides the score, dynamic sampling on one of them, the rollout dump.
    Drawing is capped: a policy whose groups all score alike (at lr 0.002 this one collapsed by step 3 on an Ice Lake
    CPU, which trains the warm-start to other weights than a Sapphire Rapids one, and drew 12,747 batches for step 4)
    stops the run with dynamic sampling's error instead of spinning until the test's timeout."""
    base = tmp_path_factory.mktemp("one_step_off")
    (base / "scorer.py").write_text(SCORER)
    return base, ARGS + [f"reward.custom_reward_function.path={base / 'scorer.py'}",
                         "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                         "algorithm.filter_groups.max_num_gen_batches=100"]


def rollout_dump(run_dir) -> str:
    return f"trainer.rollout_data_dir={run_dir / 'rollouts'}"


@pytest.fixture(scope="module")
def full_run(run_args):
    base, args = run_args
    proc = run_cli(args + [f"trainer.default_local_dir={base / 'full'}", rollout_dump(base / "full")], cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "full"


def response_log_probs(model_dir, batch) -> torch.Tensor:
    """log p(response token) under the HF model in model_dir (float64 softmax), [B, R]; the reference the rollout's
    log-probs are held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    responses = batch.batch["responses"]
    width = responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits
    logp = logits[:, -width - 1:-1].double().log_softmax(-1)  # the toy preset samples at temperature 1
    return logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def test_each_batch_is_generated_with_the_weights_of_two_steps_before(full_run):
    from pyrl.models import resolve_model_path

    weights = {0: resolve_model_path("pyrl:tiny-toy-sft")}
    weights.update({k: str(full_run / f"global_step_{k}" / "actor" / "huggingface") for k in (1, 2, 3)})
    for saved_at in (1, 2, 3):  # the checkpoint of step k holds batch k+1, generated with the weights of step k-1
        state = torch.load(full_run / f"global_step_{saved_at}" / "data.pt", weights_only=False)
        nxt = state["next_batch"]
        assert nxt["step"] == saved_at + 1
        batch, mask = nxt["batch"], nxt["batch"].batch["response_mask"].bool()
        rollout = batch.batch["rollout_log_probs"].double()[mask]
        generating = response_log_probs(weights[saved_at - 1], batch)[mask]
        current = response_log_probs(weights[saved_at], batch)[mask]
        assert (rollout - generating).abs().max() < 1e-4, f"batch {saved_at + 1} vs the weights of step {saved_at - 1}"
        staleness = (rollout - current).abs().mean()
        assert staleness > 1e-3, (f"batch {saved_at + 1}: step {saved_at}'s weights give the same log-probs "
                                  f"({staleness})")
    last = torch.load(full_run / "global_step_4" / "data.pt", weights_only=False)
    assert last["next_batch"] is None  # the last step starts no generation


def test_a_checkpoint_holds_the_sampler_after_the_batch_in_flight(full_run):
    """The checkpoint of step k holds batch k+1 and the sampler past every prompt drawn for it (dynamic sampling
    draws train_batch_size prompts per generation batch): a resumed run draws batch k+2's prompts next."""
    gen_batches = [r["training/num_gen_batches"] for r in read_metrics(full_run)]
    assert max(gen_batches) > 1  # dynamic sampling drew more prompts in some step
    for saved_at in (1, 2, 3):
        state = torch.load(full_run / f"global_step_{saved_at}" / "data.pt", weights_only=False)
        drawn = sum(gen_batches[:saved_at]) + state["next_batch"]["metrics"]["training/num_gen_batches"]
        assert state["sampler"]["epoch"] == 0 and state["sampler"]["position"] == 8 * drawn, saved_at


def test_metrics_show_the_staleness_and_the_overlap(full_run):
    rows = read_metrics(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 1 trains on a batch of the weights it holds (fp32 rounding); later steps on one update older ones
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-4
    assert all(r["training/rollout_probs_diff_mean"] > 1e-3 for r in rows[1:])
    assert "timing_s/generate_async" not in rows[0] and all("timing_s/generate_async" in r for r in rows[1:])
    # a push when a step starts after an update, or before validating (test_freq=2): step 3's batch-4 generation
    # started with the weights step 2's validation had pushed
    pushed = [r["step"] for r in rows if "timing_s/update_weights" in r and r["perf/update_weights_bytes"] > 0]
    assert pushed == [2, 4]
    assert all("rollout_corr/rollout_is_mean" in r for r in rows)
    assert [r["training/epoch"] for r in rows] == [0, 0, 0, 0]


def test_kill_and_resume_reproduces_the_uninterrupted_run(full_run, run_args):
    base, args = run_args
    part = base / "part"
    kill_after_checkpoint(args + [rollout_dump(part)], part, 2, cwd=base)
    proc = run_cli(args + [f"trainer.default_local_dir={part}", rollout_dump(part)], cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, resumed = read_metrics(full_run), read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(reference[2:], resumed[2:]):
        for key in COMPARED:
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["step"], key)
    assert "val-core/pyrl/toy_addition/acc/mean@1" in resumed[3]
    # the same samples (prompts' uids: the sampler's places) with the reward's fields, step 3's batch taken from
    # the checkpoint included
    for step in (3, 4):
        want, got = ((run / "rollouts" / f"{step}.jsonl").read_text().splitlines() for run in (full_run, part))
        assert [json.loads(line) for line in got] == [json.loads(line) for line in want], step
        assert all({"acc", "format", "uid"} <= json.loads(line).keys() for line in got), step


def test_the_one_step_off_entry_trains_with_verls_defaults(tmp_path, ray_session):
    """verl's one_step_off_ppo_trainer defaults (bypass mode: the rollout's log-probs are the old ones), run."""
    from pyrl.ppo import run_ppo

    config = compose("preset=toy", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
                     "trainer.test_freq=-1", "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=hf",
                     f"trainer.default_local_dir={tmp_path}", config_name="one_step_off_ppo_trainer")
    arr = config.actor_rollout_ref
    assert not arr.hybrid_engine and not arr.rollout.free_cache_engine and arr.rollout.calculate_log_probs
    assert config.algorithm.rollout_correction.bypass_mode and config.rollout.nnodes == 1
    assert arr.rollout.checkpoint_engine.backend == "nccl"
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert "timing_s/old_log_prob" not in rows[1] and "actor/rollout_corr/kl" in rows[1]
    assert "timing_s/generate_async" in rows[1]
    entry = subprocess.run([sys.executable, "-m", "pyrl.experimental.one_step_off_policy.main_ppo", "--cfg", "job"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert entry.returncode == 0 and "hybrid_engine: false" in entry.stdout, entry.stderr[-2000:]


def test_without_the_rollouts_log_probs_the_old_ones_are_the_trainers(tmp_path, ray_session, caplog):
    """rollout.calculate_log_probs=false (no bypass, IS or rejection): as verl 0.9.1's one-step-off trainer, the
    old-log-prob pass recomputes them with the current policy and nothing corrects the staleness; said at start."""
    from pyrl.ppo import run_ppo

    config = compose("preset=toy", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
                     "trainer.test_freq=-1", "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.rollout.calculate_log_probs=false",
                     "algorithm.rollout_correction.bypass_mode=false", f"trainer.default_local_dir={tmp_path}",
                     config_name="one_step_off_ppo_trainer")
    with caplog.at_level("INFO", logger="pyrl"):
        run_ppo(config)
    assert "the old log-probs are the trainer's (the current policy's)" in caplog.text
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # two mini-batches: the pass runs
        assert "timing_s/old_log_prob" in row and "timing_s/generate_async" in rows[1]
        assert not any(key.startswith(("training/rollout_probs_diff", "actor/rollout_corr/")) for key in row)


def test_a_rollout_pool_of_tensor_parallel_vllm_engines(tmp_path, ray_session):
    """The rollout's own two workers share one vLLM engine (rollout.tensor_model_parallel_size=2): they form a
    process group for it, load each pushed weight into their halves, and generate one batch ahead of the trainer."""
    pytest.importorskip("vllm")
    from pyrl.ppo import run_ppo

    config = compose("preset=toy", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
                     "trainer.test_freq=-1", "trainer.total_training_steps=3", "actor_rollout_ref.rollout.name=vllm",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout.n_cpu_workers_per_node=2",
                     "algorithm.rollout_correction.bypass_mode=false", f"trainer.default_local_dir={tmp_path}",
                     config_name="one_step_off_ppo_trainer")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["response_length/mean"] > 0 and row["training/rollout_probs_diff_valid"] == 1
    # the first batch is generated before any update, by the weights the trainer starts from: bf16 rounding only
    assert rows[0]["training/rollout_probs_diff_mean"] < 5e-3


OFF = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.free_cache_engine=false",
       "actor_rollout_ref.rollout.calculate_log_probs=true"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.nnodes=2"], "rollout.nnodes=2: the rollout has workers of its own only with "
                           "actor_rollout_ref.hybrid_engine=false"),
    (["actor_rollout_ref.hybrid_engine=false"], "free_cache_engine=true: .* set it to false"),
    (OFF + ["rollout.n_gpus_per_node=0", "rollout.n_cpu_workers_per_node=0"],
     "rollout.n_cpu_workers_per_node must be >= 1"),
    (OFF + ["rollout.nnodes=0"], "rollout.nnodes=0: the rollout needs at least one node"),
    (OFF + ["trainer.n_gpus_per_node=0", "rollout.n_gpus_per_node=2"], "both on GPUs or both on CPU"),
])
def test_bad_settings_stop_the_run_at_start(overrides, message):
    from pyrl.ppo import resolve_defaults

    config = compose("preset=toy", "actor_rollout_ref.model.path=pyrl:tiny", *overrides)
    with pytest.raises(ValueError, match=message):
        resolve_defaults(config)
