"""Batches for one rank from a preprocessed (columnar) split.

Semantics (identical for every world size, so a sharded run sees the same global batches as a
single process):

* each epoch the split's rows (the first ``num_samples`` of them, if given) are taken in order,
  or permuted with ``numpy.random.default_rng(seed + epoch).permutation`` when ``shuffle``;
* global batch ``i`` is rows ``[i*G, (i+1)*G)`` of that order (``G`` = global batch size); the last
  one may be partial (dropped with ``drop_last``);
* rank ``r`` of ``W`` gets the contiguous slice ``[lo_r, hi_r)`` of each global batch with sizes
  ``g // W + (r < g % W)`` (``numpy.array_split`` rule: they differ by at most 1).  Every rank
  yields ``len(loader)`` batches; when the final global batch has fewer rows than ranks, some ranks
  get an empty batch (``batch_size == 0``) — use ``drop_last`` to avoid that.

Batches are assembled by vectorised gathers from the memory-mapped shards
(:class:`dlrmctl.data.columnar.SplitData`) in a background thread that keeps ``prefetch``
batches ready.
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
from dlrmctl.data.columnar import DataError, SplitData, read_meta, weight_column
from dlrmctl.data.multi_hot import multi_hot_expand
from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor
from dlrmctl.sparse.validation import ON_INVALID_ID, IdBound, apply_id_policy, normalize_id_bounds

__all__ = ["BatchLoader", "rank_slice"]


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
        shuffle: permute rows each epoch with seed ``seed + epoch``.
        seed: shuffle seed.
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
        DataError: missing/corrupt meta, unknown split or feature (names the alternatives), a
            weighted feature without a weight column, weight bags whose lengths differ from the ids'.
        ValueError: bad batch_size / rank / world_size / num_samples.
        EmbeddingIdError: (while iterating, with ``id_bounds`` and ``on_invalid_id="error"``) an id
            outside its table, naming the split, the batch, the table and the feature.
    """

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, prefetch: int = 2,
                 num_samples: int | None = None, features: Sequence[str] | None = None,
                 pin_memory: bool = False, multi_hot_sizes: dict[str, int] | None = None,
                 multi_hot_distribution: str = "uniform", multi_hot_seed: int = 0,
                 id_bounds: dict[str, tuple[str, int] | list[IdBound]] | None = None,
                 on_invalid_id: str = "error", weighted_features: Sequence[str] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
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
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("BatchLoader(pin_memory=True) ignored: CUDA is not available", stacklevel=2)
        if on_invalid_id not in ON_INVALID_ID:
            raise ValueError(f"on_invalid_id must be one of {list(ON_INVALID_ID)}, got {on_invalid_id!r}")
        self.id_bounds = normalize_id_bounds(id_bounds)
        self.on_invalid_id = on_invalid_id
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

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`): the next ``iter()`` continues that epoch."""
        self.epoch = int(state["epoch"])
        self._start_batch = int(state["batches_yielded"])
        self._yielded = 0

    # ----------------------------------------------------------------- batches
    def _order(self) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng(self.seed + self.epoch).permutation(self.num_rows).astype(np.int64)

    def _rows_of(self, order: np.ndarray | None, i: int) -> np.ndarray:
        g0 = i * self.batch_size
        g = min(self.batch_size, self.num_rows - g0)
        lo, hi = rank_slice(g, self.rank, self.world_size)
        if order is None:
            return np.arange(g0 + lo, g0 + hi, dtype=np.int64)
        return order[g0 + lo:g0 + hi]

    def _assemble(self, rows: np.ndarray, index: int = 0) -> Batch:
        """Gather ``rows [B]`` (global split row ids) into a Batch, vectorised per shard and column."""
        B = len(rows)
        D = len(self.dense_names)
        dense = np.empty((B, D), dtype=np.float32)
        labels = np.empty(B, dtype=np.float32)
        F = len(self.features)
        onehot = [f for f in self.features if not self.multi_hot[f]]
        oh_vals = {f: np.empty(B, dtype=np.int64) for f in onehot}
        oh_w = {f: np.empty(B, dtype=np.float32) for f in onehot if f in self.weighted}
        mh_parts: dict[str, list] = {f: [] for f in self.features if self.multi_hot[f]}
        mh_w: dict[str, list] = {f: [] for f in mh_parts if f in self.weighted}
        groups = self.data.group(rows)
        for s, pos, local in groups:
            shard = self.data.shards[s]
            loc = shard.locate(local)
            for j, name in enumerate(self.dense_names):
                dense[pos, j] = shard.take(name, loc)
            if self.label_name is not None:
                labels[pos] = shard.take(self.label_name, loc)
            for f in onehot:
                oh_vals[f][pos] = shard.take(f, loc)
            for f in oh_w:
                oh_w[f][pos] = shard.take(weight_column(f), loc)
            for f in mh_parts:
                mh_parts[f].append((pos, shard.take_list(f, loc)))
            for f in mh_w:
                w, wl = shard.take_list(weight_column(f), loc)
                if not np.array_equal(wl, mh_parts[f][-1][1][1]):
                    raise DataError(f"the weight bags of multi-hot feature '{f}' ({weight_column(f)}) have other "
                                    "lengths than its id bags", path=shard.path)
                mh_w[f].append((pos, (w, wl)))
        if self.label_name is None:
            labels[:] = np.nan
        values, lengths, weights = [], [], []
        for f in self.features:
            if f in self.expand:
                n_rows, size, seed = self.expand[f]
                v, ln = multi_hot_expand(oh_vals[f], n_rows, size, self.multi_hot_distribution, seed)
                values.append(v)
                lengths.append(ln)
                if f in oh_w:
                    weights.append(np.repeat(oh_w[f], ln))
            elif not self.multi_hot[f]:
                values.append(oh_vals[f])
                lengths.append(np.ones(B, dtype=np.int64))
                if f in oh_w:
                    weights.append(oh_w[f])
            else:
                v, ln = _merge_jagged(mh_parts[f], B)
                values.append(v)
                lengths.append(ln)
                if f in mh_w:
                    weights.append(_merge_jagged(mh_w[f], B, np.float32)[0])
            if self.weighted and f not in self.weighted:
                weights.append(np.ones(len(values[-1]), dtype=np.float32))
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
        del F
        if self.id_bounds:
            kjt = apply_id_policy(kjt, self.id_bounds, self.on_invalid_id,
                                  where=f"{self.split} split, epoch {self.epoch + 1}, batch {index + 1}: ")  # numbered from 1
        batch = Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))
        return batch.pin_memory() if self.pin_memory else batch

    def _produce(self, start: int, order: np.ndarray | None) -> Iterator[Batch]:
        for i in range(start, self.num_global_batches()):
            yield self._assemble(self._rows_of(order, i), i)

    def __iter__(self) -> Iterator[Batch]:
        start = self._start_batch
        order = self._order()
        self._yielded = start
        if self.prefetch == 0:
            source = self._produce(start, order)
        else:
            source = _Prefetcher(self._produce(start, order), self.prefetch)
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
