"""save_to_disk / load_from_disk (safetensors + Arrow + JSON, no pickle) and pickling for Ray."""

import json
import os
import pickle

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pyrl.protocol import DataProto


def rich_proto():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [1, 1, 1]])
    d = DataProto.from_dict(
        tensors={"input_ids": torch.randint(0, 100, (3, 3)), "logp": torch.randn(3, 3, dtype=torch.bfloat16),
                 "attention_mask": mask, "score": torch.randn(3, dtype=torch.float64),
                 "done": torch.tensor([True, False, True])},
        non_tensors={"uid": ["a", "b", "c"], "extra": [{"k": 1}, {"k": 2, "s": "x"}, {"k": 3}],
                     "tokens": [[1, 2], [3], []], "maybe": ["x", None, "z"], "mixed": [1, "a", 2.5],
                     "nums": [1, 2.5, None]},
        meta_info={"temperature": 0.7, "eos": [1, 2], "name": "run"},
    ).to_packed(keys=["input_ids", "logp"])
    d.non_tensor_batch["step"] = np.array([1, 2, 3], dtype=np.int32)
    return d


def assert_same(a: DataProto, b: DataProto):
    assert a.batch.keys() == b.batch.keys()
    for key in a.batch:
        x, y = a.batch[key], b.batch[key]
        assert (x.equal(y) if hasattr(x, "layout") else torch.equal(x, y) and x.dtype == y.dtype), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].dtype == b.non_tensor_batch[key].dtype, key
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert a.meta_info == b.meta_info


def test_roundtrip_keeps_everything(tmp_path):
    d = rich_proto()
    path = tmp_path / "batch.safetensors"
    d.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert_same(d, back)
    assert back.batch["input_ids"].layout is back.batch["logp"].layout  # the layout is stored once
    assert back.to_padded().batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []


def test_file_is_plain_safetensors_with_json_header(tmp_path):
    path = tmp_path / "b.safetensors"
    rich_proto().save_to_disk(path)
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
        assert json.loads(header["meta_info"])["temperature"] == 0.7
        assert "batch/score" in f.keys() and "packed/logp" in f.keys() and "non_tensor.arrow" in f.keys()


def test_load_rejects_other_files_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no DataProto file"):
        DataProto.load_from_disk(tmp_path / "missing")
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        DataProto.load_from_disk(junk)
    from safetensors.torch import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a pyrl DataProto file"):
        DataProto.load_from_disk(other)


def test_unsaveable_values_are_named_and_nothing_is_written(tmp_path):
    d = DataProto.from_dict({"x": torch.zeros(2)}, meta_info={"fn": object()})
    with pytest.raises(TypeError, match=r"meta_info\['fn'\]: object cannot be saved"):
        d.save_to_disk(tmp_path / "x.safetensors")
    mixed = DataProto.from_dict({"x": torch.zeros(2)}, {"bad": [1, object()]})
    with pytest.raises(TypeError, match=r"non_tensor_batch\['bad'\]: cannot be stored"):
        mixed.save_to_disk(tmp_path / "y.safetensors")
    assert os.listdir(tmp_path) == []


def test_overwrite_is_atomic(tmp_path):
    path = tmp_path / "b.safetensors"
    rich_proto().save_to_disk(path)
    d2 = DataProto.from_dict({"only": torch.ones(5)})
    d2.save_to_disk(path)
    assert_same(DataProto.load_from_disk(path), d2)


def test_pickle_roundtrip_ships_whole_buffers():
    d = rich_proto()
    back = pickle.loads(pickle.dumps(d, protocol=5))
    assert_same(d, back)
    back.batch["score"][0] = 123.0  # received tensors are writable
    # out-of-band buffers: one per tensor (not per row), as Ray's object store receives them
    buffers = []
    data = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    # the batch's tensors, the shared layout's cu_seqlens and starts (once), the int32 numpy column
    assert len(buffers) == len(d.batch) + 2 + 1
    assert len(data) < 4096
    assert_same(d, pickle.loads(data, buffers=buffers))
