"""The policy forward used by the actor and reference workers: the HF causal LM's body, then the
log-probs (and entropy) of the response tokens only. With model.use_fused_kernels they come straight from the
hidden states (pyrl.ops.fused_linear_logprobs: no [tokens, vocab] logits tensor ever exists); without, from the
lm_head's logits of the response tokens (pyrl.ops.logprobs_from_logits), as verl's unfused path.

It is one nn.Module so that FSDP2 can shard it as the root: the root's hooks gather the embedding /
lm_head / final norm around this forward and its backward, the decoder layers are sharded on their own.
"""

from __future__ import annotations

import torch
from torch import nn

from pyrl.ops import fused_linear_logprobs, logprobs_from_logits
from pyrl.ops.fused_linear_logprobs import default_chunk_size
from pyrl.workers.batching import ModelInputs


def sum_pi_squared(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """sum_v pi_v^2 [N] with pi = softmax(hidden @ weight.T / temperature) (verl's
    calculate_sum_pi_squared_from_logits), not differentiable. One float32 [rows, V] block of logits at a time,
    with its hidden-dtype original no bigger than fused_linear_logprobs' block."""
    n, size = hidden.shape[0], hidden.element_size()
    rows = default_chunk_size(n, *weight.shape, hidden.is_cuda)
    if size < 4:  # the float32 copy lives beside the block it is made from
        rows = max(1, rows * size // (size + 4))
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for start in range(0, n, rows):
            logits = (hidden[start:start + rows] @ weight.t()).float()
            # e = exp((z - max z) / T) is in (0, 1] and sums to >= 1: no overflow; sum pi^2 = sum e^2 / (sum e)^2
            e = logits.sub_(logits.amax(-1, keepdim=True)).div_(temperature).exp_()
            total = e.sum(-1)
            out[start:start + rows] = e.square_().sum(-1) / total.square()
    return out


def topk_log_probs(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, k: int = 0,
                   ids: torch.Tensor | None = None, chunk_rows: int | None = None) -> tuple:
    """Log-probs log softmax(hidden @ weight.T / temperature) [N, K] at the top k tokens (-> (log-probs, ids),
    not differentiable: the teacher's), or at given `ids` [N, K] (-> (log-probs, the top-K ids), the log-probs
    differentiable: the student's); float32 logsumexp, `chunk_rows` rows at a time (None: all at once; the same
    numbers, less memory at once)."""
    n = hidden.shape[0]
    chunk_rows = chunk_rows or max(n, 1)
    values, top = [], []
    for start in range(0, n, chunk_rows):
        logits = (hidden[start:start + chunk_rows] @ weight.t()).float() / temperature
        log_z = logits.logsumexp(-1, keepdim=True)
        if ids is None:
            with torch.no_grad():
                best, index = logits.topk(k, dim=-1)
            values.append(best - log_z)
            top.append(index)
        else:
            values.append(logits.gather(-1, ids[start:start + chunk_rows]) - log_z)
            top.append(logits.detach().topk(ids.shape[-1], dim=-1).indices)
    if not values:
        width = k if ids is None else ids.shape[-1]
        return hidden.new_zeros((0, width), dtype=torch.float32), torch.zeros((0, width), dtype=torch.long,
                                                                              device=hidden.device)
    return torch.cat(values), torch.cat(top)


class ResponseLogProbs(nn.Module):
    def __init__(self, causal_lm: nn.Module, use_fused_kernels: bool = True):
        super().__init__()
        self.lm = causal_lm
        self.use_fused_kernels = use_fused_kernels

    def forward(self, inputs: ModelInputs, temperature: float = 1.0, return_entropy: bool = False,
                return_sum_pi_squared: bool = False, topk: int = 0, at_ids: torch.Tensor | None = None,
                chunk_rows: int | None = None):
        """Log-probs [rows, width] of the tokens `inputs` scores (the responses: see ModelInputs.responses),
        and their entropy [rows, width] with return_entropy; zeros where nothing was scored. With
        return_sum_pi_squared, sum_pi_squared (above) [rows, width] too, last in the tuple.

        Distillation (topk_log_probs above): with `topk` only the top-k log-probs and ids [rows, width, k] (the
        teacher's pass); with `at_ids` [rows, width, K] the log-probs at those ids and the top-K ids
        [rows, width, K] follow the other outputs (the student's update)."""
        hidden = inputs.scored_states(inputs.hidden_states(self.lm.model))
        if topk:
            return tuple(inputs.scatter(v) for v in topk_log_probs(hidden, self.lm.lm_head.weight, temperature, topk,
                                                                   chunk_rows=chunk_rows))
        if at_ids is not None:
            ids = at_ids.reshape(-1, at_ids.shape[-1]).index_select(0, inputs.out_index)
            extra = tuple(inputs.scatter(v) for v in topk_log_probs(hidden, self.lm.lm_head.weight, temperature,
                                                                    ids=ids, chunk_rows=chunk_rows))
            out = self._log_probs(hidden, inputs, temperature, return_entropy, return_sum_pi_squared)
            return (*(out if isinstance(out, tuple) else (out,)), *extra)
        return self._log_probs(hidden, inputs, temperature, return_entropy, return_sum_pi_squared)

    def _log_probs(self, hidden, inputs: ModelInputs, temperature, return_entropy, return_sum_pi_squared):
        if self.use_fused_kernels:
            # the update reduces its losses with .backward(): every micro-batch adds the head's weight gradient
            # into the float32 .grad in place (the first makes it), with no [vocab, hidden] float32 buffer beside it
            out = fused_linear_logprobs(hidden, self.lm.lm_head.weight, inputs.labels, temperature=temperature,
                                        return_entropy=return_entropy, grad_into_weight=torch.is_grad_enabled())
        else:
            out = logprobs_from_logits(self.lm.lm_head(hidden), inputs.labels, temperature=temperature,
                                       return_entropy=return_entropy)
        if return_sum_pi_squared:
            out = (*(out if return_entropy else (out,)), sum_pi_squared(hidden, self.lm.lm_head.weight, temperature))
            return tuple(inputs.scatter(values) for values in out)
        # scatter writes new tensors, not views: FSDP2 warns that an in-place op on a view output would skip
        # its backward hook
        if return_entropy:
            return inputs.scatter(out[0]), inputs.scatter(out[1])
        return inputs.scatter(out)
