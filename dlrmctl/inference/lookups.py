"""The embedding lookups of the inference program (:mod:`dlrmctl.inference.program`): fused
embedding-bag kernels that ship with torch, over tables grouped by width.

Tables are grouped by embedding dim (:func:`group_tables`): a group's tables are stacked into one
buffer, each row padded to the group's widest dim, with one all-zero row at the end that every
dropped or invalid id is pointed at (so no id out of range ever reaches a kernel).  One kernel
call per (group, lookup slot) pools every bag of the batch (``F*B`` bags, key-major); the pooled
columns are then picked per lookup in one ``index_select``.  Grouping bounds the padding (a
group's padded bytes are at most ``1 + MAX_PAD_WASTE`` times its tables' own) while keeping the
number of calls -- and so the per-call cost at small batches -- small.

Kernels and row layouts per storage dtype (``D``: the group's stored dim):

* int8: ``torch.ops.quantized.embedding_bag_byte_rowwise_offsets``, rows
  ``[D codes uint8][scale float32][bias float32]`` (``D + 8`` bytes);
* int4: ``torch.ops.quantized.embedding_bag_4bit_rowwise_offsets``, rows
  ``[D/2 bytes, two codes each, low nibble first][scale fp16][bias fp16]`` (``D/2 + 4`` bytes);
* fp32: ``aten.embedding_bag`` (sum, float32 accumulation);
* fp16: the ids' rows gathered, widened to float32 and added into their bags with ``index_add``
  (``aten.embedding_bag`` on fp16 sums in fp16, 2**-11 relative, which would not match FBGEMM's
  float32 accumulation).

``scale`` and ``bias`` are the fp16 values the quantizer stores (:mod:`dlrmctl.inference.quantize`),
so a row dequantizes to ``q * scale + bias`` exactly as FBGEMM's IntNBit TBE computes it.  Pad
columns (int8/int4 codes 0, fp values 0) are computed but never selected.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dlrmctl.inference.quantize import QuantizedTable

__all__ = ["FusedLookups", "cast", "group_tables", "MAX_PAD_WASTE", "register_int4_meta", "row_bytes"]

#: A group's padded table bytes are at most ``1 + MAX_PAD_WASTE`` times its tables' own.
MAX_PAD_WASTE = 0.125
_SB_BYTES = {"int8": 8, "int4": 4, "fp16": 0, "fp32": 0}  # scale + bias bytes per row


def row_bytes(dtype: str, dim: int) -> int:
    """Bytes of one row of ``dim`` columns in the kernel layout (module doc)."""
    codes = {"int8": dim, "int4": (dim + 1) // 2, "fp16": 2 * dim, "fp32": 4 * dim}[dtype]
    return codes + _SB_BYTES[dtype]


def group_tables(rows: Sequence[int], dims: Sequence[int], dtype: str,
                 max_waste: float = MAX_PAD_WASTE) -> list[list[int]]:
    """Tables grouped for stacking: widest first, a table joins the current group while the
    group's padded bytes stay within ``1 + max_waste`` of its tables' own bytes (``rows`` x
    :func:`row_bytes`), else it starts a new group.  Returns table indices per group."""
    order = sorted(range(len(dims)), key=lambda t: (-dims[t], t))
    groups: list[list[int]] = []
    for t in order:
        if groups:
            g = groups[-1] + [t]
            width = dims[groups[-1][0]]
            own = sum(rows[u] * row_bytes(dtype, dims[u]) for u in g)
            if sum(rows[u] for u in g) * row_bytes(dtype, width) <= (1 + max_waste) * own:
                groups[-1] = g
                continue
        groups.append([t])
    return groups


def _kernel_rows(q: QuantizedTable, dim: int) -> torch.Tensor:
    """``q``'s rows in the kernel layout, codes / values padded with zeros to ``dim`` columns."""
    R = int(q.num_embeddings)
    data = q.data if q.data.dim() == 2 else q.data.reshape(R, -1)
    width = (dim + 1) // 2 if q.dtype == "int4" else dim
    if data.shape[1] < width:
        data = torch.cat([data, torch.zeros(R, width - data.shape[1], dtype=data.dtype)], 1)
    if q.dtype in ("int8", "int4"):
        assert q.scale is not None and q.bias is not None
        sb_dtype = torch.float32 if q.dtype == "int8" else torch.float16
        sb = torch.stack([q.scale.to(sb_dtype), q.bias.to(sb_dtype)], 1).contiguous().view(torch.uint8)
        data = torch.cat([data, sb.reshape(R, -1)], 1)
    return data


class FusedLookups(nn.Module):
    """Sum-pooled embeddings of every lookup, ``[B, sum of lookup dims]`` float32 (lookup order).

    Args:
        tables: the quantized tables (one storage dtype); an int4 table of odd dim holds one pad
            code per row (``embedding_dim`` the real dim).
        lookup_table: per lookup its table index.
        lookup_src: per lookup the input feature it reads.
        lookup_slot: per lookup its slot ``k`` among its feature's lookups (a feature feeding ``K``
            tables is looked up ``K`` times).
        num_features: ``F``.
        k_max: ``K``, the most lookups of one feature.
        max_waste: padding bound of :func:`group_tables`.
    """

    def __init__(self, tables: Sequence[QuantizedTable], lookup_table: Sequence[int], lookup_src: Sequence[int],
                 lookup_slot: Sequence[int], num_features: int, k_max: int, max_waste: float = MAX_PAD_WASTE) -> None:
        super().__init__()
        self.dtype = tables[0].dtype if tables else "fp32"
        F, K = num_features, k_max
        stored = [int(q.embedding_dim) + (int(q.embedding_dim) % 2 if q.dtype == "int4" else 0) for q in tables]
        groups = group_tables([int(q.num_embeddings) for q in tables], stored, self.dtype, max_waste)
        table_group, table_base = {}, {}
        self.group_dim, self.zero_row = [], []
        for g, members in enumerate(groups):
            width = stored[members[0]]
            parts, r = [], 0
            for t in members:
                table_group[t], table_base[t] = g, r
                parts.append(_kernel_rows(tables[t], width))
                r += int(tables[t].num_embeddings)
            parts.append(torch.zeros_like(parts[0][:1]))  # the zero row
            self.register_buffer(f"weight_{g}", torch.cat(parts).contiguous())
            self.group_dim.append(width)
            self.zero_row.append(r)
        # base[g, k, f]: row base in group g of feature f's k-th table (-1: that table is not in g)
        base = torch.full((len(groups), K, F), -1, dtype=torch.int64)
        for t, s, k in zip(lookup_table, lookup_src, lookup_slot):
            base[table_group[t], k, s] = table_base[t]
        self.register_buffer("base", base)
        # pooled columns: block (g, k) of the concatenated kernel outputs holds [B, F * D_g]
        block, start = {}, 0
        for g in range(len(groups)):
            for k in range(K):
                block[g, k] = start
                start += F * self.group_dim[g]
        cols = [block[table_group[t], k] + s * self.group_dim[table_group[t]] + c
                for t, s, k in zip(lookup_table, lookup_src, lookup_slot) for c in range(int(tables[t].embedding_dim))]
        self.register_buffer("cols", torch.tensor(cols, dtype=torch.int64))
        self.num_features, self.k_max = F, K

    def forward(self, ids: torch.Tensor, oks: Sequence[torch.Tensor], offsets: torch.Tensor,
                weights: Optional[torch.Tensor], bags: Optional[torch.Tensor], feat: torch.Tensor,
                B: int) -> torch.Tensor:
        """``ids`` ``[M]`` int64 (any values where not ok), ``oks`` per slot ``[M]`` bool (the id is
        looked up in its k-th table), ``offsets`` ``[F*B + 1]`` int64 bag bounds, ``weights``
        ``[M]`` float32 per-id weights or None, ``bags`` ``[M]`` int64 bag of each id (fp16 only;
        else None), ``feat`` ``[M]`` int64 feature of each id -> ``[B, sum of lookup dims]``."""
        F = self.num_features
        outs = []
        for g, width in enumerate(self.group_dim):
            table = getattr(self, f"weight_{g}")
            for k in range(self.k_max):
                base = self.base[g, k][feat]
                rows = torch.where(oks[k] & (base >= 0), ids + base, self.zero_row[g])
                out = self.bag_sum(table, rows, offsets, weights, bags, width)  # [F*B, width]
                outs.append(out.view(F, B, width).transpose(0, 1).reshape(B, F * width))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).index_select(1, self.cols)

    def bag_sum(self, table: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                weights: Optional[torch.Tensor], bags: Optional[torch.Tensor], width: int) -> torch.Tensor:
        """Sum of ``table``'s ``rows`` (``[M]``, in range) per bag -> ``[F*B, width]`` float32."""
        if self.dtype == "int8":
            return torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                table, rows, offsets, False, 0, False, weights, None, True)
        if self.dtype == "int4":
            return torch.ops.quantized.embedding_bag_4bit_rowwise_offsets(
                table, rows, offsets, False, 0, False, weights, None, True)
        if self.dtype == "fp32":
            return nn.functional.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=weights,
                                               include_last_offset=True)
        assert bags is not None
        vals = cast(table[rows], torch.float32)
        if weights is not None:
            vals = vals * weights[:, None]
        out = torch.zeros_like(offsets[1:], dtype=torch.float32)[:, None].expand(-1, width).contiguous()
        return out.index_add(0, bags, vals)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as ``dtype`` on its own device.  ``x.to(dtype)`` would trace, under torch.export, to an
    alias guarded by an assertion of the tracing device (CPU), which a program run on CUDA fails."""
    return torch.ops.aten._to_copy(x, dtype=dtype)


_META_LIB: list = []


def register_int4_meta() -> None:
    """Register a meta kernel for ``quantized::embedding_bag_4bit_rowwise_offsets`` (torch ships
    none, so ``torch.export`` cannot trace the op without it; its byte counterpart has one).
    Output ``[bags, 2 * (row bytes - 4)]`` float32.  Needed to trace (export, AOTInductor), never
    to load or run a saved program.  Idempotent; a kernel torch registers itself is kept."""
    if _META_LIB:
        return
    if torch._C._dispatch_has_kernel_for_dispatch_key("quantized::embedding_bag_4bit_rowwise_offsets", "Meta"):
        _META_LIB.append(None)
        return
    lib = torch.library.Library("quantized", "IMPL")

    def meta(weight, indices, offsets=None, scale_grad_by_freq=False, mode=0, pruned_weights=False,
             per_sample_weights=None, compressed_indices_mapping=None, include_last_offset=False):
        bags = offsets.size(0) - (1 if include_last_offset else 0)
        return weight.new_empty((bags, 2 * (weight.size(1) - 4)), dtype=torch.float32)

    lib.impl("embedding_bag_4bit_rowwise_offsets", meta, "Meta")
    _META_LIB.append(lib)  # the registration lives as long as the library object
