"""Smoke runs of the scripts behind benchmarks/RESULTS.md that are not pytest benchmarks: each at its smallest
settings in a fresh process, so that a section of RESULTS.md cannot rot into a script that no longer runs. They
check that the script finishes and prints its table, not its numbers (those are measured by hand, on a quiet
machine, and recorded with their spread). Collected by CI's benchmark stage (`pytest benchmarks`); gpu_kernels.py's
CPU smoke run is in tests/, with its numbers checked."""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

SCRIPTS = {  # script and its smallest arguments -> a line its output must contain; the longest first (CI hands
    # the benchmarks' tests out one at a time in this order: see conftest.py)
    "distillation_toy.py": (["--quick", "--student-base", "pyrl:tiny-wide"], "| distillation | 1 |"),
    "one_step_off_overlap.py": (["--steps", "1", "--warmup", "0", "--prompts", "8", "--response-length", "8",
                                 "--repeats", "1"], "hybrid / one-step-off seconds per step"),
    "lora_sync.py": (["--steps", "1"], "adapter / merged, per step"),
    "rollout_tensor_parallel.py": (["--prompts", "4", "--new-tokens", "4", "--rounds", "1"],
                                   "rows with equal greedy tokens"),
    "heldout_eval.py": (["--preset", "toy", "--quick"], "| toy | 1 |"),
    "memory_plan_accuracy.py": (["--quick"], "| h256-L4-V32k (21M) | 32 x (32+32) | True | True | old_log_prob |"),
    "micro_batch_sizes.py": (["--quick", "--rows", "4", "256"], "| 256 | "),
    "interleaved_verl091.py": (["--rounds", "1", "--fast-calls", "1", "--no-memory"], "verl091_grpo_vectorized"),
    "agent_loop_cost.py": (["--engine", "hf", "--prompts", "2", "--n", "2", "--repeats", "1"],
                           "ratio agent loop / single turn"),
    "agent_rollout_async.py": (["--trajectories", "4", "--turns", "2", "--repeats", "1"],
                               "per-trajectory / lock-step:"),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_runs(script, tmp_path):
    args, expected = SCRIPTS[script]
    env = {k: v for k, v in os.environ.items() if k != "PYRL_OPS_BACKEND"}
    out = subprocess.run([sys.executable, str(HERE / script), *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    assert expected in out.stdout, f"{script}: {expected!r} not in its output:\n{out.stdout[-3000:]}"
