"""A whole GRPO step, pyrl against TRL 1.16's GRPOTrainer, side by side on one machine.

Both sides train the same model (pyrl.models.tiny.BENCH_SPEC, ~24M parameters, with EOS raised so that
responses end at varied lengths) on the same prompts in the same order, with the same samples per
prompt, response limit, temperature 1, learning rate, precision, one PPO epoch of one mini-batch per
step, the same micro-batch size, no KL/reference model and the same reward (benchmarks/e2e_reward.py).
Precision: fp32 on both sides, or (--precision bf16 / PYRL_BENCH_PRECISION=bf16) bf16 compute on both.
What differs is the trainer: pyrl runs `python -m pyrl.ppo` (vLLM or HF rollout, packed or padded
training: `actor_rollout_ref.model.use_remove_padding`; packed, pyrl's default runs each prompt's tokens once for
its samples, `-unshared` turns that off: `actor_rollout_ref.actor.use_prefix_grouper=false`; `pyrl-verl-defaults`
is a verl user's command line, every other key at verl 0.9.1's default), TRL its GRPOTrainer with HF generate
(and, once, with vLLM colocated, which fails on CPU). Each run is a fresh subprocess.

Workloads: `uniform` (32 prompts x 8 samples, 16 prompt tokens, 32 response tokens, EOS ignored) and
`longtail` (16 prompts x 4, prompt lengths log-normal with median 74 and max 384 tokens, responses up
to 32 tokens ending at EOS, geometric lengths with mean ~16).

Reported: median seconds per step over steps 2..N (N = PYRL_BENCH_STEPS, default 6) and its phases:
gen (rollout), old_log_prob (the forward pass for the old log-probs; 0 where the trainer skips it, as
TRL does in this on-policy setting), update (forward, backward, optimizer), sync (pyrl's weight push
into the rollout engine), other (reward, advantages, the rest); the mean prompt and response lengths
show that both sides did the same work; "update MFU" is the update's model FLOPs (verl 0.9.1's count, every prompt
once per sample) over its time and the best matmul rate measured in the invocation, before every run (update_mfu:
this machine's throughput drifts by tens of percent within an invocation, and other load only lowers a reading,
so a single peak measured at the start could read low and an MFU above 1);
"verl perf/mfu/actor" is pyrl's own metric; "/ TRL" is the step time over TRL's. The script runs every system
--rounds times (default 3), each round in a rotated order, and reports each system's median (min-max) over its
runs; a ratio to TRL is claimed only when the two ranges do not overlap ("within noise" otherwise). Absolute
times move with the machine and its load: compare ratios from one invocation.

    python -m pytest benchmarks/bench_e2e.py --benchmark-only -s          # timed, one test per system
    python benchmarks/bench_e2e.py --workload uniform,longtail --rounds 3  # all systems, interleaved rounds

Smoke mode (`--benchmark-disable`, as CI runs) uses the tiny default model, few prompts and 2 steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spread import ratio, rotated, show  # noqa: E402

REWARD_FILE = HERE / "e2e_reward.py"
LEARNING_RATE = 1e-6
PHASES = ("gen", "old_log_prob", "update", "sync", "other")
_VLLM, _HF = "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name=hf"
# pyrl's defaults share each prompt's tokens among its samples (actor.use_prefix_grouper, on when n > 1 and packed)
_PADDED, _UNSHARED = ("actor_rollout_ref.model.use_remove_padding=false",
                      "actor_rollout_ref.actor.use_prefix_grouper=false")
PYRL_SYSTEMS = {"pyrl-vllm": [_VLLM], "pyrl-vllm-unshared": [_VLLM, _UNSHARED], "pyrl-vllm-padded": [_VLLM, _PADDED],
                "pyrl-hf": [_HF], "pyrl-hf-unshared": [_HF, _UNSHARED], "pyrl-hf-padded": [_HF, _PADDED],
                "pyrl-verl-defaults": []}  # -> overrides (pyrl-verl-defaults: verl_defaults_command)
SYSTEMS = [*PYRL_SYSTEMS, "trl", "trl-vllm"]  # the default run order
WORKLOADS = ("uniform", "longtail")
# fp32: both sides in float32. bf16: pyrl's FSDP mixed precision (fsdp_config.dtype=bfloat16, on CPUs with native
# bf16) and rollout in bf16 (rollout.dtype, verl's default) against TRL's bf16=True (autocast: its training and its
# HF generate compute in bf16); both keep float32 master weights and optimizer state
PRECISIONS = ("fp32", "bf16")
# smoke mode (CI) starts pyrl once per workload, ~30 s each: together they cover both engines (verl's defaults:
# vllm, packed), both padding paths, EOS ignored and EOS-ended responses; TRL runs there too when it is installed (CI
# lacks it)
SMOKE_SYSTEMS = {"uniform": ("pyrl-verl-defaults", "trl"), "longtail": ("pyrl-hf-padded", "trl")}
# words of the tiny tokenizer's training text, so prompts tokenize like text, not like bytes
WORDS = ["what", "is", "the", "sum", "of", "answer", "compute", "number", "please", "think", "step", "by", "and",
         "equals", "result", "add", "minus", "times", "target"]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int  # per step
    n: int  # samples per prompt
    prompt_lengths: tuple  # chat-templated token counts of one step's prompts (every step has the same, reordered)
    response_length: int
    ignore_eos: bool
    micro_batch: int  # sequences per forward / backward, on both sides
    smoke: bool

    @property
    def eos_prob(self) -> float:
        """Per-token EOS probability of the model: geometric response lengths with a mean of about half the
        response limit once cut at it."""
        return 1.6 / self.response_length


def log_normal_lengths(count: int, median: float, maximum: int, minimum: int) -> tuple:
    """`count` lengths at the normal quantiles (i + 1/2) / count of a log-normal whose median is `median` and
    whose top quantile is `maximum`: a long tail, the same at every run; clipped below at `minimum`."""
    from statistics import NormalDist

    quantiles = [NormalDist().inv_cdf((i + 0.5) / count) for i in range(count)]
    sigma = math.log(maximum / median) / quantiles[-1]
    return tuple(max(minimum, round(median * math.exp(sigma * q))) for q in quantiles)


def make_workload(name: str, smoke: bool) -> Workload:
    if name == "uniform":
        if smoke:
            return Workload(name, 4, 2, (16,) * 4, 8, True, 8, smoke)
        return Workload(name, 32, 8, (16,) * 32, 32, True, 32, smoke)
    if name == "longtail":
        if smoke:
            return Workload(name, 4, 2, log_normal_lengths(4, 24, 48, 12), 8, False, 8, smoke)
        return Workload(name, 16, 4, log_normal_lengths(16, 74, 384, 12), 32, False, 16, smoke)
    raise ValueError(f"workload: unknown {name!r}, expected one of {WORKLOADS}")


# ---- data and model ----
def templated_ids(tokenizer, content: str) -> list[int]:
    """The prompt tokens pyrl's RLHFDataset makes of one user message (chat template, no special tokens added)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_content(tokenizer, length: int, rng: random.Random) -> str:
    """A user message whose chat-templated prompt is exactly `length` tokens: words while they fit, then
    digits (always one token each) up to the length."""
    words: list[str] = []
    while True:
        word = rng.choice(WORDS)
        if len(templated_ids(tokenizer, " ".join(words + [word]))) > length:
            break
        words.append(word)
    content = " ".join(words)
    while len(templated_ids(tokenizer, content)) < length:
        content += str(rng.randrange(10))
    if len(templated_ids(tokenizer, content)) != length:
        raise ValueError(f"cannot make a {length}-token prompt (the chat template alone is longer)")
    return content


@dataclass(frozen=True)
class Prepared:
    workload: Workload
    steps: int
    model_path: str
    train_file: str  # verl's parquet schema, steps x prompts rows, in the order both sides take them
    precision: str = "fp32"  # both sides: fp32, or bf16 compute over fp32 master weights (PRECISIONS)


def prepare(workload: Workload, steps: int, root: str, precision: str = "fp32", spec=None) -> Prepared:
    """The model (of `spec`, default BENCH_SPEC; the tiny default model in smoke mode) and the prompt file of
    `workload` for `steps` steps; checks that pyrl's data set and TRL's tokenization give every prompt the same
    tokens, of the planned lengths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from pyrl.config import DataConfig
    from pyrl.data import PromptBatches, RLHFDataset
    from pyrl.models.tiny import BENCH_SPEC, TinyModelSpec, eos_biased_model_path

    spec = spec or (TinyModelSpec() if workload.smoke else BENCH_SPEC)
    model_path = eos_biased_model_path(spec, eos_prob=workload.eos_prob)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(f"{workload.name}-{workload.smoke}")
    rows, lengths = [], []
    for step in range(steps):
        order = list(workload.prompt_lengths)
        rng.shuffle(order)
        for length in order:
            content = prompt_content(tokenizer, length, rng)
            truth = "".join(rng.sample("abcdefghijklmnopqrstuvwxyz", 6))
            rows.append({"data_source": "bench_e2e", "prompt": [{"role": "user", "content": content}],
                         "ability": "bench", "reward_model": {"style": "rule", "ground_truth": truth},
                         "extra_info": {"index": len(rows), "step": step + 1}})
            lengths.append(length)
    os.makedirs(root, exist_ok=True)
    train_file = os.path.join(root, f"{workload.name}-{'smoke' if workload.smoke else 'full'}-{steps}.parquet")
    pq.write_table(pa.Table.from_pylist(rows), train_file)

    data_config = DataConfig(max_prompt_length=max(workload.prompt_lengths))
    pyrl_ids = PromptBatches(RLHFDataset(train_file, tokenizer, data_config), tokenizer, data_config).prompt_ids
    trl_ids = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]  # as TRL's GRPOTrainer._tokenize_prompts
    for i, (ours, theirs, length) in enumerate(zip(pyrl_ids, trl_ids, lengths)):
        if list(ours) != list(theirs) or len(ours) != length:
            raise AssertionError(f"prompt {i}: pyrl tokenizes it to {len(ours)} tokens, TRL to {len(theirs)}, "
                                 f"planned {length}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    return Prepared(workload, steps, model_path, train_file, precision)


# ---- pyrl ----
def verl_defaults_command(prep: Prepared, run_dir: str) -> list[str]:
    """A verl user's command line (pyrl-verl-defaults): data, model, batch sizes, n, lr and adv_estimator=grpo;
    the workload's lengths, EOS setting and reward; the precision; the run's length, logging and this machine's
    one CPU worker. Every other key is verl 0.9.1's default: no micro-batch size, gradient checkpointing on,
    calculate_log_probs on, the fused log-probs and shared prompts off in verl (pyrl's null: on)."""
    w, dtype = prep.workload, "bfloat16" if prep.precision == "bf16" else "float32"
    return [sys.executable, "-m", "pyrl.ppo",
            f"data.train_files={prep.train_file}", "data.shuffle=false",
            f"data.max_prompt_length={max(w.prompt_lengths)}", f"data.max_response_length={w.response_length}",
            f"data.train_batch_size={w.prompts}", f"actor_rollout_ref.model.path={prep.model_path}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={w.prompts}", f"actor_rollout_ref.rollout.n={w.n}",
            f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}", "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.rollout.ignore_eos={str(w.ignore_eos).lower()}",
            f"reward.custom_reward_function.path={REWARD_FILE}", "reward.custom_reward_function.name=compute_score",
            # the compute dtype as verl 0.9.1's FSDP engine takes it (it reads fsdp_config.dtype nowhere)
            f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={dtype}",
            f"actor_rollout_ref.rollout.dtype={dtype}",
            f"trainer.total_training_steps={prep.steps}", "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.n_gpus_per_node=0",
            "trainer.n_cpu_workers_per_node=1"]


def pyrl_command(prep: Prepared, system: str, run_dir: str) -> list[str]:
    if system == "pyrl-verl-defaults":
        return verl_defaults_command(prep, run_dir)
    w = prep.workload
    return [sys.executable, "-m", "pyrl.ppo",
            f"data.train_files={prep.train_file}", "data.shuffle=false",
            f"data.max_prompt_length={max(w.prompt_lengths)}", f"data.max_response_length={w.response_length}",
            f"data.train_batch_size={w.prompts}",
            f"actor_rollout_ref.model.path={prep.model_path}",
            f"actor_rollout_ref.actor.fsdp_config.dtype={'bfloat16' if prep.precision == 'bf16' else 'float32'}",
            f"actor_rollout_ref.rollout.dtype={'bfloat16' if prep.precision == 'bf16' else 'float32'}",
            "actor_rollout_ref.actor.ppo_epochs=1", f"actor_rollout_ref.actor.ppo_mini_batch_size={w.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={w.micro_batch}",
            f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.use_kl_loss=false",
            f"actor_rollout_ref.rollout.n={w.n}",
            "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_k=-1",
            "actor_rollout_ref.rollout.top_p=1.0", f"actor_rollout_ref.rollout.ignore_eos={str(w.ignore_eos).lower()}",
            f"actor_rollout_ref.rollout.max_num_seqs={w.prompts * w.n}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={w.micro_batch}",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            f"reward.custom_reward_function.path={REWARD_FILE}", "reward.custom_reward_function.name=compute_score",
            "reward.num_workers=1", "data.dataloader_num_workers=0",
            # no recompute on either side (TRL's side sets gradient_checkpointing=False), the fused log-prob kernel
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.model.use_fused_kernels=true",
            "actor_rollout_ref.rollout.calculate_log_probs=false",
            "actor_rollout_ref.rollout.load_format=auto", "actor_rollout_ref.rollout.seed=0",
            "actor_rollout_ref.actor.data_loader_seed=1",
            f"trainer.total_training_steps={prep.steps}", "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.n_gpus_per_node=0",
            "trainer.n_cpu_workers_per_node=1", *PYRL_SYSTEMS[system]]


def run_pyrl(prep: Prepared, system: str, run_dir: str) -> list[dict]:
    """`python -m pyrl.ppo` in a subprocess; per-step phases from its metrics.jsonl (timing_s/*)."""
    os.makedirs(run_dir, exist_ok=True)
    proc = subprocess.run(pyrl_command(prep, system, run_dir), cwd=run_dir, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"pyrl ({system}: {PYRL_SYSTEMS[system]}) failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = []
    for row in rows:
        step = {"step": row["timing_s/step"], "gen": row["timing_s/gen"],
                "old_log_prob": row.get("timing_s/old_log_prob", 0.0), "update": row["timing_s/update_actor"],
                "sync": row.get("timing_s/update_weights", 0.0),
                "response_length": row["response_length/mean"], "prompt_length": row["prompt_length/mean"],
                "verl_mfu": row["perf/mfu/actor"]}
        step["other"] = step["step"] - sum(step[p] for p in PHASES if p != "other")
        steps.append(step)
    return steps


# ---- TRL ----
def trl_worker(prep: Prepared, use_vllm: bool, output_dir: str) -> dict:
    """TRL's GRPOTrainer on `prep`, in this process: {"steps": per-step phases} or {"error": ...} when the
    trainer cannot be built or fails (vLLM colocate on CPU). Step times come from a TrainerCallback
    (on_step_begin .. on_step_end: one optimizer step with its generation); `gen` is the time in
    GRPOTrainer._generate (tokenize, generate, decode), `other` the rest of
    _generate_and_score_completions (reward, advantages), `update` what remains of the step."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(HERE))
    from e2e_reward import trl_reward

    w = prep.workload
    records = pq.read_table(prep.train_file).to_pylist()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in records])
    sequences = w.prompts * w.n
    vllm_args = {}
    if use_vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm_args = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                         vllm_max_model_length=max(w.prompt_lengths) + w.response_length)
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=prep.precision == "bf16", fp16=False, seed=1,
        per_device_train_batch_size=w.micro_batch, gradient_accumulation_steps=sequences // w.micro_batch,
        steps_per_generation=sequences // w.micro_batch,  # one generation batch = one optimizer step
        num_generations=w.n, num_iterations=1, max_steps=prep.steps, shuffle_dataset=False,
        max_completion_length=w.response_length, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": w.response_length} if w.ignore_eos else None,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        gradient_checkpointing=False,  # TRL's default is True; pyrl runs without (a 24M model needs no recompute)
        loss_type="dapo",  # the token mean over the whole batch, as pyrl's token-mean over its one mini-batch
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        **vllm_args)
    try:
        model = AutoModelForCausalLM.from_pretrained(prep.model_path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(prep.model_path)
        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the colocate run records how it fails
        return {"error": describe(e, "building the trainer")}

    current: dict = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            current[name] = current.get(name, 0.0) + time.perf_counter() - start
            if name == "gen":  # (prompt_ids, completion_ids, ...)
                current["prompt_length"] = statistics.mean(len(ids) for ids in out[0])
                current["response_length"] = statistics.mean(len(ids) for ids in out[1])
            return out
        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    trainer._generate_and_score_completions = timed("gen_and_score", trainer._generate_and_score_completions)
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - current["start"]
            gen_and_score = current.get("gen_and_score", 0.0)
            steps.append({"step": total, "gen": current.get("gen", 0.0), "old_log_prob": 0.0,
                          "update": total - gen_and_score, "sync": 0.0,
                          "other": gen_and_score - current.get("gen", 0.0),
                          "response_length": current.get("response_length", 0.0),
                          "prompt_length": current.get("prompt_length", 0.0)})

    trainer.add_callback(StepTimer())
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - see above
        return {"error": describe(e, f"training step {len(steps) + 1}"), "steps": steps}
    return {"steps": steps}


def describe(error: Exception, when: str) -> str:
    """'Type: message (when, at file:line)' of the innermost frame, to tell where a peer fails."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {error} ({when}, at {frame.filename.split('site-packages/')[-1]}:{frame.lineno})"


def trl_command(prep: Prepared, use_vllm: bool, run_dir: str) -> tuple[list[str], str]:
    """The command that runs trl_worker in a fresh process (this file with --trl-worker, a job file in `run_dir`)
    and the file its result will be in."""
    os.makedirs(run_dir, exist_ok=True)
    job = os.path.join(run_dir, "job.json")
    out = os.path.join(run_dir, "result.json")
    with open(job, "w") as f:
        json.dump({"prepared": asdict(prep), "use_vllm": use_vllm,
                   "output_dir": run_dir, "result": out}, f)
    return [sys.executable, __file__, "--trl-worker", job], out


def run_trl(prep: Prepared, use_vllm: bool, run_dir: str) -> dict:
    """trl_worker in a fresh subprocess, like pyrl's runs."""
    cmd, out = trl_command(prep, use_vllm, run_dir)
    proc = subprocess.run(cmd, cwd=run_dir, capture_output=True, text=True, timeout=3600)
    if not os.path.exists(out):
        return {"error": f"the TRL process exited with {proc.returncode}: {proc.stderr[-4000:]}"}
    with open(out) as f:
        return json.load(f)


def _trl_worker_main(job_file: str) -> None:
    """The --trl-worker entry of run_trl: the job file (what to run, where to write the result) in, the result out."""
    with open(job_file) as f:
        job = json.load(f)
    spec = job["prepared"]
    prep = Prepared(**{**spec, "workload": Workload(**{**spec["workload"],
                                                       "prompt_lengths": tuple(spec["workload"]["prompt_lengths"])})})
    result = trl_worker(prep, job["use_vllm"], job["output_dir"])
    with open(job["result"], "w") as f:
        json.dump(result, f)


# ---- one system, the summary ----
def run_system(system: str, prep: Prepared, run_dir: str) -> dict:
    """{"steps": [...]} (and "error" for a TRL run that failed)."""
    if system in PYRL_SYSTEMS:
        return {"steps": run_pyrl(prep, system, run_dir)}
    if system in ("trl", "trl-vllm"):
        return run_trl(prep, system == "trl-vllm", run_dir)
    raise ValueError(f"system: unknown {system!r}, expected one of {SYSTEMS}")


def summarize(steps: list[dict]) -> dict:
    """Medians over steps 2..N (step 1 warms up; all steps when there is only one)."""
    steady = steps[1:] or steps
    return {key: statistics.median(s[key] for s in steady) for key in steady[0]} if steady else {}


def matmul_peak(precision: str) -> float:
    """The best FLOP/s of 2048^3 matmuls on all cores in the precision's compute dtype, measured now (the script
    measures it before every run and divides by the best reading)."""
    import torch

    from pyrl.workers.perf import matmul_rate

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return matmul_rate(torch.device("cpu"), dtype, threads=os.cpu_count(), size=2048, seconds=2.0)


def update_mfu(prep: Prepared, summary: dict, peak: float) -> float:
    """verl 0.9.1's model FLOPs of the update (forward and backward of every sequence, at the run's mean prompt and
    response lengths: exact for uniform lengths; for long-tailed ones the attention term, a few percent, is taken at
    the mean) over the update's median time and `peak`. Every prompt counts once per sample, on both sides."""
    from transformers import AutoConfig

    from pyrl.workers.perf import model_flops

    w = prep.workload
    length = summary["prompt_length"] + summary["response_length"]
    flops = model_flops(AutoConfig.from_pretrained(prep.model_path), [length] * (w.prompts * w.n))
    return flops / summary["update"] / peak


def rounds_table(results: dict) -> str:
    """Markdown rows per (workload, system) over its runs (one in the pytest benchmark, --rounds in the script):
    s/step median (min-max) of the runs' medians, the phases' medians, and the ratio to TRL of the same workload,
    claimed only when the ranges are apart."""
    lines = ["| workload | system | runs | s/step, median (min-max) | " + " | ".join(PHASES)
             + " | prompt len | resp len | update MFU | verl perf/mfu/actor | / TRL |",
             "|---" * (len(PHASES) + 9) + "|"]
    for (workload, system), runs in results.items():
        ok = [r["summary"] for r in runs if r.get("summary")]
        failed = [r.get("error", "no steps") for r in runs if not r.get("summary")]
        if not ok:
            lines.append(f"| {workload} | {system} | 0 | failed: {failed[0][:200]} |" + " |" * (len(PHASES) + 5))
            continue
        trl = [r["summary"]["step"] for r in results.get((workload, "trl"), []) if r.get("summary")]
        steps = [s["step"] for s in ok]
        vs_trl = "-" if not trl or system == "trl" else ratio(steps, trl)
        med = lambda key: statistics.median(s[key] for s in ok)  # noqa: E731
        optional = lambda key: f"{med(key):.3f}" if all(key in s for s in ok) else "-"  # noqa: E731
        lines.append(f"| {workload} | {system} | {len(ok)}{f' ({len(failed)} failed)' if failed else ''} | "
                     f"{show(steps)} | " + " | ".join(f"{med(p):.2f}" for p in PHASES)
                     + f" | {med('prompt_length'):.1f} | {med('response_length'):.1f} | {optional('update_mfu')} | "
                     f"{optional('verl_mfu')} | {vs_trl} |")
    return "\n".join(lines)


# ---- pytest-benchmark ----
@functools.cache
def _prepared(name: str, smoke: bool, steps: int, root: str) -> Prepared:
    return prepare(make_workload(name, smoke), steps, root, os.environ.get("PYRL_BENCH_PRECISION", "fp32"))


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_e2e_step_time(benchmark, tmp_path, tmp_path_factory, workload, system):
    if system.startswith("trl"):
        pytest.importorskip("trl")
        pytest.importorskip("datasets")
    smoke = benchmark.disabled
    if smoke and system not in SMOKE_SYSTEMS[workload]:
        pytest.skip(f"timed mode only (smoke mode runs {', '.join(SMOKE_SYSTEMS[workload])} on {workload})")
    steps = 2 if smoke else int(os.environ.get("PYRL_BENCH_STEPS", 6))
    prep = _prepared(workload, smoke, steps, str(tmp_path_factory.getbasetemp() / "e2e-data"))
    result: dict = {}
    peak = None if smoke else matmul_peak(prep.precision)  # this test's own reading (the script takes the best)

    def run():
        result.update(run_system(system, prep, str(tmp_path / "run")))

    benchmark.group = f"e2e GRPO step, {workload}"
    benchmark.pedantic(run, rounds=1, iterations=1)
    if system == "trl-vllm" and "error" in result:
        benchmark.extra_info["error"] = result["error"]
        pytest.xfail(f"TRL vLLM colocate: {result['error'][:300]}")
    assert "error" not in result, result["error"]
    result["summary"] = summarize(result["steps"])
    if peak is not None:
        result["summary"]["update_mfu"] = update_mfu(prep, result["summary"], peak)
    benchmark.extra_info.update({f"median_{k}": v for k, v in result["summary"].items()})
    benchmark.extra_info["steps"] = result["steps"]
    print("\n" + rounds_table({(workload, system): [result]}))
    assert len(result["steps"]) == steps and result["summary"]["step"] > 0


# ---- the side-by-side script ----
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="uniform,longtail", help="comma-separated: uniform, longtail")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated: {', '.join(SYSTEMS)} (each round rotates their order)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved (>= 3 for a spread)")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("PYRL_BENCH_STEPS", 6)))
    parser.add_argument("--smoke", action="store_true", help="the tiny model and few prompts (checks the plumbing)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS, help="both sides' compute dtype")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: run one TRL job file in this process
    args = parser.parse_args(argv)
    if args.trl_worker:
        _trl_worker_main(args.trl_worker)
        return
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    root = tempfile.mkdtemp(prefix="bench-e2e-")
    systems = args.systems.split(",")
    results: dict = {}
    preps, peaks = {}, []
    for workload in args.workload.split(","):
        prep = preps[workload] = prepare(make_workload(workload, args.smoke), args.steps, os.path.join(root, "data"),
                                         args.precision)
        for round_index in range(args.rounds):
            for system in rotated(systems, round_index):
                peaks.append(matmul_peak(args.precision))
                start = time.perf_counter()
                try:
                    result = run_system(system, prep, os.path.join(root, workload, f"{system}-{round_index}"))
                except RuntimeError as e:
                    result = {"error": str(e)}
                if result.get("steps") and "error" not in result:
                    result["summary"] = summarize(result["steps"])
                result["matmul_peak"] = peaks[-1]
                results.setdefault((workload, system), []).append(result)
                seconds = time.perf_counter() - start
                print(f"{workload} round {round_index + 1}/{args.rounds} {system}: {seconds:.0f} s, "
                      f"peak {peaks[-1] / 1e9:.0f} GFLOP/s"
                      + (f", {result['summary']['step']:.2f} s/step" if "summary" in result
                         else f", failed: {result.get('error', '')[-300:]}"), flush=True)
    for key, runs in results.items():
        for result in runs:
            if "summary" in result:
                result["summary"]["update_mfu"] = update_mfu(preps[key[0]], result["summary"], max(peaks))
    print(f"\n{args.steps} steps per run, each run's median over steps 2..{args.steps}, seconds, {args.precision}, "
          f"{args.rounds} interleaved rounds; runs in {root}; update MFU against the best matmul rate of the readings "
          f"taken before every run, {max(peaks) / 1e9:.0f} GFLOP/s (readings {min(peaks) / 1e9:.0f}-"
          f"{max(peaks) / 1e9:.0f}; verl perf/mfu/actor: pyrl's own metric, against its cached peak, and counting "
          f"shared prompts once)\n")
    print(rounds_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"workload": w, "system": s, "runs": runs} for (w, s), runs in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
