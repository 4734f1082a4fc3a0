"""DataProto against verl's documented semantics, on small hand-written cases."""

import numpy as np
import pytest
import torch

from pyrl.protocol import DataProto, DataProtoItem, PackedTensor, pad_dataproto_to_divisor, unpad_dataproto


def make(n=4, meta=None):
    return DataProto.from_dict(
        tensors={"obs": torch.arange(n * 2).reshape(n, 2), "act": torch.arange(n).float()},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


def test_from_dict_and_len():
    d = make()
    assert len(d) == 4
    assert d.non_tensor_batch["uid"].dtype == object
    assert d.non_tensor_batch["info"][2] == {"i": 2}
    assert len(DataProto()) == 0
    only_non_tensor = DataProto.from_dict(non_tensors={"x": [1, 2, 3]})
    assert len(only_non_tensor) == 3


def test_from_single_dict_splits_tensors_and_arrays():
    d = DataProto.from_single_dict({"a": torch.zeros(3), "b": np.array(["x", "y", "z"], dtype=object), "c": [1, 2, 3]})
    assert set(d.batch) == {"a"} and set(d.non_tensor_batch) == {"b", "c"}
    with pytest.raises(TypeError, match=r"data\['d'\]"):
        DataProto.from_single_dict({"d": 5})


def test_mismatched_lengths_name_the_keys():
    with pytest.raises(ValueError, match=r"batch\['b'\] has 3 rows but batch\['a'\] has 2"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['u'\] has 1 rows"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"u": ["x"]})
    with pytest.raises(TypeError, match=r"batch\['a'\]: expected a torch.Tensor"):
        DataProto(batch={"a": [1, 2]})
    with pytest.raises(ValueError, match="num_batch_dims"):
        DataProto.from_dict({"a": torch.zeros(2, 2)}, num_batch_dims=2)


def test_getitem_int_slice_list_mask_tensor():
    d = make()
    item = d[1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["obs"].tolist() == [2, 3] and item.non_tensor_batch["uid"] == "u1"
    assert d[-1].non_tensor_batch["uid"] == "u3"
    assert d[1:3].non_tensor_batch["uid"].tolist() == ["u1", "u2"]
    assert d[::2].batch["act"].tolist() == [0.0, 2.0]
    assert d[[3, 0, 3]].batch["act"].tolist() == [3.0, 0.0, 3.0]
    assert d[np.array([True, False, False, True])].non_tensor_batch["uid"].tolist() == ["u0", "u3"]
    assert d[torch.tensor([2])].batch["obs"].tolist() == [[4, 5]]
    with pytest.raises(IndexError, match="out of range"):
        d[4]
    with pytest.raises(IndexError, match=r"idxs: entry 1 is 9"):
        d[[0, 9]]
    with pytest.raises(IndexError, match=r"shape \(4,\)"):
        d[np.array([True, False])]
    with pytest.raises(TypeError, match="index"):
        d["obs"]


def test_slice_shares_storage_select_idxs_copies():
    d = make()
    s = d.slice(1, 3)
    s.batch["act"][0] = 100.0
    assert d.batch["act"][1] == 100.0
    assert d.select_idxs([0]).batch["act"].data_ptr() != d.batch["act"].data_ptr()


def test_select_and_deepcopy():
    d = make()
    s = d.select(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(s.batch) == ["obs"] and list(s.non_tensor_batch) == ["uid"] and s.meta_info == {}
    assert s.batch["obs"] is d.batch["obs"]
    deep = d.select(deepcopy=True)
    deep.non_tensor_batch["info"][0]["i"] = 99
    assert d.non_tensor_batch["info"][0]["i"] == 0
    with pytest.raises(KeyError, match=r"batch_keys: no key 'nope'"):
        d.select(batch_keys=["nope"])


def test_reorder_in_place():
    d = make()
    d.reorder(torch.tensor([3, 2, 1, 0]))
    assert d.batch["act"].tolist() == [3.0, 2.0, 1.0, 0.0]
    assert d.non_tensor_batch["uid"].tolist() == ["u3", "u2", "u1", "u0"]


def test_pop_and_rename():
    d = make()
    popped = d.pop(batch_keys=["act"], non_tensor_batch_keys=["info"], meta_info_keys=["temperature"])
    assert list(popped.batch) == ["act"] and "act" not in d.batch
    assert list(popped.non_tensor_batch) == ["info"] and popped.meta_info == {"temperature": 1.0}
    assert d.meta_info == {}
    d.rename("obs", "observation")
    assert list(d.batch) == ["observation"]
    with pytest.raises(KeyError, match="old_keys"):
        d.rename(["missing"], ["x"])
    with pytest.raises(ValueError, match="new_keys: 2 names for 1"):
        d.rename(["observation"], ["a", "b"])
    d2 = make()
    with pytest.raises(ValueError, match="'act' already exists"):
        d2.rename("obs", "act")


def test_union_merges_and_checks_clashes():
    a = make()
    b = DataProto.from_dict({"obs": a.batch["obs"].clone(), "rew": torch.ones(4)},
                            {"uid": list(a.non_tensor_batch["uid"])},
                            {"temperature": 1.0, "step": 3})
    a.union(b)
    assert set(a.batch) == {"obs", "act", "rew"} and a.meta_info == {"temperature": 1.0, "step": 3}
    c = DataProto.from_dict({"obs": torch.zeros(4, 2, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"batch\['obs'\] differs"):
        make().union(c)
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        make().union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        make().union(make(n=3))


def test_chunk_split_concat_roundtrip():
    d = make(6)
    chunks = d.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert chunks[1].non_tensor_batch["uid"].tolist() == ["u2", "u3"]
    back = DataProto.concat(chunks)
    assert torch.equal(back.batch["obs"], d.batch["obs"])
    assert back.non_tensor_batch["uid"].tolist() == d.non_tensor_batch["uid"].tolist()
    assert [len(p) for p in d.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="6 rows do not split into 4 equal chunks"):
        d.chunk(4)
    padded = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    assert [len(c) for c in padded.chunk(3)] == [2, 2, 1]


def test_concat_meta_info_rules():
    a, b = make(2, {"t": 1, "metrics": {"loss": 1.0}}), make(2, {"t": 1, "metrics": [{"loss": 2.0}, {"loss": 3.0}]})
    c = DataProto.concat([a, b])
    assert c.meta_info["t"] == 1
    assert c.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0]}
    with pytest.raises(ValueError, match=r"meta_info\['t'\] has conflicting values"):
        DataProto.concat([make(2, {"t": 1}), make(2, {"t": 2})])
    with pytest.raises(ValueError, match=r"batch keys of piece 1 differ from piece 0 \(key 'act'\)"):
        DataProto.concat([make(2), make(2).select(batch_keys=["obs"])])


def test_repeat_interleave_and_tile():
    d = make(2)
    inter = d.repeat(2, interleave=True)
    tile = d.repeat(3, interleave=False)
    assert inter.batch["act"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert inter.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert tile.batch["obs"].tolist() == [[0, 1], [2, 3]] * 3
    assert tile.non_tensor_batch["uid"].tolist() == ["u0", "u1"] * 3
    assert d.sample_level_repeat([2, 0]).non_tensor_batch["uid"].tolist() == ["u0", "u0"]
    assert d.sample_level_repeat(torch.tensor([1, 3])).batch["act"].tolist() == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="repeat_times: expected 2 non-negative ints"):
        d.sample_level_repeat([1])


def test_padding_and_divisor_padding():
    d = make(3)
    d.padding(2, padding_candidate="first")
    assert d.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u0", "u0"]
    e = make(3)
    e.padding(1)
    assert e.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u2"]
    padded, pad = pad_dataproto_to_divisor(make(3), 8)  # cycles through the leading rows
    assert pad == 5 and padded.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2", "u0", "u1"]
    assert unpad_dataproto(padded, pad).non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
    same, zero = pad_dataproto_to_divisor(make(4), 2)
    assert zero == 0 and len(same) == 4


def test_make_iterator_epochs_and_seeded_shuffle():
    d = make(4)
    seen = [m.batch["act"].tolist() for m in d.make_iterator(2, epochs=2)]
    assert seen == [[0.0, 1.0], [2.0, 3.0]] * 2

    def run():
        return [m.non_tensor_batch["uid"].tolist()
                for m in d.make_iterator(2, 1, seed=7, dataloader_kwargs={"shuffle": True})]

    assert run() == run()
    assert sorted(sum(run(), [])) == ["u0", "u1", "u2", "u3"]
    with pytest.raises(ValueError, match="mini_batch_size"):
        d.make_iterator(3, 1)


def test_to_device_and_iteration():
    d = make(2).to("cpu")
    assert [item.non_tensor_batch["uid"] for item in d] == ["u0", "u1"]


def test_packed_fields_follow_row_operations():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    ids = torch.arange(16).reshape(4, 4)
    d = DataProto.from_dict({"input_ids": ids, "logp": ids.float() / 10, "attention_mask": mask}, {"uid": list("abcd")})
    p = d.to_packed()
    assert "attention_mask" not in p.batch
    assert isinstance(p.batch["input_ids"], PackedTensor)
    assert p.batch["input_ids"].layout is p.batch["logp"].layout  # shared, so row ops compute it once
    assert p.batch["input_ids"].values.tolist() == [1, 2, 3, 4, 5, 12, 13, 14, 15]
    assert p.batch["input_ids"].cu_seqlens.tolist() == [0, 3, 5, 5, 9]
    assert p[1].batch["input_ids"].tolist() == [4, 5]
    sel = p[[3, 1, 1]]
    assert sel.batch["input_ids"].values.tolist() == [12, 13, 14, 15, 4, 5, 4, 5]
    assert sel.batch["input_ids"].layout is sel.batch["logp"].layout
    back = sel.to_padded()
    assert torch.equal(back.batch["input_ids"], (ids * mask)[[3, 1, 1]])
    assert torch.equal(back.batch["attention_mask"], mask[[3, 1, 1]])
    assert DataProto.concat(p.chunk(2)).batch["logp"].equal(p.batch["logp"])
    assert p.repeat(2, interleave=False).batch["input_ids"].cu_seqlens.tolist() == [0, 3, 5, 5, 9, 12, 14, 14, 18]
    assert p.slice(1, 3).batch["input_ids"].values.data_ptr() == p.batch["input_ids"].values[3:].data_ptr()
    with pytest.raises(KeyError, match=r"mask_key: batch\['nope'\]"):
        d.to_packed("nope")
