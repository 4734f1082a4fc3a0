"""logprobs_from_logits vs verl's log_softmax + gather: time, and extra peak memory (RSS on CPU, measured
in a fresh process; allocator peak on CUDA). Target (CPU, fp32, 4096 x 32000): faster, and extra peak
memory <= 1% of the logits."""

import json
import subprocess
import sys

import pytest
import torch

from pyrl.ops import logprobs_from_logits
from pyrl.ops import reference as ref

from peers import logprobs_fn as peer_logprobs_fn

N, V = 4096, 32000

_PEAK_SCRIPT = r"""
import json, resource, sys, torch
from pyrl.ops import logprobs_from_logits
from pyrl.ops import reference as ref
n, v, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
logits = torch.randn(n, v)
labels = torch.randint(0, v, (n,))
fn = logprobs_from_logits if which == "pyrl" else ref.logprobs_from_logits
fn(logits[:8], labels[:8])  # warm-up on a few rows: thread pools, lazy imports; ru_maxrss is a high-water mark
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fn(logits, labels)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_bytes": (after - before) * 1024, "logits_bytes": logits.numel() * 4}))
"""


def extra_peak_bytes(which, n=N, v=V):
    """Peak resident memory added by one call, beyond the logits, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(v), which], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


IMPLS = ["pyrl", "torch_log_softmax_gather", "liger", "flash_attn"]


def _impl(impl, device):
    if impl == "pyrl":
        return logprobs_from_logits
    if impl == "torch_log_softmax_gather":
        return ref.logprobs_from_logits
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
    ours = extra_peak_bytes("pyrl")
    theirs = extra_peak_bytes("torch")
    benchmark.extra_info.update({"pyrl_extra_bytes": ours["extra_bytes"], "torch_extra_bytes": theirs["extra_bytes"],
                                 "logits_bytes": ours["logits_bytes"]})
    print(f"\nextra peak memory: pyrl {ours['extra_bytes'] / 2**20:.1f} MiB, log_softmax+gather "
          f"{theirs['extra_bytes'] / 2**20:.1f} MiB, logits {ours['logits_bytes'] / 2**20:.1f} MiB")
    assert ours["extra_bytes"] <= 0.01 * ours["logits_bytes"], ours
    benchmark.pedantic(lambda: None, rounds=1)
