"""Export a trained DLRM as a self-contained inference artifact (torch.export program or
TorchScript, + manifest).

Artifact layout (``model_dir``)::

    model_dir/model.pt2        torch.export program (default; :mod:`dlrmctl.inference.program`):
                               torch.export.load in any Python with torch, no dlrmctl / fbgemm_gpu
    model_dir/model_aoti.pt2   with --aot: its AOTInductor package (compiled CPU code + weights);
                               C++ loads it with torch::inductor::AOTIModelPackageLoader
                               (scripts/cpp_inference), Python with torch._inductor.aoti_load_package
    model_dir/model.pt         with --torchscript instead of model.pt2: the TorchScript module below
                               (torch.jit.save); loads in Python or C++ libtorch once FBGEMM's
                               operator libraries are loaded (fbgemm_gpu_py.so & co.)
    model_dir/manifest.json    everything needed to turn raw logs into inputs and to trust the scores
    model_dir/vocab/<f>.arrow  vocabularies of vocabulary-mapped features (copied from the data dir)

The scripted module's ``forward(dense, values, lengths, weights=None) -> scores``:

* ``dense``  ``[B, D_in]`` float32 (already transformed, e.g. log(x+1));
* ``values`` ``[N]`` int64 ids of all bags, key-major in ``manifest["sparse_features"]`` order;
* ``lengths`` ``[F*B]`` int64 bag lengths, key-major (``[f0_b0..f0_b{B-1}, f1_b0, ...]``);
* ``weights`` ``[N]`` float32 per-id weights, aligned with ``values`` -- only for a model with
  weighted features (``manifest["weighted_features"]``, from ``model.tables[].weighted``): there
  it is required, and the entries of features of unweighted tables are ignored (taken as 1.0).
  A model without weighted features takes the same three inputs as before (``weights`` left out
  or None) and refuses weights;
* returns ``[B]`` float32 click probabilities ``sigmoid(logit)``.

Pooling is ``sum_i w_i e_{id_i}`` (mean: divided by the bag length), the TBE's
``per_sample_weights``, as in training.  ``logits(...)`` takes the same inputs and returns the
logits; ``embeddings(values, lengths, weights=None)`` returns the pooled embeddings
``[B, sum of lookup dims]`` (one per (table, feature) lookup, ``B = len(lengths) / F``).

It raises (``RuntimeError`` from TorchScript, message naming the feature and sample) on a wrong
dense width, ``len(lengths) != F*B``, ``sum(lengths) != len(values)``, weights missing for a
weighted model, given to an unweighted one, or not ``[N]`` float32, or -- under the model's
``on_invalid_id: error`` -- an id outside its table (message naming the table too); under
``on_invalid_id: zero`` such an id is dropped from its bag, its weight with it (the rule of
:mod:`dlrmctl.sparse.validation`, the same as training and the eager model).

A feature looked up in several tables (outputs ``feature@table``) is one input key: the module
feeds its bags (and their weights) to each of its tables (checked against each table's own rows).
``logits(dense, values, lengths, weights=None)`` (``@torch.jit.export``) returns the logits ``[B]``
float32.

Embeddings live in one FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` in the requested
storage (fp32 / fp16 / int8 / int4 row-wise, see :mod:`dlrmctl.inference.quantize`); the dense
part (dense arch, interaction, over arch) is fp32, traced with ``torch.jit.trace`` (works for the
dot, DCN and projection interactions), or dynamic-int8 on its ``nn.Linear`` layers
(``torch.ao.quantization.quantize_dynamic``) with ``quantize_dense=True``.

There is no pure-torch fallback: without fbgemm_gpu, export and loading fail with a message
saying so (:func:`dlrmctl.inference.quantize.require_fbgemm`).

The artifact directory is written to a temporary sibling and renamed into place, so a crash
never leaves a half-written ``model_dir``.

MANIFEST (``manifest.json``, ``format_version`` 1)::

    {"format_version": 1, "model_file": "model.pt", "model_bytes": n, "model_sha256": "...",
     "inputs": {...shapes/dtypes as above...}, "output": {...},
     "dense_features": ["I1", ...], "sparse_features": ["C1", ...],     # input order
     "weighted_features": ["C1", ...],    # features whose per-id weights are used ([]: no weights input)
     "tables": [{"name", "features", "num_embeddings", "embedding_dim", "pooling", "weighted", "dtype",
                 "row_bytes", "bytes",
                 "ids": "index" | "raw"}, ...],   # raw: a managed-collision table, inputs are raw 64-bit ids
     "lookups": [{"key": "C1" | "C1@t1", "feature", "table"}, ...],   # pooled outputs, in order
     "on_invalid_id": "error" | "zero",
     "quantization": {"embeddings": "int8", "dense": "fp32" | "dynamic_int8", "scale_bias": "fp16",
                      "formula": "...", "source": "..."},
     "embedding_bytes": {"stored": n, "fp32": m, "ratio": n/m},
     "preprocessing": {"dataset", "dense_features", "sparse_features", "label", "transforms",
                       "sparse": [{"name", "num_embeddings", ...}], "vocab_files": {"C1": "vocab/C1.arrow"}},
     "data": {"meta": training data meta.json, "fingerprint": {"schema", "vocabulary", "split", "all"},
              "source": "runs/<name>/data_meta.json", "vocab_sha256": {"vocab/C1.arrow": "..."}},
     "source": {"run_dir", "name", "checkpoint", "checkpoint_choice", "metrics"},
     "versions": {"dlrmctl", "torch", "fbgemm_gpu"}, "created": "ISO-8601"}
"""

from __future__ import annotations

import copy
import datetime
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn

from dlrmctl import outputs
from dlrmctl.console import stage
from dlrmctl.errors import UserError
from dlrmctl.inference.quantize import (
    EMBEDDING_DTYPES,
    TBE_DIM_ALIGN,
    empty_intnbit_tbe,
    pad_columns,
    padded_dim,
    quantize_table,
    require_fbgemm,
    tbe_row_bytes,
    tbe_storage_bytes,
    write_intnbit_table,
)
from dlrmctl.modules.embedding_configs import PoolingType
from dlrmctl.sparse import KeyedTensor

log = logging.getLogger("dlrmctl.export")

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.pt"  # TorchScript (--torchscript)
PROGRAM_FILE = "model.pt2"  # torch.export program (default)
AOTI_FILE = "model_aoti.pt2"  # AOTInductor package (--aot)
ARTIFACTS = ("pt2", "torchscript")
#: The export parity report builds the float model only up to this many bytes of float32 tables
#: (export itself holds one table at a time; see benchmarks/export.md, peak memory).
PARITY_FLOAT_BYTES = 1 << 30

__all__ = [
    "ExportError",
    "ExportResult",
    "ExportedModel",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "PROGRAM_FILE",
    "AOTI_FILE",
    "evaluate_exported",
    "export_model",
    "export_run",
    "load_exported",
    "to_host",
]


class ExportError(RuntimeError, UserError):
    """Export or artifact loading failed for a reason the user can fix (message says how)."""


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


class ExportedDLRM(nn.Module):
    """The scripted inference module: ``(dense, values, lengths[, weights]) -> scores [B]`` (see module doc).

    Args:
        tbe: FBGEMM IntNBit TBE, one feature per lookup (``feature_table_map`` applied).
        dense_part: traced :class:`_DensePart` (fp32 or dynamic-int8).
        feature_names: sparse features in input order (``F``).
        feature_rows: rows of each lookup's table ``[L]`` (a lookup = one (table, feature)).
        feature_dims: dims of each lookup's table in the TBE ``[L]`` (padded to its alignment).
        feature_mean: per lookup, mean pooling (divide by the bag's valid ids; empty bag -> 0).
        num_dense: ``D_in``.
        lookup_src: input feature index of each lookup (default: lookup ``i`` reads feature ``i``).
        lookup_tables: table name of each lookup (for messages).
        on_invalid_id: ``error`` | ``zero`` (see :mod:`dlrmctl.sparse.validation`).
        feature_weighted: per input feature (``F``), its per-id weights are used (default:
            none; then the module takes no weights).  A feature feeding several tables is
            weighted in all of them or in none (config validation).
        keep_cols: the TBE output columns of the real dims, when tables were padded (the
            pooled output ``[B, sum padded dims]`` is sliced to them); None: no padding.
    """

    def __init__(
        self,
        tbe: nn.Module,
        dense_part: nn.Module,
        feature_names: Sequence[str],
        feature_rows: Sequence[int],
        feature_dims: Sequence[int],
        feature_mean: Sequence[bool],
        num_dense: int,
        lookup_src: Sequence[int] | None = None,
        lookup_tables: Sequence[str] | None = None,
        on_invalid_id: str = "error",
        feature_weighted: Sequence[bool] | None = None,
        keep_cols: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.tbe = tbe
        self.dense_part = dense_part
        self.feature_names = list(feature_names)
        self.num_features = len(self.feature_names)
        src = list(range(len(feature_rows))) if lookup_src is None else list(lookup_src)
        self.num_lookups = len(src)
        self.expand = src != list(range(self.num_features))
        self.lookup_features = [self.feature_names[i] for i in src]
        self.lookup_tables = list(lookup_tables) if lookup_tables is not None else ["?"] * len(src)
        self.zero_invalid = on_invalid_id == "zero"
        self.num_dense = num_dense
        self.any_mean = any(feature_mean)
        self.register_buffer("lookup_src", torch.tensor(src, dtype=torch.int64))
        fw = [bool(x) for x in feature_weighted] if feature_weighted is not None else [False] * self.num_features
        self.weighted_names = str([f for f, w in zip(self.feature_names, fw) if w])  # for messages
        self.is_weighted = any(fw)
        self.all_weighted = all(fw)
        self.register_buffer("feature_rows", torch.tensor(list(feature_rows), dtype=torch.int64))
        self.register_buffer("feature_dims", torch.tensor(list(feature_dims), dtype=torch.int64))
        self.register_buffer("feature_mean", torch.tensor(list(feature_mean), dtype=torch.bool))
        self.register_buffer("feature_weighted", torch.tensor(fw, dtype=torch.bool))
        # tables padded to the TBE's dim alignment: the pooled columns of the real dims
        self.sliced = keep_cols is not None
        self.register_buffer("keep_cols", torch.tensor(list(keep_cols or []), dtype=torch.int64))

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, values, lengths, weights))

    @torch.jit.export
    def logits(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Same inputs as ``forward``; returns the logits ``[B]`` float32."""
        if dense.dim() != 2 or dense.size(1) != self.num_dense:
            raise ValueError(
                "dense must be [B, " + str(self.num_dense) + "] float32, got shape " + str(list(dense.shape))
            )
        if dense.dtype != torch.float32:
            raise ValueError("dense must be float32, got " + str(dense.dtype))
        pooled = self._pool(values, lengths, weights, dense.size(0))
        return self.dense_part(dense, pooled).reshape(-1)

    @torch.jit.export
    def embeddings(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of lookup dims]`` (lookup order: one per (table, feature), as
        the EBC's outputs), ``B = len(lengths) / F``; ``on_invalid_id`` applies."""
        if self.num_features == 0 or lengths.numel() % self.num_features != 0:
            raise ValueError(
                "lengths must have num_features * B entries (num_features = " + str(self.num_features)
                + "), got " + str(lengths.numel())
            )
        return self._pool(values, lengths, weights, lengths.numel() // self.num_features)

    def _pool(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor], B: int) -> torch.Tensor:
        if values.dtype != torch.int64 or lengths.dtype != torch.int64:
            raise ValueError("values and lengths must be int64")
        if lengths.numel() != self.num_features * B:
            raise ValueError(
                "lengths must have num_features * B = " + str(self.num_features) + " * " + str(B)
                + " entries (key-major), got " + str(lengths.numel())
            )
        if values.numel() != int(lengths.sum()):
            raise ValueError(
                "sum(lengths) = " + str(int(lengths.sum())) + " != len(values) = " + str(values.numel())
            )
        if bool((lengths < 0).any()):
            raise ValueError("lengths must be >= 0")
        per_sample: Optional[torch.Tensor] = None
        if weights is None:
            if self.is_weighted:
                raise ValueError(
                    "this model has weighted features " + self.weighted_names + ": pass weights [N] float32, "
                    "one per id aligned with values (entries of the other features are ignored)"
                )
        else:
            if not self.is_weighted:
                raise ValueError(
                    "this model has no weighted features (it was trained without per-id weights); "
                    "it takes no weights, they would be ignored"
                )
            if weights.dtype != torch.float32 or weights.dim() != 1 or weights.numel() != values.numel():
                raise ValueError(
                    "weights must be [N] float32 with N = len(values) = " + str(values.numel()) + ", got shape "
                    + str(list(weights.shape)) + " " + str(weights.dtype)
                )
            per_sample = weights
            if not self.all_weighted:  # features of unweighted tables: weight 1.0
                mask = torch.repeat_interleave(torch.repeat_interleave(self.feature_weighted, B), lengths)
                per_sample = torch.where(mask, weights, torch.ones_like(weights))
        if self.expand:  # one key per lookup: a feature feeding several tables is repeated (its weights too)
            lengths2d = lengths.view(self.num_features, B)
            key_len = lengths2d.sum(1)
            key_start = torch.cumsum(key_len, 0) - key_len
            seg_len = key_len[self.lookup_src]
            seg_start = key_start[self.lookup_src]
            out_start = torch.cumsum(seg_len, 0) - seg_len
            n = int(seg_len.sum())
            idx = torch.repeat_interleave(seg_start - out_start, seg_len) + torch.arange(n, dtype=torch.int64, device=values.device)
            values = values[idx]
            if per_sample is not None:
                per_sample = per_sample[idx]
            lengths = lengths2d[self.lookup_src].reshape(-1)
        if values.numel() > 0:
            limit = torch.repeat_interleave(torch.repeat_interleave(self.feature_rows, B), lengths)
            bad = (values < 0) | (values >= limit)
            if bool(bad.any()):
                if self.zero_invalid:  # drop the id (and its weight) from its bag (a mean counts the valid ids)
                    bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64, device=lengths.device), lengths)
                    lengths = lengths - torch.bincount(bag_of[bad], minlength=lengths.numel())
                    values = values[~bad]
                    if per_sample is not None:
                        per_sample = per_sample[~bad]
                else:
                    i = int(torch.nonzero(bad)[0])
                    ends = torch.cumsum(lengths, 0)
                    bag = int(torch.searchsorted(ends, torch.tensor([i], dtype=ends.dtype), right=True)[0])
                    f = bag // B
                    raise ValueError(
                        "table '" + self.lookup_tables[f] + "', feature '" + self.lookup_features[f] + "', sample "
                        + str(bag % B) + ": id " + str(int(values[i])) + " is out of range; expected 0 <= id < "
                        + str(int(self.feature_rows[f]))
                    )
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        pooled = self.tbe(values, offsets, per_sample)
        if self.any_mean:
            lens = lengths.view(self.num_lookups, B).t().to(pooled.dtype)
            div = torch.where(self.feature_mean, lens.clamp(min=1.0), torch.ones_like(lens))
            pooled = pooled / torch.repeat_interleave(div, self.feature_dims, dim=1)
        if self.sliced:
            pooled = pooled.index_select(1, self.keep_cols)
        return pooled


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


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    import dlrmctl

    fb = None
    for d in ("fbgemm-gpu-cpu", "fbgemm-gpu"):
        try:
            fb = md.version(d)
            break
        except md.PackageNotFoundError:
            continue
    return {"dlrmctl": dlrmctl.__version__, "torch": torch.__version__, "fbgemm_gpu": fb}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    return h.hexdigest()


@contextmanager
def _atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` (:func:`dlrmctl.outputs.make_temp_dir`); on success
    swap it in at ``out`` (replacing an existing ``out`` only with ``force`` and only when it is an
    export of ours, :func:`dlrmctl.outputs.check_replaceable`); on any failure remove it, the old
    ``out`` untouched.  Temporaries of killed exports to ``out`` are reclaimed first."""
    _check_out(out, force)
    outputs.reclaim_stale(out)
    tmp = outputs.make_temp_dir(out, "export")
    try:
        yield tmp
        outputs.finish_marker(tmp, "export")
        _check_out(out, force)  # again: it may have appeared meanwhile
        outputs.swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_out(out: Path, force: bool) -> None:
    """``out`` may receive a new export: absent, or (with ``force``) an export of ours.

    Raises:
        ExportError: ``out`` exists (without ``force``), is a training run, or may not be replaced.
    """
    if not os.path.lexists(out):
        return
    if outputs.kind_of(out) == "run":
        raise ExportError(f"{out} is a training run directory, not an export; --out another directory "
                          "(--force never replaces a run)")
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it or --out another directory")
    try:
        outputs.check_replaceable(out, "export", "--force", "--out another directory")
    except outputs.OutputError as e:
        raise ExportError(str(e)) from None


def _write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` from Python in 4 MiB chunks (a full disk is an ``OSError`` here,
    not an abort inside the C++ writer), flushed to disk."""
    with open(path, "wb") as f:
        view = memoryview(data)
        for i in range(0, len(view), 1 << 22):
            f.write(view[i:i + (1 << 22)])
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def _quiet_jit() -> Iterator[None]:
    """Silence torch 2.13's DeprecationWarnings on torch.jit.script / trace / load.

    TorchScript stays available (``--torchscript``): C++ libtorch loads it without a compiler at
    export time, where ``--aot`` compiles the torch.export program to a package with the system
    C++ compiler.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _trace_dense(part: _DensePart, num_dense: int, pooled_width: int) -> torch.jit.ScriptModule:
    """Trace the dense part at B=4 and verify it at B=3 (catches batch-size-specialised traces)."""
    g = torch.Generator().manual_seed(0)
    ex = (torch.randn(4, num_dense, generator=g), torch.randn(4, pooled_width, generator=g))
    with torch.no_grad(), warnings.catch_warnings():
        # KeyedTensor's width check compares python ints: harmless constant in the trace
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # see _quiet_jit
        traced = torch.jit.trace(part, ex, check_trace=False)
        chk = (torch.randn(3, num_dense, generator=g), torch.randn(3, pooled_width, generator=g))
        want, got = part(*chk), traced(*chk)
    if want.shape != got.shape or not torch.allclose(want, got, rtol=1e-5, atol=1e-6):
        raise ExportError(
            "the traced dense part does not reproduce the model at another batch size; the interaction "
            f"({type(part.inter_arch).__name__}) is not traceable"
        )
    return traced


def export_model(
    model: nn.Module,
    out_dir: str | os.PathLike,
    embedding_dtype: str = "int8",
    *,
    data_meta: dict | None = None,
    data_dir: str | os.PathLike | None = None,
    source: dict | None = None,
    quantize_dense: bool = False,
    force: bool = False,
    on_invalid_id: str | None = None,
    weighted_features: Sequence[str] | None = None,
    data_record: dict | None = None,
    load_table: Callable[[Any], torch.Tensor] | None = None,
    artifact: str = "pt2",
    aot: bool = False,
    multi_hot: dict | None = None,
    parity: Callable[[Any], dict] | None = None,
) -> ExportResult:
    """Write the inference artifact of ``model`` to ``out_dir`` (atomically).

    The tables are quantized one at a time straight into the artifact's TBE (in row chunks,
    :func:`~dlrmctl.inference.quantize.write_intnbit_table`); only the dense part (MLPs,
    interaction) is copied.  Peak memory: the artifact plus, with ``load_table``, the largest
    float32 table.

    Args:
        model: a :class:`~dlrmctl.modules.dlrm.DLRM` whose ``sparse_arch`` is an unsharded
            EmbeddingBagCollection (``embedding_weights()``, ``embedding_bag_configs()``),
            possibly built on the ``meta`` device (``build_model(device="meta")``: tables
            without storage) when ``load_table`` gives the weights.
        out_dir: artifact directory (must not exist unless ``force``).
        embedding_dtype: ``fp32`` | ``fp16`` | ``int8`` | ``int4``.
        data_meta: the training data's meta.json (transforms, features, vocabularies), recorded
            in the manifest; without it the manifest has no preprocessing and ``predict`` on
            raw lines is refused (the tensor interface still works).
        data_dir: where ``data_meta["vocab_files"]`` live (copied into ``out_dir/vocab``).
        source: recorded as ``manifest["source"]`` (run dir, checkpoint, metrics).
        quantize_dense: dynamic int8 ``nn.Linear`` layers in the dense part (``torchscript`` only:
            torch.export cannot trace them; refused with ``pt2``).
        force: replace an existing ``out_dir``.
        on_invalid_id: ``error`` | ``zero``; default the EBC's own (``model.on_invalid_id``).
        weighted_features: features whose per-id weights the artifact uses (the features of
            ``weighted: true`` tables); default: every feature when the EBC is weighted
            (``is_weighted()``, TorchRec semantics), none otherwise.  The artifact then takes a
            ``weights`` input (module docstring); a feature feeding several tables carries its
            weights to each of them.
        data_record: the training data's record, ``manifest["data"]``: ``{"meta", "fingerprint",
            "source"}`` (:mod:`dlrmctl.data.fingerprint`); the SHA-256 of every copied vocabulary
            file is added as ``vocab_sha256`` (``predict`` checks them).
        load_table: ``load_table(config) -> [rows, dim]`` float32 CPU tensor: the weights of
            one table (:class:`~dlrmctl.modules.embedding_configs.EmbeddingBagConfig`), called
            once per table in table order, the result dropped once quantized (e.g.
            :func:`dlrmctl.train.reload.load_table_weight`).  None: the model's own weights.
        artifact: ``pt2`` (default): a ``torch.export`` program, ``model.pt2``
            (:mod:`dlrmctl.inference.program`); ``torchscript`` (legacy): ``model.pt`` on FBGEMM's
            IntNBit TBE.  Either way every embedding dim exports: TBE tables are padded to
            :data:`~dlrmctl.inference.quantize.TBE_DIM_ALIGN` and the pooled output sliced back.
        aot: also an AOTInductor package ``model_aoti.pt2`` of the program (``pt2`` only) for
            C++ (``AOTIModelPackageLoader``); compiling takes tens of seconds.
        multi_hot: the training loader's multi-hot expansion ``{"multi_hot_sizes": {feature:
            size}, "multi_hot_distribution", "multi_hot_seed"}`` (with ``data_meta`` for the rows
            and feature order); the ``pt2`` program expands one-hot ids itself.
        parity: ``parity(loaded ExportedModel) -> dict`` run on the finished artifact before it is
            swapped in (e.g. :func:`dlrmctl.inference.parity.parity_report`); its result is
            stored as ``manifest["parity"]``.

    Returns:
        :class:`ExportResult`.

    Raises:
        RuntimeError: fbgemm_gpu is not installed (no fallback).
        QuantizationError: NaN/inf weights (table and row named), fp16 overflow.
        ExportError: ``out_dir`` exists, a vocabulary file is missing, an untraceable dense part,
            ``quantize_dense`` with the ``pt2`` artifact,
            ``weighted_features`` that are not the model's features or disagree with its EBC
            (weights given to an unweighted EBC, or none for a weighted one).
    """
    if embedding_dtype not in EMBEDDING_DTYPES:
        raise ExportError(f"embedding dtype must be one of {list(EMBEDDING_DTYPES)}, got {embedding_dtype!r}")
    if artifact not in ARTIFACTS:
        raise ExportError(f"artifact must be one of {list(ARTIFACTS)}, got {artifact!r}")
    if aot and artifact != "pt2":
        raise ExportError("--aot compiles the torch.export program; it cannot be combined with --torchscript")
    if quantize_dense and artifact == "pt2":  # torch.export cannot trace the dynamic-int8 Linear's packed params
        raise ExportError("--quantize-dense makes the MLPs' nn.Linear dynamic int8 (torch.ao quantize_dynamic), "
                          "which torch.export cannot trace (its packed weights are a TorchScript class); add "
                          "--torchscript for a dynamic-int8 dense part, or drop --quantize-dense for the "
                          "torch.export program")
    if artifact == "torchscript":
        require_fbgemm("dlrmctl export")  # --torchscript: FBGEMM TBE
    out = Path(out_dir)
    _check_out(out, force)
    ebc = model.sparse_arch
    if not hasattr(ebc, "embedding_bag_configs"):
        raise ExportError(f"model.sparse_arch is a {type(ebc).__name__}; export needs an unsharded EmbeddingBagCollection")
    tables = list(ebc.embedding_bag_configs())
    weights = ebc.embedding_weights()
    mc = getattr(ebc, "managed_collision", None)
    if mc is not None and artifact != "pt2":
        raise ExportError(f"managed-collision tables {mc.tables()} export as the .pt2 program only (it maps raw "
                          "ids to rows with searchsorted); drop --torchscript")
    # inputs: each feature once; lookups: one per (table, feature), keyed like the EBC's outputs
    feature_names = list(dict.fromkeys(f for t in tables for f in t.feature_names))
    lookup_keys = list(ebc.embedding_names()) if hasattr(ebc, "embedding_names") else \
        [f for t in tables for f in t.feature_names]
    lookup_src = [feature_names.index(f) for t in tables for f in t.feature_names]
    policy = on_invalid_id or getattr(ebc, "on_invalid_id", "error")
    if policy not in ("error", "zero"):
        raise ExportError(f"on_invalid_id must be 'error' or 'zero', got {policy!r}")
    ebc_weighted = bool(ebc.is_weighted()) if hasattr(ebc, "is_weighted") else False
    wf = list(feature_names if ebc_weighted else []) if weighted_features is None else list(weighted_features)
    unknown = [f for f in wf if f not in feature_names]
    if unknown:
        raise ExportError(f"weighted_features {unknown} are not features of the model ({feature_names})")
    if bool(wf) != ebc_weighted:
        raise ExportError(
            f"the model's EmbeddingBagCollection is {'weighted' if ebc_weighted else 'unweighted'} but "
            f"weighted_features is {wf}; export the features of its weighted tables (model.tables[].weighted)"
        )
    if load_table is None:
        on_meta = [t.name for t in tables if weights[t.name].is_meta]
        if on_meta:
            raise ExportError(f"tables {on_meta} are on the meta device (no weights): pass load_table, "
                              "or materialize the model and load its checkpoint first")
    ftm = [i for i, t in enumerate(tables) for _ in t.feature_names]
    dims = [t.embedding_dim for t in tables for _ in t.feature_names]
    num_dense = model.dense_arch.model.model[0].in_features
    # only the dense part is copied (never the tables: they may be on the meta device)
    dense_only = nn.ModuleDict(model.dense_parts())
    part = _DensePart(copy.deepcopy(dense_only).cpu().eval(), lookup_keys, dims)
    dense_mode = "fp32"
    if quantize_dense:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
            part = torch.ao.quantization.quantize_dynamic(part, {nn.Linear}, dtype=torch.qint8)
        dense_mode = "dynamic_int8"
    lookup_rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lookup_mean = [t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names]
    lookup_tables = [t.name for t in tables for _ in t.feature_names]
    stage(f"reading and quantizing {len(tables)} tables to {embedding_dtype}")
    if artifact == "pt2":
        from dlrmctl.inference.program import InferenceProgram, export_program

        qtables = []
        for t in tables:  # one table at a time: load, quantize (int4 odd dims: one pad code), drop
            w = _table_weight(t, load_table, weights)
            pd = padded_dim(t.embedding_dim, 2) if embedding_dtype == "int4" else t.embedding_dim
            q = quantize_table(pad_columns(w.detach().cpu(), pd), embedding_dtype, t.name)
            q.embedding_dim = t.embedding_dim  # the program reads only the real columns
            qtables.append(q)
            del w
        program = InferenceProgram(
            qtables, ftm, lookup_src, lookup_mean, list(zip(lookup_tables, [f for t in tables for f in t.feature_names])),
            part, feature_names, num_dense, policy, [f in wf for f in feature_names],
            _multi_hot_tables(multi_hot, data_meta, feature_names),
            remap=None if mc is None else mc.inference_remap(feature_names))
        stage("tracing the program (torch.export)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                saved: Any = export_program(program, num_dense)
        except Exception as e:  # torch.export refusing the dense part (e.g. an untraceable custom interaction)
            raise ExportError(
                f"torch.export cannot trace this model ({type(e).__name__}: {str(e).strip().splitlines()[0]}); "
                "export it as TorchScript with --torchscript") from None
        stored = sum(_qtable_bytes(q) for q in qtables)
        row_align = 1
        kernel = ("torch.export program; lookups by fused embedding-bag kernels of torch (quantized:: "
                  "row-wise int8/int4, embedding_bag fp32, float32 gather-add fp16; dlrmctl.inference.lookups)")
    else:
        align = TBE_DIM_ALIGN[embedding_dtype]
        pdims = [padded_dim(t.embedding_dim, align) for t in tables]
        tbe = empty_intnbit_tbe([(t.name, t.num_embeddings, p, embedding_dtype) for t, p in zip(tables, pdims)],
                                ftm, "cpu")
        for i, t in enumerate(tables):  # one table at a time: load, quantize into the TBE, drop
            w = _table_weight(t, load_table, weights)
            write_intnbit_table(tbe, i, pad_columns(w.detach().cpu(), pdims[i]), embedding_dtype, t.name)
            del w
        lookup_pdims = [pdims[i] for i in ftm]
        keep = None
        if lookup_pdims != dims:  # padded: keep each lookup's first `dim` columns of its padded block
            starts = [sum(lookup_pdims[:i]) for i in range(len(dims))]
            keep = [s0 + c for s0, d in zip(starts, dims) for c in range(d)]
        traced = _trace_dense(part, num_dense, sum(dims))
        module = ExportedDLRM(
            tbe, traced, feature_names, lookup_rows, lookup_pdims, lookup_mean, num_dense, lookup_src,
            lookup_tables, policy, [f in wf for f in feature_names], keep,
        ).eval()
        stage("scripting the module (TorchScript)")
        with _quiet_jit():
            saved = torch.jit.script(module)
        stored = tbe_storage_bytes(tbe)
        row_align = tbe.row_alignment
        kernel = "fbgemm IntNBitTableBatchedEmbeddingBagsCodegen (SUM pooling, fp32 output)"
    fp32_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    table_entries = []
    managed = set(mc.tables()) if mc is not None else set()
    for t in tables:
        sd = padded_dim(t.embedding_dim, TBE_DIM_ALIGN[embedding_dtype] if artifact == "torchscript" else
                        (2 if embedding_dtype == "int4" else 1))
        rb = tbe_row_bytes(sd, embedding_dtype, row_align)
        if artifact == "pt2" and embedding_dtype == "int8":
            rb += 4  # float32 scale + bias (the fp16 values, widened: the byte kernel's layout) instead of fp16
        table_entries.append({
            "name": t.name, "features": list(t.feature_names), "num_embeddings": t.num_embeddings,
            "embedding_dim": t.embedding_dim, "stored_dim": sd, "pooling": t.pooling.value,
            "weighted": any(f in wf for f in t.feature_names), "dtype": embedding_dtype,
            "row_bytes": rb, "bytes": rb * t.num_embeddings,
            # a managed-collision table takes raw ids (any int64 >= 0): the program maps them to rows
            "ids": "raw" if t.name in managed else "index",
        })
    meta = data_meta or {}
    dense_names = list(meta.get("dense_features") or [f"dense_{i}" for i in range(num_dense)])
    if len(dense_names) != num_dense:
        raise ExportError(f"data meta lists {len(dense_names)} dense features but the model takes {num_dense}")
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "artifact": artifact,
        "model_file": PROGRAM_FILE if artifact == "pt2" else MODEL_FILE,
        "inputs": {
            "dense": {"shape": ["B", num_dense], "dtype": "float32", "features": dense_names},
            "values": {"shape": ["N"], "dtype": "int64", "layout": "key-major ids of all bags"},
            "lengths": {"shape": ["F*B"], "dtype": "int64", "layout": "key-major: [f0_b0..f0_b(B-1), f1_b0, ...]"},
            **({"weights": {"shape": ["N"], "dtype": "float32", "features": wf,
                            "layout": "one per id, aligned with values; required; entries of features not in "
                                      "'features' are ignored (1.0)"}} if wf else {}),
        },
        "output": {"shape": ["B"], "dtype": "float32", "meaning": "sigmoid(logit): click probability"}
        if artifact == "torchscript" else
        {"shape": [["B"], ["B"]], "dtype": "float32", "meaning": "(scores = sigmoid(logit), logits)"},
        "dynamic": {"batch": [1, 1 << 24], "ids": [0, 1 << 31]} if artifact == "pt2" else None,
        "in_program": (["dense_standardize", "on_invalid_id", "multi_hot"] if artifact == "pt2" else
                       ["dense_standardize", "on_invalid_id"]),
        "dense_features": dense_names,
        "sparse_features": feature_names,
        "weighted_features": wf,
        "tables": table_entries,
        "lookups": [{"key": k, "feature": f, "table": t.name}
                    for k, (t, f) in zip(lookup_keys, [(t, f) for t in tables for f in t.feature_names])],
        "on_invalid_id": policy,
        "quantization": {
            "embeddings": embedding_dtype,
            "dense": dense_mode,
            "scale_bias": ("fp16 per row (int8/int4), in front of the row codes (TorchScript TBE)"
                           if artifact == "torchscript" else
                           "fp16 values per row (int8/int4), after the row codes; int8 widened to float32"),
            "formula": "bias = fp16_down(min(row)); scale = fp16_up((max(row) - bias) / (2^bits - 1)); "
                       "q = clamp(round((x - bias) / scale), 0, 2^bits - 1) (q = 0 if scale == 0); x' = q*scale + bias",
            "source": "FBGEMM FloatToFusedNBitRowwiseQuantizedSBHalf / IntNBitTableBatchedEmbeddingBagsCodegen row layout",
            "kernel": kernel,
            "padding": "rows padded to the kernel's dim alignment with the row's minimum (scale and bias "
                       "unchanged), pooled output sliced back to the real dims",
        },
        "embedding_bytes": {"stored": stored, "fp32": fp32_bytes, "ratio": stored / fp32_bytes if fp32_bytes else None},
        "preprocessing": None,
        "data": dict(data_record) if data_record else None,
        "source": source or {},
        "versions": _versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        return _write_artifact(out, force, meta, data_dir, manifest, saved, stored, fp32_bytes, aot, parity)
    except OSError as e:
        err = outputs.place_error(e, out, "free space or --out a writable directory, then export again")
        if err is None:
            raise
        raise ExportError(str(err)) from None


def _table_weight(t: Any, load_table: Callable[[Any], torch.Tensor] | None, weights: dict) -> torch.Tensor:
    """Table ``t``'s float weights (from ``load_table`` or the model), shape-checked."""
    w = load_table(t) if load_table is not None else weights[t.name]
    if tuple(w.shape) != (t.num_embeddings, t.embedding_dim):
        raise ExportError(f"table '{t.name}': weight shape {tuple(w.shape)} != ({t.num_embeddings}, {t.embedding_dim})")
    return w


def _qtable_bytes(q: Any) -> int:
    """Bytes a quantized table takes in the program, unpadded (codes + scale/bias: float32 for
    int8, fp16 for int4)."""
    n = q.data.numel() * q.data.element_size()
    return n + q.num_embeddings * {"int8": 8, "int4": 4}.get(q.dtype, 0)


def _multi_hot_tables(multi_hot: dict | None, data_meta: dict | None,
                      feature_names: Sequence[str]) -> list | None:
    """Per input feature ``(rows, offsets [1024, size-1])`` of the loader's multi-hot expansion
    (same rows, seed and distribution as :class:`dlrmctl.data.loader.BatchLoader`), or None."""
    sizes = (multi_hot or {}).get("multi_hot_sizes") or {}
    if not any(int(v) > 1 for v in sizes.values()):
        return None
    from dlrmctl.data.multi_hot import multi_hot_offsets

    sparse = list((data_meta or {}).get("sparse_features") or [])
    names = [f["name"] for f in sparse]
    out: list = []
    for f in feature_names:
        size = int(sizes.get(f, 1))
        if size <= 1:
            out.append(None)
            continue
        if f not in names:
            raise ExportError(f"multi-hot feature '{f}' is not in the data meta's sparse features {names}")
        rows = int(sparse[names.index(f)]["num_embeddings"])
        seed = int(multi_hot.get("multi_hot_seed", 0)) + names.index(f)
        off = multi_hot_offsets(rows, size, multi_hot.get("multi_hot_distribution", "uniform"), seed)
        out.append((rows, torch.from_numpy(off)))
    return out


def _compile_aoti(ep: Any, path: Path) -> None:
    """AOTInductor package of the exported program at ``path`` (CPU; the program's buffers inside).

    Raises:
        ExportError: no C++ compiler, or Inductor failed (its first line).
    """
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise ExportError("--aot compiles C++ with the system compiler; none found (install g++), or export "
                          "without --aot")
    import torch._inductor

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    except OSError:
        raise
    except Exception as e:
        raise ExportError(f"AOTInductor failed to compile the program ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def _write_artifact(out: Path, force: bool, meta: dict | None, data_dir: Any, manifest: dict,
                    saved: Any, stored: int, fp32_bytes: int, aot: bool = False,
                    parity: Callable[[Any], dict] | None = None) -> "ExportResult":
    """Write the artifact directory (vocabularies, model.pt or model.pt2 [+ model_aoti.pt2],
    manifest.json) through :func:`_atomic_dir`; every model file is listed in
    ``manifest["files"]`` with its size and SHA-256.  ``parity`` runs on the written artifact
    (loaded back, its hashes checked) before the swap."""
    with _atomic_dir(out, force) as tmp:
        if meta:
            vocab_files = {}
            for feat, rel in (meta.get("vocab_files") or {}).items():
                src = Path(data_dir) / rel if data_dir is not None else Path(rel)
                if not src.is_file():
                    raise ExportError(
                        f"vocabulary of feature '{feat}' not found at {src}; the artifact must carry it. "
                        "Pass --data DIR (the preprocessed data directory the run was trained on)"
                    )
                dst = tmp / "vocab" / Path(rel).name
                dst.parent.mkdir(exist_ok=True)
                shutil.copyfile(src, dst)
                vocab_files[feat] = f"vocab/{dst.name}"
                if manifest["data"] is not None:
                    manifest["data"].setdefault("vocab_sha256", {})[f"vocab/{dst.name}"] = _sha256(dst)
            manifest["preprocessing"] = {
                "dataset": meta.get("dataset"),
                "dense_features": meta.get("dense_features"),
                "sparse_features": [sf["name"] for sf in meta.get("sparse_features", [])],
                "sparse": meta.get("sparse_features"),
                "label": meta.get("label"),
                "transforms": meta.get("transforms"),
                "vocab_files": vocab_files,
                "meta": {k: v for k, v in meta.items() if k not in ("splits", "vocab_files")},
            }
        buf = io.BytesIO()  # serialised in memory: TorchScript's C++ writer aborts the process on a full disk
        model_file = manifest["model_file"]
        stage(f"writing {model_file}")
        if manifest["artifact"] == "pt2":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.export.save(saved, buf)
        else:
            with _quiet_jit():
                torch.jit.save(saved, buf)
        data = buf.getbuffer()
        free = shutil.disk_usage(tmp).free
        if free < len(data):
            raise OSError(errno.ENOSPC, f"{len(data):,} bytes needed, {free:,} free", str(tmp / model_file))
        _write_bytes(tmp / model_file, data)
        manifest["model_bytes"] = len(data)
        manifest["model_sha256"] = hashlib.sha256(data).hexdigest()
        manifest["files"] = {model_file: {"bytes": len(data), "sha256": manifest["model_sha256"]}}
        del data, buf
        manifest["aoti_package"] = None
        if aot:
            stage(f"compiling the AOTInductor package {AOTI_FILE} (C++; minutes on a loaded machine)")
            _compile_aoti(saved, tmp / AOTI_FILE)
            manifest["aoti_package"] = AOTI_FILE
            manifest["files"][AOTI_FILE] = {"bytes": (tmp / AOTI_FILE).stat().st_size, "sha256": _sha256(tmp / AOTI_FILE)}
        if parity is not None:
            stage("parity report: latency, then the artifact against the float model")
            _write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
            manifest["parity"] = parity(load_exported(tmp, artifact=manifest["artifact"]))
        _write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
    return ExportResult(out, manifest, stored, fp32_bytes)


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
        quantize_dense, force, artifact, aot: see :func:`export_model`.
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
    if artifact == "torchscript":
        require_fbgemm("dlrmctl export")  # --torchscript: FBGEMM TBE
    from dlrmctl.config import weighted_features
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
        _verify_data_files(vocab_dir, parity_split)

    def export_from(ckpt_path: str, which: str) -> ExportResult:
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

        return export_model(
            model, out, embedding_dtype, data_meta=meta, data_dir=vocab_dir, source=source,
            quantize_dense=quantize_dense, force=force, weighted_features=weighted_features(cfg),
            data_record=data_record, load_table=lambda t: load_table_weight(ckpt_path, t, cmeta, dcp_md),
            artifact=artifact, aot=aot, multi_hot=source["multi_hot"], parity=parity,
        )

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


# ----------------------------------------------------------------------------- loading
class ExportedModel:
    """A loaded artifact (TorchScript module or torch.export program) plus its manifest.

    Attributes:
        model_dir: the artifact directory.
        manifest: the parsed manifest.
        module: the ``torch.jit.ScriptModule`` (``artifact`` ``torchscript``; loaded for a non-CPU
            device: an eager :class:`ExportedDLRM` with its TBE rebuilt there) or the program's
            ``ExportedProgram.module()`` (``pt2``: returns ``(scores, logits)``).
        artifact: ``pt2`` | ``torchscript`` (``manifest["artifact"]``; older manifests: torchscript).
        runner: the format that runs (:mod:`dlrmctl.inference.formats`): ``aoti`` (the package of
            a ``pt2`` export), ``pt2`` or ``torchscript``.
        feature_names: sparse features in input order.
        weighted_features: features whose per-id weights the model uses (empty: it takes none).
        num_dense: ``D_in``.
    """

    def __init__(self, model_dir: Path, manifest: dict, module: torch.jit.ScriptModule,
                 device: torch.device | str = "cpu", runner: str | None = None) -> None:
        self.model_dir = model_dir
        self.manifest = manifest
        self.module = module
        self.artifact = manifest.get("artifact", "torchscript")
        self.runner = runner or self.artifact
        self.device = torch.device(device)
        self.feature_names: list[str] = list(manifest["sparse_features"])
        self.weighted_features: list[str] = list(manifest.get("weighted_features") or [])
        self.num_dense = int(manifest["inputs"]["dense"]["shape"][1])

    @property
    def description(self) -> str:
        """What runs, for a command's first line: ``model_aoti.pt2 (AOTInductor package) on cpu``."""
        from dlrmctl.inference.formats import FORMATS

        return FORMATS[self.runner].describe(self.device)

    @torch.no_grad()
    def score(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
        """``dense [B, D_in]`` float32, ``values [N]`` int64, ``lengths [F*B]`` int64 (key-major,
        manifest feature order), ``weights [N]`` float32 (required exactly when the model has
        :attr:`weighted_features`), on any device -> scores ``[B]`` float32 on the model's device.

        Raises:
            ExportError: inputs rejected by the module (message from the module).
        """
        if self.artifact == "pt2":
            return self._call(self.module, dense, values, lengths, weights)[0]
        return self._call(self.module, dense, values, lengths, weights)

    def score_kjt(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        """Scores ``[B]`` of a batch given as ``dense [B, D_in]`` + a KeyedJaggedTensor (any key
        order; reordered to the manifest's; its ``weights()`` are the per-id weights)."""
        return self.score(dense, *self._kjt_inputs(kjt))

    @torch.no_grad()
    def logits(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
        """Same inputs as :meth:`score` (``weights`` included) -> logits ``[B]`` float32 on the
        model's device (the module's ``logits``; ``score == sigmoid(logits)``).  Metrics use
        these: a float32 sigmoid rounds to 1.0 above a logit of ~16.6.

        Raises:
            ExportError: inputs rejected by the module (message from the module).
        """
        if self.artifact == "pt2":
            return self._call(self.module, dense, values, lengths, weights)[1]
        return self._call(self.module.logits, dense, values, lengths, weights)

    def _call(self, fn: Any, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None) -> torch.Tensor:
        """``fn`` (the module's ``forward`` or ``logits``) on the inputs moved to the model's device;
        a rejected input becomes an :class:`ExportError` carrying the module's own message."""
        dev = self.device
        dense, values, lengths = dense.to(dev), values.to(dev), lengths.to(dev)
        if self.artifact == "pt2":
            self._check_program_inputs(dense, values, lengths, weights)
        try:
            if weights is None:  # the 3-input call every artifact accepts
                return fn(dense, values, lengths)
            return fn(dense, values, lengths, weights.to(dev))
        except (RuntimeError, AssertionError, ValueError, torch.jit.Error) as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            if self.artifact == "pt2":  # aten._assert_async: the message is on the first line
                lines = [next((ln for ln in lines if "out of range" in ln or "lengths" in ln),
                              lines[0] if lines else str(e))]
            msg = lines[-1] if lines else str(e)
            for prefix in ("builtins.ValueError: ", "RuntimeError: "):
                msg = msg.removeprefix(prefix)
            if self.artifact == "pt2":
                msg = self._locate_bad_id(msg, values, lengths, dense.size(0))
            raise ExportError(f"{self.model_dir}: bad model input: {msg}") from None

    def _locate_bad_id(self, msg: str, values: torch.Tensor, lengths: torch.Tensor, B: int) -> str:
        """The program's range message (every lookup's valid range; the program checks all ids with
        one assertion and carries no values) made as precise as the TorchScript module's:
        ``table 'T', feature 'f', sample s: id v is out of range; expected 0 <= id < R``, the first
        such id in lookup order.  ``msg`` unchanged when it is another message or no input id is out
        of range (e.g. an expanded multi-hot id)."""
        if not msg.startswith("an id is out of range; expected 0 <= id < rows of its table"):
            return msg
        rows = {t["name"]: int(t["num_embeddings"]) for t in self.manifest["tables"]}
        ln = lengths.detach().cpu()
        vals = values.detach().cpu()
        ends = torch.cumsum(ln.view(len(self.feature_names), B).sum(1), 0)
        for lk in self.manifest["lookups"]:
            f, table = self.feature_names.index(lk["feature"]), lk["table"]
            start = int(ends[f - 1]) if f else 0
            seg = vals[start: int(ends[f])]
            bad = torch.nonzero((seg < 0) | (seg >= rows[table]))
            if bad.numel():
                i = int(bad[0])
                sample = int(torch.searchsorted(torch.cumsum(ln[f * B:(f + 1) * B], 0), torch.tensor([i]), right=True)[0])
                return (f"table '{table}', feature '{lk['feature']}', sample {sample}: id {int(seg[i])} is out of "
                        f"range; expected 0 <= id < {rows[table]}")
        return msg

    def _check_program_inputs(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                              weights: torch.Tensor | None) -> None:
        """The torch.export program's input contract, checked with messages like the TorchScript
        module's (the program itself guards shapes too, with terser messages)."""
        F = len(self.feature_names)
        if dense.dim() != 2 or dense.size(1) != self.num_dense or dense.dtype != torch.float32:
            raise ExportError(f"{self.model_dir}: bad model input: dense must be [B, {self.num_dense}] float32, got "
                              f"shape {list(dense.shape)} {dense.dtype}")
        if values.dtype != torch.int64 or lengths.dtype != torch.int64 or values.dim() != 1 or lengths.dim() != 1:
            raise ExportError(f"{self.model_dir}: bad model input: values and lengths must be 1-d int64")
        B = dense.size(0)
        if B < 1:
            raise ExportError(f"{self.model_dir}: bad model input: the batch is empty (B = 0)")
        if lengths.numel() != F * B:
            raise ExportError(f"{self.model_dir}: bad model input: lengths must have num_features * B = {F} * {B} "
                              f"entries (key-major), got {lengths.numel()}")
        if weights is None and self.weighted_features:
            raise ExportError(f"{self.model_dir}: bad model input: this model has weighted features "
                              f"{self.weighted_features}: pass weights [N] float32, one per id aligned with values")
        if weights is not None:
            if not self.weighted_features:
                raise ExportError(f"{self.model_dir}: bad model input: this model has no weighted features (it was "
                                  "trained without per-id weights); it takes no weights, they would be ignored")
            if weights.dtype != torch.float32 or weights.dim() != 1 or weights.numel() != values.numel():
                raise ExportError(f"{self.model_dir}: bad model input: weights must be [N] float32 with N = "
                                  f"len(values) = {values.numel()}, got shape {list(weights.shape)} {weights.dtype}")

    def logits_kjt(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        """Logits ``[B]`` float32 of ``dense [B, D_in]`` + a KeyedJaggedTensor (any key order;
        its ``weights()`` are the per-id weights, as :meth:`score_kjt`)."""
        return self.logits(dense, *self._kjt_inputs(kjt))

    def _kjt_inputs(self, kjt: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``values`` int64, ``lengths`` int64 (manifest key order) and float32 ``weights`` (or None) of a KJT."""
        if kjt.keys() != self.feature_names:
            kjt = kjt.select_keys(self.feature_names)
        w = kjt.weights_or_none()
        return kjt.values().to(torch.int64), kjt.lengths().to(torch.int64), None if w is None else w.to(torch.float32)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A model output (scores / logits ``[B]`` on any device) as a NumPy array on the host:
    detached and copied to the CPU first (``.numpy()`` refuses a CUDA tensor).  Every consumer of
    :class:`ExportedModel` outputs (predict, evaluate, the parity report) goes through it."""
    return t.detach().cpu().numpy()


def load_exported(model_dir: str | os.PathLike, device: torch.device | str = "cpu",
                  artifact: str | None = None) -> ExportedModel:
    """Load ``model_dir/manifest.json`` and its model -- ``model.pt2`` (``torch.export.load``; needs
    no fbgemm_gpu) or ``model.pt`` (TorchScript, ``manifest["artifact"]``) -- onto ``device``
    (``cpu``, or ``cuda[:i]``; not run on a GPU yet): the program's buffers are moved there
    (``ep.module().to(device)``); a TorchScript artifact's IntNBit TBE is rebuilt for the device
    (DEVICE placement, 16-byte rows: :func:`_torchscript_for_device`; needs fbgemm_gpu's CUDA
    build), its module then an eager :class:`ExportedDLRM` with the same ``forward`` / ``logits``.
    Outputs stay on ``device``: :func:`to_host` brings them to NumPy.

    ``artifact`` (``aoti`` | ``pt2`` | ``torchscript``) names the format to run; by default the
    fastest the directory holds that runs on ``device`` (the AOTInductor package of a ``--aot``
    export on the CPU): :func:`dlrmctl.inference.formats.choose_format`.

    Raises:
        ExportError: no manifest (not an exported model), unknown format version, model file
            missing, of another size than recorded (truncated copy) or with another SHA-256 than
            recorded (``manifest["files"]``, every model file; damaged; hashed in 4 MiB chunks).
        RuntimeError: fbgemm_gpu missing for a TorchScript artifact (its operators run the module).
    """
    d = Path(model_dir)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        raise ExportError(f"{mpath}: not found; {d} is not an exported model (create one with `dlrmctl export RUN_DIR`)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ExportError(f"{mpath}: corrupt manifest: {e}") from None
    if not isinstance(manifest, dict):
        raise ExportError(f"{mpath}: corrupt manifest: a JSON object expected, got {type(manifest).__name__}")
    try:
        return _load_checked(d, mpath, manifest, device, artifact)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a field of the wrong shape
        raise ExportError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e}); export the run again") from None


def _load_checked(d: Path, mpath: Path, manifest: dict, device: str | torch.device,
                  runner: str | None = None) -> "ExportedModel":
    """:func:`load_exported` once ``manifest`` parsed as a JSON object (same errors)."""
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{mpath}: format_version {manifest.get('format_version')!r} is not supported (expected {FORMAT_VERSION})")
    artifact = manifest.get("artifact", "torchscript")
    if artifact not in ARTIFACTS:
        raise ExportError(f"{mpath}: artifact {artifact!r} is not one of {list(ARTIFACTS)}")
    model_path = d / manifest.get("model_file", MODEL_FILE)
    files = dict(manifest.get("files") or {})
    if not files:  # manifests before "files": the model file alone
        files = {model_path.name: {"bytes": manifest.get("model_bytes"), "sha256": manifest.get("model_sha256")}}
    if model_path.name not in files or not (files[model_path.name] or {}).get("sha256") \
            or os.path.dirname(manifest.get("model_file", MODEL_FILE)):
        # the file that is loaded must be one whose SHA-256 is checked below
        raise ExportError(f"{mpath}: model_file {manifest.get('model_file')!r} is not a file the manifest records a "
                          "SHA-256 for; the manifest was edited or damaged: export the run again")
    for rel, rec in files.items():  # every artifact file the manifest lists: present, same size and SHA-256
        f = d / rel
        if not f.is_file():
            raise ExportError(f"{f}: missing")
        if rec.get("bytes") is not None and f.stat().st_size != rec["bytes"]:
            raise ExportError(f"{f}: {f.stat().st_size} bytes but the manifest records {rec['bytes']}; truncated copy?")
        want = rec.get("sha256")
        if want:
            got = _sha256(f)
            if got != want:
                raise ExportError(
                    f"{f}: SHA-256 {got} differs from {want} recorded in {mpath}: the file is damaged or "
                    "was changed after export; export the run again (`dlrmctl export RUN_DIR --force --out "
                    f"{d}`) or copy the artifact again"
                )
    from dlrmctl.inference.formats import choose_format

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"{model_path}: device {device} requested but CUDA is not available")
    fmt = choose_format(d, manifest, device, runner)
    if fmt.name == "torchscript":
        require_fbgemm(f"loading {d / fmt.file}")
    with _unloadable(d / fmt.file, fmt.name):
        module = fmt.loader(d / fmt.file, manifest, device)
    return ExportedModel(d, manifest, module, device, runner=fmt.name)


@contextmanager
def _unloadable(model_path: Path, artifact: str) -> Iterator[None]:
    """A model file that passed its SHA-256 check but does not load as ``artifact`` (a file replaced
    with its hash updated, an edited ``artifact`` field): one :class:`ExportError` naming the file
    and what the manifest claims, not the loader's traceback or a "corrupt manifest"."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever the loader raises about a file that is not its format
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        how = {"pt2": "torch.export.load", "aoti": "torch._inductor.aoti_load_package"}.get(artifact, "torch.jit.load")
        raise ExportError(f"{model_path}: does not load as the '{artifact}' artifact the manifest names ({how}: "
                          f"{first}); the file or the manifest was replaced or edited after export: export the run "
                          "again") from None


def _torchscript_for_device(module: Any, manifest: dict, device: torch.device) -> nn.Module:
    """The loaded TorchScript artifact (CPU) as an eager :class:`ExportedDLRM` for ``device``: its
    IntNBit TBE rebuilt there (:func:`~dlrmctl.inference.quantize.intnbit_tbe_for_device`: DEVICE
    placement and the CUDA kernel's row alignment, the same table bytes), its traced dense part
    and buffers moved.  ``map_location`` alone would move the bytes but keep the HOST placement
    and 1-byte rows, which FBGEMM's CUDA kernel reads through empty UVM weights.

    Raises:
        QuantizationError: the artifact's TBE and manifest disagree.
    """
    from dlrmctl.inference.quantize import intnbit_tbe_for_device

    tables = [(t["name"], int(t["num_embeddings"]), int(t.get("stored_dim") or t["embedding_dim"]), t["dtype"])
              for t in manifest["tables"]]
    names = [t[0] for t in tables]
    ftm = [names.index(lk["table"]) for lk in manifest["lookups"]]
    tbe = intnbit_tbe_for_device(module.tbe, tables, ftm, device)
    eager = ExportedDLRM(
        tbe, module.dense_part, list(module.feature_names), module.feature_rows.tolist(),
        module.feature_dims.tolist(), module.feature_mean.tolist(), int(module.num_dense),
        module.lookup_src.tolist(), list(module.lookup_tables), "zero" if module.zero_invalid else "error",
        module.feature_weighted.tolist(), module.keep_cols.tolist() if module.sliced else None)
    return eager.to(device).eval()


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate_exported(
    model_dir: str | os.PathLike, data_dir: str | os.PathLike, split: str = "val", batch_size: int = 8192,
    device: torch.device | str = "cpu", any_split: bool = False, progress: bool = False,
    artifact: str | None = None, announce: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Metrics of an exported model on a split of preprocessed data (``dlrmctl evaluate MODEL_DIR``).

    The data must be preprocessed with the same transforms as the training data (the ids are
    checked against each table's rows by the module).

    Computed from the module's logits in float64, like training's evaluation.

    The data's fingerprint (schema, vocabularies and split; without the split with ``any_split``)
    must equal the one the export recorded (``manifest["data"]``; artifacts without one are
    evaluated with a warning).

    ``device`` (``cpu`` | ``cuda[:i]``) and ``artifact`` choose what runs as in
    :func:`load_exported`; each batch is moved there once and its logits come back in one copy.
    ``announce`` is called with :attr:`ExportedModel.description` once the model is loaded and the
    data checked.

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``
        (:func:`dlrmctl.metrics.compute_metrics_from_logits`).

    Raises:
        ExportError: not an exported model, data without labels, ids out of range.
        DataError: unknown split / bad data directory.
    """
    from dlrmctl.console import Progress
    from dlrmctl.data.fingerprint import PARTS, check_same_data, read_meta_json, split_rows
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.metrics import compute_metrics_from_logits

    m = load_exported(model_dir, device, artifact)
    mpath = os.path.join(str(data_dir), "meta.json")
    dmeta = read_meta_json(mpath, "data")
    rec = m.manifest.get("data") or {}
    if rec.get("meta"):
        check_same_data(rec["meta"], f"{Path(model_dir) / MANIFEST_FILE} (recorded from {rec.get('source', '?')})",
                        dmeta, mpath, PARTS[:2] if any_split else PARTS,
                        hint="Evaluate on the data the model was trained on"
                             + ("" if any_split else "; --any-split accepts other rows with the same schema and "
                                                     "vocabularies"))
    else:
        log.warning("%s records no training-data fingerprint (exported by an older dlrmctl): the data is not "
                    "checked against it", Path(model_dir) / MANIFEST_FILE)
    split_rows(dmeta, str(data_dir), split)
    if announce is not None:  # once the data is known to fit: a bad input stays one error line
        announce(m.description)
    loader = BatchLoader(str(data_dir), split, batch_size, shuffle=False, features=m.feature_names,
                         weighted_features=m.weighted_features,
                         **({} if "multi_hot" in (m.manifest.get("in_program") or [])
                            else (m.manifest.get("source") or {}).get("multi_hot", {})))
    logits, labels = [], []
    bar = Progress(len(loader), f"eval {split}", "batch", enabled=progress, final_line=False, leave=False)
    for batch in loader:
        if bool(torch.isnan(batch.labels).any()):
            raise ExportError(f"{data_dir}: split '{split}' has no labels; cannot compute metrics")
        logits.append(to_host(m.logits_kjt(batch.dense_features.float(), batch.sparse_features)))
        labels.append(batch.labels.numpy())
        bar.update(1)
    bar.close()
    if not logits:
        raise ExportError(f"{data_dir}: split '{split}' is empty")
    return compute_metrics_from_logits(np.concatenate(logits), np.concatenate(labels))
