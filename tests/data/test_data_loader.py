"""BatchLoader + columnar format: batch boundaries, rank slices, shuffle, resume, KJT layout."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from dlrmctl.data.columnar import (
    FORMAT_VERSION,
    DataError,
    MappedShard,
    ShardWriter,
    read_meta,
    shard_schema,
    write_meta,
)
from dlrmctl.data.loader import BatchLoader


def make_dataset(d, n=10, files=1, chunks=1):
    """Row i: label i%2, dense D1=i, D2=-i, C1=10*i, M1 = bag [i]*(i%3) (lengths 0,1,2,0,...)."""
    schema = shard_schema(["D1", "D2"], ["C1", "M1"], [False, True])
    bounds = np.linspace(0, n, files + 1).astype(int)
    paths = []
    for k in range(files):
        rows = np.arange(bounds[k], bounds[k + 1])
        w = ShardWriter(d / f"parts/p{k}/train.arrow", schema)
        for part in np.array_split(rows, chunks):  # several record batches per shard
            w.write({"label": (part % 2).astype(np.float32), "D1": part.astype(np.float32),
                     "D2": -part.astype(np.float32), "C1": part * 10,
                     "M1": pa.array([[int(i)] * (int(i) % 3) for i in part], pa.list_(pa.int64()))})
        w.close()
        paths.append(f"parts/p{k}/train.arrow")
    write_meta(d, {"format_version": FORMAT_VERSION, "dataset": "handmade", "dense_features": ["D1", "D2"],
                   "sparse_features": [{"name": "C1", "num_embeddings": 10 * n, "multi_hot": False},
                                       {"name": "M1", "num_embeddings": n, "multi_hot": True}],
                   "label": "label", "splits": {"train": {"rows": n, "files": paths}}})
    return d


def rows_of(b):
    return b.dense_features[:, 0].long().tolist()


def test_ten_samples_batch_four_gives_4_4_2_in_order(tmp_path):
    loader = BatchLoader(make_dataset(tmp_path), "train", 4)
    batches = list(loader)
    assert [b.batch_size for b in batches] == [4, 4, 2] and len(loader) == 3
    assert [rows_of(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[2].labels.tolist() == [0.0, 1.0]
    assert len(BatchLoader(tmp_path, "train", 4, drop_last=True)) == 2


def test_kjt_layout_is_key_major_and_matches_hand_computation(tmp_path):
    b = next(iter(BatchLoader(make_dataset(tmp_path), "train", 4)))
    kjt = b.sparse_features
    assert kjt.keys() == ["C1", "M1"] and kjt.stride() == 4
    # C1: one id per row; M1 row i has i%3 copies of i -> rows 0..3: [], [1], [2, 2], []
    assert kjt.lengths().tolist() == [1, 1, 1, 1, 0, 1, 2, 0]
    assert kjt.values().tolist() == [0, 10, 20, 30, 1, 2, 2]
    assert kjt.values().dtype.is_floating_point is False and str(kjt.values().dtype) == "torch.int64"
    assert b.dense_features.shape == (4, 2) and b.dense_features[:, 1].tolist() == [0, -1, -2, -3]
    sub = next(iter(BatchLoader(tmp_path, "train", 4, features=["M1"])))
    assert sub.sparse_features.keys() == ["M1"] and sub.sparse_features.lengths().tolist() == [0, 1, 2, 0]
    with pytest.raises(DataError, match="unknown sparse feature"):
        BatchLoader(tmp_path, "train", 4, features=["C9"])


@pytest.mark.parametrize("files,chunks", [(1, 1), (3, 2)])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_concatenated_equal_single_process_global_batches(tmp_path, files, chunks, world):
    d = make_dataset(tmp_path, n=23, files=files, chunks=chunks)
    ref = list(BatchLoader(d, "train", 8, shuffle=True, seed=5))
    per_rank = [list(BatchLoader(d, "train", 8, rank=r, world_size=world, shuffle=True, seed=5))
                for r in range(world)]
    assert all(len(p) == len(ref) for p in per_rank)
    for i, g in enumerate(ref):
        parts = [per_rank[r][i] for r in range(world)]
        assert [x for p in parts for x in rows_of(p)] == rows_of(g)
        sizes = [p.batch_size for p in parts]
        assert max(sizes) - min(sizes) <= 1
        # each rank's KJT holds exactly the ids of its rows
        for p in parts:
            rs = rows_of(p)
            assert p.sparse_features["C1"].values().tolist() == [10 * r for r in rs]
            assert p.sparse_features["M1"].values().tolist() == [r for r in rs for _ in range(r % 3)]
    loaders = [BatchLoader(d, "train", 8, rank=r, world_size=world) for r in range(world)]
    assert sum(l.num_samples_per_rank() for l in loaders) == 23
    assert [l.num_samples_per_rank() for l in loaders] == [sum(b.batch_size for b in l) for l in loaders]


def test_shuffle_is_a_permutation_deterministic_per_seed_and_epoch(tmp_path):
    d = make_dataset(tmp_path, n=50)
    a = BatchLoader(d, "train", 7, shuffle=True, seed=1)
    e0 = [x for b in a for x in rows_of(b)]
    e1 = [x for b in a for x in rows_of(b)]  # the loader moved on to epoch 1
    assert sorted(e0) == list(range(50)) and sorted(e1) == list(range(50)) and e0 != e1
    b = BatchLoader(d, "train", 7, shuffle=True, seed=1)
    assert [x for bb in b for x in rows_of(bb)] == e0
    b.set_epoch(1)
    assert [x for bb in b for x in rows_of(bb)] == e1
    c = BatchLoader(d, "train", 7, shuffle=True, seed=2)
    assert [x for bb in c for x in rows_of(bb)] != e0
    assert [x for bb in BatchLoader(d, "train", 7, num_samples=20) for x in rows_of(bb)] == list(range(20))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_dict_resumes_at_the_exact_batch(tmp_path, prefetch):
    d = make_dataset(tmp_path, n=30)
    full = BatchLoader(d, "train", 4, shuffle=True, seed=3, prefetch=prefetch)
    full.set_epoch(2)
    want = [rows_of(b) for b in full]
    first = BatchLoader(d, "train", 4, shuffle=True, seed=3, prefetch=prefetch)
    first.set_epoch(2)
    it = iter(first)
    got = [rows_of(next(it)) for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches_yielded": 3}
    it.close()
    resumed = BatchLoader(d, "train", 4, shuffle=True, seed=3, prefetch=prefetch)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    got += [rows_of(b) for b in resumed]
    assert got == want
    assert resumed.state_dict() == {"epoch": 3, "batches_yielded": 0}


def test_mapped_shard_gathers_across_record_batches(tmp_path):
    make_dataset(tmp_path, n=17, chunks=4)
    s = MappedShard(tmp_path / "parts/p0/train.arrow")
    rows = np.array([16, 0, 5, 9, 4, 12])
    loc = s.locate(rows)
    assert s.take("C1", loc).tolist() == (rows * 10).tolist()
    v, ln = s.take_list("M1", loc)
    assert ln.tolist() == (rows % 3).tolist() and v.tolist() == [r for r in rows for _ in range(r % 3)]


def test_read_meta_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="meta.json: not found"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=r"meta.json: corrupt"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(DataError, match="missing the key 'dataset'"):
        read_meta(tmp_path)
    make_dataset(tmp_path)
    with pytest.raises(DataError, match=r"unknown split 'val'.*\['train'\]"):
        BatchLoader(tmp_path, "val", 4)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_id_bounds_are_checked_on_the_cpu_batch_and_length_per_key_is_known(tmp_path, prefetch):
    from dlrmctl.sparse.validation import EmbeddingIdError

    make_dataset(tmp_path, n=10)
    # C1 ids are 0, 10, ..., 90; M1 ids are < 10
    ok = BatchLoader(tmp_path, "train", 4, prefetch=prefetch, id_bounds={"C1": ("t_C1", 100), "M1": ("t_M1", 10)})
    batches = list(ok)
    # the loader hands over ids per key as host ints: the step never reads them from the device
    assert batches[0].sparse_features._length_per_key == [4, 3]
    assert batches[0].sparse_features.to("cpu").length_per_key() == [4, 3]
    bad = BatchLoader(tmp_path, "train", 4, prefetch=prefetch, id_bounds={"C1": ("t_C1", 45)})
    with pytest.raises(EmbeddingIdError, match=r"train split, epoch 1, batch 2: table 't_C1', feature 'C1': "
                                               r"id 70 is out of range; expected 0 <= id < num_embeddings = 45"):
        list(bad)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_last_batch_smaller_than_the_world_gives_empty_batches_with_multi_hot_bags(tmp_path, shuffle):
    d = make_dataset(tmp_path, n=10, files=2, chunks=2)  # C1 one-hot, M1 multi-hot
    last = [list(BatchLoader(d, "train", 4, rank=r, world_size=3, shuffle=shuffle, prefetch=0))[-1] for r in range(3)]
    assert [b.batch_size for b in last] == [1, 1, 0]  # 10 rows = 4 + 4 + 2
    empty = last[2].sparse_features
    assert empty.keys() == ["C1", "M1"] and empty.values().numel() == 0 and empty.lengths().numel() == 0
    assert last[2].dense_features.shape == (0, 2) and last[2].labels.shape == (0,)
