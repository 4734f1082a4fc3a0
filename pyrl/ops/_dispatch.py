"""Backend choice and argument checks shared by the pyrl.ops entries.

Backends: "triton" (CUDA tensors; CPU tensors too under TRITON_INTERPRET=1), "cpp" (pyrl._C, CPU
tensors) and "torch" (pyrl.ops.reference). PYRL_OPS_BACKEND forces one; otherwise CUDA tensors go to
Triton (or torch where Triton is not installed) and CPU tensors to the C++ core.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("triton", "cpp", "torch")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        # lazy: probes whether the optional triton is installed
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def forced_backend() -> str:
    """The backend PYRL_OPS_BACKEND names ("" when unset), as written, lower-cased."""
    return os.environ.get("PYRL_OPS_BACKEND", "").strip().lower()


def choose_backend(tensor: torch.Tensor) -> str:
    forced = forced_backend()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"PYRL_OPS_BACKEND={forced!r}: expected one of {', '.join(BACKENDS)}")
        if forced == "triton":
            if not triton_available():
                raise ValueError("PYRL_OPS_BACKEND=triton: triton is not installed (pip install triton)")
            if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "PYRL_OPS_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before pyrl.kernels is "
                    "imported"
                )
        if forced == "cpp" and tensor.device.type != "cpu":
            raise ValueError(f"PYRL_OPS_BACKEND=cpp takes CPU tensors, got a tensor on {tensor.device}")
        return forced
    if tensor.device.type == "cpu":
        return "cpp"
    if tensor.is_cuda and triton_available():
        return "triton"
    return "torch"


def as_buffer(t: torch.Tensor):
    """Zero-copy numpy view of a CPU tensor for pyrl._C (bf16 travels as raw int16)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def maybe_buffer(t: torch.Tensor | None):
    return None if t is None else as_buffer(t)


def check_tensor(name: str, t, *, floating: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    return t


def check_same_shape(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {ref_name} shape {tuple(ref.shape)}")
        if t.device != ref.device:
            raise ValueError(f"{name}: on {t.device}, but {ref_name} is on {ref.device}")


def check_positive(name: str, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {value!r}") from None
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"{name}: must be a finite number > 0, got {value}")
    return value


def float32_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Elementwise kernels read float32; masks and bf16 inputs are converted (a [B, T] copy, not [.., V])."""
    if t.dtype == torch.float32 and not t.requires_grad and t.is_contiguous():
        return t  # the common case, without the three dispatcher calls
    return t.detach().to(torch.float32).contiguous()
