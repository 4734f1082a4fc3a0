"""pyrl's Triton kernels on a CUDA GPU: correctness at full size against float64, time against each named peer
and against the machine's own floor, peak memory.

    python benchmarks/gpu_kernels.py [--out DIR] [--quick]

The floor of an op is the larger of (its fewest bytes through device memory / the measured copy bandwidth) and
(its matrix FLOPs / the measured bf16 matmul rate); both ceilings are measured first in the same process (a
device-to-device copy counting bytes read plus written, an 8192^3 bf16 matmul), so the ratio time / floor says how
far each implementation is from what this card can do at all. Peers, each named for what it is:

- `torch_eager_verl_formula`: pyrl.ops.reference, the formula verl 0.9.1 writes in torch (log_softmax + gather,
  the clipped losses, ...), run eagerly;
- `verl091_gpu_path_flash_attn_ce`: flash-attn's Triton cross entropy, what verl 0.9.1's logprobs_from_logits calls
  on a GPU where flash-attn is installed (row left out, with the reason, when it is not);
- `liger`: Liger-Kernel's cross entropy / fused linear cross entropy (reduction "none", negated);
- `torch_materialized_logits`: hidden @ weight.T, then log_softmax + gather in float32 (what a trainer without a
  fused kernel does);
- `torch_ops_as_transformers`: the model layers' elementwise work as transformers' modules run it (the gated MLP's
  silu(g) * u and its autograd backward; Qwen2RMSNorm's forward and backward), beside pyrl's kernels for them
  (pyrl.kernels.swiglu, rms_norm; `--cases layers`).

Each time is triton.testing.do_bench's median with its 20th-80th percentiles, on fresh random inputs (never
zeros), inputs re-drawn between implementations. Correctness: every row of pyrl's output checked against float64
over a row sample that includes the last rows (where 32-bit offsets would overflow past 2^31 elements), and the
relative error printed beside the time. Writes gpu_kernels.json and gpu_kernels.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest
import torch

if "--smoke-cpu" in sys.argv:  # the layers' kernels, called directly, run on CPU under Triton's interpreter, which
    os.environ.setdefault("TRITON_INTERPRET", "1")  # is read when pyrl.kernels is imported (the ops take C++ there)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
import verl091  # noqa: E402

from pyrl.ops import (  # noqa: E402
    compute_gae,
    compute_gae_packed,
    entropy_from_logits,
    fused_linear_logprobs,
    group_advantages,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
from pyrl.ops import reference as ref  # noqa: E402
from pyrl.ops.masked import masked_whiten  # noqa: E402

DEVICE = "cuda"  # --smoke-cpu: "cpu", tiny shapes, to check the script's paths where there is no GPU


def bench(fn, warmup=25, rep=200):
    """(median, p20, p80) milliseconds of fn() through CUDA events (host clock, 3 calls, on CPU)."""
    if DEVICE == "cpu":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        times.sort()
        return times[1], times[0], times[2]
    from triton.testing import do_bench

    med, lo, hi = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return med, lo, hi


def peak_extra_bytes(fn):
    """Device memory fn() allocates at its peak beyond what was allocated before the call."""
    if DEVICE == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def ceilings():
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    numel, side = (1 << 30, 8192) if DEVICE == "cuda" else (1 << 22, 256)  # 4 GiB copied on a GPU
    x = torch.randn(numel, device=DEVICE, dtype=torch.float32)
    y = torch.empty_like(x)
    ms, _, _ = bench(lambda x=x, y=y: y.copy_(x))  # bound now: the del below frees them before the matmul
    bandwidth = 2 * x.numel() * 4 / (ms * 1e-3)
    del x, y
    a = torch.randn(side, side, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(side, side, device=DEVICE, dtype=torch.bfloat16)
    ms, _, _ = bench(lambda: a @ b)
    flops = 2 * side ** 3 / (ms * 1e-3)
    return bandwidth, flops


def rel_error(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def row_sample(n, device):
    """Rows 0..63, 64 spread through the middle and the last 64."""
    idx = torch.cat([torch.arange(64), torch.linspace(64, n - 65, 64).long(), torch.arange(n - 64, n)])
    return idx.unique().to(device)


class Report:
    def __init__(self, bandwidth, flops):
        self.bandwidth, self.flops, self.rows = bandwidth, flops, []

    def floor_ms(self, nbytes, nflops=0.0):
        return 1e3 * max(nbytes / self.bandwidth, nflops / self.flops)

    def add(self, op, shape, impl, fn, nbytes, nflops=0.0, error=None, skip=None):
        row = {"op": op, "shape": shape, "impl": impl, "floor_ms": self.floor_ms(nbytes, nflops), "bytes": nbytes,
               "flops": nflops, "rel_error_vs_float64": error}
        if not skip:
            try:
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                row["median_ms"], row["p20_ms"], row["p80_ms"] = bench(fn)
                row["extra_peak_MiB"] = peak_extra_bytes(fn) / 2 ** 20
                row["x_floor"] = row["median_ms"] / row["floor_ms"]
            except Exception as e:  # a peer that fails here is reported, not allowed to stop the other rows
                if impl.startswith("pyrl"):
                    raise
                skip = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if skip:
            row["skipped"] = skip
        self.rows.append(row)
        shown = "skipped: " + skip if skip else (f"{row['median_ms']:9.3f} ms [{row['p20_ms']:.3f}-{row['p80_ms']:.3f}]"
                                                f" {row['x_floor']:6.2f}x floor, +{row['extra_peak_MiB']:.0f} MiB")
        err = "" if error is None else f"  err {error:.1e}"
        print(f"{op:34s} {impl:34s} {shown}{err}", flush=True)

    def markdown(self):
        lines = [f"Ceilings measured in this run: copy {self.bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
                 f"{self.flops / 1e12:.0f} TFLOP/s.", "",
                 "| op | shape | implementation | median ms (p20-p80) | floor ms | x floor | extra peak MiB | "
                 "rel. error vs float64 |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            err = "" if r["rel_error_vs_float64"] is None else f"{r['rel_error_vs_float64']:.1e}"
            if "skipped" in r:
                lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | not run: {r['skipped']} | "
                             f"{r['floor_ms']:.3f} | | | |")
                continue
            lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['median_ms']:.3f} ({r['p20_ms']:.3f}-"
                         f"{r['p80_ms']:.3f}) | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | "
                         f"{r['extra_peak_MiB']:.0f} | {err} |")
        return "\n".join(lines)


def peer(make, *args):
    """(the peer's function, None), or (None, why it cannot run here): benchmarks/peers.py, which the pytest
    benchmarks also use, builds each peer as verl calls it and skips (pytest.skip) where it is not installed."""
    try:
        return make(*args), None
    except pytest.skip.Exception as e:
        return None, str(e)


def logprob_cases(report, n, v):
    dev = DEVICE
    shape = f"{n}x{v} bf16"
    logits = torch.randn(n, v, device=dev, dtype=torch.bfloat16) * 2
    labels = torch.randint(0, v, (n,), device=dev)
    rows = row_sample(n, dev)
    exact = torch.log_softmax(logits[rows].double(), -1)
    want_logp = exact.gather(-1, labels[rows, None]).squeeze(-1)
    want_entropy = -(exact.exp() * exact).sum(-1)
    logits_bytes = n * v * 2

    got = logprobs_from_logits(logits, labels)
    report.add("logprobs fwd", shape, "pyrl_triton", lambda: logprobs_from_logits(logits, labels), logits_bytes,
               error=rel_error(got[rows], want_logp))
    got = ref.logprobs_from_logits(logits, labels)
    report.add("logprobs fwd", shape, "torch_eager_verl_formula", lambda: ref.logprobs_from_logits(logits, labels),
               logits_bytes, error=rel_error(got[rows], want_logp))
    flash, why = peer(peers.logprobs_fn, "flash_attn", dev)
    if flash is None:
        report.add("logprobs fwd", shape, "verl091_gpu_path_flash_attn_ce", None, logits_bytes, skip=why)
    else:
        report.add("logprobs fwd", shape, "verl091_gpu_path_flash_attn_ce", lambda: flash(logits, labels), logits_bytes,
                   error=rel_error(flash(logits, labels)[rows], want_logp))
    # verl 0.9.1 without flash-attn (its logprobs_from_logits_v2 row loop): only where it finishes in seconds
    if n <= 8192:
        got = verl091.logprobs_from_logits(logits, labels)
        report.add("logprobs fwd", shape, "verl091_no_flash_attn_v2_row_loop",
                   lambda: verl091.logprobs_from_logits(logits, labels),
                   logits_bytes, error=rel_error(got[rows], want_logp))

    got = entropy_from_logits(logits)
    report.add("entropy fwd", shape, "pyrl_triton", lambda: entropy_from_logits(logits), logits_bytes,
               error=rel_error(got[rows], want_entropy))
    got = ref.entropy_from_logits(logits)
    report.add("entropy fwd", shape, "torch_eager_verl_formula", lambda: ref.entropy_from_logits(logits), logits_bytes,
               error=rel_error(got[rows], want_entropy))

    # forward + backward: the fewest bytes are the logits read twice and their gradient written once
    grad_out = torch.randn(n, device=dev)
    leaf = logits.detach().requires_grad_()

    def fwd_bwd(fn):
        def run():
            leaf.grad = None
            fn(leaf).backward(grad_out)
            return leaf.grad
        return run

    want_grad = torch.softmax(logits[rows].double(), -1) * -grad_out[rows, None].double()
    want_grad[torch.arange(len(rows)), labels[rows]] += grad_out[rows].double()
    for impl, fn in (("pyrl_triton", lambda x: logprobs_from_logits(x, labels)),
                     ("torch_eager_verl_formula", lambda x: ref.logprobs_from_logits(x, labels))):
        grad = fwd_bwd(fn)()
        report.add("logprobs fwd+bwd", shape, impl, fwd_bwd(fn), 3 * logits_bytes,
                   error=rel_error(grad[rows], want_grad))
    liger, why = peer(peers.logprobs_fn, "liger", dev)
    if liger is not None:
        fn = lambda x: liger(x, labels)  # noqa: E731
        try:
            error = rel_error(fwd_bwd(fn)()[rows], want_grad)
        except Exception as e:  # noqa: BLE001 (a peer's failure is a row of the report)
            why = f"failed: {e!r}"[:160]
    if why:
        report.add("logprobs fwd+bwd", shape, "liger_cross_entropy", None, 3 * logits_bytes, skip=why)
    else:
        report.add("logprobs fwd+bwd", shape, "liger_cross_entropy", fwd_bwd(fn), 3 * logits_bytes, error=error)


def fused_linear_cases(report, n, h, v, chunk_sweep=()):
    dev = DEVICE
    shape = f"N={n} H={h} V={v} bf16"
    hidden = (torch.randn(n, h, device=dev, dtype=torch.bfloat16) / h ** 0.25).requires_grad_()
    weight = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) / h ** 0.25).requires_grad_()
    labels = torch.randint(0, v, (n,), device=dev)
    grad_out = torch.randn(n, device=dev)
    rows = row_sample(n, dev)
    exact = torch.log_softmax(hidden[rows].detach().double() @ weight.detach().double().t(), -1)
    want = exact.gather(-1, labels[rows, None]).squeeze(-1)
    nbytes = 2 * (3 * n * h + 3 * v * h)  # hidden, weight read; their gradients written (plus reads in backward)
    nflops = 3 * 2 * n * h * v  # logits, grad_hidden, grad_weight: the matmuls no method avoids

    def fwd_bwd(fn):
        def run():
            hidden.grad = weight.grad = None
            fn().backward(grad_out)
            return hidden.grad
        return run

    def materialized():
        logits = (hidden @ weight.t()).float()
        return torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)

    impls = [("pyrl_triton", lambda: fused_linear_logprobs(hidden, weight, labels)),
             ("torch_materialized_logits", materialized)]
    impls += [(f"pyrl_triton chunk_size={c}", lambda c=c: fused_linear_logprobs(hidden, weight, labels, chunk_size=c))
              for c in chunk_sweep]
    liger, why = peer(peers.fused_linear_logprobs_fn, dev)
    if liger is not None:
        impls.append(("liger_fused_linear_cross_entropy", lambda: liger(hidden, weight, labels)))
    for impl, fn in impls:
        try:
            with torch.no_grad():
                err = rel_error(fn()[rows], want)
        except Exception as e:  # noqa: BLE001 (a peer's failure is a row of the report)
            if impl.startswith("pyrl"):
                raise
            report.add("fused_linear_logprobs fwd+bwd", shape, impl, None, nbytes, nflops, skip=f"failed: {e!r}"[:160])
            continue
        report.add("fused_linear_logprobs fwd+bwd", shape, impl, fwd_bwd(fn), nbytes, nflops, error=err)
    if why:
        report.add("fused_linear_logprobs fwd+bwd", shape, "liger_fused_linear_cross_entropy",
                   None, nbytes, nflops, skip=why)


def token_cases(report, b, t):
    dev = DEVICE
    shape = f"{b}x{t} fp32"
    n = b * t
    logp = (-torch.rand(b, t, device=dev) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(b, t, device=dev)
    refl = logp.detach() + 0.1 * torch.randn(b, t, device=dev)
    adv = torch.randn(b, t, device=dev)
    mask = (torch.rand(b, t, device=dev) > 0.2).float()
    grad = torch.randn(b, t, device=dev)

    def backward_of(fn, leaf, scalar):
        def run():
            leaf.grad = None
            out = fn()
            (out if scalar else (out * grad).sum()).backward()
            return leaf.grad
        return run

    def check(fn_pyrl, fn_ref, leaf):
        """Relative error of pyrl's value and gradient against the reference formula run in float64."""
        leaf.grad = None
        out = fn_pyrl()
        out.backward() if out.dim() == 0 else out.backward(grad)
        got_val, got_grad = out.detach(), leaf.grad.clone()
        leaf64 = leaf.detach().double().requires_grad_()
        want = fn_ref(leaf64)
        want.backward() if want.dim() == 0 else want.backward(grad.double())
        return max(rel_error(got_val, want.detach()), rel_error(got_grad, leaf64.grad))

    # kl_penalty (low_var_kl): read logp, ref; write kl; backward reads grad, logp, ref, writes the gradient
    err = check(lambda: kl_penalty(logp, refl), lambda x: ref.kl_penalty(x, refl.double()), logp)
    for impl, fn in (("pyrl_triton", lambda: kl_penalty(logp, refl)),
                     ("torch_eager_verl_formula", lambda: ref.kl_penalty(logp, refl))):
        report.add("kl_penalty low_var_kl fwd+bwd", shape, impl, backward_of(fn, logp, False), 7 * 4 * n,
                   error=err if impl == "pyrl_triton" else None)

    # ppo policy loss (vanilla, token-mean): read logp, old, adv, mask; write the gradient
    err = check(lambda: ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)[0],
                lambda x: ref.ppo_policy_loss(x, old.double(), adv.double(), mask.double(), 0.2, 0.28, 3.0)[0], logp)
    for impl, fn in (("pyrl_triton", lambda: ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)[0]),
                     ("torch_eager_verl_formula",
                      lambda: ref.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)[0])):
        report.add("ppo_policy_loss vanilla fwd+bwd", shape, impl, backward_of(fn, logp, True), 5 * 4 * n,
                   error=err if impl == "pyrl_triton" else None)

    # value loss (clipped, token-mean): read values, old values, returns, mask; write the gradient
    values = torch.randn(b, t, device=dev).requires_grad_()
    old_v = values.detach() + 0.3 * torch.randn(b, t, device=dev)
    returns = torch.randn(b, t, device=dev)
    err = check(lambda: value_loss(values, old_v, returns, mask)[0],
                lambda x: ref.value_loss(x, old_v.double(), returns.double(), mask.double())[0], values)
    for impl, fn in (("pyrl_triton", lambda: value_loss(values, old_v, returns, mask)[0]),
                     ("torch_eager_verl_formula", lambda: ref.value_loss(values, old_v, returns, mask)[0])):
        report.add("value_loss fwd+bwd", shape, impl, backward_of(fn, values, True), 5 * 4 * n,
                   error=err if impl == "pyrl_triton" else None)


def gae_float64(rewards, values, mask, gamma, lam):
    """verl's recurrence in float64 numpy, vectorized over rows, looping over t: (advantages, returns) [b, t]."""
    r, v, m = (x.double().cpu().numpy() for x in (rewards, values, mask))
    adv = np.empty_like(r)
    next_value = last_adv = np.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last_adv
        next_value = m[:, t] * v[:, t] + (1 - m[:, t]) * next_value
        last_adv = m[:, t] * a + (1 - m[:, t]) * last_adv
        adv[:, t] = last_adv
    return torch.from_numpy(adv), torch.from_numpy(adv + v)


def gae_cases(report, b, t, loop=True):
    """compute_gae at [b, t] without and with whitening, and compute_gae_packed on as many tokens in b sequences
    of uneven lengths; against a float64 oracle (gae_float64), and verl 0.9.1's loop over t where `loop`."""
    dev = DEVICE
    shape = f"{b}x{t} fp32"
    n = b * t
    mask = (torch.rand(b, t, device=dev) > 0.2).float()
    rewards = torch.randn(b, t, device=dev) * mask
    vals = torch.randn(b, t, device=dev)
    nbytes = 5 * 4 * n  # read rewards, values, mask; write advantages, returns
    adv64, ret64 = gae_float64(rewards, vals, mask, 0.99, 0.95)
    for whiten in (False, True):
        adv_p, ret_p = compute_gae(rewards, vals, mask, 0.99, 0.95, whiten=whiten)
        want = masked_whiten(adv64, mask.double().cpu()) if whiten else adv64
        err = max(rel_error(adv_p.cpu(), want), rel_error(ret_p.cpu(), ret64))
        name = "compute_gae" + (" whiten" if whiten else "")
        report.add(name, shape, "pyrl_triton", lambda w=whiten: compute_gae(rewards, vals, mask, 0.99, 0.95, whiten=w),
                   nbytes + (8 * n if whiten else 0), error=err)
        if loop:
            report.add(name, shape, "torch_eager_verl_formula (loop over t)",
                       lambda w=whiten: ref.compute_gae(rewards, vals, mask, 0.99, 0.95, whiten=w), nbytes)
    # packed: b sequences of t/2 .. 3t/2 tokens, right-padded to one [b, max] matrix for the oracle (trailing
    # masked tokens carry a zero state: the same numbers as the sequence alone)
    lengths = torch.randint(max(1, t // 2), t + t // 2 + 1, (b,))
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    total, width = int(cu[-1]), int(lengths.max())
    cols = torch.arange(width)
    valid = cols[None, :] < lengths[:, None]
    flat_index = (cu[:-1, None] + cols[None, :])[valid]
    r1, v1 = torch.randn(total, device=dev), torch.randn(total, device=dev)
    m1 = (torch.rand(total, device=dev) > 0.2).float()
    padded = [torch.zeros(b, width, dtype=x.dtype).index_put_((valid.nonzero(as_tuple=True)), x.cpu())
              for x in (r1, v1, m1)]
    adv64, ret64 = gae_float64(*padded, 0.99, 0.95)
    cu = cu.to(dev)
    adv_p, ret_p = compute_gae_packed(r1, v1, cu, 0.99, 0.95, mask=m1, whiten=False)
    assert flat_index.numel() == total
    report.add("compute_gae_packed", f"{b} seqs, {total} tokens fp32", "pyrl_triton",
               lambda: compute_gae_packed(r1, v1, cu, 0.99, 0.95, mask=m1, whiten=False), 5 * 4 * total,
               error=max(rel_error(adv_p.cpu(), adv64[valid]), rel_error(ret_p.cpu(), ret64[valid])))


def group_cases(report, samples, group):
    dev = DEVICE
    shape = f"{samples} samples, groups of {group}"
    scores = torch.randn(samples, device=dev)
    index = torch.randperm(samples, device=dev) // group
    want = ref.group_advantages(scores.double(), index, "grpo")
    err = rel_error(group_advantages(scores, index, "grpo"), want)
    response_mask = torch.ones(samples, 1, device=dev)
    index_np = index.cpu().numpy()
    impls = [("pyrl_triton", lambda: group_advantages(scores, index, "grpo"), err),
             ("verl091_grpo_vectorized", lambda: verl091.compute_grpo_vectorized_outcome_advantage(
                 scores[:, None], response_mask, index_np), None)]
    for impl, fn, e in impls:
        report.add("group_advantages grpo", shape, impl, fn, 3 * 4 * samples, error=e)


def layer_cases(report, n, intermediate, hidden):
    """The model layers' elementwise kernels (pyrl.models.gated_mlp, rms_norm with model.use_fused_kernels) at a
    micro-batch of n tokens: the gated MLP's silu(g) * u forward and its backward (h recomputed, du, dg), and
    RMSNorm forward + backward, each against torch's ops as transformers runs them and float64."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from pyrl.kernels import rms_norm, swiglu

    dev = DEVICE
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        size = torch.tensor([], dtype=dtype).element_size()

        def rounded(t, dtype=dtype):  # where the kernels (as torch's kernels) round to the tensors' dtype
            return t.to(dtype).double()

        gate, up, grad_hidden = (torch.randn(n, intermediate, device=dev).mul_(3).to(dtype) for _ in range(3))
        gd, ud, dhd = (t.double() for t in (gate, up, grad_hidden))
        s64 = torch.sigmoid(gd)
        activated = rounded(gd * s64)
        want = (activated * ud, (activated * ud, dhd * activated,
                                 rounded(dhd * ud) * s64 * (1 + gd * (1 - s64))))
        shape = f"{n}x{intermediate} {label}"
        nbytes = n * intermediate * size
        err = rel_error(swiglu.swiglu_forward(gate, up), want[0])
        report.add("swiglu fwd", shape, "pyrl_triton", lambda: swiglu.swiglu_forward(gate, up), 3 * nbytes, error=err)
        report.add("swiglu fwd", shape, "torch_ops_as_transformers",
                   lambda: torch.nn.functional.silu(gate).mul_(up), 3 * nbytes)
        got = swiglu.swiglu_backward(gate, up, grad_hidden.clone())
        err = max(rel_error(a, b) for a, b in zip(got, want[1]))
        # pyrl's writes dg over the incoming gradient, so each call takes a copy of it (timed: 2 of the 7 passes)
        report.add("swiglu bwd", shape, "pyrl_triton (+ a copy of dh)",
                   lambda: swiglu.swiglu_backward(gate, up, grad_hidden.clone()), 6 * nbytes, error=err)
        # autograd through silu(g) * u: it kept silu(g) from the forward, so it recomputes nothing and returns no h
        g_leaf, u_leaf = gate.detach().requires_grad_(), up.detach().requires_grad_()
        product = torch.nn.functional.silu(g_leaf) * u_leaf
        report.add("swiglu bwd", shape, "torch_ops_as_transformers (autograd)",
                   lambda: torch.autograd.grad(product, (g_leaf, u_leaf), grad_hidden, retain_graph=True), 6 * nbytes)

        norm = Qwen2RMSNorm(hidden).to(dev, dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(hidden))
        x = torch.randn(n, hidden, device=dev).mul_(2).to(dtype).requires_grad_()
        dy = torch.randn(n, hidden, device=dev).to(dtype)
        # pyrl.models.rms_norm's formula in float64, with its roundings to the dtype
        x64, w64, dy64 = x.detach().double(), norm.weight.detach().double(), dy.double()
        rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        normed = x64 * rstd
        grad_normed = rounded(dy64 * w64)
        want_dx = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        want_dw = (dy64 * rounded(normed)).sum(0)

        def pyrl_norm():
            y, rstd = rms_norm.rms_norm_forward(x.detach(), norm.weight.detach(), norm.variance_epsilon)
            return y, *rms_norm.rms_norm_backward(x.detach(), norm.weight.detach(), rstd, dy)

        def transformers_norm():
            x.grad = norm.weight.grad = None
            norm(x).backward(dy)

        y, dx, dw = pyrl_norm()
        err = max(rel_error(y, w64 * rounded(normed)), rel_error(dx, want_dx), rel_error(dw, want_dw))
        shape = f"{n}x{hidden} {label}"
        nbytes = n * hidden * size  # x read twice, dy once, y and dx written
        report.add("rms_norm fwd+bwd", shape, "pyrl_triton", pyrl_norm, 5 * nbytes, error=err)
        report.add("rms_norm fwd+bwd", shape, "torch_ops_as_transformers", transformers_norm, 5 * nbytes)


def profile_token_ops(b=1024, t=4096):
    """torch.profiler's device-time table for one call of each token-level op (fwd+bwd where it has one): how many
    kernels each launches and where its time goes, for the ops far above their floor."""
    from torch.profiler import ProfilerActivity, profile

    logp = (-torch.rand(b, t, device="cuda") * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(b, t, device="cuda")
    adv = torch.randn(b, t, device="cuda")
    mask = (torch.rand(b, t, device="cuda") > 0.2).float()
    calls = {"ppo_policy_loss fwd+bwd": lambda: ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)[0].backward(),
             "value_loss fwd+bwd": lambda: value_loss(logp, old, adv, mask)[0].backward(),
             "compute_gae whiten": lambda: compute_gae(adv, old, mask, 0.99, 0.95)}
    for name, call in calls.items():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        print(f"== {name} ({b}x{t})")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_kernels.json / .md")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a minute)")
    parser.add_argument("--cases", default="logprobs,fused_linear,token,gae,group,layers",
                        help="which groups of rows to run (comma-separated; default all)")
    parser.add_argument("--profile", action="store_true", help="also print the profiler's table for the token ops")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny shapes on the CPU: checks the script, times nothing")
    args = parser.parse_args()
    global DEVICE
    if args.smoke_cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("gpu_kernels.py: needs a CUDA GPU (--smoke-cpu checks the script without one)")
    os.environ.pop("PYRL_OPS_BACKEND", None)
    start = time.time()
    torch.manual_seed(0)
    bandwidth, flops = ceilings()
    report = Report(bandwidth, flops)
    print(f"{DEVICE}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s",
          flush=True)
    cases = set(args.cases.split(","))
    unknown = cases - {"logprobs", "fused_linear", "token", "gae", "group", "layers"}
    if unknown:
        sys.exit(f"--cases: unknown {sorted(unknown)}")
    if args.smoke_cpu:
        shapes = {"logprobs": [(200, 97)], "fused_linear": [(200, 16, 97, (64,))], "token": [(4, 33)],
                  "gae": [(4, 33, True)], "group": [(64, 4)], "layers": [(16, 48, 32)]}
    elif args.quick:
        shapes = {"logprobs": [(4096, 32000)], "fused_linear": [(2048, 1024, 32000, ())], "token": [(256, 1024)],
                  "gae": [(64, 1024, True)], "group": [(4096, 8)], "layers": [(8192, 4864, 896)]}
    else:
        shapes = {"logprobs": [(8192, 151936), (16384, 151936)],  # 16384 x 151936 = 2.49e9 logits: past 2^31
                  "fused_linear": [(8192, 4096, 151936, (512, 1024, 2048, 4096))],
                  "token": [(1024, 4096)],
                  "gae": [(512, 4096, True), (16, 131072, False)],  # kernel_anchors.md's G1; G2 (few long sequences)
                  "group": [(1 << 20, 16)],
                  "layers": [(32768, 4864, 896)]}  # a 32k-token micro-batch of Qwen2.5-0.5B (gpu_update.py's)
    runners = {"logprobs": logprob_cases, "fused_linear": fused_linear_cases, "token": token_cases,
               "gae": gae_cases, "group": group_cases, "layers": layer_cases}
    for name in ("logprobs", "fused_linear", "token", "gae", "group", "layers"):
        if name in cases:
            for shape in shapes[name]:
                runners[name](report, *shape)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "seconds": time.time() - start,
            "copy_bytes_per_s": bandwidth, "bf16_matmul_flops": flops,
            "fp32_accumulating_mm": DEVICE == "cuda" and sys.modules["pyrl.ops.fused_linear_logprobs"]
            .fp32_accumulating_addmm(torch.device("cuda"))}
    print("grad_weight accumulated by torch.addmm(out_dtype=float32):", meta["fp32_accumulating_mm"])
    (out / "gpu_kernels.json").write_text(json.dumps({"meta": meta, "rows": report.rows}, indent=1))
    (out / "gpu_kernels.md").write_text(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}\n\n"
                                         + report.markdown() + "\n")
    print(report.markdown())
    if args.profile and DEVICE == "cuda":
        profile_token_ops()


if __name__ == "__main__":
    main()
