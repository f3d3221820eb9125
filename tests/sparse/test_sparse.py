"""KeyedJaggedTensor / KeyedTensor: layout and validation errors."""

import pytest
import torch

from dlrmctl.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, SparseInputError


def t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype)


def test_key_major_layout_to_dict_and_stride():
    # keys f0, f1; batch 3: f0 bags [1], [], [2,3]; f1 bags [4], [5,6], []
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], t([1, 2, 3, 4, 5, 6]), t([1, 0, 2, 1, 2, 0]))
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 3] and kjt.offset_per_key() == [0, 3, 6]
    d = kjt.to_dict()
    assert d["f0"].values().tolist() == [1, 2, 3] and d["f0"].lengths().tolist() == [1, 0, 2]
    assert d["f1"].values().tolist() == [4, 5, 6] and d["f1"].lengths().tolist() == [1, 2, 0]
    assert kjt.offsets().tolist() == [0, 1, 1, 3, 4, 6, 6]


def test_permute_and_split_reorder_keys_with_their_values_and_weights():
    kjt = KeyedJaggedTensor(["a", "b", "c"], t([1, 2, 3, 4]), lengths=t([1, 0, 1, 1, 0, 1]),
                            weights=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    p = kjt.permute([2, 0])
    assert p.keys() == ["c", "a"]
    assert p.values().tolist() == [4, 1] and p.lengths().tolist() == [0, 1, 1, 0]
    assert p.weights().tolist() == pytest.approx([0.4, 0.1])
    s0, s1 = kjt.split([1, 2])
    assert s0.keys() == ["a"] and s1.keys() == ["b", "c"] and s1.values().tolist() == [2, 3, 4]


def test_from_offsets_equals_from_lengths():
    a = KeyedJaggedTensor.from_offsets_sync(["x"], t([7, 8, 9]), t([0, 2, 2, 3]))
    assert a.lengths().tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(keys=["a", "b"], values=t([1, 2, 3]), lengths=t([1, 1, 1])), r"number of lengths \(3\) is not a multiple of the number of keys \(2"),
        (dict(keys=["a"], values=t([1]), lengths=t([2, -1])), r"negative length -1 for key 'a', sample 1"),
        (dict(keys=["a"], values=t([1, 2]), lengths=t([1, 2])), r"sum\(lengths\)=3 != len\(values\)=2"),
        (dict(keys=["a"], values=t([1, 2]), lengths=t([1, 1]), weights=torch.ones(3)), r"len\(weights\)=3 != len\(values\)=2"),
    ],
)
def test_kjt_validation_errors_say_what_was_expected(kwargs, match):
    with pytest.raises(SparseInputError, match=match):
        KeyedJaggedTensor(**kwargs)


def test_jagged_tensor_validation():
    with pytest.raises(SparseInputError, match="sum"):
        JaggedTensor(t([1, 2]), lengths=t([3]))
    assert [b.tolist() for b in JaggedTensor(t([1, 2, 3]), lengths=t([2, 0, 1])).to_dense()] == [[1, 2], [], [3]]


def test_keyed_tensor_blocks():
    kt = KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).view(2, 5))
    assert kt["b"].tolist() == [[2, 3, 4], [7, 8, 9]]
    with pytest.raises(SparseInputError, match="sum\\(length_per_key\\)=4"):
        KeyedTensor(["a", "b"], [2, 2], torch.zeros(2, 5))
