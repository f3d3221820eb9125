"""What the sharded EmbeddingBagCollection and the sharded EmbeddingCollection share about the
shards this rank holds: one view of the optimizers fused into their TBEs, the weights of their
dense-kernel shards, and the full tables gathered from (or loaded into) every rank's shards."""

from __future__ import annotations

import torch
from torch import nn

from dlrmctl.distributed.comm import all_reduce
from dlrmctl.modules.embedding_modules import FusedOptimizer


class ShardedTables:
    """What the sharded EBC and the sharded EC share about their local shards (``self.groups``:
    one :class:`EmbeddingSharding` per sharding type, ``self.env``, ``self._spec``); subclasses
    give :meth:`_full_shapes`."""

    def _full_shapes(self) -> list[tuple[str, int, int]]:
        """``(table, rows, dim)`` of every (unsharded) table."""
        raise NotImplementedError

    def fused_optimizer(self) -> FusedOptimizer:
        """One view of the optimizers fused into every local TBE: ``set_lr``,
        ``state_dict`` / ``load_state_dict`` (keys: table name, or
        ``"<table>@<shard index>"`` when this rank holds several shards of a table)."""
        tbes = []
        for g in self.groups:
            counts: dict[str, int] = {}
            for s, *_ in g.local_shards():
                counts[s.table.name] = counts.get(s.table.name, 0) + 1
            for lk, lay in zip(g.lookups, g.layouts[self.env.rank].lookups):
                key = {s.table.name: (s.table.name if counts[s.table.name] == 1 else f"{s.table.name}@{s.shard_index}")
                       for s in lay.shards}
                tbes.extend(lk.fused_optimizer().renamed(key))
        return FusedOptimizer(tbes, self._spec)

    def embedding_dense_parameters(self) -> list[nn.Parameter]:
        """Weights of dense-kernel shards (incl. data_parallel replicas and tables whose dim is not
        a multiple of 4): they need a torch optimizer (``dlrmctl.optim.dense.embedding_optimizer_for_dense``)."""
        return [p for g in self.groups for lk in g.lookups for p in lk.dense_parameters()]

    @torch.no_grad()
    def gather_full_weights(self) -> dict[str, torch.Tensor]:
        """Table -> full ``[rows, dim]`` weights assembled from all ranks' shards.

        For tests and small tables only: materialises every table on every rank
        (one all-reduce); never used in training.  Collective: all ranks must call it.
        """
        full = {n: torch.zeros(r, d, device=self.env.device) for n, r, d in self._full_shapes()}
        for g in self.groups:
            replicated = g.replicated  # identical on every rank: counted once
            for s, w, _, _ in g.local_shards():
                if replicated and self.env.rank != 0:
                    continue
                r0, c0 = s.meta.offsets
                full[s.table.name][r0 : r0 + s.rows, c0 : c0 + s.cols] = w.detach().to(self.env.device)
        if self.env.is_distributed and full:
            flat = torch.cat([v.reshape(-1) for v in full.values()])
            all_reduce(flat, self.env.pg)
            off = 0
            for v in full.values():
                v.copy_(flat[off : off + v.numel()].view_as(v))
                off += v.numel()
        return full

    @torch.no_grad()
    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy each local shard's block out of full ``[rows, dim]`` tables (e.g. a reference model's)."""
        for g in self.groups:
            for s, w, _, _ in g.local_shards():
                if s.table.name in weights:
                    r0, c0 = s.meta.offsets
                    w.copy_(weights[s.table.name][r0 : r0 + s.rows, c0 : c0 + s.cols])
