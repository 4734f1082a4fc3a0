"""Attention over packed sequences (remove-padding): B sequences laid end to end as one row of T tokens,
each attending causally to its own tokens only, never across a boundary.

A Hugging Face model loaded with ``attn_implementation="pyrl_varlen"`` runs it: the caller passes no
attention mask, the keyword ``pyrl_varlen=`` a :class:`VarlenAttention` (the sequences' cu_seqlens), which
transformers hands through every decoder layer to the attention function, and position ids that restart at 0
for each sequence. Without it (a padded batch with a [B, L] mask) the model behaves exactly as with ``sdpa``.

The cost is the sum of the sequences' costs, not the square of the total:
- CUDA with flash-attn installed: ``flash_attn_varlen_func`` on the packed tokens.
- Otherwise (CPU, or CUDA without flash-attn): the sequences are grouped into buckets of similar length
  (shortest >= ``BUCKET_RATIO`` x longest), each bucket gathered into a right-padded [b, L] batch and run
  through one causal SDPA call. Right padding needs no mask: a real query at position i sees keys 0..i,
  all real; rows past a sequence's end are computed and dropped. See benchmarks/RESULTS.md ("packed
  attention on CPU") for the measurements that chose this over one block-diagonal mask and over one
  SDPA call per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAME = "pyrl_varlen"
KWARG = "pyrl_varlen"
BUCKET_RATIO = 0.75  # a bucket's shortest sequence is at least this fraction of its longest


@dataclass
class VarlenAttention:
    """Where each packed sequence lies: tokens [cu_seqlens[i], cu_seqlens[i+1]) of the row. The buckets
    (token index [b, L] per bucket, and where its real tokens go) are built once per forward and shared by
    every layer."""

    cu_seqlens: torch.Tensor  # [B + 1] int64, on the model's device
    max_seqlen: int
    buckets: list  # [(gather [b, L] int64, valid [b, L] bool)], for the SDPA path

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device) -> "VarlenAttention":
        lengths = lengths.to("cpu", torch.int64)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        return cls(cu.to(device), int(lengths.max()) if lengths.numel() else 0, _buckets(lengths, cu, device))

    def as_kwargs(self) -> dict:
        """The model's keyword arguments for a packed call (with attention_mask=None)."""
        return {KWARG: self}


def _buckets(lengths: torch.Tensor, cu: torch.Tensor, device: torch.device) -> list:
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
        valid = columns[None, :] < lengths[rows][:, None]
        gather = torch.where(valid, cu[rows][:, None] + columns[None, :], cu[rows][:, None])  # padding reads token 0
        buckets.append((gather.to(device), valid.to(device)))
        start = end
    return buckets


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             sliding_window=None, **kwargs):
    """transformers attention interface: query [1, H, T, D], key/value [1, H_kv, T, D] -> ([1, T, H, D], None)."""
    packed = kwargs.pop(KWARG, None)
    if packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    attention_mask = packed
    if sliding_window is not None and attention_mask.max_seqlen > sliding_window:  # shorter: the window is moot
        raise NotImplementedError(f"packed attention (use_remove_padding=true): a sequence of {attention_mask.max_seqlen} "
                                  f"tokens exceeds the model's sliding window ({sliding_window}), which the packed path "
                                  "does not implement; set model.use_remove_padding=false for this model")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention: expected one packed row, got a batch of {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        cu = attention_mask.cu_seqlens.to(torch.int32)
        out = _flash_varlen()(q, k, v, cu, cu, attention_mask.max_seqlen, attention_mask.max_seqlen,
                              dropout_p=dropout, softmax_scale=scaling, causal=True)
        return out.unsqueeze(0), None
    groups = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape)
    for gather, valid in attention_mask.buckets:
        qb, kb, vb = (t[gather].transpose(1, 2) for t in (q, k, v))  # [b, H, L, D]
        if groups > 1:
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        ob = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout, is_causal=True,
                                                              scale=scaling)
        out = out.index_put((gather[valid],), ob.transpose(1, 2)[valid])
    return out.unsqueeze(0), None


_FLASH = []


def _flash_varlen():
    if not _FLASH:
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            flash_attn_varlen_func = None
        _FLASH.append(flash_attn_varlen_func)
    return _FLASH[0]


def register() -> str:
    """Make ``attn_implementation="pyrl_varlen"`` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*, attention_mask=None, **kwargs):
        # packed calls pass no mask (their sequences restart the position ids, from which transformers would
        # build a [T, T] block mask nobody reads); padded calls get sdpa's masks
        return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, mask)
    return NAME
