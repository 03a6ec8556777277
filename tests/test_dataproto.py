import pickle

import numpy as np
import pytest
import torch

from common.dataproto import DataProto


def make(n=5):
    return DataProto.from_dict(
        {"x": torch.arange(n), "y": torch.arange(2 * n).view(n, 2).float()},
        {"name": [f"s{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
    )


def test_from_dict_and_length():
    data = make()
    assert len(data) == 5
    assert data["name"].dtype == object
    assert data["info"][3] == {"i": 3}
    assert sorted(data.keys()) == ["info", "name", "x", "y"]


def test_mismatched_lengths_is_a_clear_error():
    with pytest.raises(ValueError, match="same batch size"):
        DataProto.from_dict({"x": torch.zeros(3)}, {"name": ["a", "b"]})
    with pytest.raises(ValueError, match="lengths 5 and 3"):
        make(5).union(make(3).select("x"))


def test_union_merges_and_refuses_conflicts():
    data = make().select("x", "name")
    merged = data | make().select("y", "x")
    assert sorted(merged.keys()) == ["name", "x", "y"]
    other = DataProto.from_dict({"x": torch.arange(5) + 1})
    with pytest.raises(ValueError, match="'x' is in both"):
        data.union(other)
    with pytest.raises(ValueError, match="'name' is in both"):
        data.union(DataProto.from_dict(non_tensors={"name": list("abcde")}))
    merged_in_place = data
    merged_in_place |= DataProto.from_dict({"z": torch.ones(5)})
    assert "z" in merged_in_place.keys()


def test_concat_split_chunk():
    data = make(5)
    parts = data.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    whole = DataProto.concat(parts)
    assert torch.equal(whole["y"], data["y"])
    assert list(whole["name"]) == list(data["name"])
    with pytest.raises(ValueError, match="pad_to_multiple"):
        data.chunk(2)
    assert [len(p) for p in make(6).chunk(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="same fields"):
        DataProto.concat([make(2), make(2).select("x")])


def test_repeat_interleaved_and_tiled():
    data = make(3)
    assert data.repeat(2, interleave=True)["x"].tolist() == [0, 0, 1, 1, 2, 2]
    assert data.repeat(2, interleave=False)["x"].tolist() == [0, 1, 2, 0, 1, 2]
    assert list(data.repeat(2)["name"]) == ["s0", "s0", "s1", "s1", "s2", "s2"]


def test_select_and_fields_by_name():
    data = make()
    assert sorted(data.select("y", "info").keys()) == ["info", "y"]
    with pytest.raises(KeyError, match="no field"):
        data.select("nope")
    with pytest.raises(KeyError, match="no field 'nope'"):
        data["nope"]
    data["score"] = torch.ones(5)
    data["label"] = ["a"] * 5
    assert "score" in data.tensors and data["label"].dtype == object and "label" in data
    with pytest.raises(ValueError, match="field 'short' has 2 rows, the DataProto 5"):
        data["short"] = torch.ones(2)


def test_index_by_list_mask_slice_and_int():
    data = make(5)
    assert data[[4, 0]]["x"].tolist() == [4, 0]
    assert list(data[[4, 0]]["name"]) == ["s4", "s0"]
    mask = torch.tensor([True, False, True, False, False])
    assert data[mask]["x"].tolist() == [0, 2]
    assert data[np.array([False, True, False, False, True])]["x"].tolist() == [1, 4]
    assert data[1:3]["x"].tolist() == [1, 2]
    assert data[2]["x"].tolist() == [2]
    assert data[-1]["x"].tolist() == [4]
    with pytest.raises(ValueError, match="boolean mask of length 2"):
        data[np.array([True, False])]


def test_pad_and_unpad():
    data = make(5)
    padded, pad = data.pad_to_multiple(4)
    assert (len(padded), pad) == (8, 3)
    assert padded["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert torch.equal(padded.unpad(pad)["x"], data["x"])
    same, none = data.pad_to_multiple(5)
    assert none == 0 and same is data


def test_to_device_and_pickle():
    data = make()
    moved = data.to("cpu")
    assert moved["x"].device.type == "cpu"
    restored = pickle.loads(pickle.dumps(data))
    assert torch.equal(restored["y"], data["y"])
    assert list(restored["info"]) == list(data["info"])
