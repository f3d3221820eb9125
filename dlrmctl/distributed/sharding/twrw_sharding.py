"""table_row_wise: a table's rows are split over the ranks of one host.

Same math as row_wise (bucketize ids by row range, sum partial pools, mean
after the reduce) with each table confined to one host's ``local_world_size``
ranks.  The ids travel by the shared all-to-all.

output_dist:

* one host (or one rank per host): the partial sums come back in the shared
  pooled all-to-all and are added at the destination (the flat scheme);
* several hosts of ``L > 1`` ranks (:attr:`TwRwSharding.hierarchical`):
  TorchRec's two levels, :func:`~dlrmctl.distributed.comm.hierarchical_reduce_all_to_all`.
  The owners of a host first add their partial sums inside the host (the
  owner of local rank ``l`` sums the rows of the destinations ``r`` with
  ``r mod L == l``), then each sends one summed block to each destination it
  serves: the bytes that cross hosts are ``1/L`` of the flat scheme's.
  Backward is the reverse.  Both collectives run on the world group with
  zero splits outside the ranks that talk, before the pooled all-to-all of
  the other types is waited on.
"""

from __future__ import annotations

import torch

from dlrmctl.distributed.comm import hierarchical_reduce_all_to_all
from dlrmctl.distributed.sharding.rw_sharding import RwSharding
from dlrmctl.distributed.types import ShardingType
from dlrmctl.sparse import KeyedJaggedTensor


class TwRwSharding(RwSharding):
    """Tables sharded table-row-wise on this rank.

    Attributes:
        hierarchical: the output dist is two-level (default: the world spans more than one
            host and hosts have more than one rank; ``ShardedEmbeddingBagCollection``'s
            ``twrw_hierarchical`` overrides it).
        host_cols: per host, the group columns its ranks hold (sorted): the host's column space.
    """

    sharding_type = ShardingType.TABLE_ROW_WISE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        W, L = self.env.world_size, self.env.local_world_size
        H = W // L
        self.hierarchical = H > 1 and L > 1
        self.host_cols: list[list[int]] = [
            sorted({c for r in range(h * L, (h + 1) * L) for c in self.layouts[r].out_cols}) for h in range(H)
        ]
        self.host_widths = [len(c) for c in self.host_cols]
        h = self.env.rank // L
        pos = {c: i for i, c in enumerate(self.host_cols[h])}
        peer = [[pos[c] for c in self.layouts[h * L + lp].out_cols] for lp in range(L)]
        self._peer_sizes = [len(p) for p in peer]
        dev = self.device
        self.register_buffer("_peer_cols", torch.tensor([c for p in peer for c in p], dtype=torch.int64, device=dev),
                             persistent=False)
        # where each column of the hierarchical result goes in the group output (output_cols()[0] order)
        at = {c: i for i, c in enumerate(self.output_cols()[0])}
        self.register_buffer("_hier_cols", torch.tensor([at[c] for hc in self.host_cols for c in hc],
                                                        dtype=torch.int64, device=dev), persistent=False)

    def configure_output_dist(self, reduce_scatter: bool | None, hierarchical: bool | None) -> None:
        """Also ``hierarchical``: the two-level output dist forced on or off (``twrw_hierarchical``)."""
        super().configure_output_dist(reduce_scatter, hierarchical)
        if hierarchical is not None:
            self.hierarchical = bool(hierarchical)

    @staticmethod
    def default_ranks(table_index: int, world_size: int, local_world_size: int) -> list[int]:
        """All ranks of host ``table_index % num_hosts``."""
        host = table_index % (world_size // local_world_size)
        return list(range(host * local_world_size, (host + 1) * local_world_size))

    def output_dist(self, looked: torch.Tensor, batch_sizes: list[int], local_kjt: KeyedJaggedTensor,
                    qdtype: torch.dtype | None) -> list[torch.Tensor]:
        """The hierarchical output dist (used when :attr:`hierarchical`).

        Args:
            looked: this rank's lookup output ``[sum(batch_sizes), layouts[rank].width]`` float32.
            batch_sizes: every rank's local batch size.
            local_kjt: this rank's input for the group (for mean pooling).
            qdtype: wire dtype (``None``: full precision).

        Returns:
            ``[ [B_local, width] ]`` in group column order (:meth:`output_cols`), as
            :meth:`output_dist_recv` returns for the flat scheme.
        """
        if self.env.pg is None:
            return self.output_dist_recv([looked], local_kjt)
        peer_cols = list(torch.split(self._peer_cols, self._peer_sizes))
        t = hierarchical_reduce_all_to_all(looked, batch_sizes, self.env.local_world_size, peer_cols,
                                           self.host_widths, self.env.pg, qdtype)
        out = t.new_zeros(local_kjt.stride(), len(self.output_cols()[0])).index_copy(1, self._hier_cols, t)
        return [self.apply_mean(out, local_kjt)]
