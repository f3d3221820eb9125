"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables are
spread over ranks by a :class:`~dlrmctl.distributed.types.ShardingPlan`.

Same contract as the unsharded module for the *local* batch:
``forward(kjt [B_local]) -> KeyedTensor [B_local, sum(dims)]`` with keys in
table order.  Ranks may have different local batch sizes (the last, smaller
batch; a global batch not divisible by the world size).

One step, whatever the mix of sharding types (one group per type):

1. ``input_dist`` — each type routes ids per destination rank
   (``sharding/*.py``); all types share **one** all-to-all of the sizes
   (local batch size + ids per feature, tiny) and **one** all-to-all of the
   data (lengths, ids, weights as int64).  The second runs asynchronously:
   :meth:`input_dist` returns an :class:`Awaitable`.
2. lookup — each type's local :class:`GroupedEmbeddingLookup` (FBGEMM TBE with
   the optimizer fused in backward, or torch EmbeddingBag).
3. ``output_dist`` — **one** differentiable all-to-all of the pooled blocks of
   all types (on NCCL row-wise uses ``reduce_scatter`` instead; table_row_wise
   across hosts its own two-level reduce, ``twrw_sharding.py``); each type
   combines its blocks (concatenate / sum, then mean), one column permutation
   puts the result in table order.

data_parallel tables take no part in 1-3; their gradients are summed over ranks
by :meth:`sync_replicated_grads` (called by DistributedModelParallel after
backward).

Gradients: backward of the output all-to-all routes each source's gradient
rows back to the shard owners, so a shard's gradient is the sum over all
sources' samples — with the trainer's loss ``sum_local / global_batch`` that is
exactly the single-process gradient of the global batch.

The per-plan permutations of the input dist and the column reassembly of the output dist are
:mod:`dlrmctl.distributed.dist_plans`'; what this module shares with the sharded
EmbeddingCollection, :mod:`dlrmctl.distributed.sharded_tables`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dlrmctl.distributed.comm import (Awaitable, DoneAwaitable, LazyAwaitable, all_to_all_ints, comm_dtype,
                                      pooled_all_to_all_async)
from dlrmctl.distributed.comm import DENSE_GRAD_MAX_BYTES, reduce_scatter_v, sync_sparse_grads
from dlrmctl.distributed.dist_plans import ColumnAssembly, InputDistPlan, weights_to_wire
from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.sharded_tables import ShardedTables
from dlrmctl.distributed.sharding.common import EmbeddingSharding, int64_to_weights
from dlrmctl.distributed.sharding.cw_sharding import CwSharding
from dlrmctl.distributed.sharding.dp_sharding import DpSharding
from dlrmctl.distributed.sharding.rw_sharding import RwSharding
from dlrmctl.distributed.sharding.tw_sharding import TwSharding
from dlrmctl.distributed.sharding.twcw_sharding import TwCwSharding
from dlrmctl.distributed.sharding.twrw_sharding import TwRwSharding
from dlrmctl.distributed.types import PlanError, ShardingPlan, ShardingType, ShardMetadata
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec, TableFeatures
from dlrmctl.optim.dense import row_state_tensors
from dlrmctl.optim.registry import embedding_optimizer
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor
from dlrmctl.sparse.permute import SegmentPermutation
from dlrmctl.sparse.jagged_tensor import expand_by_inverse_indices, host_to_device, split_variable_batch

#: sharding type -> implementation (one file per type).
SHARDING_CLASSES: dict[ShardingType, type[EmbeddingSharding]] = {
    ShardingType.DATA_PARALLEL: DpSharding,
    ShardingType.TABLE_WISE: TwSharding,
    ShardingType.ROW_WISE: RwSharding,
    ShardingType.TABLE_ROW_WISE: TwRwSharding,
    ShardingType.COLUMN_WISE: CwSharding,
    ShardingType.TABLE_COLUMN_WISE: TwCwSharding,
}


@dataclass
class ShardedEBCContext:
    """What the lookups and the output dist of one batch need.

    Attributes:
        batch_sizes: local batch size of every rank.
        local_kjts: per group, this rank's input (group features, local batch).
        lookup_kjts: per group, the lookup input received from all ranks
            (``None`` for data_parallel).
    """

    batch_sizes: list[int]
    local_kjts: list[KeyedJaggedTensor]
    lookup_kjts: list[KeyedJaggedTensor | None]
    #: variable batch per key: expands the pooled output back to the full local batch
    inverse_indices: tuple[list[str], torch.Tensor] | None = None
    #: every rank's full local batch (its samples; differs from ``batch_sizes`` for VBE batches,
    #: whose lookups use the largest per-key batch); ``None`` without a size exchange
    full_batch_sizes: list[int] | None = None
    #: the lookup inputs hold raw ids of managed-collision tables, to be remapped by their owner
    #: before the lookup (training; :mod:`dlrmctl.distributed.sharded_mc`)
    raw_ids: bool = False

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """Mark every tensor as used on ``stream`` (the context was made on the data-dist stream)."""
        for kjt in list(self.local_kjts) + [k for k in self.lookup_kjts if k is not None]:
            kjt.record_stream(stream)
        if self.inverse_indices is not None:
            self.inverse_indices[1].record_stream(stream)


class ShardedEmbeddingBagCollection(ShardedTables, TableFeatures):
    """This rank's part of an EmbeddingBagCollection sharded by ``plan``.

    Args:
        tables: all tables of the model (as given to the unsharded EBC).
        plan: a plan for these tables and ``env.world_size`` (validated here);
            its ``local_world_size`` defines hosts for the ``table_*`` kinds.
        env: this rank.
        is_weighted: inputs carry per-id weights (they travel with the ids in the input
            all-to-all); as for the unsharded EBC, a KJT with weights given to an unweighted
            collection, or without them to a weighted one, raises ``SparseInputError``.
        optimizer: fused optimizer hyper-parameters.
        seed: initial weights are those of an unsharded EBC with this seed
            (drawn per shard, see ``init_table_rows``).
        check_ids: apply ``on_invalid_id`` to the local input on every forward, before
            any bucketization (``False``: the caller did, e.g. the trainer's loader).
        on_invalid_id: ``error`` | ``zero`` (see :mod:`dlrmctl.sparse.validation`).
        reduce_scatter: row-wise output dist by the ``reduce_scatter`` collective
            (default: on NCCL) instead of all-to-all + local sum (gloo default).
            Only for row-wise groups whose every rank holds a shard of every table.
        input_dist_dtype: element type of the id all-to-all: ``None`` (default) picks
            int32 when every table that is communicated has fewer than 2^31 rows,
            else int64 (for the whole buffer: lengths, ids and weight bits).
        comm_precision: ``fp32`` | ``bf16`` | ``fp16``: quantized output_dist (TorchRec's qcomm):
            the pooled embeddings and, in backward, their gradients travel in this precision
            (:func:`~dlrmctl.distributed.comm.pooled_all_to_all`, ``reduce_scatter_v``).
        twrw_hierarchical: table_row_wise output dist in two levels (sum inside the host, then
            one block per destination across hosts:
            :func:`~dlrmctl.distributed.comm.hierarchical_reduce_all_to_all`) instead of the
            flat pooled all-to-all of partial sums.  Default (``None``): when the world spans
            more than one host of more than one rank.

    Forward:
        ``features``: KJT with every feature of every table, int64 global ids,
        local batch ``B`` (may differ between ranks).  Returns a KeyedTensor
        with the unsharded EBC's keys (one per (table, feature) lookup in table order,
        ``feature@table`` for a shared feature), values ``[B, sum dims]`` float32.

    Raises:
        PlanError: the plan does not fit the tables / world size.
        EmbeddingIdError: an id outside its table (with ``check_ids``).
        SparseInputError: weights given to an unweighted collection, or missing for a weighted one.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        plan: ShardingPlan,
        env: ShardingEnv,
        is_weighted: bool = False,
        optimizer: EmbeddingOptimizerSpec | None = None,
        seed: int = 0,
        check_ids: bool = True,
        reduce_scatter: bool | None = None,
        input_dist_dtype: torch.dtype | None = None,
        on_invalid_id: str = "error",
        comm_precision: str = "fp32",
        twrw_hierarchical: bool | None = None,
    ) -> None:
        super().__init__(tables, is_weighted, check_ids, on_invalid_id)
        #: wire dtype of the pooled embeddings' output_dist and its gradient in training (None: fp32,
        #: no cast); in eval mode the output_dist is always fp32 (:attr:`output_dist_dtype`)
        self.comm_dtype = comm_dtype(comm_precision)
        plan.validate(self._tables, env.world_size)
        if plan.local_world_size != env.local_world_size:
            env = ShardingEnv(env.world_size, env.rank, env.pg, local_world_size=plan.local_world_size, device=env.device)
        self.env = env
        self.plan = plan
        self._spec = optimizer or EmbeddingOptimizerSpec()
        ebc_feat_off = [0]
        for d in self._length_per_key:
            ebc_feat_off.append(ebc_feat_off[-1] + d)
        # lookups are keyed by output key (a shared feature is one key per table)
        fidx = {f: i for i, f in enumerate(self._embedding_names)}

        groups: list[EmbeddingSharding] = []
        for st, cls in SHARDING_CLASSES.items():
            ts = [t for t in self._lookup_tables if plan.plan[t.name].sharding_type == st]
            if ts:
                groups.append(cls(ts, plan.plan, env, is_weighted, self._spec, seed))
        for g in groups:
            g.configure_output_dist(reduce_scatter, twrw_hierarchical)
        self.groups = nn.ModuleList(groups)
        self._comm = [i for i, g in enumerate(groups) if g.needs_comm]
        #: groups with an output dist of their own (table_row_wise across hosts), done before returning
        self._own_out = [i for i in self._comm if groups[i].hierarchical and not groups[i].use_reduce_scatter]
        self._a2a_out = [i for i in self._comm if not groups[i].use_reduce_scatter and i not in self._own_out]
        #: the input dist's plan constants (index tensors and segment permutations), built once
        self._idist = InputDistPlan([groups[i] for i in self._comm], env.world_size, env.rank, is_weighted, env.device)
        self._group_feat_idx = [[fidx[f] for f in g.features] for g in groups]
        self._single_identity = len(groups) == 1 and self._group_feat_idx[0] == list(range(len(self._embedding_names)))
        #: per group: its features' rows of the EBC's [F, B] lengths and their segment permutation
        self._group_perms = [
            (torch.tensor(idx, dtype=torch.int64, device=env.device),
             SegmentPermutation(idx, len(self._embedding_names), env.device))
            for idx in self._group_feat_idx
        ]
        # where each column of each group output tensor goes in the table-ordered output
        labels: list[list[int]] = []
        for g, gf in zip(groups, self._group_feat_idx):
            col_feat = [f for f in range(len(g.features)) for _ in range(g.feature_offsets[f + 1] - g.feature_offsets[f])]
            for cols in g.output_cols():
                labels.append([ebc_feat_off[gf[col_feat[c]]] + c - g.feature_offsets[col_feat[c]] for c in cols])
        self._assembly = ColumnAssembly(labels, ebc_feat_off[-1])
        # wire format of the id all-to-all: int32 when every communicated table has < 2^31 rows
        # (lengths, local ids and float32 weight bits then all fit), else int64
        self.input_dist_dtype = input_dist_dtype
        #: data_parallel tables up to this many fp32 bytes get a dense gradient all-reduce (no host
        #: sync), whatever the optimizer
        self.dense_grad_max_bytes = DENSE_GRAD_MAX_BYTES
        #: the densified gradient also carries each row's lookup count (same all-reduce), so the
        #: optimizer updates exactly the rows looked up: decided here from the optimizer settings,
        #: under the Adam family (it updates a looked-up row whose summed gradient is zero) and
        #: under embedding weight decay (it must reach only the rows looked up)
        self.track_touched_rows = bool(embedding_optimizer(self._spec.type).sparse_grads or self._spec.weight_decay)
        #: send / receive buffers of the data_parallel row all-gather, reused between steps
        self._grad_sync_workspace: dict = {}
        #: bytes this rank sent in its last input_dist: (size exchange, data)
        self.input_dist_bytes: tuple[int, int] = (0, 0)
        #: this rank's zones of the managed-collision tables (:meth:`set_managed_collision`), or None
        self.managed_collision: nn.Module | None = None

    def set_managed_collision(self, mc: nn.Module) -> None:
        """Shard managed-collision tables row_wise by zone: ``mc`` is this rank's
        :class:`~dlrmctl.distributed.sharded_mc.ShardedManagedCollision`.  Each table must be
        row_wise with :func:`~dlrmctl.distributed.sharded_mc.managed_collision_sharding`'s
        shards; its features hold raw ids (not range-checked; the id all-to-all goes in int64).

        Raises:
            PlanError: a managed table that is not sharded that way.
        """
        from dlrmctl.distributed.sharded_mc import managed_collision_sharding

        configs = {t.name: t for t in self._tables}
        routing = {}
        for name in mc.tables():
            t = configs[name]
            ps = self.plan.plan[name]
            want = managed_collision_sharding(t.num_embeddings, t.embedding_dim, self.env.world_size, ps.compute_kernel)
            if ps.sharding_type != ShardingType.ROW_WISE or [m.to_dict() for m in ps.shards or []] != [
                    m.to_dict() for m in want.shards or []]:
                raise PlanError(f"table '{name}': a managed-collision table is sharded row_wise by zone "
                                f"(rank r: rows [r*{mc.sizes[name] // self.env.world_size}, ...)); the plan gives "
                                f"{ps.sharding_type.value}")
            for f in t.feature_names:
                routing[f] = mc.routing(f)
        for g in self.groups:
            if g.row_wise and any(f in routing for f in g.features):
                g.set_raw_routing(routing)
        self.managed_collision = mc
        managed = set(mc.tables())
        self._bounds = {e: [b for b in bs if b.table not in managed] for e, bs in self._bounds.items()}
        self._bounds = {e: bs for e, bs in self._bounds.items() if bs}
        self._wire_dtype = torch.int64  # raw ids are 63-bit

    @property
    def output_dist_dtype(self) -> torch.dtype | None:
        """The pooled embeddings' wire dtype now: :attr:`comm_dtype` in training; None (full
        precision) in eval mode, since ``sharding.comm_precision`` is a training-speed setting and
        evaluation (with fp32 dense arithmetic) must score the model as ``dlrmctl evaluate`` and
        the fp32 export do."""
        return self.comm_dtype if self.training else None

    # ---------------------------------------------------------- input dist
    @property
    def input_dist_dtype(self) -> torch.dtype:
        """Element type of the id all-to-all (int32 or int64); settable (``None``: automatic)."""
        return self._wire_dtype

    @input_dist_dtype.setter
    def input_dist_dtype(self, dtype: torch.dtype | None) -> None:
        big = any(t.num_embeddings >= 2**31 for i in self._comm for t in self.groups[i].tables)
        if dtype not in (None, torch.int32, torch.int64):
            raise ValueError(f"input_dist_dtype must be torch.int32, torch.int64 or None, got {dtype}")
        if dtype == torch.int32 and big:
            raise ValueError("input_dist_dtype=torch.int32 with a table of >= 2^31 rows: its ids do not fit")
        self._wire_dtype = dtype or (torch.int64 if big else torch.int32)

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[ShardedEBCContext]:
        """Start redistributing the local batch's ids; ``.wait()`` gives the lookup inputs.

        The small all-to-all of sizes runs synchronously and is read back in one
        host sync; the data all-to-all runs asynchronously (``async_op=True``) until
        ``wait()``.  Issued on the current stream (the pipeline puts it on its
        data-dist stream, see :class:`dlrmctl.train.pipeline.PipelineStreams`).
        """
        return self._input_dist(features)

    def _input_dist(self, features: KeyedJaggedTensor) -> Awaitable[ShardedEBCContext]:
        # variable batch per key: each key padded with empty bags to its largest batch, the
        # pooled output is expanded back with the inverse indices after the output dist
        features, inv = split_variable_batch(self.prepare_features(features))
        groups = self.groups
        raw = False
        if self.managed_collision is not None:
            # training: raw ids travel to their zone's owner; else rows from the gathered lookup
            raw = self.training
            if not raw:
                features = self.managed_collision.remap_source(features)
            for g in groups:
                if g.routes_raw_ids():
                    g.raw_ids = raw
        local = [features] if self._single_identity else self._group_inputs(features)
        B = features.stride()
        W = self.env.world_size
        B_full = B if inv is None else int(inv[1].shape[1])
        if not self._comm:
            return DoneAwaitable(ShardedEBCContext([B], local, [None] * len(groups), inv, None if W > 1 else [B_full]))
        dev = features.values().device
        plan = self._idist
        wire = self._wire_dtype
        # every comm group's ids as segments (row-wise kinds bucketize here), counts on the device
        srcs = [groups[i].input_dist_source(local[i]) for i in self._comm]
        # 1) sizes: row d = [B, full B, ids per d-received feature of each comm group], gathered
        #    from [B, full B, every group's counts] by one plan-constant index
        counts = torch.cat([host_to_device([B, B_full], torch.int64, dev)] + [c for *_, c in srcs])
        meta_t = counts.index_select(0, plan.meta_idx)
        meta_r, _ = all_to_all_ints(meta_t, plan.meta_in, plan.meta_out, self.env.pg)
        # the one host sync of the step: what we receive and what we send
        both = torch.cat([meta_r, meta_t]).tolist()
        in_splits, out_splits, recv = plan.sizes(both[meta_r.numel():], both[: meta_r.numel()], B)
        # 2) data: lengths, ids, weights of every comm group, in one all-to-all, put in destination
        #    order by one segment permutation of the groups' concatenated sources
        pieces: list[torch.Tensor] = []
        for lengths, values, weights, _ in srcs:
            pieces.append(lengths.to(wire))
            pieces.append(values.to(wire))
            if self._is_weighted:
                pieces.append(weights_to_wire(weights, wire))
        src = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        seg_lengths = counts.index_select(0, plan.send_seg_idx)
        send = plan.send_perm.apply(seg_lengths, src, sum(in_splits))
        self.input_dist_bytes = (meta_t.numel() * meta_t.element_size(), send.numel() * send.element_size())
        data_r, work = all_to_all_ints(send, in_splits, out_splits, self.env.pg, async_op=True)

        def finish() -> ShardedEBCContext:
            data = data_r if data_r.dtype == torch.int64 else data_r.to(torch.int64)
            # (source, group, kind, feature) segments -> (group, kind, feature, source): key-major,
            # every source's samples in rank order; the lengths come from the received sizes
            out = plan.recv_perm.apply(meta_r.index_select(0, plan.recv_seg_idx), data, data.numel())
            lookup_kjts: list[KeyedJaggedTensor | None] = [None] * len(groups)
            for i, (off_l, n_l, off_v, n_v, lpk) in zip(self._comm, recv.slices):
                g = groups[i]
                keys = [g.features[f] for f in g.layouts[self.env.rank].features]
                weights = int64_to_weights(out[off_v + n_v : off_v + 2 * n_v]) if self._is_weighted else None
                lookup_kjts[i] = KeyedJaggedTensor(
                    keys, out[off_v : off_v + n_v], lengths=out[off_l : off_l + n_l], weights=weights,
                    stride=recv.stride, validate=False, length_per_key=lpk,
                )
            return ShardedEBCContext(recv.batch_sizes, local, lookup_kjts, inv, recv.full_batch_sizes, raw)

        return LazyAwaitable([work], finish)

    def _group_inputs(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """Each group's features of the local batch (``KJT [B]`` per group, group feature order):
        per group one row gather of the ``[F, B]`` lengths and one segment permutation of the
        ids and of the weights (plan constants: :attr:`_group_perms`), no loop over features."""
        lpk = features.length_per_key()  # host ints (the loader's KJT carries them: no sync)
        lens2d = features.lengths_2d()
        counts = lens2d.sum(dim=1)
        values, weights = features.values(), features.weights_or_none()
        keys = features.keys()
        out = []
        for idx, (rows, perm) in zip(self._group_feat_idx, self._group_perms):
            n = sum(lpk[f] for f in idx)
            out.append(KeyedJaggedTensor(
                [keys[f] for f in idx], perm.apply(counts, values, n),
                lengths=lens2d.index_select(0, rows).reshape(-1),
                weights=None if weights is None else perm.apply(counts, weights, n),
                stride=features.stride(), length_per_key=[lpk[f] for f in idx], validate=False,
            ))
        return out

    # ------------------------------------------------ lookup + output dist
    def compute_and_output_dist(self, ctx: ShardedEBCContext) -> KeyedTensor:
        """Local lookups, then pooled embeddings back to their sources: ``KeyedTensor [B_local, sum dims]``
        (:meth:`compute_and_output_dist_async`, waited on at once)."""
        return self.compute_and_output_dist_async(ctx).wait()

    def compute_and_output_dist_async(self, ctx: ShardedEBCContext) -> Awaitable[KeyedTensor]:
        """Local lookups and the launch of the pooled embeddings' all-to-all; ``.wait()`` receives
        them and assembles ``KeyedTensor [B_local, sum dims]`` (float32, the unsharded EBC's keys).

        TorchRec's ``LazyAwaitable`` output dist: whatever runs between this call and ``wait()``
        (the dense arch, see ``DLRM.dense_forward``) overlaps the all-to-all, and its backward
        overlaps the gradient all-to-all.  Row-wise groups on the reduce-scatter collective and
        data_parallel lookups are done before returning.  Bit-identical to waiting at once (the
        same ops on the same values); ``wait()`` must be called once, on every rank, before the
        next collective.  The assembly after the wait runs with autocast off, as it would have
        run before the caller's autocast region."""
        groups = self.groups
        W = self.env.world_size
        bs = ctx.batch_sizes
        results: list[list[torch.Tensor] | None] = [None] * len(groups)
        looked = {i: groups[i].compute(self._lookup_input(i, ctx)) for i in self._comm}
        a2a: Awaitable[list[list[torch.Tensor]]] | None = None
        if self._a2a_out:
            widths = [[groups[i].layouts[d].width for i in self._a2a_out] for d in range(W)]
            if self.env.pg is not None:
                a2a = pooled_all_to_all_async([looked[i] for i in self._a2a_out], bs, widths, self.env.pg,
                                              self.output_dist_dtype)
            else:
                a2a = DoneAwaitable([[looked[i] for i in self._a2a_out]])
        for i in self._own_out:
            results[i] = groups[i].output_dist(looked[i], bs, ctx.local_kjts[i], self.output_dist_dtype)
        for i in self._comm:
            if i in self._a2a_out or i in self._own_out:
                continue
            g = groups[i]
            reduced = reduce_scatter_v(looked[i], bs, self.env.pg, use_collective=True, qdtype=self.output_dist_dtype)
            results[i] = [g.apply_mean(reduced, ctx.local_kjts[i])]  # type: ignore[attr-defined]
        for i, g in enumerate(groups):
            if not g.needs_comm:
                results[i] = [g.compute(ctx.local_kjts[i])]
        device_type = self.env.device.type

        def finish() -> KeyedTensor:
            with torch.autocast(device_type, enabled=False):
                if a2a is not None:
                    out = a2a.wait()
                    for k, i in enumerate(self._a2a_out):
                        results[i] = groups[i].output_dist_recv([out[d][k] for d in range(W)], ctx.local_kjts[i])
                vals = self._assembly([t for r in results for t in r])  # type: ignore[union-attr]
                kt = KeyedTensor(self._embedding_names, self._length_per_key, vals)
                return kt if ctx.inverse_indices is None else expand_by_inverse_indices(kt, ctx.inverse_indices)

        return LazyAwaitable([], finish)

    def _lookup_input(self, i: int, ctx: ShardedEBCContext) -> KeyedJaggedTensor:
        """Group ``i``'s lookup input; raw ids of managed-collision tables remapped by this rank's
        zones first (training; resets the rows new ids take)."""
        kjt = ctx.lookup_kjts[i]
        if ctx.raw_ids and self.groups[i].routes_raw_ids():
            return self.managed_collision.remap_lookup(kjt, self.groups[i])
        return kjt

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.compute_and_output_dist(self.input_dist(features).wait())

    # -------------------------------------------------------- parameters
    def replicated_parameters(self) -> list[nn.Parameter]:
        """data_parallel replicas (their gradients are summed over ranks)."""
        return [p for g in self.groups for p in g.replicated_parameters()]

    def sync_replicated_grads(self) -> None:
        """SUM the data_parallel tables' sparse gradients over ranks (after backward); tables up
        to :attr:`dense_grad_max_bytes` are densified and all-reduced (see ``sync_sparse_grads``)."""
        if self.env.is_distributed:
            sync_sparse_grads(self.replicated_parameters(), self.env.pg, self.dense_grad_max_bytes,
                              workspace=self._grad_sync_workspace, track_touched=self.track_touched_rows)

    def local_shards(
        self, dense_optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, list[tuple[ShardMetadata, torch.Tensor, list[torch.Tensor]]]]:
        """Table -> this rank's shards as ``(metadata, live weight view, optimizer state views)``.

        Fused shards give their TBE momentum (row-wise Adagrad ``[rows]``,
        Adagrad ``[rows, cols]``, SGD none); dense-kernel shards give the
        per-row / per-element tensors of ``dense_optimizer``'s state for their
        weight (empty before its first step, or without ``dense_optimizer``).
        data_parallel tables appear on every rank as one full shard with this
        rank's number (identical replicas).
        """
        out: dict[str, list[tuple[ShardMetadata, torch.Tensor, list[torch.Tensor]]]] = {}
        for g in self.groups:
            for s, w, states, _ in g.local_shards():
                if not states and dense_optimizer is not None and isinstance(w, nn.Parameter):
                    states = row_state_tensors(dense_optimizer, w)
                out.setdefault(s.table.name, []).append((s.meta, w, states))
        return out

    def _full_shapes(self) -> list[tuple[str, int, int]]:
        return [(t.name, t.num_embeddings, t.embedding_dim) for t in self._tables]
