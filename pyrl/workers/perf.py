"""What a phase costs against what the hardware could do: verl's perf/ metrics (memory, MFU).

MFU = the model FLOPs of the work done / its time / the peak FLOP rate, for the updates (perf/mfu/actor,
perf/mfu/critic), the old-log-prob pass (perf/mfu/actor_infer, verl's name), and pyrl's perf/mfu/ref and
perf/mfu/gen (generation: the forward FLOPs of the sequences generated, as if each were run once, KV cache and
all; prompts shared by n samples are counted n times). Model FLOPs are verl 0.9.1's estimate for a dense
decoder (its FlopsCounter for Qwen2/Llama): 6 x the dense parameters (every layer's attention and MLP
projections, plus embedding and LM head as verl counts them) x the real tokens, plus the attention,
6 x sum(seqlen^2) x head_dim x heads x layers, for forward + backward (a forward alone is a third). Padding
tokens are not model FLOPs: the padded path does more work for the same count, so it shows as a lower MFU.
Shared prompts (actor.use_prefix_grouper) run once, and the dense term counts them once.

The peak: on CUDA the device's dense bf16/fp32 spec; on CPU a matmul benchmark over all cores (the best of
1024^3 and 2048^3 matmuls: AMX bf16 reaches its rate only on the larger, 1,900 against 1,100 GFLOP/s on a
Sapphire Rapids core pair), run once per machine and cached (PYRL_CACHE_DIR), each rank's share being its
threads over the machine's cores.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from pyrl.models.tiny import default_cache_dir
from pyrl.workers.distributed import all_reduce

# dense (no sparsity) tensor throughput in TFLOP/s, by CUDA device name fragment; verl's get_device_flops
CUDA_PEAK_TFLOPS = {"H100": {"bfloat16": 989.0, "float32": 67.0}, "H200": {"bfloat16": 989.0, "float32": 67.0},
                    "H800": {"bfloat16": 989.0, "float32": 67.0}, "H20": {"bfloat16": 148.0, "float32": 44.0},
                    "A100": {"bfloat16": 312.0, "float32": 19.5}, "A800": {"bfloat16": 312.0, "float32": 19.5},
                    "L40": {"bfloat16": 181.0, "float32": 90.5}, "B200": {"bfloat16": 2250.0, "float32": 80.0}}


def memory_metrics(device: torch.device) -> dict:
    """verl's perf/ memory metrics of an update: peak CUDA memory of this process (GPU only) and the
    machine's used RAM."""
    import psutil  # lazy: psutil loads only when memory metrics are taken

    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def model_flops(hf_config, seqlens, backward: bool = True, lm_head: bool = True, tokens: int | None = None) -> float:
    """verl's FLOP estimate of running a dense decoder on sequences of these lengths (forward + backward,
    or forward only); lm_head=False for a value or reward model, whose head is one wide. tokens: the tokens
    the dense layers ran when fewer than sum(seqlens) (shared prompts run once; their attention is counted
    per sequence)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    layers = hf_config.num_hidden_layers
    attn_linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * hf_config.intermediate_size
    dense = (attn_linear + mlp) * layers + (2 * hf_config.vocab_size * hidden if lm_head else hidden)
    seqlens = [int(s) for s in seqlens]
    # verl 0.9.1 counts causal attention's scores and weighted sum as 6 x seqlen^2 x head_dim x heads per layer
    flops = (6 * dense * (sum(seqlens) if tokens is None else tokens)
             + 6 * sum(s * s for s in seqlens) * head_dim * heads * layers)
    return flops if backward else flops / 3


def mfu(hf_config, seqlens, seconds: float, device: torch.device, dtype: torch.dtype, backward: bool = True,
        lm_head: bool = True, tokens: int | None = None) -> float:
    """The model FLOPs of running these sequences (model_flops) over `seconds` and the peak of `dtype`, summed
    over the ranks before the ratio: a collective, every rank calls it."""
    rate = model_flops(hf_config, seqlens, backward, lm_head, tokens) / max(seconds, 1e-9)
    totals = all_reduce(torch.tensor([rate, peak_flops(device, dtype)], dtype=torch.float64, device=device))
    return float(totals[0] / totals[1])


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """This rank's peak FLOP/s in `dtype` (see the module docstring)."""
    name = "bfloat16" if dtype in (torch.bfloat16, torch.float16) else "float32"  # GPUs: fp16's dense peak is bf16's
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        for fragment, peaks in CUDA_PEAK_TFLOPS.items():
            if fragment in device_name:
                return peaks[name] * 1e12
        return _cached_peak(f"cuda:{device_name}:{name}", lambda: matmul_rate(device, dtype))
    cores = os.cpu_count() or 1
    # "peak-v2": entries of the 1024^3-only benchmark (bf16 read ~2x low) are measured again
    machine = _cached_peak(f"cpu:{_cpu_model()}:{cores}:{str(dtype).removeprefix('torch.')}:peak-v2",
                           lambda: max(matmul_rate(device, dtype, threads=cores, size=size) for size in (1024, 2048)))
    return machine * min(torch.get_num_threads(), cores) / cores


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cached_peak(key: str, measure) -> float:
    path = os.path.join(default_cache_dir(), "peak_flops.json")
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    return float(table[key])


def matmul_rate(device: torch.device, dtype: torch.dtype, threads: int | None = None, size: int = 1024,
                 seconds: float = 0.5) -> float:
    """Best FLOP/s of square matmuls (the rate a well-shaped GEMM reaches: the practical peak)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best, deadline = 0.0, time.perf_counter() + seconds
        while True:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            best = max(best, 4 * 2 * size**3 / elapsed)
            if time.perf_counter() > deadline:
                return best
    finally:
        torch.set_num_threads(saved)
