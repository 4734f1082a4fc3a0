"""logprobs_from_logits: time, and extra peak memory (RSS on CPU, measured in a fresh process), against each named
baseline (peak: VmHWM reset through /proc/self/clear_refs, minus the RSS before the call; glibc's default allocator):

- `verl091_cpu_path_v2`: verl 0.9.1's `logprobs_from_logits` as it runs without flash-attn (a CPU):
  `logprobs_from_logits_v2`, a loop over rows (fp32: gather z_y minus a stacked per-row logsumexp; bf16/fp16: a
  per-row log_softmax + gather, in the logits' dtype). Extra memory: about a row.
- `naive_log_softmax_gather`: verl 0.9.1's `logprobs_from_logits_naive`, log_softmax over [N, V] then gather (a
  [N, V] temporary in the logits' dtype); verl's dispatcher does not pick it.
- `liger`, `flash_attn` (CUDA only, when installed): flash-attn's cross entropy is verl 0.9.1's GPU path.

Transcriptions in benchmarks/verl091.py (checked against pyrl in tests/ops/test_verl091_baselines.py). Target (CPU,
fp32, 4096 x 32000): faster, and extra peak memory <= 1% of the logits."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import verl091
from peers import logprobs_fn as peer_logprobs_fn

from pyrl.ops import logprobs_from_logits

N, V = 4096, 32000

_PEAK_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[4])
import verl091
from pyrl.ops import logprobs_from_logits
def status(key):  # kB -> bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
n, v, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
logits = torch.randn(n, v)
labels = torch.randint(0, v, (n,))
fn = {"pyrl": logprobs_from_logits, "verl091_cpu_path_v2": verl091.logprobs_from_logits,
      "naive_log_softmax_gather": verl091.logprobs_from_logits_naive}[which]
fn(logits[:8], labels[:8])  # warm-up on a few rows: thread pools, lazy imports
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS (ru_maxrss would not do: Linux carries the parent's peak into the child)
fn(logits, labels)
print(json.dumps({"extra_bytes": max(0, status("VmHWM") - before), "logits_bytes": logits.numel() * 4}))
"""

CPU_IMPLS = ["pyrl", "verl091_cpu_path_v2", "naive_log_softmax_gather"]
IMPLS = CPU_IMPLS + ["liger", "flash_attn"]


def extra_peak_bytes(which, n=N, v=V):
    """Peak resident memory added by one call, beyond the logits, in a fresh process."""
    here = str(pathlib.Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(v), which, here], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _impl(impl, device):
    if impl == "pyrl":
        return logprobs_from_logits
    if impl == "verl091_cpu_path_v2":
        return verl091.logprobs_from_logits
    if impl == "naive_log_softmax_gather":
        return verl091.logprobs_from_logits_naive
    return peer_logprobs_fn(impl, device)


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_fp32(benchmark, device, impl):
    fn = _impl(impl, device)
    logits = torch.randn(N, V, device=device)
    labels = torch.randint(0, V, (N,), device=device)
    benchmark.group = f"logprobs fp32 {N}x{V} {device}"
    benchmark(fn, logits, labels)


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_bf16_fwd_bwd(benchmark, device, impl):
    fn = _impl(impl, device)
    n = 1024
    logits = torch.randn(n, V, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (n,), device=device)

    def step():
        logits.grad = None
        fn(logits, labels).sum().backward()

    benchmark.group = f"logprobs bf16 fwd+bwd {n}x{V} {device}"
    benchmark(step)


def test_logprobs_extra_peak_memory_cpu(benchmark):
    extra = {impl: extra_peak_bytes(impl) for impl in CPU_IMPLS}
    logits_bytes = extra["pyrl"]["logits_bytes"]
    benchmark.extra_info.update({f"{impl}_extra_bytes": e["extra_bytes"] for impl, e in extra.items()})
    benchmark.extra_info["logits_bytes"] = logits_bytes
    print("\nextra peak memory (fp32 %dx%d, logits %.1f MiB): " % (N, V, logits_bytes / 2**20)
          + ", ".join(f"{impl} {e['extra_bytes'] / 2**20:.1f} MiB" for impl, e in extra.items()))
    assert extra["pyrl"]["extra_bytes"] <= 0.01 * logits_bytes, extra["pyrl"]
    benchmark.pedantic(lambda: None, rounds=1)
