"""TorchRec user code runs on dlrmctl's types unchanged (issue 11).

Written the way TorchRec's documentation writes it: positional calls in
TorchRec's argument order and keyword calls with TorchRec's names, plus the
places where dlrmctl is stricter (inconsistent input raises instead of being
silently accepted).
"""

import inspect
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse.jagged_tensor import (
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    SparseInputError,
    VariableBatchNotSupportedError,
)
from dlrmctl.metrics import auc, compute_metrics

KERNELS = ["fused", "dense"] if HAS_FBGEMM else ["dense"]


# ------------------------------------------------------------------ imports
def test_torchrec_import_paths_map_to_dlrmctl():
    import dlrmctl
    import dlrmctl.modules as modules
    from dlrmctl import EmbeddingBagCollection as EBC
    from dlrmctl import EmbeddingBagConfig as Cfg
    from dlrmctl import KeyedJaggedTensor as KJT

    assert KJT is KeyedJaggedTensor and EBC is EmbeddingBagCollection and Cfg is EmbeddingBagConfig
    assert dlrmctl.JaggedTensor is JaggedTensor and dlrmctl.KeyedTensor is KeyedTensor
    assert dlrmctl.PoolingType is PoolingType and dlrmctl.DataType is DataType
    assert modules.EmbeddingBagCollection is EmbeddingBagCollection
    with pytest.raises(AttributeError):
        dlrmctl.ShardingPlanner  # noqa: B018 - not a TorchRec name dlrmctl exports


# -------------------------------------------------- KeyedJaggedTensor
def test_issue_silent_misuse_positional_torchrec_order():
    # TorchRec order: keys, values, weights, lengths
    kjt = KeyedJaggedTensor(["k"], torch.tensor([10, 11, 12, 13]), torch.tensor([1.0, 1.0, 1.0, 1.0]),
                            torch.tensor([1, 3]))
    assert kjt.stride() == 2
    assert kjt.lengths().tolist() == [1, 3]
    assert kjt.weights().tolist() == [1.0, 1.0, 1.0, 1.0]
    assert kjt.values().tolist() == [10, 11, 12, 13]
    jt = kjt["k"]
    assert [b.tolist() for b in jt.to_dense()] == [[10], [11, 12, 13]]
    assert [b.tolist() for b in jt.to_dense_weights()] == [[1.0], [1.0, 1.0, 1.0]]


def test_old_dlrmctl_order_is_an_error_not_a_silent_misread():
    values, lengths = torch.tensor([10, 11, 12, 13]), torch.tensor([1, 3])
    # (keys, values, lengths) positionally: lengths lands in `weights` -> no lengths given
    with pytest.raises(SparseInputError, match="no lengths or offsets"):
        KeyedJaggedTensor(["k"], values, lengths)
    # float weights given where TorchRec expects lengths
    with pytest.raises(SparseInputError, match="lengths must be an integer tensor.*argument order"):
        KeyedJaggedTensor(["k"], values, None, torch.tensor([1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(SparseInputError, match="weights must be floating point"):
        KeyedJaggedTensor(["k"], values, torch.tensor([1, 3]), torch.tensor([1, 3]))


def test_kjt_torchrec_docstring_example_with_all_caches():
    #              0       1        2  <-- dim_1
    # "Feature0"   [V0,V1] None    [V2]
    # "Feature1"   [V3]    [V4]    [V5,V6,V7]
    values = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    weights = torch.arange(8, dtype=torch.float32) / 10
    lengths = torch.tensor([2, 0, 1, 1, 1, 3])
    offsets = torch.tensor([0, 2, 2, 3, 4, 5, 8])
    kjt = KeyedJaggedTensor(
        keys=["Feature0", "Feature1"], values=values, weights=weights, lengths=lengths, offsets=offsets,
        stride=3, stride_per_key=[3, 3], length_per_key=[3, 5], lengths_offset_per_key=[0, 3, 6],
        offset_per_key=[0, 3, 8], index_per_key={"Feature0": 0, "Feature1": 1},
    )
    assert kjt.stride() == 3 and kjt.stride_per_key() == [3, 3] and not kjt.variable_stride_per_key()
    assert kjt.length_per_key() == [3, 5] and kjt.offset_per_key() == [0, 3, 8]
    assert kjt.lengths_offset_per_key() == [0, 3, 6] and kjt.index_per_key() == {"Feature0": 0, "Feature1": 1}
    assert kjt.offsets().tolist() == offsets.tolist()
    # the same KJT from offsets alone, positionally
    kjt2 = KeyedJaggedTensor(["Feature0", "Feature1"], values, weights, None, offsets)
    assert kjt2.lengths().tolist() == lengths.tolist() and kjt2.stride() == 3
    assert kjt2["Feature1"].weights().tolist() == pytest.approx([0.3, 0.4, 0.5, 0.6, 0.7])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(length_per_key=[4, 4]), r"length_per_key \[4, 4\] disagrees with the lengths \(per-key sums \[3, 5\]\)"),
        (dict(length_per_key=[3, 4]), r"must be >= 0 and sum to len\(values\)=8"),
        (dict(length_per_key=[8]), r"1 length_per_key entries for 2 keys"),
        (dict(offset_per_key=[0, 4, 8]), r"disagrees with the lengths"),
        (dict(offset_per_key=[0, 3, 7]), r"offset_per_key \[0, 3, 7\] must be 3 non-decreasing ints"),
        (dict(length_per_key=[3, 5], offset_per_key=[0, 4, 8]), r"disagrees with length_per_key"),
        (dict(index_per_key={"Feature1": 0, "Feature0": 1}), r"index_per_key"),
        (dict(lengths_offset_per_key=[0, 2, 6]), r"lengths_offset_per_key \[0, 2, 6\] != \[0, 3, 6\]"),
        (dict(stride_per_key=[3]), r"1 stride_per_key entries for 2 keys"),
        (dict(stride=2), r"stride 2 \* 2 keys != 6 lengths"),
        (dict(offsets=torch.tensor([0, 2, 2, 3, 4, 5, 7, 8])), r"len\(offsets\)=8 != len\(lengths\)\+1=7"),
        (dict(offsets=torch.tensor([0, 2, 3, 3, 4, 5, 8])), r"offsets and lengths disagree"),
        (dict(jt_dict={"Feature0": None}), r"jt_dict keys"),
    ],
)
def test_kjt_caches_are_checked_against_lengths(kwargs, match):
    base = dict(keys=["Feature0", "Feature1"], values=torch.arange(8), lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    with pytest.raises(SparseInputError, match=match):
        KeyedJaggedTensor(**{**base, **kwargs})


def test_offsets_alone_are_checked():
    with pytest.raises(SparseInputError, match="offsets must start at 0"):
        KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(SparseInputError, match=r"offsets decrease at position 1 \(2 -> 1\)"):
        KeyedJaggedTensor(["a"], torch.arange(1), offsets=torch.tensor([0, 2, 1]))
    with pytest.raises(SparseInputError, match=r"offsets\[-1\]=2 != len\(values\)=3"):
        KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 1, 2]))


def test_variable_batch_per_key_kjt_in_torchrec_style():
    # full batch of 4 samples; key "a" deduplicated to 2 rows, key "b" to 3 rows
    values = torch.tensor([10, 11, 12, 20, 21, 22, 23])
    lengths = torch.tensor([1, 2, 2, 1, 1])  # a: [1, 2] | b: [2, 1, 1]
    inv = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 2]])
    kjt = KeyedJaggedTensor(["a", "b"], values, None, lengths, stride_per_key_per_rank=[[2], [3]],
                            inverse_indices=(["a", "b"], inv))
    assert kjt.variable_stride_per_key() and kjt.stride() == 3 and kjt.stride_per_key() == [2, 3]
    assert kjt.stride_per_key_per_rank() == [[2], [3]] and kjt.length_per_key() == [3, 4]
    assert kjt.lengths_offset_per_key() == [0, 2, 5]
    assert kjt["b"].lengths().tolist() == [2, 1, 1] and kjt["b"].values().tolist() == [20, 21, 22, 23]
    assert {k: jt.lengths().tolist() for k, jt in kjt.to_dict().items()} == {"a": [1, 2], "b": [2, 1, 1]}
    keys, ii = kjt.inverse_indices()
    assert keys == ["a", "b"] and torch.equal(ii, inv)
    # permute / select keep the per-key strides and the inverse indices, key by key
    p = kjt.permute([1, 0])
    assert p.stride_per_key() == [3, 2] and p.lengths().tolist() == [2, 1, 1, 1, 2]
    assert p.inverse_indices()[0] == ["b", "a"] and torch.equal(p.inverse_indices()[1], inv[[1, 0]])
    assert kjt.to("cpu").stride_per_key_per_rank() == [[2], [3]]
    # padded to one stride: bag i of each key keeps its place, the rest are empty
    u = kjt.to_uniform_stride()
    assert not u.variable_stride_per_key() and u.stride() == 3 and u.lengths().tolist() == [1, 2, 0, 2, 1, 1]
    # TorchRec's constructors and from_jt_dict with different batch sizes
    assert KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, lengths,
                                               stride_per_key_per_rank=[[2], [3]]).stride_per_key() == [2, 3]
    j = KeyedJaggedTensor.from_jt_dict({"a": kjt["a"], "b": kjt["b"]})
    assert j.stride_per_key_per_rank() == [[2], [3]] and j.lengths().tolist() == lengths.tolist()
    # inconsistent input is refused, naming what is wrong
    with pytest.raises(SparseInputError, match="per-key batch sizes"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths[:4], stride_per_key_per_rank=[[2], [3]])
    with pytest.raises(SparseInputError, match=r"inverse_indices of key 'a' must be in \[0, 2\)"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[2], [3]],
                          inverse_indices=(["a", "b"], torch.tensor([[0, 2, 0, 1], [0, 1, 2, 2]])))
    with pytest.raises(SparseInputError, match="need stride_per_key_per_rank"):
        KeyedJaggedTensor(["a", "b"], values, lengths=torch.tensor([1, 2, 1, 1, 1, 1]), inverse_indices=(["a", "b"], inv))
    with pytest.raises(VariableBatchNotSupportedError):
        KeyedJaggedTensor.concat([kjt, kjt.select_keys(["a"])])
    plain = KeyedJaggedTensor(["a", "b"], values[:3], lengths=torch.tensor([1, 0, 1, 1]))
    assert plain.stride_per_key_per_rank() == [] and plain.inverse_indices_or_none() is None


def test_kjt_from_keys_and_values_alone():
    # TorchRec accepts it; stride defaults to 0 (no keys -> 0, no lengths/offsets -> 0)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.empty(0, dtype=torch.int64))
    assert kjt.stride() == 0 and kjt.lengths().numel() == 0 and kjt.length_per_key() == [0, 0]
    assert {k: jt.lengths().numel() for k, jt in kjt.to_dict().items()} == {"a": 0, "b": 0}
    # with a stride: every bag empty
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.empty(0, dtype=torch.int64), stride=3)
    assert kjt.stride() == 3 and kjt.lengths().tolist() == [0] * 6
    # values without any lengths are inconsistent (TorchRec fails later, in lengths())
    with pytest.raises(SparseInputError, match="2 values but no lengths or offsets"):
        KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2]))


def test_kjt_2d_values_lengths_count_rows():
    vals = torch.arange(10.0).view(5, 2)  # [N, D] dense sequence values
    kjt = KeyedJaggedTensor(["seq", "other"], vals, lengths=torch.tensor([2, 1, 0, 2]))
    assert kjt.length_per_key() == [3, 2]
    assert kjt["other"].values().tolist() == [[6.0, 7.0], [8.0, 9.0]]
    with pytest.raises(SparseInputError, match=r"sum\(lengths\)=4 != len\(values\)=5"):
        KeyedJaggedTensor(["seq"], vals, lengths=torch.tensor([2, 2]))


def test_kjt_to_dict_compute_offsets_and_cache():
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2, 3, 4, 5, 6]),
                                              torch.tensor([1, 0, 2, 1, 2, 0]))
    lazy = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths()).to_dict(compute_offsets=False)
    assert lazy["f1"].offsets_or_none() is None and lazy["f1"].offsets().tolist() == [0, 1, 3, 3]
    d = kjt.to_dict()  # compute_offsets=True (TorchRec's default)
    assert d["f0"].offsets_or_none().tolist() == [0, 1, 1, 3] and d["f1"].offsets().tolist() == [0, 1, 3, 3]
    assert kjt.to_dict() is d  # cached, as in TorchRec


def test_kjt_concat_empty_and_empty_like():
    a = KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([0.5, 1.5]), torch.tensor([2, 0]))
    b = KeyedJaggedTensor(["b", "c"], torch.tensor([3]), torch.tensor([2.5]), torch.tensor([0, 1, 0, 0]))
    c = KeyedJaggedTensor.concat([a, b])
    assert c.keys() == ["a", "b", "c"] and c.stride() == 2
    assert c.lengths().tolist() == [2, 0, 0, 1, 0, 0] and c.weights().tolist() == [0.5, 1.5, 2.5]
    assert c.length_per_key() == [2, 1, 0]
    with pytest.raises(VariableBatchNotSupportedError, match=r"strides \[2, 1\] differ"):
        KeyedJaggedTensor.concat([a, KeyedJaggedTensor(["d"], torch.tensor([3]), torch.ones(1), torch.tensor([1]))])
    with pytest.raises(SparseInputError, match="weighted KJT with unweighted"):
        KeyedJaggedTensor.concat([a, KeyedJaggedTensor(["d"], torch.tensor([3]), lengths=torch.tensor([1, 0]))])
    with pytest.raises(SparseInputError, match=r"keys \['a'\] appear in more than one KJT"):
        KeyedJaggedTensor.concat([a, a])
    with pytest.raises(ValueError):
        KeyedJaggedTensor.concat([])

    e = KeyedJaggedTensor.empty(is_weighted=True, values_dtype=torch.int64, weights_dtype=torch.float16,
                                lengths_dtype=torch.int64)
    assert e.keys() == [] and e.stride() == 0 and e.values().dtype == torch.int64
    assert e.weights().dtype == torch.float16 and e.lengths().dtype == torch.int64
    assert KeyedJaggedTensor.empty().lengths().dtype == torch.int32  # TorchRec's default
    assert KeyedJaggedTensor.empty().weights_or_none() is None

    el = KeyedJaggedTensor.empty_like(a)
    assert el.keys() == [] and el.stride() == 2 and el.values().dtype == torch.int64
    assert el.weights().dtype == torch.float32 and el.values().numel() == 0
    same_shape = KeyedJaggedTensor.empty_like(a, device="cpu").copy_(a)
    assert same_shape.keys() == ["a"] and same_shape.values().tolist() == [1, 2]
    assert same_shape.lengths().tolist() == [2, 0]


def test_kjt_validate_false_reads_no_tensor_contents(monkeypatch):
    @contextmanager
    def no_host_reads():
        def boom(*a, **k):
            raise AssertionError("tensor contents read on the host (a device sync on CUDA)")
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, boom)
            yield

    values, weights, lengths = torch.arange(6), torch.rand(6), torch.tensor([1, 0, 2, 1, 2, 0])
    with no_host_reads():
        kjt = KeyedJaggedTensor(["f0", "f1"], values, weights, lengths, stride=3, length_per_key=[3, 3],
                                validate=False)
        kjt.permute([1, 0]).to("cpu").split([1, 1])
        KeyedJaggedTensor(["f0"], values, lengths=torch.tensor([9, 9]), validate=False)  # contents unchecked
    with pytest.raises(AssertionError, match="contents read"), no_host_reads():
        KeyedJaggedTensor(["f0", "f1"], values, weights, lengths)  # validate=True reads them
    assert inspect.signature(KeyedJaggedTensor).parameters["validate"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(JaggedTensor).parameters["validate"].kind is inspect.Parameter.KEYWORD_ONLY


def test_kjt_signature_is_torchrecs():
    names = list(inspect.signature(KeyedJaggedTensor).parameters)
    assert names[:14] == ["keys", "values", "weights", "lengths", "offsets", "stride", "stride_per_key_per_rank",
                          "stride_per_key", "length_per_key", "lengths_offset_per_key", "offset_per_key",
                          "index_per_key", "jt_dict", "inverse_indices"]
    assert list(inspect.signature(JaggedTensor).parameters)[:4] == ["values", "weights", "lengths", "offsets"]
    assert list(inspect.signature(KeyedTensor).parameters) == ["keys", "length_per_key", "values", "key_dim",
                                                               "offset_per_key", "index_per_key"]


# -------------------------------------------------------------- JaggedTensor
def test_jagged_tensor_positional_torchrec_order():
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([2, 1]))
    assert jt.lengths().tolist() == [2, 1] and jt.weights().tolist() == pytest.approx([0.1, 0.2, 0.3])
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), None, None, torch.tensor([0, 2, 3]))
    assert jt.lengths().tolist() == [2, 1]
    with pytest.raises(SparseInputError, match="needs lengths or offsets"):
        JaggedTensor(torch.tensor([1.0, 2.0]), torch.tensor([2]))
    with pytest.raises(SparseInputError, match=r"offsets and lengths disagree"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3]))
    with pytest.raises(SparseInputError, match=r"lengths must be >= 0"):
        JaggedTensor(torch.arange(1), lengths=torch.tensor([2, -1]))


def test_jagged_tensor_dense_conversions_torchrec_examples():
    values = torch.Tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    weights = torch.Tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    offsets = torch.IntTensor([0, 2, 2, 3, 4, 5, 8])
    jt = JaggedTensor(values=values, weights=weights, offsets=offsets)
    assert jt.to_padded_dense(desired_length=2, padding_value=10.0).tolist() == [
        [1.0, 2.0], [10.0, 10.0], [3.0, 10.0], [4.0, 10.0], [5.0, 10.0], [6.0, 7.0]]
    assert jt.to_padded_dense().shape == (6, 3)  # longest bag
    pw = jt.to_padded_dense_weights(desired_length=2)
    assert torch.allclose(pw, torch.tensor([[0.1, 0.2], [0, 0], [0.3, 0], [0.4, 0], [0.5, 0], [0.6, 0.7]]))
    dw = jt.to_dense_weights()
    assert [len(w) for w in dw] == [2, 0, 1, 1, 1, 3] and torch.equal(torch.cat(dw), weights)
    unweighted = JaggedTensor(values=values, offsets=offsets)
    assert unweighted.to_dense_weights() is None and unweighted.to_padded_dense_weights() is None

    j1 = JaggedTensor.from_dense(
        values=[torch.Tensor([1.0]), torch.Tensor(), torch.Tensor([7.0, 8.0]), torch.Tensor([10.0, 11.0, 12.0])],
        weights=[torch.Tensor([1.0]), torch.Tensor(), torch.Tensor([7.0, 8.0]), torch.Tensor([10.0, 11.0, 12.0])],
    )
    assert j1.lengths().tolist() == [1, 0, 2, 3] and j1.lengths().dtype == torch.int32
    assert [b.tolist() for b in j1.to_dense()] == [[1.0], [], [7.0, 8.0], [10.0, 11.0, 12.0]]

    j2 = JaggedTensor.from_dense_lengths(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), torch.tensor([2, 0, 3]),
                                         weights=torch.ones(3, 3))
    assert j2.values().tolist() == [1, 2, 7, 8, 9] and j2.weights().tolist() == [1.0] * 5
    with pytest.raises(SparseInputError, match=r"length 4 outside \[0, N=3\]"):
        JaggedTensor.from_dense_lengths(torch.zeros(2, 3), torch.tensor([1, 4]))


def test_jagged_tensor_2d_values_empty_and_size():
    vals = torch.arange(12.0).view(6, 2)  # [N, D]
    jt = JaggedTensor(vals, lengths=torch.tensor([1, 0, 5]))
    padded = jt.to_padded_dense(desired_length=3, padding_value=-1.0)
    assert padded.shape == (3, 3, 2)
    assert padded[0].tolist() == [[0.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]]
    assert padded[2].tolist() == [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]  # truncated to 3 rows
    fresh = JaggedTensor(vals, lengths=torch.tensor([1, 0, 5]))
    assert fresh.size_in_bytes() == 12 * 4 + 3 * 8  # values + lengths
    fresh.offsets()
    assert fresh.size_in_bytes() == 12 * 4 + 3 * 8 + 4 * 8  # + offsets once materialised

    e = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int64)
    assert e.values().numel() == 0 and e.weights().numel() == 0 and e.lengths().dtype == torch.int32
    el = JaggedTensor.empty_like(jt)
    assert el.values().shape == (0, 2) and el.values().dtype == torch.float32 and el.lengths().numel() == 0
    assert el.to_padded_dense().shape == (0, 0, 2)


# -------------------------------------------------------------- KeyedTensor
def test_keyed_tensor_torchrec_example_and_regroup():
    tensor_list = [torch.tensor([[1, 1]] * 3), torch.tensor([[2, 1, 2]] * 3), torch.tensor([[3, 1, 2, 3]] * 3)]
    keys = ["Embedding A", "Embedding B", "Embedding C"]
    kt = KeyedTensor.from_tensor_list(keys, tensor_list)
    assert kt.values().tolist() == [[1, 1, 2, 1, 2, 3, 1, 2, 3]] * 3
    assert kt["Embedding B"].tolist() == [[2, 1, 2]] * 3
    assert kt.length_per_key() == [2, 3, 4] and kt.offset_per_key() == [0, 2, 5, 9]

    kt2 = KeyedTensor(["d"], [1], torch.full((3, 1), 7))  # positional: keys, length_per_key, values
    g = KeyedTensor.regroup([kt, kt2], [["Embedding C", "d"], ["Embedding A"], ["Embedding A", "Embedding B"]])
    assert [t.tolist() for t in g] == [[[3, 1, 2, 3, 7]] * 3, [[1, 1]] * 3, [[1, 1, 2, 1, 2]] * 3]
    assert KeyedTensor.regroup([kt, kt2], [keys, ["d"]])[0] is kt.values()  # no-regroup shortcut
    d = KeyedTensor.regroup_as_dict([kt, kt2], [["d"], ["Embedding A"]], ["x", "y"])
    assert list(d) == ["x", "y"] and d["x"].tolist() == [[7]] * 3
    with pytest.raises(SparseInputError, match="2 groups but 1 keys"):
        KeyedTensor.regroup_as_dict([kt], [["Embedding A"], ["Embedding B"]], ["x"])
    with pytest.raises(KeyError, match="no KeyedTensor has key 'zz'"):
        KeyedTensor.regroup([kt], [["zz"]])
    with pytest.raises(SparseInputError, match="key 'd' is in more than one KeyedTensor"):
        KeyedTensor.regroup([kt2, kt2], [["d"]])

    # key_dim / cat_dim
    kt0 = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(2, 4), torch.zeros(3, 4)], key_dim=0, cat_dim=0)
    assert kt0.key_dim() == 0 and kt0["b"].shape == (3, 4)
    with pytest.raises(SparseInputError, match=r"offset_per_key \[0, 1, 5\] != cumsum"):
        KeyedTensor(["a", "b"], [2, 3], torch.zeros(2, 5), 1, [0, 1, 5])


# -------------------------------------------------------- embedding configs
def test_embedding_bag_config_torchrec_field_order():
    c = EmbeddingBagConfig(100, 8, "t0", DataType.FP32, ["f0", "f1"])  # positional, TorchRec order
    assert (c.num_embeddings, c.embedding_dim, c.name, c.feature_names) == (100, 8, "t0", ["f0", "f1"])
    assert c.pooling is PoolingType.SUM and c.data_type is DataType.FP32
    c = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", pooling=PoolingType.MEAN)
    assert c.feature_names == ["t1"] and c.get_weight_init_max() == pytest.approx(math.sqrt(0.1))
    assert PoolingType("SUM") is PoolingType.SUM and PoolingType("mean") is PoolingType.MEAN
    assert PoolingType.NONE and DataType("fp16") is DataType.FP16
    names = [f for f in inspect.signature(EmbeddingBagConfig).parameters]
    assert names[:11] == ["num_embeddings", "embedding_dim", "name", "data_type", "feature_names",
                          "weight_init_max", "weight_init_min", "num_embeddings_post_pruning", "init_fn",
                          "need_pos", "pooling"]
    with pytest.raises(ValueError, match="num_embeddings must be an int > 0"):
        EmbeddingBagConfig("t", 10, 4)  # dlrmctl's old order: name first


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(pooling=PoolingType.NONE), "pooling NONE"),
        (dict(data_type=DataType.INT8), "data_type INT8 is not trainable"),
        (dict(num_embeddings_post_pruning=5), "pruning"),
        (dict(pruning_indices_remapping=torch.arange(10)), "pruning"),
        (dict(name=""), "needs a name"),
    ],
)
def test_ebc_refuses_configs_it_cannot_honour(cfg, match):
    with pytest.raises(ValueError, match=match):
        EmbeddingBagCollection([EmbeddingBagConfig(**{**dict(num_embeddings=10, embedding_dim=4, name="t"), **cfg})])


# ------------------------------------------------------ EmbeddingBagCollection
def _tables(**kw):
    return [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t0", feature_names=["a", "b"], **kw),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["c"],
                           pooling=PoolingType.MEAN),
    ]


def _kjt():
    lengths = torch.tensor([1, 2, 0, 1, 3, 1])
    values = torch.tensor([1, 19, 3, 5, 0, 2, 6, 4])
    # TorchRec's positional order (keys, values, weights, lengths); no weights: these EBCs are
    # unweighted, and an unweighted EBC given weights raises
    return KeyedJaggedTensor(["a", "b", "c"], values, None, lengths)


@pytest.mark.parametrize("kernel", KERNELS)
def test_ebc_positional_signature_embedding_bags_and_state_dict(kernel):
    ebc = EmbeddingBagCollection(_tables(), False, torch.device("cpu"), compute_kernel=kernel)
    assert not ebc.is_weighted() and ebc.device == torch.device("cpu")
    with pytest.raises(TypeError):
        EmbeddingBagCollection(_tables(), False, None, kernel)  # dlrmctl options are keyword-only
    assert list(ebc.embedding_bags) == ["t0", "t1"]
    for name, w in ebc.embedding_weights().items():
        assert ebc.embedding_bags[name].weight.shape == w.shape
        assert torch.equal(ebc.embedding_bags[name].weight, w)
    assert list(ebc.state_dict()) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]

    kt = ebc(_kjt())
    assert kt.keys() == ["a", "b", "c"] and kt.values().shape == (2, 8 + 8 + 4)
    # writes through embedding_bags[...].weight reach the lookup, whatever the kernel
    with torch.no_grad():
        ebc.embedding_bags["t1"].weight.fill_(2.0)
    assert torch.allclose(ebc(_kjt())["c"], torch.tensor([[2.0] * 4, [2.0] * 4]))


@pytest.mark.parametrize("src_kernel,dst_kernel", [(a, b) for a in KERNELS for b in KERNELS])
def test_ebc_state_dict_round_trips_across_kernels(src_kernel, dst_kernel):
    src = EmbeddingBagCollection(_tables(), compute_kernel=src_kernel, seed=1)
    dst = EmbeddingBagCollection(_tables(), compute_kernel=dst_kernel, seed=2)
    kjt = _kjt()
    assert not torch.allclose(src(kjt).values(), dst(kjt).values())
    assert str(dst.load_state_dict(src.state_dict())) == "<All keys matched successfully>"
    torch.testing.assert_close(src(kjt).values(), dst(kjt).values())
    sd = src.state_dict()
    sd["embedding_bags.t0.weight"] = torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.t0.weight"):
        dst.load_state_dict(sd)
    res = dst.load_state_dict({"embedding_bags.t1.weight": torch.zeros(7, 4)}, strict=False)
    assert res.missing_keys == ["embedding_bags.t0.weight"] and res.unexpected_keys == []


@pytest.mark.parametrize("kernel", KERNELS)
def test_ebc_init_fn_and_weight_init_bounds(kernel):
    def fill_rows(w):  # in place, as TorchRec's init_fn contract
        with torch.no_grad():
            w.copy_(torch.arange(w.shape[0], dtype=w.dtype).unsqueeze(1).expand_as(w))

    tables = [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t0", init_fn=fill_rows),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", weight_init_min=0.5, weight_init_max=0.75),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t2", init_fn=lambda w: torch.full_like(w, 3.0)),
    ]
    ebc = EmbeddingBagCollection(tables, compute_kernel=kernel)
    w = {name: m.weight.detach() for name, m in ebc.embedding_bags.items()}
    assert torch.equal(w["t0"][:, 0], torch.arange(20.0)) and torch.equal(w["t0"][:, 7], torch.arange(20.0))
    assert 0.5 <= float(w["t1"].min()) and float(w["t1"].max()) <= 0.75
    assert torch.equal(w["t2"], torch.full((5, 4), 3.0))  # a returned tensor is copied in
    with torch.no_grad():
        ebc.embedding_bags["t0"].weight.zero_()
    ebc.reset_parameters()
    assert torch.equal(ebc.embedding_bags["t0"].weight.detach()[:, 3], torch.arange(20.0))


def test_dlrm_state_dict_has_torchrec_keys_and_checkpoint_helpers_still_split_it():
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.train.checkpoint import dense_state_dict

    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name=f"t{i}", feature_names=[f"f{i}"])
              for i in range(3)]
    model = DLRM(EmbeddingBagCollection(tables, compute_kernel=KERNELS[0]), 13, [8, 4], [8, 1], 3, 4)
    sparse_keys = [k for k in model.state_dict() if k.startswith("sparse_arch.")]
    assert sparse_keys == [f"sparse_arch.embedding_bags.t{i}.weight" for i in range(3)]
    assert not any(k.startswith("sparse_arch.") for k in dense_state_dict(model))


# ----------------------------------------------------------------- metrics
def test_weighted_auc_equals_auc_of_rows_repeated_by_integer_weights():
    rng = np.random.default_rng(11)
    for _ in range(30):
        n = int(rng.integers(2, 80))
        p = rng.integers(0, 6, n) / 5.0  # many ties
        y = rng.integers(0, 2, n)
        w = rng.integers(0, 4, n)  # zero weights drop rows
        rep_p, rep_y = np.repeat(p, w), np.repeat(y, w)
        if rep_y.size == 0 or rep_y.min() == rep_y.max():
            assert math.isnan(auc(p, y, w))
            continue
        assert auc(p, y, w) == pytest.approx(auc(rep_p, rep_y), abs=1e-12)
        pr = np.clip(p, 0.05, 0.95)
        got, want = compute_metrics(pr, y, w), compute_metrics(np.repeat(pr, w), rep_y)
        for k in ("auc", "logloss", "ne", "calibration", "accuracy", "ctr"):
            assert got[k] == pytest.approx(want[k], abs=1e-12, nan_ok=True), k
    assert auc([0.1, 0.5, 0.5, 0.9], [0, 1, 0, 1], [1, 1, 1, 1]) == pytest.approx(0.875)
    with pytest.raises(ValueError, match="weights"):
        auc([0.1, 0.2], [0, 1], [1.0, -1.0])
    with pytest.raises(ValueError, match="2 samples"):
        auc([0.1, 0.2], [0, 1], [1.0])


def test_sharding_env_takes_torchrec_argument_order():
    from dlrmctl.distributed.env import ShardingEnv

    env = ShardingEnv(4, 1, None)  # TorchRec: ShardingEnv(world_size, rank, pg)
    assert (env.world_size, env.rank, env.process_group, env.pg) == (4, 1, None, None)
    assert env.local_world_size == 4 and env.device == torch.device("cpu") and not env.is_distributed
    kw = ShardingEnv(world_size=2, rank=0, pg=None, local_world_size=1, device="cpu")
    assert kw.num_hosts == 2 and kw.host == 0
    assert ShardingEnv.from_local(8, 3).rank == 3
    with pytest.raises(ValueError, match="rank 4 out of range for world_size 4"):
        ShardingEnv(4, 4)


def test_a_directly_built_ebc_leaves_the_update_to_the_users_optimizer_like_torchrec():
    tables = [EmbeddingBagConfig(10, 4, "t1", feature_names=["f1"])]
    ebc = EmbeddingBagCollection(tables)
    kjt = KeyedJaggedTensor(["f1"], torch.tensor([1, 2, 2]), None, torch.tensor([2, 1]))
    before = ebc.embedding_bags["t1"].weight.detach().clone()
    ebc(kjt).values().sum().backward()
    w = ebc.embedding_bags["t1"].weight
    assert torch.equal(w.detach(), before)  # backward does not train
    assert w.grad is not None and w.grad.is_sparse
    assert torch.equal(w.grad.to_dense()[2], 2 * torch.ones(4)) and torch.equal(w.grad.to_dense()[0], torch.zeros(4))
    torch.optim.SGD(ebc.parameters(), lr=0.5).step()
    assert torch.equal(w.detach()[2], before[2] - 1.0) and torch.equal(w.detach()[0], before[0])
    with pytest.raises(TypeError, match="is_weighted must be a bool.*pass device= by keyword"):
        EmbeddingBagCollection(tables, torch.device("cpu"))
