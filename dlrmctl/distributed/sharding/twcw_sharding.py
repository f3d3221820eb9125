"""table_column_wise: column blocks of a table on the ranks of one host.

Same communication as column_wise (the ids go to the host's ranks holding a
block; pooled blocks come back by all-to-all); the plan keeps all blocks of a
table within one host (``local_world_size`` consecutive ranks), so on a real
cluster the heavy pooled traffic of a table stays inside a host.
"""

from __future__ import annotations

from dlrmctl.distributed.sharding.cw_sharding import CwSharding
from dlrmctl.distributed.types import PlanError, ShardingType


class TwCwSharding(CwSharding):
    """Tables sharded table-column-wise on this rank."""

    sharding_type = ShardingType.TABLE_COLUMN_WISE

    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        """All ranks of host ``table_index % num_hosts``."""
        host = table_index % (world_size // local_world_size)
        return list(range(host * local_world_size, (host + 1) * local_world_size))

    @classmethod
    def validate_sharding(cls, table, ps) -> None:
        super().validate_sharding(table, ps)
        if not ps.shards:
            raise PlanError(f"table '{table.name}': table_column_wise needs shards")
