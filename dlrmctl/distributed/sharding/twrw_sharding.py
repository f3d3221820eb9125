"""table_row_wise: a table's rows are split over the ranks of one host.

Same math as row_wise (bucketize ids by row range, sum partial pools, mean
after the reduce) with each table confined to one host's ``local_world_size``
ranks.  The ids travel by the shared all-to-all and the partial sums come back
by all-to-all + local sum (on every backend); the hierarchical variant
(intra-host reduce-scatter, then cross-host all-to-all) is a multi-host
optimisation not done yet.
"""

from __future__ import annotations

from dlrmctl.distributed.sharding.rw_sharding import RwSharding
from dlrmctl.distributed.types import ShardingType


class TwRwSharding(RwSharding):
    """Tables sharded table-row-wise on this rank."""

    sharding_type = ShardingType.TABLE_ROW_WISE

    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        """All ranks of host ``table_index % num_hosts``."""
        host = table_index % (world_size // local_world_size)
        return list(range(host * local_world_size, (host + 1) * local_world_size))
