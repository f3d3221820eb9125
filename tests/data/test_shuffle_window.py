"""Windowed block shuffle of BatchLoader: every row once per epoch on any world size, deterministic
per (seed, epoch), exact mid-epoch resume, bounded reads (blocks read with pread, not the mapping)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dlrmctl.data.columnar import MappedShard
from dlrmctl.data.loader import BatchLoader
from tests.data.test_data_loader import make_dataset, rows_of

# (window, block): window < block, window = a few blocks, window > the data
SHAPES = [(3, 8), (8, 3), (1000, 4), (5, 1)]


def epoch_rows(d, world, **kw):
    """Global batches of one epoch as row lists, rebuilt from `world` ranks' slices (checks slice sizes)."""
    per_rank = [list(BatchLoader(d, "train", rank=r, world_size=world, **kw)) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1
    out = []
    for parts in zip(*per_rank):
        sizes = [p.batch_size for p in parts]
        assert max(sizes) - min(sizes) <= 1
        out.append([x for p in parts for x in rows_of(p)])
    return out


@pytest.mark.parametrize("window,block", SHAPES)
@pytest.mark.parametrize("files,chunks", [(1, 1), (3, 2)])
def test_every_row_once_per_epoch_and_world_size_independent(tmp_path, window, block, files, chunks):
    d = make_dataset(tmp_path, n=37, files=files, chunks=chunks)
    kw = dict(batch_size=8, shuffle=True, seed=4, shuffle_window_rows=window, shuffle_block_rows=block)
    ref = epoch_rows(d, 1, **kw)
    assert sorted(x for b in ref for x in b) == list(range(37))
    assert [len(b) for b in ref] == [8, 8, 8, 8, 5]
    assert [x for b in ref for x in b] != list(range(37))  # shuffled
    for world in (2, 3):
        assert epoch_rows(d, world, **kw) == ref
    # every rank's KJT carries the ids of its own rows (one-hot and multi-hot)
    for b in BatchLoader(d, "train", rank=1, world_size=3, **kw):
        rs = rows_of(b)
        assert b.sparse_features["C1"].values().tolist() == [10 * r for r in rs]
        assert b.sparse_features["M1"].values().tolist() == [r for r in rs for _ in range(r % 3)]
        assert b.labels.tolist() == [float(r % 2) for r in rs]


def test_order_differs_per_epoch_and_repeats_per_seed(tmp_path):
    d = make_dataset(tmp_path, n=60, files=2, chunks=3)
    kw = dict(batch_size=7, shuffle=True, shuffle_window_rows=16, shuffle_block_rows=4)
    a = BatchLoader(d, "train", seed=1, **kw)
    e0 = [x for b in a for x in rows_of(b)]
    e1 = [x for b in a for x in rows_of(b)]
    assert sorted(e0) == sorted(e1) == list(range(60)) and e0 != e1
    b = BatchLoader(d, "train", seed=1, **kw)
    b.set_epoch(1)
    assert [x for bb in b for x in rows_of(bb)] == e1
    assert [x for bb in BatchLoader(d, "train", seed=1, **kw) for x in rows_of(bb)] == e0
    assert [x for bb in BatchLoader(d, "train", seed=2, **kw) for x in rows_of(bb)] != e0


def test_window_of_one_keeps_blocks_contiguous_inside_row_groups(tmp_path):
    # 3 shards x 2 record batches of sizes 5/5, 5/4, 4/4 rows -> blocks of <= 3 rows never cross them
    d = make_dataset(tmp_path, n=27, files=3, chunks=2)
    loader = BatchLoader(d, "train", 27, shuffle=True, seed=0, shuffle_window_rows=1, shuffle_block_rows=3)
    order = rows_of(next(iter(loader)))
    assert sorted(order) == list(range(27))
    group_starts = [0, 5, 9, 14, 18, 23]  # first row of each record batch
    starts = sorted({s + k for s, e in zip(group_starts, group_starts[1:] + [27]) for k in range(0, e - s, 3)})
    runs, i = [], 0
    while i < len(order):  # split the order at every block start
        j = i + 1
        while j < len(order) and order[j] == order[j - 1] + 1 and order[j] not in starts:
            j += 1
        runs.append(order[i:j])
        i = j
    assert sorted(r[0] for r in runs) == starts  # each block comes whole, starting at its own start
    assert all(len(r) <= 3 for r in runs)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("window,block", SHAPES)
def test_resume_mid_epoch_equals_the_uninterrupted_stream(tmp_path, prefetch, window, block):
    d = make_dataset(tmp_path, n=45, files=2, chunks=2)
    kw = dict(batch_size=4, shuffle=True, seed=9, prefetch=prefetch, shuffle_window_rows=window,
              shuffle_block_rows=block)
    full = BatchLoader(d, "train", **kw)
    full.set_epoch(1)
    want = [rows_of(b) for b in full]
    for k in (1, 5, 11):  # 11 = the last, partial batch
        first = BatchLoader(d, "train", **kw)
        first.set_epoch(1)
        it = iter(first)
        got = [rows_of(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        it.close()
        assert state == {"epoch": 1, "batches_yielded": k}
        # resume on one rank and, with the same global batches, on 3 ranks
        one = BatchLoader(d, "train", **kw)
        one.load_state_dict(state)
        assert got + [rows_of(b) for b in one] == want
        assert one.state_dict() == {"epoch": 2, "batches_yielded": 0}
        ranks = []
        for r in range(3):
            lr = BatchLoader(d, "train", rank=r, world_size=3, **kw)
            lr.load_state_dict(state)
            ranks.append(list(lr))
        assert got + [[x for p in parts for x in rows_of(p)] for parts in zip(*ranks)] == want


def test_data_smaller_than_one_batch_and_drop_last(tmp_path):
    d = make_dataset(tmp_path, n=5)
    kw = dict(shuffle=True, seed=0, shuffle_window_rows=2, shuffle_block_rows=2)
    (b,) = list(BatchLoader(d, "train", 16, **kw))
    assert sorted(rows_of(b)) == list(range(5))
    parts = [list(BatchLoader(d, "train", 16, rank=r, world_size=3, **kw)) for r in range(3)]
    assert [x for p in parts for x in rows_of(p[0])] == rows_of(b)
    assert len(BatchLoader(d, "train", 16, drop_last=True, **kw)) == 0
    assert list(BatchLoader(d, "train", 16, drop_last=True, **kw)) == []
    d2 = make_dataset(tmp_path / "b", n=30, files=2, chunks=2)
    loader = BatchLoader(d2, "train", 8, drop_last=True, **dict(kw, shuffle_window_rows=7, shuffle_block_rows=3))
    e0 = [rows_of(b) for b in loader]
    e1 = [rows_of(b) for b in loader]
    for e in (e0, e1):
        flat = [x for b in e for x in b]
        assert [len(b) for b in e] == [8, 8, 8] and len(set(flat)) == 24 and set(flat) <= set(range(30))
    assert e0 != e1


def test_num_samples_caps_the_shuffled_rows(tmp_path):
    d = make_dataset(tmp_path, n=40, files=2, chunks=2)
    loader = BatchLoader(d, "train", 6, shuffle=True, seed=2, num_samples=23, shuffle_window_rows=5,
                         shuffle_block_rows=4)
    rows = [x for b in loader for x in rows_of(b)]
    assert sorted(rows) == list(range(23))


@pytest.mark.parametrize("world", [1, 3])
def test_rows_are_read_with_pread_once_per_epoch_and_not_before_a_resume_point(tmp_path, monkeypatch, world):
    d = make_dataset(tmp_path, n=200, files=2, chunks=3)
    read = []
    orig = MappedShard.read_range

    def spy(self, name, chunk, start, n, out=None):
        if name == "D1":
            read.append(n)
        return orig(self, name, chunk, start, n, out=out)

    def no_mapping(*a, **k):
        raise AssertionError("the shuffled path must not gather from the mapping")

    monkeypatch.setattr(MappedShard, "read_range", spy)
    monkeypatch.setattr(MappedShard, "take", no_mapping)
    monkeypatch.setattr(MappedShard, "take_list", no_mapping)
    monkeypatch.setattr(MappedShard, "copy_range", no_mapping)
    kw = dict(batch_size=10, shuffle=True, seed=1, shuffle_window_rows=40, shuffle_block_rows=16, prefetch=0)
    loaders = [BatchLoader(d, "train", rank=r, world_size=world, **kw) for r in range(world)]
    for lr in loaders:
        list(lr)
    # one rank reads each row at most once; every rank reads at most the split
    assert sum(read) <= 200 * world and (world > 1 or sum(read) == 200)
    read.clear()
    resumed = BatchLoader(d, "train", **kw)
    resumed.load_state_dict({"epoch": 0, "batches_yielded": 16})  # position 160 = window 4 of 5
    assert sum(len(b.labels) for b in resumed) == 40
    assert sum(read) <= 40  # the windows before the resume point are not read


def test_weighted_multi_hot_and_id_policy_go_through_the_shuffled_path(tmp_path):
    from dlrmctl.sparse.validation import EmbeddingIdError

    d = make_dataset(tmp_path, n=30, files=2, chunks=2)
    kw = dict(shuffle=True, seed=3, shuffle_window_rows=9, shuffle_block_rows=4, features=["C1"])
    # on-the-fly multi-hot expansion: 3 ids per row
    b = next(iter(BatchLoader(d, "train", 8, multi_hot_sizes={"C1": 3}, **kw)))
    assert b.sparse_features.lengths().tolist() == [3] * 8
    # C1 = 10 * row: rows >= 10 are outside a 100-row table
    with pytest.raises(EmbeddingIdError, match="train split, epoch 1, batch 1"):
        list(BatchLoader(d, "train", 30, id_bounds={"C1": ("t", 100)}, **kw))
    zeroed = next(iter(BatchLoader(d, "train", 30, id_bounds={"C1": ("t", 100)}, on_invalid_id="zero", **kw)))
    rs = rows_of(zeroed)
    assert zeroed.sparse_features.values().tolist() == [10 * r for r in rs if r < 10]


def test_bad_window_and_block_are_rejected(tmp_path):
    d = make_dataset(tmp_path, n=5)
    with pytest.raises(ValueError, match="shuffle_window_rows must be >= 1, got 0"):
        BatchLoader(d, "train", 2, shuffle=True, shuffle_window_rows=0)
    with pytest.raises(ValueError, match="shuffle_block_rows must be >= 1, got -1"):
        BatchLoader(d, "train", 2, shuffle=True, shuffle_block_rows=-1)


def test_a_mid_epoch_position_saved_under_another_batch_order_is_refused_and_an_epoch_end_is_not(tmp_path):
    # the position is a count of global batches: under another batch size / shuffle setting / row cap
    # batch k is other rows, so a resume silently repeated or skipped rows of the epoch
    d = make_dataset(tmp_path, n=37, files=2, chunks=2)
    kw = dict(batch_size=8, shuffle=True, seed=4, shuffle_window_rows=16, shuffle_block_rows=4, prefetch=0)
    saver = BatchLoader(d, "train", **kw)
    it = iter(saver)
    seen = [x for _ in range(2) for x in rows_of(next(it))]
    state = dict(saver.state_dict(), order=saver.order())
    assert state["batches_yielded"] == 2
    # same order on another world size: exact continuation
    parts = []
    for r in range(3):
        lr = BatchLoader(d, "train", rank=r, world_size=3, **kw)
        lr.load_state_dict(state)
        parts.append([rows_of(b) for b in lr])
    rest = [x for batch in zip(*parts) for p in batch for x in p]
    assert sorted(seen + rest) == list(range(37))
    for change, key in ((dict(batch_size=4), "batch_size"), (dict(seed=5), "seed"),
                        (dict(shuffle_window_rows=8), "shuffle_window_rows"), (dict(shuffle_block_rows=2), "shuffle_block_rows"),
                        (dict(num_samples=30), "rows"), (dict(drop_last=True), "drop_last"), (dict(shuffle=False), "shuffle")):
        other = BatchLoader(d, "train", **{**kw, **change})
        with pytest.raises(ValueError, match=rf"train split: cannot resume inside epoch 1 \(after 2 batches\) with "
                                             rf"another batch order \(.*{key}: .* now, .* when saved"):
            other.load_state_dict(state)
    # a position without the order (older checkpoints) is taken as it is
    other = BatchLoader(d, "train", **{**kw, "batch_size": 4})
    other.load_state_dict({"epoch": 0, "batches_yielded": 2})
    assert sum(len(b.labels) for b in other) == 37 - 8
    # the end of a saved epoch (5 batches of 8) is an epoch boundary under any order: the next epoch is whole
    end = {"epoch": 0, "batches_yielded": 5, "order": saver.order()}
    for change in (dict(batch_size=4), dict(batch_size=16, seed=9)):
        other = BatchLoader(d, "train", **{**kw, **change})
        other.load_state_dict(end)
        assert list(other) == [] and other.state_dict() == {"epoch": 1, "batches_yielded": 0}
        assert sorted(x for b in other for x in rows_of(b)) == list(range(37))


def _mapped_rss_bytes(path) -> int:
    """RSS of this process's mappings of ``path`` (Linux /proc/self/smaps)."""
    total, cur = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and ":" not in parts[0]:
                cur = parts[5] if len(parts) > 5 else None
            elif line.startswith("Rss:") and cur == str(path):
                total += int(parts[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_opening_a_shard_leaves_none_of_its_pages_mapped(tmp_path):
    """Locating the record batches reads every batch's metadata; through the kept mapping the
    page faults (and fault-around) left ~3.4 bytes per row resident — RSS grew with the rows of
    the dataset (+61 MB at 20M Criteo rows).  The offsets now come from a mapping that is closed."""
    import pyarrow as pa

    from dlrmctl.data.columnar import MappedShard, ShardWriter

    schema = pa.schema([(f"c{i}", pa.float32()) for i in range(8)])
    path = tmp_path / "s.arrow"
    w = ShardWriter(path, schema)
    for b in range(300):  # 300 record batches, ~9.6 MB
        w.write({f"c{i}": np.full(1000, b, np.float32) for i in range(8)})
    w.close()
    shard = MappedShard(path)
    assert shard.rows == 300_000
    assert _mapped_rss_bytes(path) < 256 * 1024, _mapped_rss_bytes(path)
    # the kept mapping still serves reads (and maps only what they touch)
    assert shard.read_range("c3", 299, 0, 2).tolist() == [299.0, 299.0]


def test_an_abandoned_shuffled_epoch_stops_its_batch_and_window_threads(tmp_path):
    """With prefetch the batches are made in one thread and the next window is read in another; an
    iteration left mid-epoch (a break, an error in the step) ends both, and the next epoch's
    batches are those of a loader that never stopped (the window buffers reused are rewritten)."""
    import threading

    d = make_dataset(tmp_path, n=300, files=2, chunks=3)
    kw = dict(batch_size=10, shuffle=True, seed=2, shuffle_window_rows=40, shuffle_block_rows=16)
    loader = BatchLoader(d, "train", prefetch=2, **kw)
    it = iter(loader)
    for _ in range(7):  # into the second window: the third is being read ahead
        next(it)
    it.close()
    names = lambda: {t.name for t in threading.enumerate() if t.is_alive()}  # noqa: E731
    assert not {"BatchLoader-prefetch", "BatchLoader-window"} & names(), names()
    loader.set_epoch(1)
    ref = BatchLoader(d, "train", prefetch=0, **kw)
    ref.set_epoch(1)
    assert [rows_of(b) for b in loader] == [rows_of(b) for b in ref]
