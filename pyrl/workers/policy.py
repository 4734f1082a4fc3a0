"""The policy forward used by the actor and reference workers: the HF causal LM's body, then the
log-probs (and entropy) of the response tokens straight from the hidden states with
pyrl.ops.fused_linear_logprobs, so no [tokens, vocab] fp32 logits tensor ever exists.

It is one nn.Module so that FSDP2 can shard it as the root: the root's hooks gather the embedding /
lm_head / final norm around this forward and its backward, the decoder layers are sharded on their own.
"""

from __future__ import annotations

import torch
from torch import nn

from pyrl.ops import fused_linear_logprobs
from pyrl.workers.batching import ModelInputs


class ResponseLogProbs(nn.Module):
    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.lm = causal_lm

    def forward(self, inputs: ModelInputs, temperature: float = 1.0, return_entropy: bool = False):
        """Log-probs [rows, width] of the tokens `inputs` scores (the responses: see ModelInputs.responses),
        and their entropy [rows, width] with return_entropy; zeros where nothing was scored."""
        hidden = inputs.hidden_states(self.lm.model)
        out = fused_linear_logprobs(inputs.scored_states(hidden), self.lm.lm_head.weight, inputs.labels,
                                    temperature=temperature, return_entropy=return_entropy)
        # scatter writes new tensors, not views: FSDP2 warns that an in-place op on a view output would skip
        # its backward hook
        if return_entropy:
            return inputs.scatter(out[0]), inputs.scatter(out[1])
        return inputs.scatter(out)
