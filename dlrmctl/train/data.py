"""The training package's data side: ONE loader constructor for every split a run reads
(training, in-training evaluation, offline evaluation of a run directory) and the aligned
epoch that gives every rank the same number of batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch

from dlrmctl.config import ExperimentConfig, resolve_tables, weighted_features
from dlrmctl.distributed import comm
from dlrmctl.train.run_dir import TrainError

if TYPE_CHECKING:
    from dlrmctl.data.batch import Batch
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.distributed.env import RunEnv


def loader_features(tables: list) -> list[str]:
    """Each input feature of ``tables`` once, in table order of first use (also when several
    tables look a feature up): the KJT keys a loader yields, as the model reads them."""
    return list(dict.fromkeys(f for t in tables for f in t.feature_names))


def make_loader(cfg: ExperimentConfig, meta: dict[str, Any], split: str, env: "RunEnv | None" = None, *,
                train: bool = False, data_dir: str | None = None, batch_size: int | None = None,
                tables: list | None = None) -> "BatchLoader":
    """The :class:`~dlrmctl.data.loader.BatchLoader` of ``split`` for this run.

    Args:
        cfg: the experiment (``data.*``; ``train.seed`` for shuffling and multi-hot draws).
        meta: the data's meta.json (sparse features, for ``data.multi_hot_sizes``).
        split: the split to read.
        env: this rank (its slice of the split; ids range-checked on the CPU batch by
            ``model.on_invalid_id``, so the step does no device read; ``data.workers`` worker
            processes, ``auto`` per the rank's device and CPUs).  None: one process
            reading the whole split, ids left to the model (offline evaluation).
        train: the training loader (shuffled per ``data.shuffle``, ``data.drop_last``,
            ``data.num_samples``, pinned memory on CUDA); else in row order, every row.
        data_dir: another copy of the data (default ``data.path``).
        batch_size: default ``data.batch_size`` (train) or ``data.eval_batch_size``.
        tables: the resolved tables (default :func:`~dlrmctl.config.resolve_tables`).

    Raises:
        TrainError: ``data.multi_hot_sizes`` does not match the data's sparse features.
    """
    from dlrmctl.data.loader import BatchLoader

    tables = resolve_tables(cfg, meta) if tables is None else tables
    d = cfg.data
    # every split a run reads is labelled (a label outside {0, 1}, or none, is a named DataError)
    kw: dict[str, Any] = {"features": loader_features(tables), "require_labels": True, **multi_hot_kwargs(cfg, meta)}
    if env is not None:
        from dlrmctl.config import managed_collision_tables
        from dlrmctl.modules.embedding_modules import table_id_bounds

        managed = managed_collision_tables(cfg, meta)  # raw ids: remapped in the model, not range-checked
        bounds = {f: [b for b in bs if b.table not in managed] for f, bs in table_id_bounds(tables).items()}
        from dlrmctl.data.loader_workers import auto_workers

        workers = auto_workers(env.device, env.local_world_size) if d.workers == "auto" else d.workers
        kw.update(rank=env.rank, world_size=env.world_size, prefetch=d.prefetch, workers=workers,
                  id_bounds={f: bs for f, bs in bounds.items() if bs}, on_invalid_id=cfg.model.on_invalid_id)
    if train:
        assert env is not None, "the training loader reads a rank's slice"
        kw.update(shuffle=d.shuffle, seed=cfg.train.seed, drop_last=d.drop_last,
                  shuffle_window_rows=d.shuffle_window_rows, shuffle_block_rows=d.shuffle_block_rows,
                  num_samples=d.num_samples, pin_memory=env.device.type == "cuda")
    else:
        kw.update(shuffle=False)
    size = batch_size or (d.batch_size if train else d.eval_batch_size)
    return BatchLoader(data_dir or d.path, split, size, **kw)


def aligned_num_batches(env: "RunEnv", n: int) -> int:
    """All ranks run the same number of steps (collectives must match): the max over ranks of
    ``n`` (one int64 all-reduce; ``n`` itself without sharding)."""
    if not env.sharded:
        return n
    from dlrmctl.sparse.jagged_tensor import host_to_device

    t = host_to_device([n], torch.int64, env.device)  # pinned, non-blocking: the read below is the one sync
    comm.all_reduce(t, env.pg, op="max")
    return int(t.item())


def aligned_epoch(loader: Any, n: int, num_dense: int, feature_names: list[str],
                  weighted: bool = False) -> Iterator["Batch"]:
    """Exactly ``n`` batches of one pass over ``loader`` (``n``: :func:`aligned_num_batches` of
    the ranks' counts, less what was already trained), padded with empty batches
    (:func:`empty_batch_like`) when this rank's slice runs out first."""
    return exactly(iter(loader), n, lambda: empty_batch_like(num_dense, feature_names, weighted))


def multi_hot_kwargs(cfg: ExperimentConfig, meta: dict) -> dict[str, Any]:
    """BatchLoader arguments for ``data.multi_hot_sizes`` (one size per sparse feature of meta.json),
    and ``weighted_features`` (the features of ``weighted: true`` tables, or of meta.json's weighted
    features for tables derived from the data) when there are any.

    Raises:
        TrainError: the list length does not match the data's sparse features.
    """
    wf = weighted_features(cfg, meta)
    extra: dict[str, Any] = {"weighted_features": wf} if wf else {}
    sizes = cfg.data.multi_hot_sizes
    if not sizes:
        return extra
    names = [f["name"] for f in meta["sparse_features"]]
    if len(sizes) != len(names):
        raise TrainError(
            f"data.multi_hot_sizes has {len(sizes)} sizes but {cfg.data.path}/meta.json has {len(names)} sparse "
            f"features ({names[:4]}...); give one size per feature"
        )
    return {"multi_hot_sizes": dict(zip(names, sizes)), "multi_hot_distribution": cfg.data.multi_hot_distribution,
            "multi_hot_seed": cfg.train.seed, **extra}


def exactly(it: Any, n: int, empty: Any) -> Any:
    """Yield exactly ``n`` items of ``it``, padding with ``empty()`` if it runs out first.

    A rank whose data slice has fewer batches keeps stepping with empty
    batches, so every rank issues the same collectives and nobody waits forever.
    """
    for _ in range(max(n, 0)):
        b = next(it, None)
        yield empty() if b is None else b


def empty_batch_like(num_dense: int, feature_names: list[str], weighted: bool = False) -> "Batch":
    """A batch of 0 samples: dense ``[0, num_dense]`` float32, a KJT of ``feature_names`` with no
    ids (and empty weights when ``weighted``), labels ``[0]``: what a rank whose slice ran out
    steps with (:func:`aligned_epoch`)."""
    from dlrmctl.data.batch import Batch
    from dlrmctl.sparse import KeyedJaggedTensor

    z = torch.zeros(0, dtype=torch.int64)
    return Batch(
        dense_features=torch.zeros(0, num_dense),
        sparse_features=KeyedJaggedTensor(feature_names, z, lengths=z.clone(), stride=0,
                                          weights=torch.zeros(0) if weighted else None,
                                          length_per_key=[0] * len(feature_names)),
        labels=torch.zeros(0),
    )
