"""pyrl.sandbox's cost: the kernel-enforced sandbox against the one it replaced (the audit hook under network and
PID namespaces, taken from git at OLD_COMMIT), on this machine.

  start-up     run_code("print(1)") one after another: p50 and p95 per run
  throughput   16 concurrent runs (threads) of a 10-case problem, each case its own run (prime_code's way): runs
               per second over the 160 runs

Both sides run interleaved (old, new, old, new, ...) for --rounds rounds, so that load from other processes falls
on both; the report gives the median and min-max over rounds. Target (issue 23): p50 of print(1) within 1.5x of the
old sandbox's.

    python benchmarks/bench_sandbox.py [--rounds 5] [--startup-runs 40]

Under pytest (CI's smoke pass) each side runs print(1) once.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import pytest

import pyrl.sandbox as new_sandbox

OLD_COMMIT = "dae79be"  # the last commit with the audit-hook sandbox
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEM = "a, b = map(int, input().split())\nprint(sum(i * i for i in range(a, b)) % 1000003)\n"
CASES = [f"{i} {i + 20000}\n" for i in range(10)]


def load_old_sandbox(directory: str):
    """The old pyrl.sandbox package (both files) from git, imported under another name."""
    package = os.path.join(directory, "pyrl_sandbox_old")
    os.makedirs(package, exist_ok=True)
    for name in ("__init__.py", "_child.py"):
        source = subprocess.run(["git", "-C", ROOT, "show", f"{OLD_COMMIT}:pyrl/sandbox/{name}"], check=True,
                                capture_output=True).stdout
        with open(os.path.join(package, name), "wb") as f:
            f.write(source)
    spec = importlib.util.spec_from_file_location("pyrl_sandbox_old", os.path.join(package, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyrl_sandbox_old"] = module
    spec.loader.exec_module(module)
    return module


def startup(sandbox, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = sandbox.run_code("print(1)")
        times.append(time.perf_counter() - start)
        assert result.ok and result.stdout == "1\n", result
    return times


def throughput(sandbox, concurrent_runs: int = 16) -> float:
    """Runs per second: `concurrent_runs` problems at once, each running its 10 cases one after another."""
    def problem(_):
        return [sandbox.run_code(PROBLEM, stdin=case).ok for case in CASES]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrent_runs) as pool:
        results = list(pool.map(problem, range(concurrent_runs)))
    seconds = time.perf_counter() - start
    assert all(all(r) for r in results)
    return concurrent_runs * len(CASES) / seconds


@pytest.fixture(scope="module")
def old_sandbox(tmp_path_factory):
    try:
        return load_old_sandbox(str(tmp_path_factory.mktemp("old-sandbox")))
    except (OSError, subprocess.CalledProcessError) as e:  # a shallow clone or an export without git
        pytest.skip(f"the old sandbox is read from git history (commit {OLD_COMMIT}), which this checkout lacks: {e}")


@pytest.mark.parametrize("side", ["old", "new"])
def test_sandbox_startup(benchmark, old_sandbox, side):
    sandbox = old_sandbox if side == "old" else new_sandbox
    benchmark.group = "sandbox run_code('print(1)')"
    result = benchmark(sandbox.run_code, "print(1)")
    assert result.ok


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--startup-runs", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        sides = {"old": load_old_sandbox(directory), "new": new_sandbox}
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"kernel {platform.release()}")
        print("new:", new_sandbox.isolation().describe())
        for sandbox in sides.values():  # probes and first runs out of the timings
            startup(sandbox, 3)
        p50 = {name: [] for name in sides}
        p95 = {name: [] for name in sides}
        rate = {name: [] for name in sides}
        for round_ in range(args.rounds):
            for name, sandbox in sides.items():
                times = sorted(startup(sandbox, args.startup_runs))
                p50[name].append(times[len(times) // 2])
                p95[name].append(times[min(len(times) - 1, int(0.95 * len(times)))])
                rate[name].append(throughput(sandbox))
                print(f"round {round_ + 1} {name}: p50 {p50[name][-1] * 1e3:.1f} ms, p95 {p95[name][-1] * 1e3:.1f} ms,"
                      f" {rate[name][-1]:.1f} runs/s", flush=True)
        print(f"\n{args.rounds} rounds, interleaved; median (min-max) over rounds\n")
        print("| sandbox | print(1) p50 ms | print(1) p95 ms | 16 x 10-case runs/s |")
        print("|---|---|---|---|")
        for name in sides:
            print(f"| {name} | {spread(p50[name], 1e3)} | {spread(p95[name], 1e3)} | {spread(rate[name])} |")
        ratios = [n / o for n, o in zip(p50["new"], p50["old"])]
        print(f"\np50 new/old per round: {spread(ratios, 1, 2)}; runs/s new/old: "
              f"{spread([n / o for n, o in zip(rate['new'], rate['old'])], 1, 2)}")


if __name__ == "__main__":
    main()
