"""Packed token-level data: B sequences stored flat as [total_tokens, ...] with cu_seqlens.

A PackedLayout says where each sequence sits: packed tokens [cu_seqlens[i], cu_seqlens[i+1]), and in
the padded view [B, width] the columns [starts[i], starts[i] + len_i). Sequences are contiguous runs of
their padded rows (left padding, right padding, or a left-padded prompt followed by a right-padded
response, as the PPO loop builds input_ids), so a layout costs O(B) and packed memory is the token count.
The index work (mask -> layout, row selection, padded indices, positions) runs in pyrl._C.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def _int64_cpu(name: str, value) -> torch.Tensor:
    if isinstance(value, (list, tuple)) and not value:
        return torch.zeros(0, dtype=torch.int64)
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected integers, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64).contiguous()


class PackedLayout:
    """Where B packed sequences live: cu_seqlens [B + 1], starts [B] (padded column of each first
    token), width (padded length). mask_key / mask_dtype remember the mask it was made from, so that
    DataProto.to_padded can rebuild it."""

    __slots__ = ("cu_seqlens", "starts", "width", "mask_key", "mask_dtype")

    def __init__(self, cu_seqlens, starts, width: int, mask_key: str | None = None, mask_dtype=torch.bool, *,
                 validate: bool = True):
        self.cu_seqlens = _int64_cpu("cu_seqlens", cu_seqlens)
        self.starts = _int64_cpu("starts", starts)
        self.width = int(width)
        self.mask_key = mask_key
        self.mask_dtype = mask_dtype
        if validate:
            self._validate()

    def _validate(self):
        cu, starts = self.cu_seqlens, self.starts
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor [B + 1] starting at 0, got {cu.tolist()[:8]}")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()):
            row = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"cu_seqlens: must be non-decreasing, entry {row + 1} < entry {row}")
        if starts.shape != (cu.numel() - 1,):
            raise ValueError(f"starts: expected shape ({cu.numel() - 1},), got {tuple(starts.shape)}")
        if self.width < 0:
            raise ValueError(f"width: expected >= 0, got {self.width}")
        bad = (starts < 0) | (starts + lengths > self.width)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(f"starts: row {row} (start {int(starts[row])}, length {int(lengths[row])}) does not fit "
                             f"in width {self.width}")

    # ---- construction ----
    @classmethod
    def from_mask(cls, mask: torch.Tensor, mask_key: str | None = None) -> "PackedLayout":
        """The layout of the tokens of a [B, width] mask (nonzero = token); each row's tokens must be one
        contiguous run (a ValueError names the first row that is not)."""
        from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"mask: expected a [batch, tokens] tensor, got "
                             f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
        rows, width = mask.shape
        as_bytes = (mask != 0).to(device="cpu", dtype=torch.uint8).contiguous()
        cu, starts = torch.empty(rows + 1, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
        _C.layout_from_mask(as_bytes.numpy(), cu.numpy(), starts.numpy())
        return cls(cu, starts, width, mask_key, mask.dtype, validate=False)

    @classmethod
    def from_lengths(cls, lengths, width: int | None = None, padding_side: str = "right") -> "PackedLayout":
        """Sequences of the given lengths, right- or left-aligned in rows of `width` (default: the longest)."""
        lengths = _int64_cpu("lengths", lengths)
        if lengths.dim() != 1:
            raise ValueError(f"lengths: expected a 1-D tensor, got shape {tuple(lengths.shape)}")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
        if bool((lengths < 0).any()):
            raise ValueError(f"lengths: entry {int(torch.nonzero(lengths < 0)[0])} is negative")
        width = int(lengths.max()) if width is None and lengths.numel() else (width or 0)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        starts = torch.zeros_like(lengths) if padding_side == "right" else width - lengths
        return cls(cu, starts, width)

    # ---- properties ----
    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def __len__(self) -> int:
        return self.num_sequences

    def __repr__(self) -> str:
        return f"PackedLayout(sequences={self.num_sequences}, tokens={self.num_tokens}, width={self.width})"

    def same_as(self, other: "PackedLayout") -> bool:
        return (self is other) or (self.width == other.width and torch.equal(self.cu_seqlens, other.cu_seqlens)
                                   and torch.equal(self.starts, other.starts))

    def nbytes(self) -> int:
        return (self.cu_seqlens.numel() + self.starts.numel()) * 8

    # ---- index work (C++) ----
    def padded_index(self) -> torch.Tensor:
        """[tokens] flat index (row * width + column) of every packed token in the padded view."""
        from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

        out = torch.empty(self.num_tokens, dtype=torch.int64)
        _C.padded_index(self.cu_seqlens.numpy(), self.starts.numpy(), self.width, out.numpy())
        return out

    def position_ids(self) -> torch.Tensor:
        """[tokens] position of every packed token within its sequence (0, 1, ...)."""
        from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

        out = torch.empty(self.num_tokens, dtype=torch.int64)
        _C.positions(self.cu_seqlens.numpy(), out.numpy())
        return out

    def take(self, indices) -> tuple["PackedLayout", torch.Tensor]:
        """Layout of rows `indices` (in that order, repeats allowed) and, for each of its tokens, the
        packed token it comes from."""
        from pyrl import _C  # lazy: pyrl.protocol imports without the built C++ core (pyrl._C)

        idx = _int64_cpu("indices", indices).reshape(-1)
        n_tokens = _C.count_taken_tokens(self.cu_seqlens.numpy(), idx.numpy())
        new_cu = torch.empty(idx.numel() + 1, dtype=torch.int64)
        token_index = torch.empty(n_tokens, dtype=torch.int64)
        _C.take_rows(self.cu_seqlens.numpy(), idx.numpy(), new_cu.numpy(), token_index.numpy())
        return PackedLayout(new_cu, self.starts[idx], self.width, self.mask_key, self.mask_dtype,
                            validate=False), token_index

    def slice(self, start: int, stop: int) -> tuple["PackedLayout", int, int]:
        """Layout of rows [start, stop) and its token range [begin, end): a view, nothing gathered."""
        begin, end = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])
        return PackedLayout(self.cu_seqlens[start:stop + 1] - begin, self.starts[start:stop], self.width,
                            self.mask_key, self.mask_dtype, validate=False), begin, end

    @staticmethod
    def concat(layouts: Sequence["PackedLayout"]) -> "PackedLayout":
        """Rows of all layouts one after the other; the padded width is the widest."""
        if not layouts:
            raise ValueError("layouts: need at least one layout to concatenate")
        lengths = torch.cat([layout.lengths for layout in layouts])
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        first = layouts[0]
        return PackedLayout(cu, torch.cat([layout.starts for layout in layouts]),
                            max(layout.width for layout in layouts), first.mask_key, first.mask_dtype, validate=False)

    # ---- data movement (torch, so any dtype/device and autograd) ----
    def pack(self, padded: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """[B, width, ...] -> [tokens, ...]. index: this layout's padded_index(), when the caller moves
        several fields through one layout and computes it once."""
        if padded.dim() < 2 or tuple(padded.shape[:2]) != (self.num_sequences, self.width):
            raise ValueError(f"padded: expected shape ({self.num_sequences}, {self.width}, ...), "
                             f"got {tuple(padded.shape)}")
        flat = padded.reshape(self.num_sequences * self.width, *padded.shape[2:])
        return flat.index_select(0, (self.padded_index() if index is None else index).to(padded.device))

    def unpack(self, packed: torch.Tensor, pad_value=0, index: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, ...] -> [B, width, ...], pad_value outside the sequences (index as in pack)."""
        if packed.dim() < 1 or packed.shape[0] != self.num_tokens:
            raise ValueError(f"packed: expected {self.num_tokens} tokens in dim 0, got shape {tuple(packed.shape)}")
        out = packed.new_full((self.num_sequences * self.width, *packed.shape[1:]), pad_value)
        out = out.index_copy(0, (self.padded_index() if index is None else index).to(packed.device), packed)
        return out.reshape(self.num_sequences, self.width, *packed.shape[1:])

    def mask(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """[B, width] mask of this layout's tokens, in the dtype of the mask it was made from (index as in pack)."""
        ones = torch.ones(self.num_tokens, dtype=self.mask_dtype)
        return self.unpack(ones, pad_value=0, index=index)


class PackedTensor:
    """A token-level field kept packed: values [tokens, ...] laid out by `layout`. len() is the number
    of sequences, so it sits in a DataProto's batch next to [B, ...] tensors."""

    __slots__ = ("values", "layout")

    def __init__(self, values: torch.Tensor, layout: PackedLayout):
        if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.shape[0] != layout.num_tokens:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values: expected [{layout.num_tokens}, ...] for {layout}, got {shape}")
        self.values = values
        self.layout = layout

    def __len__(self) -> int:
        return self.layout.num_sequences

    def __repr__(self) -> str:
        return f"PackedTensor({tuple(self.values.shape)}, {self.values.dtype}, {self.layout})"

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.layout.cu_seqlens

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def device(self):
        return self.values.device

    def sequence(self, i: int) -> torch.Tensor:
        return self.values[int(self.layout.cu_seqlens[i]):int(self.layout.cu_seqlens[i + 1])]

    def to_padded(self, pad_value=0) -> torch.Tensor:
        return self.layout.unpack(self.values, pad_value)

    def to(self, *args, **kwargs) -> "PackedTensor":
        return PackedTensor(self.values.to(*args, **kwargs), self.layout)

    def equal(self, other) -> bool:
        return (isinstance(other, PackedTensor) and self.layout.same_as(other.layout)
                and self.values.dtype == other.values.dtype and torch.equal(self.values, other.values.to(self.device)))

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


def left_padded(token_lists, pad_value: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids, attention_mask) [B, width] int64, each row's tokens flush right (the
    padding generation expects); width defaults to the longest list."""
    width = max(map(len, token_lists), default=0) if width is None else width
    input_ids = torch.full((len(token_lists), width), pad_value, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, ids in enumerate(token_lists):
        if len(ids) > width:
            raise ValueError(f"left_padded: row {i} has {len(ids)} tokens, more than width={width}")
        if len(ids):
            input_ids[i, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
    return input_ids, attention_mask


def as_index_array(name: str, idxs, length: int) -> np.ndarray:
    """int64 row indices from a list / ndarray / tensor of ints (negatives wrap) or a bool mask of `length`."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    arr = np.asarray(idxs)
    if arr.dtype == np.bool_:
        if arr.shape != (length,):
            raise IndexError(f"{name}: a boolean mask must have shape ({length},), got {arr.shape}")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise IndexError(f"{name}: expected integer or boolean indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64).reshape(-1)
    bad = (arr < -length) | (arr >= length)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise IndexError(f"{name}: entry {j} is {int(arr[j])}, outside [-{length}, {length})")
    return np.where(arr < 0, arr + length, arr)
