"""table_wise: each table lives whole on one rank.

input_dist: every rank sends each feature's bags (ids unchanged) to the rank
holding its table; output_dist: the owner sends each source its pooled rows
back (all-to-all) and the source concatenates the blocks.
"""

from __future__ import annotations


from dlrmctl.distributed.sharding.kinds import TableWiseLikeSharding
from dlrmctl.distributed.types import (
    PlanError,
    ShardingType,
)


class TwSharding(TableWiseLikeSharding):
    """Tables sharded table-wise on this rank (see :class:`~dlrmctl.distributed.sharding.common.EmbeddingSharding`)."""

    sharding_type = ShardingType.TABLE_WISE


    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        """Round-robin placement: table ``i`` on rank ``i % world_size``."""
        return [table_index % world_size]

    @classmethod
    def validate_sharding(cls, table, ps) -> None:
        super().validate_sharding(table, ps)
        if len(ps.shards or []) != 1:
            raise PlanError(f"table '{table.name}': table_wise needs exactly one shard")
