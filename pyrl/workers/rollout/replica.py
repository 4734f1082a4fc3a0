"""What a rollout server answers an agent loop's request with (verl 0.9.1's `verl.workers.rollout.replica.TokenOutput`,
same module path under pyrl, so a verl agent loop's imports need only the package name changed)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel


class TokenOutput(BaseModel):
    token_ids: list[int]
    """response token ids"""
    log_probs: Optional[list[float]] = None
    """log-probs of the response token ids (with sampling_params["logprobs"])"""
    routed_experts: Optional[Any] = None
    """routed experts of the response token ids (pyrl: always None; it has no router replay)"""
    stop_reason: Optional[str] = None
    """'completed', 'aborted', or None for unknown"""
    num_preempted: Optional[int] = None
    """times the request was preempted (pyrl: None, not measured)"""
    extra_fields: dict[str, Any] = {}
    """extra fields for dynamic addition"""
