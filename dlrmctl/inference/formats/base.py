"""The interface every artifact format implements: how it is written (``build`` + ``save`` and its
manifest fields), loaded (``load``), described (``describe``) and run (``run`` with its input
contract: ``check_inputs`` and ``input_message``).

:mod:`dlrmctl.inference.export` resolves a model into an :class:`ExportPlan` (its tables, lookups
and dense part) and hands it to the chosen format; :class:`~dlrmctl.inference.exported.ExportedModel`
calls the format that runs.  A new format is one subclass in ``dlrmctl/inference/formats/`` plus
its record in :data:`dlrmctl.inference.formats.FORMATS` (docs/extending.md).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dlrmctl.inference.artifact import ExportError

__all__ = ["Built", "ExportPlan", "Format"]


@dataclass
class ExportPlan:
    """A model resolved for export: what every format writes from (lists are in table order for
    tables, in lookup order -- one per (table, feature), the EBC's output order -- for lookups).

    Attributes:
        tables: the EBC's :class:`~dlrmctl.modules.embedding_configs.EmbeddingBagConfig` list.
        table_weight: ``table_weight(config) -> [rows, dim]`` float32 tensor (shape-checked),
            called once per table in table order; the caller drops it once written.
        embedding_dtype: ``fp32`` | ``fp16`` | ``int8`` | ``int4``.
        dense_part: everything after the lookup (``(dense [B, D_in], pooled [B, sum dims]) ->
            logits [B, 1]``), fp32 or dynamic-int8.
        feature_names: the input features (``F``), each once.
        num_dense: ``D_in``.
        lookup_table: per lookup its table index.
        lookup_src: per lookup the index of its input feature.
        lookup_dims / lookup_rows / lookup_mean / lookup_tables / lookup_features: per lookup its
            table's dim, rows, mean pooling, table name and feature name.
        on_invalid_id: ``error`` | ``zero``.
        feature_weighted: per input feature, its per-id weights are used.
        multi_hot: the training loader's multi-hot expansion (or None) with ``data_meta`` for
            its rows (a program format expands one-hot ids itself).
        data_meta: the training data's meta.json, or None.
        managed_collision: the EBC's managed-collision remapper, or None.
    """

    tables: list
    table_weight: Callable[[Any], torch.Tensor]
    embedding_dtype: str
    dense_part: nn.Module
    feature_names: list[str]
    num_dense: int
    lookup_table: list[int]
    lookup_src: list[int]
    lookup_dims: list[int]
    lookup_rows: list[int]
    lookup_mean: list[bool]
    lookup_tables: list[str]
    lookup_features: list[str]
    on_invalid_id: str
    feature_weighted: list[bool]
    multi_hot: dict | None = None
    data_meta: dict | None = None
    managed_collision: Any = None


@dataclass
class Built:
    """What a format built from an :class:`ExportPlan`.

    Attributes:
        saved: the object :meth:`Format.save` serialises (a ``torch.export.ExportedProgram``, a
            ``torch.jit.ScriptModule``).
        stored_bytes: bytes of embedding storage in it.
        row_alignment: byte alignment of a stored row (1: none).
        kernel: how its lookups run, for ``manifest["quantization"]["kernel"]``.
    """

    saved: Any
    stored_bytes: int
    row_alignment: int
    kernel: str


class Format:
    """One artifact format (class attributes) and what it does (methods).

    Attributes:
        name: ``pt2`` | ``aoti`` | ``torchscript`` (``--artifact``; ``manifest["artifact"]`` for
            a format written on its own).
        file: its file in the export directory.
        title: what it is, for messages and the commands' first line.
        devices: device types it runs on, empty: any.
        rank: lower is faster per request (``serve``; benchmarks/export.md; whole-file scoring:
            :data:`dlrmctl.inference.formats.BULK_ORDER`).
        export_flag: the ``dlrmctl export`` option that writes it.
        loads_with: the call that loads it, for messages.
        standalone: written on its own (``export --artifact``); False for a package compiled
            beside another format's file (``aoti``).
    """

    name: str = ""
    file: str = ""
    title: str = ""
    devices: tuple[str, ...] = ()
    rank: int = 0
    export_flag: str = ""
    loads_with: str = ""
    standalone: bool = True

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.file}>"

    # ------------------------------------------------------------------ where it runs
    def present(self, manifest: dict) -> bool:
        """The manifest records this format's file (and so its SHA-256, checked at load)."""
        files = manifest.get("files") or {manifest.get("model_file", "model.pt"): {}}
        return self.file in files

    def runs_on(self, manifest: dict, device: torch.device) -> bool:
        """This format runs on ``device``."""
        return not self.devices or device.type in self.devices

    def runs_where(self, manifest: dict) -> str:
        """The devices it runs on, for messages: ``cpu/cuda``."""
        return "/".join(self.devices) or "any device"

    def describe(self, device: torch.device) -> str:
        """``model_aoti.pt2 (AOTInductor package) on cpu``."""
        return f"{self.file} ({self.title}) on {device}"

    # ------------------------------------------------------------------ write
    def check_export(self, quantize_dense: bool, aot: bool) -> None:
        """Refuse export options this format cannot honour (before any work).

        Raises:
            ExportError: the option and why, naming what to change.
        """

    def check_tables(self, managed: Sequence[str]) -> None:
        """Refuse tables this format cannot hold (``managed``: managed-collision tables).

        Raises:
            ExportError: which tables, and what to change.
        """

    def build(self, plan: ExportPlan) -> Built:
        """The artifact's object built from ``plan`` (tables read and written one at a time)."""
        raise ExportError(f"the {self.name} format is not written on its own; export with {self.export_flag}")

    def stored_dim(self, dim: int, dtype: str) -> int:
        """Columns a row of a ``dim``-wide table takes in this format (padded to its alignment)."""
        return dim

    def row_bytes(self, stored_dim: int, dtype: str, row_alignment: int) -> int:
        """Bytes one stored row takes (codes plus its scale and bias)."""
        from dlrmctl.inference.quantize import tbe_row_bytes

        return tbe_row_bytes(stored_dim, dtype, row_alignment)

    def manifest_fields(self) -> dict:
        """The manifest entries that say what this format's file is: ``model_file``, ``output``,
        ``dynamic``, ``in_program`` and ``scale_bias`` (the layout of a quantized row)."""
        raise NotImplementedError

    def save(self, saved: Any, buf: io.BytesIO) -> None:
        """Serialise ``saved`` (:attr:`Built.saved`) into ``buf`` (in memory: a full disk is then
        an ``OSError`` of the Python writer, never an abort inside a C++ one)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ load and run
    def check_loadable(self, path: Path) -> None:
        """What must be installed to load ``path`` is (raises ``RuntimeError`` saying what is not)."""

    def load(self, path: Path, manifest: dict, device: torch.device) -> Any:
        """The module in ``path`` on ``device``, ready for :meth:`run`."""
        raise NotImplementedError

    def no_autograd(self) -> Any:
        """The context a call runs in: ``torch.inference_mode`` (no autograd bookkeeping or version
        counters: every operator is cheaper to call than under ``no_grad``; the outputs are
        inference tensors)."""
        return torch.inference_mode()

    def run(self, module: Any, args: tuple, logits: bool) -> torch.Tensor:
        """``module`` on ``args`` (``dense, values, lengths[, weights]``): the scores ``[B]``
        float32, or with ``logits`` the logits ``[B]`` float32."""
        raise NotImplementedError

    def check_inputs(self, model: Any, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     weights: torch.Tensor | None) -> None:
        """Check the input contract before the call where the module's own checks say less
        (``model``: the :class:`~dlrmctl.inference.exported.ExportedModel`).

        Raises:
            ExportError: the input and what was expected.
        """

    def message_line(self, lines: list[str]) -> str:
        """The line of a rejected call's error message that says what was wrong."""
        return lines[-1]

    def input_message(self, model: Any, err: BaseException, values: torch.Tensor, lengths: torch.Tensor,
                      batch: int) -> str:
        """What :meth:`run` raising ``err`` says about the inputs, as one line."""
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        msg = self.message_line(lines) if lines else str(err)
        for prefix in ("builtins.ValueError: ", "RuntimeError: "):
            msg = msg.removeprefix(prefix)
        return msg
