"""How a GRPO step's cost grows, pyrl against TRL 1.16's GRPOTrainer: seconds per step and per phase as the response
length grows (32 to 1,024 tokens, EOS ignored), as the group size grows (n = 2 to 16 samples per prompt), and as the
prompt length grows (16 to 1,024 tokens), each curve with its growth exponent (the slope of log time over log size,
least squares).

Each point is bench_e2e's side-by-side run (the same model, prompts, samples, lengths, precision, one PPO epoch of
one mini-batch, one micro-batch per step, no reference model; pyrl as bench_e2e's pyrl-vllm system, tuned, not
verl's defaults; TRL with HF generate) on a small batch, 4 prompts per step, so that the long points fit this
2-core machine: 3 steps per run, the median of steps 2-3, --rounds runs per point interleaved (each round visits
every point and system in a rotated order). The model is bench_e2e's body (BENCH_SPEC) with room for 2,048 positions.

    python benchmarks/bench_scaling.py --rounds 3 --plot benchmarks/scaling_cpu.png
    python benchmarks/bench_scaling.py --sweeps group --rounds 1      # one sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_e2e  # noqa: E402
from spread import ratio, rotated, show  # noqa: E402

SYSTEMS = ("pyrl-vllm", "trl")
PROMPTS = 4
# sweep -> (the size that grows, its values, the fixed settings)
SWEEPS = {
    "response": ("response tokens", (32, 128, 512, 1024), dict(n=4, prompt=16)),
    "group": ("samples per prompt (n)", (2, 4, 8, 16), dict(prompt=16, response=64)),
    "prompt": ("prompt tokens", (16, 64, 256, 1024), dict(n=4, response=32)),
}
STEPS = 3


def point(sweep: str, size: int) -> bench_e2e.Workload:
    """The workload of one point of a sweep: PROMPTS prompts, all rows in one micro-batch, EOS ignored."""
    settings = {**SWEEPS[sweep][2], {"response": "response", "group": "n", "prompt": "prompt"}[sweep]: size}
    n, prompt, response = settings["n"], settings["prompt"], settings["response"]
    return bench_e2e.Workload(f"{sweep}-{size}", PROMPTS, n, (prompt,) * PROMPTS, response, True, PROMPTS * n, False)


def model_spec():
    from pyrl.models.tiny import BENCH_SPEC

    return dataclasses.replace(BENCH_SPEC, max_position_embeddings=2048)


def growth_exponent(sizes, seconds) -> float:
    """The least-squares slope of log(seconds) over log(size)."""
    xs, ys = [math.log(s) for s in sizes], [math.log(t) for t in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run(sweeps, rounds: int, root: str, precision: str, out: str | None = None) -> dict:
    """{(sweep, size, system): [summary or {"error"}, ...]}: every point's runs, interleaved by round; written to
    `out` as JSON after each run, so that a long sweep cut short keeps what it measured."""
    preps = {(sweep, size): bench_e2e.prepare(point(sweep, size), STEPS, os.path.join(root, "data"), precision,
                                              spec=model_spec())
             for sweep in sweeps for size in SWEEPS[sweep][1]}
    jobs = [(sweep, size, system) for (sweep, size) in preps for system in SYSTEMS]
    results: dict = {}
    for round_index in range(rounds):
        for sweep, size, system in rotated(jobs, round_index):
            start = time.perf_counter()
            run_dir = os.path.join(root, f"{sweep}-{size}-{system}-{round_index}")
            try:
                result = bench_e2e.run_system(system, preps[sweep, size], run_dir)
            except RuntimeError as e:
                result = {"error": str(e)}
            summary = bench_e2e.summarize(result["steps"]) if result.get("steps") and "error" not in result else None
            results.setdefault((sweep, size, system), []).append(summary or {"error": result.get("error", "no steps")})
            print(f"round {round_index + 1}/{rounds} {sweep} {size} {system}: {time.perf_counter() - start:.0f} s"
                  + (f", {summary['step']:.2f} s/step" if summary else f", failed: {result.get('error', '')[-300:]}"),
                  flush=True)
            if out:
                save(results, out)
    return results


def save(results: dict, out: str) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump([{"sweep": k[0], "size": k[1], "system": k[2], "runs": v} for k, v in results.items()], f, indent=1)
    os.replace(out + ".tmp", out)


def table(results: dict, sweep: str) -> str:
    label, sizes, _ = SWEEPS[sweep]
    lines = [f"| {label} | system | runs | s/step, median (min-max) | gen | update | other | / TRL |",
             "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for system in SYSTEMS:
            ok = [r for r in results.get((sweep, size, system), []) if "error" not in r]
            if not ok:
                failed = results.get((sweep, size, system), [{"error": "not run"}])[0]["error"]
                lines.append(f"| {size} | {system} | 0 | failed: {failed[:150]} | | | | |")
                continue
            med = lambda key: statistics.median(r[key] for r in ok)  # noqa: E731
            trl = [r["step"] for r in results.get((sweep, size, "trl"), []) if "error" not in r]
            vs = "-" if system == "trl" or not trl else ratio([r["step"] for r in ok], trl)
            other = med("step") - med("gen") - med("update")
            lines.append(f"| {size} | {system} | {len(ok)} | {show([r['step'] for r in ok])} | {med('gen'):.2f} | "
                         f"{med('update'):.2f} | {other:.2f} | {vs} |")
    return "\n".join(lines)


def exponents(results: dict, sweep: str) -> dict:
    """{system: {phase: exponent}} over the sweep's points that every run finished."""
    sizes = SWEEPS[sweep][1]
    out = {}
    for system in SYSTEMS:
        per_size = [[r for r in results.get((sweep, s, system), []) if "error" not in r] for s in sizes]
        if not all(per_size):
            continue
        out[system] = {phase: growth_exponent(sizes, [max(statistics.median(r[phase] for r in runs), 1e-6)
                                                      for runs in per_size])
                       for phase in ("step", "gen", "update")}
    return out


def plot(results: dict, sweeps, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 4.3), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        label, sizes, _ = SWEEPS[sweep]
        fitted = exponents(results, sweep)
        for system, color in zip(SYSTEMS, ("tab:blue", "tab:orange")):
            for phase, style in (("step", "o-"), ("gen", "^--"), ("update", "s:")):
                xs, ys = [], []
                for size in sizes:
                    ok = [r[phase] for r in results.get((sweep, size, system), []) if "error" not in r]
                    if ok:
                        xs.append(size)
                        ys.append(statistics.median(ok))
                slope = fitted.get(system, {}).get(phase)
                ax.plot(xs, ys, style, color=color,
                        label=f"{system} {phase}" + (f" (x^{slope:.2f})" if slope is not None else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds (median)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated: {', '.join(SWEEPS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=bench_e2e.PRECISIONS)
    parser.add_argument("--plot", help="write the PNG here")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    sweeps = args.sweeps.split(",")
    unknown = [s for s in sweeps if s not in SWEEPS]
    if unknown:
        raise SystemExit(f"--sweeps: unknown {unknown}, expected some of {list(SWEEPS)}")
    root = tempfile.mkdtemp(prefix="bench-scaling-")
    results = run(sweeps, args.rounds, root, args.precision, args.out)
    print(f"\n{STEPS} steps per run, the median of steps 2-{STEPS}; {PROMPTS} prompts per step; {args.precision}; "
          f"{args.rounds} interleaved rounds; runs in {root}\n")
    for sweep in sweeps:
        print(f"{SWEEPS[sweep][0]} ({', '.join(f'{k} {v}' for k, v in SWEEPS[sweep][2].items())}):\n")
        print(table(results, sweep))
        print("\ngrowth exponents: " + "; ".join(f"{system}: " + ", ".join(f"{p} {e:.2f}" for p, e in phases.items())
                                                 for system, phases in exponents(results, sweep).items()) + "\n")
    if args.plot:
        plot(results, sweeps, args.plot, f"GRPO step cost as work grows, pyrl vs TRL 1.16, {args.precision}, "
                                         f"{PROMPTS} prompts per step")


def test_growth_exponent():
    """The slope of a power law is its exponent; a constant's is 0."""
    sizes = [32, 128, 512, 1024]
    assert abs(growth_exponent(sizes, [3e-4 * s ** 1.5 for s in sizes]) - 1.5) < 1e-9
    assert abs(growth_exponent(sizes, [2.0] * 4)) < 1e-9


def test_points_are_the_sweeps():
    w = point("group", 8)
    assert (w.prompts, w.n, w.prompt_lengths[0], w.response_length, w.micro_batch, w.ignore_eos) == (4, 8, 16, 64, 32,
                                                                                                      True)
    w = point("prompt", 1024)
    assert (w.n, w.prompt_lengths, w.response_length) == (4, (1024,) * 4, 32)


if __name__ == "__main__":
    main()
