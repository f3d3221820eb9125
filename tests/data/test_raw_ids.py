"""Raw 64-bit ids (dlrmctl.data.ids): the documented FNV-1a-64 formula, stable across input types."""

import numpy as np
import pyarrow as pa
import pytest

from dlrmctl.data.ids import MISSING_RAW_ID, hash_buckets, raw_id_of, raw_ids


def _fnv1a64_reference(text: str) -> int:
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    h &= (1 << 63) - 1
    return h or 1


def test_raw_ids_match_a_per_byte_reference_for_strings_of_every_length_and_unicode():
    words = ["a", "ab", "68fd1e64", "user_17", "ü漢字", "x" * 300, "1000009418151094273"]
    got = raw_ids(pa.array(words))
    assert got.dtype == np.int64
    assert got.tolist() == [_fnv1a64_reference(w) for w in words]


def test_published_fnv1a64_vector_before_the_top_bit_is_cleared():
    # FNV-1a-64("a") = 0xaf63dc4c8601ec8c (draft-eastlake-fnv test vectors)
    assert raw_id_of("a") == 0xAF63DC4C8601EC8C & ((1 << 63) - 1)


def test_an_integer_and_its_decimal_text_are_the_same_id_in_every_arrow_type():
    ints = [0, 7, -3, 1 << 40]
    texts = [str(v) for v in ints]
    ref = raw_ids(pa.array(texts))
    for t in (pa.int64(), pa.int32() if max(ints) < 2**31 else pa.int64(), pa.uint64() if min(ints) >= 0 else pa.int64()):
        assert raw_ids(pa.array(ints, t)).tolist() == ref.tolist()
    assert raw_ids(pa.array(texts, pa.large_string())).tolist() == ref.tolist()
    assert raw_ids(pa.array(texts).dictionary_encode()).tolist() == ref.tolist()
    assert raw_ids(pa.chunked_array([texts[:2], texts[2:]])).tolist() == ref.tolist()


def test_missing_values_are_id_0_and_no_present_value_is():
    got = raw_ids(pa.array(["", None, "a", None]))
    assert got.tolist()[:2] == [MISSING_RAW_ID, MISSING_RAW_ID]
    assert got[2] > 0 and got[3] == MISSING_RAW_ID
    many = raw_ids(pa.array([f"v{i}" for i in range(50_000)]))
    assert (many >= 1).all() and len(np.unique(many)) == 50_000


def test_a_sliced_array_hashes_its_own_rows():
    arr = pa.array(["a", "bb", "ccc", "dddd"])
    assert raw_ids(arr.slice(1, 2)).tolist() == raw_ids(pa.array(["bb", "ccc"])).tolist()


def test_floats_are_refused_and_buckets_are_in_range():
    with pytest.raises(TypeError, match="strings or integers"):
        raw_ids(pa.array([1.5]))
    ids = raw_ids(pa.array([f"k{i}" for i in range(1000)]))
    b = hash_buckets(ids, 97)
    assert b.min() >= 0 and b.max() < 97
    with pytest.raises(ValueError):
        hash_buckets(ids, 0)


def test_meta_json_marks_raw_features_with_ids_raw_and_refuses_another_ids_value(tmp_path):
    from dlrmctl.data.columnar import IDS_KEY, IDS_RAW, DataError, is_raw_feature, read_meta, write_meta

    meta = {"format_version": 1, "dataset": "t", "dense_features": [], "label": "label", "splits": {},
            "sparse_features": [{"name": "C1", "num_embeddings": 5, "multi_hot": False, IDS_KEY: IDS_RAW},
                                {"name": "C2", "num_embeddings": 5, "multi_hot": False}]}
    write_meta(tmp_path, meta)
    sf = read_meta(tmp_path)["sparse_features"]
    assert [is_raw_feature(s) for s in sf] == [True, False]
    meta["sparse_features"][1][IDS_KEY] = "vocab"
    with pytest.raises(DataError, match=r"sparse_features\[1\] \(C2\): 'ids' must be 'raw' or absent"):
        write_meta(tmp_path, meta)
