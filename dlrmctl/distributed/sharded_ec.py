"""ShardedEmbeddingCollection: an EmbeddingCollection whose tables are spread over
ranks by a :class:`~dlrmctl.distributed.types.ShardingPlan` (table_wise, row_wise,
column_wise).

Same contract as the unsharded module for the *local* batch:
``forward(kjt [B_local]) -> {feature: JaggedTensor}`` with values ``[N_f, D]``
float32 (one row per id, input order) and the input's lengths.  Ranks may have
different local batch sizes, including zero.

One step:

1. ``input_dist`` — the same routing as the sharded EmbeddingBagCollection,
   from the same sharding classes (``sharding/*.py``: ``input_dist_counts`` /
   ``input_dist_chunks`` / ``input_dist_recv``; row-wise bucketizes ids by row
   block and keeps the *unbucketize permutation* of every id); **one**
   all-to-all of the sizes (local batch size + ids per feature and
   destination, read back in the step's one host sync) and **one**
   asynchronous all-to-all of the data (lengths + ids).
2. lookup — each rank's :class:`~dlrmctl.modules.sequence_embeddings.SequenceEmbeddingLookup`
   (FBGEMM sequence TBE with the optimizer fused in backward, or
   ``nn.Embedding``): one row per received id.
3. ``output_dist`` — **one** differentiable all-to-all
   (:func:`~dlrmctl.distributed.comm.all_to_all_single`) sends every row back
   to the rank the id came from; the split sizes are ``ids per (source,
   feature) x shard columns``, known on both sides from step 1.  The source
   then assembles each feature: table_wise takes its one block; column_wise
   concatenates the column blocks of the same ids in column order; row_wise
   concatenates the blocks of all owners in bucketized order (owner, feature,
   sample) and puts every row back at its id's original position (the inverse
   of the bucketization, ``index_select``).

Backward: the all-to-all's backward routes each row's gradient to the rank
owning it; the lookups there apply their (fused) optimizer to the sum over all
sources' ids — the single-process update of the global batch.

Refused: data_parallel, table_row_wise, table_column_wise (``PlanError``
naming the table and the supported types).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dlrmctl.distributed.comm import Awaitable, LazyAwaitable, all_to_all_ints, all_to_all_single
from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.sharded_tables import ShardedTables
from dlrmctl.distributed.sharding.bucketize import HAS_BLOCK_BUCKETIZE, bucketize_order
from dlrmctl.distributed.sharding.common import EmbeddingSharding, LookupLayout
from dlrmctl.distributed.sharding.cw_sharding import CwSharding
from dlrmctl.distributed.sharding.rw_sharding import RwSharding
from dlrmctl.distributed.sharding.tw_sharding import TwSharding
from dlrmctl.distributed.types import PlanError, ShardingPlan, ShardingType, ShardMetadata
from dlrmctl.modules.embedding_configs import EmbeddingConfig
from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec
from dlrmctl.modules.sequence_embeddings import SequenceEmbeddingLookup, SequenceTableFeatures
from dlrmctl.sparse.jagged_tensor import host_to_device
from dlrmctl.sparse import JaggedTensor, KeyedJaggedTensor


# ------------------------------------------------------------- sharding kinds
class _SequenceLookups:
    """Mixin for a sharding class: unpooled lookups instead of pooled ones."""

    env: ShardingEnv
    lookups: nn.ModuleList
    layouts: list

    def make_lookup(self, lk: LookupLayout, optimizer: EmbeddingOptimizerSpec, seed: int) -> nn.Module:
        return SequenceEmbeddingLookup(
            [(s.table, s.rows, s.cols, s.meta.offsets[0], s.meta.offsets[1]) for s in lk.shards],
            compute_kernel=lk.kernel.value,
            device=self.env.device,
            optimizer=optimizer,
            seed=seed,
        )

    def sequence_input_dist_counts(self, kjt: KeyedJaggedTensor) -> tuple[object, object, torch.Tensor | None]:
        """``(state, counts, unbucketize permutation or None)``: :meth:`input_dist_counts` plus,
        for row-wise, where each bucketized id came from (see :class:`RwSequenceSharding`)."""
        state, counts = self.input_dist_counts(kjt)  # type: ignore[attr-defined]
        return state, counts, None

    def compute_sequence(self, kjt: KeyedJaggedTensor) -> list[list[torch.Tensor]]:
        """Local lookups: per lookup of this rank, one ``[N_k, cols]`` float32 tensor per
        (shard, feature) key (rows: every source's ids in rank order)."""
        outs = []
        for lk, ident, lay in zip(self.lookups, self._lookup_identity, self.layouts[self.env.rank].lookups):  # type: ignore[attr-defined]
            outs.append(lk(kjt if ident else kjt.permute(lay.feature_pos)))
        return outs


class TwSequenceSharding(_SequenceLookups, TwSharding):
    """table_wise for an EmbeddingCollection: ids go unchanged to the table's rank;
    its rows come back to the source."""


class CwSequenceSharding(_SequenceLookups, CwSharding):
    """column_wise for an EmbeddingCollection: ids go unchanged to every rank holding a
    column block; the source concatenates the blocks of the same ids in column order."""


class RwSequenceSharding(_SequenceLookups, RwSharding):
    """row_wise for an EmbeddingCollection: ids are bucketized to the rank holding
    their row (local row ids); every row comes back to the source and is put at
    the id's original position."""

    def sequence_input_dist_counts(self, kjt):
        lengths, values, unbucketize = self.bucketize_sequence(kjt)
        return (lengths, values, None), lengths.sum(dim=2), unbucketize

    def bucketize_sequence(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route every id to the rank holding its row, remembering where it came from.

        Returns:
            ``(lengths [W, F, B], local ids [N], unbucketize [N])``: ids ordered by
            destination rank, then feature, then sample (as :meth:`bucketize`);
            ``unbucketize[i]`` is the bucketized position of the ``i``-th input id
            (key-major), so ``rows_bucketized[unbucketize]`` restores input order.
            FBGEMM's ``block_bucketize_sparse_features(sequence=True)`` on the
            all-ranks block split, else a torch equivalent.
        """
        W = self.env.world_size
        F, B = len(self.features), kjt.stride()
        values, lengths = kjt.values(), kjt.lengths()
        if self._block_sizes is not None and HAS_BLOCK_BUCKETIZE and values.numel():
            new_lengths, new_values, _, _, unbucketize = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths.contiguous(), values.contiguous(), False, True, self._block_sizes_t.to(values.dtype), W, None
            )
            return new_lengths.view(W, F, B), new_values, unbucketize.to(torch.int64)
        return sequence_bucketize_torch(
            values, lengths, F, B, W, self._feat_base, self._shard_starts, self._shard_ranks
        )


def sequence_bucketize_torch(values: torch.Tensor, lengths: torch.Tensor, F: int, B: int, W: int, feat_base: torch.Tensor,
                             shard_starts: torch.Tensor, shard_ranks: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch ``block_bucketize_sparse_features(sequence=True)`` for any row split
    (arguments as :func:`~dlrmctl.distributed.sharding.bucketize.bucketize_torch`).

    Returns:
        ``(lengths [W, F, B], local ids [N], unbucketize [N] int64)``.
    """
    new_lengths, local, order = bucketize_order(values, lengths, F, B, W, feat_base, shard_starts, shard_ranks)
    unbucketize = torch.empty_like(order)
    unbucketize[order] = torch.arange(order.numel(), device=order.device)
    return new_lengths, local, unbucketize


#: sharding type -> implementation for EmbeddingCollection tables.
SEQUENCE_SHARDING_CLASSES: dict[ShardingType, type[EmbeddingSharding]] = {
    ShardingType.TABLE_WISE: TwSequenceSharding,
    ShardingType.ROW_WISE: RwSequenceSharding,
    ShardingType.COLUMN_WISE: CwSequenceSharding,
}


# --------------------------------------------------------------------- module
@dataclass
class ShardedECContext:
    """What the lookups and the output dist of one batch need.

    Attributes:
        features: this rank's prepared input (all features, table order).
        batch_sizes: local batch size of every rank.
        local_kjts: per group, this rank's input (group features, local batch).
        lookup_kjts: per group, the lookup input received from all ranks.
        recv_counts: per group, per source ``s``: ids received of each of this
            rank's received features (``layouts[rank].features``).
        sent_counts: per group, per destination ``d``: ids sent for each of
            ``layouts[d].features``.
        unbucketize: per group, the row-wise unbucketize permutation ``[N]`` (else None).
    """

    features: KeyedJaggedTensor
    batch_sizes: list[int]
    local_kjts: list[KeyedJaggedTensor]
    lookup_kjts: list[KeyedJaggedTensor]
    recv_counts: list[list[list[int]]]
    sent_counts: list[list[list[int]]]
    unbucketize: list[torch.Tensor | None]

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """Mark every tensor as used on ``stream``."""
        for kjt in [self.features, *self.local_kjts, *self.lookup_kjts]:
            kjt.record_stream(stream)
        for t in self.unbucketize:
            if t is not None:
                t.record_stream(stream)


class ShardedEmbeddingCollection(ShardedTables, SequenceTableFeatures):
    """This rank's part of an EmbeddingCollection sharded by ``plan``.

    Args:
        tables: all EmbeddingConfig tables (as given to the unsharded EmbeddingCollection).
        plan: a plan for these tables and ``env.world_size`` (validated here);
            every table ``table_wise``, ``row_wise`` or ``column_wise``.
        env: this rank.
        need_indices: each output JaggedTensor carries this rank's input ids (global,
            ``[N_f]`` integer) in ``weights()``, as the unsharded module does.
        optimizer: fused optimizer hyper-parameters.
        seed: initial weights are those of an unsharded EmbeddingCollection with
            this seed (each rank draws only its own shards, see ``init_table_rows``).
        check_ids: check id ranges of the local input on every forward.

    Forward:
        ``features``: KJT with every feature of every table, integer global ids,
        local batch ``B`` (may differ between ranks, may be 0).  Returns
        ``{feature: JaggedTensor}`` in table order, values ``[N_f, D]`` float32,
        the input's ``lengths [B]``.  Collective: every rank calls it (and, when
        training, runs a backward through its outputs).

    Raises:
        PlanError: the plan does not fit the tables / world size, or uses a
            sharding type other than table_wise / row_wise / column_wise.
        ValueError: see :func:`~dlrmctl.modules.sequence_embeddings.check_sequence_tables`.
        EmbeddingIdError: an id outside its table (with ``check_ids``).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        plan: ShardingPlan,
        env: ShardingEnv,
        need_indices: bool = False,
        optimizer: EmbeddingOptimizerSpec | None = None,
        seed: int = 0,
        check_ids: bool = True,
    ) -> None:
        super().__init__(tables, need_indices, check_ids)
        plan.validate(self._embedding_configs, env.world_size)
        supported = ", ".join(t.value for t in SEQUENCE_SHARDING_CLASSES)
        for t in self._embedding_configs:
            st = plan.plan[t.name].sharding_type
            if st not in SEQUENCE_SHARDING_CLASSES:
                raise PlanError(
                    f"table '{t.name}': sharding type {st.value} is not supported for an EmbeddingCollection "
                    f"table; supported: {supported}"
                )
        if plan.local_world_size != env.local_world_size:
            env = ShardingEnv(env.world_size, env.rank, env.pg, local_world_size=plan.local_world_size, device=env.device)
        self.env = env
        self.plan = plan
        self._spec = optimizer or EmbeddingOptimizerSpec()
        fidx = {f: i for i, f in enumerate(self._feature_names)}
        groups: list[EmbeddingSharding] = []
        for st, cls in SEQUENCE_SHARDING_CLASSES.items():
            ts = [t for t in self._embedding_configs if plan.plan[t.name].sharding_type == st]
            if ts:
                groups.append(cls(ts, plan.plan, env, False, self._spec, seed))
        self.groups = nn.ModuleList(groups)
        self._group_feat_idx = [[fidx[f] for f in g.features] for g in groups]
        self._identity = len(groups) == 1 and self._group_feat_idx[0] == list(range(len(self._feature_names)))
        # per group, per rank d, per lookup of d: (received feature position, cols, col offset) of each key
        self._key_info: list[list[list[list[tuple[int, int, int]]]]] = [
            [
                [
                    [(fpos, s.cols, s.meta.offsets[1]) for s, fpos in zip(_key_shards(lk), lk.feature_pos)]
                    for lk in g.layouts[d].lookups
                ]
                for d in range(env.world_size)
            ]
            for g in groups
        ]
        big = any(t.num_embeddings >= 2**31 for t in self._embedding_configs)
        #: element type of the id all-to-all: int32 when every table has < 2^31 rows
        self.input_dist_dtype = torch.int64 if big else torch.int32

    # ---------------------------------------------------------- input dist
    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[ShardedECContext]:
        """Start redistributing the local batch's ids; ``.wait()`` gives the lookup inputs.

        The small all-to-all of sizes runs synchronously and is read back in one
        host sync; the data all-to-all runs asynchronously until ``wait()``.
        """
        features = self.prepare_features(features)
        # a variable-batch KJT is routed with one stride (empty bags appended add no ids); the
        # outputs keep each key's own bags (``features``)
        routed = features.to_uniform_stride()
        groups = self.groups
        local = [routed if self._identity else routed.permute(idx) for idx in self._group_feat_idx]
        B = routed.stride()
        W, me = self.env.world_size, self.env.rank
        dev = features.values().device
        prep = [g.sequence_input_dist_counts(k) for g, k in zip(groups, local)]  # type: ignore[attr-defined]
        # 1) sizes: row d = [B, then per group the ids of each of d's received features]
        # host-known sizes go in one non-blocking copy; device counts (row-wise) are spliced in
        host_meta: list[int] = []
        dev_parts: list[tuple[int, torch.Tensor]] = []  # (position in the meta, device counts)
        meta_in = []
        for d in range(W):
            n = 1
            host_meta.append(B)
            for g, (_, c, _) in zip(groups, prep):
                fs = g.layouts[d].features
                n += len(fs)
                if not fs:
                    continue
                if torch.is_tensor(c):
                    dev_parts.append((len(host_meta), c[d, fs].to(torch.int64)))
                    host_meta.extend([0] * len(fs))
                else:
                    host_meta.extend(int(x) for x in c[d])
            meta_in.append(n)
        n_recv = [len(g.layouts[me].features) for g in groups]
        row = 1 + sum(n_recv)
        meta_t = host_to_device(host_meta, torch.int64, dev)
        for p0, t in dev_parts:
            meta_t[p0 : p0 + t.numel()] = t
        meta_r, _ = all_to_all_ints(meta_t, meta_in, [row] * W, self.env.pg)
        both = torch.cat([meta_r, meta_t]).tolist()  # the one host sync of the step
        recv_flat, sent_flat = both[: meta_r.numel()], both[meta_r.numel() :]
        batch_sizes = [recv_flat[s * row] for s in range(W)]
        recv_counts: list[list[list[int]]] = []
        off = 1
        for nf in n_recv:
            recv_counts.append([recv_flat[s * row + off : s * row + off + nf] for s in range(W)])
            off += nf
        sent_counts: list[list[list[int]]] = [[] for _ in groups]
        pos = 0
        for d in range(W):
            pos += 1
            for gi, g in enumerate(groups):
                nf = len(g.layouts[d].features)
                sent_counts[gi].append(sent_flat[pos : pos + nf])
                pos += nf
        # 2) data: lengths + ids of every group, in one all-to-all
        sends = []
        for gi, (g, (state, c, _)) in enumerate(zip(groups, prep)):
            if torch.is_tensor(c):  # row-wise: host counts over all group features [W][F]
                full = [[0] * c.shape[1] for _ in range(W)]
                for d in range(W):
                    for f, n in zip(g.layouts[d].features, sent_counts[gi][d]):
                        full[d][f] = n
                c = full
            sends.append(g.input_dist_chunks(state, c))
        pieces: list[torch.Tensor] = []
        in_splits = []
        for d in range(W):
            n = 0
            for ch in sends:
                for t in ch[d]:
                    pieces.append(t)
                    n += t.numel()
            in_splits.append(n)
        recv_sizes = [[nf * batch_sizes[s] + sum(recv_counts[gi][s]) for s in range(W)] for gi, nf in enumerate(n_recv)]
        out_splits = [sum(rs[s] for rs in recv_sizes) for s in range(W)]
        send = torch.cat(pieces).to(self.input_dist_dtype) if pieces else torch.zeros(0, dtype=self.input_dist_dtype, device=dev)
        recv, work = all_to_all_ints(send, in_splits, out_splits, self.env.pg, async_op=True)
        unbucketize = [u for _, _, u in prep]

        def finish() -> ShardedECContext:
            data = recv.to(torch.int64)
            per_src = torch.split(data, out_splits)
            chunks: list[list[torch.Tensor]] = [[] for _ in groups]
            for s in range(W):
                for gi, p in enumerate(torch.split(per_src[s], [rs[s] for rs in recv_sizes])):
                    chunks[gi].append(p)
            lookup_kjts = [g.input_dist_recv(batch_sizes, recv_counts[gi], chunks[gi]) for gi, g in enumerate(groups)]
            return ShardedECContext(features, batch_sizes, local, lookup_kjts, recv_counts, sent_counts, unbucketize)

        return LazyAwaitable([work], finish)

    # ------------------------------------------------ lookup + output dist
    def compute_and_output_dist(self, ctx: ShardedECContext) -> dict[str, JaggedTensor]:
        """Local lookups, then every row back to the rank its id came from: ``{feature: JaggedTensor}``."""
        groups = self.groups
        W, me = self.env.world_size, self.env.rank
        looked = [g.compute_sequence(k) for g, k in zip(groups, ctx.lookup_kjts)]  # type: ignore[attr-defined]
        # send: for each source s, for each group / lookup / key, the rows of s's ids
        src_off = []  # per group, per received feature: row offset of each source
        for gi in range(len(groups)):
            rc = ctx.recv_counts[gi]
            offs = []
            for f in range(len(groups[gi].layouts[me].features)):
                o = [0]
                for s in range(W):
                    o.append(o[-1] + rc[s][f])
                offs.append(o)
            src_off.append(offs)
        send_parts: list[torch.Tensor] = []
        in_splits = [0] * W
        for s in range(W):
            for gi in range(len(groups)):
                for lk_rows, keys in zip(looked[gi], self._key_info[gi][me]):
                    for rows, (fpos, cols, _) in zip(lk_rows, keys):
                        a, b = src_off[gi][fpos][s], src_off[gi][fpos][s + 1]
                        send_parts.append(rows[a:b].reshape(-1))
                        in_splits[s] += (b - a) * cols
        out_splits = [0] * W
        for d in range(W):
            for gi in range(len(groups)):
                for keys in self._key_info[gi][d]:
                    for fpos, cols, _ in keys:
                        out_splits[d] += ctx.sent_counts[gi][d][fpos] * cols
        dev = ctx.features.values().device
        send = torch.cat(send_parts) if send_parts else torch.zeros(0, device=dev)
        if torch.is_grad_enabled() and not send.requires_grad:
            # a rank holding no rows still takes part in the backward all-to-all
            send = send.detach().requires_grad_()
        recv = all_to_all_single(send, in_splits, out_splits, self.env.pg)
        # assemble each group feature from the blocks of every owner
        D = self._embedding_dim
        rows_by_feature: dict[int, torch.Tensor] = {}
        off = 0
        per_group: list[dict[tuple[int, int], list[tuple[int, torch.Tensor]]]] = [{} for _ in groups]
        for d in range(W):
            for gi, g in enumerate(groups):
                feats = g.layouts[d].features
                for keys in self._key_info[gi][d]:
                    for fpos, cols, c0 in keys:
                        n = ctx.sent_counts[gi][d][fpos]
                        piece = recv[off : off + n * cols].view(n, cols)
                        off += n * cols
                        per_group[gi].setdefault((d, feats[fpos]), []).append((c0, piece))
        for gi, g in enumerate(groups):
            gf = self._group_feat_idx[gi]
            if g.row_wise:
                blocks = [per_group[gi][(d, f)][0][1] for d in range(W) for f in g.layouts[d].features]
                flat = torch.cat(blocks) if blocks else recv.new_zeros(0, D)
                perm = ctx.unbucketize[gi]
                if perm is not None and perm.numel():
                    flat = flat.index_select(0, perm)
                lpk = ctx.local_kjts[gi].length_per_key()
                for f, t in enumerate(torch.split(flat, lpk)):
                    rows_by_feature[gf[f]] = t
            else:
                for f in range(len(g.features)):
                    blocks = sorted(
                        (b for d in range(W) for b in per_group[gi].get((d, f), [])), key=lambda b: b[0]
                    )
                    rows_by_feature[gf[f]] = blocks[0][1] if len(blocks) == 1 else torch.cat([b for _, b in blocks], dim=1)
        return self._outputs(ctx.features, [rows_by_feature[k] for k in range(len(self._feature_names))])

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return self.compute_and_output_dist(self.input_dist(features).wait())

    # -------------------------------------------------------- parameters
    def local_shards(self) -> dict[str, list[tuple[ShardMetadata, torch.Tensor, list[torch.Tensor]]]]:
        """Table -> this rank's shards as ``(metadata, live weight view, fused optimizer state views)``."""
        out: dict[str, list[tuple[ShardMetadata, torch.Tensor, list[torch.Tensor]]]] = {}
        for g in self.groups:
            for s, w, states, _ in g.local_shards():
                out.setdefault(s.table.name, []).append((s.meta, w, states))
        return out

    def _full_shapes(self) -> list[tuple[str, int, int]]:
        return [(t.name, t.num_embeddings, t.embedding_dim) for t in self._embedding_configs]


def _key_shards(lk: LookupLayout) -> list:
    """The shard of every key of a lookup (keys: per shard, the features of its table)."""
    return [s for s in lk.shards for _ in s.table.feature_names]
