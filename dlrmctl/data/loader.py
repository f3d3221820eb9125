"""Batches for one rank from a preprocessed (columnar) split.

Semantics (identical for every world size, so a sharded run sees the same global batches as a
single process, and a checkpoint resumes exactly at another world size):

* each epoch the split's rows (the first ``num_samples`` of them, if given) are taken in order,
  or, when ``shuffle``, in the *windowed block shuffle* order below;
* global batch ``i`` is rows ``[i*G, (i+1)*G)`` of that order (``G`` = global batch size); the last
  one may be partial (dropped with ``drop_last``);
* rank ``r`` of ``W`` gets the contiguous slice ``[lo_r, hi_r)`` of each global batch with sizes
  ``g // W + (r < g % W)`` (``numpy.array_split`` rule: they differ by at most 1).  Every rank
  yields ``len(loader)`` batches; when the final global batch has fewer rows than ranks, some ranks
  get an empty batch (``batch_size == 0``) — use ``drop_last`` to avoid that.

Windowed block shuffle (``shuffle=True``; memory independent of the row count):

1. *blocks*: every record batch (row group) of every shard is cut into runs of at most
   ``shuffle_block_rows`` (``K``) contiguous rows; the block order is
   ``default_rng([seed, epoch, 0]).permutation(num_blocks)``.  Concatenating the blocks in that
   order gives the epoch's *stream* of rows.
2. *windows*: the stream is cut into consecutive windows of ``shuffle_window_rows`` (``S``) rows;
   the rows of window ``w`` are permuted with ``default_rng([seed, epoch, 1, w])``.  The
   concatenated windows are the epoch's order.  So a global batch draws its rows uniformly from
   one window (two at a window edge), i.e. from about ``S / K`` blocks at random places of the
   split; ``S >= rows`` is an exact uniform permutation, at O(rows) memory.
3. *reading*: each rank computes which positions of window ``w`` are in its slices, maps them
   through the window permutation to (block, row) and reads, block by block with ``pread``
   (not through the mapping), only the row range of each block it needs, into row-major stacks
   of the window (:mod:`dlrmctl.data.loader_rows`: the one-hot ids ``[n, F]``, the dense values
   ``[n, D]``), so a batch is one gather of a few cache lines per row from each stack.  Rows
   ahead of a resume point are never read.  Every rank reads the blocks of every window (its
   rows are spread over all of them); that is the price of world-size-independent batches.
   With ``prefetch > 0`` the next window is read by a second thread while the batches of this
   one are made (the reads release the GIL), and a window's buffer, once all its rows are in
   batches, is reused for a later window (no fresh pages to fault in every window).

Memory per rank: the window permutation (8 bytes x ``S``), one buffer of a window's rows read
(about a whole window on any number of ranks), this rank's rows of at most three windows (the one
being consumed, the next when a batch spans two, the one read ahead), and 16 bytes per *block*
for the epoch's block order (8.6 MB at 4.4 billion rows, ``K = 8192``): no per-row array.  The
data position (:meth:`BatchLoader.state_dict`), the global batches consumed, is all a resume needs.

Unshuffled batches (evaluation) are rank slices of contiguous rows: each column's range is copied
from the memory-mapped shards (:class:`dlrmctl.data.columnar.SplitData`) into the batch's
column-major id stack, which is the KeyedJaggedTensor's key-major values as it is.  Batches are
made in a background thread that keeps ``prefetch`` batches ready (plus the one being made).
With ``workers > 0`` they are made in that many worker processes instead, bit-identical and in
the same order (:mod:`dlrmctl.data.loader_workers`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from dlrmctl.data.batch import Batch
from dlrmctl.data.columnar import DataError, SplitData, read_meta, weight_column
from dlrmctl.data.loader_rows import (BlockTable, BufferPool, Prefetcher, RawRows, RowColumns, feature_bags,
                                      window_pieces)
from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor
from dlrmctl.sparse.validation import ON_INVALID_ID, IdBound, apply_id_policy, normalize_id_bounds

__all__ = ["BatchLoader", "rank_slice", "DEFAULT_SHUFFLE_WINDOW_ROWS", "DEFAULT_SHUFFLE_BLOCK_ROWS"]

#: rows mixed by the shuffle window (``data.shuffle_window_rows``): 2 MB of permutation and, on
#: Criteo (13 float32 + 26 int64 + label = 212 bytes a row), 56 MB of rows on one rank
DEFAULT_SHUFFLE_WINDOW_ROWS = 262_144
#: rows of a shuffled block (``data.shuffle_block_rows``): 32 KB per int64 column read at once,
#: 32 blocks per default window
DEFAULT_SHUFFLE_BLOCK_ROWS = 8_192


def rank_slice(global_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank`` inside a global batch of ``global_size`` rows (array_split rule)."""
    q, r = divmod(global_size, world_size)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


class BatchLoader:
    """Iterates over one split of a preprocessed directory, yielding :class:`Batch` for one rank.

    Args:
        data_dir: directory with ``meta.json`` (``dlrmctl preprocess ...``).
        split: ``"train"``, ``"val"`` or ``"test"`` (any key of ``meta["splits"]``).
        batch_size: GLOBAL batch size ``G`` (rows over all ranks).
        rank, world_size: this rank and the number of ranks.
        shuffle: windowed block shuffle each epoch (module docstring), seeded by ``(seed, epoch)``.
        seed: shuffle seed.
        shuffle_window_rows: rows ``S`` of the shuffle window (>= 1); ``S >= rows`` permutes the
            whole split at once (memory O(rows)).
        shuffle_block_rows: rows ``K`` of a shuffled block (>= 1); at most a record batch.
        drop_last: drop the final partial global batch.
        prefetch: batches kept ready by a background thread, besides the one it is making
            (0: synchronous, and the shuffle windows are read when needed, not ahead).
        num_samples: use only the first ``num_samples`` rows of the split.
        features: subset (and order) of sparse feature names; default all, in meta order.
        pin_memory: pin batches (page-locked) for fast async host-to-device copies; ignored with a
            warning when CUDA is unavailable.
        multi_hot_sizes: feature -> bag size; one-hot ids of those features are expanded on the
            fly into MLPerf-DLRMv2 multi-hot bags (:func:`dlrmctl.data.multi_hot.multi_hot_expand`,
            seed ``multi_hot_seed + feature index``); size 1 leaves a feature unchanged.
        multi_hot_distribution: ``"uniform"`` or ``"pareto"`` offsets.
        workers: worker processes that make the batches (0: a thread of this process, see
            ``prefetch``); worker ``k`` of ``N`` makes global batches ``i % N == k``, each at most
            ``max(2, prefetch)`` ahead; the batches are the same, in the same order
            (:mod:`dlrmctl.data.loader_workers`; needs ``os.fork``).
        id_bounds: feature -> the lookups it feeds, as a list of
            :class:`~dlrmctl.sparse.validation.IdBound` (``table_id_bounds(tables)``) or one
            ``(table, rows)``; every batch gets ``on_invalid_id`` applied on the CPU, before
            it leaves the loader thread.
        on_invalid_id: ``error`` (raise) or ``zero`` (drop invalid ids from their bags; a
            feature feeding tables of different sizes then comes as one key per table,
            ``feature@table``), see :mod:`dlrmctl.sparse.validation`.
        require_labels: refuse data without a label column (training and evaluation) instead of
            yielding NaN labels.
        weighted_features: features whose per-id weights (the data's ``<feature>__weight``
            column, see :mod:`dlrmctl.data.columnar`) are read into the KJT's ``weights()``; the
            other features get weight 1.0 (ignoring any weight column they have).  Empty / None:
            the KJTs carry no weights.  An id repeated into a multi-hot bag
            (``multi_hot_sizes``) keeps its weight; ``on_invalid_id="zero"`` drops
            an invalid id's weight with it (and a per-table ``feature@table`` copy carries the
            feature's weights).

    Yields (``__iter__``):
        :class:`Batch` with ``dense_features [B, D] f32``, ``sparse_features`` KJT (keys =
        features, key-major, int64 values, float32 weights with ``weighted_features``),
        ``labels [B] f32`` (NaN when the data has no label).

    Raises:
        DataError: missing/corrupt meta, unknown split or feature (names the alternatives), no label
            column with ``require_labels``, a
            weighted feature without a weight column, weight bags whose lengths differ from the ids';
            (while iterating) a label other than 0 / 1 or a NaN / inf dense value
            (:func:`dlrmctl.data.columnar.check_rows`: names the shard, split, row, column and value).
        ValueError: bad batch_size / rank / world_size / num_samples / shuffle_window_rows /
            shuffle_block_rows.
        EmbeddingIdError: (while iterating, with ``id_bounds`` and ``on_invalid_id="error"``) an id
            outside its table, naming the split, the batch, the table and the feature.
    """

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, prefetch: int = 2,
                 num_samples: int | None = None, features: Sequence[str] | None = None,
                 pin_memory: bool = False, multi_hot_sizes: dict[str, int] | None = None,
                 multi_hot_distribution: str = "uniform", multi_hot_seed: int = 0,
                 id_bounds: dict[str, tuple[str, int] | list[IdBound]] | None = None,
                 on_invalid_id: str = "error", weighted_features: Sequence[str] | None = None,
                 shuffle_window_rows: int = DEFAULT_SHUFFLE_WINDOW_ROWS,
                 shuffle_block_rows: int = DEFAULT_SHUFFLE_BLOCK_ROWS, require_labels: bool = False,
                 workers: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if int(workers) < 0 or (workers and not hasattr(os, "fork")):
            raise ValueError(f"workers must be >= 0 (> 0 needs os.fork), got {workers}")
        self.workers = int(workers)
        if int(shuffle_window_rows) < 1:
            raise ValueError(f"shuffle_window_rows must be >= 1, got {shuffle_window_rows}")
        if int(shuffle_block_rows) < 1:
            raise ValueError(f"shuffle_block_rows must be >= 1, got {shuffle_block_rows}")
        self.shuffle_window_rows = int(shuffle_window_rows)
        self.shuffle_block_rows = int(shuffle_block_rows)
        self.meta = read_meta(data_dir)
        self.data = SplitData(data_dir, split, self.meta)
        self.split = split
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.prefetch = prefetch
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_rows = self.data.rows if num_samples is None else min(num_samples, self.data.rows)
        all_sparse = [f["name"] for f in self.meta["sparse_features"]]
        if features is None:
            features = all_sparse
        unknown = [f for f in features if f not in all_sparse]
        if unknown:
            raise DataError(f"unknown sparse feature(s) {unknown}; available: {all_sparse}",
                            path=Path(data_dir) / "meta.json")
        self.features = list(dict.fromkeys(features))  # a feature looked up in several tables is read once
        self.multi_hot = {f["name"]: bool(f["multi_hot"]) for f in self.meta["sparse_features"]}
        self.weighted = set(weighted_features or ())
        has_w = {f["name"]: bool(f.get("weighted", False)) for f in self.meta["sparse_features"]}
        for f in sorted(self.weighted):
            if f not in self.features:
                raise DataError(f"weighted feature '{f}' is not among the features read {self.features}",
                                path=Path(data_dir) / "meta.json")
            if not has_w[f]:
                raise DataError(
                    f"feature '{f}' is weighted (its table has `weighted: true`) but the data has no per-id "
                    f"weights for it (no '{weight_column(f)}' column; meta.json sparse_features[].weighted is "
                    "not true); preprocess data with weights (e.g. `dlrmctl preprocess synthetic "
                    "--weighted-features ...`) or make the table unweighted", path=Path(data_dir) / "meta.json")
        # on-the-fly MLPerf-DLRMv2 multi-hot expansion of one-hot features (multi_hot.multi_hot_expand)
        self.expand: dict[str, tuple[int, int, int]] = {}
        rows_of = {f["name"]: int(f["num_embeddings"]) for f in self.meta["sparse_features"]}
        for j, (name, size) in enumerate((multi_hot_sizes or {}).items()):
            if name not in rows_of:
                raise DataError(f"multi_hot_sizes names unknown feature '{name}'; available: {all_sparse}",
                                path=Path(data_dir) / "meta.json")
            if self.multi_hot[name] and size != 1:
                raise DataError(f"feature '{name}' is already multi-hot; multi_hot_sizes must be 1 for it",
                                path=Path(data_dir) / "meta.json")
            if size > 1:
                self.expand[name] = (rows_of[name], int(size), multi_hot_seed + all_sparse.index(name))
        if multi_hot_distribution not in ("uniform", "pareto"):
            raise ValueError(f"multi_hot_distribution must be 'uniform' or 'pareto', got {multi_hot_distribution!r}")
        self.multi_hot_distribution = multi_hot_distribution
        self.dense_names = list(self.meta["dense_features"])
        self.label_name = self.meta["label"]
        if require_labels and self.label_name is None:
            raise DataError(f"the {split} split has no labels (meta.json \"label\": null, e.g. Criteo's test.txt "
                            "preprocessed as unlabelled data); training and evaluation need labelled data: "
                            "preprocess labelled files", path=Path(data_dir) / "meta.json")
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("BatchLoader(pin_memory=True) ignored: CUDA is not available", stacklevel=2)
        if on_invalid_id not in ON_INVALID_ID:
            raise ValueError(f"on_invalid_id must be one of {list(ON_INVALID_ID)}, got {on_invalid_id!r}")
        self.id_bounds = normalize_id_bounds(id_bounds)
        self.on_invalid_id = on_invalid_id
        # raw columns read per row (before batching): one-hot ids and dense values stacked (loader_rows)
        self._cols = RowColumns(
            ids=[f for f in self.features if not self.multi_hot[f]], dense=self.dense_names, label=self.label_name,
            scalar_weights=[weight_column(f) for f in self.features if not self.multi_hot[f] and f in self.weighted],
            lists=[f for f in self.features if self.multi_hot[f]]
            + [weight_column(f) for f in self.features if self.multi_hot[f] and f in self.weighted], split=split)
        self._id_row = {f: j for j, f in enumerate(self._cols.ids)}
        # every feature one-hot, none expanded or weighted: a batch's KJT values are its id stack as it is
        self._plain_ids = not self.expand and not self.weighted and len(self._cols.ids) == len(self.features)
        self._blocks = BlockTable(self.data, self.num_rows, self.shuffle_block_rows) if shuffle else None
        # the shuffle windows' buffers, recycled from window to window and epoch to epoch
        self._pool = BufferPool(self._cols, min(self.shuffle_window_rows, self.num_rows)) if shuffle else None
        self._epoch_blocks: tuple[int, np.ndarray, np.ndarray] | None = None
        self.epoch = 0
        self._start_batch = 0  # batches of `epoch` already consumed (resume point)
        self._yielded = 0

    # ----------------------------------------------------------------- sizes
    def num_global_batches(self) -> int:
        """Global batches per epoch (``R // G`` with drop_last, else ``ceil(R / G)``)."""
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank)."""
        return self.num_global_batches()

    def num_samples_per_rank(self, rank: int | None = None) -> int:
        """Rows rank ``rank`` (default: this rank) sees per epoch."""
        r = self.rank if rank is None else rank
        nb = self.num_global_batches()
        full = min(nb, self.num_rows // self.batch_size)
        lo, hi = rank_slice(self.batch_size, r, self.world_size)
        total = full * (hi - lo)
        if nb > full:
            lo, hi = rank_slice(self.num_rows - full * self.batch_size, r, self.world_size)
            total += hi - lo
        return total

    # ----------------------------------------------------------------- state
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch on the next ``iter()``."""
        self.epoch = int(epoch)
        self._start_batch = 0
        self._yielded = 0

    def state_dict(self) -> dict:
        """``{"epoch", "batches_yielded"}``: the exact data position (batches consumed this epoch)."""
        return {"epoch": self.epoch, "batches_yielded": self._yielded if self._yielded else self._start_batch}

    def order(self) -> dict:
        """What fixes the sequence of global batches of an epoch: ``{"rows", "batch_size", "drop_last",
        "shuffle", "seed", "shuffle_window_rows", "shuffle_block_rows"}`` (the world size does not).
        Store it with :meth:`state_dict` (as ``state["order"]``) so that :meth:`load_state_dict` can
        tell a mid-epoch position that no longer means the same rows."""
        return {"rows": int(self.num_rows), "batch_size": int(self.batch_size), "drop_last": bool(self.drop_last),
                "shuffle": bool(self.shuffle), "seed": int(self.seed) if self.shuffle else None,
                "shuffle_window_rows": self.shuffle_window_rows if self.shuffle else None,
                "shuffle_block_rows": self.shuffle_block_rows if self.shuffle else None}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`): the next ``iter()`` continues that epoch.

        Raises:
            ValueError: ``state["order"]`` (the :meth:`order` of the loader that was saved, when
                present) differs from this loader's while the position is inside an epoch
                (``0 < batches_yielded <`` the saved epoch's batches): batch ``k`` would be other rows,
                so rows of the epoch would be repeated or skipped.  The message names the differing
                settings.  A position at the end of a saved epoch continues with the next epoch
                whatever the settings.
        """
        start = int(state["batches_yielded"])
        saved = state.get("order")
        r, g = (int(saved["rows"]), int(saved["batch_size"])) if saved is not None else (0, 1)
        if saved is not None and start >= (r // g if saved["drop_last"] else -(-r // g)):
            start = self.num_global_batches()  # the saved epoch was complete: the next one starts afresh
        elif start > 0 and saved is not None:
            mine = self.order()
            diff = [f"{k}: {mine.get(k)!r} now, {saved.get(k)!r} when saved" for k in sorted(set(mine) | set(saved))
                    if mine.get(k) != saved.get(k)]
            if diff:
                raise ValueError(
                    f"{self.split} split: cannot resume inside epoch {int(state['epoch']) + 1} (after {start} "
                    f"batches) with another batch order ({'; '.join(diff)}): rows of that epoch would be repeated "
                    "or skipped; resume with the saved settings, or from a checkpoint at an epoch boundary")
        self.epoch = int(state["epoch"])
        self._start_batch = start
        self._yielded = 0

    # ----------------------------------------------------------------- batches
    def _build(self, rows: RawRows, index: int = 0) -> Batch:
        """Raw columns of ``B`` rows (fresh arrays, owned by the batch) -> :class:`Batch`
        (multi-hot expansion, weights, id policy, pinning)."""
        B = rows.n
        dense = np.ascontiguousarray(rows.dense)  # [B, D]
        ids = np.ascontiguousarray(rows.ids.T)  # [F, B]: key-major (no copy for an in-order batch)
        labels = np.full(B, np.nan, np.float32) if self.label_name is None else rows.scalar[self.label_name]
        if self._plain_ids:  # the id stack is the KJT's key-major values
            values, weights = ids.reshape(-1), None
            lengths = np.ones(len(values), dtype=np.int64)
            length_per_key = [B] * len(self.features)
        else:
            values, lengths, weights = feature_bags(self, rows, ids)
            length_per_key = [len(v) for v in values]
            values = np.concatenate(values) if values else np.zeros(0, np.int64)
            lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
            weights = (np.concatenate(weights) if weights else np.zeros(0, np.float32)) if self.weighted else None
        kjt = KeyedJaggedTensor(
            self.features, torch.from_numpy(values), lengths=torch.from_numpy(lengths),
            weights=torch.from_numpy(weights) if weights is not None else None,
            stride=B, validate=False, length_per_key=length_per_key,
        )
        if self.id_bounds:
            kjt = apply_id_policy(kjt, self.id_bounds, self.on_invalid_id,
                                  where=f"{self.split} split, epoch {self.epoch + 1}, batch {index + 1}: ")  # numbered from 1
        batch = Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))
        return batch.pin_memory() if self.pin_memory else batch


    def _rank_rows(self, i: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank inside global batch ``i``, as global order positions."""
        g0 = i * self.batch_size
        lo, hi = rank_slice(min(self.batch_size, self.num_rows - g0), self.rank, self.world_size)
        return g0 + lo, g0 + hi

    def _part(self, start: int, k: int = 0, n: int = 1) -> Iterator[tuple[int, Batch]]:
        """``(i, batch i)`` for the global batches ``i >= start`` with ``i % n == k``, in order
        (``n`` = 1: every batch; a worker's share, :mod:`dlrmctl.data.loader_workers`)."""
        first = start + (k - start) % n
        batches = self._produce_shuffled(start, (k, n)) if self.shuffle else self._produce(start, (k, n))
        return zip(range(first, self.num_global_batches(), n), batches)

    def _produce(self, start: int, part: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        k, n = part
        for i in range(start + (k - start) % n, self.num_global_batches(), n):
            lo, hi = self._rank_rows(i)  # contiguous split rows: read with pread into the batch's stacks
            yield self._build(RawRows.read_range(self._cols, self.data, lo, hi), i)

    # ------------------------------------------------------- windowed block shuffle
    def _seed(self, *tail: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % (1 << 64), self.epoch, *tail])

    def _block_order(self) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's block order ``[num_blocks] int64`` and the stream position where each of those
        blocks starts ``[num_blocks] int64`` (cached per epoch)."""
        if self._epoch_blocks is None or self._epoch_blocks[0] != self.epoch:
            order = self._seed(0).permutation(self._blocks.num_blocks)
            starts = np.cumsum(self._blocks.lengths(order))
            starts = np.concatenate(([0], starts[:-1])) if len(starts) else starts
            self._epoch_blocks = (self.epoch, order, starts)
        return self._epoch_blocks[1], self._epoch_blocks[2]

    def _rank_positions(self, p0: int, p1: int, first_batch: int, part: tuple[int, int] = (0, 1)) -> np.ndarray:
        """Sorted global order positions ``[n] int64`` in ``[p0, p1)`` that this rank yields, in
        global batches ``i >= first_batch`` with ``i % part[1] == part[0]``."""
        G, R = self.batch_size, self.num_rows
        i0 = max(first_batch, p0 // G)
        i1 = min(self.num_global_batches(), -(-p1 // G))
        full_end = min(i1, R // G)  # batches before R // G are full
        chunks = []
        if i0 < full_end:
            lo, hi = rank_slice(G, self.rank, self.world_size)
            base = np.arange(i0, full_end, dtype=np.int64) * G
            chunks.append((base[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :]).ravel())
        if max(i0, full_end) < i1:  # the partial last batch
            lo, hi = self._rank_rows(i1 - 1)
            chunks.append(np.arange(lo, hi, dtype=np.int64))
        if not chunks:
            return np.zeros(0, np.int64)
        pos = np.concatenate(chunks)
        keep = (pos >= p0) & (pos < p1)
        if part[1] > 1:
            keep &= (pos // G) % part[1] == part[0]
        return pos[keep]

    def _load_window(self, w: int, first_batch: int, pool: BufferPool,
                     part: tuple[int, int] = (0, 1)) -> tuple[RawRows, np.ndarray]:
        """This rank's rows of shuffle window ``w`` (global batches ``>= first_batch``): the raw rows
        read (for each block, the range of rows this rank needs, block after block in stream order)
        and ``src [n] int64``, the raw row of each of this rank's positions, in order."""
        S, R = self.shuffle_window_rows, self.num_rows
        p0, p1 = w * S, min((w + 1) * S, R)
        pos = self._rank_positions(p0, p1, first_batch, part)
        if len(pos) == 0:
            return self._cols.none(), pos
        order, starts = self._block_order()
        stream = self._seed(1, w).permutation(p1 - p0)[pos - p0]  # stream position - p0 of each position
        t, first, lo, n, at, src = window_pieces(stream, p0, p1, starts)
        raw = pool.get(int(n.sum()))
        pieces = []
        for g in range(len(first)):  # one block piece at a time, in stream order
            s, chunk, row0 = self._blocks.locate(int(order[t[first[g]]]))
            shard = self.data.shards[s]
            start = row0 + int(lo[g])
            pieces.append(raw.read_piece(self._cols, int(at[g]), shard, chunk, start, int(n[g]),
                                         int(shard._starts[chunk]) + start))
        raw = raw.set_lists(pieces, self._cols)
        if 2 * len(src) <= raw.n:  # one rank's share of rows read on several: keep only its rows
            mine = raw.take(src)
            pool.put(raw)  # the buffer is free again for the next window read
            return mine, np.arange(len(src), dtype=np.int64)
        return raw, src

    def _windows(self, w: int, first_batch: int, pool: BufferPool,
                 part: tuple[int, int]) -> Iterator[tuple[RawRows, np.ndarray]]:
        """:meth:`_load_window` of ``w``, ``w + 1``, ... up to the end of the split."""
        n = -(-self.num_rows // self.shuffle_window_rows)  # windows of the split
        return (self._load_window(v, first_batch, pool, part) for v in range(w, n))

    def _produce_shuffled(self, start: int, part: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        nb = self.num_global_batches()
        if start >= nb:
            return
        pool = self._pool
        windows = self._windows(start * self.batch_size // self.shuffle_window_rows, start, pool, part)
        if self.prefetch:  # the next window is read (pread, the GIL released) while this one's batches are made
            windows = Prefetcher(windows, 1, name="BatchLoader-window")
        fifo: list[tuple[RawRows, np.ndarray]] = []
        head = have = 0  # next position of fifo[0]; positions held
        try:
            for i in range(start + (part[0] - start) % part[1], nb, part[1]):
                lo, hi = self._rank_rows(i)
                need = hi - lo
                while have < need:
                    raw, src = next(windows, (None, None))
                    if raw is None:
                        raise RuntimeError(f"internal error: the shuffle stream ended before batch {i + 1}")
                    if len(src):
                        fifo.append((raw, src))
                        have += len(src)
                parts = []
                while need:
                    raw, src = fifo[0]
                    k = min(need, len(src) - head)
                    parts.append(raw.take(src[head:head + k]))
                    head += k
                    need -= k
                    have -= k
                    if head == len(src):
                        pool.put(fifo.pop(0)[0])  # every row of it is in a batch (copied by take)
                        head = 0
                yield self._build(RawRows.concat(parts) if parts else self._cols.none(), i)
        finally:
            if isinstance(windows, Prefetcher):
                windows.close()

    def __iter__(self) -> Iterator[Batch]:
        start = self._start_batch
        self._yielded = start
        if self.workers:
            from dlrmctl.data.loader_workers import worker_batches

            source = worker_batches(self, start, self.workers, max(2, self.prefetch))
        else:
            gen = self._produce_shuffled(start) if self.shuffle else self._produce(start)
            source = gen if self.prefetch == 0 else Prefetcher(gen, self.prefetch + 1)  # + the one being made
        try:
            for b in source:
                self._yielded += 1
                yield b
        finally:
            if isinstance(source, Prefetcher):
                source.close()
            elif self.workers:
                source.close()  # kills and reaps the workers now, not when the generator is collected
        # epoch complete: the next iter() starts the next epoch
        self.epoch += 1
        self._start_batch = 0
        self._yielded = 0
