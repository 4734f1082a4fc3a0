"""Attention over packed sequences (remove-padding): B sequences laid end to end as one row of T tokens,
each attending causally to its own tokens only, never across a boundary.

A Hugging Face model loaded with ``attn_implementation="pyrl_varlen"`` runs it: the caller passes no
attention mask, the keyword ``pyrl_varlen=`` a :class:`VarlenAttention` (the sequences' cu_seqlens), which
transformers hands through every decoder layer to the attention function, and position ids that restart at 0
for each sequence. Without it (a padded batch with a [B, L] mask) the model behaves exactly as with ``sdpa``.

The cost is the sum of the sequences' costs, not the square of the total:
- CUDA, bf16/fp16: one flash-attention varlen call per layer on the packed tokens: flash-attn's
  ``flash_attn_varlen_func`` where it is installed (verl's path), else torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10: no extra package).
- Otherwise (CPU, float32, or a torch without either): the sequences are grouped into buckets of similar length
  (shortest >= ``BUCKET_RATIO`` x longest), each bucket gathered into a right-padded [b, L] batch (a plain
  reshape when the bucket is the whole row) and run as one causal attention call. Right padding needs no
  mask: a real query at position i sees keys 0..i, all real; rows past a sequence's end are computed and
  dropped. On CPU a bf16/fp16 bucket of sequences up to ``CPU_MATMUL_ATTENTION_MAX_LEN`` tokens runs as two
  batched matmuls with float32 scores and softmax (the query heads of a KV group stacked, so GQA repeats
  nothing): there torch's fused CPU attention costs 1.7-2.6x more; longer buckets, and float32, run SDPA. See
  benchmarks/RESULTS.md ("packed attention on CPU") for the measurements behind both choices.

Shared prefixes (``VarlenAttention.from_shared_prefixes``, actor.use_prefix_grouper): the n samples of a prompt
hold its tokens once; each sample's sequence is gathered as prompt + its own tokens and runs the bucket path
(on CUDA too: flash-attn's varlen call has no such layout), giving the outputs of its own tokens, the first
sample also the prompt's. The gather's backward sums what every sample sends the prompt's keys and values.

The gathers are ``index_select`` on flat indices, not advanced or boolean indexing: their backward is then an
``index_add_``, 3-5x faster on CPU than the accumulating ``index_put_`` the indexing forms backpropagate by (it was
6% of a shared-prompt fp32 update on 2 cores; benchmarks/RESULTS.md). On CUDA ``index_add_`` sums by atomics, so
the gradient of a prompt shared by several samples may differ in its last bits from run to run (as flash-attention's
backward already does).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch

NAME = "pyrl_varlen"
KWARG = "pyrl_varlen"
BUCKET_RATIO = 0.75  # a bucket's shortest sequence is at least this fraction of its longest
# on CPU, bf16/fp16 buckets of sequences up to this length attend by plain matmuls, longer ones by SDPA: the
# crossover measured for 8 heads of 64 (2 KV heads), fwd + bwd (benchmarks/RESULTS.md)
CPU_MATMUL_ATTENTION_MAX_LEN = 128
# benchmarks/gpu_update.py sets this False to time the bucket path against torch's varlen kernel on one GPU
USE_TORCH_VARLEN = True


class Bucket(NamedTuple):
    """b sequences of up to L tokens attended as one right-padded [b, L] batch."""

    gather: torch.Tensor  # [b, L] int64: the row token at each position (padding reads token 0)
    given: torch.Tensor  # [n] int64: the flat index into [b * L] of the positions whose output this bucket gives


@dataclass
class VarlenAttention:
    """Which tokens of the packed row each sequence attends over, built once per forward and shared by every
    layer. Plain packing: sequence i is the run [cu_seqlens[i], cu_seqlens[i+1]) of the row. Shared prefixes
    (actor.use_prefix_grouper): the samples of one prompt hold the prompt's tokens once, then each sample's own
    tokens; each sample attends over the prompt and its own tokens (positions continue after the prompt), so
    the prompt's queries, keys and values are computed once for all its samples."""

    cu_seqlens: torch.Tensor | None  # [B + 1] int64 for plain packing (flash-attn's varlen path); None when shared
    max_seqlen: int
    # for the bucket path: a Bucket each, or none when all sequences are contiguous runs of the same length (the
    # row is then [B, L] as it stands: inverse is None)
    buckets: list[Bucket]
    # [T] int64: where each token's output lies in the concatenation of the buckets' valid outputs
    inverse: torch.Tensor | None

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device) -> "VarlenAttention":
        """Plain packing: sequences of these lengths laid end to end."""
        lengths = lengths.to("cpu", torch.int64)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest and bool((lengths == longest).all()):
            return cls(cu.to(device), longest, [], None)
        tokens = torch.arange(int(cu[-1]))
        return cls._build(tokens, cu, torch.zeros_like(lengths), cu.to(device), device)

    @classmethod
    def from_shared_prefixes(cls, tokens: torch.Tensor, lengths: torch.Tensor, owned_from: torch.Tensor,
                             device: torch.device) -> "VarlenAttention":
        """Sequences that may share tokens: sequence i attends over row tokens tokens[cu[i]:cu[i+1]] (cu from
        `lengths`), in order, causally; it gives the outputs of its positions >= owned_from[i]. Every token of
        the row must be given by exactly one sequence (a shared prefix by the first sequence that holds it)."""
        lengths = lengths.to("cpu", torch.int64)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        return cls._build(tokens.to("cpu", torch.int64), cu, owned_from.to("cpu", torch.int64), None, device)

    @classmethod
    def _build(cls, tokens, cu, owned_from, cu_seqlens, device) -> "VarlenAttention":
        lengths = cu[1:] - cu[:-1]
        buckets = _buckets(tokens, cu, lengths, owned_from)
        order = torch.cat([b.gather.reshape(-1)[b.given] for b in buckets]) if buckets else tokens[:0]
        total = int(tokens.max()) + 1 if tokens.numel() else 0
        if len(order) != total or (total and int(torch.bincount(order, minlength=total).max()) != 1):
            raise ValueError("packed attention: every token of the row must be given by exactly one sequence")
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        longest = int(lengths.max()) if lengths.numel() else 0
        return cls(cu_seqlens, longest, [Bucket(*(t.to(device) for t in bucket)) for bucket in buckets],
                   inverse.to(device))

    def as_kwargs(self) -> dict:
        """The model's keyword arguments for a packed call (with attention_mask=None)."""
        return {KWARG: self}


def _buckets(tokens: torch.Tensor, cu: torch.Tensor, lengths: torch.Tensor, owned_from: torch.Tensor) -> list[Bucket]:
    """Sequences grouped by length (shortest >= BUCKET_RATIO x longest), each bucket a right-padded [b, L] gather
    of row tokens and the positions it gives."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    order = [i for i in order if lengths[i] > 0]
    buckets, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])
        end = start + 1
        while end < len(order) and lengths[order[end]] >= BUCKET_RATIO * longest:
            end += 1
        rows = torch.tensor(order[start:end], dtype=torch.int64)
        columns = torch.arange(longest, dtype=torch.int64)
        real = columns[None, :] < lengths[rows][:, None]
        gather = torch.where(real, tokens[(cu[rows][:, None] + columns[None, :]).clamp(max=max(len(tokens) - 1, 0))], 0)
        given = real & (columns[None, :] >= owned_from[rows][:, None])
        buckets.append(Bucket(gather, given.reshape(-1).nonzero().reshape(-1)))
        start = end
    return buckets


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             sliding_window=None, **kwargs):
    """transformers attention interface: query [1, H, T, D], key/value [1, H_kv, T, D] -> ([1, T, H, D], None)."""
    packed = kwargs.pop(KWARG, None)
    if packed is None:
        # lazy: transformers stays off this module's import (pyrl.trainer.memory_plan reads its constants)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    attention_mask = packed
    if sliding_window is not None and attention_mask.max_seqlen > sliding_window:  # shorter: the window is moot
        raise NotImplementedError(f"packed attention (use_remove_padding=true): a sequence of "
                                  f"{attention_mask.max_seqlen} tokens exceeds the model's sliding window "
                                  f"({sliding_window}), which the packed path does not implement; set "
                                  "model.use_remove_padding=false for this model")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention: expected one packed row, got a batch of {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    # (a rank's empty micro-batch, which FSDP still runs, has no tokens: the bucket path returns its empty output)
    if (attention_mask.cu_seqlens is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[0] > 0):
        cu = attention_mask.cu_seqlens.to(torch.int32)
        if _flash_varlen() is not None:
            out = _flash_varlen()(q, k, v, cu, cu, attention_mask.max_seqlen, attention_mask.max_seqlen,
                                  dropout_p=dropout, softmax_scale=scaling, causal=True)
            return out.unsqueeze(0), None
        if USE_TORCH_VARLEN and not dropout and _torch_varlen()[0] is not None:
            return torch_varlen_attention(q, k, v, cu, attention_mask.max_seqlen, scaling).unsqueeze(0), None
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if attention_mask.inverse is None:  # equal lengths: [T, H, D] is [B, L, H, D] as it stands
        rows = q.shape[0] // attention_mask.max_seqlen
        qb, kb, vb = (t.view(rows, attention_mask.max_seqlen, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        return causal_attention(qb, kb, vb, scaling, dropout).transpose(1, 2).reshape(q.shape).unsqueeze(0), None
    if attention_mask.inverse.numel() == 0:
        return q.new_zeros(q.shape).unsqueeze(0), None
    pieces = []
    for bucket in attention_mask.buckets:
        rows, length = bucket.gather.shape
        qb, kb, vb = (t.index_select(0, bucket.gather.reshape(-1)).view(rows, length, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))  # [b, H, L, D]
        pieces.append(causal_attention(qb, kb, vb, scaling, dropout).transpose(1, 2).flatten(0, 1)
                      .index_select(0, bucket.given))
    return torch.cat(pieces).index_select(0, attention_mask.inverse).unsqueeze(0), None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     dropout: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scaling + causal mask) v: q [b, H, L, D], k and v [b, H_kv, L, D] -> [b, H, L, D].
    matmul_attention for short bf16/fp16 buckets on CPU, SDPA otherwise (benchmarks/RESULTS.md: in float32 SDPA's
    CPU kernel is as fast or faster at every length measured)."""
    if (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[2] <= CPU_MATMUL_ATTENTION_MAX_LEN and not dropout):
        return matmul_attention(q, k, v, scaling)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                            enable_gqa=q.shape[1] != k.shape[1])


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """causal_attention as two batched matmuls: the query heads that share a KV head stacked along the rows (one
    matmul per KV head, nothing repeated), scores and softmax in float32 (bf16 scores lose the softmax's
    precision; SDPA's CPU kernels keep them in float32 too)."""
    b, heads, length, dim = q.shape
    groups = heads // k.shape[1]
    stacked = q.float().reshape(b, k.shape[1], groups * length, dim) * scaling
    scores = torch.matmul(stacked, k.float().transpose(-1, -2)).view(b, k.shape[1], groups, length, length)
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.matmul(probs.view(b, k.shape[1], groups * length, length), v.float())
    return out.view(b, heads, length, dim).to(q.dtype)


_FLASH = []


def _flash_varlen():
    if not _FLASH:
        try:
            from flash_attn import flash_attn_varlen_func  # lazy: flash_attn is optional
        except ImportError:
            flash_attn_varlen_func = None
        _FLASH.append(flash_attn_varlen_func)
    return _FLASH[0]


_TORCH_VARLEN = []


def _torch_varlen():
    """(torch.nn.attention.varlen.varlen_attn, its parameters) or (None, {}) where this torch lacks it."""
    if not _TORCH_VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn  # lazy: torch >= 2.10 only, and only CUDA runs it
        except ImportError:
            _TORCH_VARLEN.append((None, {}))
        else:
            _TORCH_VARLEN.append((varlen_attn, inspect.signature(varlen_attn).parameters))
    return _TORCH_VARLEN[0]


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, scaling: float | None) -> torch.Tensor:
    """Causal attention of each run [cu_seqlens[i], cu_seqlens[i+1]) of q [T, H, D] over k, v [T, H_kv, D] by
    torch's flash-attention varlen kernel (CUDA, bf16/fp16). Its keywords moved between torch releases: causal
    is ``window_size=(-1, 0)`` (2.11+) or ``is_causal=True`` (2.10); GQA is ``enable_gqa`` where it exists, else
    the KV heads are repeated; without ``scale`` q is scaled to match."""
    varlen_attn, params = _torch_varlen()
    kwargs = {}
    if scaling is not None and "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None:  # a release without `scale` scales by D^-1/2
        q = q * (scaling * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def register() -> str:
    """Make ``attn_implementation="pyrl_varlen"`` known to transformers (idempotent); returns the name."""
    # lazy: transformers stays off this module's import (pyrl.trainer.memory_plan reads its constants)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*, attention_mask=None, **kwargs):
        # packed calls pass no mask (their sequences restart the position ids, from which transformers would
        # build a [T, T] block mask nobody reads); padded calls get sdpa's masks
        return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, mask)
    return NAME
