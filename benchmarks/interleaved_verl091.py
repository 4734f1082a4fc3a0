"""The rows of bench_logprobs.py and bench_group_advantages.py (CPU) timed round-robin: each round calls every
implementation of a case once (fast ones `--fast-calls` times) in a rotating order, so load from other processes
falls on all of them alike. Prints median (min-max) per row, pyrl's ratio to each baseline, and the log-prob
variants' extra peak memory (fresh process each).

    python benchmarks/interleaved_verl091.py --rounds 15
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_group_advantages as bga  # noqa: E402
import bench_logprobs as blp  # noqa: E402


def _logprob_cases():
    logits = torch.randn(blp.N, blp.V)
    labels = torch.randint(0, blp.V, (blp.N,))
    fp32 = {impl: (lambda f=blp._impl(impl, "cpu"): f(logits, labels)) for impl in blp.CPU_IMPLS}
    n = 1024
    x = torch.randn(n, blp.V, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, blp.V, (n,))

    def step(f):
        x.grad = None
        f(x, y).sum().backward()

    bf16 = {impl: (lambda f=blp._impl(impl, "cpu"): step(f)) for impl in blp.CPU_IMPLS}
    return {f"logprobs fp32 fwd {blp.N}x{blp.V}": fp32, f"logprobs bf16 fwd+bwd {n}x{blp.V}": bf16}


def _group_cases():
    scores = torch.randint(0, 2, (bga.N,)).float()
    index = torch.randperm(bga.N) % bga.GROUPS
    op = {}
    for impl in bga.IMPLS:
        fn, args = bga._op(impl, scores, index)
        op[impl] = lambda fn=fn, args=args: fn(*args)
    return {f"group_advantages grpo {bga.N} scores / {bga.GROUPS} groups": op}


FAST = {"pyrl", "verl091_grpo_vectorized"}


def run(cases, rounds, fast_calls):
    out = {}
    for name, impls in cases.items():
        for fn in impls.values():  # warm-up
            fn()
        times = {impl: [] for impl in impls}
        order = list(impls)
        for r in range(rounds):
            for impl in order[r % len(order):] + order[:r % len(order)]:
                for _ in range(fast_calls if impl in FAST and "group" in name else 1):
                    t0 = time.perf_counter()
                    impls[impl]()
                    times[impl].append(time.perf_counter() - t0)
        out[name] = times
    return out


def _fmt(s):
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--fast-calls", type=int, default=20)
    p.add_argument("--no-memory", action="store_true")
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds {a.rounds}")
    results = run({**_logprob_cases(), **_group_cases()}, a.rounds, a.fast_calls)
    print("| case | implementation | median | min - max | calls | pyrl / this (median) |")
    print("|---|---|---|---|---|---|")
    for name, times in results.items():
        ours = statistics.median(times["pyrl"])
        for impl, t in times.items():
            med = statistics.median(t)
            ratio = ("-" if impl == "pyrl" else f"{med / ours:.1f}x faster" if med >= ours
                     else f"{ours / med:.2f}x slower")
            print(f"| {name} | {impl} | {_fmt(med)} | {_fmt(min(t))} - {_fmt(max(t))} | {len(t)} | {ratio} |")
    if not a.no_memory:
        for impl in blp.CPU_IMPLS:
            e = blp.extra_peak_bytes(impl)
            print(f"extra peak RSS, fp32 {blp.N}x{blp.V} (logits {e['logits_bytes'] / 2**20:.0f} MiB): {impl} "
                  f"{e['extra_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
