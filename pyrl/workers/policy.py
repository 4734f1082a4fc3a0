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


class ResponseLogProbs(nn.Module):
    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.lm = causal_lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_length: int, temperature: float = 1.0, return_entropy: bool = False):
        """input_ids [B, P + R] (left-padded prompt, then the right-padded response), attention_mask and
        position_ids alike -> log-probs [B, R] of the response tokens (and entropy [B, R]); as verl, the
        token at column P + j is scored by the hidden state at column P + j - 1."""
        batch, total = input_ids.shape
        if not 0 < response_length < total:
            raise ValueError(f"response_length: expected 1..{total - 1}, got {response_length}")
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        scoring = hidden[:, total - response_length - 1:total - 1].reshape(batch * response_length, -1)
        labels = input_ids[:, total - response_length:].reshape(-1)
        out = fused_linear_logprobs(scoring, self.lm.lm_head.weight, labels, temperature=temperature,
                                    return_entropy=return_entropy)
        # copies, not views: FSDP2 warns that an in-place op on a view output would skip its backward hook
        if return_entropy:
            logp, entropy = out
            return logp.reshape(batch, response_length).clone(), entropy.reshape(batch, response_length).clone()
        return out.reshape(batch, response_length).clone()
