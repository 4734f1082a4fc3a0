"""The memory frontier: peak memory of a whole GRPO step, pyrl against TRL 1.16's GRPOTrainer, with a Qwen2-sized
vocabulary, and the largest micro-batch each fits in a fixed budget per process.

Model: the body of bench_e2e's model (pyrl.models.tiny.BENCH_SPEC: hidden 512, 8 layers, ~24M parameters without
its embedding) with Qwen2's vocabulary size, 151,936, embedding tied to the head as in Qwen2.5-0.5B (~102M
parameters in all). Its tokenizer is pyrl's tiny one with filler entries up to that size, so that every id the
model samples decodes (real Qwen2 checkpoints also carry more rows than their tokenizer; here every row is a
token). Logits over this vocabulary are where RL trainers run out of memory: 0.6 MB per token in float32.

Runs: bench_e2e's commands on both sides (the same prompts, samples, lengths, micro-batch size, precision, no
gradient checkpointing on either side, one PPO epoch of one mini-batch, no reference model), the uniform workload
(16-token prompts, 32 response tokens, EOS ignored), each run a fresh process tree. Systems: pyrl-vllm (pyrl's
defaults: vLLM rollout with its 1 GiB CPU KV cache, packed, shared prompts, fused log-probs), pyrl-hf (HF generate
in the trainer's process, as TRL does) and TRL (HF generate).

Measured, not estimated:
- process peak: the largest high-water resident set (VmHWM) of any process of the run, read from /proc every 20 ms
  while it runs (VmHWM is the kernel's own maximum: nothing between two reads is missed). For pyrl this is the
  worker that trains and generates; for TRL its one process. It is what a per-GPU (per-process) budget limits.
- whole run: the peak of the run's memory cgroup (cgroup v1 memory.max_usage_in_bytes, v2 memory.peak): every
  process of the tree at once (for pyrl also the driver, Ray's GCS, raylet and idle workers), each page counted
  once. The model's and the data's files are read into the page cache before the run, outside its cgroup, so that
  their cache is not charged to whichever side reads them first. "-" where no cgroup can be made.
- plan: pyrl's memory plan (pyrl/trainer/memory_plan.py) for the same run, its largest phase per process, as the
  run logged it. It leaves out each process's runtime (Python, torch, libraries: a few hundred MB on CPU).
The frontier: micro-batches (= the whole batch, one micro-batch per step, 8 samples per prompt) doubled from 16 rows
until the process peak passes the budget (--budget-gib, default 8); the largest that fits, in tokens per micro-batch
(rows x 48). pyrl's default shares each prompt's 16 tokens among its 8 samples, so it runs fewer tokens than that.

    python benchmarks/bench_memory.py --rounds 3          # equal-batch peaks, then the frontier; prints markdown
    python benchmarks/bench_memory.py --plot benchmarks/memory_frontier_cpu.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_e2e  # noqa: E402
from spread import show  # noqa: E402

QWEN2_VOCAB = 151_936
GiB = 1 << 30
SYSTEMS = ("pyrl-vllm", "pyrl-hf", "trl")
SAMPLES = 8  # per prompt, as bench_e2e's uniform workload
PROMPT_TOKENS, RESPONSE_TOKENS = 16, 32
WIDE_VERSION = 1  # bumped when wide_vocab_model_path's construction changes (names its cache directory)


# ---- the model ----
def wide_vocab_model_path(vocab: int = QWEN2_VOCAB) -> str:
    """BENCH_SPEC's model with `vocab` rows (tied embedding and head; the new rows drawn as the model's
    initializer draws them) and its tokenizer with filler tokens up to `vocab`, made once, atomically, in pyrl's
    model cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from pyrl.models.tiny import BENCH_SPEC, _write_once, default_cache_dir, tiny_model_path

    base = tiny_model_path(BENCH_SPEC)
    path = os.path.join(default_cache_dir(), f"tiny-qwen2-{os.path.basename(base)[len('tiny-qwen2-'):]}"
                                             f"-vocab{vocab}-v{WIDE_VERSION}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path

    def write(tmp: str) -> None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(0)
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.save_pretrained(tmp)
        for name in os.listdir(base):
            if name.startswith(("tokenizer", "chat_template", "generation_config")):
                with open(os.path.join(base, name)) as f:
                    text = f.read()
                if name == "tokenizer.json":
                    text = json.dumps(widened_tokenizer(json.loads(text), vocab))
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)

    _write_once(default_cache_dir(), path, write)
    return path


def widened_tokenizer(tokenizer: dict, vocab: int) -> dict:
    """A byte-level BPE tokenizer.json with entries added to its model's vocab up to `vocab` ids: "Ġ" and lower-case
    letters (byte-level text for " " + letters), none in the vocab before. No merge makes them, so encoding is
    unchanged; decoding any id gives text."""
    entries = dict(tokenizer["model"]["vocab"])
    # added tokens past the model's vocab go into it at their ids: the tokenizers library numbers an added token
    # that its model lacks after the model's vocab, which the fillers would otherwise move
    taken = set(entries.values())
    entries.update({t["content"]: t["id"] for t in tokenizer["added_tokens"] if t["id"] not in taken})
    used = set(entries)
    next_id = max(entries.values()) + 1
    index = 0
    while next_id < vocab:
        word, k = "", index
        while True:
            word += chr(ord("a") + k % 26)
            k //= 26
            if not k:
                break
        index += 1
        text = "Ġ" + word + "q"  # "q" last: never a word the BPE merges produce, and no prefix clashes
        if text not in used:
            entries[text] = next_id
            next_id += 1
    tokenizer["model"]["vocab"] = entries
    return tokenizer


# ---- measuring a process tree ----
@dataclass(frozen=True)
class Peaks:
    process_bytes: int  # the largest VmHWM of any process of the run
    process: str  # what it runs (its command line's first words)
    processes: int  # how many processes the run had
    tree_bytes: int | None  # the run's cgroup peak; None without a cgroup


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _name(pid: int) -> str:
    """What the process runs: its command line's first words (Ray workers retitle theirs, e.g.
    ray::ActorRolloutRefWorker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:
        return "?"
    return " ".join(os.path.basename(w) if i == 0 else w for i, w in enumerate(words[:2]))[:60]


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (/proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _cgroup_peak(group) -> int | None:
    name = "memory.peak" if group.version == 2 else "memory.max_usage_in_bytes"
    try:
        with open(os.path.join(group.paths[0], name)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def run_measured(cmd: list[str], cwd: str, timeout: float, warm_files: tuple = ()) -> tuple[subprocess.CompletedProcess,
                                                                                            Peaks]:
    """Run `cmd`, measuring its process tree's peaks (see the module docstring). `warm_files` are read first, outside
    the run's cgroup."""
    from pyrl.sandbox import cgroup

    for path in warm_files:
        for root, _, names in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [path])]:
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    while f.read(1 << 24):
                        pass
    hierarchy = cgroup.probe()
    group = hierarchy.create(1 << 50, 1 << 20) if hierarchy else None

    def join_group():  # in the child before exec: every process the run starts is in the cgroup from its birth
        for procs in group.procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    seen: dict[int, tuple[int, str]] = {}
    done = threading.Event()
    with open(os.path.join(cwd, "stdout.log"), "w") as out, open(os.path.join(cwd, "stderr.log"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, preexec_fn=join_group if group else None)

        def watch():
            while not done.is_set():
                for pid in _descendants(proc.pid):
                    hwm = _status_kib(pid, "VmHWM")
                    if hwm is not None and hwm >= seen.get(pid, (0, ""))[0]:
                        seen[pid] = (hwm, seen[pid][1] if pid in seen else _name(pid))
                done.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            done.set()
            watcher.join()
            tree = _cgroup_peak(group) if group else None
            if group:
                group.remove(within_s=30)
    with open(os.path.join(cwd, "stdout.log")) as f_out, open(os.path.join(cwd, "stderr.log")) as f_err:
        result = subprocess.CompletedProcess(cmd, proc.returncode, f_out.read(), f_err.read())
    top_pid = max(seen, key=lambda p: seen[p][0]) if seen else proc.pid
    peaks = Peaks(seen.get(top_pid, (0, ""))[0] * 1024, seen.get(top_pid, (0, "?"))[1], len(seen), tree)
    return result, peaks


# ---- one run ----
def workload(rows: int, micro_rows: int | None = None) -> bench_e2e.Workload:
    """bench_e2e's uniform lengths, `rows` sequences per step (rows / 8 prompts x 8 samples), micro-batches of
    `micro_rows` (default: all rows at once)."""
    if rows % SAMPLES:
        raise ValueError(f"rows: expected a multiple of {SAMPLES}, got {rows}")
    prompts = rows // SAMPLES
    return bench_e2e.Workload(f"uniform-{rows}", prompts, SAMPLES, (PROMPT_TOKENS,) * prompts, RESPONSE_TOKENS, True,
                              micro_rows or rows, False)


def prepared(work: bench_e2e.Workload, steps: int, root: str, model_path: str,
             precision: str = "fp32") -> bench_e2e.Prepared:
    """bench_e2e.prepare's prompts for `work`, with the wide-vocabulary model instead; its tokenizer gives every
    prompt the same ids as the one bench_e2e.prepare checked them with (checked again here)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    prep = bench_e2e.prepare(work, steps, root, precision)
    wide, base = AutoTokenizer.from_pretrained(model_path), AutoTokenizer.from_pretrained(prep.model_path)
    for i, row in enumerate(pq.read_table(prep.train_file).to_pylist()):
        content = row["prompt"][0]["content"]
        if bench_e2e.templated_ids(wide, content) != bench_e2e.templated_ids(base, content):
            raise AssertionError(f"prompt {i}: the wide tokenizer encodes it differently from the base one")
    return dataclasses.replace(prep, model_path=model_path)


PLAN_LINE = re.compile(r"^\s+\S.*?\s([\d.]+) \+\s+([\d.]+) =\s+([\d.]+)", re.M)


def plan_peak_gib(log: str) -> float | None:
    """The largest phase peak of the memory plan table a pyrl run logged."""
    start = log.find("memory plan per process")
    if start < 0:
        return None
    block = log[start:].split("\n", 1)[1]
    peaks = []
    for line in block.splitlines():
        found = PLAN_LINE.match(line)
        if not found:
            if line.strip().startswith(("note:",)) or "skipped" in line:
                continue
            break
        peaks.append(float(found.group(3)))
    return max(peaks) if peaks else None


def run_one(system: str, prep: bench_e2e.Prepared, run_dir: str) -> dict:
    """One run of `system` on `prep`, measured: {"peaks": Peaks as a dict, "plan_gib", "step_s"} or {"error"}."""
    os.makedirs(run_dir, exist_ok=True)
    warm = (prep.model_path, prep.train_file)
    if system.startswith("pyrl"):
        cmd = bench_e2e.pyrl_command(prep, system, run_dir)
        result, peaks = run_measured(cmd, run_dir, 3600, warm)
        if result.returncode != 0:
            return {"error": f"pyrl ({system}) exited with {result.returncode}: {result.stderr[-3000:]}"}
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line)["timing_s/step"] for line in f if line.strip()]
        return {"peaks": dataclasses.asdict(peaks), "plan_gib": plan_peak_gib(result.stderr + result.stdout),
                "step_s": steps}
    if system == "trl":
        cmd, out = bench_e2e.trl_command(prep, False, run_dir)
        result, peaks = run_measured(cmd, run_dir, 3600, warm)
        if not os.path.exists(out):
            return {"error": f"TRL exited with {result.returncode}: {result.stderr[-3000:]}"}
        with open(out) as f:
            trl = json.load(f)
        if "error" in trl:
            return {"error": trl["error"]}
        return {"peaks": dataclasses.asdict(peaks), "plan_gib": None, "step_s": [s["step"] for s in trl["steps"]]}
    raise ValueError(f"system: unknown {system!r}, expected one of {SYSTEMS}")


# ---- the two measurements ----
def equal_batch(systems, rounds: int, steps: int, root: str, model_path: str, rows: int, micro_rows: int,
                precision: str) -> dict:
    """{system: [run, ...]}: `rounds` interleaved runs of each system on `rows` sequences per step in micro-batches
    of `micro_rows`."""
    from spread import rotated

    prep = prepared(workload(rows, micro_rows), steps, os.path.join(root, "data"), model_path, precision)
    runs: dict = {}
    for round_index in range(rounds):
        for system in rotated(list(systems), round_index):
            start = time.perf_counter()
            result = run_one(system, prep, os.path.join(root, f"equal-{system}-{round_index}"))
            runs.setdefault(system, []).append(result)
            print(f"equal batch round {round_index + 1}/{rounds} {system}: {time.perf_counter() - start:.0f} s, "
                  + (f"process peak {result['peaks']['process_bytes'] / GiB:.2f} GiB" if "peaks" in result
                     else f"failed: {result['error'][-300:]}"), flush=True)
    return runs


def frontier(system: str, budget: int, root: str, model_path: str, precision: str, start_rows: int = 16,
             max_rows: int = 1024, rows_list: tuple = ()) -> list[dict]:
    """Runs of one step with one micro-batch of 16, 32, 64, ... rows, until the process peak passes `budget` (that
    run is kept: it shows by how much), a run fails, or max_rows: [{"rows", "tokens", run...}]. `rows_list`: run
    exactly these sizes instead (to place the frontier between two doublings)."""
    doubling = [start_rows << k for k in range(max(0, (max_rows // start_rows).bit_length()))]
    points = []
    for rows in rows_list or doubling:
        prep = prepared(workload(rows), 1, os.path.join(root, "data"), model_path, precision)
        start = time.perf_counter()
        result = run_one(system, prep, os.path.join(root, f"frontier-{system}-{rows}"))
        points.append({"rows": rows, "tokens": rows * (PROMPT_TOKENS + RESPONSE_TOKENS), **result})
        print(f"frontier {system} {rows} rows: {time.perf_counter() - start:.0f} s, "
              + (f"process peak {result['peaks']['process_bytes'] / GiB:.2f} GiB" if "peaks" in result
                 else f"failed: {result['error'][-300:]}"), flush=True)
        if not rows_list and ("peaks" not in result or result["peaks"]["process_bytes"] > budget):
            break
    return points


def fits(points: list[dict], budget: int) -> int:
    """The most tokens per micro-batch among the runs whose process peak stayed within `budget` (0: none)."""
    return max([p["tokens"] for p in points if "peaks" in p and p["peaks"]["process_bytes"] <= budget], default=0)


def gib(values) -> str:
    return show([v / GiB for v in values])


def equal_batch_table(runs: dict) -> str:
    lines = ["| system | runs | process peak GiB, median (min-max) | its process | whole run GiB | plan GiB | "
             "process peak / TRL | whole run / TRL |", "|---|---|---|---|---|---|---|---|"]
    trl = [r["peaks"] for r in runs.get("trl", []) if "peaks" in r]
    for system, results in runs.items():
        ok = [r for r in results if "peaks" in r]
        if not ok:
            lines.append(f"| {system} | 0 | failed: {results[0]['error'][:200]} | | | | | |")
            continue
        process = [r["peaks"]["process_bytes"] for r in ok]
        tree = [r["peaks"]["tree_bytes"] for r in ok if r["peaks"]["tree_bytes"] is not None]
        plan = [r["plan_gib"] for r in ok if r["plan_gib"] is not None]
        ratio = lambda mine, key: (f"{statistics.median(mine) / statistics.median(p[key] for p in trl):.2f}x"  # noqa: E731
                                   if trl and mine and system != "trl" else "-")
        names = sorted({r["peaks"]["process"] for r in ok})
        lines.append(f"| {system} | {len(ok)} | {gib(process)} | {', '.join(names)} | "
                     f"{gib(tree) if tree else '-'} | {f'{statistics.median(plan):.2f}' if plan else '-'} | "
                     f"{ratio(process, 'process_bytes')} | {ratio(tree, 'tree_bytes') if tree else '-'} |")
    return "\n".join(lines)


def frontier_table(points: dict, budget: int) -> str:
    lines = ["| system | rows | tokens per micro-batch | process peak GiB | whole run GiB | plan GiB | step s | "
             f"within {budget / GiB:.0f} GiB |", "|---|---|---|---|---|---|---|---|"]
    for system, runs in points.items():
        for p in runs:
            if "peaks" not in p:
                lines.append(f"| {system} | {p['rows']} | {p['tokens']} | failed: {p['error'][:200]} | | | | no |")
                continue
            peaks = p["peaks"]
            lines.append(f"| {system} | {p['rows']} | {p['tokens']} | {peaks['process_bytes'] / GiB:.2f} | "
                         + (f"{peaks['tree_bytes'] / GiB:.2f}" if peaks["tree_bytes"] else "-")
                         + f" | {p['plan_gib'] if p['plan_gib'] is not None else '-'} | {p['step_s'][0]:.1f} | "
                         f"{'yes' if peaks['process_bytes'] <= budget else 'no'} |")
    return "\n".join(lines)


def plot(equal: dict, points: dict, budget: int, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [s for s in equal if any("peaks" in r for r in equal[s])]
    for offset, (key, label) in enumerate((("process_bytes", "process peak"), ("tree_bytes", "whole run"))):
        values = []
        for s in names:
            got = [r["peaks"][key] / GiB for r in equal[s] if "peaks" in r and r["peaks"][key]]
            values.append(statistics.median(got) if got else 0.0)
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(names))]
        left.bar(xs, values, width=0.38, label=label)
        for x, v in zip(xs, values):
            left.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("GiB")
    left.set_title("equal batch: peak of a whole GRPO step (median)")
    left.legend()
    for system, runs in points.items():
        ok = [p for p in runs if "peaks" in p]
        right.plot([p["tokens"] for p in ok], [p["peaks"]["process_bytes"] / GiB for p in ok], "o-", label=system)
    right.axhline(budget / GiB, color="grey", linestyle="--", label=f"budget {budget / GiB:.0f} GiB")
    right.set_xscale("log", base=2)
    right.set_xlabel("tokens per micro-batch (rows x 48)")
    right.set_ylabel("process peak, GiB")
    right.set_title("the frontier: one micro-batch per step")
    right.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# ---- pytest: the measurement itself (fast, run in CI); the frontier (timed mode only) ----
ALLOCATE = """
import subprocess, sys, time
block = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(block), 4096):  # pages are resident once written
    block[i] = 1
if len(sys.argv) > 2:  # a child that allocates while this process holds its block
    subprocess.run([sys.executable, __file__, sys.argv[2]], check=True)
time.sleep(0.2)
"""


def test_peaks_of_a_process_tree(tmp_path):
    """A parent that touches 300 MiB and, while holding it, runs a child that touches 200 MiB: the process peak is
    the parent's (300 MiB plus the interpreter), the whole run's at least both together."""
    script = tmp_path / "allocate.py"
    script.write_text(ALLOCATE)
    result, peaks = run_measured([sys.executable, str(script), "300", "200"], str(tmp_path), 60)
    assert result.returncode == 0, result.stderr
    assert 300 << 20 <= peaks.process_bytes <= (300 + 80) << 20, peaks
    assert peaks.processes == 2, peaks
    if peaks.tree_bytes is not None:
        assert peaks.tree_bytes >= (500 << 20), peaks


def test_widened_tokenizer_decodes_every_id():
    from transformers import PreTrainedTokenizerFast

    from pyrl.models.tiny import BENCH_SPEC, tiny_model_path

    base = tiny_model_path(BENCH_SPEC)
    with open(os.path.join(base, "tokenizer.json")) as f:
        spec = json.load(f)
    widened = widened_tokenizer(json.loads(json.dumps(spec)), 5000)
    before = PreTrainedTokenizerFast(tokenizer_file=os.path.join(base, "tokenizer.json"))
    wide_file = os.path.join(tempfile.mkdtemp(), "tokenizer.json")
    with open(wide_file, "w") as f:
        json.dump(widened, f)
    wide = PreTrainedTokenizerFast(tokenizer_file=wide_file)
    assert len(wide) == 5000
    text = "what is the sum of 12 and 7? think step by step <answer>19</answer>"
    assert wide(text)["input_ids"] == before(text)["input_ids"]
    first = max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])]) + 1
    decoded = [wide.decode([i]) for i in range(first, 5000)]
    assert all(d.startswith(" ") and len(d) > 1 for d in decoded) and len(set(decoded)) == len(decoded)


def test_memory_frontier(benchmark, tmp_path):
    if benchmark.disabled:
        pytest.skip("timed mode only: the frontier takes whole GRPO steps of a 102M model (python "
                    "benchmarks/bench_memory.py)")
    pytest.importorskip("trl")
    budget = 8 * GiB
    model = wide_vocab_model_path()
    result: dict = {}
    benchmark.pedantic(lambda: result.update({s: frontier(s, budget, str(tmp_path), model, "fp32")
                                              for s in ("pyrl-vllm", "trl")}), rounds=1, iterations=1)
    print("\n" + frontier_table(result, budget))
    benchmark.extra_info.update({f"{s}_tokens_within_budget": fits(p, budget) for s, p in result.items()})
    assert fits(result["pyrl-vllm"], budget) > 0


# ---- the script ----
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="equal-batch runs of every system, interleaved")
    parser.add_argument("--steps", type=int, default=2, help="steps of each equal-batch run")
    parser.add_argument("--rows", type=int, default=256, help="equal batch: sequences per step (32 prompts x 8)")
    parser.add_argument("--micro-rows", type=int, default=32, help="equal batch: sequences per micro-batch")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="the frontier's budget per process")
    parser.add_argument("--frontier-systems", default="pyrl-vllm,trl")
    parser.add_argument("--max-rows", type=int, default=1024, help="the frontier's largest micro-batch tried")
    parser.add_argument("--frontier-rows", default="", help="comma-separated: run exactly these micro-batch sizes")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: equal, frontier")
    parser.add_argument("--precision", default="fp32", choices=bench_e2e.PRECISIONS)
    parser.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    parser.add_argument("--plot", help="write the PNG here")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-memory-")
    model = wide_vocab_model_path(args.vocab)
    budget = int(args.budget_gib * GiB)
    skip = set(filter(None, args.skip.split(",")))
    equal = {} if "equal" in skip else equal_batch(args.systems.split(","), args.rounds, args.steps, root, model,
                                                      args.rows, args.micro_rows, args.precision)
    points = {} if "frontier" in skip else {
        s: frontier(s, budget, root, model, args.precision, max_rows=args.max_rows,
                    rows_list=tuple(int(r) for r in args.frontier_rows.split(",") if r))
        for s in args.frontier_systems.split(",")}
    print(f"\nmodel {model} (vocab {args.vocab}), {args.precision}; runs in {root}\n")
    if equal:
        print(f"equal batch: {args.rows} sequences per step ({args.rows // SAMPLES} prompts x {SAMPLES}), "
              f"{PROMPT_TOKENS} + {RESPONSE_TOKENS} tokens, micro-batches of {args.micro_rows}, {args.steps} steps, "
              f"{args.rounds} interleaved rounds\n\n{equal_batch_table(equal)}\n")
    if points:
        print(f"frontier (budget {args.budget_gib:g} GiB per process, one step per point):\n\n"
              f"{frontier_table(points, budget)}\n")
        print("tokens per micro-batch within the budget: "
              + ", ".join(f"{s} {fits(p, budget)}" for s, p in points.items()))
    if args.plot:
        plot(equal, points, budget, args.plot, f"pyrl vs TRL 1.16, BENCH_SPEC body + vocab {args.vocab}, "
             f"{args.precision}, {bench_e2e_cpu()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"equal": equal, "frontier": points, "budget_bytes": budget}, f, indent=1)


def bench_e2e_cpu() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    return "?"


if __name__ == "__main__":
    main()
