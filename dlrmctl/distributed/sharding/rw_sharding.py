"""row_wise: a table's rows are split in equal blocks over all ranks.

input_dist: ids are bucketized by row block (``fbgemm.block_bucketize_sparse_features``
when FBGEMM is installed, else :func:`~dlrmctl.distributed.sharding.bucketize.bucketize_torch`)
and remapped to local rows, then sent to the block's rank; every rank looks up
its block for all sources' bags with *sum* pooling.
output_dist: reduce-scatter of the partial sums (NCCL ``reduce_scatter``; on
gloo an all-to-all of the row blocks plus a local sum).  Mean pooling divides
the reduced sum by the whole bag length at the source, so a bag split over
shards gets the mean of the whole bag.

Rows not divisible by the world size: blocks of ``ceil(rows / world_size)``,
the last ones smaller or empty (10 rows on 3 ranks -> 4, 4, 2).
"""

from __future__ import annotations


from dlrmctl.distributed.sharding.kinds import RowWiseLikeSharding
from dlrmctl.distributed.types import (
    PlanError,
    ShardingType,
)


class RwSharding(RowWiseLikeSharding):
    """Tables sharded row-wise on this rank."""

    sharding_type = ShardingType.ROW_WISE


    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        return list(range(world_size))

    @classmethod
    def validate_sharding(cls, table, ps) -> None:
        super().validate_sharding(table, ps)
        ranks = [m.rank for m in ps.shards or []]
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"table '{table.name}': {ps.sharding_type.value} puts two row shards on one rank {ranks}")
