"""Seconds per training step and generated tokens/s of the default run (`python -m pyrl.ppo`), split
into its timing_s/* phases (medians over the steps after the first two). Smoke mode (benchmarks
disabled) runs 2 steps; timed runs PYRL_BENCH_STEPS (default 30)."""

import json
import os
import statistics
import subprocess
import sys


def test_default_run_step_time(benchmark, tmp_path):
    steps = 2 if benchmark.disabled else int(os.environ.get("PYRL_BENCH_STEPS", 30))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pyrl.ppo", f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
           "trainer.test_freq=-1", f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]"]

    def run():
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]

    benchmark.group = "default run (toy GRPO, tiny model)"
    benchmark.pedantic(run, rounds=1, iterations=1)
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steady = rows[2:] or rows
    summary = {key: statistics.median(r[key] for r in steady)
               for key in sorted({k for r in steady for k in r})
               if key.startswith("timing_s/") or key in ("perf/gen_tokens_per_s", "perf/throughput",
                                                         "perf/total_num_tokens")}
    benchmark.extra_info.update(summary)
    print("\n".join(f"{k:32s} {v:10.4f}" for k, v in summary.items()))
    assert summary["timing_s/step"] > 0
