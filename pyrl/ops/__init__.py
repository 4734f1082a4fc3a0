"""pyrl.ops: fused RL loss-side ops on plain torch tensors (CPU via the C++ core, CUDA via Triton).

    from pyrl.ops import logprobs_from_logits, compute_gae, ppo_policy_loss

All return float32 and support autograd where a gradient exists. PYRL_OPS_BACKEND=triton|cpp|torch
forces a backend; pyrl.ops.reference holds the plain-torch definitions they match (verl's).
"""

from pyrl.ops.fused_linear_logprobs import fused_linear_logprobs
from pyrl.ops.gae import compute_gae, compute_gae_packed
from pyrl.ops.group_advantages import GROUP_ESTIMATORS, group_advantages
from pyrl.ops.kl_penalty import KL_KINDS, kl_penalty
from pyrl.ops.logprobs import entropy_from_logits, logprobs_from_logits
from pyrl.ops.masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from pyrl.ops.policy_loss import POLICY_LOSS_MODES, ppo_policy_loss
from pyrl.ops.value_loss import value_loss

__all__ = [
    "GROUP_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "agg_loss",
    "compute_gae",
    "compute_gae_packed",
    "entropy_from_logits",
    "fused_linear_logprobs",
    "group_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "value_loss",
]
