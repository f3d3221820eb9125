"""The per-plan machinery of the sharded EBC's input and output dist, built once per sharding
plan: :class:`InputDistPlan` (the send / receive permutations and size rows of the one
all-to-all of every sharding type's ids) with its per-step :class:`RecvLayout`, and the
reassembly of the output dist's column blocks into table order (:class:`ColumnAssembly`).
Used by :class:`~dlrmctl.distributed.sharded_ebc.ShardedEmbeddingBagCollection`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dlrmctl.distributed.sharding.common import EmbeddingSharding
from dlrmctl.sparse.permute import SegmentPermutation


class ColumnAssembly:
    """Puts the columns of several ``[B, w_k]`` tensors into table order in one copy.

    Args:
        labels: per tensor, the output column of each of its columns; together
            a permutation of ``range(total)``.
    """

    def __init__(self, labels: list[list[int]], total: int) -> None:
        where = {}
        for k, labs in enumerate(labels):
            for src, e in enumerate(labs):
                where[e] = (k, src)
        if sorted(where) != list(range(total)) or sum(map(len, labels)) != total:
            raise AssertionError(f"sharded output columns do not tile the table columns: {labels}")
        blocks: list[list[int]] = []  # [tensor, src_start, length, out_start]
        for e in range(total):
            k, src = where[e]
            if blocks and blocks[-1][0] == k and blocks[-1][1] + blocks[-1][2] == src:
                blocks[-1][2] += 1
            else:
                blocks.append([k, src, 1, e])
        self.blocks = [tuple(b) for b in blocks]
        self.n = len(labels)
        self.widths = [len(x) for x in labels]
        self.back = [sorted((b for b in self.blocks if b[0] == k), key=lambda b: b[1]) for k in range(self.n)]
        self.identity = self.n == 1 and len(self.blocks) == 1

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.identity:
            return tensors[0]
        return AssembleColumns.apply(self, *tensors)


class AssembleColumns(torch.autograd.Function):
    """Forward: one ``cat`` of column slices; backward: one ``cat`` per input
    (cheaper than ``index_select`` + its ``index_add`` backward), or, for an input that is one
    column block, a strided view of the gradient (no copy: every consumer copies it once anyway,
    the pooled all-to-all into its send buffer, the reduce-scatter and the lookups by their own
    ``contiguous()``)."""

    @staticmethod
    def forward(ctx, plan: ColumnAssembly, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        return torch.cat([tensors[k][:, s : s + n] for k, s, n, _ in plan.blocks], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        grads = []
        for k in range(plan.n):
            parts = [grad[:, o : o + n] for _, _, n, o in plan.back[k]]
            if not parts:  # a zero-width block (a rank holding nothing of a group)
                grads.append(grad.new_zeros(grad.shape[0], 0))
            else:
                grads.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return (None, *grads)


def weights_to_wire(w: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """float32 weights ``[N]`` -> their bits as ``wire`` ints (int32: a view; int64: widened)."""
    bits = w.contiguous().view(torch.int32)
    return bits if wire == torch.int32 else bits.to(wire)


@dataclass
class RecvLayout:
    """Host sizes of one step's received data (after the size exchange).

    Attributes:
        batch_sizes / full_batch_sizes: every source's local batch (lookup batch / full).
        stride: ``sum(batch_sizes)``.
        slices: per comm group, ``(lengths offset, lengths numel, values offset, values numel,
            length_per_key)`` in the permuted receive buffer (weights follow the values).
    """

    batch_sizes: list[int]
    full_batch_sizes: list[int]
    stride: int
    slices: list[tuple[int, int, int, int, list[int]]]


class InputDistPlan:
    """What the input dist of a sharding plan needs every step, built once per plan.

    Send side: the comm groups' sources (:meth:`EmbeddingSharding.input_dist_source`) are
    concatenated as ``[lengths_0, values_0, (weights_0), lengths_1, ...]`` — segments of ``B``
    lengths and of ``counts`` ids each; :attr:`send_perm` puts them in destination order
    (per destination ``d``, per group: d's features' lengths, ids, weights: the wire format),
    with a feature repeated for every rank holding a shard of its table.  The size row of
    ``d`` is ``[B, full B, counts of d's features]``: :attr:`meta_idx` gathers it from
    ``[B, full B, counts of every group]``.  Receive side: :attr:`recv_perm` turns the
    ``(source, group, lengths|ids|weights, feature)`` segments into ``(group, kind, feature,
    source)`` order, the lookup KJTs' layout, with segment lengths gathered from the received
    size rows by :attr:`recv_seg_idx` (nothing goes host -> device but ``[B, full B]``).

    Args:
        groups: the communicating groups, in the EBC's order.
        world_size / rank: this rank.
        weighted: weights travel with the ids.
        device: where the index tensors live.
    """

    def __init__(self, groups: Sequence[EmbeddingSharding], world_size: int, rank: int, weighted: bool,
                 device: torch.device) -> None:
        W = world_size
        kinds = 3 if weighted else 2
        self.mult = kinds - 1
        S = [g.num_source_segments() for g in groups]
        cbase = [2 + sum(S[:k]) for k in range(len(groups))]  # group k's counts in [B, B_full, counts...]
        sbase = [kinds * sum(S[:k]) for k in range(len(groups))]  # group k's first source segment
        self.send_feats = [[g.send_segments(d) for g in groups] for d in range(W)]  # [d][k] -> segments
        meta_idx: list[int] = []
        self.meta_in: list[int] = []
        perm: list[int] = []
        for d in range(W):
            meta_idx.extend([0, 1])
            for k, fs in enumerate(self.send_feats[d]):
                meta_idx.extend(cbase[k] + j for j in fs)
                for kind in range(kinds):
                    perm.extend(sbase[k] + kind * S[k] + j for j in fs)
            self.meta_in.append(2 + sum(len(fs) for fs in self.send_feats[d]))
        send_seg_idx = [0 if kind == 0 else cbase[k] + j
                        for k in range(len(groups)) for kind in range(kinds) for j in range(S[k])]
        self.n_recv = [len(g.layouts[rank].features) for g in groups]
        M = 2 + sum(self.n_recv)
        self.meta_out = [M] * W
        moff = [2 + sum(self.n_recv[:k]) for k in range(len(groups))]
        # received segments in arrival order (s, k, kind, f); their lengths in the size rows
        seg_of: dict[tuple[int, int, int, int], int] = {}
        recv_seg_idx: list[int] = []
        for s in range(W):
            for k, n in enumerate(self.n_recv):
                for kind in range(kinds):
                    for f in range(n):
                        seg_of[s, k, kind, f] = len(recv_seg_idx)
                        recv_seg_idx.append(s * M + (0 if kind == 0 else moff[k] + f))
        recv_perm = [seg_of[s, k, kind, f] for k, n in enumerate(self.n_recv) for kind in range(kinds)
                     for f in range(n) for s in range(W)]
        self.moff = moff
        self.M = M
        self.meta_idx = torch.tensor(meta_idx, dtype=torch.int64, device=device)
        self.send_seg_idx = torch.tensor(send_seg_idx, dtype=torch.int64, device=device)
        self.recv_seg_idx = torch.tensor(recv_seg_idx, dtype=torch.int64, device=device)
        self.send_perm = SegmentPermutation(perm, len(send_seg_idx), device)
        self.recv_perm = SegmentPermutation(recv_perm, len(recv_seg_idx), device)

    def sizes(self, sent: list[int], received: list[int], B: int) -> tuple[list[int], list[int], RecvLayout]:
        """Host split sizes from the size rows: ``(in_splits, out_splits, receive layout)``.

        Args:
            sent: the flat size rows this rank sent (``meta_in`` row lengths).
            received: the flat size rows received, ``W`` rows of ``M``.
            B: this rank's lookup batch.
        """
        mult = self.mult
        in_splits, pos = [], 0
        for d, row_len in enumerate(self.meta_in):
            row = sent[pos + 2 : pos + row_len]
            nf = row_len - 2
            in_splits.append(nf * B + mult * sum(row))
            pos += row_len
        M, W = self.M, len(self.meta_out)
        rows = [received[s * M : (s + 1) * M] for s in range(W)]
        bs = [r[0] for r in rows]
        stride = sum(bs)
        out_splits = [(M - 2) * r[0] + mult * sum(r[2:]) for r in rows]
        slices, off = [], 0
        for k, n in enumerate(self.n_recv):
            a = self.moff[k]
            lpk = [sum(r[a + f] for r in rows) for f in range(n)]
            n_v = sum(lpk)
            slices.append((off, n * stride, off + n * stride, n_v, lpk))
            off += n * stride + mult * n_v
        return in_splits, out_splits, RecvLayout(bs, [r[1] for r in rows], stride, slices)
