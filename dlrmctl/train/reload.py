"""Offline reload of a trained run: the model rebuilt from a run directory's checkpoint
(unsharded, on the meta device until its tables are read), one table's weights, the run's
recorded config, and evaluation of a checkpoint on a split (``dlrmctl evaluate``, export,
predict).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import torch

from dlrmctl.config import ExperimentConfig, meta_as_trained, recorded_weighted_features, resolve_tables
from dlrmctl.console import Progress, show_path, stage
from dlrmctl.modules.embedding_configs import DataType
from dlrmctl.train import checkpoint as ckpt
from dlrmctl.train.checkpoint import check_tables, dense_state_dict, embedding_load_request, managed_collision_state
from dlrmctl.train.checkpoint import load as ckpt_load
from dlrmctl.train.data import make_loader
from dlrmctl.train.factory import build_model
from dlrmctl.metrics import compute_metrics_from_logits
from dlrmctl.train.run_dir import TrainError


def load_trained_model(run_dir: str, device: str = "cpu", compute_kernel: str | None = "dense",
                       checkpoint: str | None = "last", materialize: bool = True):
    """``(cfg, model, meta)`` of :func:`load_trained_model_with_checkpoint` (same arguments, errors)."""
    return load_trained_model_with_checkpoint(run_dir, device, compute_kernel, checkpoint, materialize)[:3]


def load_trained_model_with_checkpoint(run_dir: str, device: str = "cpu", compute_kernel: str | None = "dense",
                                       checkpoint: str | None = "last", materialize: bool = True):
    """Rebuild a trained model (unsharded) from a run directory's checkpoint: ``checkpoint`` is
    ``last`` (the newest), ``best`` (``train.keep_best``), a step, or None (best if any, else last).

    The model is built on the meta device (``build_model(device="meta")``: no table storage,
    no table init) and its dense part loaded; with ``materialize`` the tables are then
    allocated empty on ``device`` and loaded from the checkpoint (no random-init pass).

    Args:
        materialize: False: leave the tables on the meta device (the dense part is loaded, on
            the CPU); read them one at a time with :func:`load_table_weight` (what export does).

    Returns:
        ``(cfg, model, meta, checkpoint_meta, metadata)``: the resolved config, a DLRM with all
        tables assembled from the saved shards (float32, also from an fp16-table run), the
        training data's meta.json, and the checkpoint's verified meta.json (its
        ``weighted_features`` always set: :func:`dlrmctl.config.recorded_weighted_features`) and
        DCP ``.metadata`` (read once: :func:`load_table_weight` takes them).

    Raises:
        CheckpointError / TrainError: no config, meta or checkpoint in ``run_dir``; tables that
            differ from the checkpoint's.
        ConfigError: a checkpoint without a ``weighted_features`` record whose weighting cannot
            be told (:func:`dlrmctl.config.recorded_weighted_features`).
    """
    from dlrmctl.train.factory import materialize_model

    cfg = run_config(run_dir)
    mpath = os.path.join(run_dir, "data_meta.json")
    if not os.path.exists(mpath):
        raise TrainError(f"{mpath}: missing; the run directory is incomplete")
    with open(mpath) as f:
        meta = json.load(f)
    path, _ = ckpt.resolve_checkpoint(run_dir, checkpoint)
    cmeta = ckpt.load_checkpoint_meta(path)
    # the weighted features the run trained with (older checkpoints lack the record: refused where ambiguous)
    cmeta["weighted_features"] = recorded_weighted_features(cfg, cmeta.get("weighted_features"), meta,
                                                            os.path.join(path, "meta.json"))
    # the fp32 view of the tables whatever model.embedding_precision trained them in (fp16 weights
    # widen exactly): what evaluation, prediction and export (which quantizes from fp32) start from
    tables = [dataclasses.replace(t, data_type=DataType.FP32) for t in resolve_tables(cfg, meta)]
    model = build_model(cfg, tables, len(meta["dense_features"]), device="meta", compute_kernel=compute_kernel,
                        is_weighted=bool(cmeta["weighted_features"]), meta=meta)
    check_tables(cmeta, tables, path)
    req: dict[str, Any] = {}
    finish = None
    md = ckpt_load.read_metadata(path, cmeta)
    if materialize:
        materialize_model(model, device)
        req, finish = embedding_load_request(model, md)  # full tables, assembled from every saved shard
    dense = dense_state_dict(model)
    req.update({f"dense/{k}": v for k, v in dense.items()})
    req.update(managed_collision_state(model))  # the remappers (managed-collision tables), loaded in place
    ckpt.load_checkpoint(path, req, meta=cmeta, metadata=md)
    if finish is not None:
        finish()
    model.eval()
    return cfg, model, meta, cmeta, md


@torch.no_grad()
def load_table_weight(ckpt_dir: str, table: Any, meta: dict[str, Any] | None = None,
                      metadata: Any = None) -> torch.Tensor:
    """One table's weights ``[num_embeddings, embedding_dim]`` float32 (CPU), assembled from
    every saved shard of checkpoint ``ckpt_dir`` (any sharding); only that table's chunks are
    read.  Memory: the table, plus one read slab (``checkpoint.READ_SLAB_BYTES``).

    Args:
        table: the table's config (``name``, ``num_embeddings``, ``embedding_dim``).
        meta: the checkpoint's meta.json (:func:`~dlrmctl.train.checkpoint.load_checkpoint_meta`).
        metadata: its DCP metadata (:func:`~dlrmctl.train.checkpoint.read_metadata`), so a caller
            loading table after table reads and verifies ``.metadata`` once.

    Raises:
        CheckpointError: no such table, another shape, or a damaged file (named).
    """
    w = torch.empty(table.num_embeddings, table.embedding_dim)
    ckpt.load_checkpoint(ckpt_dir, {f"emb/{table.name}/weight": w}, meta=meta, metadata=metadata)
    return w


def run_config(run_dir: str) -> ExperimentConfig:
    """The resolved config a run recorded (``run_dir/config.yaml``).

    Raises:
        TrainError: no config.yaml (not a run directory).
    """
    from dlrmctl.config import config_from_dict
    from dlrmctl.yaml_file import read_yaml

    cpath = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cpath):
        raise TrainError(f"{run_dir}: no config.yaml; not a dlrmctl run directory")
    return config_from_dict(read_yaml(cpath, TrainError, "run's recorded config"), source=cpath)


@torch.no_grad()
def evaluate_run(run_dir: str, split: str = "val", data_dir: str | None = None, batch_size: int | None = None,
                 checkpoint: str | None = None, any_split: bool = False, progress: bool = False) -> dict[str, float]:
    """Metrics of a run's checkpoint on ``split`` of its data (or ``data_dir``), from the logits
    (:func:`~dlrmctl.metrics.compute_metrics_from_logits`, as ``Trainer.evaluate``).

    The data must be the data the run was trained on: its fingerprint (schema, vocabularies and
    split; without the split with ``any_split``) must equal the one of ``run_dir/data_meta.json``
    (:mod:`dlrmctl.data.fingerprint`).

    Args:
        checkpoint: ``best``, ``last`` or a step; None: best if the run kept one, else last.
        any_split: accept data whose split differs (same schema and vocabularies).
        progress: show evaluation progress (:class:`dlrmctl.console.Progress`).

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``.

    Raises:
        DataMismatchError: other data than the run's; DataError: ``split`` missing or empty.
    """
    return compute_metrics_from_logits(*run_logits(run_dir, split, data_dir, batch_size, checkpoint=checkpoint,
                                                   any_split=any_split, progress=progress))


def run_logits(run_dir: str, split: str = "val", data_dir: str | None = None, batch_size: int | None = None,
               checkpoint: str | None = None, any_split: bool = False,
               progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The logits and labels of a run's checkpoint on ``split``, in the split's row order (what
    :func:`evaluate_run` computes its metrics from; e.g. to pool the rows of several runs).

    Same arguments, data check and errors as :func:`evaluate_run`.

    Returns:
        ``(logits [n] float32, labels [n] float32)``.
    """
    from dlrmctl.data.fingerprint import PARTS, check_run_data, read_meta_json, split_rows

    data = data_dir or run_config(run_dir).data.path
    check_run_data(os.path.join(run_dir, "data_meta.json"), data, PARTS[:2] if any_split else PARTS,
                   hint="Evaluate on the data the run was trained on (--data DIR), or train on this data"
                        + ("" if any_split else "; --any-split accepts other rows with the same schema and vocabularies"))
    rows = split_rows(read_meta_json(os.path.join(data, "meta.json")), data, split)
    stage(f"reading the checkpoint {show_path(checkpoint)}" if checkpoint else "reading the checkpoint")
    cfg, model, meta, cmeta, _ = load_trained_model_with_checkpoint(run_dir, checkpoint=checkpoint)
    # each input feature once; no rank slice and no id check in the loader (the model applies on_invalid_id)
    loader = make_loader(cfg, meta_as_trained(meta, cmeta["weighted_features"]), split, data_dir=data,
                         batch_size=batch_size)
    stage(f"scoring {rows:,} rows of split '{split}' in {len(loader):,} batch(es)")
    logits, labels = [], []
    with Progress(len(loader), f"eval {split}", "batch", enabled=progress, every_s=cfg.train.progress_every_s,
                  final_line=False, leave=False) as bar, torch.no_grad():
        for batch in loader:
            logits.append(model(batch.dense_features, batch.sparse_features).squeeze(1).float().numpy())
            labels.append(batch.labels.numpy())
            bar.update(1)
    return np.concatenate(logits), np.concatenate(labels)
