"""data_parallel: every rank holds the whole table (dense kernel).

No input or output communication: each rank looks up its own local batch.
The tables' (sparse) gradients are summed over ranks after backward
(:func:`~dlrmctl.distributed.comm.sync_sparse_grads`), so every replica takes
the same optimizer step as the single-process model on the global batch.
"""

from __future__ import annotations

from typing import Sequence

from dlrmctl.distributed.sharding.common import EmbeddingSharding, LocalShard
from dlrmctl.distributed.types import (
    ComputeKernel,
    ParameterSharding,
    PlanError,
    ShardingType,
    ShardMetadata,
)
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig


class DpSharding(EmbeddingSharding):
    """Replicated tables on this rank."""

    sharding_type = ShardingType.DATA_PARALLEL
    replicated = True
    needs_comm = False

    @staticmethod
    def shard_table(
        table: EmbeddingBagConfig,
        ranks: Sequence[int],
        compute_kernel: ComputeKernel | str = ComputeKernel.DENSE,
        column_sizes: Sequence[int] | None = None,
    ) -> ParameterSharding:
        """A full replica on every rank of ``ranks`` (all ranks); dense kernel only."""
        if ComputeKernel(compute_kernel) != ComputeKernel.DENSE:
            raise PlanError(f"table '{table.name}': data_parallel tables use the dense kernel")
        return ParameterSharding(ShardingType.DATA_PARALLEL, ComputeKernel.DENSE, list(ranks), None)

    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        return list(range(world_size))

    def _shards_on(self, d: int) -> list[LocalShard]:
        return [
            LocalShard(t, 0, ShardMetadata(d, [0, 0], [t.num_embeddings, t.embedding_dim]), ComputeKernel.DENSE)
            for t in self.tables
        ]

    def replicated_parameters(self) -> list:
        """The replicas' weights, whose gradients are summed over ranks."""
        return [p for lk in self.lookups for p in lk.dense_parameters()]

    def output_cols(self) -> list[list[int]]:
        return [self.layouts[self.env.rank].out_cols]
