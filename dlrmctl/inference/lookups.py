"""The embedding lookups of the inference program (:mod:`dlrmctl.inference.program`): fused
embedding-bag kernels that ship with torch, over tables grouped by width.

Tables are grouped by embedding dim (:func:`group_tables`): a group's tables are stacked into one
buffer, each row padded to the group's widest dim, with one all-zero row at the end that every
dropped or invalid id is pointed at (so no id out of range ever reaches a kernel).  One kernel
call per (group, lookup slot) pools every bag of the batch (``F*B`` bags, key-major) into a block
``[F, B, W_g]``; the dot interaction's head (:mod:`dlrmctl.inference.dense_head`) reads the blocks
as they are, other dense parts get the EBC's pooled columns (:meth:`FusedLookups.columns`: one
``index_select``).  Per-feature values (row bases, ranges) reach the key-major ids by one
``repeat_interleave`` over each feature's id count.  Grouping bounds the padding (a
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

from typing import Callable, Optional, Sequence

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
    """Sum-pooled embeddings per block: one fused kernel call per (group, lookup slot) -> ``[F, B, W_g]``.

    Block ``(g, k)`` pools every feature's bags through its ``k``-th table where that table is in
    group ``g`` (the other features read the zero row); row ``f`` of the block is feature ``f``'s
    pooled ``k``-th lookup, its first ``dim`` columns real, the rest padding (codes 0, so
    ``bias * count`` at int8/int4: never read as a value).  :attr:`block_members` says which
    lookups each block holds; :meth:`columns` lays the blocks out as the EBC's ``[B, sum of dims]``.

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
        #: the blocks, in call order: (group, slot) pairs that hold at least one lookup
        self.blocks = [(g, k) for g in range(len(groups)) for k in range(K)
                       if any(table_group[t] == g and s == k for t, s in zip(lookup_table, lookup_slot))]
        #: per block its lookups as (feature row f, lookup index), in lookup order
        self.block_members: list[list[tuple[int, int]]] = []
        #: per block: every feature's k-th table is in the block's group (no id reads the zero row
        #: for being in another group)
        self.block_full: list[bool] = []
        for b, (g, k) in enumerate(self.blocks):
            base = torch.full((F,), -1, dtype=torch.int64)  # row base in g of feature f's k-th table; -1: not in g
            members = []
            for i, (t, s, kk) in enumerate(zip(lookup_table, lookup_src, lookup_slot)):
                if kk == k and table_group[t] == g:
                    base[s] = table_base[t]
                    members.append((int(s), i))
            self.register_buffer(f"base_{b}", base)
            self.block_members.append(members)
            self.block_full.append(bool((base >= 0).all()))
        # pooled columns of :meth:`columns`: block b's [B, F * W_g] slab, feature f's first dim columns
        cols, start = {}, 0
        for b, (g, _) in enumerate(self.blocks):
            for s, i in self.block_members[b]:
                cols[i] = [start + s * self.group_dim[g] + c for c in range(int(tables[lookup_table[i]].embedding_dim))]
            start += F * self.group_dim[g]
        self.register_buffer("cols", torch.tensor([c for i in range(len(lookup_table)) for c in cols[i]],
                                                  dtype=torch.int64))
        self.num_features, self.k_max = F, K

    def block_width(self, b: int) -> int:
        """``W_g`` of block ``b``: its group's stored dim (the widest table's, int4 rounded up to even)."""
        return self.group_dim[self.blocks[b][0]]

    def forward(self, ids: torch.Tensor, oks: Sequence[Optional[torch.Tensor]], starts: torch.Tensor,
                weights: Optional[torch.Tensor], bags: Optional[torch.Tensor], per_id: Callable[[torch.Tensor], torch.Tensor],
                B: int) -> list[torch.Tensor]:
        """Pooled blocks, each ``[F, B, W_g]`` float32 (:attr:`blocks` order).

        Args:
            ids: ``[M]`` int64 ids (any value where not ok).
            oks: per slot ``k`` a ``[M]`` bool mask (the id is looked up in its k-th table), or None:
                every id is (the ``error`` policy passed its check and the feature has a k-th table).
            starts: ``[F*B]`` int64 start of each bag in ``ids`` (key-major; a bag ends where the
                next starts, the last at ``M``).
            weights: ``[M]`` float32 per-id weights, or None.
            bags: ``[M]`` int64 bag of each id (fp16 only; else None).
            per_id: maps a per-feature vector ``[F]`` to its value per id ``[M]``.
        """
        F = self.num_features
        outs = []
        for b, (g, k) in enumerate(self.blocks):
            width, ok = self.group_dim[g], oks[k]
            base = per_id(getattr(self, f"base_{b}"))
            if ok is None and self.block_full[b]:
                rows = ids + base
            else:
                inside = base >= 0 if ok is None else (ok if self.block_full[b] else ok & (base >= 0))
                rows = torch.where(inside, ids + base, self.zero_row[g])
            out = self.bag_sum(getattr(self, f"weight_{g}"), rows, starts, weights, bags, width)  # [F*B, width]
            outs.append(out.view(F, B, width))
        return outs

    def columns(self, blocks: Sequence[torch.Tensor], B: int) -> torch.Tensor:
        """The blocks as the EBC's pooled embeddings ``[B, sum of lookup dims]`` (lookup order)."""
        slabs = [x.transpose(0, 1).reshape(B, -1) for x in blocks]
        return (slabs[0] if len(slabs) == 1 else torch.cat(slabs, 1)).index_select(1, self.cols)

    def bag_sum(self, table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                weights: Optional[torch.Tensor], bags: Optional[torch.Tensor], width: int) -> torch.Tensor:
        """Sum of ``table``'s ``rows`` (``[M]``, in range) per bag -> ``[F*B, width]`` float32."""
        if self.dtype == "int8":
            return torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                table, rows, starts, False, 0, False, weights, None, False)
        if self.dtype == "int4":
            return torch.ops.quantized.embedding_bag_4bit_rowwise_offsets(
                table, rows, starts, False, 0, False, weights, None, False)
        if self.dtype == "fp32":
            return nn.functional.embedding_bag(rows, table, starts, mode="sum", per_sample_weights=weights)
        assert bags is not None
        vals = cast(table[rows], torch.float32)
        if weights is not None:
            vals = vals * weights[:, None]
        out = torch.zeros_like(starts, dtype=torch.float32)[:, None].expand(-1, width).contiguous()
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
