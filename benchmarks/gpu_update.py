"""The actor's whole update on a CUDA GPU, measured: time, MFU against the matmul peak measured in the same run,
packed against padded, micro-batch sizes, and the memory the 151,936-token vocabulary costs (issue 25 items 1,
2, 4 and 6, where a GPU is lent).

    python benchmarks/gpu_update.py [--out DIR] [--rounds 3] [--micro-sweep 16,32,64] [--profile [--profile-tokens N]]
                                     [--smoke-cpu]

It needs neither Ray nor vLLM. The lent GPU machines lack omegaconf and pydantic: carry their wheels (omegaconf,
antlr4-python3-runtime, pydantic, pydantic-core for cp312, annotated-types, typing-inspection) and build pyrl._C
there (`python3 setup.py build_ext --inplace`).

What runs is pyrl's own ActorRolloutRefWorker (role "actor"): one rank of a real process group (NCCL), the policy
wrapped by FSDP2 (bf16 mixed precision over float32 master weights, or float32 throughout), update_actor's real
loop (mini-batch, micro-batches, PPO clipped loss, AdamW step). No Ray: the worker runs in this process. The model
is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, vocabulary 151,936; untied
head), randomly initialised and made here.

Workers (each loaded once and kept, so the rounds can interleave them):
- `bf16 packed fused`: pyrl's default path (packed sequences, fused linear log-probs: no [tokens, vocab] logits);
- `bf16 padded fused`: model.use_remove_padding=false;
- `bf16 packed logits`: model.use_fused_kernels=false (verl's default: the logits materialised);
- `fp32 packed fused`, `fp32 padded fused`: fsdp_config.dtype=float32 (no TF32: torch's default);
- `bf16 packed buckets` (only when named in --workers): the default path with packed attention run as one SDPA
  call per length bucket and layer, as before torch's varlen kernel was used (float32 always runs that way);
- `bf16 packed budget`, `bf16 padded budget` (only when named): use_dynamic_bsz with TOKEN_BUDGET tokens per
  micro-batch instead of 16 rows;
- `bf16 packed budget torch-elementwise` (only when named): the packed budget worker with the gated MLPs'
  elementwise work run by torch's ops instead of pyrl's Triton kernels (pyrl.kernels.swiglu), and RMSNorms by
  torch's ops also where PYRL_OPS_BACKEND=triton would take pyrl.kernels.rms_norm; `bf16 packed budget hf-norms`:
  with transformers' RMSNorms (not patched), as before pyrl.models.rms_norm: A/Bs of those kernels.

Workloads (one mini-batch of 128 rows, one epoch; gradient checkpointing off; micro-batches of 16 rows unless
swept): `uniform`, every row a 256-token prompt and a 256-token response; `long-tailed`, prompt and response
lengths drawn log-normal (medians 48 and 64, cut to 16..512), padded to the widest. The micro-batch sweep runs the
default worker on the uniform workload with 4, 8, 16 and 32 rows (2k to 16k tokens).

Each cell: one warm-up update, then `--rounds` timed updates, the cells in turn within each round (interleaved).
Reported: median (min-max) seconds, tokens/s, MFU = verl 0.9.1's model FLOPs (pyrl.workers.perf.model_flops, real
tokens only) / time / the peak measured here (an 8192^3 matmul in the worker's dtype: bf16, or float32 without
TF32), verl's own perf/mfu/actor (against the datasheet), and memory: the resident state before the update
(weights, gradients, AdamW's moments of every worker held) is subtracted, so "transient" is the update's own peak
above it. Writes gpu_update.json and gpu_update.md to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "trainer"))

import memory_measure  # noqa: E402
from spread import show, spread  # noqa: E402

MODEL = dict(hidden=896, layers=24, intermediate=4864, vocab=151936, heads=14, kv_heads=2)  # Qwen2.5-0.5B's shape
SMOKE_MODEL = dict(hidden=64, layers=2, intermediate=128, vocab=1000, heads=2, kv_heads=1)
WORKERS = {
    # name: (dtype, packed, fused, packed attention: one varlen call per layer or per-bucket SDPA calls,
    #        micro-batches by a token budget instead of rows, the gated MLPs' and RMSNorms' elementwise work:
    #        pyrl's Triton kernels (the default on CUDA), torch's ops, or transformers' own norms)
    "bf16 packed fused": ("bfloat16", True, True, "varlen", False, "triton"),
    "bf16 padded fused": ("bfloat16", False, True, "varlen", False, "triton"),
    "bf16 packed logits": ("bfloat16", True, False, "varlen", False, "triton"),
    "fp32 packed fused": ("float32", True, True, "varlen", False, "triton"),
    "fp32 padded fused": ("float32", False, True, "varlen", False, "triton"),
    "bf16 packed buckets": ("bfloat16", True, True, "buckets", False, "triton"),
    "bf16 packed budget": ("bfloat16", True, True, "varlen", True, "triton"),
    "bf16 padded budget": ("bfloat16", False, True, "varlen", True, "triton"),
    "bf16 packed budget torch-elementwise": ("bfloat16", True, True, "varlen", True, "torch"),
    "bf16 packed budget hf-norms": ("bfloat16", True, True, "varlen", True, "hf-norms"),
}
DEFAULT_WORKERS = list(WORKERS)[:5]
# the `budget` workers: use_dynamic_bsz with this many tokens per micro-batch (padded: counting the padding), where
# run 3's sweep of 2026-11-26 found the time per token levels off on an H200 for this model
TOKEN_BUDGET = 32768
ROWS, MICRO = 128, 16


def workloads(smoke: bool) -> dict:
    """name -> (prompt lengths, response lengths, prompt width, response width)."""
    rows, width = (8, 16) if smoke else (ROWS, 256)
    rng = np.random.default_rng(0)
    cut = (4, 2 * width) if smoke else (16, 512)
    prompts = np.clip(rng.lognormal(np.log(48 if not smoke else 6), 0.9, rows), *cut).astype(int)
    responses = np.clip(rng.lognormal(np.log(64 if not smoke else 8), 1.0, rows), *cut).astype(int)
    return {"uniform": ([width] * rows, [width] * rows, width, width),
            "long-tailed": (prompts.tolist(), responses.tolist(), int(prompts.max()), int(responses.max()))}


def make_batch(prompt_lens, response_lens, prompt_width, response_width, vocab, seed=0):
    """Left-padded prompts and right-padded responses, as a rollout returns them, with advantages and old
    log-probs (an off-policy update: no own-log-prob bookkeeping)."""
    from pyrl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    p = torch.tensor(prompt_lens)[:, None]
    r = torch.tensor(response_lens)[:, None]
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - p).long()
    response_mask = (torch.arange(response_width) < r).long()
    prompts = torch.randint(0, vocab, (rows, prompt_width), generator=g) * prompt_mask
    responses = torch.randint(0, vocab, (rows, response_width), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], -1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompts, responses], -1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask, "advantages": torch.randn(rows, response_width, generator=g) * response_mask,
        "old_log_probs": -torch.rand(rows, response_width, generator=g) * 5,
    }, meta_info={"temperature": 1.0})


def matmul_peak(dtype, device, sides) -> float:
    """The best FLOP/s of square matmuls in dtype over these sizes (each the median of 10 timed batches of 5 after
    3 warm-up batches): the rate a well-shaped GEMM reaches here, the conservative denominator for MFU."""
    best = 0.0
    for side in sides:
        a = torch.randn(side, side, device=device).to(dtype)
        b = torch.randn(side, side, device=device).to(dtype)
        times = []
        for i in range(13 if device.type == "cuda" else 4):
            sync(device)
            start = time.perf_counter()
            for _ in range(5):
                a @ b
            sync(device)
            if i >= 3 or device.type == "cpu":
                times.append((time.perf_counter() - start) / 5)
        best = max(best, 2 * side ** 3 / float(np.median(times)))
    return best


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_process_group(device) -> None:
    """One rank of a real process group, so the worker wraps its model with FSDP2 and mixed precision (a process
    without one runs the plain module in its master dtype)."""
    from pyrl.controller.worker import Worker

    worker = Worker()
    worker.setup_distributed(*worker.master_address(), "nccl" if device.type == "cuda" else "gloo")


def make_worker(model_path, dtype, packed, fused, max_prompt, max_response, rows, budget=0, patch_norms=True):
    from pyrl.models import rms_norm
    from pyrl.workers.actor import ActorRolloutRefWorker

    overrides = memory_measure.config_overrides({"model": model_path, "prompt": max_prompt, "response": max_response,
                                                 "rows": rows, "micro": MICRO, "checkpointing": "false",
                                                 "fused": str(fused).lower()})
    overrides = [o for o in overrides if not o.startswith("actor_rollout_ref.actor.fsdp_config.dtype")] + [
        f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}", f"actor_rollout_ref.model.use_remove_padding={packed}",
        "actor_rollout_ref.actor.use_prefix_grouper=false", "actor_rollout_ref.actor.optim.lr=1e-6"]
    if budget:
        overrides += ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                      f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"]
    config = memory_measure.resolved_config(overrides)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, "actor")
    patch = rms_norm.patch_rms_norms
    if not patch_norms:  # transformers' own norms, for the A/B
        rms_norm.patch_rms_norms = lambda model: 0
    try:
        worker.init_model()
    finally:
        rms_norm.patch_rms_norms = patch
    return worker


def timed_update(worker, batch, micro, device, attention="varlen", elementwise="triton") -> dict:
    from pyrl.models import gated_mlp, rms_norm, varlen_attention
    from pyrl.ops._dispatch import choose_backend

    varlen_attention.USE_TORCH_VARLEN = attention == "varlen"
    # the torch-elementwise worker: the gated MLPs' and norms' elementwise work by torch's ops, pyrl's other ops
    # unchanged (the hf-norms worker's norms were never patched: see make_worker)
    chosen = choose_backend if elementwise != "torch" else (lambda tensor: "torch")
    gated_mlp.choose_backend = rms_norm.choose_backend = chosen
    worker.config.actor.ppo_micro_batch_size_per_gpu = micro
    sync(device)
    gc.collect()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    metrics = worker.update_actor(batch).meta_info["metrics"]
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"seconds": seconds, "transient_gib": (peak - before) / 2**30, "held_gib": before / 2**30,
            "verl_mfu": metrics["perf/mfu/actor"], "pg_loss": metrics["actor/pg_loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke-cpu", action="store_true", help="a tiny model on the CPU: checks the script's paths")
    parser.add_argument("--profile", action="store_true",
                        help="instead: torch.profiler over one update of the default worker (micro-batches of 4 rows), "
                             "and a plain bf16 HF forward + backward of one such micro-batch for comparison")
    parser.add_argument("--profile-tokens", type=int, default=0,
                        help="with --profile: profile the default worker with micro-batches by this token budget "
                             "(use_dynamic_bsz) instead of 4 rows, the shape where the device, not the host, bounds "
                             "the update; the plain-transformers comparison is left out")
    parser.add_argument("--micro-sweep", default="",
                        help="instead: only the default worker on the uniform workload at these rows per micro-batch "
                             "(comma-separated), e.g. 32,64,128")
    parser.add_argument("--workers", default="",
                        help=f"instead: only these workers (comma-separated, of {list(WORKERS)}), micro-batches of "
                             f"{MICRO} rows")
    parser.add_argument("--workloads", default="uniform,long-tailed", help="comma-separated, of uniform,long-tailed")
    args = parser.parse_args()
    if not args.smoke_cpu and not torch.cuda.is_available():
        sys.exit("gpu_update.py: needs a CUDA GPU (--smoke-cpu checks the script without one)")
    device = torch.device("cpu") if args.smoke_cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.time()
    peaks = {name: matmul_peak(dtype, device, [256] if args.smoke_cpu else [4096, 8192, 12288])
             for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
    print(f"measured matmul peak: bf16 {peaks['bfloat16'] / 1e12:.1f} TFLOP/s, fp32 (no TF32) "
          f"{peaks['float32'] / 1e12:.1f} TFLOP/s", flush=True)
    root = pathlib.Path(os.environ.get("PYRL_CACHE_DIR", "/tmp/pyrl-gpu-update"))
    shape = SMOKE_MODEL if args.smoke_cpu else MODEL
    t0 = time.time()
    model_path = memory_measure.make_model(str(root / ("smoke" if args.smoke_cpu else "qwen2.5-0.5b-shape")), **shape)
    from transformers import AutoConfig

    from pyrl.workers.perf import model_flops
    from pyrl.workers.precision import cpu_has_bf16

    hf_config = AutoConfig.from_pretrained(model_path)
    print(f"model made in {time.time() - t0:.0f} s: {model_path}", flush=True)
    start_process_group(device)
    if args.profile:
        return profile_update(model_path, device, args)
    loads = {name: w for name, w in workloads(args.smoke_cpu).items() if name in args.workloads.split(",")}
    if not loads:
        sys.exit(f"gpu_update.py: --workloads {args.workloads!r} names none of uniform, long-tailed")
    max_prompt = max(w[2] for w in loads.values())
    max_response = max(w[3] for w in loads.values())
    batches = {name: make_batch(*w, vocab=shape["vocab"], seed=i) for i, (name, w) in enumerate(loads.items())}
    workers = {}
    names = args.workers.split(",") if args.workers else DEFAULT_WORKERS
    unknown = [name for name in names if name not in WORKERS]
    if unknown:
        sys.exit(f"gpu_update.py: unknown --workers {unknown}; known: {list(WORKERS)}")
    chosen = {name: WORKERS[name] for name in (["bf16 packed fused"] if args.micro_sweep else names)}
    token_budget = 64 if args.smoke_cpu else TOKEN_BUDGET
    for name, (dtype, packed, fused, _, budgeted, elementwise) in chosen.items():
        t0 = time.time()
        workers[name] = make_worker(model_path, dtype, packed, fused, max_prompt, max_response,
                                    len(next(iter(loads.values()))[0]), token_budget if budgeted else 0,
                                    patch_norms=elementwise != "hf-norms")
        print(f"worker {name!r} ready in {time.time() - t0:.0f} s", flush=True)
    params = sum(p.numel() for p in next(iter(workers.values())).policy.parameters())
    micros = [2, 4] if args.smoke_cpu else [4, 8, 16, 32]
    cells = [(w, load, MICRO if not args.smoke_cpu else 4) for w in workers for load in loads]
    if not args.workers and "uniform" in loads:
        cells += [("bf16 packed fused", "uniform", m) for m in micros if m != (4 if args.smoke_cpu else MICRO)]
    if args.micro_sweep:
        cells = [("bf16 packed fused", "uniform", int(m)) for m in args.micro_sweep.split(",")]
    results: dict = {cell: [] for cell in cells}
    for rnd in range(args.rounds + 1):  # round 0 warms up (kernels compiled, AdamW's moments allocated)
        for cell in (cells if rnd % 2 else cells[::-1]):
            worker, load, micro = cell
            _, _, _, attention, _, elementwise = WORKERS[worker]
            out = timed_update(workers[worker], batches[load], micro, device, attention, elementwise)
            if rnd:
                results[cell].append(out)
        print(f"round {rnd} done at {time.time() - started:.0f} s", flush=True)
    rows = []
    for (worker, load, micro), runs in results.items():
        prompt_lens, response_lens, pw, rw = loads[load]
        seqlens = [p + r for p, r in zip(prompt_lens, response_lens)]
        flops = model_flops(hf_config, seqlens, backward=True)
        seconds = [r["seconds"] for r in runs]
        # the dtype the worker computes in: a CPU without native bf16 runs a bf16 worker in float32
        # (pyrl.workers.precision), and its MFU against the emulated bf16 peak could exceed 1
        computes_bf16 = worker.startswith("bf16") and (device.type == "cuda" or cpu_has_bf16())
        peak = peaks["bfloat16" if computes_bf16 else "float32"]
        rows.append({"worker": worker, "workload": load,
                     "micro_rows": f"<= {token_budget} tokens" if WORKERS[worker][4] else micro,
                     "real_tokens": sum(seqlens),
                     "padded_tokens": len(seqlens) * (pw + rw), "seconds": seconds,
                     "tokens_per_s": sum(seqlens) / spread(seconds)[0],
                     "mfu_measured_peak": [flops / s / peak for s in seconds],
                     "verl_mfu_datasheet": [r["verl_mfu"] for r in runs],
                     "transient_gib": max(r["transient_gib"] for r in runs), "held_gib": runs[-1]["held_gib"]})
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "model": {**shape, "parameters": params},
            "rows": len(next(iter(loads.values()))[0]), "rounds": args.rounds,
            "matmul_peak_flops": peaks, "seconds": time.time() - started}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_update.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    (out / "gpu_update.md").write_text(f"{meta['device']}, torch {meta['torch']}, {params / 1e6:.0f}M parameters, "
                                       f"measured peak bf16 {peaks['bfloat16'] / 1e12:.0f} / fp32 "
                                       f"{peaks['float32'] / 1e12:.1f} TFLOP/s\n\n{table}\n")
    print(table)


def profile_update(model_path, device, args) -> None:
    """Where an update's time goes when its micro-batches are small: torch.profiler's tables (self CPU time, self
    device time; the device table lists both the aten ops and their kernels, so its rows overlap) over one update,
    and the same micro-batch's forward
    + backward through plain transformers (bf16 weights, sdpa, logits materialised, no FSDP) as a lower bound."""
    from torch.profiler import ProfilerActivity, profile

    loads = workloads(args.smoke_cpu)
    prompt_lens, response_lens, pw, rw = loads["uniform"]
    batch = make_batch(prompt_lens, response_lens, pw, rw, vocab=(SMOKE_MODEL if args.smoke_cpu else MODEL)["vocab"])
    budget = args.profile_tokens
    worker = make_worker(model_path, "bfloat16", True, True, pw, rw, len(prompt_lens), budget)
    micro = 2 if args.smoke_cpu else 4
    sizes = [micro] if budget else [micro, 4 * micro]
    for m in sizes:
        timed_update(worker, batch, m, device)
    times = {m: [timed_update(worker, batch, m, device)["seconds"] for _ in range(2)] for m in sizes}
    print("update seconds: " + (f"micro-batches of <= {budget} tokens {times[micro]}" if budget else
                                ", ".join(f"{m} rows per micro-batch {t}" for m, t in times.items())), flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    worker.config.actor.ppo_micro_batch_size_per_gpu = micro
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        worker.update_actor(batch)
        sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=40)
    by_device = events.table(sort_by="self_device_time_total", row_limit=60) if device.type == "cuda" else ""
    name = f"profile-{budget}-tokens.txt" if budget else "profile.txt"
    (out / name).write_text(f"wall {wall:.3f} s\n\n{by_cpu}\n\n{by_device}\n")
    print(f"profiled update: wall {wall:.3f} s")
    print("\n".join(by_cpu.splitlines()[:28]))
    print("\n".join(by_device.splitlines()[:20]))
    if budget:
        return
    del worker
    gc.collect()
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    ids = batch.batch["input_ids"][:micro].to(device)
    seconds = []
    for i in range(6):
        sync(device)
        start = time.perf_counter()
        logits = lm(input_ids=ids).logits.float()
        logits.log_softmax(-1).gather(-1, ids[:, :, None]).mean().backward()
        del logits
        sync(device)
        seconds.append(time.perf_counter() - start)
    print(f"plain transformers bf16 forward + backward of {micro} x {ids.shape[1]} tokens: "
          f"{show(seconds[2:], 4)} s; pyrl's update per micro-batch: "
          f"{min(times[micro]) * micro / len(prompt_lens):.4f} s")


def markdown(rows) -> str:
    lines = ["| worker | workload | micro rows | real / padded tokens | update s, median (min-max) | tokens/s | "
             "MFU vs measured peak | verl perf/mfu/actor | transient GiB | held GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['worker']} | {r['workload']} | {r['micro_rows']} | "
                     f"{r['real_tokens']} / {r['padded_tokens']} "
                     f"| {show(r['seconds'], 3)} | {r['tokens_per_s']:.0f} | {show(r['mfu_measured_peak'], 3)} "
                     f"| {show(r['verl_mfu_datasheet'], 3)} | {r['transient_gib']:.2f} | {r['held_gib']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
