"""pyrl.ops: fused RL loss-side ops on plain torch tensors (CPU via the C++ core, CUDA via Triton).

    from pyrl.ops import logprobs_from_logits, compute_gae, ppo_policy_loss

All return float32 and support autograd where a gradient exists. PYRL_OPS_BACKEND=triton|cpp|torch
forces a backend; pyrl.ops.reference holds the plain-torch definitions they match (verl's).
"""

from pyrl.ops.logprobs import entropy_from_logits, logprobs_from_logits
from pyrl.ops.masked import agg_loss, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "agg_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
