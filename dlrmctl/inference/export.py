"""Export a trained DLRM as a self-contained inference artifact (+ manifest): the orchestration.

What is written is one of the formats of :mod:`dlrmctl.inference.formats` (each a
:class:`~dlrmctl.inference.formats.base.Format`: how it is built, saved, loaded and run):

    model_dir/model.pt2        torch.export program (default; :mod:`~dlrmctl.inference.formats.pt2`):
                               torch.export.load in any Python with torch, no dlrmctl / fbgemm_gpu
    model_dir/model_aoti.pt2   with --aot: its AOTInductor package (compiled CPU code + weights;
                               :mod:`~dlrmctl.inference.formats.aoti`); C++ loads it with
                               torch::inductor::AOTIModelPackageLoader (scripts/cpp_inference)
    model_dir/model.pt         with --torchscript instead of model.pt2: TorchScript on FBGEMM's TBE
                               (:mod:`~dlrmctl.inference.formats.torchscript`, its module contract)
    model_dir/manifest.json    everything needed to turn raw logs into inputs and to trust the scores
    model_dir/vocab/<f>.arrow  vocabularies of vocabulary-mapped features (copied from the data dir)

:func:`export_model` resolves the model into an :class:`~dlrmctl.inference.formats.base.ExportPlan`
(inputs, lookups, dense part, checks), has the format build it (tables quantized one at a time),
and writes the directory to a temporary sibling renamed into place, so a crash never leaves a
half-written ``model_dir``; :func:`export_run` does it for a checkpoint of a training run.
Loading is :mod:`dlrmctl.inference.exported` (re-exported here).

The manifest is :mod:`dlrmctl.inference.writer`'s (its fields documented there).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dlrmctl import outputs
from dlrmctl.console import show_path, stage
from dlrmctl.inference import writer
from dlrmctl.inference.artifact import AOTI_FILE, MANIFEST_FILE, MODEL_FILE, PROGRAM_FILE, ExportError
from dlrmctl.inference.exported import ExportedModel, evaluate_exported, load_exported, to_host
from dlrmctl.inference.formats import ARTIFACTS, FORMATS
from dlrmctl.inference.formats.base import ExportPlan, Format
from dlrmctl.inference.quantize import EMBEDDING_DTYPES
from dlrmctl.modules.embedding_configs import PoolingType
from dlrmctl.sparse import KeyedTensor

log = logging.getLogger("dlrmctl.export")

#: The export parity report builds the float model only up to this many bytes of float32 tables
#: (export itself holds one table at a time; see benchmarks/export.md, peak memory).
PARITY_FLOAT_BYTES = 1 << 30

__all__ = [
    "AOTI_FILE",
    "ExportError",
    "ExportOptions",
    "ExportResult",
    "ExportedModel",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "PROGRAM_FILE",
    "evaluate_exported",
    "export_model",
    "export_run",
    "load_exported",
    "to_host",
]


# ----------------------------------------------------------------------------- modules
class _DensePart(nn.Module):
    """Everything after the embedding lookup, over plain tensors (traceable).

    Forward: ``dense [B, D_in]`` float32, ``pooled [B, sum of feature dims]`` float32 (feature
    order of the EBC) -> logits ``[B, 1]`` float32.
    """

    def __init__(self, model: nn.Module, keys: Sequence[str], dims: Sequence[int]) -> None:
        super().__init__()
        self.dense_arch = model.dense_arch
        self.inter_arch = model.inter_arch
        self.over_arch = model.over_arch
        self.first_order = getattr(model, "first_order", None)
        self.dense_norm = getattr(model, "dense_norm", None)
        self._keys = list(keys)
        self._dims = list(dims)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.dense_norm is not None:  # model.dense_standardize: the train split's statistics
            dense = self.dense_norm(dense)
        d = self.dense_arch(dense)
        logits = self.over_arch(self.inter_arch(d, KeyedTensor(self._keys, self._dims, pooled)))
        if self.first_order is not None:  # model.first_order: the linear term (FirstOrder)
            logits = logits + self.first_order(dense, pooled)
        return logits


# ----------------------------------------------------------------------------- export
@dataclass
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        model_dir: the artifact directory.
        manifest: the manifest dict written to ``manifest.json``.
        embedding_bytes: bytes of embedding storage in the TBE (FBGEMM padding included).
        embedding_bytes_fp32: ``sum(rows * dim * 4)`` over tables.
    """

    model_dir: Path
    manifest: dict
    embedding_bytes: int
    embedding_bytes_fp32: int


@dataclass
class ExportOptions:
    """What :func:`export_model` writes, and what it records.

    Attributes:
        embedding_dtype: ``fp32`` | ``fp16`` | ``int8`` | ``int4``.
        artifact: a standalone format of :data:`~dlrmctl.inference.formats.FORMATS`: ``pt2``
            (default), the ``torch.export`` program ``model.pt2``; ``torchscript`` (legacy),
            ``model.pt`` on FBGEMM's IntNBit TBE.  Either way every embedding dim exports.
        aot: also the AOTInductor package ``model_aoti.pt2`` of the program (``pt2`` only) for
            C++ (``AOTIModelPackageLoader``); compiling takes tens of seconds.
        quantize_dense: dynamic int8 ``nn.Linear`` layers in the dense part (``torchscript`` only:
            torch.export cannot trace them; refused with ``pt2``).
        force: replace an existing ``out_dir`` (an export of ours only).
        on_invalid_id: ``error`` | ``zero``; default the EBC's own (``model.on_invalid_id``).
        weighted_features: features whose per-id weights the artifact uses (the features of
            ``weighted: true`` tables); default: every feature when the EBC is weighted
            (``is_weighted()``, TorchRec semantics), none otherwise.  The artifact then takes a
            ``weights`` input; a feature feeding several tables carries its weights to each.
        data_meta: the training data's meta.json (transforms, features, vocabularies), recorded
            in the manifest; without it the manifest has no preprocessing and ``predict`` on
            raw lines is refused (the tensor interface still works).
        data_dir: where ``data_meta["vocab_files"]`` live (copied into ``out_dir/vocab``).
        data_record: the training data's record, ``manifest["data"]``: ``{"meta", "fingerprint",
            "source"}`` (:mod:`dlrmctl.data.fingerprint`); the SHA-256 of every copied vocabulary
            file is added as ``vocab_sha256`` (``predict`` checks them).
        source: recorded as ``manifest["source"]`` (run dir, checkpoint, metrics).
        load_table: ``load_table(config) -> [rows, dim]`` float32 CPU tensor: the weights of
            one table (:class:`~dlrmctl.modules.embedding_configs.EmbeddingBagConfig`), called
            once per table in table order, the result dropped once quantized (e.g.
            :func:`dlrmctl.train.reload.load_table_weight`).  None: the model's own weights.
        multi_hot: the training loader's multi-hot expansion ``{"multi_hot_sizes": {feature:
            size}, "multi_hot_distribution", "multi_hot_seed"}`` (with ``data_meta`` for the rows
            and feature order); the ``pt2`` program expands one-hot ids itself.
        parity: ``parity(loaded ExportedModel) -> dict`` run on the finished artifact before it is
            swapped in (e.g. :func:`dlrmctl.inference.parity.parity_report`); its result is
            stored as ``manifest["parity"]``.
    """

    embedding_dtype: str = "int8"
    artifact: str = "pt2"
    aot: bool = False
    quantize_dense: bool = False
    force: bool = False
    on_invalid_id: str | None = None
    weighted_features: Sequence[str] | None = None
    data_meta: dict | None = None
    data_dir: str | os.PathLike | None = None
    data_record: dict | None = None
    source: dict | None = None
    load_table: Callable[[Any], torch.Tensor] | None = None
    multi_hot: dict | None = None
    parity: Callable[[Any], dict] | None = None

    def format(self) -> Format:
        """The format to write, the options checked against it.

        Raises:
            ExportError: an unknown dtype or artifact, or an option the format refuses.
        """
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ExportError(f"embedding dtype must be one of {list(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}")
        if self.artifact not in ARTIFACTS:
            raise ExportError(f"artifact must be one of {list(ARTIFACTS)}, got {self.artifact!r}")
        fmt = FORMATS[self.artifact]
        fmt.check_export(self.quantize_dense, self.aot)
        return fmt


def export_model(model: nn.Module, out_dir: str | os.PathLike, options: ExportOptions | None = None) -> ExportResult:
    """Write the inference artifact of ``model`` to ``out_dir`` (atomically), as ``options`` say.

    The tables are quantized one at a time straight into the artifact (in row chunks); only the
    dense part (MLPs, interaction) is copied.  Peak memory: the artifact plus, with
    ``options.load_table``, the largest float32 table.

    Args:
        model: a :class:`~dlrmctl.modules.dlrm.DLRM` whose ``sparse_arch`` is an unsharded
            EmbeddingBagCollection (``embedding_weights()``, ``embedding_bag_configs()``),
            possibly built on the ``meta`` device (``build_model(device="meta")``: tables
            without storage) when ``options.load_table`` gives the weights.
        out_dir: artifact directory (must not exist unless ``options.force``).
        options: :class:`ExportOptions` (default: int8, the ``pt2`` program).

    Returns:
        :class:`ExportResult`.

    Raises:
        RuntimeError: fbgemm_gpu is not installed (``torchscript``; no fallback).
        QuantizationError: NaN/inf weights (table and row named), fp16 overflow.
        ExportError: ``out_dir`` exists, a vocabulary file is missing, an untraceable dense part,
            an option the format refuses (``quantize_dense`` with ``pt2``, ``aot`` with
            ``torchscript``), ``weighted_features`` that are not
            the model's features or disagree with its EBC (weights given to an unweighted EBC, or
            none for a weighted one).
    """
    opts = options or ExportOptions()
    fmt = opts.format()
    out = Path(out_dir)
    writer.check_out(out, opts.force)
    plan, wf, lookup_keys, dense_mode = _plan(model, opts, fmt)
    stage(f"reading and quantizing {len(plan.tables)} tables to {opts.embedding_dtype}")
    built = fmt.build(plan)
    manifest = writer.build_manifest(fmt, plan, built, wf, lookup_keys, dense_mode, opts.data_record, opts.source)
    try:
        writer.write_artifact(out, fmt, manifest, built.saved, force=opts.force, data_meta=opts.data_meta,
                              data_dir=opts.data_dir, aot=opts.aot, parity=opts.parity)
    except OSError as e:
        err = outputs.place_error(e, out, "free space or --out a writable directory, then export again")
        if err is None:
            raise
        raise ExportError(str(err)) from None
    return ExportResult(out, manifest, built.stored_bytes, manifest["embedding_bytes"]["fp32"])


def _plan(model: nn.Module, opts: ExportOptions, fmt: Format) -> tuple[ExportPlan, list[str], list[str], str]:
    """``model`` resolved for ``fmt``: the :class:`ExportPlan`, the weighted features, the lookup
    keys (the EBC's output names) and the dense part's mode (``fp32`` | ``dynamic_int8``).
    Raises the :class:`ExportError` s of :func:`export_model` about the model."""
    ebc = model.sparse_arch
    if not hasattr(ebc, "embedding_bag_configs"):
        raise ExportError(f"model.sparse_arch is a {type(ebc).__name__}; export needs an unsharded EmbeddingBagCollection")
    tables = list(ebc.embedding_bag_configs())
    weights = ebc.embedding_weights()
    mc = getattr(ebc, "managed_collision", None)
    fmt.check_tables(mc.tables() if mc is not None else [])
    # inputs: each feature once; lookups: one per (table, feature), keyed like the EBC's outputs
    feature_names = list(dict.fromkeys(f for t in tables for f in t.feature_names))
    lookup_keys = list(ebc.embedding_names()) if hasattr(ebc, "embedding_names") else \
        [f for t in tables for f in t.feature_names]
    lookup_src = [feature_names.index(f) for t in tables for f in t.feature_names]
    policy = opts.on_invalid_id or getattr(ebc, "on_invalid_id", "error")
    if policy not in ("error", "zero"):
        raise ExportError(f"on_invalid_id must be 'error' or 'zero', got {policy!r}")
    ebc_weighted = bool(ebc.is_weighted()) if hasattr(ebc, "is_weighted") else False
    wf = list(feature_names if ebc_weighted else []) if opts.weighted_features is None else list(opts.weighted_features)
    unknown = [f for f in wf if f not in feature_names]
    if unknown:
        raise ExportError(f"weighted_features {unknown} are not features of the model ({feature_names})")
    if bool(wf) != ebc_weighted:
        raise ExportError(
            f"the model's EmbeddingBagCollection is {'weighted' if ebc_weighted else 'unweighted'} but "
            f"weighted_features is {wf}; export the features of its weighted tables (model.tables[].weighted)"
        )
    if opts.load_table is None:
        on_meta = [t.name for t in tables if weights[t.name].is_meta]
        if on_meta:
            raise ExportError(f"tables {on_meta} are on the meta device (no weights): pass load_table, "
                              "or materialize the model and load its checkpoint first")
    dims = [t.embedding_dim for t in tables for _ in t.feature_names]
    num_dense = model.dense_arch.model.model[0].in_features
    # only the dense part is copied (never the tables: they may be on the meta device)
    dense_only = nn.ModuleDict(model.dense_parts())
    part: nn.Module = _DensePart(copy.deepcopy(dense_only).cpu().eval(), lookup_keys, dims)
    dense_mode = "fp32"
    if opts.quantize_dense:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
            part = torch.ao.quantization.quantize_dynamic(part, {nn.Linear}, dtype=torch.qint8)
        dense_mode = "dynamic_int8"
    load_table = opts.load_table

    def table_weight(t: Any) -> torch.Tensor:  # table t's float weights (from load_table or the model), shape-checked
        w = load_table(t) if load_table is not None else weights[t.name]
        if tuple(w.shape) != (t.num_embeddings, t.embedding_dim):
            raise ExportError(f"table '{t.name}': weight shape {tuple(w.shape)} != ({t.num_embeddings}, {t.embedding_dim})")
        return w

    per_lookup = [t for t in tables for _ in t.feature_names]
    plan = ExportPlan(
        tables=tables, table_weight=table_weight, embedding_dtype=opts.embedding_dtype, dense_part=part,
        feature_names=feature_names, num_dense=num_dense,
        lookup_table=[i for i, t in enumerate(tables) for _ in t.feature_names], lookup_src=lookup_src,
        lookup_dims=dims, lookup_rows=[t.num_embeddings for t in per_lookup],
        lookup_mean=[t.pooling == PoolingType.MEAN for t in per_lookup], lookup_tables=[t.name for t in per_lookup],
        lookup_features=[f for t in tables for f in t.feature_names], on_invalid_id=policy,
        feature_weighted=[f in wf for f in feature_names], multi_hot=opts.multi_hot, data_meta=opts.data_meta,
        managed_collision=mc)
    return plan, wf, lookup_keys, dense_mode


def _last_eval_metrics(run_dir: Path) -> dict | None:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return None
    last = None
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "eval":
            last = rec
    return last


def export_run(
    run_dir: str | os.PathLike,
    embedding_dtype: str = "int8",
    out_dir: str | os.PathLike | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    quantize_dense: bool = False,
    force: bool = False,
    checkpoint: str | None = None,
    artifact: str = "pt2",
    aot: bool = False,
    parity_split: str | None = "val",
) -> ExportResult:
    """Export a checkpoint of a training run (``dlrmctl export``): ``checkpoint`` ``best``, ``last``,
    a step, or None (best when the run kept one, else last).

    The vocabularies are copied from ``data_dir`` (default the run's ``data.path``), whose schema
    and vocabulary fingerprint must equal the one the run recorded (``data_meta.json``); the
    manifest's ``data`` entry records that fingerprint for ``evaluate`` and ``predict``.

    The model is built on the meta device and its tables are read from the checkpoint one at a
    time, each quantized into the artifact and dropped before the next is read
    (:func:`~dlrmctl.train.reload.load_table_weight`): peak memory is about the largest float32
    table (plus DCP's read buffer of its saved chunk) plus the artifact, not the whole model.

    Args:
        run_dir: ``runs/<name>`` (config.yaml, data_meta.json, checkpoints/).
        embedding_dtype: ``fp32`` | ``fp16`` | ``int8`` | ``int4``.
        out_dir: default ``<run_dir>/export-<dtype>`` (``-dq`` appended with ``quantize_dense``).
        data_dir: preprocessed data dir holding the vocabularies (default: the run's ``data.path``).
        quantize_dense, force, artifact, aot: see :class:`ExportOptions`.
        parity_split: split of ``data_dir`` for the parity report (AUC / logloss vs the float
            model, max |Δlogit|, latency; :func:`dlrmctl.inference.parity.parity_report`) stored
            in the manifest; None, or data without that split: latency only, on synthetic ids.

    Raises:
        TrainError / CheckpointError: not a run directory, no such checkpoint, or the chosen
            checkpoint was pruned by the run while it was read (after one re-resolve of best / last,
            see :func:`dlrmctl.train.checkpoint.read_checkpoint`).
        DataMismatchError: ``data_dir`` holds other data than the run was trained on.
        plus everything :func:`export_model` raises.
    """
    wanted = ExportOptions(embedding_dtype, artifact=artifact, aot=aot, quantize_dense=quantize_dense, force=force)
    wanted.format()  # its refusals (and FBGEMM for --torchscript) before the run is read
    from dlrmctl.data.fingerprint import check_run_data, data_fingerprint
    from dlrmctl.train.checkpoint import read_checkpoint
    from dlrmctl.train.data import multi_hot_kwargs
    from dlrmctl.train.reload import load_table_weight, load_trained_model_with_checkpoint, run_config

    run = Path(run_dir)
    vocab_dir = Path(data_dir or run_config(str(run)).data.path)
    recorded = run / "data_meta.json"
    if (vocab_dir / "meta.json").is_file():  # the vocabularies to copy are the run's
        check_run_data(recorded, vocab_dir, ("schema", "vocabulary"),
                       hint="Pass --data DIR with the data the run was trained on")
        stage(f"checking the files export reads from {show_path(vocab_dir)} (SHA-256)")
        _verify_data_files(vocab_dir, parity_split)

    def export_from(ckpt_path: str, which: str) -> ExportResult:
        stage(f"reading the checkpoint {show_path(ckpt_path)}, {which}")
        # tables on the meta device: each is read from the checkpoint only when export quantizes it
        # the checkpoint's meta.json and .metadata: read and verified once, for the dense part and every table
        cfg, model, meta, cmeta, dcp_md = load_trained_model_with_checkpoint(
            str(run), device="cpu", compute_kernel="dense", checkpoint=ckpt_path, materialize=False)
        out = Path(out_dir) if out_dir is not None else run / (f"export-{embedding_dtype}" + ("-dq" if quantize_dense else ""))
        ck_eval = cmeta.get("eval")
        source = {
            "run_dir": str(run.resolve()),
            "name": cfg.name,
            "checkpoint": ckpt_path,
            "checkpoint_choice": which,
            "metrics": ck_eval if ck_eval is not None else _last_eval_metrics(run),
            "data_path": cfg.data.path,
            # the training loader's on-the-fly multi-hot expansion: evaluate_exported repeats it
            "multi_hot": {k: v for k, v in multi_hot_kwargs(cfg, meta).items() if k.startswith("multi_hot")},
        }
        data_record = {"meta": meta, "fingerprint": data_fingerprint(meta), "source": str(recorded)}
        from dlrmctl.inference.parity import parity_report

        fp32_total = sum(t.num_embeddings * t.embedding_dim * 4 for t in model.sparse_arch.embedding_bag_configs())

        def reference() -> nn.Module:  # the float model: this checkpoint, its tables materialised
            return load_trained_model_with_checkpoint(str(run), device="cpu", compute_kernel="dense",
                                                      checkpoint=ckpt_path)[1]

        def parity(m: ExportedModel) -> dict:
            return parity_report(m, reference if fp32_total <= PARITY_FLOAT_BYTES else None,
                                 vocab_dir if parity_split else None, parity_split or "val", source["multi_hot"])

        return export_model(model, out, replace(
            wanted, data_meta=meta, data_dir=vocab_dir, source=source, weighted_features=cmeta["weighted_features"],
            data_record=data_record, load_table=lambda t: load_table_weight(ckpt_path, t, cmeta, dcp_md),
            multi_hot=source["multi_hot"], parity=parity))

    # read_checkpoint: a checkpoint the run prunes (keep_last) meanwhile is re-resolved / named as pruned
    return read_checkpoint(str(run), checkpoint, export_from)


def _verify_data_files(data_dir: Path, parity_split: str | None) -> None:
    """Before the checkpoint is read: the bytes export takes from the dataset (the vocabulary files
    it copies into the artifact, the shards of the parity split) are those meta.json's checksums
    record (:func:`dlrmctl.data.checksums.verify_files`; the checkpoint's own blocks are verified
    as they are read).

    Raises:
        DataMismatchError: a file is missing, or its size or SHA-256 differs, naming it.
    """
    from dlrmctl.data.checksums import verify_files
    from dlrmctl.data.fingerprint import DataMismatchError, read_meta_json

    meta = read_meta_json(data_dir / "meta.json", "data")
    files = [f for f in (meta.get("vocab_files") or {}).values() if isinstance(f, str)]
    split = (meta.get("splits") or {}).get(parity_split) if parity_split else None
    if isinstance(split, dict):
        files += [f for f in (split.get("files") or []) if isinstance(f, str)]
    verify_files(data_dir, meta, files, DataMismatchError)
