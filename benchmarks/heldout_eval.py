"""Held-out evaluation of pyrl's built-in runs over seeds (issue 24 item 5): each run as a user starts it
(`python -m pyrl.ppo preset=<preset>`), with its validation pointed at the task's held-out test split
(`data.val_files=pyrl:<task>:test`: pairs that neither the warm-start's stopping nor the choice of recipe ever saw),
one run per seed (`data.seed` = `actor_rollout_ref.rollout.seed` = the seed; the warm-started model is the
preset's, the same for every seed). Reported: the held-out reward at the start and at the *last* step (not the
best one) per seed, their mean and min-max over seeds, and a plot of every seed's curve.

    python benchmarks/heldout_eval.py --preset toy [--seeds 0 1 2] [--steps N] [--out DIR]
    python benchmarks/heldout_eval.py --preset tool_calc
    python benchmarks/heldout_eval.py --preset tool_calc_transfer
    python benchmarks/heldout_eval.py --preset tool_calc_transfer --name transfer_guess \
        actor_rollout_ref.model.path=pyrl:tiny-tool-transfer-guess-sft     (more overrides: after the options)

Runs one after another (this machine has 2 cores); --quick: 2 steps, one seed, 16 held-out prompts (the smoke
run of benchmarks/test_results_scripts.py). Writes DIR/<name>.json (every seed's validation and training
curves) and DIR/<name>.png; the name is the preset's unless --name gives one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

TASKS = {"toy": "pyrl:toy_addition", "tool_calc": "pyrl:tool_calc", "tool_calc_transfer": "pyrl:tool_calc"}
TRAINING = ["critic/score/mean", "tool_calls/sample_ratio", "actor/distillation/loss"]  # kept beside the held-out one


def run(preset: str, seed: int, args, out: str) -> dict:
    run_dir = os.path.join(out, f"{args.name}-seed{seed}")
    command = [sys.executable, "-m", "pyrl.ppo", f"preset={preset}", f"data.val_files={TASKS[preset]}:test",
               f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}", f"trainer.default_local_dir={run_dir}",
               "trainer.logger=[console,jsonl]", "trainer.save_freq=-1"]
    command += args.overrides
    if args.steps:
        command.append(f"trainer.total_training_steps={args.steps}")
    if args.quick:
        command += ["data.val_max_samples=16", "trainer.test_freq=1"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{preset} seed {seed} failed ({done.returncode}): {' '.join(command)}\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    key = next(k for row in rows for k in row if k.startswith("val-core/") and "/mean@" in k)
    val = [(row["step"], row[key]) for row in rows if key in row]
    return {"seed": seed, "key": key, "val": val, "seconds": round(time.perf_counter() - start, 1),
            "training": {k: [(row["step"], row[k]) for row in rows if k in row] for k in TRAINING}}


def spread(values) -> str:
    return f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def plot(name: str, runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in runs:
        steps, values = zip(*r["val"])
        ax.plot(steps, values, marker=".", label=f"seed {r['seed']} (held-out, greedy)")
        if r["training"]["critic/score/mean"]:
            steps, values = zip(*r["training"]["critic/score/mean"])
            ax.plot(steps, values, alpha=0.3, color=ax.lines[-1].get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(f"{name}: held-out test reward (faint: training reward, sampled)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(TASKS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=0, help="trainer.total_training_steps (default: the preset's)")
    parser.add_argument("--out", default="heldout_runs")
    parser.add_argument("--name", help="names the outputs (default: the preset)")
    parser.add_argument("--quick", action="store_true", help="2 steps, the first seed, 16 held-out prompts")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    args.name = args.name or args.preset
    if args.quick:
        args.steps, args.seeds = args.steps or 2, args.seeds[:1]
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for seed in args.seeds:
        runs.append(run(args.preset, seed, args, args.out))
        r = runs[-1]
        print(f"seed {seed}: {r['key']} {r['val'][0][1]:.3f} at step {r['val'][0][0]} -> {r['val'][-1][1]:.3f} at "
              f"step {r['val'][-1][0]} ({r['seconds']:.0f} s)", flush=True)
    start, final = [r["val"][0][1] for r in runs], [r["val"][-1][1] for r in runs]
    gain = [f - s for s, f in zip(start, final)]
    summary = {"name": args.name, "preset": args.preset, "overrides": args.overrides, "seeds": args.seeds,
               "key": runs[0]["key"], "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "start": start, "final": final, "gain": gain}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({**summary, "runs": runs}, f, indent=1)
    plot(args.name, runs, os.path.join(args.out, f"{args.name}.png"))
    print(f"\n| run | seeds | held-out reward at step 0 | at the last step (step {runs[0]['val'][-1][0]}) "
          f"| gain |\n|---|---|---|---|---|")
    print(f"| {args.name} | {len(runs)} | {spread(start)} | {spread(final)} | {spread(gain)} |")
    print("(mean (min-max) over seeds)")


if __name__ == "__main__":
    main()
