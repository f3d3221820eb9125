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


class TableWiseLikeSharding(EmbeddingSharding):
    """Shared input/output dist of table_wise, column_wise and table_column_wise:
    every id of a feature goes (unchanged) to each rank holding a shard of its
    table; pooled blocks come back and are concatenated."""

    def input_dist_counts(self, kjt):
        lpk = kjt.length_per_key()
        return kjt, [[lpk[f] for f in lay.features] for lay in self.layouts]

    def input_dist_chunks(self, kjt, counts):
        opk = kjt.offset_per_key()
        lens2d = kjt.lengths_2d()
        values = kjt.values()
        weights = kjt.weights_or_none() if self.is_weighted else None
        wbits = weights_to_int64(weights) if weights is not None else None
        chunks = []
        nf = len(self.features)
        for lay in self.layouts:
            fs = lay.features
            if fs == list(range(nf)):
                ch = [kjt.lengths(), values]
                if wbits is not None:
                    ch.append(wbits)
            else:
                ch = [lens2d[fs].reshape(-1) if fs else kjt.lengths()[:0]]
                ch.extend(values[opk[f] : opk[f + 1]] for f in fs)
                if wbits is not None:
                    ch.extend(wbits[opk[f] : opk[f + 1]] for f in fs)
            chunks.append(ch)
        return chunks

    def num_source_segments(self) -> int:
        return len(self.features)

    def send_segments(self, d: int) -> list[int]:
        return list(self.layouts[d].features)

    def input_dist_source(self, kjt):
        counts = kjt.lengths_2d().sum(dim=1) if self.features else kjt.lengths()[:0]
        return kjt.lengths(), kjt.values(), kjt.weights_or_none() if self.is_weighted else None, counts

    def output_cols(self) -> list[list[int]]:
        return [lay.out_cols for lay in self.layouts]

    def output_dist_recv(self, pieces, local_kjt):
        return list(pieces)


class RowWiseLikeSharding(EmbeddingSharding):
    """Shared input/output dist of row_wise and table_row_wise: ids are
    bucketized by row range to the rank holding the row (and made local to
    its shard), partial sums come back and are added; mean pooling divides the
    sum by the whole bag length afterwards."""

    row_wise = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Virtual concatenation of all features' tables: feature f's id i is key
        # feat_base[f] + i; shard k of that feature covers keys [starts[k], starts[k]+rows).
        starts, ranks, base = [], [], []
        acc = 0
        for fi, ti in enumerate(self.feature_table):
            t = self.tables[ti]
            base.append(acc)
            for m in self.shardings[t.name].shards or []:
                starts.append(acc + m.offsets[0])
                ranks.append(m.rank)
            acc += t.num_embeddings
        dev = self.device
        self.register_buffer("_feat_base", torch.tensor(base, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("_shard_starts", torch.tensor(starts, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("_shard_ranks", torch.tensor(ranks, dtype=torch.int64, device=dev), persistent=False)
        ws = self.env.world_size
        # all-ranks block split (TorchRec's row_wise) -> FBGEMM block_bucketize fast path
        self._block_sizes: list[int] | None = []
        for ti in self.feature_table:
            t = self.tables[ti]
            ms = self.shardings[t.name].shards or []
            blk = -(-t.num_embeddings // ws)
            if [m.rank for m in ms] != list(range(ws)) or any(m.offsets[0] != r * blk for r, m in enumerate(ms)):
                self._block_sizes = None
                break
            self._block_sizes.append(blk)
        if self._block_sizes is not None:
            self.register_buffer(
                "_block_sizes_t", torch.tensor(self._block_sizes, dtype=torch.int64, device=dev), persistent=False
            )
        self._same_layout = all(lay.out_cols == self.layouts[0].out_cols for lay in self.layouts)
        mean_cols = [self.feature_is_mean[f] for f in range(len(self.features)) for _ in range(self.feature_offsets[f + 1] - self.feature_offsets[f])]
        self._any_mean = any(mean_cols)
        col_feat = [f for f in range(len(self.features)) for _ in range(self.feature_offsets[f + 1] - self.feature_offsets[f])]
        out_cols = self.output_cols()[0]
        self.register_buffer("_out_col_feat", torch.tensor([col_feat[c] for c in out_cols], dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("_out_col_mean", torch.tensor([mean_cols[c] for c in out_cols], dtype=torch.bool, device=dev), persistent=False)
        self.register_buffer(
            "_scatter_idx",
            torch.tensor([c for lay in self.layouts for c in lay.out_cols], dtype=torch.int64, device=dev),
            persistent=False,
        )
        #: use the real reduce-scatter collective for the output (NCCL); gloo uses the fused all-to-all
        self.use_reduce_scatter = bool(
            self._same_layout and env_backend(self.env) == "nccl" and self.sharding_type == ShardingType.ROW_WISE
        )

    def set_raw_routing(self, routing: dict[str, tuple[int, int]]) -> None:
        """Features of sharded managed-collision tables: ``feature -> (buckets, buckets per
        rank)``; while :attr:`raw_ids` is set, their raw ids go unchanged to the rank owning their
        zone (:mod:`dlrmctl.distributed.sharded_mc`), the others as usual."""
        nb = [routing.get(f, (0, 1))[0] for f in self.features]
        per = [routing.get(f, (0, 1))[1] for f in self.features]
        self._raw_route = (torch.tensor(nb, dtype=torch.int64, device=self.device),
                           torch.tensor(per, dtype=torch.int64, device=self.device))

    _raw_route: tuple[torch.Tensor, torch.Tensor] | None = None

    def routes_raw_ids(self) -> bool:
        return self._raw_route is not None

    def configure_output_dist(self, reduce_scatter: bool | None, hierarchical: bool | None) -> None:
        """``reduce_scatter``: the real reduce-scatter collective where every rank has the same
        output layout (else the fused all-to-all)."""
        if reduce_scatter is not None:
            self.use_reduce_scatter = bool(reduce_scatter and self._same_layout)

    def bucketize(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Route every id to the rank holding its row (raw ids of managed-collision tables, while
        :attr:`raw_ids`: to the rank owning their zone, unchanged).

        Returns:
            ``(lengths [W, F, B], local ids [N], weights [N] or None)`` with ids
            (and weights) ordered by destination rank, then feature, then sample.
        """
        W = self.env.world_size
        F, B = len(self.features), kjt.stride()
        values, lengths = kjt.values(), kjt.lengths()
        weights = kjt.weights_or_none() if self.is_weighted else None
        if self.raw_ids and self._raw_route is not None:
            new_lengths, local, order = bucketize_order(values, lengths, F, B, W, self._feat_base, self._shard_starts,
                                                        self._shard_ranks, self._raw_route)
            return new_lengths, local, None if weights is None else weights[order]
        if self._block_sizes is not None and HAS_BLOCK_BUCKETIZE and values.numel():
            # FBGEMM reads raw memory: views (e.g. a loader's column slice) must be made contiguous
            new_lengths, new_values, new_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths.contiguous(), values.contiguous(), False, False, self._block_sizes_t.to(values.dtype), W,
                None if weights is None else weights.contiguous(),
            )
            return new_lengths.view(W, F, B), new_values, new_weights
        return bucketize_torch(
            values, lengths, weights, F, B, W, self._feat_base, self._shard_starts, self._shard_ranks
        )

    def input_dist_counts(self, kjt):
        new_lengths, new_values, new_weights = self.bucketize(kjt)
        return (new_lengths, new_values, new_weights), new_lengths.sum(dim=2)  # [W, F] on the device

    def num_source_segments(self) -> int:
        return self.env.world_size * len(self.features)

    def send_segments(self, d: int) -> list[int]:
        return [d * len(self.features) + f for f in self.layouts[d].features]

    def input_dist_source(self, kjt):
        new_lengths, new_values, new_weights = self.bucketize(kjt)
        return new_lengths.reshape(-1), new_values, new_weights, new_lengths.sum(dim=2).reshape(-1)

    def input_dist_chunks(self, state, per_feat_l):
        W = self.env.world_size
        new_lengths, new_values, new_weights = state
        wbits = weights_to_int64(new_weights) if new_weights is not None else None
        chunks = []
        off = 0
        nf = len(self.features)
        for d in range(W):
            fs = self.layouts[d].features
            n = sum(per_feat_l[d])
            lens = new_lengths[d].reshape(-1) if fs == list(range(nf)) else new_lengths[d][fs].reshape(-1)
            ch = [lens, new_values[off : off + n]]
            if wbits is not None:
                ch.append(wbits[off : off + n])
            off += n
            chunks.append(ch)
        return chunks

    def output_cols(self) -> list[list[int]]:
        return [self.layouts[0].out_cols if self._same_layout else list(range(self.width))]

    def output_dist_recv(self, pieces, local_kjt):
        if self._same_layout:
            out = pieces[0]
            for p in pieces[1:]:
                out = out + p
        else:
            B = local_kjt.stride()
            out = torch.zeros(B, self.width, device=self.device, dtype=pieces[0].dtype if pieces else torch.float32)
            if self._scatter_idx.numel():
                out = out.index_add(1, self._scatter_idx, torch.cat(list(pieces), dim=1))
        return [self.apply_mean(out, local_kjt)]

    def apply_mean(self, out: torch.Tensor, local_kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Divide the mean-pooled columns of ``out [B, output_cols()[0]]`` by the full
        bag length (empty bag -> 0)."""
        if not self._any_mean:
            return out
        lens = local_kjt.lengths_2d().t().to(out.dtype).clamp(min=1)  # [B, F]
        div = torch.where(self._out_col_mean, lens[:, self._out_col_feat], torch.ones((), dtype=out.dtype, device=out.device))
        return out / div


def env_backend(env: ShardingEnv) -> str | None:
    return env.backend


try:  # FBGEMM's bucketizer, when fbgemm_gpu is importable (the GPU box may lack it)
    import fbgemm_gpu  # noqa: F401

    HAS_BLOCK_BUCKETIZE = hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features")
except Exception:  # pragma: no cover - depends on the install
    HAS_BLOCK_BUCKETIZE = False


def bucketize_torch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    F: int,
    B: int,
    W: int,
    feat_base: torch.Tensor,
    shard_starts: torch.Tensor,
    shard_ranks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-torch equivalent of ``fbgemm.block_bucketize_sparse_features`` for any row split.

    Args:
        values: ``[N]`` global ids, key-major.
        lengths: ``[F * B]``.
        feat_base: ``[F]`` offset of each feature's table in a virtual
            concatenation of all tables.
        shard_starts: ``[S]`` start of every shard in that concatenation
            (non-decreasing); ``shard_ranks [S]`` the rank holding it.

    Returns:
        ``(lengths [W, F, B], local ids [N], weights [N] | None)``, ids grouped by
        destination rank (stable: feature, sample order kept).
    """
    new_lengths, local, order = bucketize_order(values, lengths, F, B, W, feat_base, shard_starts, shard_ranks)
    return new_lengths, local, None if weights is None else weights[order]


def bucketize_order(values: torch.Tensor, lengths: torch.Tensor, F: int, B: int, W: int, feat_base: torch.Tensor,
                    shard_starts: torch.Tensor, shard_ranks: torch.Tensor,
                    raw_route: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core of the pure-torch bucketize (pooled :func:`bucketize_torch` and the sequence
    collection's): arguments as :func:`bucketize_torch`, without weights.

    ``raw_route``: ``(buckets [F], buckets per rank [F])`` int64: a feature with ``buckets > 0``
    holds raw ids of a sharded managed-collision table (:mod:`dlrmctl.distributed.sharded_mc`),
    each sent unchanged to the rank owning its zone, ``(id % buckets) // buckets per rank``.

    Returns:
        ``(lengths [W, F, B], local ids [N] grouped by destination rank, order [N] int64)``:
        ``order[j]`` is the input position of the j-th id sent (stable: feature, sample order kept).
    """
    N = values.numel()
    dev = values.device
    bag = torch.repeat_interleave(torch.arange(F * B, device=dev), lengths, output_size=N)
    if raw_route is None:
        key = feat_base[torch.div(bag, B, rounding_mode="floor")] + values if B else values
        shard = torch.searchsorted(shard_starts, key, right=True) - 1
        dest = shard_ranks[shard]
        local = key - shard_starts[shard]
    else:
        feat = torch.div(bag, max(B, 1), rounding_mode="floor")
        nb, per = raw_route[0][feat], raw_route[1][feat]
        raw = nb > 0
        key = feat_base[feat] + torch.where(raw, 0, values)  # raw ids stay out of the row arithmetic
        shard = torch.searchsorted(shard_starts, key, right=True) - 1
        dest = torch.where(raw, torch.remainder(values, nb.clamp(min=1)) // per, shard_ranks[shard])
        local = torch.where(raw, values, key - shard_starts[shard])
    order = torch.argsort(dest, stable=True)
    # scatter-add into a buffer of known size (bincount would read the max id back to the host on CUDA)
    new_lengths = torch.zeros(W * F * B, dtype=lengths.dtype, device=dev)
    new_lengths.index_add_(0, dest * (F * B) + bag, torch.ones_like(bag, dtype=lengths.dtype))
    return new_lengths.view(W, F, B), local[order], order
