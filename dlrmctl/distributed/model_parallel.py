"""DistributedModelParallel: a DLRM with sharded embeddings and replicated dense layers.

Gradient semantics (what makes a multi-rank step equal the single-process step
on the same global batch):

* The trainer computes on every rank ``loss = BCE_sum_over_local_samples /
  global_batch_size`` and calls ``loss.backward()`` (no averaging anywhere else).
* Embedding shards: backward of the output all-to-all / reduce-scatter brings
  each shard the gradient rows of *all* ranks' samples, so its gradient (and
  its fused optimizer update) is already the global-batch gradient.
* Dense layers (MLPs) and data_parallel tables are replicated: their gradients
  are all-reduced with **SUM** (not averaged) — sum over ranks of
  ``d(sum_local / global_B)`` is the global-batch gradient.  Dense gradients go
  through :class:`~dlrmctl.distributed.comm.GradBucketReducer`: DDP's buckets,
  each all-reduced asynchronously as soon as backward has produced it, so the
  communication overlaps the rest of backward; a callback queued on the
  autograd engine waits for them (and sums the data_parallel tables' sparse
  gradients) at the end of ``backward()``.  With
  ``sync_grads_in_backward=False`` call :meth:`sync_dense_gradients` yourself.

After ``backward``, step the dense optimizer over :meth:`dense_parameters` and
a torch embedding optimizer over :meth:`embedding_dense_parameters`
(``dlrmctl.optim.dense.embedding_optimizer_for_dense``); fused tables were
already updated inside backward (:meth:`fused_optimizer` gives their lr and state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

import torch
from torch import nn

from dlrmctl.distributed.comm import Awaitable, DoneAwaitable, GradBucketReducer, broadcast, sync_dense_grads
from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.sharded_ebc import SHARDING_CLASSES, ShardedEmbeddingBagCollection
from dlrmctl.distributed.types import ComputeKernel, PlanError, ShardingPlan, ShardingType
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec, FusedOptimizer, TableFeatures
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor

if TYPE_CHECKING:
    from dlrmctl.modules.dlrm import DLRM


class TableConfigs(TableFeatures):
    """Placeholder ``sparse_arch`` holding only table configs (no weights): lets a
    DLRM be built and sharded without ever allocating the full tables.  Its
    ``managed_collision_configs`` (``(tables, table -> (size, eviction, buckets), seed)``, or
    None) are the managed-collision tables DistributedModelParallel shards by zone."""

    managed_collision_configs: tuple | None = None

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        raise RuntimeError("TableConfigs is a placeholder: shard it with DistributedModelParallel")


class DistributedModelParallel(nn.Module):
    """Shard ``module.sparse_arch`` by ``plan``; keep the rest replicated.

    Args:
        module: a DLRM (anything with ``.sparse_arch`` — an EmbeddingBagCollection,
            or a :class:`TableConfigs` placeholder so the full tables are never
            allocated — and ``dense_forward(dense, KeyedTensor)``).  Modified in place:
            ``sparse_arch`` becomes a :class:`ShardedEmbeddingBagCollection`.
        env: this rank.
        plan: the sharding plan; ``None`` runs unsharded (world size 1 only: no
            sharding, no collectives, the original EBC).
        optimizer: fused embedding optimizer hyper-parameters.
        seed: embedding init seed; sharded tables get exactly the weights of an
            unsharded EBC built with this seed (the original EBC's weights are
            not copied; use ``sparse_arch.load_full_weights`` to start from given ones).
        check_ids: apply the EBC's ``on_invalid_id`` to every local batch (``False``: the
            caller did, e.g. the trainer's loader on the CPU batch).
        sync_grads_in_backward: SUM-all-reduce the replicated gradients during /
            at the end of every backward (else call :meth:`sync_dense_gradients`).
        bucket_cap_mb: size of the dense-gradient all-reduce buckets (MiB).
        comm_precision: ``fp32`` | ``bf16`` | ``fp16``: the precision the pooled embeddings'
            output_dist and its gradient travel in (``sharding.comm_precision``, qcomm).
        overlap_output_dist: :meth:`compute_and_output_dist` returns an ``Awaitable[KeyedTensor]``
            that :meth:`dense_forward` waits on after the dense arch, so the bottom MLP runs while
            the pooled embeddings' all-to-all travels, forward and backward
            (``sharding.overlap_output_dist``; bit-identical results either way).  Also settable
            as the attribute of the same name.  Default False here (a direct caller gets a
            ``KeyedTensor``, as TorchRec's ``DistributedModelParallel.forward`` gives); the trainer
            passes the config key, whose default is true.

    Forward: ``dense [B, D_in]`` float32, ``sparse`` KJT (local batch ``B``, may
    differ between ranks) -> logits ``[B, 1]``.

    Raises:
        PlanError: no plan with several ranks, or a plan that does not fit.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv,
        plan: ShardingPlan | None,
        optimizer: EmbeddingOptimizerSpec,
        seed: int = 0,
        check_ids: bool = True,
        sync_grads_in_backward: bool = True,
        bucket_cap_mb: float = 25.0,
        comm_precision: str = "fp32",
        overlap_output_dist: bool = False,
    ) -> None:
        super().__init__()
        self.env = env
        #: defer the wait of the output dist to ``dense_forward`` (after the dense arch)
        self.overlap_output_dist = bool(overlap_output_dist)
        self.plan = plan
        self._spec = optimizer
        self._sync_in_backward = sync_grads_in_backward
        self._sync_queued = False
        ebc = module.sparse_arch
        if plan is None:
            if env.world_size > 1:
                raise PlanError(
                    f"DistributedModelParallel: {env.world_size} ranks need a sharding plan "
                    "(`dlrmctl plan`, or sharding.tables in the config)"
                )
        else:
            module.sparse_arch = ShardedEmbeddingBagCollection(
                ebc.embedding_bag_configs(), plan, env, ebc.is_weighted(), optimizer, seed, check_ids,
                on_invalid_id=getattr(ebc, "on_invalid_id", "error"), comm_precision=comm_precision,
            )
            mc = getattr(ebc, "managed_collision_configs", None)
            if mc is not None:  # managed-collision tables: this rank's zones of their remappers
                from dlrmctl.distributed.sharded_mc import ShardedManagedCollision

                module.sparse_arch.set_managed_collision(ShardedManagedCollision(mc[0], mc[1], mc[2], env))
            del ebc
        for name, child in module.named_children():
            if name != "sparse_arch":
                child.to(env.device)
        self.module = module
        self._reducer: GradBucketReducer | None = None
        if env.is_distributed:
            self._broadcast_dense()
            if sync_grads_in_backward:
                self._reducer = GradBucketReducer(self.dense_parameters(), env.pg, bucket_cap_mb)

    @torch.no_grad()
    def _broadcast_dense(self) -> None:
        """Make the replicas identical: rank 0's dense parameters and buffers everywhere."""
        ts = [p.data for p in self.dense_parameters()]
        ts += [b for n, b in self.module.named_buffers() if not n.startswith("sparse_arch.") and b.is_floating_point()]
        if not ts:
            return
        flat = torch.cat([t.reshape(-1) for t in ts])
        broadcast(flat, 0, self.env.pg)
        off = 0
        for t in ts:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()

    # ------------------------------------------------------------- forward
    @property
    def sparse_arch(self) -> nn.Module:
        return self.module.sparse_arch

    @property
    def is_sharded(self) -> bool:
        return isinstance(self.module.sparse_arch, ShardedEmbeddingBagCollection)

    def sparse_input_dist(self, features: KeyedJaggedTensor) -> Awaitable:
        """Start the ids' all-to-all (async, on the current stream); ``.wait()`` gives the lookup context."""
        if self.is_sharded:
            return self.module.sparse_arch.input_dist(features)
        return DoneAwaitable(features)

    def compute_and_output_dist(self, ctx) -> KeyedTensor | Awaitable[KeyedTensor]:
        """Lookups + pooled embeddings back to this rank: ``KeyedTensor [B_local, sum dims]``;
        with :attr:`overlap_output_dist` (sharded only) an ``Awaitable`` of it whose all-to-all
        is in flight: hand it to :meth:`dense_forward` (or ``.wait()`` it) before the next
        collective."""
        if self.is_sharded:
            if self.overlap_output_dist:
                return self.module.sparse_arch.compute_and_output_dist_async(ctx)
            return self.module.sparse_arch.compute_and_output_dist(ctx)
        return self.module.sparse_arch(ctx)

    def dense_forward(self, dense_features: torch.Tensor,
                      embedded: KeyedTensor | Awaitable[KeyedTensor]) -> torch.Tensor:
        """Dense part: ``dense [B, D_in]``, pooled ``KeyedTensor`` (or its ``Awaitable``, waited on
        after the dense arch) -> logits ``[B, 1]``."""
        logits = self.module.dense_forward(dense_features, embedded)
        self._sync_queued = False  # one gradient sync per backward, however many forwards fed it
        if self._sync_in_backward and self.env.is_distributed and logits.requires_grad:
            logits.register_hook(self._queue_sync)
        return logits

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense_forward(
            dense_features, self.compute_and_output_dist(self.sparse_input_dist(sparse_features).wait())
        )

    def _queue_sync(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._sync_queued:
            self._sync_queued = True
            if self._reducer is not None:
                self._reducer.arm()

            def run() -> None:
                self._sync_queued = False
                self._finish_grad_sync()

            torch.autograd.Variable._execution_engine.queue_callback(run)
        return grad

    @torch.no_grad()
    def _finish_grad_sync(self) -> None:
        if self._reducer is not None:
            self._reducer.finish()
        else:
            sync_dense_grads(self.dense_parameters(), self.env.pg)
        if self.is_sharded:
            self.module.sparse_arch.sync_replicated_grads()

    # ------------------------------------------------------- parameters
    def dense_parameters(self) -> list[nn.Parameter]:
        """Replicated dense-layer parameters (MLPs, interaction) for the dense optimizer."""
        return [p for n, p in self.module.named_parameters() if not n.startswith("sparse_arch.")]

    def embedding_dense_parameters(self) -> list[nn.Parameter]:
        """Dense-kernel embedding shards (incl. data_parallel replicas) for a torch embedding optimizer."""
        sa = self.module.sparse_arch
        if self.is_sharded:
            return sa.embedding_dense_parameters()
        return sa.lookup.dense_parameters()

    def fused_optimizer(self) -> FusedOptimizer:
        """lr / state of the optimizers fused into this rank's TBEs."""
        return self.module.sparse_arch.fused_optimizer()

    @torch.no_grad()
    def sync_dense_gradients(self) -> None:
        """SUM-all-reduce the gradients of the dense layers and data_parallel tables."""
        if not self.env.is_distributed:
            return
        sync_dense_grads(self.dense_parameters(), self.env.pg)
        if self.is_sharded:
            self.module.sparse_arch.sync_replicated_grads()

    def describe_plan(self) -> str:
        if self.plan is None:
            return "no sharding plan: unsharded model on one process"
        return describe_plan(self.plan, self.module.sparse_arch.embedding_bag_configs())


#: what the trainer, the checkpoint layout and reload take as "the model": a DLRM, or one rank's
#: DistributedModelParallel around it; both offer ``dense_parameters()``,
#: ``embedding_dense_parameters()``, ``fused_optimizer()``, ``sparse_arch`` and ``dense_forward``
TrainModel = Union["DLRM", "DistributedModelParallel"]


def unwrap_dlrm(model: TrainModel) -> "DLRM":
    """The DLRM of ``model``: the module inside a DistributedModelParallel, or the model itself
    (its parameter names and state dict are the checkpoint's, whatever the wrapping)."""
    return model.module if isinstance(model, DistributedModelParallel) else model


# ------------------------------------------------------------------ plans
def plan_from_types(
    tables: Sequence[EmbeddingBagConfig],
    sharding_types: str | ShardingType | dict[str, str | ShardingType],
    world_size: int,
    local_world_size: int | None = None,
    compute_kernel: str | ComputeKernel | dict[str, str | ComputeKernel] = ComputeKernel.FUSED,
    column_sizes: dict[str, Sequence[int]] | None = None,
    ranks: dict[str, Sequence[int]] | None = None,
) -> ShardingPlan:
    """A plan from a sharding type per table, with each type's default placement
    (table-wise round robin, row-wise over all ranks, table_* kinds over one
    host chosen round robin, column-wise blocks on every rank).

    Not a planner (no memory or cost model): for tests, benchmarks and
    hand-written configs.  data_parallel tables always get the dense kernel.
    """
    lws = local_world_size or world_size
    out: dict = {}
    for i, t in enumerate(tables):
        st = ShardingType(sharding_types if not isinstance(sharding_types, dict) else sharding_types[t.name])
        ck = compute_kernel if not isinstance(compute_kernel, dict) else compute_kernel.get(t.name, ComputeKernel.FUSED)
        if st == ShardingType.DATA_PARALLEL:
            ck = ComputeKernel.DENSE
        cls = SHARDING_CLASSES[st]
        rk = list(ranks[t.name]) if ranks and t.name in ranks else cls.default_ranks(i, world_size, lws)
        cs = (column_sizes or {}).get(t.name)
        out[t.name] = cls.shard_table(t, rk, ck, cs)
    plan = ShardingPlan(world_size, lws, out)
    plan.validate(tables, world_size)
    return plan


def describe_plan(plan: ShardingPlan, tables: Sequence[EmbeddingBagConfig]) -> str:
    """Readable plan: one line per table (type, kernel, shape, ranks, every shard's
    rows / cols), then per rank the shards and parameter bytes it holds."""
    lines = [
        f"Sharding plan: world_size {plan.world_size}, local_world_size {plan.local_world_size} "
        f"({plan.world_size // plan.local_world_size} host(s))",
        f"{'table':<20} {'sharding':<18} {'kernel':<6} {'rows x dim':>16}  {'ranks':<12} shards (rank: rows [r0, r1) cols [c0, c1))",
    ]
    per_rank_shards = [0] * plan.world_size
    per_rank_bytes = [0] * plan.world_size
    for t in tables:
        ps = plan.plan[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            shards_s = "replicated on every rank"
            for r in ps.ranks:
                per_rank_shards[r] += 1
                per_rank_bytes[r] += t.num_embeddings * t.embedding_dim * 4
        else:
            parts = []
            for m in ps.shards or []:
                r0, c0 = m.offsets
                parts.append(f"{m.rank}: [{r0}, {r0 + m.sizes[0]}) [{c0}, {c0 + m.sizes[1]})")
                per_rank_shards[m.rank] += 1
                per_rank_bytes[m.rank] += m.sizes[0] * m.sizes[1] * 4
            shards_s = "; ".join(parts)
        ranks_s = ",".join(map(str, ps.ranks))
        lines.append(
            f"{t.name:<20} {ps.sharding_type.value:<18} {ps.compute_kernel.value:<6} "
            f"{f'{t.num_embeddings} x {t.embedding_dim}':>16}  {ranks_s:<12} {shards_s}"
        )
    lines.append("rank  shards  weights (MB)")
    for r in range(plan.world_size):
        lines.append(f"{r:<5} {per_rank_shards[r]:<7} {per_rank_bytes[r] / 2**20:.2f}")
    return "\n".join(lines)
