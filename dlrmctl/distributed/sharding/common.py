"""What every sharding type shares: the interface and the per-rank bookkeeping.

One :class:`EmbeddingSharding` holds the tables of one sharding type of one
:class:`~dlrmctl.distributed.sharded_ebc.ShardedEmbeddingBagCollection` on this
rank.  It answers four questions (TorchRec's interface):

* **shard metadata** — :meth:`shard_table` (a classmethod per type file) builds
  a table's :class:`ParameterSharding`; :attr:`layouts` says which shards each
  rank holds.
* **input_dist** — :meth:`input_dist_counts` says how many ids of each feature
  go to each destination (host ints, or a device tensor for row-wise kinds that
  is read back together with the size exchange, in one host sync), then
  :meth:`input_dist_chunks` turns this rank's local-batch KJT into int64 chunks
  per destination rank (lengths, then ids already local to the destination's
  shard, then weights bit-cast to int64); :meth:`input_dist_recv` turns the chunks received from every
  source into the lookup's KJT (key-major, batch = all sources' samples in rank
  order).  The collectives themselves are issued once for all sharding types by
  the sharded EBC (one all-to-all for the counts, one for the data).
* **lookup** — :meth:`compute`: one :class:`GroupedEmbeddingLookup` per
  (shard slot, compute kernel) over this rank's shards.
* **output_dist** — :meth:`output_dist_recv` turns the pooled blocks received
  from every owner rank into this rank's ``[B_local, cols]`` output (a
  concatenation for table/column-wise kinds, a sum for row-wise kinds), with
  the EBC column of each output column.

Data layout conventions (all on ``env.device``):

* group features: the features of this type's tables in EBC order; column
  ``c`` of feature ``i`` in the group output is ``feature_offsets[i] + c``.
* rows of a lookup output are sources' samples in rank order
  (``sum(batch_sizes)`` rows).

The table-like and row-like kinds every type file builds on are :mod:`.kinds`'; the row-wise
bucketize core is :mod:`.bucketize`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
from torch import nn

from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.types import (
    ComputeKernel,
    ParameterSharding,
    PlanError,
    ShardingType,
    ShardMetadata,
    construct_parameter_sharding,
)
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec, GroupedEmbeddingLookup
from dlrmctl.sparse import KeyedJaggedTensor
from dlrmctl.sparse.jagged_tensor import host_to_device
from dlrmctl.sparse.permute import SegmentPermutation

log = logging.getLogger(__name__)


@dataclass
class LocalShard:
    """One shard held by a rank: ``table`` rows ``[r0, r0+rows)`` x cols ``[c0, c0+cols)``."""

    table: EmbeddingBagConfig
    shard_index: int
    meta: ShardMetadata
    kernel: ComputeKernel

    @property
    def rows(self) -> int:
        return self.meta.sizes[0]

    @property
    def cols(self) -> int:
        return self.meta.sizes[1]


@dataclass
class LookupLayout:
    """One GroupedEmbeddingLookup of a rank: its shards (at most one per table),
    the positions of its features in the rank's received KJT, and the group
    output column of each of its output columns."""

    kernel: ComputeKernel
    shards: list[LocalShard]
    feature_pos: list[int]
    out_cols: list[int]


@dataclass
class RankLayout:
    """What rank ``d`` holds of a group: received features and lookups."""

    features: list[int]  # group feature indices received (sorted, unique)
    lookups: list[LookupLayout]

    @property
    def out_cols(self) -> list[int]:
        return [c for lk in self.lookups for c in lk.out_cols]

    @property
    def width(self) -> int:
        return sum(len(lk.out_cols) for lk in self.lookups)


def weights_to_int64(w: torch.Tensor) -> torch.Tensor:
    """float32 ``[N]`` -> int64 ``[N]`` holding the same bits (so weights travel with the ids)."""
    return w.contiguous().view(torch.int32).to(torch.int64)


def int64_to_weights(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).view(torch.float32)


class EmbeddingSharding(nn.Module):
    """Tables of one sharding type on this rank (see the module docstring).

    Args:
        tables: this type's tables, in EBC order.
        shardings: table name -> its ParameterSharding (already validated).
        env: this rank.
        is_weighted: inputs carry per-id weights.
        optimizer: fused optimizer hyper-parameters.
        seed: deterministic init seed (sharding-independent).
    """

    sharding_type: ClassVar[ShardingType]
    #: row-wise kinds: ids are bucketized by row range, partial sums are reduced.
    row_wise: ClassVar[bool] = False
    #: data_parallel: no communication at all.
    needs_comm: ClassVar[bool] = True
    #: data_parallel: every rank holds whole tables (gathered once; gradients summed over ranks,
    #: :meth:`replicated_parameters`).
    replicated: ClassVar[bool] = False
    #: the output dist is one reduce-scatter (row-wise kinds: NCCL, the same layout on every rank).
    use_reduce_scatter: bool = False
    #: the output dist is the group's own two-level one (table_row_wise across hosts).
    hierarchical: bool = False
    #: route the managed features' raw ids by zone (training; :meth:`routes_raw_ids` groups only).
    raw_ids: bool = False

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        shardings: dict[str, ParameterSharding],
        env: ShardingEnv,
        is_weighted: bool,
        optimizer: EmbeddingOptimizerSpec,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.shardings = {t.name: shardings[t.name] for t in self.tables}
        self.env = env
        self.is_weighted = is_weighted
        self.device = env.device
        self.features: list[str] = [f for t in self.tables for f in t.feature_names]
        self.feature_table: list[int] = [i for i, t in enumerate(self.tables) for _ in t.feature_names]
        dims = [self.tables[i].embedding_dim for i in self.feature_table]
        self.feature_offsets = [0]
        for d in dims:
            self.feature_offsets.append(self.feature_offsets[-1] + d)
        self.width = self.feature_offsets[-1]
        self.feature_is_mean = [self.tables[i].pooling == PoolingType.MEAN for i in self.feature_table]
        for t in self.tables:
            self.validate_sharding(t, self.shardings[t.name])
        self.layouts: list[RankLayout] = [self._rank_layout(d) for d in range(env.world_size)]
        me = self.layouts[env.rank]
        self.lookups = nn.ModuleList(self.make_lookup(lk, optimizer, seed) for lk in me.lookups)
        self._lookup_identity = [lk.feature_pos == list(range(len(me.features))) for lk in me.lookups]
        #: world size -> the receive side's segment permutation (:meth:`input_dist_recv`)
        self._recv_perms: dict[int, SegmentPermutation] = {}

    # ------------------------------------------------------------ family hooks (what the EBC asks)
    def configure_output_dist(self, reduce_scatter: bool | None, hierarchical: bool | None) -> None:
        """Overrides of this group's output-dist choice (None: keep its own): ``reduce_scatter``
        for the row-wise kinds, ``hierarchical`` for table_row_wise; the other kinds ignore them."""

    def routes_raw_ids(self) -> bool:
        """Whether this group routes managed-collision raw ids by zone (row-wise kinds given a
        routing, :meth:`RowWiseLikeSharding.set_raw_routing`)."""
        return False

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Weights whose gradients are summed over ranks (data_parallel replicas; none here)."""
        return []

    def make_lookup(self, lk: LookupLayout, optimizer: EmbeddingOptimizerSpec, seed: int) -> nn.Module:
        """The local lookup over ``lk.shards``: a pooled :class:`GroupedEmbeddingLookup` (sum
        pooling for row-wise kinds).  The sequence (EmbeddingCollection) shardings override it."""
        return GroupedEmbeddingLookup(
            [(s.table, s.rows, s.cols, s.meta.offsets[0], s.meta.offsets[1]) for s in lk.shards],
            compute_kernel=lk.kernel.value,
            device=self.env.device,
            optimizer=optimizer,
            is_weighted=self.is_weighted,
            seed=seed,
            pooling_override=PoolingType.SUM if self.row_wise else None,
        )

    # ------------------------------------------------------------ metadata
    @classmethod
    def shard_table(
        cls,
        table: EmbeddingBagConfig,
        ranks: Sequence[int],
        compute_kernel: ComputeKernel | str = ComputeKernel.FUSED,
        column_sizes: Sequence[int] | None = None,
    ) -> ParameterSharding:
        """The ParameterSharding of ``table`` for this type on ``ranks``
        (:func:`~dlrmctl.distributed.types.construct_parameter_sharding`: table-wise one rank,
        row kinds ``ceil(rows / len(ranks))`` blocks, column kinds ``column_sizes`` or an even split).
        """
        return construct_parameter_sharding(
            cls.sharding_type, table.num_embeddings, table.embedding_dim, ranks, compute_kernel, column_sizes
        )

    @classmethod
    def validate_sharding(cls, table: EmbeddingBagConfig, ps: ParameterSharding) -> None:
        """Type-specific checks beyond :meth:`ShardingPlan.validate` (override)."""
        if ps.sharding_type != cls.sharding_type:
            raise PlanError(f"table '{table.name}': {ps.sharding_type.value} given to {cls.__name__}")

    def _shards_on(self, d: int) -> list[LocalShard]:
        out = []
        for t in self.tables:
            ps = self.shardings[t.name]
            for i, m in enumerate(ps.shards or []):
                if m.rank == d:
                    out.append(LocalShard(t, i, m, ps.compute_kernel))
        return out

    def _rank_layout(self, d: int) -> RankLayout:
        shards = self._shards_on(d)
        tidx = {t.name: i for i, t in enumerate(self.tables)}
        feats = sorted({fi for s in shards for fi, ti in enumerate(self.feature_table) if ti == tidx[s.table.name]})
        pos_of = {f: p for p, f in enumerate(feats)}
        # slot k = k-th shard of a table on this rank (a lookup holds one shard per table)
        seen: dict[str, int] = {}
        slots: dict[tuple[int, str], list[LocalShard]] = {}
        for s in shards:
            k = seen.get(s.table.name, 0)
            seen[s.table.name] = k + 1
            slots.setdefault((k, s.kernel.value), []).append(s)
        lookups = []
        for (k, kernel), group in sorted(slots.items(), key=lambda kv: (kv[0][0], kv[0][1] != "fused")):
            fpos, cols = [], []
            for s in group:
                for fi, ti in enumerate(self.feature_table):
                    if ti == tidx[s.table.name]:
                        fpos.append(pos_of[fi])
                        base = self.feature_offsets[fi] + s.meta.offsets[1]
                        cols.extend(range(base, base + s.cols))
            lookups.append(LookupLayout(ComputeKernel(kernel), group, fpos, cols))
        return RankLayout(feats, lookups)

    # ----------------------------------------------------------- input dist
    def input_dist_counts(self, kjt: KeyedJaggedTensor) -> tuple[object, list[list[int]] | torch.Tensor]:
        """First half of the send side: how many ids go to each destination.

        Args:
            kjt: ``self.features`` (in order), local batch ``B``, global ids.

        Returns:
            ``(state, counts)``: ``counts`` is either host ints, ``counts[d][j]`` =
            ids of d's ``j``-th received feature (``layouts[d].features``), known
            without reading the device (table-wise kinds: the KJT's
            ``length_per_key``); or a device tensor ``[W, F]`` over all group features
            (row-wise kinds: ids per destination after bucketizing), which the
            sharded EBC ships in the size all-to-all and reads back in the same one
            host sync as the sizes it receives.
        """
        raise NotImplementedError

    def input_dist_chunks(self, state: object, counts: list[list[int]]) -> list[list[torch.Tensor]]:
        """Second half: per destination ``d``, int64 tensors to send in order (lengths
        ``[len(layouts[d].features) * B]`` key-major, ids local to d's shards, weights
        as int64 bits when weighted).

        Args:
            state: from :meth:`input_dist_counts`.
            counts: host ints in the layout of :meth:`input_dist_counts`'s ``counts``
                (``[W][F]`` for row-wise kinds).
        """
        raise NotImplementedError

    # the vectorized send side (the sharded EBC): this rank's ids as segments, and which segments
    # each destination receives -- a plan constant the EBC turns into one segment permutation
    def num_source_segments(self) -> int:
        """``S``: the segments :meth:`input_dist_source` cuts its lengths / values into."""
        raise NotImplementedError

    def send_segments(self, d: int) -> list[int]:
        """Static: the source segment of each feature rank ``d`` receives (``layouts[d].features`` order)."""
        raise NotImplementedError

    def input_dist_source(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's ids as ``S = num_source_segments()`` segments, nothing read to the host.

        Args:
            kjt: ``self.features`` (in order), local batch ``B``, global ids.

        Returns:
            ``(lengths [S * B], values [N], weights [N] float32 or None, counts [S])``: segment
            ``j`` is ``lengths[j*B:(j+1)*B]`` and ``counts[j]`` consecutive values (ids already
            local to the destination's shard) and weights; ``counts`` on the device.
        """
        raise NotImplementedError

    def input_dist_send(self, kjt: KeyedJaggedTensor) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
        """Both halves at once (reads device counts back itself): ``(chunks, counts per d)``."""
        state, counts = self.input_dist_counts(kjt)
        host = counts.tolist() if torch.is_tensor(counts) else counts
        chunks = self.input_dist_chunks(state, host)
        if torch.is_tensor(counts):
            host = [[host[d][f] for f in self.layouts[d].features] for d in range(self.env.world_size)]
        return chunks, host

    def input_dist_recv(
        self, batch_sizes: Sequence[int], counts: Sequence[Sequence[int]], chunks: Sequence[torch.Tensor]
    ) -> KeyedJaggedTensor:
        """Assemble the lookup input from what every source sent.

        Args:
            batch_sizes: local batch size of every rank.
            counts: per source, ids per received feature (``layouts[rank].features``).
            chunks: per source, the int64 data (lengths, ids, weights).

        Returns:
            KJT over ``layouts[rank].features``, stride ``sum(batch_sizes)``,
            samples of source 0 first.
        """
        me = self.layouts[self.env.rank]
        F = len(me.features)
        keys = [self.features[f] for f in me.features]
        W = len(chunks)
        kinds = 3 if self.is_weighted else 2
        # (source, lengths|ids|weights, feature) segments -> (kind, feature, source): one segment
        # permutation (a plan constant, cached per world size) instead of a split per (source, feature)
        perm = self._recv_perms.get(W)
        if perm is None:
            order = [(s * kinds + k) * F + f for k in range(kinds) for f in range(F) for s in range(W)]
            perm = self._recv_perms[W] = SegmentPermutation(order, W * kinds * F, self.device)
        seg: list[int] = []
        for s in range(W):
            seg.extend([int(batch_sizes[s])] * F)
            c = [int(x) for x in counts[s]]
            seg.extend(c * (kinds - 1))
        data = torch.cat(list(chunks)) if W > 1 else chunks[0]
        out = perm.apply(host_to_device(seg, torch.int64, data.device), data, data.numel())
        stride = int(sum(batch_sizes))
        lpk = [sum(int(counts[s][f]) for s in range(W)) for f in range(F)]
        n = sum(lpk)
        lengths, values = out[: F * stride], out[F * stride : F * stride + n]
        weights = int64_to_weights(out[F * stride + n : F * stride + 2 * n]) if self.is_weighted else None
        return KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights, stride=stride, validate=False,
                                 length_per_key=lpk)

    # --------------------------------------------------------------- lookup
    def compute(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Local lookups: ``[sum(batch_sizes), layouts[rank].width]`` float32 (columns in
        ``layouts[rank].out_cols`` order).  Always part of the autograd graph when
        grad is enabled, so that every rank takes part in the backward collective."""
        outs = []
        for lk, ident, lay in zip(self.lookups, self._lookup_identity, self.layouts[self.env.rank].lookups):
            inp = kjt if ident else kjt.permute(lay.feature_pos)
            outs.append(lk(inp))
        if not outs:
            out = torch.zeros(kjt.stride(), 0, device=self.device)
        else:
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if torch.is_grad_enabled() and not out.requires_grad:
            out = out.detach().requires_grad_()
        return out

    # ---------------------------------------------------------- output dist
    def output_dist_recv(
        self, pieces: Sequence[torch.Tensor], local_kjt: KeyedJaggedTensor
    ) -> list[torch.Tensor]:
        """Combine the pooled blocks of every owner rank.

        Args:
            pieces: per owner rank ``d``, ``[B_local, layouts[d].width]``.
            local_kjt: this rank's input for the group (for mean pooling).

        Returns:
            ``[B_local, len(cols)]`` tensors, one per entry of :meth:`output_cols`
            (the sharded EBC puts their columns in table order in one pass).
        """
        raise NotImplementedError

    def output_cols(self) -> list[list[int]]:
        """Static: for each tensor :meth:`output_dist_recv` returns, the group column of each of its columns."""
        raise NotImplementedError

    # ------------------------------------------------------------- weights
    def local_shards(self) -> list[tuple[LocalShard, torch.Tensor, list[torch.Tensor], nn.Module]]:
        """``(shard, live weight view, fused optimizer state views, lookup)`` for every local shard."""
        out = []
        for lk, lay in zip(self.lookups, self.layouts[self.env.rank].lookups):
            weights = lk.table_weights()
            mom = lk.fused_optimizer().momentum()
            for s in lay.shards:
                out.append((s, weights[s.table.name], list(mom.get(s.table.name, [])), lk))
        return out


