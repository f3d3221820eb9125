"""Perf estimator: seconds each shard adds to its rank per training step, from the bytes
dlrmctl's sharded modules actually move.

Reference for the approach: TorchRec ``planner/shard_estimators.py``
(``EmbeddingPerfEstimator``) and ``planner/constants.py`` (``kernel_bw_lookup``,
``BWD_COMPUTE_MULTIPLIER``, ``DP_ELEMENTWISE_KERNELS_PERF_FACTOR``).  The model is
*bytes moved / bandwidth* plus fixed per-op costs (:func:`step_latency`).  Unlike
TorchRec's estimator, the communication bytes follow dlrmctl's implementation
(``dlrmctl/distributed/sharded_ebc.py``, ``sharding/*.py``, ``comm.py``) exactly;
:func:`shard_comm_bytes` gives them and ``tests/test_planner_comm_bytes.py`` checks
them against the bytes a 2-rank gloo run of every sharding type sends.

Notation (one table, one step): ``B`` global batch, ``P`` ids per sample (sum of the
features' pooling factors), ``F`` features of the table (``TableSpec.num_poolings``),
``R`` rows the lookups output per sample (``F`` pooled; ``P`` unpooled), ``d``
table dim, ``c`` shard columns, ``W`` world size, ``L`` ranks per host, ``n`` row
shards, ``bpw`` bytes per weight, ``I`` bytes per element of the id all-to-all
(``input_dist_dtype``: 4 = int32 when the table has < 2^31 rows, else 8),
``O = 4`` bytes per output element (fp32), ``m`` smallest row read (128 B on cuda:
TorchRec's ``max(emb_dim, 32)`` fp32 elements; 64 B on cpu: a cache line),
``bw_k = mem_bw * kernel_efficiency``, ``a2a = (W-1)/W`` (the part of an all-to-all
that leaves the rank), ``net`` = ``Topology.comm_bw`` (inter-host once there are
several hosts: a flat all-to-all is bounded by its slowest link).

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
  every backend, row_wise on gloo; row_wise on NCCL uses ``reduce_scatter`` /
  ``all_gather`` of the same buffer)::

      out = B*R*c*O     (c = d for row shards)

* data_parallel gradient sync (``comm.sync_sparse_grads``): a table of at most
  :data:`DENSE_GRAD_MAX_BYTES` fp32 bytes (not under an Adam-family optimizer) has its
  gradient densified and SUM-all-reduced: ``grad = rows*d*4`` bytes per rank; a
  larger one is all-gathered as sparse rows: every rank contributes one int64 row
  index and ``d`` fp32 values per id of its local batch (the ``EmbeddingBag``
  sparse gradient is not coalesced) plus its int64 count:
  ``grad = B*P/W*(8 + 4*d) + 8``.  No input or output dist.

**Time** per shard::

    fwd_compute = (in_local + ids*max(c*bpw, m) + out) / bw_k     # read ids, rows; write pooled
    bwd_compute = bwd_compute_multiplier * fwd_compute             # Topology; TorchRec: 2.0
                  # (dense kernel: Topology.dense_bwd_compute_multiplier when calibrated)
                + ids * fused_bwd_id_s                             # fused kernel only
    fwd_comms   = a2a*(in + out) / net;   bwd_comms = a2a*out / net

with ``ids`` = ``B*P`` (column / table kinds) or ``B*P/n`` (row kinds) and
``in_local`` the ids + lengths it reads.  data_parallel (dense kernel, local batch
``B/W``)::

    ids = B*P/W;  fwd_compute = (ids*8 + ids*max(d*bpw, m) + B/W*R*d*O) / bw_dense
    bwd_compute = mult*fwd_compute + 9.22*rows_touched*d*bpw / bw_dense
                  # DP_ELEMENTWISE_KERNELS_PERF_FACTOR; rows_touched = rows (dense
                  # gradient) or min(rows, B*P) (gathered sparse rows)
    bwd_comms   = 2*(W-1)/W*grad / net    (all-reduce, ring)
                | (W-1)*grad / net        (all-gather: W-1 other ranks' rows arrive)

``fused_bwd_id_s`` (``Topology``; 0 unless calibrated) is the part of the fused (FBGEMM
TBE) backward that is paid per id whatever the row width: the CPU backward sorts the ids
by row (csr2csc) and runs the optimizer's per-row prologue (row-wise Adagrad: one sum of
squares and one square root per unique row) before touching ``c`` columns.  Without it a
shard of ``c = d/k`` columns and ``k`` times the ids (column_wise: every column shard
looks up every id of its table) would cost the same bytes as the whole table, while the
measured backward grows with the ids: 2-rank gloo, the 8 tables of
``scripts/bench_planner_accuracy.py``, one process: all 8 at ``c = 32`` backward
6.0 ms for 274k ids vs 5.0 ms for the 139k ids of 4 of them at ``d = 64``; a 4 MB table
(cache resident) takes 13-15 ns per id in backward at 16, 32 or 64 columns alike.
``plan --calibrate`` measures it with the fused lookup at two widths over the same ids
(``calibrate.measure_fused_backward``).

A dense-kernel shard of the other types adds an unfused optimizer pass to its
backward: ``ids*c*(2*4 + 2*bpw) / bw_k`` (write + read the sparse gradient, read +
write the rows; our estimate, TorchRec only halves the kernel bandwidth).

Not modelled: the size of a collective (gloo moves one large buffer far slower than
the same bytes in pieces; ``comm.sync_sparse_grads`` gathers in ``GLOO_GATHER_CHUNK_BYTES``
pieces), per-id weights of weighted features (they travel with the ids and add
``B*P*I`` input bytes), the tiny size exchange all-to-all (its latency is in
:func:`step_latency`), and the source-side sum / copy of received blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.planner.types import Perf, TableSpec, Topology

BWD_COMPUTE_MULTIPLIER = 2.0  #: TorchRec constants.py (the Topology default)
DP_ELEMENTWISE_KERNELS_PERF_FACTOR = 9.22  #: TorchRec constants.py (DP optimizer sweep)
OUTPUT_ELEM_BYTES = 4  #: fp32 pooled embeddings / their gradients
MIN_ROW_READ_BYTES = {"cuda": 128, "cpu": 64}
#: ``comm.DENSE_GRAD_MAX_BYTES`` (kept here so the planner does not import torch; a test checks they agree)
DENSE_GRAD_MAX_BYTES = 8 << 20
#: optimizers whose data_parallel gradients stay sparse (``ShardedEmbeddingBagCollection.dense_grad_max_bytes = 0``;
#: ``embedding_modules.ADAM_FAMILY``)
SPARSE_GRAD_OPTIMIZERS = ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")

#: Fraction of the memory bandwidth a kernel reaches on a device (``Topology.kernel_efficiency``
#: overrides it).  cuda: TorchRec ``kernel_bw_lookup`` (fused 1.0, dense 0.5).  cpu: measured on
#: the dev VM, 1M x 128 fp32 random rows, 20 ids per bag, 1 thread: FBGEMM TBE forward 2.8 GB/s
#: and ``F.embedding_bag`` 3.6 GB/s against an 18.8 GB/s copy.
KERNEL_EFFICIENCY: dict[tuple[str, ComputeKernel], float] = {
    ("cuda", ComputeKernel.FUSED): 1.0,
    ("cuda", ComputeKernel.DENSE): 0.5,
    ("cpu", ComputeKernel.FUSED): 0.15,
    ("cpu", ComputeKernel.DENSE): 0.19,
}

_ROW_TYPES = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


def kernel_efficiency(topology: Topology, kernel: ComputeKernel) -> float:
    """Fraction of ``mem_bw`` ``kernel`` reaches: ``topology.kernel_efficiency`` (calibrated) or the default."""
    return topology.kernel_efficiency.get(kernel.value, KERNEL_EFFICIENCY[(topology.compute_device, kernel)])


def kernel_bandwidth(topology: Topology, kernel: ComputeKernel) -> float:
    """Effective lookup bandwidth, bytes/s = table memory bandwidth * kernel efficiency."""
    return topology.mem_bw * kernel_efficiency(topology, kernel)


def input_id_bytes(table: TableSpec) -> int:
    """Bytes per element of the id all-to-all: 4 (int32) below 2^31 rows, else 8
    (``ShardedEmbeddingBagCollection.input_dist_dtype``'s automatic choice; the module picks
    int64 for the whole buffer when *any* communicated table has 2^31 rows or more)."""
    return 8 if table.num_embeddings >= 2**31 else 4


def dp_dense_grad(table: TableSpec) -> bool:
    """True when a data_parallel table's gradient is densified and all-reduced (``sync_sparse_grads``)."""
    return (table.optimizer not in SPARSE_GRAD_OPTIMIZERS
            and table.num_embeddings * table.embedding_dim * 4 <= DENSE_GRAD_MAX_BYTES)


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
    """

    input: float
    output: float
    grad_sync: float
    ids: float


def shard_comm_bytes(table: TableSpec, sharding_type: ShardingType, cols: int, num_row_shards: int,
                     batch_size: int, world_size: int) -> CommBytes:
    """The bytes of one shard (formulas in the module docstring).

    Args:
        cols: shard columns (``d`` for table / row kinds).
        num_row_shards: ``n`` for row_wise / table_row_wise, else 1.
        batch_size: global batch ``B``.
        world_size: ``W`` (data_parallel's local batch is ``B/W``).
    """
    B, P, F, R = float(batch_size), table.ids_per_sample, table.num_poolings, table.output_rows_per_sample
    d, I, O = table.embedding_dim, input_id_bytes(table), OUTPUT_ELEM_BYTES
    st = sharding_type
    if st == ShardingType.DATA_PARALLEL:
        ids = B * P / world_size
        grad = table.num_embeddings * d * 4 if dp_dense_grad(table) else ids * (8 + 4 * d) + 8
        return CommBytes(0.0, 0.0, float(grad), ids)
    if st in _ROW_TYPES:
        n = max(1, num_row_shards)
        ids = B * P / n
        out = ids * d * O if not table.is_pooled else B * R * d * O
        return CommBytes((B * F + ids) * I, out, 0.0, ids)
    ids = B * P
    return CommBytes((B * F + ids) * I, B * R * cols * O, 0.0, ids)


def estimate_shard(
    topology: Topology,
    table: TableSpec,
    sharding_type: ShardingType,
    compute_kernel: ComputeKernel,
    rows: int,
    cols: int,
    num_row_shards: int,
    batch_size: int,
) -> tuple[Perf, float, int, int]:
    """Estimate one shard (formulas in the module docstring).

    Args:
        rows, cols: shard shape (a row shard with 0 rows costs nothing).
        num_row_shards: ``n`` for row_wise / table_row_wise, else 1.
        batch_size: global batch ``B`` (samples per step over all ranks).

    Returns:
        ``(perf seconds, ids looked up per step, input_bytes, output_bytes)``; the two byte
        counts are the shard's input_dist / output_dist bytes per step
        (:func:`shard_comm_bytes`; data_parallel: local ids * 8 and its local pooled output).
    """
    if rows == 0:
        return Perf(), 0.0, 0, 0
    W = topology.world_size
    B = float(batch_size)
    R = table.output_rows_per_sample
    d = table.embedding_dim
    bpw = table.weight_bytes
    m = MIN_ROW_READ_BYTES[topology.compute_device]
    O = OUTPUT_ELEM_BYTES
    bw = kernel_bandwidth(topology, compute_kernel)
    net = topology.comm_bw
    a2a = (W - 1) / W
    mult = topology.bwd_compute_multiplier
    if compute_kernel == ComputeKernel.DENSE and topology.dense_bwd_compute_multiplier is not None:
        mult = topology.dense_bwd_compute_multiplier
    st = sharding_type
    cb = shard_comm_bytes(table, st, cols, num_row_shards, batch_size, W)
    ids = cb.ids

    if st == ShardingType.DATA_PARALLEL:
        inp, out = ids * 8, B / W * R * d * O  # local int64 ids, local pooled rows: nothing is sent
        fwd = (inp + ids * max(d * bpw, m) + out) / bw
        if dp_dense_grad(table):
            touched = rows
            comm = 2 * (W - 1) / W * cb.grad_sync / net
        else:
            touched = min(rows, B * table.ids_per_sample)
            comm = (W - 1) * cb.grad_sync / net
        bwd = mult * fwd + DP_ELEMENTWISE_KERNELS_PERF_FACTOR * touched * d * bpw / bw
        return Perf(fwd, 0.0, bwd, comm), ids, int(inp), int(out)

    c = d if st in _ROW_TYPES else cols
    fwd = (cb.input + ids * max(c * bpw, m) + cb.output) / bw
    bwd = mult * fwd
    if compute_kernel == ComputeKernel.DENSE:
        bwd += ids * c * (2 * 4 + 2 * bpw) / bw
    else:
        bwd += ids * topology.fused_bwd_id_s  # csr2csc + per-row optimizer prologue (module docstring)
    return (Perf(fwd, a2a * (cb.input + cb.output) / net, bwd, a2a * cb.output / net),
            ids, int(cb.input), int(cb.output))


# ----------------------------------------------------------------------------- fixed latencies
def step_latency(topology: Topology, options: list, ranks: list) -> tuple[float, int, int]:
    """Fixed cost per training step that the bandwidth model does not contain, seconds.

    Counted as dlrmctl's sharded EBC issues them (``sharded_ebc.py``, ``comm.py``):

    * sharding groups: every rank runs the routing / combine code of every sharding type
      in the plan (one group per type), ``Topology.lookup_fixed_s`` each;
    * kernels (busiest rank): one fused TBE per sharding type holding fused shards there,
      one ``EmbeddingBag`` per dense-kernel shard, forward and backward each,
      ``Topology.kernel_launch_s`` each;
    * collectives (every rank, ``W > 1``), ``Topology.collective_s`` each: with any
      communicating type the size all-to-all and the data all-to-all of the input dist; the
      pooled all-to-all forward and backward (row_wise on CUDA/NCCL instead: its own
      reduce-scatter forward and all-gather backward); data_parallel: one all-reduce for
      the densified small tables, three all-gathers (counts, rows, values) for the others.

    Args:
        options, ranks: a placement (``Partition.options`` / ``Partition.ranks``).

    Returns:
        ``(seconds, kernel launches on the busiest rank, collectives per step)``.
    """
    W = topology.world_size
    fused_types: list[set] = [set() for _ in range(W)]
    dense_shards = [0] * W
    types: set[ShardingType] = set()
    for opt, rs in zip(options, ranks):
        types.add(opt.sharding_type)
        for r in rs:
            if r is None:
                continue
            if opt.compute_kernel == ComputeKernel.DENSE:
                dense_shards[r] += 1
            else:
                fused_types[r].add(opt.sharding_type)
    kernels = max((2 * (dense_shards[r] + len(fused_types[r])) for r in range(W)), default=0)
    collectives = 0
    if W > 1:
        comm_types = types - {ShardingType.DATA_PARALLEL}
        nccl_rs = topology.compute_device == "cuda" and ShardingType.ROW_WISE in comm_types
        if comm_types:
            collectives += 2  # input dist: sizes + data
            if comm_types - ({ShardingType.ROW_WISE} if nccl_rs else set()):
                collectives += 2  # pooled all-to-all forward + backward
            if nccl_rs:
                collectives += 2  # reduce-scatter forward + all-gather backward
        dp = [o.table for o in options if o.sharding_type == ShardingType.DATA_PARALLEL]
        collectives += (1 if any(dp_dense_grad(t) for t in dp) else 0) + (3 if any(not dp_dense_grad(t) for t in dp) else 0)
    seconds = (len(types) * topology.lookup_fixed_s + kernels * topology.kernel_launch_s
               + collectives * topology.collective_s)
    return seconds, kernels, collectives
