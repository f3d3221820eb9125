"""The TorchScript format (``model.pt``, ``dlrmctl export --torchscript``): the scripted
:class:`ExportedDLRM` on FBGEMM's IntNBit TBE.

``torch.jit.save``-d; loads in Python or C++ libtorch once FBGEMM's operator libraries are loaded
(``fbgemm_gpu_py.so`` & co.).  The scripted module's ``forward(dense, values, lengths, weights=None)
-> scores``:

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
``per_sample_weights``, as in training.  ``logits(...)`` (``@torch.jit.export``) takes the same
inputs and returns the logits ``[B]`` float32; ``embeddings(values, lengths, weights=None)`` returns
the pooled embeddings ``[B, sum of lookup dims]`` (one per (table, feature) lookup,
``B = len(lengths) / F``).

It raises (``RuntimeError`` from TorchScript, message naming the feature and sample) on a wrong
dense width, ``len(lengths) != F*B``, ``sum(lengths) != len(values)``, weights missing for a
weighted model, given to an unweighted one, or not ``[N]`` float32, or -- under the model's
``on_invalid_id: error`` -- an id outside its table (message naming the table too); under
``on_invalid_id: zero`` such an id is dropped from its bag, its weight with it (the rule of
:mod:`dlrmctl.sparse.validation`, the same as training and the eager model).

A managed-collision feature (``manifest["tables"][i]["ids"] == "raw"``) takes raw 64-bit ids:
the module maps them to rows first with the ``.pt2`` program's own step
(:class:`~dlrmctl.inference.raw_id_remap.RawIdRemap`: ``searchsorted`` on the ids training's
last state held; an id not held takes its table's default row), then checks and looks up rows.

A feature looked up in several tables (outputs ``feature@table``) is one input key: the module
feeds its bags (and their weights) to each of its tables (checked against each table's own rows).

The tables are one FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` in the requested storage
(fp32 / fp16 / int8 / int4 row-wise, see :mod:`dlrmctl.inference.quantize`), each padded to
:data:`~dlrmctl.inference.quantize.TBE_DIM_ALIGN` and the pooled output sliced back; the dense part
(dense arch, interaction, over arch) is fp32, traced with ``torch.jit.trace`` (works for the dot,
DCN and projection interactions), or dynamic-int8 on its ``nn.Linear`` layers
(``torch.ao.quantization.quantize_dynamic``) with ``--quantize-dense``.  There is no pure-torch
fallback: without fbgemm_gpu, writing and loading fail with a message saying so
(:func:`dlrmctl.inference.intnbit_tbe.require_fbgemm`).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from dlrmctl.console import stage
from dlrmctl.inference.artifact import MODEL_FILE, ExportError, quiet_jit
from dlrmctl.inference.formats.base import Built, ExportPlan, Format
from dlrmctl.inference.raw_id_remap import raw_id_remap

__all__ = ["ExportedDLRM", "TorchScriptFormat", "torchscript_for_device", "trace_dense"]


class ExportedDLRM(nn.Module):
    """The scripted inference module: ``(dense, values, lengths[, weights]) -> scores [B]`` (see module doc).

    Args:
        tbe: FBGEMM IntNBit TBE, one feature per lookup (``feature_table_map`` applied).
        dense_part: the traced dense part (:func:`trace_dense`; fp32 or dynamic-int8).
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
        remap: raw id -> row of the managed-collision features
            (:class:`~dlrmctl.inference.raw_id_remap.RawIdRemap`, the ``.pt2`` program's own
            step), run on the input values before any check or lookup; None: no such feature.
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
        remap: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.tbe = tbe
        self.remap = remap
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
        if self.remap is not None:  # managed-collision features: raw ids -> rows (unheld: default row)
            values = self.remap(values, lengths, B)
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


def trace_dense(part: nn.Module, num_dense: int, pooled_width: int) -> torch.jit.ScriptModule:
    """Trace the dense part at B=4 and verify it at B=3 (catches batch-size-specialised traces)."""
    g = torch.Generator().manual_seed(0)
    ex = (torch.randn(4, num_dense, generator=g), torch.randn(4, pooled_width, generator=g))
    with torch.no_grad(), warnings.catch_warnings():
        # KeyedTensor's width check compares python ints: harmless constant in the trace
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # see quiet_jit
        traced = torch.jit.trace(part, ex, check_trace=False)
        chk = (torch.randn(3, num_dense, generator=g), torch.randn(3, pooled_width, generator=g))
        want, got = part(*chk), traced(*chk)
    if want.shape != got.shape or not torch.allclose(want, got, rtol=1e-5, atol=1e-6):
        raise ExportError(
            "the traced dense part does not reproduce the model at another batch size; the interaction "
            f"({type(part.inter_arch).__name__}) is not traceable"
        )
    return traced


def torchscript_for_device(module: Any, manifest: dict, device: torch.device) -> nn.Module:
    """The loaded TorchScript artifact (CPU) as an eager :class:`ExportedDLRM` for ``device``: its
    IntNBit TBE rebuilt there (:func:`~dlrmctl.inference.intnbit_tbe.intnbit_tbe_for_device`: DEVICE
    placement and the CUDA kernel's row alignment, the same table bytes), its traced dense part
    and buffers moved.  ``map_location`` alone would move the bytes but keep the HOST placement
    and 1-byte rows, which FBGEMM's CUDA kernel reads through empty UVM weights.

    Raises:
        QuantizationError: the artifact's TBE and manifest disagree.
    """
    from dlrmctl.inference.intnbit_tbe import intnbit_tbe_for_device

    tables = [(t["name"], int(t["num_embeddings"]), int(t.get("stored_dim") or t["embedding_dim"]), t["dtype"])
              for t in manifest["tables"]]
    names = [t[0] for t in tables]
    ftm = [names.index(lk["table"]) for lk in manifest["lookups"]]
    tbe = intnbit_tbe_for_device(module.tbe, tables, ftm, device)
    eager = ExportedDLRM(
        tbe, module.dense_part, list(module.feature_names), module.feature_rows.tolist(),
        module.feature_dims.tolist(), module.feature_mean.tolist(), int(module.num_dense),
        module.lookup_src.tolist(), list(module.lookup_tables), "zero" if module.zero_invalid else "error",
        module.feature_weighted.tolist(), module.keep_cols.tolist() if module.sliced else None,
        getattr(module, "remap", None))
    return eager.to(device).eval()


class TorchScriptFormat(Format):
    """``model.pt``: :class:`ExportedDLRM` scripted, on FBGEMM's IntNBit TBE (CPU and CUDA)."""

    name = "torchscript"
    file = MODEL_FILE
    title = "TorchScript + FBGEMM TBE"
    devices = ("cpu", "cuda")
    rank = 2
    export_flag = "--torchscript"
    loads_with = "torch.jit.load"

    def no_autograd(self) -> Any:
        """``torch.no_grad``: TorchScript's graph executor specialises a module on whether its
        parameters need gradients, so a call under ``inference_mode`` after one outside it (the
        module called directly) would save inference tensors for backward and fail."""
        return torch.no_grad()

    # ------------------------------------------------------------------ write
    def check_export(self, quantize_dense: bool, aot: bool) -> None:
        """``aot`` is refused (it compiles the torch.export program); fbgemm_gpu is required."""
        from dlrmctl.inference.intnbit_tbe import require_fbgemm

        if aot:
            raise ExportError("--aot compiles the torch.export program; it cannot be combined with --torchscript")
        require_fbgemm("dlrmctl export")  # --torchscript: FBGEMM TBE

    def build(self, plan: ExportPlan) -> Built:
        """Quantize each table straight into the TBE (padded to its alignment), trace the dense part,
        script the module.

        Raises:
            ExportError: an untraceable dense part.
        """
        from dlrmctl.inference.intnbit_tbe import empty_intnbit_tbe, tbe_storage_bytes, write_intnbit_table
        from dlrmctl.inference.quantize import TBE_DIM_ALIGN, pad_columns, padded_dim

        dtype = plan.embedding_dtype
        align = TBE_DIM_ALIGN[dtype]
        pdims = [padded_dim(t.embedding_dim, align) for t in plan.tables]
        tbe = empty_intnbit_tbe([(t.name, t.num_embeddings, p, dtype) for t, p in zip(plan.tables, pdims)],
                                plan.lookup_table, "cpu")
        for i, t in enumerate(plan.tables):  # one table at a time: load, quantize into the TBE, drop
            w = plan.table_weight(t)
            write_intnbit_table(tbe, i, pad_columns(w.detach().cpu(), pdims[i]), dtype, t.name)
            del w
        dims = plan.lookup_dims
        lookup_pdims = [pdims[i] for i in plan.lookup_table]
        keep = None
        if lookup_pdims != dims:  # padded: keep each lookup's first `dim` columns of its padded block
            starts = [sum(lookup_pdims[:i]) for i in range(len(dims))]
            keep = [s0 + c for s0, d in zip(starts, dims) for c in range(d)]
        traced = trace_dense(plan.dense_part, plan.num_dense, sum(dims))
        module = ExportedDLRM(
            tbe, traced, plan.feature_names, plan.lookup_rows, lookup_pdims, plan.lookup_mean, plan.num_dense,
            plan.lookup_src, plan.lookup_tables, plan.on_invalid_id, plan.feature_weighted, keep,
            None if plan.managed_collision is None else raw_id_remap(plan.managed_collision, plan.feature_names),
        ).eval()
        stage("scripting the module (TorchScript)")
        with quiet_jit():
            saved = torch.jit.script(module)
        return Built(saved, tbe_storage_bytes(tbe), tbe.row_alignment,
                     "fbgemm IntNBitTableBatchedEmbeddingBagsCodegen (SUM pooling, fp32 output)")

    def stored_dim(self, dim: int, dtype: str) -> int:
        """The dim padded to the TBE's alignment (:data:`~dlrmctl.inference.quantize.TBE_DIM_ALIGN`)."""
        from dlrmctl.inference.quantize import TBE_DIM_ALIGN, padded_dim

        return padded_dim(dim, TBE_DIM_ALIGN[dtype])

    def manifest_fields(self) -> dict:
        return {
            "model_file": self.file,
            "output": {"shape": ["B"], "dtype": "float32", "meaning": "sigmoid(logit): click probability"},
            "dynamic": None,
            "in_program": ["dense_standardize", "on_invalid_id"],
            "scale_bias": "per row in front of the row codes: fp16 scale and bias (4 bytes; int8/int4, "
                          "FBGEMM's IntNBit TBE row layout)",
        }

    def save(self, saved: Any, buf: io.BytesIO) -> None:
        with quiet_jit():
            torch.jit.save(saved, buf)

    # ------------------------------------------------------------------ load and run
    def check_loadable(self, path: Path) -> None:
        from dlrmctl.inference.intnbit_tbe import require_fbgemm

        require_fbgemm(f"loading {path}")

    def load(self, path: Path, manifest: dict, device: torch.device) -> Any:
        """``torch.jit.load`` on the CPU (FBGEMM's operators loaded), its TBE rebuilt for another
        device (:func:`torchscript_for_device`)."""
        with quiet_jit():  # the TBE was built on the CPU: loaded there, rebuilt for another device
            module = torch.jit.load(str(path), map_location="cpu")
        module.eval()
        return torchscript_for_device(module, manifest, device) if device.type != "cpu" else module

    def run(self, module: Any, args: tuple, logits: bool) -> torch.Tensor:
        return module.logits(*args) if logits else module(*args)
