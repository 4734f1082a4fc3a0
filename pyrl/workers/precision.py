"""Which dtype a model can compute in on this device: the one configured, unless it is a reduced precision
the CPU only emulates (slower than float32 there)."""

from __future__ import annotations

import functools
import logging

import torch

from pyrl.config import torch_dtype

log = logging.getLogger("pyrl")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16 instructions): elsewhere bf16
    matmuls are emulated and slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def runnable_dtype(name: str, key: str, device: torch.device, fallback: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype config key `key` (= `name`) asks for, on CUDA and where a CPU runs it natively (float32, and
    bfloat16 with AVX512-BF16/AMX); else `fallback`, said in one log line."""
    wanted = torch_dtype(name, key)
    if device.type != "cpu" or wanted in (fallback, torch.float32) or (wanted == torch.bfloat16 and cpu_has_bf16()):
        return wanted
    log.info("%s=%s: this CPU has no native %s; computing in %s", key, name, wanted, fallback)
    return fallback
