"""Replacing the forward of chosen transformers modules inside a model (pyrl.models.gated_mlp, rms_norm)."""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn


def patch_forwards(model: nn.Module, applies: Callable[[nn.Module], bool], forward: Callable) -> int:
    """Bind `forward` as the forward of every module of `model` that `applies` to. Returns how many were patched."""
    patched = 0
    for module in model.modules():
        if applies(module):
            module.forward = types.MethodType(forward, module)
            patched += 1
    return patched
