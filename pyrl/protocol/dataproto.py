"""DataProto: the batch every stage of the PPO loop passes on, with verl's API and semantics.

`batch` maps names to tensors sharing dim 0 (per sample, [B, ...]) or to PackedTensors (token-level
fields kept flat, [tokens, ...] with cu_seqlens); `non_tensor_batch` maps names to numpy arrays of
length B (object arrays for strings and dicts); `meta_info` is a plain dict. Row operations (index,
slice, repeat, concat, chunk) apply to all three; for packed fields the index work runs in pyrl._C.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from pyrl.protocol.packed import PackedLayout, PackedTensor, as_index_array
from pyrl.protocol.storage import dtype_from_name, load_dataproto, save_dataproto, tensor_from_state, tensor_to_state

AUTO_PADDING_KEY = "_pyrl_auto_padding"


def _length(value) -> int:
    return len(value) if isinstance(value, PackedTensor) else int(value.shape[0])


def _values_equal(a, b) -> bool:
    if isinstance(a, PackedTensor):
        return a.equal(b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b.to(a.device)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        return all(_values_equal(x, y) for x, y in zip(a.ravel().tolist(), b.ravel().tolist()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN == NaN for the purpose of "same value"
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _as_object_array(name: str, value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non_tensor_batch[{name!r}]: expected an array with a batch dimension, got a 0-d array")
        return value
    if isinstance(value, (list, tuple)):
        arr = np.empty(len(value), dtype=object)
        arr[:] = list(value)  # element-wise, so nested lists stay Python objects
        return arr
    raise TypeError(f"non_tensor_batch[{name!r}]: expected a numpy array or a list, got {type(value).__name__}")


def _take_rows(batch: dict, idx: np.ndarray) -> dict:
    """Rows idx of every field; packed fields sharing a layout share the new one (computed once)."""
    out, new_layouts = {}, {}
    idx_cpu = torch.from_numpy(idx)
    for key, value in batch.items():
        if isinstance(value, PackedTensor):
            lid = id(value.layout)
            if lid not in new_layouts:
                new_layouts[lid] = value.layout.take(idx_cpu)
            layout, token_index = new_layouts[lid]
            out[key] = PackedTensor(value.values.index_select(0, token_index.to(value.device)), layout)
        else:
            out[key] = value.index_select(0, idx_cpu.to(value.device))
    return out


def _slice_rows(batch: dict, start: int, stop: int, step: int) -> dict:
    if step != 1:
        return _take_rows(batch, np.arange(start, stop, step, dtype=np.int64))
    out, new_layouts = {}, {}
    for key, value in batch.items():
        if isinstance(value, PackedTensor):
            lid = id(value.layout)
            if lid not in new_layouts:
                new_layouts[lid] = value.layout.slice(start, stop)
            layout, begin, end = new_layouts[lid]
            out[key] = PackedTensor(value.values[begin:end], layout)
        else:
            out[key] = value[start:stop]
    return out


@dataclass
class DataProtoItem:
    """One row of a DataProto: tensors indexed at the row (a packed field gives its sequence's tokens)."""

    batch: dict = field(default_factory=dict)
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    batch: dict = field(default_factory=dict)
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.batch = {} if self.batch is None else dict(self.batch)
        self.non_tensor_batch = {} if self.non_tensor_batch is None else dict(self.non_tensor_batch)
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ---- construction ----
    def check_consistency(self):
        lengths = {}
        for key, value in self.batch.items():
            if not isinstance(value, (torch.Tensor, PackedTensor)):
                raise TypeError(f"batch[{key!r}]: expected a torch.Tensor or PackedTensor, got {type(value).__name__}")
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                raise ValueError(f"batch[{key!r}]: expected a batch dimension, got a 0-d tensor")
            lengths[f"batch[{key!r}]"] = _length(value)
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}]: expected a numpy array, got {type(value).__name__}")
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}]: expected a batch dimension, got a 0-d array")
            lengths[f"non_tensor_batch[{key!r}]"] = value.shape[0]
        if len(set(lengths.values())) > 1:
            first = next(iter(lengths.items()))
            other = next((k, n) for k, n in lengths.items() if n != first[1])
            raise ValueError(f"{other[0]} has {other[1]} rows but {first[0]} has {first[1]}: all fields of a DataProto "
                             "must share dim 0")
        clash = set(self.batch) & set(self.non_tensor_batch)
        if clash:
            raise ValueError(f"key {sorted(clash)[0]!r} is both in batch and in non_tensor_batch")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info: expected a dict, got {type(self.meta_info).__name__}")

    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None, meta_info: dict | None = None,
                  num_batch_dims: int = 1, auto_padding: bool = False) -> "DataProto":
        if num_batch_dims != 1:
            raise ValueError(f"num_batch_dims: only 1 batch dimension is supported, got {num_batch_dims}")
        tensors = dict(tensors or {})
        non_tensors = {k: _as_object_array(k, v) for k, v in (non_tensors or {}).items()}
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None, auto_padding: bool = False) -> "DataProto":
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, (torch.Tensor, PackedTensor)):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(f"data[{key!r}]: expected a tensor, numpy array or list, got {type(value).__name__}")
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    # ---- size and indexing ----
    def __len__(self) -> int:
        for value in self.batch.values():
            return _length(value)
        for value in self.non_tensor_batch.values():
            return value.shape[0]
        return 0

    def __getitem__(self, item):
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of range for a DataProto of {n} rows")
            i = int(item) % n
            batch = {k: v.sequence(i) if isinstance(v, PackedTensor) else v[i] for k, v in self.batch.items()}
            return DataProtoItem(batch, {k: v[i] for k, v in self.non_tensor_batch.items()}, self.meta_info)
        raise TypeError(f"index: expected an int, slice, list, numpy array or tensor, got {type(item).__name__}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def select_idxs(self, idxs) -> "DataProto":
        """Rows idxs (ints, negatives wrap, repeats allowed; or a boolean mask over the rows)."""
        idx = as_index_array("idxs", idxs, len(self))
        return type(self)(_take_rows(self.batch, idx), {k: v[idx] for k, v in self.non_tensor_batch.items()},
                          self.meta_info)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        """Rows start:end:step; with step 1 tensors and packed fields are views, not copies."""
        start, end, step = slice(start, end, step).indices(len(self))
        if step == 1:
            end = max(end, start)
        batch = _slice_rows(self.batch, start, end, step)
        return type(self)(batch, {k: v[start:end:step] for k, v in self.non_tensor_batch.items()}, self.meta_info)

    def reorder(self, indices) -> None:
        """Permute the rows in place."""
        idx = as_index_array("indices", indices, len(self))
        self.batch = _take_rows(self.batch, idx)
        self.non_tensor_batch = {k: v[idx] for k, v in self.non_tensor_batch.items()}

    # ---- columns ----
    def _check_keys(self, where: str, keys, available) -> list:
        if keys is None:
            return list(available)
        keys = [keys] if isinstance(keys, str) else list(keys)
        for key in keys:
            if key not in available:
                raise KeyError(f"{where}: no key {key!r} (have {sorted(available)})")
        return keys

    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None, deepcopy: bool = False):
        """A DataProto with only these columns (None = all); tensors are shared, deepcopy copies the rest."""
        batch = {k: self.batch[k] for k in self._check_keys("batch_keys", batch_keys, self.batch)}
        non_tensor = {k: self.non_tensor_batch[k]
                      for k in self._check_keys("non_tensor_batch_keys", non_tensor_batch_keys, self.non_tensor_batch)}
        meta = {k: self.meta_info[k] for k in self._check_keys("meta_info_keys", meta_info_keys, self.meta_info)}
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch, non_tensor, meta)

    def pop(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> "DataProto":
        """Remove these columns (None = none) and return them as a DataProto."""
        batch_keys = self._check_keys("batch_keys", batch_keys or [], self.batch)
        non_tensor_keys = self._check_keys("non_tensor_batch_keys", non_tensor_batch_keys or [], self.non_tensor_batch)
        meta_keys = self._check_keys("meta_info_keys", meta_info_keys or [], self.meta_info)
        return type(self)({k: self.batch.pop(k) for k in batch_keys},
                          {k: self.non_tensor_batch.pop(k) for k in non_tensor_keys},
                          {k: self.meta_info.pop(k) for k in meta_keys})

    def rename(self, old_keys=None, new_keys=None) -> "DataProto":
        """Rename batch keys in place."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise ValueError(f"new_keys: {len(new)} names for {len(old)} old_keys")
        self._check_keys("old_keys", old, self.batch)
        remaining = set(self.batch) - set(old)
        for name in new:
            if name in remaining or name in self.non_tensor_batch:
                raise ValueError(f"new_keys: {name!r} already exists")
        if len(set(new)) != len(new):
            raise ValueError(f"new_keys: duplicate names {new}")
        values = [self.batch.pop(k) for k in old]
        self.batch.update(zip(new, values))
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Add other's columns in place; a key both have must hold equal values."""
        if len(self.batch) and len(other.batch) and len(self) != len(other):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        for target, source, where in ((self.batch, other.batch, "batch"),
                                      (self.non_tensor_batch, other.non_tensor_batch, "non_tensor_batch"),
                                      (self.meta_info, other.meta_info, "meta_info")):
            for key, value in source.items():
                if key in target and not _values_equal(target[key], value):
                    raise ValueError(f"union: {where}[{key!r}] differs between the two DataProtos")
                target.setdefault(key, value)
        self.check_consistency()
        return self

    # ---- many rows ----
    def is_padding_enabled(self) -> bool:
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False))

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into `chunks` consecutive pieces (views); len must divide unless auto padding is enabled,
        then piece sizes differ by at most one."""
        if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunks: expected a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks and not self.is_padding_enabled():
            raise ValueError(f"chunk: {n} rows do not split into {chunks} equal chunks (enable auto padding, or "
                             "pad with pad_dataproto_to_divisor)")
        bounds = np.cumsum([0] + [n // chunks + (i < n % chunks) for i in range(chunks)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive pieces of split_size rows (the last may be shorter)."""
        if isinstance(split_size, bool) or not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise ValueError(f"split_size: expected a positive int, got {split_size!r}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Rows of all pieces in order. meta_info is merged (a key in several pieces must have equal
        values), except `metrics`, which is gathered from every piece into a dict of lists."""
        data = list(data)
        if not data:
            raise ValueError("concat: need at least one DataProto")
        first = data[0]
        for i, d in enumerate(data[1:], 1):
            for where, a, b in (("batch", first.batch, d.batch), ("non_tensor_batch", first.non_tensor_batch,
                                                                   d.non_tensor_batch)):
                if a.keys() != b.keys():
                    diff = sorted(set(a) ^ set(b))
                    raise ValueError(f"concat: {where} keys of piece {i} differ from piece 0 (key {diff[0]!r})")
        batch, new_layouts = {}, {}
        for key, value in first.batch.items():
            pieces = [d.batch[key] for d in data]
            if isinstance(value, PackedTensor):
                if not all(isinstance(p, PackedTensor) for p in pieces):
                    raise TypeError(f"concat: batch[{key!r}] is packed in piece 0 but not in every piece")
                lid = tuple(id(p.layout) for p in pieces)
                if lid not in new_layouts:
                    new_layouts[lid] = PackedLayout.concat([p.layout for p in pieces])
                batch[key] = PackedTensor(torch.cat([p.values for p in pieces]), new_layouts[lid])
            else:
                if any(isinstance(p, PackedTensor) for p in pieces):
                    raise TypeError(f"concat: batch[{key!r}] is packed in some pieces only")
                batch[key] = torch.cat(pieces)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        meta, metrics = {}, []
        for d in data:
            for key, value in d.meta_info.items():
                if key == "metrics":
                    if value is not None:
                        metrics.extend(value if isinstance(value, list) else [value])
                elif key in meta and not _values_equal(meta[key], value):
                    raise ValueError(f"concat: meta_info[{key!r}] has conflicting values across pieces")
                else:
                    meta.setdefault(key, value)
        if metrics:
            gathered: dict[str, list] = {}
            for m in metrics:
                for k, v in m.items():
                    gathered.setdefault(k, []).append(v)
            meta["metrics"] = gathered
        return type(first)(batch, non_tensor, meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row repeat_times times: interleave gives a a b b, otherwise a b a b."""
        if isinstance(repeat_times, bool) or not isinstance(repeat_times, (int, np.integer)) or repeat_times < 0:
            raise ValueError(f"repeat_times: expected an int >= 0, got {repeat_times!r}")
        rows = np.arange(len(self), dtype=np.int64)
        idx = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self.select_idxs(idx)

    def sample_level_repeat(self, repeat_times) -> "DataProto":
        """Row i repeated repeat_times[i] times, in order."""
        counts = (repeat_times.detach().cpu().numpy() if isinstance(repeat_times, torch.Tensor)
                  else np.asarray(repeat_times))
        if counts.shape != (len(self),) or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError(f"repeat_times: expected {len(self)} non-negative ints, got {counts.tolist()[:8]}")
        return self.select_idxs(np.repeat(np.arange(len(self), dtype=np.int64), counts))

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append padding_size copies of the first row (padding_candidate="first") or the last, in place."""
        if padding_size == 0:
            return
        if len(self) == 0:
            raise ValueError("padding: cannot pad an empty DataProto")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = DataProto.concat([self, self.select_idxs(np.full(padding_size, row, dtype=np.int64))])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator["DataProto"]:
        """Mini-batches of mini_batch_size rows for `epochs` passes, through a torch DataLoader over row
        indices (dataloader_kwargs e.g. shuffle=True; seed fixes its generator)."""
        if len(self) % mini_batch_size:
            raise ValueError(f"mini_batch_size: {len(self)} rows do not split into mini-batches of {mini_batch_size}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(range(len(self)), batch_size=mini_batch_size, collate_fn=_index_list, generator=generator,
                            **(dataloader_kwargs or {}))

        def batches():
            for _ in range(epochs):
                for idx in loader:
                    yield self.select_idxs(np.asarray(idx, dtype=np.int64))

        return batches()

    # ---- devices, views, storage ----
    def to(self, device) -> "DataProto":
        """Move tensors and packed values to device (in place, returns self)."""
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    def to_packed(self, mask_key: str = "attention_mask", keys=None) -> "DataProto":
        """A DataProto whose [B, width, ...] fields (keys, default: all but the mask with the mask's
        [B, width]) are PackedTensors laid out by batch[mask_key]; the mask itself is dropped (the layout
        rebuilds it in to_padded). Other columns are shared."""
        mask = self.batch.get(mask_key)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise KeyError(f"mask_key: batch[{mask_key!r}] must be a [batch, tokens] tensor to pack with")
        if keys is None:
            keys = [k for k, v in self.batch.items() if k != mask_key and isinstance(v, torch.Tensor)
                    and v.dim() >= 2 and v.shape[:2] == mask.shape]
        keys = self._check_keys("keys", keys, self.batch)
        layout = PackedLayout.from_mask(mask, mask_key)
        index = layout.padded_index()  # once for all the fields
        batch = {k: v for k, v in self.batch.items() if k != mask_key}
        for key in keys:
            batch[key] = PackedTensor(layout.pack(self.batch[key], index), layout)
        return type(self)(batch, dict(self.non_tensor_batch), self.meta_info)

    def to_padded(self, keys=None, pad_value=0) -> "DataProto":
        """A DataProto whose packed fields (keys, default: all) are [B, width, ...] tensors again, with
        each layout's mask restored under its original key."""
        packed = [k for k, v in self.batch.items() if isinstance(v, PackedTensor)]
        keys = packed if keys is None else self._check_keys("keys", keys, packed)
        batch, indices = dict(self.batch), {}
        for key in keys:
            value = batch[key]
            layout = value.layout
            if id(layout) not in indices:  # once per layout, however many fields share it
                indices[id(layout)] = layout.padded_index()
            batch[key] = layout.unpack(value.values, pad_value, indices[id(layout)])
            if layout.mask_key is not None and layout.mask_key not in batch:
                batch[layout.mask_key] = layout.mask(indices[id(layout)]).to(value.device)
        return type(self)(batch, dict(self.non_tensor_batch), self.meta_info)

    def save_to_disk(self, path) -> None:
        """Write to `path` as safetensors (tensors, packed layouts, non-tensor columns as Arrow IPC, meta_info
        as JSON in the header): no pickle, loading runs no code. Written to a temporary file, then renamed."""
        save_dataproto(self, path)

    @staticmethod
    def load_from_disk(path) -> "DataProto":
        return load_dataproto(path)

    # ---- pickling for Ray: whole CPU buffers as numpy views (pickle 5 out-of-band), no per-row work ----
    def __getstate__(self):
        batch, layouts = {}, {}
        for key, value in self.batch.items():
            if isinstance(value, PackedTensor):
                layout = value.layout
                if id(layout) not in layouts:  # shared layouts travel once
                    layouts[id(layout)] = (layout.cu_seqlens.numpy(), layout.starts.numpy(), layout.width,
                                           layout.mask_key, str(layout.mask_dtype))
                batch[key] = ("packed", tensor_to_state(value.values), id(layout))
            else:
                batch[key] = ("tensor", tensor_to_state(value))
        return {"batch": batch, "layouts": layouts, "non_tensor_batch": self.non_tensor_batch,
                "meta_info": self.meta_info}

    def __setstate__(self, state):
        layouts = {lid: PackedLayout(torch.from_numpy(np.array(cu)), torch.from_numpy(np.array(starts)), width,
                                     mask_key, dtype_from_name(mask_dtype), validate=False)
                   for lid, (cu, starts, width, mask_key, mask_dtype) in state["layouts"].items()}
        batch = {}
        for key, entry in state["batch"].items():
            batch[key] = (PackedTensor(tensor_from_state(entry[1]), layouts[entry[2]]) if entry[0] == "packed"
                          else tensor_from_state(entry[1]))
        self.batch, self.non_tensor_batch, self.meta_info = batch, state["non_tensor_batch"], state["meta_info"]


def _index_list(indices):
    return indices


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad to a multiple of size_divisor by appending copies of the leading rows (cycling); returns
    (padded, pad_size)."""
    if isinstance(size_divisor, bool) or not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise ValueError(f"size_divisor: expected a positive int, got {size_divisor!r}")
    n = len(data)
    if n % size_divisor == 0:
        return data, 0
    pad_size = size_divisor - n % size_divisor
    idx = np.concatenate([np.arange(n), np.arange(pad_size) % n]).astype(np.int64)
    return data.select_idxs(idx), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last pad_size rows (undoes pad_dataproto_to_divisor)."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size: expected 0..{len(data)}, got {pad_size}")
    return data[: len(data) - pad_size] if pad_size else data



def response_lengths(data: DataProto) -> torch.Tensor:
    """[B] tokens in each response: its attended ones (verl's valid_response_length). A multi-turn response's
    tool tokens count; its response_mask, which marks only what is trained, would leave holes."""
    width = data.batch["response_mask"].shape[-1]
    return data.batch["attention_mask"][:, -width:].sum(-1)
