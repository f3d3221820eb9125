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
   (not through the mapping), only the row range of each block it needs.  Rows ahead of a
   resume point are never read.  Every rank reads the blocks of every window (its rows are
   spread over all of them); that is the price of world-size-independent batches.

Memory per rank: the window permutation (8 bytes x ``S``), this rank's rows of at most two windows
plus one block piece, and 16 bytes per *block* for the epoch's block order (8.6 MB at
4.4 billion rows with ``K = 8192``) -- no per-row array of the split.  The data position
(:meth:`BatchLoader.state_dict`) is the number of global batches consumed, so a resume recomputes
the window of that batch and continues exactly.

Unshuffled batches (evaluation) are assembled by vectorised gathers from the memory-mapped
shards (:class:`dlrmctl.data.columnar.SplitData`).  Both run in a background thread that keeps
``prefetch`` batches ready.
"""

from __future__ import annotations

import queue
import threading
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from dlrmctl.data.batch import Batch
from dlrmctl.data.columnar import DataError, SplitData, _jagged_gather, check_rows, read_meta, weight_column
from dlrmctl.data.multi_hot import multi_hot_expand
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
        prefetch: batches prepared ahead by a background thread (0: synchronous).
        num_samples: use only the first ``num_samples`` rows of the split.
        features: subset (and order) of sparse feature names; default all, in meta order.
        pin_memory: pin batches (page-locked) for fast async host-to-device copies; ignored with a
            warning when CUDA is unavailable.
        multi_hot_sizes: feature -> bag size; one-hot ids of those features are expanded on the
            fly into MLPerf-DLRMv2 multi-hot bags (:func:`dlrmctl.data.multi_hot.multi_hot_expand`,
            seed ``multi_hot_seed + feature index``); size 1 leaves a feature unchanged.
        multi_hot_distribution: ``"uniform"`` or ``"pareto"`` offsets.
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
                 shuffle_block_rows: int = DEFAULT_SHUFFLE_BLOCK_ROWS, require_labels: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
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
        # raw columns read per row (before batching)
        self._scalar_cols = list(self.dense_names) + ([self.label_name] if self.label_name is not None else [])
        self._scalar_cols += [f for f in self.features if not self.multi_hot[f]]
        self._scalar_cols += [weight_column(f) for f in self.features if not self.multi_hot[f] and f in self.weighted]
        self._list_cols = [f for f in self.features if self.multi_hot[f]]
        self._list_cols += [weight_column(f) for f in self.features if self.multi_hot[f] and f in self.weighted]
        self._blocks = _BlockTable(self.data, self.num_rows, self.shuffle_block_rows) if shuffle else None
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
    def _empty_rows(self) -> "_Rows":
        ids = set(self.features)  # id columns are int64; dense, label and weight columns float32
        scalar = {c: np.zeros(0, np.int64 if c in ids else np.float32) for c in self._scalar_cols}
        lists = {c: (np.zeros(0, np.int64 if c in ids else np.float32), np.zeros(1, np.int64))
                 for c in self._list_cols}
        return _Rows(0, scalar, lists)

    def _gather(self, rows: np.ndarray) -> "_Rows":
        """Raw columns of ``rows [B]`` (global split row ids), gathered from the mapped shards."""
        parts = []
        for s, pos, local in self.data.group(rows):
            shard = self.data.shards[s]
            loc = shard.locate(local)
            scalar = {c: shard.take(c, loc) for c in self._scalar_cols}
            check_rows(shard.path, self.split, local, scalar, self.label_name, self.dense_names)
            lists = {}
            for c in self._list_cols:
                v, ln = shard.take_list(c, loc)
                lists[c] = (v, _offsets(ln))
            self._check_weight_bags(lists, shard.path)
            parts.append((pos, _Rows(len(local), scalar, lists)))
        return _Rows.scatter(parts, len(rows)) if parts else self._empty_rows()

    def _check_weight_bags(self, lists: dict, path) -> None:
        for f in self._list_cols:
            wc = weight_column(f)
            if wc in lists and not np.array_equal(lists[wc][1], lists[f][1]):
                raise DataError(f"the weight bags of multi-hot feature '{f}' ({wc}) have other "
                                "lengths than its id bags", path=path)

    def _build(self, rows: "_Rows", index: int = 0) -> Batch:
        """Raw columns of ``B`` rows -> :class:`Batch` (multi-hot expansion, weights, id policy, pinning)."""
        B = rows.n
        dense = np.empty((B, len(self.dense_names)), dtype=np.float32)
        for j, name in enumerate(self.dense_names):
            dense[:, j] = rows.scalar[name]
        if self.label_name is None:
            labels = np.full(B, np.nan, dtype=np.float32)
        else:
            labels = np.array(rows.scalar[self.label_name], dtype=np.float32)
        values, lengths, weights = [], [], []
        for f in self.features:
            w = None
            if not self.multi_hot[f]:
                ids = rows.scalar[f]
                if f in self.weighted:
                    w = rows.scalar[weight_column(f)]
                if f in self.expand:
                    n_rows, size, seed = self.expand[f]
                    v, ln = multi_hot_expand(ids, n_rows, size, self.multi_hot_distribution, seed)
                    if w is not None:
                        w = np.repeat(w, ln)
                else:
                    v, ln = np.array(ids, dtype=np.int64), np.ones(B, dtype=np.int64)
            else:
                v, off = rows.lists[f]
                ln = np.diff(off)
                if f in self.weighted:
                    w = rows.lists[weight_column(f)][0]
            values.append(v)
            lengths.append(ln)
            if w is not None:
                weights.append(np.asarray(w, dtype=np.float32))
            elif self.weighted:
                weights.append(np.ones(len(v), dtype=np.float32))
        kjt = KeyedJaggedTensor(
            self.features,
            torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths) if lengths else np.zeros(0, np.int64)),
            weights=(torch.from_numpy(np.concatenate(weights) if weights else np.zeros(0, np.float32))
                     if self.weighted else None),
            stride=B,
            validate=False,
            length_per_key=[len(v) for v in values],
        )
        if self.id_bounds:
            kjt = apply_id_policy(kjt, self.id_bounds, self.on_invalid_id,
                                  where=f"{self.split} split, epoch {self.epoch + 1}, batch {index + 1}: ")  # numbered from 1
        batch = Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))
        return batch.pin_memory() if self.pin_memory else batch

    def _assemble(self, rows: np.ndarray, index: int = 0) -> Batch:
        """Gather ``rows [B]`` (global split row ids) from the mapped shards into a Batch."""
        return self._build(self._gather(rows), index)

    def _rank_rows(self, i: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank inside global batch ``i``, as global order positions."""
        g0 = i * self.batch_size
        lo, hi = rank_slice(min(self.batch_size, self.num_rows - g0), self.rank, self.world_size)
        return g0 + lo, g0 + hi

    def _produce(self, start: int) -> Iterator[Batch]:
        for i in range(start, self.num_global_batches()):
            lo, hi = self._rank_rows(i)
            yield self._assemble(np.arange(lo, hi, dtype=np.int64), i)

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

    def _rank_positions(self, p0: int, p1: int, first_batch: int) -> np.ndarray:
        """Sorted global order positions ``[n] int64`` in ``[p0, p1)`` that this rank yields, in
        global batches ``>= first_batch``."""
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
        return pos[(pos >= p0) & (pos < p1)]

    def _load_window(self, w: int, first_batch: int) -> "_Rows":
        """This rank's rows of shuffle window ``w`` (global batches ``>= first_batch``), in order."""
        S, R = self.shuffle_window_rows, self.num_rows
        p0, p1 = w * S, min((w + 1) * S, R)
        pos = self._rank_positions(p0, p1, first_batch)
        if len(pos) == 0:
            return self._empty_rows()
        order, starts = self._block_order()
        stream = p0 + self._seed(1, w).permutation(p1 - p0)[pos - p0]
        t = np.searchsorted(starts, stream, side="right") - 1  # index into the block order
        off = stream - starts[t]  # row inside the block
        by_block = np.argsort(t, kind="stable")
        bounds = np.flatnonzero(np.diff(t[by_block])) + 1
        parts = []
        for grp in np.split(by_block, bounds):  # one block piece at a time, in stream order
            o = off[grp]
            lo = int(o.min())
            piece = self._read_piece(int(order[t[grp[0]]]), lo, int(o.max()) + 1 - lo)
            parts.append((grp, piece.take(o - lo)))
        return _Rows.scatter(parts, len(pos))

    def _read_piece(self, block: int, start: int, n: int) -> "_Rows":
        """Rows ``[start, start + n)`` of block ``block``, read with ``pread`` (see MappedShard.read_range)."""
        s, chunk, row0 = self._blocks.locate(block)
        shard = self.data.shards[s]
        scalar = {c: shard.read_range(c, chunk, row0 + start, n) for c in self._scalar_cols}
        check_rows(shard.path, self.split, int(shard._starts[chunk]) + row0 + start, scalar, self.label_name,
                   self.dense_names)
        lists = {}
        for c in self._list_cols:
            v, ln = shard.read_range(c, chunk, row0 + start, n)
            lists[c] = (v, _offsets(ln))
        self._check_weight_bags(lists, shard.path)
        return _Rows(n, scalar, lists)

    def _produce_shuffled(self, start: int) -> Iterator[Batch]:
        nb = self.num_global_batches()
        if start >= nb:
            return
        S = self.shuffle_window_rows
        w = start * self.batch_size // S
        fifo: list[_Rows] = []
        head = have = 0  # next row of fifo[0]; rows held
        for i in range(start, nb):
            lo, hi = self._rank_rows(i)
            need = hi - lo
            while have < need:
                if w * S >= self.num_rows:
                    raise RuntimeError(f"internal error: the shuffle stream ended before batch {i + 1}")
                part = self._load_window(w, start)
                w += 1
                if part.n:
                    fifo.append(part)
                    have += part.n
            pieces = []
            while need:
                k = min(need, fifo[0].n - head)
                pieces.append(fifo[0].slice(head, head + k))
                head += k
                need -= k
                have -= k
                if head == fifo[0].n:
                    fifo.pop(0)
                    head = 0
            rows = pieces[0] if len(pieces) == 1 else _Rows.concat(pieces) if pieces else self._empty_rows()
            yield self._build(rows, i)

    def __iter__(self) -> Iterator[Batch]:
        start = self._start_batch
        self._yielded = start
        gen = self._produce_shuffled(start) if self.shuffle else self._produce(start)
        source = gen if self.prefetch == 0 else _Prefetcher(gen, self.prefetch)
        try:
            for b in source:
                self._yielded += 1
                yield b
        finally:
            if isinstance(source, _Prefetcher):
                source.close()
        # epoch complete: the next iter() starts the next epoch
        self.epoch += 1
        self._start_batch = 0
        self._yielded = 0


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Bag lengths ``[n]`` -> offsets ``[n + 1] int64`` starting at 0."""
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off


class _Rows:
    """Raw columns of ``n`` rows before batching.

    ``scalar``: column -> ``[n]`` float32 / int64; ``lists``: column -> (values ``[offsets[-1]]``,
    offsets ``[n + 1] int64`` from 0) for ``list<int64>`` / ``list<float32>`` columns.
    """

    __slots__ = ("n", "scalar", "lists")

    def __init__(self, n: int, scalar: dict, lists: dict) -> None:
        self.n, self.scalar, self.lists = n, scalar, lists

    def take(self, idx: np.ndarray) -> "_Rows":
        """Rows ``idx [m]`` (any order) -> a new ``_Rows`` of ``m`` rows."""
        lists = {}
        for c, (v, off) in self.lists.items():
            ln = off[1:][idx] - off[:-1][idx]
            lists[c] = (_jagged_gather(v, off[:-1][idx], ln), _offsets(ln))
        return _Rows(len(idx), {c: a[idx] for c, a in self.scalar.items()}, lists)

    def slice(self, a: int, b: int) -> "_Rows":
        """Rows ``[a, b)`` (views of the scalar columns)."""
        lists = {c: (v[off[a]:off[b]], off[a:b + 1] - off[a]) for c, (v, off) in self.lists.items()}
        return _Rows(b - a, {c: x[a:b] for c, x in self.scalar.items()}, lists)

    @staticmethod
    def concat(parts: list["_Rows"]) -> "_Rows":
        """Rows of ``parts`` one after the other."""
        lists = {}
        for c in parts[0].lists:
            vals = [p.lists[c][0] for p in parts]
            lens = [np.diff(p.lists[c][1]) for p in parts]
            lists[c] = (np.concatenate(vals), _offsets(np.concatenate(lens)))
        scalar = {c: np.concatenate([p.scalar[c] for p in parts]) for c in parts[0].scalar}
        return _Rows(sum(p.n for p in parts), scalar, lists)

    @staticmethod
    def scatter(parts: list, n: int) -> "_Rows":
        """``[(positions, _Rows)]`` covering ``[0, n)`` once -> one ``_Rows`` in position order."""
        if len(parts) == 1 and isinstance(parts[0][0], slice):
            return parts[0][1]
        first = parts[0][1]
        scalar = {}
        for c, a in first.scalar.items():
            out = np.empty(n, dtype=a.dtype)
            for pos, p in parts:
                out[pos] = p.scalar[c]
            scalar[c] = out
        lists = {}
        for c, (v0, _) in first.lists.items():
            v, ln = _merge_jagged([(pos, (p.lists[c][0], np.diff(p.lists[c][1]))) for pos, p in parts], n, v0.dtype)
            lists[c] = (v, _offsets(ln))
        return _Rows(n, scalar, lists)


class _BlockTable:
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


def _merge_jagged(parts: list, B: int, dtype: type = np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard (positions, (values, lengths)) of one multi-hot feature -> batch-ordered (values, lengths)."""
    if len(parts) == 1 and isinstance(parts[0][0], slice):
        return parts[0][1]
    lengths = np.zeros(B, dtype=np.int64)
    for pos, (_, ln) in parts:
        lengths[pos] = ln
    offsets = np.cumsum(lengths) - lengths
    values = np.empty(int(lengths.sum()), dtype=dtype)
    for pos, (v, ln) in parts:
        if len(v):
            dst = np.repeat(offsets[pos] - (np.cumsum(ln) - ln), ln) + np.arange(len(v))
            values[dst] = v
    return values, lengths


class _Prefetcher:
    """Runs a batch generator in a daemon thread, ``depth`` batches ahead; re-raises its errors."""

    _END = object()

    def __init__(self, gen: Iterator[Batch], depth: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._gen = gen
        self._t = threading.Thread(target=self._run, name="BatchLoader-prefetch", daemon=True)
        self._t.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for b in self._gen:
                if not self._put(b):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer
            self._put(e)

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
