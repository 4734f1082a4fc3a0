"""Peer kernels the GPU benchmarks compare against when they are installed (CUDA only): Liger-Kernel's
cross entropy / fused linear cross entropy and flash-attn's Triton cross entropy, each turned into
per-token log-probs (= -loss with reduction "none"), as verl calls them."""

from __future__ import annotations

import importlib.util

import pytest


def _need(module: str, device: str):
    if device != "cuda":
        pytest.skip("peer kernels run on CUDA only")
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def logprobs_fn(peer: str, device: str):
    """fn(logits, labels) -> log-probs of the labels."""
    if peer == "liger":
        _need("liger_kernel", device)
        from liger_kernel.transformers import LigerCrossEntropyLoss

        loss = LigerCrossEntropyLoss(reduction="none")
        return lambda logits, labels: -loss(logits, labels)
    if peer == "flash_attn":
        _need("flash_attn", device)
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        return lambda logits, labels: -cross_entropy_loss(logits, labels)[0]
    raise ValueError(f"peer: unknown {peer!r}")


def fused_linear_logprobs_fn(device: str):
    """fn(hidden, weight, labels) -> log-probs, Liger's chunked fused linear cross entropy."""
    _need("liger_kernel", device)
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    return lambda hidden, weight, labels: -loss(weight, hidden, labels)
