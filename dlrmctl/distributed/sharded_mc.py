"""Managed-collision tables sharded row_wise over ranks (TorchRec's sharded MC modules).

A managed-collision table of ``N`` rows (plus its default row ``N``) with ``B`` buckets
(:mod:`dlrmctl.modules.managed_collision`) is split over ``W`` ranks, ``W`` dividing ``B``, into
*zones*: rank ``r`` owns the buckets ``[r B/W, (r+1) B/W)`` of the raw-id space (an id's bucket
is ``id % B``), their rows ``[r N/W, (r+1) N/W)`` (the last rank also the default row) and the
remapper of those rows (a zone :class:`~dlrmctl.modules.managed_collision.ManagedCollisionRemapper`
of ``N/W`` rows).

Training: the row_wise input_dist sends each raw id to the rank owning its zone
(``(id % B) // (B/W)``, see :meth:`~dlrmctl.distributed.sharding.kinds.RowWiseLikeSharding.bucketize`;
the ids travel as int64), and the owner remaps the ids it received from every source just before
its lookup (:meth:`ShardedManagedCollision.remap_lookup`: the same vectorised remap as one
process, no per-id loop, no host read), resetting the rows new ids took in its shard and in the
shard's optimizer state.  The rows a zone gives are local to the rank's shard.  Since a bucket's
state depends only on its own ids, and every zone sees exactly the ids of the global batch in its
buckets, the W zones together hold exactly the state of one process's remapper.

Evaluation (and anything outside training): each rank needs the row of any id of its local
batch, misses included (the default row, on the last rank), so the zones' lookups (``N`` sorted
ids and rows) are all-gathered once after the state changed and ids are remapped at the source;
the rows then go through the ordinary row_wise input_dist.

Checkpoint: the row arrays (``row_ids``, ``counts``, ``last_seen``, ``[N+1]``) are saved as the
zones' blocks at their row offsets and ``sorted_ids`` / ``sorted_rows`` as the gathered global
lookup, so the entries are exactly those of one process (any world size whose ``W`` divides
``B`` loads them; a zone rebuilds its lookup from its rows).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from dlrmctl.distributed.comm import all_gather_tensor
from dlrmctl.distributed.env import ShardingEnv
from dlrmctl.distributed.types import (ComputeKernel, ParameterSharding, PlanError, ShardingPlan, ShardingType,
                                      ShardMetadata)
from dlrmctl.modules.managed_collision import (ManagedCollisionRemapper, remap_features, reset_uniform,
                                               table_reset_key)

__all__ = ["ShardedManagedCollision", "managed_collision_plan", "managed_collision_sharding", "zone_rows"]


def zone_rows(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of rank ``rank``'s zone of a table of ``size`` rows (the default row
    ``size`` not counted)."""
    z = size // world_size
    return rank * z, z


def managed_collision_sharding(num_embeddings: int, dim: int, world_size: int,
                               compute_kernel: ComputeKernel | str = ComputeKernel.FUSED) -> ParameterSharding:
    """The row_wise :class:`ParameterSharding` of a managed-collision table of ``num_embeddings =
    size + 1`` rows on ``world_size`` ranks: rank ``r`` holds its zone's rows (:func:`zone_rows`),
    the last rank also the default row.

    Raises:
        PlanError: ``size`` not a multiple of ``world_size``.
    """
    size = num_embeddings - 1
    if size % world_size:
        raise PlanError(f"managed-collision table of {size} rows: not a multiple of the {world_size} ranks")
    shards = []
    for r in range(world_size):
        r0, n = zone_rows(size, world_size, r)
        shards.append(ShardMetadata(r, [r0, 0], [n + (1 if r == world_size - 1 else 0), dim]))
    return ParameterSharding(ShardingType.ROW_WISE, ComputeKernel(compute_kernel), list(range(world_size)), shards)


def managed_collision_plan(plan: ShardingPlan, tables: Sequence[Any], compute_kernel: str) -> ShardingPlan:
    """``plan`` with every managed-collision table of ``tables`` sharded row_wise by zone
    (:func:`managed_collision_sharding`; its kernel kept, ``compute_kernel`` for a data_parallel
    choice), the other tables unchanged."""
    out = dict(plan.plan)
    for t in tables:
        ps = out[t.name]
        kernel = compute_kernel if ps.sharding_type == ShardingType.DATA_PARALLEL else ps.compute_kernel
        out[t.name] = managed_collision_sharding(t.num_embeddings, t.embedding_dim, plan.world_size, kernel)
    return ShardingPlan(plan.world_size, plan.local_world_size, out)


class _GlobalLookup:
    """The gathered lookup of a sharded table: ``ids [n] -> global rows [n]`` (a miss: ``default``)."""

    def __init__(self, sorted_ids: torch.Tensor, sorted_rows: torch.Tensor, default: int) -> None:
        self.sorted_ids, self.sorted_rows, self.default = sorted_ids, sorted_rows, default

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.sorted_ids, ids).clamp_(max=self.sorted_ids.numel() - 1)
        return torch.where(self.sorted_ids[pos] == ids, self.sorted_rows[pos], self.default)


class ShardedManagedCollision(nn.Module):
    """This rank's zone remappers of the managed-collision tables of a sharded collection (see the
    module docstring).

    Args:
        tables: the managed tables (``EmbeddingBagConfig``, ``num_embeddings = size + 1``).
        configs: table name -> ``(size, eviction, buckets)``.
        seed: ``train.seed`` (a newcomer's weights: as one process's).
        env: this rank (``world_size`` must divide every table's ``buckets``).

    Raises:
        ValueError: ``world_size`` does not divide a table's ``buckets``.
    """

    def __init__(self, tables: Sequence[Any], configs: dict[str, tuple[int, str, int]], seed: int,
                 env: ShardingEnv) -> None:
        super().__init__()
        self.env = env
        W, r = env.world_size, env.rank
        self.remappers = nn.ModuleDict()
        self._features: dict[str, list[str]] = {}
        self._init: dict[str, tuple[float, float, int]] = {}
        self.sizes: dict[str, int] = {}
        self.buckets: dict[str, int] = {}
        for t in tables:
            size, eviction, buckets = configs[t.name]
            if buckets % W:
                raise ValueError(f"managed-collision table '{t.name}': buckets ({buckets}) is not a multiple of the "
                                 f"{W} ranks")
            _, zone = zone_rows(size, W, r)
            self.remappers[t.name] = ManagedCollisionRemapper(zone, eviction, buckets // W, env.device,
                                                              bucket_offset=r * (buckets // W), total_buckets=buckets)
            self._features[t.name] = list(t.feature_names)
            self._init[t.name] = (t.get_weight_init_min(), t.get_weight_init_max(), table_reset_key(seed, t.name))
            self.sizes[t.name] = size
            self.buckets[t.name] = buckets
        #: the torch optimizer of dense-kernel shards (its per-row state is reset on eviction); set by the trainer
        self.dense_optimizer: torch.optim.Optimizer | None = None
        #: training remaps (and loads) so far: the gathered lookup is refreshed when it moved
        self._version = 0
        self._gathered: tuple[int, dict[str, _GlobalLookup]] | None = None

    def tables(self) -> list[str]:
        """Names of the managed tables."""
        return list(self._features)

    def features(self) -> list[str]:
        """Input features of the managed tables."""
        return [f for fs in self._features.values() for f in fs]

    def routing(self, feature: str) -> tuple[int, int] | None:
        """``(B, B/W)`` of a managed feature's table (its raw ids go to rank ``(id % B) // (B/W)``),
        None for another feature."""
        for t, fs in self._features.items():
            if feature in fs:
                return self.buckets[t], self.buckets[t] // self.env.world_size
        return None

    def reset_values(self, table: str, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """A newcomer's weights (as :meth:`ManagedCollisionCollection.reset_values`)."""
        low, high, key = self._init[table]
        return reset_uniform(ids, dim, key, low, high)

    # ------------------------------------------------------------------ training
    def remap_lookup(self, kjt, group: nn.Module):
        """Training: the lookup input of ``group`` (this rank's row_wise group, ids from every
        source) with each managed feature's raw ids replaced by rows of this rank's shard; the
        rows new ids took are reset in the shard and its optimizer state."""
        shards = {s.table.name: (w, states) for s, w, states, _ in group.local_shards()}

        def row_state(table: str):
            w, states = shards[table]
            if not states and self.dense_optimizer is not None and isinstance(w, nn.Parameter):
                from dlrmctl.optim.dense import row_state_tensors

                states = list(row_state_tensors(self.dense_optimizer, w))
            return w, states

        self._version += 1
        return remap_features(kjt, self._features, self.remappers, True, row_state, self.reset_values)

    # ---------------------------------------------------------------- evaluation
    def _global_lookups(self) -> dict[str, _GlobalLookup]:
        if self._gathered is None or self._gathered[0] != self._version:
            self._gathered = (self._version, {t: _GlobalLookup(*self._global_sorted(t), self.sizes[t])
                                              for t in self._features})
        return self._gathered[1]

    def _global_sorted(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sorted ids [N], their global rows [N])`` of the whole table: the zones' lookups
        gathered (collective) and merged; free rows last, in row order (as one process's)."""
        rm = self.remappers[table]
        W = self.env.world_size
        ids = all_gather_tensor(rm.sorted_ids, self.env.pg).reshape(-1)
        rows = all_gather_tensor(rm.sorted_rows, self.env.pg)
        rows = (rows + torch.arange(W, device=rows.device)[:, None] * rm.size).reshape(-1)
        sid, order = torch.sort(ids, stable=True)
        return sid, rows[order]

    def remap_source(self, kjt):
        """Outside training: this rank's local batch with each managed feature's raw ids replaced
        by global rows (a miss: the default row).  Collective when the state changed since the
        last call (every rank calls it for the same batches)."""
        return remap_features(kjt, self._features, self._global_lookups(), False, None, None)

    # ---------------------------------------------------------------- checkpoint
    def _row_offset(self, table: str) -> int:
        return zone_rows(self.sizes[table], self.env.world_size, self.env.rank)[0]

    def load_request(self) -> dict[str, Any]:
        """What this rank reads of the ``mc/`` entries, filled in place: its zone's row arrays
        (``[N+1]``, blocks at its row offset; the last rank also the scratch entry ``N``) and
        ``step``; call :meth:`after_load` afterwards."""
        from dlrmctl.train.checkpoint.codec import Blocks

        out: dict[str, Any] = {}
        last = self.env.rank == self.env.world_size - 1
        for t, rm in self.remappers.items():
            N, r0 = self.sizes[t], self._row_offset(t)
            for name in ("row_ids", "counts", "last_seen"):
                buf = getattr(rm, name)
                out[f"mc/{t}.{name}"] = Blocks((N + 1,), [((r0,), buf[: rm.size])] + ([((N,), buf[rm.size:])] if last else []))
            out[f"mc/{t}.step"] = rm.step
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """``mc/<table>.<buffer>`` entries as one process writes them (collective: the global
        lookup is gathered): :meth:`load_request`'s blocks, and ``sorted_ids`` / ``sorted_rows`` whole."""
        out = self.load_request()
        for t in self._features:
            out[f"mc/{t}.sorted_ids"], out[f"mc/{t}.sorted_rows"] = self._global_sorted(t)
        return out

    def checkpoint_keys(self) -> set[str]:
        """The ``mc/`` keys of a checkpoint of these tables."""
        return {f"mc/{t}.{n}" for t in self._features
                for n in ("row_ids", "counts", "last_seen", "sorted_ids", "sorted_rows", "step")}

    @torch.no_grad()
    def after_load(self) -> None:
        """Rebuild each zone's lookup from its loaded rows."""
        for rm in self.remappers.values():
            rm.rebuild_lookup()
            rm.sync_host_bounds()
        self._version += 1
