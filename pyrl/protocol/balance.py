"""Index work for batching, done in C++: balanced partitions of sequence lengths across data-parallel
ranks (Karmarkar-Karp largest differencing, as verl's seqlen balancing) and token-budget micro-batches
(dynamic batch size)."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def _seqlens_array(seqlens) -> np.ndarray:
    if isinstance(seqlens, torch.Tensor):
        seqlens = seqlens.detach().cpu().numpy()
    if isinstance(seqlens, list) and all(type(s) is int for s in seqlens[:64]):
        try:  # the common case, a list of ints: read it without an intermediate object array
            return np.fromiter(seqlens, dtype=np.int64, count=len(seqlens))
        except (TypeError, ValueError, OverflowError):
            pass  # mixed types further on: the general path below reports them
    arr = np.asarray(seqlens)
    if arr.ndim != 1:
        raise ValueError(f"seqlens: expected a 1-D sequence of lengths, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.floor(arr))):
            raise TypeError(f"seqlens: expected integer lengths, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _lists(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    items, bounds = flat.tolist(), offsets.tolist()
    return [items[begin:end] for begin, end in zip(bounds[:-1], bounds[1:])]


def balanced_partitions(seqlens, k: int, equal_size: bool = True) -> list[list[int]]:
    """k lists of indices into seqlens whose length sums are as even as Karmarkar-Karp's largest
    differencing makes them (verl's get_seqlen_balanced_partitions). equal_size: every list holds
    len(seqlens) / k indices. Each list is sorted; lists come largest sum first; deterministic."""
    from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k: expected an int, got {type(k).__name__}")
    return _lists(*_C.balanced_partitions(_seqlens_array(seqlens), int(k), bool(equal_size)))


def token_budget_micro_batches(seqlens, max_tokens: int, balanced: bool = False) -> list[list[int]]:
    """Lists of indices into seqlens whose length sums stay <= max_tokens (dynamic batch size).

    balanced=False: consecutive runs in input order, each as long as the budget allows.
    balanced=True: the fewest micro-batches with balanced sums (Karmarkar-Karp as verl's
    rearrange_micro_batches, longest-first beyond ~1e7 sequence x batch pairs), ordered by first index.
    A sequence longer than max_tokens gets a micro-batch of its own, with a warning."""
    from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
        raise TypeError(f"max_tokens: expected an int, got {type(max_tokens).__name__}")
    lengths = _seqlens_array(seqlens)
    (flat, offsets), oversized = _C.token_budget_micro_batches(lengths, int(max_tokens), bool(balanced))
    batches = _lists(flat, offsets)
    if oversized:
        shown = ", ".join(f"{i} ({lengths[i]} tokens)" for i in oversized[:5])
        warnings.warn(
            f"token_budget_micro_batches: {len(oversized)} sequence(s) longer than max_tokens={max_tokens} "
            f"each get a micro-batch of their own: {shown}{', ...' if len(oversized) > 5 else ''}",
            stacklevel=2,
        )
    return batches
