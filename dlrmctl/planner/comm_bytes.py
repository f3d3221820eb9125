"""The bytes one shard communicates per step (:func:`shard_comm_bytes`), as dlrmctl's sharded
collection moves them; :mod:`dlrmctl.planner.perf` turns them into seconds.  Notation as in
:mod:`dlrmctl.planner.perf` (``B`` global batch, ``P`` ids per sample, ``F`` poolings, ``R``
output rows per sample, ``d`` dim, ``c`` shard columns, ``n`` row shards, ``I`` id bytes,
``O`` output element bytes, ``W`` ranks, ``L`` ranks per host).

**Bytes** (:func:`shard_comm_bytes`; totals over all source ranks, per step):

* input_dist — one all-to-all of ``I``-byte elements: every source sends each rank
  holding a shard the lengths of the table's features for its samples and the ids
  routed there (``TableWiseLikeSharding`` / ``RowWiseLikeSharding.input_dist_chunks``)::

      table_wise / column_wise / table_column_wise shard:  in = (B*F + B*P) * I
      row_wise / table_row_wise shard (1 of n):           in = (B*F + B*P/n) * I

  (a column shard receives all of the table's ids; a row shard all lengths but only
  the ids of its row block; the ids are assumed spread evenly over the blocks).
* output_dist — one differentiable all-to-all of fp32 pooled blocks forward, the
  same bytes back in backward (``pooled_all_to_all``).  A row shard sends *full*
  partial sums for every sample (flat all-to-all + local sum: table_row_wise on
  one host, row_wise on gloo; row_wise on NCCL uses ``reduce_scatter`` /
  ``all_gather`` of the same buffer)::

      out = B*R*c*O     (c = d for row shards)

  Of these, the bytes that cross hosts (:attr:`CommBytes.output_inter_host`; ``H = W/L``
  hosts) are ``out*(W-L)/W`` for a flat all-to-all (the samples of the other hosts' ranks).
  table_row_wise across hosts of ``L > 1`` ranks is two-level
  (``comm.hierarchical_reduce_all_to_all``): the ``out`` bytes are first summed inside the
  host (``(L-1)/L*out`` leave the rank, none the host), then each owner sends the summed rows
  of the ``B/L`` samples it serves to their ranks::

      inter_host = out/L * (W-L)/W      (TWRW, H > 1, L > 1: 1/L of the flat scheme's)

* data_parallel gradient sync (``comm.sync_sparse_grads``): a table of at most
  :data:`DENSE_GRAD_MAX_BYTES` fp32 bytes (not under an Adam-family optimizer) has its
  gradient densified and SUM-all-reduced: ``grad = rows*d*4`` bytes per rank; a
  larger one is all-gathered as sparse rows: every rank contributes one int64 row
  index and ``d`` fp32 values per id of its local batch (the ``EmbeddingBag``
  sparse gradient is not coalesced) plus its int64 count:
  ``grad = B*P/W*(8 + 4*d) + 8``.  No input or output dist.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrmctl.distributed.types import ShardingType
from dlrmctl.optim.registry import find_embedding_optimizer
from dlrmctl.planner.types import TableSpec

OUTPUT_ELEM_BYTES = 4  #: fp32 pooled embeddings / their gradients
#: ``comm.DENSE_GRAD_MAX_BYTES`` (kept here so the planner does not import torch; a test checks they agree)
DENSE_GRAD_MAX_BYTES = 8 << 20
#: the row-split kinds (a shard holds a block of rows; partial sums come back)
ROW_TYPES = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


def input_id_bytes(table: TableSpec) -> int:
    """Bytes per element of the id all-to-all: 4 (int32) below 2^31 rows, else 8
    (``ShardedEmbeddingBagCollection.input_dist_dtype``'s automatic choice; the module picks
    int64 for the whole buffer when *any* communicated table has 2^31 rows or more)."""
    return 8 if table.num_embeddings >= 2**31 else 4


def dp_dense_grad(table: TableSpec) -> bool:
    """True when a data_parallel table's gradient is densified and all-reduced (``sync_sparse_grads``)."""
    return table.num_embeddings * table.embedding_dim * 4 <= DENSE_GRAD_MAX_BYTES


@dataclass(frozen=True)
class CommBytes:
    """Bytes one shard communicates per step, summed over all source ranks.

    Attributes:
        input: ids + lengths it receives in the input_dist all-to-all.
        output: fp32 pooled rows it sends in the output_dist forward (and receives back as
            gradients in backward: the same bytes).
        grad_sync: data_parallel only: bytes this replica puts into the gradient collective
            (all-reduce buffer, or its all-gathered sparse rows).
        ids: ids the shard looks up per step (float: the row-block split is an expectation).
        output_inter_host: the part of the output dist's bytes that crosses hosts, forward (the
            same back in backward); 0 on one host.  table_row_wise across hosts: ``1/L`` of a
            flat all-to-all's (module docstring).
    """

    input: float
    output: float
    grad_sync: float
    ids: float
    output_inter_host: float = 0.0


def twrw_hierarchical(world_size: int, local_world_size: int) -> bool:
    """True when table_row_wise's output dist is two-level: several hosts of more than one rank
    (``TwRwSharding.hierarchical``'s default)."""
    return world_size > local_world_size > 1


def shard_comm_bytes(table: TableSpec, sharding_type: ShardingType, cols: int, num_row_shards: int,
                     batch_size: int, world_size: int, local_world_size: int | None = None) -> CommBytes:
    """The bytes of one shard (formulas in the module docstring).

    Args:
        cols: shard columns (``d`` for table / row kinds).
        num_row_shards: ``n`` for row_wise / table_row_wise, else 1.
        batch_size: global batch ``B``.
        world_size: ``W`` (data_parallel's local batch is ``B/W``).
        local_world_size: ``L`` ranks per host (default ``W``: one host); sets
            :attr:`CommBytes.output_inter_host`.
    """
    L = world_size if local_world_size is None else local_world_size
    off_host = (world_size - L) / world_size
    B, P, F, R = float(batch_size), table.ids_per_sample, table.num_poolings, table.output_rows_per_sample
    d, I, O = table.embedding_dim, input_id_bytes(table), OUTPUT_ELEM_BYTES
    st = sharding_type
    if st == ShardingType.DATA_PARALLEL:
        ids = B * P / world_size
        # the registry's sparse_grads optimizers also all-reduce a per-row lookup count (one more fp32 per row:
        # ``ShardedEmbeddingBagCollection.track_touched_rows``)
        rec = find_embedding_optimizer(table.optimizer)
        touched_count = table.num_embeddings * 4 if rec is not None and rec.sparse_grads else 0
        grad = table.num_embeddings * d * 4 + touched_count if dp_dense_grad(table) else ids * (8 + 4 * d) + 8
        return CommBytes(0.0, 0.0, float(grad), ids)
    if st in ROW_TYPES:
        n = max(1, num_row_shards)
        ids = B * P / n
        out = ids * d * O if not table.is_pooled else B * R * d * O
        inter = out * off_host
        if st == ShardingType.TABLE_ROW_WISE and twrw_hierarchical(world_size, L):
            inter /= L
        return CommBytes((B * F + ids) * I, out, 0.0, ids, inter)
    ids = B * P
    out = B * R * cols * O
    return CommBytes((B * F + ids) * I, out, 0.0, ids, out * off_host)
