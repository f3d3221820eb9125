"""Raw rows of a split before they become a batch, in the loader's stacked layout.

:class:`RawRows` holds ``n`` rows of the columns one rank reads: the one-hot id columns stacked
key-major as ``ids [F, n] int64`` (a batch's KeyedJaggedTensor values are then one gather of
that matrix) and the dense columns as ``dense [D, n] float32``, next to the other scalar
columns (label, per-id weights of one-hot features) and the ``list`` columns (multi-hot bags)
as ``(values, offsets)``.  Rows are read into it with ``pread`` straight into those stacks
(:meth:`RawRows.read_piece`, the GIL released), so a batch costs a handful of numpy calls
whatever the number of features: one ``take`` of each stack, not one gather per column.

:class:`BlockTable` locates the shuffle blocks of a split; :class:`Prefetcher` runs a generator
in a thread, a few items ahead (the loader's batches, and its shuffle windows read ahead of them).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from dlrmctl.data.columnar import (WEIGHT_SUFFIX, DataError, MappedShard, SplitData, jagged_gather, check_rows,
                                   weight_column)
from dlrmctl.data.multi_hot import multi_hot_expand

__all__ = ["RawRows", "RowColumns", "BlockTable", "BufferPool", "Prefetcher", "feature_bags", "offsets_of",
           "window_pieces"]


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """Bag lengths ``[n]`` -> offsets ``[n + 1] int64`` starting at 0."""
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off


class RowColumns:
    """Which columns a loader reads, by layout.

    Args:
        ids: one-hot id columns (int64), stacked in this order as ``RawRows.ids``.
        dense: dense columns (float32), stacked in this order as ``RawRows.dense``.
        label: the label column (float32) or None.
        scalar_weights: float32 per-id weight columns of one-hot features.
        lists: ``list<int64>`` / ``list<float32>`` columns (multi-hot bags and their weights).
        split: the split's name (for the value checks' messages).
    """

    def __init__(self, ids: Sequence[str], dense: Sequence[str], label: str | None, scalar_weights: Sequence[str],
                 lists: Sequence[str], split: str) -> None:
        self.ids, self.dense, self.label = list(ids), list(dense), label
        self.scalar = ([label] if label is not None else []) + list(scalar_weights)
        self.lists, self.split = list(lists), split

    def empty(self, n: int, row_major: bool) -> "RawRows":
        """Uninitialised rows ``[n]`` for the scalar and stacked columns (no list columns yet).

        ``row_major``: the stacks hold each row's values together (C order ``[n, K]``: a gather of
        random rows reads a few cache lines a row, what a shuffle window is made for); otherwise
        each column together (F order: an in-order batch, whose id stack transposed is the KJT's
        key-major values without a copy)."""
        def stack(k: int, dtype: type) -> np.ndarray:
            return np.empty((n, k), dtype) if row_major else np.empty((k, n), dtype).T

        return RawRows(n, stack(len(self.ids), np.int64), stack(len(self.dense), np.float32),
                       {c: np.empty(n, np.float32) for c in self.scalar}, {})

    def none(self) -> "RawRows":
        """Zero rows."""
        rows = self.empty(0, True)
        rows.lists = {c: (np.zeros(0, np.float32 if c.endswith(WEIGHT_SUFFIX) else np.int64), np.zeros(1, np.int64))
                      for c in self.lists}
        return rows


class RawRows:
    """``n`` raw rows: ``ids [n, F] int64`` and ``dense [n, D] float32`` (columns in
    :class:`RowColumns` order; C or F order, see :meth:`RowColumns.empty`), ``scalar``: column ->
    ``[n] float32``, ``lists``: column -> (values ``[offsets[-1]]``, offsets ``[n + 1] int64`` from 0)."""

    __slots__ = ("n", "ids", "dense", "scalar", "lists", "owner")

    def __init__(self, n: int, ids: np.ndarray, dense: np.ndarray, scalar: dict, lists: dict) -> None:
        self.n, self.ids, self.dense, self.scalar, self.lists = n, ids, dense, scalar, lists
        self.owner: RawRows | None = None  # the pooled buffer these rows are the head of (BufferPool)

    # ------------------------------------------------------------------ reading
    def read_piece(self, cols: RowColumns, at: int, shard: MappedShard, chunk: int, start: int, n: int,
                   first_row: int, mapped: bool = False) -> dict:
        """Read rows ``[start, start + n)`` of record batch ``chunk`` of ``shard`` into rows
        ``[at, at + n)`` of the stacks and scalar columns, check them (:func:`check_rows`:
        labels in {0, 1}, finite dense values; ``first_row``: the shard row of ``start``, for the
        message), and return the piece's list columns ``{column: (values, lengths)}``.

        ``mapped``: copy the scalar columns from the shard's mapping (an in-order pass: its pages
        are read once) instead of ``pread`` (the shuffled reads: no mapped page stays resident).

        Raises:
            DataError: a bad label or dense value, weight bags whose lengths differ from the ids'.
        """
        if mapped:
            read = shard.copy_range
        else:
            def read(c: str, chunk: int, start: int, n: int, out: np.ndarray) -> None:
                shard.read_range(c, chunk, start, n, out=out)

        def fill(stack: np.ndarray, names: list[str]) -> np.ndarray:
            """Read ``names`` into rows ``[at, at + n)`` of ``stack`` (returned, ``[n, K]``)."""
            dst = stack[at:at + n]
            if dst.T.flags.c_contiguous:  # column after column: read in place
                for j, c in enumerate(names):
                    read(c, chunk, start, n, dst[:, j])
                return dst
            tmp = np.empty(n, dst.dtype)  # row-major: each column read whole, then written across the rows
            for j, c in enumerate(names):  # (a strided write per column: 2.5x faster than one transposed copy)
                read(c, chunk, start, n, tmp)
                dst[:, j] = tmp
            return dst

        fill(self.ids, cols.ids)
        dense = fill(self.dense, cols.dense)
        for c in cols.scalar:
            read(c, chunk, start, n, self.scalar[c][at:at + n])
        label = self.scalar[cols.label][at:at + n] if cols.label is not None else None
        if (label is not None and not ((label == 0) | (label == 1)).all()) or not np.isfinite(dense).all():
            check_rows(shard.path, cols.split, first_row,  # raises, naming the first bad value
                       {**({cols.label: label} if label is not None else {}),
                        **{c: dense[:, j] for j, c in enumerate(cols.dense)}}, cols.label, cols.dense)
        lists = {c: shard.read_range(c, chunk, start, n) for c in cols.lists}
        check_weight_bags(lists, shard.path)
        return lists

    def set_lists(self, pieces: list[dict], cols: RowColumns) -> "RawRows":
        """Join the list columns of the pieces read (in row order) into :attr:`lists`."""
        if not pieces:  # no rows (a rank's empty slice of a last batch smaller than the world)
            self.lists = cols.none().lists
            return self
        for c in cols.lists:
            if len(pieces) == 1:
                v, ln = pieces[0][c]
            else:
                v = np.concatenate([p[c][0] for p in pieces])
                ln = np.concatenate([p[c][1] for p in pieces])
            self.lists[c] = (v, offsets_of(ln))
        return self

    @staticmethod
    def read_range(cols: RowColumns, data: SplitData, lo: int, hi: int) -> "RawRows":
        """Split rows ``[lo, hi)`` (global row ids), copied from the shards' mappings piece by piece
        (one piece per record batch) into column-major stacks."""
        rows = cols.empty(hi - lo, False)
        pieces = []
        pos = lo
        while pos < hi:
            s = int(np.searchsorted(data.starts, pos, side="right")) - 1
            shard = data.shards[s]
            local = pos - int(data.starts[s])
            chunk = int(np.searchsorted(shard._starts, local, side="right")) - 1
            c0 = int(shard._starts[chunk])
            n = min(hi - pos, int(shard._starts[chunk + 1]) - local)
            pieces.append(rows.read_piece(cols, pos - lo, shard, chunk, local - c0, n, local, mapped=True))
            pos += n
        return rows.set_lists(pieces, cols)

    # ------------------------------------------------------------------ rows
    def take(self, idx: np.ndarray) -> "RawRows":
        """Rows ``idx [m]`` (any order) -> new ``RawRows`` of ``m`` rows (copies, C order)."""
        lists = {}
        for c, (v, off) in self.lists.items():
            ln = off[1:][idx] - off[:-1][idx]
            lists[c] = (jagged_gather(v, off[:-1][idx], ln), offsets_of(ln))
        return RawRows(len(idx), np.take(self.ids, idx, axis=0), np.take(self.dense, idx, axis=0),
                       {c: np.take(a, idx) for c, a in self.scalar.items()}, lists)

    @staticmethod
    def concat(parts: list["RawRows"]) -> "RawRows":
        """Rows of ``parts`` one after the other (copies, C order; one part: itself)."""
        if len(parts) == 1:
            return parts[0]
        lists = {}
        for c in parts[0].lists:
            lens = [np.diff(p.lists[c][1]) for p in parts]
            lists[c] = (np.concatenate([p.lists[c][0] for p in parts]), offsets_of(np.concatenate(lens)))
        return RawRows(sum(p.n for p in parts), np.concatenate([p.ids for p in parts]),
                       np.concatenate([p.dense for p in parts]),
                       {c: np.concatenate([p.scalar[c] for p in parts]) for c in parts[0].scalar}, lists)


def feature_bags(loader: Any, rows: RawRows, ids: np.ndarray) -> tuple[list, list, list]:
    """Per feature of ``loader.features`` (values, lengths, weights) of ``rows`` (``ids``: their
    one-hot ids ``[F, B]``): multi-hot bags, expanded one-hot ids (per the settings of the
    :class:`~dlrmctl.data.loader.BatchLoader` ``loader``: ``expand``, ``weighted``, ``multi_hot``)."""
    B = rows.n
    values, lengths, weights = [], [], []
    for f in loader.features:
        w = None
        if not loader.multi_hot[f]:
            fid = ids[loader._id_row[f]]
            if f in loader.weighted:
                w = rows.scalar[weight_column(f)]
            if f in loader.expand:
                n_rows, size, seed = loader.expand[f]
                v, ln = multi_hot_expand(fid, n_rows, size, loader.multi_hot_distribution, seed)
                if w is not None:
                    w = np.repeat(w, ln)
            else:
                v, ln = fid, np.ones(B, dtype=np.int64)
        else:
            v, off = rows.lists[f]
            ln = np.diff(off)
            if f in loader.weighted:
                w = rows.lists[weight_column(f)][0]
        values.append(v)
        lengths.append(ln)
        if w is not None:
            weights.append(np.asarray(w, dtype=np.float32))
        elif loader.weighted:
            weights.append(np.ones(len(v), dtype=np.float32))
    return values, lengths, weights


def check_weight_bags(lists: dict, path: Path) -> None:
    """The weight bags of each multi-hot feature read (``F__weight``) have its id bags' lengths.

    Args:
        lists: column -> (values, lengths ``[n]``) of one piece.

    Raises:
        DataError: naming the feature and its weight column."""
    for wc, (_, wl) in lists.items():
        f = wc[:-len(WEIGHT_SUFFIX)] if wc.endswith(WEIGHT_SUFFIX) else None
        if f in lists and not np.array_equal(wl, lists[f][1]):
            raise DataError(f"the weight bags of multi-hot feature '{f}' ({wc}) have other "
                            "lengths than its id bags", path=path)


def window_pieces(stream: np.ndarray, p0: int, p1: int, starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Which rows of which blocks one rank reads for its positions in shuffle window ``[p0, p1)``.

    Args:
        stream: ``[n] int64``, the stream position (minus ``p0``) of each of the rank's positions,
            in position order (all distinct).
        starts: ``[num_blocks] int64``, the stream position where each block of the epoch's block
            order starts (increasing).

    Returns:
        ``(t, first, lo, n, at, src)``: ``t [m] int64`` the block-order index of each stream position
        read, in stream order; ``first [g]`` the index into ``t`` of each block's first row; for each
        of those ``g`` blocks ``lo`` the first row read inside it, ``n`` the rows read (a contiguous
        range), ``at`` where they start in the raw rows (blocks one after the other); ``src [n]``
        the raw row of each position.  Linear in the window (a mask, no sort).
    """
    need = np.zeros(p1 - p0, dtype=bool)
    need[stream] = True
    ss = np.flatnonzero(need) + p0  # the stream positions read, in stream order
    b0 = int(np.searchsorted(starts, p0, side="right")) - 1  # the blocks the window overlaps
    b1 = int(np.searchsorted(starts, p1, side="left"))
    t = np.searchsorted(starts[b0:b1], ss, side="right") - 1 + b0
    off = ss - starts[t]  # row inside the block (increasing inside each block)
    first = np.flatnonzero(np.concatenate(([True], t[1:] != t[:-1])))
    last = np.append(first[1:], len(ss)) - 1
    lo = off[first]
    n = off[last] + 1 - lo
    at = np.cumsum(n) - n
    raw_of = np.empty(p1 - p0, np.int64)  # stream position - p0 -> raw row
    raw_of[ss - p0] = np.repeat(at - lo, last + 1 - first) + off
    return t, first, lo, n, at, raw_of[stream]


class BlockTable:
    """The shuffle blocks of a split: each record batch of each shard cut into runs of at most
    ``block_rows`` rows, over the first ``num_rows`` rows.  Holds one entry per record batch
    (not per block or row); block ``b`` is located by a search over those."""

    def __init__(self, data: SplitData, num_rows: int, block_rows: int) -> None:
        shard, chunk, rows = [], [], []
        left = num_rows
        for s, sh in enumerate(data.shards):
            for c, n in enumerate(sh.chunk_rows.tolist()):
                n = min(n, left)
                if n > 0:
                    shard.append(s)
                    chunk.append(c)
                    rows.append(n)
                left -= n
        self.block_rows = block_rows
        self.shard = np.array(shard, dtype=np.int64)
        self.chunk = np.array(chunk, dtype=np.int64)
        self.rows = np.array(rows, dtype=np.int64)
        nblocks = -(-self.rows // block_rows)
        self.first = np.zeros(len(rows) + 1, dtype=np.int64)  # first block of each record batch
        np.cumsum(nblocks, out=self.first[1:])
        self.num_blocks = int(self.first[-1])

    def _rb(self, blocks: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.first, blocks, side="right") - 1

    def lengths(self, blocks: np.ndarray) -> np.ndarray:
        """Rows of each block in ``blocks [n]`` -> ``[n] int64``."""
        rb = self._rb(blocks)
        start = (blocks - self.first[rb]) * self.block_rows
        return np.minimum(self.block_rows, self.rows[rb] - start)

    def locate(self, block: int) -> tuple[int, int, int]:
        """Block -> (shard index, record batch index, first row inside the record batch)."""
        rb = int(self._rb(np.array([block]))[0])
        return int(self.shard[rb]), int(self.chunk[rb]), (block - int(self.first[rb])) * self.block_rows


class Prefetcher:
    """Runs a generator in a daemon thread, at most ``depth`` items ahead of the consumer (the
    one being made included); re-raises its errors in the consumer.

    :meth:`close` stops the thread and closes the generator in it (so a generator that runs a
    prefetcher of its own closes that one too)."""

    _END = object()

    def __init__(self, gen: Iterator, depth: int, name: str = "BatchLoader-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"Prefetcher depth must be >= 1, got {depth}")
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(depth)  # items that may be made before the consumer takes one
        self._stop = threading.Event()
        self._gen = gen
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def _wait_room(self) -> bool:
        while not self._stop.is_set():
            if self._room.acquire(timeout=0.1):
                return True
        return False

    def _run(self) -> None:
        try:
            while self._wait_room():
                try:
                    item = next(self._gen)
                except StopIteration:
                    self._q.put(self._END)
                    return
                self._q.put(item)
        except BaseException as e:  # handed to the consumer
            self._q.put(e)
        finally:
            close = getattr(self._gen, "close", None)
            if close is not None:
                close()

    def __iter__(self):
        return self

    def __next__(self):
        item = self._q.get()
        if item is self._END:
            self._q.put(item)  # every later call ends too
            raise StopIteration
        if isinstance(item, BaseException):
            self._q.put(item)
            raise item
        self._room.release()
        return item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)


class BufferPool:
    """Recycled :class:`RawRows` buffers for the shuffle windows: a window's buffer, once every row
    of it is in a batch, holds the next window read (a fresh array of tens of MB every window
    would fault in and zero each of its pages again).  Never blocks: it allocates when no spare
    buffer is large enough, and keeps at most ``keep`` spares."""

    def __init__(self, cols: RowColumns, capacity: int, keep: int = 2) -> None:
        self._cols, self._capacity, self._keep = cols, capacity, keep
        self._spare: queue.SimpleQueue = queue.SimpleQueue()

    def get(self, n: int) -> RawRows:
        """Rows ``[n]`` (uninitialised, no list columns) in a spare buffer or a new one."""
        while True:
            try:
                buf = self._spare.get_nowait()
            except queue.Empty:
                buf = self._cols.empty(max(n, self._capacity), True)
                break
            if buf.n >= n:
                break
        rows = RawRows(n, buf.ids[:n], buf.dense[:n], {c: a[:n] for c, a in buf.scalar.items()}, {})
        rows.owner = buf
        return rows

    def put(self, rows: RawRows) -> None:
        """Give back the buffer of ``rows`` (from :meth:`get`; nothing of it may be used after)."""
        if rows.owner is not None and self._spare.qsize() < self._keep:
            self._spare.put(rows.owner)
