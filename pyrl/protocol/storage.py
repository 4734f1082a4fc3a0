"""DataProto on disk and on the wire.

Disk: one safetensors file. Tensors are stored as `batch/<key>`; packed fields as `packed/<key>` with
their layouts as `layout/<n>/cu_seqlens` and `layout/<n>/starts`; numeric numpy columns as
`non_tensor/<key>`; object columns (strings, dicts, lists) as one Arrow IPC stream in a uint8 tensor
`non_tensor.arrow`; meta_info and the rest of the description as JSON in the header. Loading parses
JSON, Arrow and raw buffers only: nothing in the file can run code.

Object columns: strings and numbers as Arrow columns, other values (dicts, lists) as JSON text per
element; numpy arrays inside them come back as lists.

Wire (Ray): CPU tensors travel as flat uint8 numpy views, which pickle protocol 5 ships out of band
without a copy; one copy per tensor at most on arrival, never per row.
"""

from __future__ import annotations

import io
import json
import os
import tempfile

import numpy as np
import torch

from pyrl.protocol.packed import PackedLayout, PackedTensor

FORMAT = "pyrl.dataproto/1"
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported {name!r}")
    return _DTYPES[name]


def tensor_to_state(t: torch.Tensor):
    if t.device.type != "cpu":
        return ("torch", t)
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.zeros(0, dtype=torch.uint8)
    return ("raw", raw.numpy(), str(t.dtype), tuple(t.shape))


def tensor_from_state(state) -> torch.Tensor:
    if state[0] == "torch":
        return state[1]
    _, raw, dtype, shape = state
    if not raw.flags.writeable:  # zero-copy from a read-only object store: one copy, so the tensor is writable
        raw = raw.copy()
    flat = torch.from_numpy(raw)
    dtype = dtype_from_name(dtype)
    return (flat.view(dtype) if flat.numel() else torch.zeros(0, dtype=dtype)).reshape(shape)


def _json_meta(meta_info: dict) -> str:
    try:
        return json.dumps(meta_info, allow_nan=True)
    except TypeError as e:
        for key, value in meta_info.items():
            try:
                json.dumps(value)
            except TypeError:
                raise TypeError(f"meta_info[{key!r}]: {type(value).__name__} cannot be saved (JSON values only)") from e
        raise


def _json_default(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _arrow_columns(columns: dict) -> tuple[bytes, dict]:
    """Object columns as one Arrow IPC stream. Strings and numbers (with None) keep their Arrow types;
    anything else (dicts, lists, mixed types) is stored as JSON text per element, since Arrow's type
    inference would change it (dicts with different keys gain None fields). Returns (bytes, encodings)."""
    import pyarrow as pa  # lazy: pyarrow loads only when a DataProto is saved or loaded

    arrays, encodings = {}, {}
    for key, value in columns.items():
        items = value.tolist()
        kinds = {type(v) for v in items if v is not None}
        if len(kinds) <= 1 and kinds <= {str, int, float, bool}:  # one type: Arrow keeps it exactly
            arrays[key], encodings[key] = pa.array(items), "arrow"
            continue
        try:
            arrays[key] = pa.array([json.dumps(v, default=_json_default) for v in items], type=pa.string())
        except (TypeError, ValueError) as e:
            raise TypeError(f"non_tensor_batch[{key!r}]: cannot be stored ({e}); use JSON-like values") from e
        encodings[key] = "json"
    sink = io.BytesIO()
    table = pa.table(arrays) if arrays else pa.table({})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue(), encodings


def save_dataproto(data, path) -> None:
    from safetensors.torch import save_file  # lazy: safetensors loads only when a DataProto is saved or loaded

    path = os.fspath(path)
    tensors, packed, layouts, layout_ids = {}, {}, [], {}
    for key, value in data.batch.items():
        if isinstance(value, PackedTensor):
            lid = id(value.layout)
            if lid not in layout_ids:
                layout_ids[lid] = len(layouts)
                layout = value.layout
                tensors[f"layout/{len(layouts)}/cu_seqlens"] = layout.cu_seqlens
                tensors[f"layout/{len(layouts)}/starts"] = layout.starts
                layouts.append({"width": layout.width, "mask_key": layout.mask_key,
                                "mask_dtype": str(layout.mask_dtype)})
            packed[key] = layout_ids[lid]
            tensors[f"packed/{key}"] = value.values.detach().cpu().contiguous()
        else:
            tensors[f"batch/{key}"] = value.detach().cpu().contiguous()
    numeric, objects, non_tensor_dtypes = {}, {}, {}
    for key, value in data.non_tensor_batch.items():
        if value.dtype != object and value.dtype.kind in "biuf":
            tensors[f"non_tensor/{key}"] = torch.from_numpy(np.ascontiguousarray(value))
            numeric[key] = str(value.dtype)
        else:
            objects[key] = value
            non_tensor_dtypes[key] = str(value.dtype)
    arrow_bytes, encodings = _arrow_columns(objects)
    tensors["non_tensor.arrow"] = torch.frombuffer(bytearray(arrow_bytes), dtype=torch.uint8)
    header = {
        "format": FORMAT,
        "num_rows": str(len(data)),
        "batch_keys": json.dumps(list(data.batch)),
        "packed": json.dumps(packed),
        "layouts": json.dumps(layouts),
        "non_tensor_numeric": json.dumps(numeric),
        "non_tensor_objects": json.dumps({k: [non_tensor_dtypes[k], encodings[k]] for k in objects}),
        "meta_info": _json_meta(data.meta_info),
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_dataproto(path):
    # lazy: pyarrow and safetensors load only when a DataProto is saved or loaded
    import pyarrow as pa
    from safetensors import SafetensorError, safe_open

    from pyrl.protocol.dataproto import DataProto  # lazy: import cycle (pyrl.protocol.dataproto imports this module)

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no DataProto file at {path}")
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT:
                raise ValueError(f"{path}: not a pyrl DataProto file (format {header.get('format')!r}, expected "
                                 f"{FORMAT!r})")
            stored = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    layouts = [PackedLayout(stored[f"layout/{i}/cu_seqlens"], stored[f"layout/{i}/starts"], spec["width"],
                            spec["mask_key"], dtype_from_name(spec["mask_dtype"]))
               for i, spec in enumerate(json.loads(header["layouts"]))]
    packed = json.loads(header["packed"])
    batch = {}
    for key in json.loads(header["batch_keys"]):
        batch[key] = (PackedTensor(stored[f"packed/{key}"], layouts[packed[key]]) if key in packed
                      else stored[f"batch/{key}"])
    non_tensor = {key: stored[f"non_tensor/{key}"].numpy().astype(dtype, copy=False)
                  for key, dtype in json.loads(header["non_tensor_numeric"]).items()}
    table = pa.ipc.open_stream(stored["non_tensor.arrow"].numpy().tobytes()).read_all()
    for key, (dtype, encoding) in json.loads(header["non_tensor_objects"]).items():
        values = table.column(key).to_pylist()
        if encoding == "json":
            values = [json.loads(v) for v in values]
        if dtype == "object":
            column = np.empty(len(values), dtype=object)
            column[:] = values
        else:
            column = np.array(values, dtype=dtype)
        non_tensor[key] = column
    data = DataProto(batch, non_tensor, json.loads(header["meta_info"]))
    if len(data) != int(header["num_rows"]) and (batch or non_tensor):
        raise ValueError(f"{path}: holds {len(data)} rows, its header says {header['num_rows']}")
    return data
