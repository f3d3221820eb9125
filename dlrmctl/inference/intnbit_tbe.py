"""FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` holding row-wise quantized tables
(:mod:`dlrmctl.inference.quantize`): the TorchScript artifact's embedding storage.

FBGEMM IntNBit TBE row layout (``split_table_batched_embeddings_ops_inference.py``,
``reverse_qparam=False``)::

    INT8 / INT4:  [scale fp16 (2 bytes)][bias fp16 (2 bytes)][codes: D bytes | D/2 bytes]
    FP16:         [D halves]          FP32: [D floats]

INT4 packs two codes per byte, element ``2k`` in the low nibble and ``2k+1`` in the high
nibble.  Each row is padded to ``row_alignment`` bytes (1 on CPU, 16 on CUDA) and each table
to a 128-byte cache line.  Bytes per row on CPU: int8 ``D + 4``, int4 ``D/2 + 4``,
fp16 ``2D``, fp32 ``4D``; so versus fp32 (``4D``) int8 is ``(D+4)/(4D)`` (0.3125 at D=16,
0.3 at D=20, 0.28 at D=32) and int4 ``(D/2+4)/(4D)`` (0.1875 at D=16, 0.167 at D=24,
0.156 at D=32).

There is no pure-torch fallback: :func:`require_fbgemm` names what is missing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dlrmctl import _fbgemm
from dlrmctl.inference.quantize import (
    CHUNK_ROWS,
    EMBEDDING_DTYPES,
    SCALE_BIAS_BYTES,
    TBE_DIM_ALIGN,
    QuantizationError,
    QuantizedTable,
    quantize_table,
    tbe_row_bytes,
)

__all__ = [
    "build_intnbit_tbe",
    "empty_intnbit_tbe",
    "intnbit_tbe_for_device",
    "require_fbgemm",
    "tbe_placement",
    "tbe_rows",
    "tbe_storage_bytes",
    "write_intnbit_table",
]


def tbe_rows(q: QuantizedTable) -> torch.Tensor:
    """The table as FBGEMM IntNBit TBE rows (unpadded): uint8 ``[R, tbe_row_bytes(D, dtype)]``.

    int8/int4: ``[scale fp16 | bias fp16 | codes]``; fp16/fp32: the raw little-endian values.
    """
    if q.dtype in ("fp32", "fp16"):
        return q.data.contiguous().view(torch.uint8).view(q.num_embeddings, -1)
    assert q.scale is not None and q.bias is not None
    sb = torch.stack([q.scale, q.bias], dim=1).contiguous().view(torch.uint8).view(q.num_embeddings, SCALE_BIAS_BYTES)
    return torch.cat([sb, q.data], dim=1)


def require_fbgemm(what: str) -> None:
    """Raise a RuntimeError explaining that ``what`` needs fbgemm_gpu when it is absent.

    Exported artifacts run FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` and its ops
    (``torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function``); there is no
    pure-torch fallback by design (an artifact that silently changes kernels per machine
    would not be the artifact that was validated).
    """
    if not _fbgemm.HAS_FBGEMM:
        raise RuntimeError(
            f"{what} needs fbgemm_gpu (IntNBitTableBatchedEmbeddingBagsCodegen and the torch.ops.fbgemm "
            f"inference operators), which is not available here ({_fbgemm.FBGEMM_IMPORT_ERROR}). "
            "Install the matching pair: pip install fbgemm-gpu-cpu==1.8.0 (CPU) or fbgemm-gpu==1.8.0 (CUDA) "
            "with torch 2.13."
        )


def empty_intnbit_tbe(
    tables: Sequence[tuple[str, int, int, str]],
    feature_table_map: Sequence[int],
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """An FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` (SUM pooling, fp32 output) with
    storage for ``tables`` as FBGEMM initialises it (``initialize_weights()``); fill each table
    with :func:`write_intnbit_table`.

    Args:
        tables: ``(name, rows, dim, dtype)`` per table, TBE table order; ``dtype`` one of
            :data:`EMBEDDING_DTYPES`.
        feature_table_map: feature ``i`` (input order) -> index into ``tables``.
        device: ``cpu`` (HOST placement; row alignment 1) or ``cuda`` (DEVICE; alignment 16).

    Returns:
        The TBE module; ``forward(indices [N] int64, offsets [F*B+1] int64) -> [B, sum of the
        features' dims]`` float32.  Out-of-range ids raise (``BoundsCheckMode.FATAL``).

    Raises:
        RuntimeError: fbgemm_gpu missing (see :func:`require_fbgemm`).
        QuantizationError: a dim that is not a multiple of :data:`TBE_DIM_ALIGN` (FBGEMM TBE
            requirement; :func:`dlrmctl.inference.export.export_model` pads every table to it),
            an unknown dtype.
    """
    require_fbgemm("building an IntNBit TBE")
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    sparse_type = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
    dev = torch.device(device)
    placement, row_alignment = tbe_placement(dev)
    loc = getattr(EmbeddingLocation, placement)
    for name, _, dim, dtype in tables:
        if dtype not in sparse_type:
            raise QuantizationError(f"table '{name}': dtype must be one of {list(EMBEDDING_DTYPES)}, got {dtype!r}")
        if dim % TBE_DIM_ALIGN[dtype]:
            raise QuantizationError(
                f"table '{name}': embedding_dim {dim} is not a multiple of {TBE_DIM_ALIGN[dtype]}, which FBGEMM's "
                f"IntNBit TBE requires for {dtype}; pad the table (pad_columns) and slice the pooled output"
            )
    specs = [(name, rows, dim, sparse_type[dtype], loc) for name, rows, dim, dtype in tables]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=list(feature_table_map),
        pooling_mode=PoolingMode.SUM,
        device=dev,
        bounds_check_mode=BoundsCheckMode.FATAL,
        output_dtype=SparseType.FP32,
        row_alignment=row_alignment,
    )
    tbe.initialize_weights()
    return tbe


def tbe_placement(device: str | torch.device) -> tuple[str, int]:
    """``(EmbeddingLocation name, row alignment in bytes)`` of an IntNBit TBE built for ``device``:
    ``("HOST", 1)`` on the CPU (FBGEMM's CPU kernel reads ``weights_host``), ``("DEVICE", 16)``
    on CUDA (the CUDA kernel reads ``weights_dev`` with 16-byte rows; a HOST table moved there
    with ``map_location`` would be read through empty UVM weights)."""
    return ("HOST", 1) if torch.device(device).type == "cpu" else ("DEVICE", 16)


@torch.no_grad()
def intnbit_tbe_for_device(
    src: torch.nn.Module,
    tables: Sequence[tuple[str, int, int, str]],
    feature_table_map: Sequence[int],
    device: str | torch.device,
) -> torch.nn.Module:
    """A new IntNBit TBE built for ``device`` (:func:`empty_intnbit_tbe`: its placement and row
    alignment) holding the table bytes of ``src``, a TBE built on the CPU (HOST placement; eager
    or loaded from TorchScript: its ``weights_host``, ``weights_physical_offsets`` and
    ``row_alignment`` are read), each table copied row by row without its padding.

    Args:
        src: the CPU TBE (e.g. ``torch.jit.load(model.pt).tbe``).
        tables: ``(name, rows, stored dim, dtype)`` per table, ``src``'s table order
            (``manifest["tables"]``: ``name, num_embeddings, stored_dim, dtype``).
        feature_table_map: feature -> table index, as ``src``'s.
        device: the target device (``cuda[:i]`` in practice).

    Raises:
        QuantizationError: ``src`` is not a HOST-placed TBE, or its storage is smaller than
            ``tables`` need (another artifact's manifest).
    """
    placements = [int(p) for p in src.weights_physical_placements]
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    if any(p != EmbeddingLocation.HOST.value for p in placements):
        raise QuantizationError(f"the source TBE's placements {placements} are not all HOST (a CPU-built TBE)")
    host, offsets, align = src.weights_host, [int(o) for o in src.weights_physical_offsets], int(src.row_alignment)
    dst = empty_intnbit_tbe(tables, feature_table_map, device)
    views = dst.split_embedding_weights()
    for i, (name, rows, dim, dtype) in enumerate(tables):
        rb = tbe_row_bytes(dim, dtype, align)
        if offsets[i] + rows * rb > host.numel():
            raise QuantizationError(f"table '{name}': {rows} rows of {rb} bytes at {offsets[i]} exceed the source "
                                    f"TBE's {host.numel()} bytes")
        raw = host[offsets[i]: offsets[i] + rows * rb].view(rows, rb)
        w, sb = views[i]
        head = 0 if sb is None else SCALE_BIAS_BYTES
        if sb is not None:
            sb.copy_(raw[:, :SCALE_BIAS_BYTES].to(sb.device))
        w.copy_(raw[:, head: head + w.shape[1]].to(w.device))
    return dst


@torch.no_grad()
def _copy_tbe_rows(dst: tuple[torch.Tensor, torch.Tensor | None], rows: torch.Tensor, start: int) -> None:
    """Copy :func:`tbe_rows` output (uint8 ``[n, row bytes]``) into rows ``start..start+n`` of one
    table of ``tbe.split_embedding_weights()`` (``(codes/values, scale_bias or None)``)."""
    w, sb = dst
    n = rows.shape[0]
    if sb is None:
        w[start : start + n].copy_(rows[:, : w.shape[1]])
    else:
        sb[start : start + n].copy_(rows[:, :SCALE_BIAS_BYTES])
        w[start : start + n].copy_(rows[:, SCALE_BIAS_BYTES:])


def write_intnbit_table(tbe: torch.nn.Module, index: int, weight: torch.Tensor, dtype: str, table: str,
                        chunk_rows: int = CHUNK_ROWS) -> None:
    """Quantize float table ``weight [R, D]`` to ``dtype`` and write it into table ``index`` of an
    IntNBit TBE (:func:`empty_intnbit_tbe`), ``chunk_rows`` rows at a time: the bytes are those of
    :func:`quantize_table` + :func:`tbe_rows` (what :func:`build_intnbit_tbe` writes), without
    holding a quantized copy of the whole table (temporaries: one chunk).

    Raises:
        QuantizationError: as :func:`quantize_table` (NaN/inf, fp16 overflow: table and row
            named); ``weight``'s shape differs from the TBE's table, or its dtype from ``dtype``.
    """
    name, rows_, dim, sparse_type = tbe.embedding_specs[index][:4]
    if str(sparse_type.name).lower() != dtype:
        raise QuantizationError(f"table '{table}': the TBE stores it as {sparse_type.name}, not {dtype}")
    if tuple(weight.shape) != (rows_, dim):
        raise QuantizationError(f"table '{table}': weight shape {tuple(weight.shape)} != the TBE's ({rows_}, {dim})")
    dst = tbe.split_embedding_weights()[index]
    w = weight.detach()
    for s in range(0, rows_, chunk_rows):
        q = quantize_table(w[s : s + chunk_rows], dtype, table, chunk_rows, row_offset=s)
        _copy_tbe_rows(dst, tbe_rows(q), s)


def build_intnbit_tbe(
    tables: Sequence[QuantizedTable],
    feature_table_map: Sequence[int],
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """An FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` (SUM pooling, fp32 output) holding
    ``tables`` in their quantized storage (:func:`empty_intnbit_tbe`, then each table's rows).

    Args:
        tables: quantized tables, TBE table order.
        feature_table_map: feature ``i`` (input order) -> index into ``tables``.
        device: ``cpu`` (HOST placement; row alignment 1) or ``cuda`` (DEVICE; alignment 16).

    Returns:
        The TBE module (see :func:`empty_intnbit_tbe`).

    Raises:
        RuntimeError: fbgemm_gpu missing (see :func:`require_fbgemm`).
        QuantizationError: a dim that is not a multiple of 4 (FBGEMM TBE requirement).
    """
    tbe = empty_intnbit_tbe([(q.name, q.num_embeddings, q.embedding_dim, q.dtype) for q in tables],
                            feature_table_map, device)
    for q, dst in zip(tables, tbe.split_embedding_weights()):
        _copy_tbe_rows(dst, tbe_rows(q), 0)
    return tbe


def tbe_storage_bytes(tbe: torch.nn.Module) -> int:
    """Bytes actually allocated for the weights of an IntNBit TBE (host + device + UVM),
    including FBGEMM's row and 128-byte table padding."""
    return int(tbe.weights_host.numel() + tbe.weights_dev.numel() + tbe.weights_uvm.numel())
