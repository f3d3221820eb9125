"""The dense part of the inference program (:mod:`dlrmctl.inference.program`) for the dot
interaction, fused over the lookup blocks of :class:`~dlrmctl.inference.lookups.FusedLookups`.

The training model runs, after its lookups, one ``Linear(dim_f, d)`` per narrower table
(:class:`~dlrmctl.modules.dlrm.ProjectedInteraction`, mixed-dimension embeddings), a concatenation
into ``[B, F+1, d]``, the pairwise dots, the over arch, and the first-order term's read-out of the
pooled ``[B, sum of dims]`` row (:class:`~dlrmctl.modules.dlrm.FirstOrder`).  Done literally on the
program's blocks that is ~60 operators, most of them per table: the cost of a small batch, where
every operator is a Python call of the loaded program.  :class:`DotHead` computes the same values
in a fixed handful of operators, whatever the number of tables:

* per block ``[F, B, W]`` (row ``f``: feature ``f``'s pooled lookup, padding columns past its
  dim): the projections of all its lookups as **one** ``bmm`` with ``[F, W, d]`` -- each
  lookup's ``W_f^T`` in its first ``dim_f`` rows, zero rows for the padding (so the padding never
  counts), the identity for a lookup of width ``d`` (no projection in training);
* the first-order read-out as one ``bmm`` of ``[F, 1, W]`` (each lookup's slice of
  ``first_order.sparse.weight``) with the block transposed, ``[F, W, B]``, summed over ``F``: a
  row per feature times the batch, 2.5-3x faster in MKL's batched GEMM than the block times a
  ``[W, 1]`` column (an ``N = 1`` product) at B = 64 and 4096;
* ``T = [dense, lookups]`` ``[B, 1 + L, d]`` built by one ``cat`` in block order (not lookup
  order: the strict upper triangle's flat positions are permuted instead, so the pairs come out
  in the training order), ``T T^T`` by one ``bmm``, the pairs by one ``index_select``.

The sums are the training model's, in another order (float32 rounding: within 1e-6 of the
TorchScript artifact's logits at fp32, ``tests/inference/test_export_pt2.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dlrmctl.inference.lookups import FusedLookups
from dlrmctl.modules.dlrm import InteractionArch, ProjectedInteraction

__all__ = ["DotHead"]


class DotHead(nn.Module):
    """``(dense [B, D_in], blocks) -> logits [B]`` float32 for a DLRM with the dot interaction.

    Args:
        dense_part: the exported dense part (attributes ``dense_norm``, ``dense_arch``,
            ``over_arch``, ``first_order``; ``inter_arch`` read here, not kept).
        lookups: the program's lookups (which block holds which lookup, each block's width).
        projections: per lookup (lookup order) its projection weight ``[d, dim]``, or None
            (width ``d``, unprojected).
        lookup_dim: per lookup its embedding dim.
        triu_flat: the interaction's pair positions (flat, row-major ``[1+L, 1+L]``, lookup order).
        d: the interaction width.
    """

    def __init__(self, dense_part: nn.Module, lookups: FusedLookups, projections: Sequence[Optional[torch.Tensor]],
                 lookup_dim: Sequence[int], triu_flat: torch.Tensor, d: int) -> None:
        super().__init__()
        self.dense_norm = getattr(dense_part, "dense_norm", None)
        self.dense_arch = dense_part.dense_arch
        self.over_arch = dense_part.over_arch
        first_order = getattr(dense_part, "first_order", None)
        self.has_first_order = first_order is not None
        if first_order is not None:
            self.register_buffer("fo_dense", first_order.dense.weight.detach().t().contiguous())  # [D_in, 1]
            w_sparse = first_order.sparse.weight.detach().reshape(-1)  # [sum of dims], lookup order
            starts = [sum(lookup_dim[:i]) for i in range(len(lookup_dim))]
        F, L = lookups.num_features, len(lookup_dim)
        self.d = int(d)
        order: list[int] = []  # lookups in block order
        self.select, self.project, self.narrow = [], [], []
        for b, members in enumerate(lookups.block_members):
            W = lookups.block_width(b)
            rows = [f for f, _ in members]
            self.select.append(rows != list(range(F)))
            if self.select[-1]:
                self.register_buffer(f"rows_{b}", torch.tensor(rows, dtype=torch.int64))
            project = any(projections[i] is not None for _, i in members)
            self.project.append(project)
            self.narrow.append(not project and W != d)
            if project:
                wt = torch.zeros(len(members), W, d)
                for j, (_, i) in enumerate(members):
                    p = projections[i]
                    wt[j, : lookup_dim[i]] = torch.eye(d) if p is None else p.detach().t()
                self.register_buffer(f"proj_{b}", wt)
            if first_order is not None:
                wf = torch.zeros(len(members), 1, W)
                for j, (_, i) in enumerate(members):
                    wf[j, 0, : lookup_dim[i]] = w_sparse[starts[i]: starts[i] + lookup_dim[i]]
                self.register_buffer(f"fo_{b}", wf)
            order += [i for _, i in members]
        # T's row of each of the training order's rows (0: dense, 1 + i: lookup i)
        pos = torch.zeros(L + 1, dtype=torch.int64)
        pos[1 + torch.tensor(order, dtype=torch.int64)] = torch.arange(1, L + 1)
        n = L + 1
        self.register_buffer("triu", pos[triu_flat // n] * n + pos[triu_flat % n])

    @staticmethod
    def build(dense_part: nn.Module, lookups: FusedLookups, lookup_dim: Sequence[int],
              num_features: int) -> Optional["DotHead"]:
        """The fused head of ``dense_part`` when its interaction is the dot one (plain, or behind
        per-table projections) over the program's lookups; None for any other dense part (then
        the program runs ``dense_part`` itself on the pooled columns)."""
        inter = getattr(dense_part, "inter_arch", None)
        if not all(hasattr(dense_part, a) for a in ("dense_arch", "over_arch")) or not lookup_dim:
            return None
        dims = [int(x) for x in lookup_dim]
        if isinstance(inter, ProjectedInteraction) and type(inter.inner) is InteractionArch:
            if list(inter._dims) != dims:
                return None
            d = int(inter.d)
            projections = [None if k < 0 else inter.projections[k].weight for k in inter._proj_index]
            triu = inter.inner.triu_flat
        elif type(inter) is InteractionArch and len(set(dims)) == 1:
            d, projections, triu = dims[0], [None] * len(dims), inter.triu_flat
        else:
            return None
        if triu.numel() != len(dims) * (len(dims) + 1) // 2:
            return None
        return DotHead(dense_part, lookups, projections, dims, triu.detach().cpu(), d)

    def forward(self, dense: torch.Tensor, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """``dense`` ``[B, D_in]``, ``blocks`` each ``[F, B, W]`` -> logits ``[B]`` float32."""
        x = self.dense_norm(dense) if self.dense_norm is not None else dense
        dv = self.dense_arch(x)  # [B, d]
        rows = [dv.unsqueeze(1)]
        fo: Optional[torch.Tensor] = None
        for b, e in enumerate(blocks):
            if self.select[b]:
                e = e.index_select(0, getattr(self, f"rows_{b}"))
            if self.project[b]:
                p = torch.bmm(e, getattr(self, f"proj_{b}"))
            else:
                p = e[:, :, : self.d] if self.narrow[b] else e
            rows.append(p.transpose(0, 1))
            if self.has_first_order:
                s = torch.bmm(getattr(self, f"fo_{b}"), e.transpose(1, 2)).sum(0)  # [1, B]
                fo = s if fo is None else fo + s
        t = torch.cat(rows, 1)  # [B, 1 + L, d], lookups in block order
        pairs = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, self.triu)
        logits = self.over_arch(torch.cat([dv, pairs], 1))  # [B, 1]
        if fo is not None:
            logits = logits + torch.addmm(fo.view(-1, 1), x, self.fo_dense)
        return logits.reshape(-1)
