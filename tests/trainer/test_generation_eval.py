"""Batch generation and evaluation (pyrl.trainer.main_generation_server, pyrl.trainer.main_eval), verl 0.9.1's entry
points: the generations against transformers' own greedy generate, the output's layout, the refusals before any
worker starts, pass@k against enumerating every draw, and the metrics by hand."""

import itertools
import math
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyrl.trainer import main_eval

N_ROWS = 5  # odd: the two ranks and the calls of 3 prompts are padded


def run_module(module: str, args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """The toy task's first held-out rows, with a column of pyrl's own (every column must come back)."""
    from pyrl.data import toy_task_files

    table = pq.read_table(toy_task_files().test).slice(0, N_ROWS)
    table = table.append_column("row_note", pa.array([f"note {i}" for i in range(N_ROWS)]))
    path = tmp_path_factory.mktemp("generation") / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def greedy_reference(prompts_file):
    """transformers' greedy generate of each prompt, alone, in float32, with the chat template as the trainer
    renders it: what a greedy engine must answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.models import resolve_model_path

    path = resolve_model_path("pyrl:tiny-toy-sft", "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    answers = []
    for messages in pq.read_table(prompts_file).column("prompt").to_pylist():
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


GENERATE = ["actor_rollout_ref.model.path=pyrl:tiny-toy-sft", "trainer.n_gpus_per_node=0",
            "trainer.n_cpu_workers_per_node=2", "data.train_batch_size=3", "data.max_prompt_length=32",
            "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.enforce_eager=true"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_greedy_generations_are_transformers_own(prompts_file, greedy_reference, tmp_path, engine):
    """Temperature 0, n = 1, two CPU ranks, calls of 3 prompts: each row's one response is what transformers'
    greedy generate answers for that prompt alone, on both engines; the input's rows and columns come back in
    order. verl's command-line spelling +data.output_path is taken."""
    out = tmp_path / "greedy.parquet"
    proc = run_module("pyrl.trainer.main_generation_server",
                      [*GENERATE, f"data.train_files={prompts_file}", f"actor_rollout_ref.rollout.name={engine}",
                       "actor_rollout_ref.rollout.temperature=0", f"+data.output_path={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, source = pq.read_table(out), pq.read_table(prompts_file)
    assert table.column_names == source.column_names + ["responses"]
    assert table.drop_columns(["responses"]).equals(source)
    assert table.column("responses").to_pylist() == [[answer] for answer in greedy_reference]
    assert "generated for 5 / 5 prompts (1 samples each)" in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def sampled(prompts_file, tmp_path_factory, ray_session):
    """n = 4 samples at temperature 1 with the hf engine: the file main_eval reads; generated in this process
    (the command line runs in the greedy tests), recording which keys of the config pyrl's code read (in the driver
    and the workers: tests/config_reads.py)."""
    import config_reads
    import ray.cloudpickle
    from trainer.trainer_helpers import compose

    import pyrl.ppo
    from pyrl.trainer.main_generation_server import run_generation

    out = tmp_path_factory.mktemp("sampled") / "sampled.parquet"
    record = out.parent / "reads.txt"
    ray.cloudpickle.register_pickle_by_value(config_reads)  # the workers cannot import tests/
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pyrl.ppo, "OmegaConf", config_reads.RecordingOmegaConf)
            config = compose(*GENERATE, f"data.train_files={prompts_file}", "actor_rollout_ref.rollout.name=hf",
                             "actor_rollout_ref.rollout.n=4", f"data.output_path={out}")
            run_generation(config_reads.record_reads(config, str(record)))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(config_reads)
        config_reads.restore_replace()
    return out, config_reads.read_keys(str(record))


# what batch generation leaves unread of the PPO config (the trainer's command line it takes), each with why; a key
# or a section (a prefix ending in ".")
TRAINING = "training, scoring and their loop: generation trains and scores nothing (main_eval scores its output)"
GENERATION_UNREAD = {
    **{section: TRAINING for section in (
        "actor_rollout_ref.actor.", "actor_rollout_ref.ref.", "critic.", "reward.", "reward_model.",
        "custom_reward_function.", "algorithm.", "distillation.", "sandbox_fusion.", "data.reward_fn_key",
        "data.val_batch_size", "data.val_max_samples", "actor_rollout_ref.rollout.val_kwargs.")},
    **{f"trainer.{key}": "the training loop, its logging, validation and checkpoints: generation writes "
                         "data.output_path only" for key in (
        "balance_batch", "total_epochs", "total_training_steps", "project_name", "experiment_name", "logger",
        "log_val_generations", "rollout_data_dir", "validation_data_dir", "save_freq", "test_freq", "val_before_train",
        "val_only", "critic_warmup", "resume_mode", "resume_from_path", "default_local_dir", "max_actor_ckpt_to_keep",
        "max_critic_ckpt_to_keep")},
    "trainer.device": "read with trainer.n_gpus_per_node=-1 (the default: this machine's GPUs, of that device, "
                      "are counted); this run sets 0",
    "trainer.memory_plan": "the memory plan sizes training's phases (update, log-prob passes) against the device",
    "ray_kwargs.timeline_json_file": "a Ray timeline of the training steps",
    "rollout.": "one-step-off's rollout pool: generation's workers are trainer.nnodes x trainer.n_gpus_per_node, as "
                "verl's",
    "actor_rollout_ref.hybrid_engine": "whether the rollout shares the actor's processes: generation has no actor",
    **{f"actor_rollout_ref.model.{key}": "a LoRA the run would train, from zero (the base model answers as the "
                                         "policy does at step 0); a trained adapter, lora_adapter_path, is refused"
       for key in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")},
    "actor_rollout_ref.model.enable_gradient_checkpointing": "the training forward's memory",
    "actor_rollout_ref.model.use_fused_kernels": "the training forward's log-prob kernel",
    **{f"actor_rollout_ref.rollout.{key}": "vLLM's engine options: read with rollout.name=vllm (this run uses hf; "
                                           "tests/test_config_keys.py's one-step-off run reads them)" for key in (
        "prompt_length", "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
        "enable_prefix_caching", "enforce_eager", "logprobs_mode", "max_model_len")},
    "actor_rollout_ref.rollout.engine_kwargs": "read with rollout.name=vllm (vLLM's own options); with hf, "
                                               "check_engine_kwargs refuses any set",
    **{f"actor_rollout_ref.rollout.{key}": "the rollout's log-prob pass (rollout.calculate_log_probs, for training's "
                                           "rollout correction): generation returns text only" for key in (
        "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")},
    "actor_rollout_ref.rollout.free_cache_engine": "read with rollout.name=vllm (its sleep mode); this run uses hf",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "the trainer's log-prob pass: generation computes none",
    "actor_rollout_ref.rollout.multi_turn.": "multi_turn.enable is refused (check_generation_config), so none of "
                                             "its options applies",
    "data.function_tool_path": "tools are for the agent loops, which are refused",
    **{f"data.{key}": "read with data.train_max_samples, to pick the rows kept; here every row is" for key in (
        "shuffle", "seed")},
    "data.custom_cls.name": "data.custom_cls.path is refused",
    "actor_rollout_ref.rollout.agent.num_workers": "the agent loops' workers: an agent loop other than "
                                                   "single_turn_agent is refused",
    "actor_rollout_ref.rollout.checkpoint_engine.": "the trainer-to-rollout weight transport: nothing is pushed",
    "actor_rollout_ref.rollout.do_sample": "read nowhere, as in verl 0.9.1's rollout: the temperature decides",
    "data.return_raw_chat": "read nowhere, as in verl 0.9.1's dataset: each prompt's messages are kept",
}


# keys under a GENERATION_UNREAD section that generation reads all the same, each with what for
READ_IN_UNREAD_SECTIONS = {
    "actor_rollout_ref.rollout.multi_turn.enable": "to refuse true (check_generation_config)",
    **{f"actor_rollout_ref.rollout.multi_turn.{key}": "a pyrl: built-in name resolved to its file, as for every "
                                                      "entry (pyrl.ppo.resolve_builtin_files)"
       for key in ("tool_config_path", "interaction_config_path")},
    "actor_rollout_ref.actor.data_loader_seed": "seeds torch in each worker as it starts (pyrl.workers.actor), as in "
                                                "training",
}


def test_generation_reads_every_key_it_does_not_document_or_refuse(sampled):
    """Every key of the PPO config batch generation takes is read by the code that acts on it (by its full path,
    in the driver or the workers; a read by pyrl/trainer/checks.py alone does not count), or stopped at start when
    it holds a value pyrl does not implement (pyrl.config.LIMITS, for the sections generation acts on), or in
    GENERATION_UNREAD with why; no key an entry there covers is one the run reads, but READ_IN_UNREAD_SECTIONS'
    (each of them read)."""
    from config_reads import leaves, with_interpolation_sources

    from pyrl.config import LIMITS
    from pyrl.trainer.main_generation_server import acts_on

    _, reads = sampled
    # rollout.response_length read: data.max_response_length, its default, is read
    acting = with_interpolation_sources({key for key, files in reads.items() if files - {"trainer/checks.py"}})

    def documented(key):
        return key in GENERATION_UNREAD or any(key.startswith(p) for p in GENERATION_UNREAD if p.endswith("."))

    keys = list(leaves())
    unread = [k for k in keys if k not in acting and not (k in LIMITS and acts_on(k)) and not documented(k)]
    assert not unread, f"keys generation neither reads, refuses nor documents in GENERATION_UNREAD: {unread}"
    assert all(any(k == p or k.startswith(p) for k in keys) for p in GENERATION_UNREAD), "an entry names no key"
    stale = [k for k in keys if documented(k) and k in acting and k not in READ_IN_UNREAD_SECTIONS]
    assert not stale, f"GENERATION_UNREAD covers keys generation reads: {stale}"
    assert set(READ_IN_UNREAD_SECTIONS) <= acting, set(READ_IN_UNREAD_SECTIONS) - acting


def test_sampled_generations_and_their_evaluation(sampled, tmp_path):
    """Four strings per row; main_eval's metrics equal the toy scorer's verdicts counted by hand (a response
    scores 1 when its <answer> is the sum)."""
    sampled, _ = sampled
    table = pq.read_table(sampled)
    responses = table.column("responses").to_pylist()
    truths = [r["ground_truth"] for r in table.column("reward_model").to_pylist()]
    assert [len(r) for r in responses] == [4] * N_ROWS and all(isinstance(s, str) for r in responses for s in r)
    correct = [[s.strip() == f"<answer>{t}</answer>" for s in r] for r, t in zip(responses, truths)]
    proc = run_module("pyrl.trainer.main_eval", [f"data.path={sampled}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = eval(proc.stdout.strip().splitlines()[-1])  # the dict, printed as verl prints it
    source = table.column("data_source")[0].as_py()
    assert metrics[f"test_score/{source}"] == pytest.approx(sum(sum(c) / 4 for c in correct) / N_ROWS)
    for k in (1, 2, 4):
        by_hand = sum(1 - math.comb(4 - sum(c), k) / math.comb(4, k) for c in correct) / N_ROWS
        assert metrics[f"pass@{k}/{source}"] == pytest.approx(by_hand)


@pytest.mark.parametrize("args, message", [
    (["data.train_files=x.parquet"], "data.output_path: where to write the generations"),
    (["data.output_path=o.parquet", "trainer.device=gpu"], "trainer.device='gpu' is not supported"),
    (["data.output_path=o.parquet", "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.n=2"],
     "actor_rollout_ref.rollout.n=2 with temperature=0"),
    (["data.output_path=o.parquet", "data.filter_overlong_prompts=true"], "would drop rows from the output"),
    (["data.output_path=o.parquet", "actor_rollout_ref.model.path=/nonexistent/model"],
     "actor_rollout_ref.model.path='/nonexistent/model': no such directory"),
    (["data.output_path=o.parquet", "actor_rollout_ref.model.path=pyrl:tiny", "data.max_prompt_length=500",
      "data.max_response_length=100"], "exceeds actor_rollout_ref.model.path's max_position_embeddings=512"),
    (["data.output_path=o.parquet", "actor_rollout_ref.rollout.name=hf",
      "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"],
     "engine_kwargs.vllm is set (swap_space) but the rollout engine is hf"),
])
def test_generation_refusals_before_any_worker(prompts_file, tmp_path, args, message):
    defaults = [f"data.train_files={prompts_file}"] if not any(a.startswith("data.train_files") for a in args) else []
    proc = run_module("pyrl.trainer.main_generation_server", [*defaults, *args], tmp_path, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_a_prompt_over_the_limit_is_named(prompts_file, tmp_path):
    proc = run_module("pyrl.trainer.main_generation_server",
                      [*GENERATE, f"data.train_files={prompts_file}", "data.max_prompt_length=4",
                       f"data.output_path={tmp_path / 'o.parquet'}"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "row 0: the prompt has" in proc.stderr and "data.max_prompt_length=4" in \
        proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi_turn.enable=true: generation is one assistant turn"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "default_agent_loop='tool_agent'"),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", "agent_loop_config_path='loops.yaml'"),
    ("data.custom_cls.path=my_dataset.py", "data.custom_cls.path='my_dataset.py': generation reads the rows"),
    ("actor_rollout_ref.model.lora_adapter_path=adapter", "lora_adapter_path='adapter': generation loads"),
    ("data.tokenizer=other", "data.tokenizer='other' is not supported"),  # pyrl.config.LIMITS, as the trainer's
])
def test_the_trainers_rollout_features_generation_lacks_are_refused(override, message):
    """A training command line reused for generation: what its rollout would do and generation cannot stops the
    run, naming the key (verl 0.9.1's generation ignores them)."""
    from trainer_helpers import compose

    from pyrl.trainer.main_generation_server import check_generation_config

    base = ["data.train_files=x.parquet", "data.output_path=o.parquet"]
    check_generation_config(compose(*base))  # the base passes
    # and so does a training section's value pyrl does not implement (a verl training command line reused here)
    check_generation_config(compose(*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                    "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_generation_config(compose(*base, override))


def test_a_row_the_trainer_would_run_through_an_agent_loop_is_refused(prompts_file, tmp_path):
    from trainer_helpers import compose

    from pyrl.trainer.main_generation_server import PromptRows

    table = pq.read_table(prompts_file)
    loops = ["single_turn_agent", None, "tool_agent"] + ["single_turn_agent"] * (table.num_rows - 3)
    pq.write_table(table.append_column("agent_name", pa.array(loops, type=pa.string())), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=re.escape(f"data file {str(tmp_path / 'p.parquet')!r} row 2: agent_name "
                                                   f"'tool_agent'; generation is one assistant turn")):
        PromptRows(compose(f"data.train_files={tmp_path / 'p.parquet'}").data)


@pytest.mark.parametrize("shuffle", [False, True])
def test_train_max_samples_keeps_the_rows_the_trainer_would_train_on(prompts_file, shuffle):
    """data.train_max_samples=3 of the 5 rows: the ones RLHFDataset keeps (the first 3, or with data.shuffle a
    random 3 of data.seed), in file order, each still named by its row in the file; <= 0 keeps every row."""
    from trainer_helpers import compose

    from pyrl.data import RLHFDataset
    from pyrl.trainer.main_generation_server import PromptRows

    data = compose(f"data.train_files={prompts_file}", "data.train_max_samples=3", f"data.shuffle={shuffle}",
                   "data.seed=7").data
    rows = PromptRows(data)
    trainer_rows = sorted(row for _, row, _ in RLHFDataset(data.train_files, config=data, max_samples=3).rows)
    assert len(rows) == 3 and rows.table.column("row_note").to_pylist() == [f"note {i}" for i in trainer_rows]
    assert [rows.where(i) for i in range(3)] == [f"data file {str(prompts_file)!r} row {i}" for i in trainer_rows]
    if not shuffle:
        assert trainer_rows == [0, 1, 2]
    data.train_max_samples = -1
    assert PromptRows(data).table.column("row_note").to_pylist() == [f"note {i}" for i in range(N_ROWS)]


def test_the_ppo_trainer_refuses_the_generation_output_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pyrl.ppo", "data.output_path=o.parquet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is batch generation's output" in proc.stderr, proc.stderr[-2000:]


# ---- evaluation ----

def test_pass_at_k_is_the_chance_over_every_draw():
    """Against enumerating every k-subset of n responses without replacement."""
    for n in range(1, 7):
        for c in range(n + 1):
            passing = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(itertools.combinations(range(n), k))
                exact = sum(any(passing[i] for i in d) for d in draws) / len(draws)
                assert main_eval.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="k=0"):
        main_eval.pass_at_k(3, 1, 0)
    assert main_eval.ks_for(1) == [1] and main_eval.ks_for(4) == [1, 2, 4] and main_eval.ks_for(5) == [1, 2, 4, 5]


SCORER = '''
def judge(source, answer, truth, bonus=0.0):
    # verl calls it positionally: these names are the user's own
    if answer == "boom":
        raise RuntimeError("cannot score")
    if source == "dict_source":
        return {"score": 0.5 if answer == truth else 0.0, "acc": answer == truth}
    if source == "numpy_source":  # numpy's numbers and bools score as verl's np.mean takes them
        import numpy
        return numpy.bool_(answer == truth) if answer == "x" else numpy.float32(0.25)
    return (1.0 if answer == truth else 0.0) + bonus
'''


def generations(tmp_path, rows) -> str:
    path = tmp_path / "gens.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": s, "responses": r, "reward_model": {"ground_truth": t}}
                                         for s, r, t in rows]), path)
    return str(path)


def evaluate(**overrides):
    from omegaconf import OmegaConf

    config = OmegaConf.merge(OmegaConf.structured(main_eval.EvalConfig), OmegaConf.from_dotlist(
        [f"{k}={v}" for k, v in overrides.items()]))
    return main_eval.evaluate(OmegaConf.to_object(config))


def test_metrics_by_hand_with_a_users_scorer(tmp_path):
    """Rows of different sizes per source; a dict score passes by its acc (0.5 is below the 1.0 threshold), a plain
    score by reaching the threshold; reward_kwargs bound; test_score weighs rows alike; pass@k over the fewest
    responses a source's rows have."""
    scorer = tmp_path / "judge.py"
    scorer.write_text(SCORER)
    path = generations(tmp_path, [("a", ["1", "2", "1"], "1"), ("a", ["3", "3"], "4"),
                                  ("dict_source", ["x", "y"], "x"), ("numpy_source", ["x", "y"], "x")])
    metrics = evaluate(**{"data.path": path, "custom_reward_function.path": scorer,
                          "custom_reward_function.name": "judge"})
    assert metrics["test_score/a"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["pass@1/a"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["pass@2/a"] == pytest.approx((1 - math.comb(1, 2) / math.comb(3, 2) + 0) / 2)
    assert "pass@3/a" not in metrics  # a row of a has only 2
    assert metrics["test_score/dict_source"] == pytest.approx(0.25) and metrics["pass@2/dict_source"] == 1.0
    assert metrics["test_score/numpy_source"] == pytest.approx((1.0 + 0.25) / 2)
    kwargs = evaluate(**{"data.path": path, "reward.custom_reward_function.path": scorer,
                         "reward.custom_reward_function.name": "judge",
                         "reward.custom_reward_function.reward_kwargs.bonus": 1.0})
    assert kwargs["test_score/a"] == pytest.approx(metrics["test_score/a"] + 1) and kwargs["pass@1/a"] == 1.0


def test_evaluation_refusals_name_the_row_or_key(tmp_path):
    scorer = tmp_path / "judge.py"
    scorer.write_text(SCORER)
    fn = {"custom_reward_function.path": scorer, "custom_reward_function.name": "judge"}
    with pytest.raises(RuntimeError, match=r"row 1 response 0: the scorer failed \(RuntimeError: cannot score\)"):
        evaluate(**{"data.path": generations(tmp_path, [("a", ["1"], "1"), ("a", ["boom"], "1")]), **fn})
    with pytest.raises(ValueError, match="row 0: column 'responses' must be a non-empty list of strings"):
        evaluate(**{"data.path": generations(tmp_path, [("a", [], "1")]), **fn})
    with pytest.raises(ValueError, match="set one"):
        evaluate(**{"data.path": generations(tmp_path, [("a", ["1"], "1")]), **fn,
                    "reward.custom_reward_function.path": scorer})
    with pytest.raises(ValueError, match="missing column 'answers'"):
        evaluate(**{"data.path": generations(tmp_path, [("a", ["1"], "1")]), "data.response_key": "answers"})
    with pytest.raises(RuntimeError, match="data_source 'a': no rule-based scorer for it"):
        evaluate(**{"data.path": generations(tmp_path, [("a", ["1"], "1")])})


def test_the_eval_command_line_takes_verls_workaround_and_refuses_unknown_keys(tmp_path):
    """verl 0.9.1's main_eval needs +reward.custom_reward_function.* (its code reads there): taken; a key the
    schema lacks stops the run with exit code 2."""
    scorer = tmp_path / "judge.py"
    scorer.write_text(SCORER)
    path = generations(tmp_path, [("a", ["1", "0"], "1")])
    proc = run_module("pyrl.trainer.main_eval", [f"data.path={path}", f"+reward.custom_reward_function.path={scorer}",
                                                 "+reward.custom_reward_function.name=judge"], tmp_path, timeout=120)
    assert proc.returncode == 0 and "'test_score/a': 0.5" in proc.stdout, proc.stderr[-2000:]
    proc = run_module("pyrl.trainer.main_eval", [f"data.path={path}", "+data.colour=blue"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "data.colour" in proc.stderr, proc.stderr[-2000:]
