"""Supervised fine-tuning, pyrl against TRL 1.16's SFTTrainer, side by side on one machine (issue 28 item 4).

Both sides train the same model (pyrl.models.tiny.BENCH_SPEC, ~24M parameters) for one epoch over the same
conversations (one user turn, one assistant turn; the loss on the assistant's tokens), in float32, AdamW at the
same learning rate, gradient clipping at 1.0, no gradient checkpointing, one CPU process.

- pyrl: `python -m pyrl.trainer.sft_trainer` (verl 0.9.1's keys), data.train_batch_size conversations per step,
  packed micro-batches of at most data.max_token_len_per_gpu tokens (use_dynamic_bsz), each sequence attending to
  itself only.
- trl-packed: TRL's SFTTrainer with its packing (BFD, padding-free) into rows of `--pack-length` tokens, one row
  per step; prompt-completion data (completion_only_loss). On CPU (no flash attention) TRL's padding-free rows run
  through SDPA without a mask: each row's attention spans every conversation packed in it (more work than
  per-sequence attention, and a different loss: what TRL does on this machine, named as such).
- trl-padded: TRL's SFTTrainer without packing, the same conversations per step as pyrl, padded batches.

Workload: `longtail`: conversations whose user and assistant turns have log-normal lengths (median 48 and 96
tokens, long tails, capped at 1,024 per conversation); `uniform`: every turn the same length. Reported: the
epoch's training time (the optimizer steps, from each trainer's own timer: pyrl's timing_s/step summed, TRL's
train_runtime), the tokens trained on, their time per token, and the whole process's wall time; each system runs
`--rounds` times, interleaved (each round in a rotated order), median (min-max); a ratio is claimed only when the
ranges do not overlap.

    python benchmarks/bench_sft.py --rounds 3 --out benchmarks/cpu_runs/sft-longtail-fp32-DATE.json
    python -m pytest benchmarks/bench_sft.py --benchmark-disable     # smoke: the tiny model, a few conversations
"""

from __future__ import annotations

import argparse
import json
import os
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

SYSTEMS = ("pyrl", "trl-packed", "trl-padded")
LEARNING_RATE = 1e-5
WORDS = "the of and to in is was for on are with as by at be this from or an have not which one can all".split()


@dataclass
class Workload:
    name: str
    conversations: int
    batch: int  # conversations per optimizer step (pyrl, trl-padded)
    token_budget: int  # pyrl's tokens per micro-batch
    pack_length: int  # trl-packed's row
    user_median: int
    assistant_median: int
    sigma: float  # the log-normal's (0: every turn the median's length)
    max_length: int
    smoke: bool = False


WORKLOADS = {
    "longtail": Workload("longtail", 256, 32, 4096, 4096, 48, 96, 0.9, 1024),
    "uniform": Workload("uniform", 256, 32, 4096, 4096, 48, 96, 0.0, 1024),
}
SMOKE = Workload("smoke", 16, 8, 1024, 512, 8, 16, 0.5, 256, smoke=True)


def make_data(workload: Workload, tokenizer, path: str, seed: int = 0) -> dict:
    """The conversations (messages) as a parquet file; returns their token counts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)

    def text(median: int) -> str:
        # about one token per short word with this tokenizer; trimmed by tokens below
        n = median if workload.sigma == 0 else int(np.clip(rng.lognormal(np.log(median), workload.sigma), 4, 4096))
        words = " ".join(rng.choice(WORDS, n))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:n]
        return tokenizer.decode(ids)

    rows = []
    for _ in range(workload.conversations):
        while True:
            chat = [{"role": "user", "content": text(workload.user_median)},
                    {"role": "assistant", "content": text(workload.assistant_median)}]
            length = len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False),
                                   add_special_tokens=False)["input_ids"])
            if length <= workload.max_length:
                break
        rows.append({"messages": chat, "tokens": length})
    pq.write_table(pa.Table.from_pylist(rows), path)
    lengths = [r["tokens"] for r in rows]
    return {"conversations": len(rows), "tokens": sum(lengths), "mean_tokens": sum(lengths) / len(lengths),
            "max_tokens": max(lengths)}


def model_path(workload: Workload) -> str:
    from pyrl.models.tiny import BENCH_SPEC, TinyModelSpec, tiny_model_path

    return tiny_model_path(TinyModelSpec() if workload.smoke else BENCH_SPEC)


def run_pyrl(workload: Workload, data: str, model: str, run_dir: str) -> dict:
    args = [sys.executable, "-m", "pyrl.trainer.sft_trainer", f"model.path={model}", f"data.train_files={data}",
            "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=1", "trainer.total_epochs=1",
            f"data.train_batch_size={workload.batch}", "data.use_dynamic_bsz=true",
            f"data.max_token_len_per_gpu={workload.token_budget}", f"data.max_length={workload.max_length}",
            "engine.dtype=float32", "model.enable_gradient_checkpointing=false", f"optim.lr={LEARNING_RATE}",
            "optim.weight_decay=0.0", "optim.clip_grad=1.0", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=run_dir if os.path.isdir(run_dir) else None, capture_output=True, text=True,
                          timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"pyrl failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"train_s": sum(r["timing_s/step"] for r in rows), "steps": len(rows), "wall_s": wall,
            "loss_first": rows[0]["train/loss"], "loss_last": rows[-1]["train/loss"],
            "tokens": sum(r["train/global_tokens"] for r in rows)}


def trl_worker(job: dict) -> dict:
    """One TRL run in this process."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    workload = Workload(**job["workload"])
    rows = pq.read_table(job["data"]).to_pylist()
    dataset = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
    packed = job["system"] == "trl-packed"
    args = SFTConfig(
        output_dir=job["run_dir"], use_cpu=True, bf16=False, fp16=False, seed=1, num_train_epochs=1,
        per_device_train_batch_size=1 if packed else workload.batch, gradient_accumulation_steps=1,
        packing=packed, max_length=workload.pack_length if packed else workload.max_length,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, gradient_checkpointing=False, completion_only_loss=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"train_s": out.metrics["train_runtime"], "steps": out.global_step, "tokens": tokens,
            "loss_first": losses[0], "loss_last": losses[-1]}


def run_trl(system: str, workload: Workload, data: str, model: str, run_dir: str) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    job = os.path.join(run_dir, "job.json")
    with open(job, "w") as f:
        json.dump({"system": system, "workload": asdict(workload), "data": data, "model": model,
                   "run_dir": run_dir, "result": os.path.join(run_dir, "result.json")}, f)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", job], capture_output=True, text=True,
                          timeout=3600, cwd=run_dir)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{system} failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "result.json")) as f:
        return {**json.load(f), "wall_s": wall}


def run(system: str, workload: Workload, data: str, model: str, run_dir: str) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    if system == "pyrl":
        return run_pyrl(workload, data, model, run_dir)
    return run_trl(system, workload, data, model, run_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="longtail", choices=sorted(WORKLOADS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        with open(args.trl_worker) as f:
            job = json.load(f)
        result = trl_worker(job)
        with open(job["result"], "w") as f:
            json.dump(result, f)
        return
    from transformers import AutoTokenizer

    workload, systems = WORKLOADS[args.workload], args.systems.split(",")
    root = tempfile.mkdtemp(prefix="bench-sft-")
    model = model_path(workload)
    data = os.path.join(root, "data.parquet")
    shape = make_data(workload, AutoTokenizer.from_pretrained(model), data)
    print(f"{workload.name}: {shape}; runs in {root}", flush=True)
    results: dict[str, list] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in rotated(systems, r):
            result = run(system, workload, data, model, os.path.join(root, f"{system}-{r}"))
            results[system].append(result)
            print(f"round {r + 1}/{args.rounds} {system}: train {result['train_s']:.1f} s, {result['steps']} steps, "
                  f"wall {result['wall_s']:.1f} s", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"workload": asdict(workload), "data": shape, "results": results}, f, indent=1)
    print("\n| workload | system | runs | epoch train s, median (min-max) | steps | tokens | us/token | wall s | "
          "loss first -> last | / TRL packed |\n|---|---|---|---|---|---|---|---|---|---|")
    base = results.get("trl-packed")
    for system in systems:
        runs = results[system]
        train = [x["train_s"] for x in runs]
        per_token = [1e6 * x["train_s"] / x["tokens"] for x in runs]
        print(f"| {workload.name} | {system} | {len(runs)} | {show(train)} | {runs[0]['steps']} | {runs[0]['tokens']} "
              f"| {show(per_token, 1)} | {show([x['wall_s'] for x in runs], 1)} | {runs[0]['loss_first']:.3f} -> "
              f"{runs[-1]['loss_last']:.3f} | "
              f"{ratio(train, [x['train_s'] for x in base]) if base and system != 'trl-packed' else '-'} |")


@pytest.mark.parametrize("system", SYSTEMS)
def test_sft_epoch(system, tmp_path, pytestconfig):
    """Smoke mode (CI): the tiny model, 16 short conversations, each system once: the plumbing holds."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    model = model_path(SMOKE)
    data = str(tmp_path / "data.parquet")
    make_data(SMOKE, AutoTokenizer.from_pretrained(model), data)
    result = run(system, SMOKE, data, model, str(tmp_path / system))
    assert result["steps"] >= 1 and result["train_s"] > 0 and result["tokens"] > 0


if __name__ == "__main__":
    main()
