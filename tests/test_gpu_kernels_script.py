"""benchmarks/gpu_kernels.py (the GPU suite's timing half) runs where there is no GPU with --smoke-cpu: every case's
code path on tiny CPU shapes, pyrl's rows within float64 tolerance, the report written. A GPU session then finds a
script that works, not one that fails at its first line."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_kernels_smoke_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"),
                          "--smoke-cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    rows = report["rows"]
    ops = {r["op"] for r in rows}
    assert {"logprobs fwd", "logprobs fwd+bwd", "entropy fwd", "fused_linear_logprobs fwd+bwd",
            "kl_penalty low_var_kl fwd+bwd", "ppo_policy_loss vanilla fwd+bwd", "value_loss fwd+bwd", "compute_gae",
            "compute_gae whiten", "compute_gae_packed", "group_advantages grpo", "swiglu fwd", "swiglu bwd",
            "rms_norm fwd+bwd"} <= ops
    for row in rows:
        if row["impl"].startswith("pyrl"):
            assert "skipped" not in row and row["median_ms"] > 0, row
            assert row["rel_error_vs_float64"] is not None, row
            # bf16 inputs round the log-prob gradient (and the fused head's matmul) to bf16: ~1e-3; the layers'
            # kernels run here under Triton's interpreter, whose float32 -> bf16 casts truncate (twice the error of
            # rounding to nearest, which the kernels do on a GPU: bit for bit with torch's, tests/models)
            bf16_bound = 1.5e-2 if row["op"].startswith(("swiglu", "rms_norm")) else 5e-3
            assert row["rel_error_vs_float64"] < (bf16_bound if "bf16" in row["shape"] else 1e-5), row
    assert (tmp_path / "gpu_kernels.md").read_text().count("\n|") == len(rows) + 2


def test_gpu_update_smoke_cpu(tmp_path):
    """benchmarks/gpu_update.py on a tiny model on the CPU: every worker and workload cell runs the real update and
    reports its time, MFU and memory."""
    env = {**os.environ, "PYRL_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_update.py"), "--smoke-cpu", "--rounds", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_update.json").read_text())["rows"]
    cells = {(r["worker"], r["workload"], r["micro_rows"]) for r in rows}
    workers = ("bf16 packed fused", "bf16 padded fused", "bf16 packed logits", "fp32 packed fused", "fp32 padded fused")
    assert ({(w, load, 4) for w in workers for load in ("uniform", "long-tailed")}
            | {("bf16 packed fused", "uniform", 2)}) == cells
    for row in rows:
        assert len(row["seconds"]) == 1 and row["seconds"][0] > 0, row
        # positive and finite; not < 1 here: on a shared CPU the peak (one 256^3 matmul) and the update are timed
        # apart, and a slow peak measurement put the ratio over 1 under the full suite's load (2026-11-27); on a GPU
        # benchmarks/gpu_update.py measures the peak at 4096-12288 and reports it beside the MFU
        assert all(0 < m < float("inf") for m in row["mfu_measured_peak"] + row["verl_mfu_datasheet"]), row
        assert row["real_tokens"] <= row["padded_tokens"], row
    assert (tmp_path / "gpu_update.md").read_text().count("\n|") == len(rows) + 2
