"""Row-wise quantization of embedding tables for inference (fp16 / int8 / int4).

Formula (per row ``x = W[r, :]``, ``b`` bits, ``qmax = 2**b - 1``; int8: 255, int4: 15)::

    bias  = min(x)                      stored as fp16, rounded toward -inf
    scale = (max(x) - bias) / qmax      stored as fp16, rounded toward +inf
    q_i   = clamp(round_half_even((x_i - bias) / scale), 0, qmax)    (q = 0 when scale == 0)
    x'_i  = q_i * scale + bias          (what FBGEMM's IntNBit TBE computes, in fp32)

This is the affine row-wise scheme of FBGEMM's ``FloatToFusedNBitRowwiseQuantizedSBHalf``
(``fbgemm/src/QuantUtils.cc``) and of TorchRec's quantized EmbeddingBagCollection, with two
deliberate differences, both documented here and tested against FBGEMM's op:

* **fp16 rounding of scale and bias.**  FBGEMM's IntNBit TBE stores ``scale`` and ``bias``
  as fp16 in the row (layout below), so they cannot be the exact fp32 ``(max-min)/qmax`` and
  ``min``.  FBGEMM rounds both to nearest, which can put ``min`` above the row's minimum
  (that element then dequantizes to ``bias``, an error of up to half an fp16 ulp of ``min``
  beyond ``scale/2``) and ``max`` above ``bias + qmax*scale`` (clamped).  We round the bias
  *down* and the scale *up*, so every element lies in ``[bias, bias + qmax*scale]`` and the
  reconstruction error is bounded by half a step of the stored scale::

      |x_i - x'_i| <= scale_fp16 / 2  (+ fp32 rounding of the multiply-add, ~1e-7 |x_i|)

  ``scale_fp16`` exceeds the ideal ``(max - min)/qmax`` by at most one fp16 ulp plus
  ``(min - bias)/qmax`` (bias rounding).  For typical embedding rows (values of order
  1e-3..1) the scale is an fp16 *subnormal* for int8 when ``max - min < 255 * 6.1e-5 ≈ 0.0156``,
  where fp16 has an absolute step of 2**-24 ≈ 6e-8: the scale is then coarser in relative
  terms (up to ~1.5% for a range of 1e-3) but the bound above still holds because it is stated
  with the stored scale.
* **Constant rows.**  ``max == min`` gives ``scale = 0`` and ``q = 0`` so the row dequantizes
  to ``bias`` exactly; when ``min`` is representable in fp16 (e.g. 9.0) that is the original
  value exactly.  (FBGEMM stores ``scale = 1`` in that case; the result is the same.)  When
  ``min`` is not fp16-representable the directed rounding gives a small positive range and
  the row is reconstructed to within ``scale/2`` (for 0.1: error < 1e-7).

Rows with NaN or +-inf are refused (:class:`QuantizationError` naming the table and the row),
as are values whose fp16 bias/scale would overflow (``|x| > 65504``).

fp16 tables are plain half rows (round to nearest even: relative error <= 2**-11 in the fp16
normal range, absolute <= 2**-25 below 6.1e-5).

The FBGEMM IntNBit TBE that holds these rows (its row layout, building, writing a table into it,
rebuilding it for a device) is :mod:`dlrmctl.inference.intnbit_tbe` .
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from dlrmctl.errors import UserError

#: Embedding storage types accepted by :func:`quantize_table` / ``dlrmctl export``.
EMBEDDING_DTYPES = ("fp32", "fp16", "int8", "int4")
_BITS = {"int8": 8, "int4": 4}
#: Bytes of the fp16 scale + fp16 bias stored in front of every int8/int4 row.
SCALE_BIAS_BYTES = 4
#: Rows quantized per chunk (bounds temporary memory to a few x chunk x dim floats).
CHUNK_ROWS = 1 << 18
_FP16_MAX = 65504.0


class QuantizationError(ValueError, UserError):
    """A table cannot be quantized (NaN/inf, fp16 overflow, unsupported dim or dtype).

    The message names the table and, for bad values, the first bad row.
    """


@dataclass
class QuantizedTable:
    """One table in its inference storage format.

    Attributes:
        name: table name.
        dtype: ``fp32`` | ``fp16`` | ``int8`` | ``int4``.
        num_embeddings: rows ``R``.
        embedding_dim: ``D``.
        data: fp32: ``[R, D]`` float32; fp16: ``[R, D]`` float16; int8: ``[R, D]`` uint8 codes;
            int4: ``[R, D/2]`` uint8, two codes per byte (low nibble = even column).
        scale: int types: ``[R]`` float16 (0 for constant rows); else None.
        bias: int types: ``[R]`` float16; else None.
    """

    name: str
    dtype: str
    num_embeddings: int
    embedding_dim: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[R, D]`` reconstruction ``q * scale + bias`` (or the fp16/fp32 values)."""
        if self.dtype in ("fp32", "fp16"):
            return self.data.float()
        assert self.scale is not None and self.bias is not None
        return dequantize_rowwise(self.data, self.scale, self.bias, _BITS[self.dtype], self.embedding_dim)


def tbe_row_bytes(dim: int, dtype: str, row_alignment: int = 1) -> int:
    """Bytes per row of an IntNBit TBE table, padded to ``row_alignment`` bytes.

    Same numbers as ``fbgemm_gpu...rounded_row_size_in_bytes``: int8 ``D + 4``, int4
    ``D/2 + 4``, fp16 ``2D``, fp32 ``4D`` (before padding).
    """
    raw = {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + SCALE_BIAS_BYTES, "int4": dim // 2 + SCALE_BIAS_BYTES}[dtype]
    return -(-raw // row_alignment) * row_alignment


def check_finite(weight: torch.Tensor, table: str, row_offset: int = 0) -> None:
    """Raise if any value of ``weight [R, D]`` is NaN or +-inf.

    Raises:
        QuantizationError: ``table 't_C3', row 17: contains NaN (column 4)``; the row index is
            ``row_offset`` + the local row (for chunked callers).
    """
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        v = float(weight[r, c])
        what = "NaN" if v != v else ("+inf" if v > 0 else "-inf")
        raise QuantizationError(
            f"table '{table}', row {row_offset + r}: contains {what} (column {c}); "
            "refusing to quantize a table with non-finite weights (was training diverging?)"
        )


def _fp16_round(x: torch.Tensor, direction: str) -> torch.Tensor:
    """float32 ``[R]`` -> float16 ``[R]`` rounded toward ``-inf`` (``down``) or ``+inf`` (``up``)."""
    h = x.to(torch.float16)
    hf = h.float()
    if direction == "down":
        wrong = hf > x
        toward = torch.full_like(h, float("-inf"))
    else:
        wrong = hf < x
        toward = torch.full_like(h, float("inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)


def quantize_rowwise(
    weight: torch.Tensor, bits: int, table: str = "?", row_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise affine quantization (formula in the module docstring).

    Args:
        weight: ``[R, D]`` float32 (any float dtype; computed in float32).
        bits: 8 or 4 (``D`` must be even for 4).
        table: table name for error messages.
        row_offset: added to row indices in error messages.

    Returns:
        ``(codes, scale, bias)``: ``codes`` uint8 ``[R, D]`` (bits=8) or ``[R, D/2]`` packed
        (bits=4, see :func:`pack_int4`); ``scale`` and ``bias`` float16 ``[R]``.

    Raises:
        QuantizationError: NaN/inf in a row, ``|x| > 65504`` (fp16 bias overflow), odd ``D``
            for int4, or bits not in {4, 8}.
    """
    if bits not in (4, 8):
        raise QuantizationError(f"table '{table}': bits must be 8 or 4, got {bits}")
    w = weight.detach().float()
    if w.dim() != 2:
        raise QuantizationError(f"table '{table}': expected a [rows, dim] weight, got shape {tuple(w.shape)}")
    R, D = w.shape
    if bits == 4 and D % 2:
        raise QuantizationError(f"table '{table}': int4 packs two values per byte; embedding_dim {D} is odd")
    check_finite(w, table, row_offset)
    if R == 0 or D == 0:
        z16 = torch.zeros(R, dtype=torch.float16)
        return torch.zeros(R, D * bits // 8, dtype=torch.uint8), z16, z16.clone()
    qmax = (1 << bits) - 1
    lo = w.amin(dim=1)
    hi = w.amax(dim=1)
    too_big = (lo < -_FP16_MAX) | (hi > _FP16_MAX)
    if bool(too_big.any()):
        r = int(torch.nonzero(too_big)[0])
        raise QuantizationError(
            f"table '{table}', row {row_offset + r}: values in [{float(lo[r]):g}, {float(hi[r]):g}] exceed the "
            f"fp16 range (|x| <= {_FP16_MAX:g}) of FBGEMM's per-row scale/bias"
        )
    bias16 = _fp16_round(lo, "down")
    bias = bias16.float()
    scale16 = _fp16_round((hi - bias) / qmax, "up")
    if bool(torch.isinf(scale16).any()):
        r = int(torch.nonzero(torch.isinf(scale16))[0])
        raise QuantizationError(
            f"table '{table}', row {row_offset + r}: range {float(hi[r] - lo[r]):g} / {qmax} overflows an fp16 scale"
        )
    scale = scale16.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - bias[:, None]) / safe[:, None])
    q = torch.where(scale[:, None] > 0, q, torch.zeros_like(q)).clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        q = pack_int4(q)
    return q, scale16, bias16


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[R, D]`` (values 0..15, D even) -> ``[R, D/2]``: ``byte k = c[2k] | c[2k+1] << 4``.

    FBGEMM's nibble order (``FloatToFusedNBitRowwiseQuantizedSBHalf``: element ``col`` goes to
    bits ``(col % 2) * 4`` of byte ``col // 2``).
    """
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[R, D/2]`` uint8 -> ``[R, D]`` uint8 codes 0..15."""
    out = torch.empty(packed.shape[0], dim, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def dequantize_rowwise(
    codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, dim: int
) -> torch.Tensor:
    """``q * scale + bias`` in float32 -> ``[R, dim]``.

    Args:
        codes: uint8 ``[R, dim]`` (8 bits) or packed ``[R, dim/2]`` (4 bits).
        scale, bias: ``[R]`` float16 (or float32).
        bits: 8 or 4.
        dim: ``D``.
    """
    q = unpack_int4(codes, dim) if bits == 4 else codes
    return q.float() * scale.float()[:, None] + bias.float()[:, None]


def quantize_table(weight: torch.Tensor, dtype: str, table: str, chunk_rows: int = CHUNK_ROWS,
                   row_offset: int = 0) -> QuantizedTable:
    """Convert one ``[R, D]`` float table to ``dtype`` storage, in row chunks.

    Args:
        weight: ``[R, D]`` float32 (e.g. ``EmbeddingBagCollection.embedding_weights()[name]``).
        dtype: one of :data:`EMBEDDING_DTYPES`.
        table: table name (error messages, result name).
        chunk_rows: rows per chunk (memory bound).
        row_offset: row of the table ``weight``'s row 0 is (error messages name table rows
            when a table is quantized in slices; the values do not depend on it: every row
            is quantized on its own).

    Returns:
        :class:`QuantizedTable`.

    Raises:
        QuantizationError: NaN/inf (table and row named), fp16 overflow (``|x| > 65504`` for
            fp16 tables too: they would become inf), unknown dtype, odd dim for int4.
    """
    if dtype not in EMBEDDING_DTYPES:
        raise QuantizationError(f"table '{table}': dtype must be one of {list(EMBEDDING_DTYPES)}, got {dtype!r}")
    w = weight.detach()
    R, D = w.shape
    if dtype in ("fp32", "fp16"):
        out = torch.empty(R, D, dtype=torch.float32 if dtype == "fp32" else torch.float16)
        for s in range(0, R, chunk_rows):
            blk = w[s : s + chunk_rows].float()
            check_finite(blk, table, row_offset + s)
            if dtype == "fp16":
                big = blk.abs().amax(dim=1) > _FP16_MAX
                if bool(big.any()):
                    r = int(torch.nonzero(big)[0])
                    raise QuantizationError(
                        f"table '{table}', row {row_offset + s + r}: a value exceeds the fp16 range (|x| <= {_FP16_MAX:g})"
                    )
            out[s : s + chunk_rows] = blk
        return QuantizedTable(table, dtype, R, D, out)
    bits = _BITS[dtype]
    codes = torch.empty(R, D * bits // 8, dtype=torch.uint8)
    scale = torch.empty(R, dtype=torch.float16)
    bias = torch.empty(R, dtype=torch.float16)
    for s in range(0, R, chunk_rows):
        c, sc, b = quantize_rowwise(w[s : s + chunk_rows], bits, table, row_offset=row_offset + s)
        codes[s : s + chunk_rows] = c
        scale[s : s + chunk_rows] = sc
        bias[s : s + chunk_rows] = b
    return QuantizedTable(table, dtype, R, D, codes, scale, bias)


#: Dim multiple FBGEMM's IntNBit TBE needs per storage type (its kernels read rows in 4-element
#: vectors; an int4 row is two codes per byte, so 8 codes = 4 bytes).
TBE_DIM_ALIGN = {"fp32": 4, "fp16": 4, "int8": 4, "int4": 8}


def padded_dim(dim: int, align: int) -> int:
    """``dim`` rounded up to a multiple of ``align``."""
    return -(-int(dim) // align) * align


def pad_columns(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """``weight [R, D]`` widened to ``[R, dim]`` (``dim >= D``) for a kernel's alignment.

    The pad columns repeat each row's minimum, so a row-wise quantized row keeps the scale and
    bias of the unpadded row (its real columns quantize to the same codes); fp32/fp16 rows are
    unaffected either way.  The pad is never read back: callers slice the pooled output (or
    mask the columns) to the real ``D``.  ``dim == D`` returns ``weight`` itself.
    """
    R, D = weight.shape
    if dim == D:
        return weight
    w = weight.detach().float()
    fill = w.amin(dim=1, keepdim=True) if D > 0 else torch.zeros(R, 1)
    return torch.cat([w, fill.expand(R, dim - D)], dim=1)
