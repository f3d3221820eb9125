"""column_wise: a table is split into column blocks placed on (any) ranks.

input_dist: each feature's bags go, unchanged, to every rank holding a column
block of its table (one copy per rank, even if the rank holds several blocks);
output_dist: each owner returns its ``[B, block cols]`` pooled blocks
(all-to-all), the source concatenates them in column order.  Mean pooling is
exact per block (each block sees the whole bag).

Row-wise Adagrad keeps one accumulator per row *and shard*, so a column-wise
table under ``exact_rowwise_adagrad`` is not bit-identical to the unsharded
table (as in TorchRec); the same holds for the per-row second moment of
``partial_rowwise_adam`` / ``partial_rowwise_lamb`` and LAMB's per-row trust
ratio.  ``exact_adagrad`` / ``exact_sgd`` / ``adam`` (per-element state: each
column shard holds its columns of both moments) are exact.
"""

from __future__ import annotations


from dlrmctl.distributed.sharding.kinds import TableWiseLikeSharding
from dlrmctl.distributed.types import (
    ShardingType,
)


class CwSharding(TableWiseLikeSharding):
    """Tables sharded column-wise on this rank."""

    sharding_type = ShardingType.COLUMN_WISE


    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        """Column blocks on every rank, rotated per table to spread the first (widest) block."""
        return [(table_index + i) % world_size for i in range(world_size)]
