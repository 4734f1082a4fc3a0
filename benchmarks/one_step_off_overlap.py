"""One-step-off-policy rollout against the hybrid engine, end to end: the same run (toy task, pyrl's warm-started
tiny model, vLLM, responses long enough that generation is a large share of a step) as

  hybrid        actor_rollout_ref.hybrid_engine=true: one worker process generates, then trains (sequential)
  one-step-off  actor_rollout_ref.hybrid_engine=false: one actor process trains on batch k while one rollout
                process generates batch k+1 (overlapped)

Seconds per step over the steps after the warm-up, with the breakdown the metrics give: gen (hybrid: generation;
one-step-off: the trainer's wait for the batch, the part of generation not hidden), generate_async (one-step-off:
the batch's generation in the background), old_log_prob, update_actor, update_weights (the push).

    python benchmarks/one_step_off_overlap.py [--steps 10] [--warmup 2] [--response-length 64] [--repeats 3]

The modes alternate --repeats times, the first of each repeat rotating (hybrid first, then one-step-off first, ...),
so that load from other processes falls on both; each run's numbers are reported, then each mode's median (min-max)
over its runs and the ratio, claimed only when the two ranges do not overlap (benchmarks/spread.py), with the
machine's load average around them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import ratio, rotated, show  # noqa: E402

MODES = ["hybrid", "one-step-off"]
KEYS = ["step", "gen", "generate_async", "reward", "old_log_prob", "update_actor", "update_weights"]


def run(mode: str, args, root: str, repeat: int) -> list[dict]:
    run_dir = os.path.join(root, f"{mode}-{repeat}")
    overrides = ["preset=toy", f"trainer.total_training_steps={args.warmup + args.steps}", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.save_freq=-1",
                 f"data.max_response_length={args.response_length}",
                 "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.calculate_log_probs=true",
                 f"data.train_batch_size={args.prompts}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts // 2}",
                 f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]"]
    if mode == "one-step-off":
        overrides += ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.free_cache_engine=false"]
    proc = subprocess.run([sys.executable, "-m", "pyrl.ppo", *overrides], capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[args.warmup:]


def summary(rows: list[dict]) -> dict:
    return {key: float(np.mean([r.get(f"timing_s/{key}", 0.0) for r in rows])) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64, help="data.train_batch_size (x rollout.n=8 samples)")
    parser.add_argument("--response-length", type=int, default=64, help="tokens generated per sample (ignore_eos)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    results = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
               "shape": {"prompts": args.prompts, "samples_per_prompt": 8, "response_length": args.response_length,
                         "steps": args.steps, "warmup": args.warmup}}
    results["load_average_before"] = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for mode in rotated(MODES, repeat):
                runs.append({"mode": mode, "repeat": repeat, **summary(run(mode, args, root, repeat))})
    results["load_average_after"] = os.getloadavg()[0]
    results["runs"] = runs
    steps = {mode: [r["step"] for r in runs if r["mode"] == mode] for mode in MODES}
    for mode in MODES:
        results[mode] = {key: float(np.median([r[key] for r in runs if r["mode"] == mode])) for key in KEYS}
        results[mode]["step_min"], results[mode]["step_max"] = min(steps[mode]), max(steps[mode])
    results["speedup"] = ratio(steps["hybrid"], steps["one-step-off"])
    print(f"{'mode':<14}{'repeat':>7}" + "".join(f"{key:>16}" for key in KEYS))
    for r in runs:
        print(f"{r['mode']:<14}{r['repeat']:>7}" + "".join(f"{r[key]:>16.3f}" for key in KEYS))
    for mode in MODES:
        print(f"{mode}: {show(steps[mode], 3)} s per step, median (min-max) of {len(steps[mode])} runs")
    print(f"hybrid / one-step-off seconds per step (medians): {results['speedup']}; load average "
          f"{results['load_average_before']:.1f} before, {results['load_average_after']:.1f} after")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
