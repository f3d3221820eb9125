"""The two shared kinds of input / output dist over the interface of
:mod:`dlrmctl.distributed.sharding.common`: table-like (:class:`TableWiseLikeSharding`: table_wise,
column_wise, table_column_wise — every id of a feature to each rank holding a shard of its table,
pooled blocks concatenated) and row-like (:class:`RowWiseLikeSharding`: row_wise, table_row_wise —
ids bucketized by row range, partial sums added)."""

from __future__ import annotations

import torch

from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.sharding.bucketize import HAS_BLOCK_BUCKETIZE, bucketize_order, bucketize_torch
from dlrmctl.distributed.sharding.common import EmbeddingSharding, weights_to_int64
from dlrmctl.distributed.types import ShardingType
from dlrmctl.sparse import KeyedJaggedTensor


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
