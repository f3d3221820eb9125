"""Perf estimator: seconds each shard adds to its rank per training step.

Reference: TorchRec ``planner/shard_estimators.py``, ``EmbeddingPerfEstimator``
(``_get_tw_sharding_perf``, ``_get_rw_sharding_perf``, ``_get_twrw_sharding_perf``,
``_get_dp_sharding_perf``) and ``planner/constants.py`` (``kernel_bw_lookup``,
``BWD_COMPUTE_MULTIPLIER``, ``BATCHED_COPY_PERF_FACTOR``,
``DP_ELEMENTWISE_KERNELS_PERF_FACTOR``).  The model is *bytes moved / bandwidth*:
time depends on how many ids a shard looks up and how many bytes it reads,
writes and sends, never on how many rows it holds (except data_parallel, whose
gradient all-reduce and optimizer sweep are table-sized).

Notation (one table, one step): ``B`` global batch, ``P`` ids per sample (sum
of the features' pooling factors), ``F`` pooled outputs per sample (features),
``d`` table dim, ``c`` shard columns, ``W`` world size, ``L`` ranks per host,
``H = W / L`` hosts, ``n`` row shards, ``bpw`` bytes per weight, ``I = 8`` bytes
per id (int64), ``O = 4`` bytes per output element (fp32),
``m`` = smallest row read (128 B on cuda: TorchRec's ``max(emb_dim, 32)`` fp32
elements; 64 B on cpu: a cache line).  ``bw_k = mem_bw * efficiency(device,
kernel)``, ``a2a = (W-1)/W`` (the part of an all-to-all that leaves the rank;
TorchRec omits it, which makes W=1 cost communication), ``net`` = inter-host
bandwidth when H > 1 else intra-host (TorchRec's ``comms_bw``).

table_wise / column_wise / table_column_wise shard (``c`` columns)::

    ids = B*P;  in = ids*I;  out = B*F*c*O;  lookup = ids*max(c*bpw, m)
    fwd_compute = (in + lookup + out) / bw_k
    fwd_comms   = a2a*(in + out) / net        # input_dist ids + output_dist pooled rows
    bwd_compute = 2 * fwd_compute             # BWD_COMPUTE_MULTIPLIER
    bwd_comms   = a2a*out / net               # gradients of the pooled rows

row_wise shard (one of ``n``; ids spread evenly over the row blocks)::

    ids = B*P/n;  in = ids*I;  out = B*F*d*O (partial sums for every sample)
    fwd_compute = (in + ids*max(d*bpw, m) + out) / bw_k
    fwd_comms   = a2a*in/net + (n-1)/n*out/net            # reduce-scatter of partial sums
    bwd_compute = 2*fwd_compute + 2.455*out/bw_k          # BATCHED_COPY_PERF_FACTOR
    bwd_comms   = (n-1)/n*out/net                         # all-gather of output grads

table_row_wise shard (``n`` = ranks of one host): as row_wise, but the partial
sums are reduce-scattered inside the host and only the reduced ``out/n`` crosses
hosts::

    fwd_comms = a2a*in/net + (n-1)/n*out/intra + (H-1)/H*out/n/inter
    bwd_comms = (n-1)/n*out/intra + (H-1)/H*out/n/inter

data_parallel (dense kernel, a full replica per rank, local batch ``B/W``)::

    ids = B*P/W;  fwd_compute = (ids*I + ids*max(d*bpw, m) + B/W*F*d*O) / bw_k
    fwd_comms   = 0
    bwd_compute = 2*fwd_compute + 9.22*rows*d*bpw/bw_k    # DP_ELEMENTWISE_KERNELS_PERF_FACTOR
    bwd_comms   = 2*(W-1)/W * rows*d*4 / net              # ring all-reduce (NCCL busbw formula)

Unpooled tables (EmbeddingCollection, ``TableSpec.is_pooled = False``): the
lookups output one row per id, not one per feature and sample, so ``F`` above
becomes ``P`` (``TableSpec.output_rows_per_sample``) and a row_wise shard sends
the rows of its own ids back by all-to-all (no partial sums, no reduce-scatter)::

    table_wise / column_wise:  out = B*P*c*O          (formulas as above)
    row_wise:  ids = B*P/n;  in = ids*I;  out = ids*d*O
               fwd_compute = (in + ids*max(d*bpw, m) + out) / bw_k
               fwd_comms   = a2a*(in + out) / net;  bwd_compute = 2*fwd_compute
               bwd_comms   = a2a*out / net

dense kernel (``torch.nn.EmbeddingBag(sparse=True)`` + a separate optimizer,
any type but data_parallel) adds an unfused optimizer pass to the backward:
``ids*c*(2*4 + 2*bpw) / bw_k`` (write + read the sparse gradient, read + write
the rows) — our estimate; TorchRec only halves the kernel bandwidth.
"""

from __future__ import annotations

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.planner.types import Perf, TableSpec, Topology

BWD_COMPUTE_MULTIPLIER = 2.0  #: TorchRec constants.py
BATCHED_COPY_PERF_FACTOR = 2.455  #: TorchRec constants.py (row-wise backward copy)
DP_ELEMENTWISE_KERNELS_PERF_FACTOR = 9.22  #: TorchRec constants.py (DP optimizer sweep)
INPUT_ID_BYTES = 8  #: int64 ids in the KJT
OUTPUT_ELEM_BYTES = 4  #: fp32 pooled embeddings / their gradients
MIN_ROW_READ_BYTES = {"cuda": 128, "cpu": 64}

#: Fraction of the memory bandwidth a kernel reaches on a device.  cuda:
#: TorchRec ``kernel_bw_lookup`` (fused 1.0, dense 0.5).  cpu: measured on the
#: dev VM, 1M x 128 fp32 random rows, 20 ids per bag, 1 thread: FBGEMM TBE
#: forward 2.8 GB/s and ``F.embedding_bag`` 3.6 GB/s against an 18.8 GB/s copy.
KERNEL_EFFICIENCY: dict[tuple[str, ComputeKernel], float] = {
    ("cuda", ComputeKernel.FUSED): 1.0,
    ("cuda", ComputeKernel.DENSE): 0.5,
    ("cpu", ComputeKernel.FUSED): 0.15,
    ("cpu", ComputeKernel.DENSE): 0.19,
}


def kernel_bandwidth(topology: Topology, kernel: ComputeKernel) -> float:
    """Effective lookup bandwidth, bytes/s = table memory bandwidth * kernel efficiency."""
    return topology.mem_bw * KERNEL_EFFICIENCY[(topology.compute_device, kernel)]


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
        ``(perf seconds, ids looked up per step, input_bytes, output_bytes)``; the
        two byte counts are the shard's input_dist / output_dist buffers per step.
    """
    W, L = topology.world_size, topology.local_world_size
    H = W // L
    B = float(batch_size)
    P = table.ids_per_sample
    F = table.output_rows_per_sample  # pooled: features per sample; unpooled: ids per sample
    d = table.embedding_dim
    bpw = table.weight_bytes
    m = MIN_ROW_READ_BYTES[topology.compute_device]
    I, O = INPUT_ID_BYTES, OUTPUT_ELEM_BYTES
    bw = kernel_bandwidth(topology, compute_kernel)
    net = topology.comm_bw
    a2a = (W - 1) / W
    st = sharding_type
    dense_extra = 0.0

    if rows == 0:
        return Perf(), 0.0, 0, 0
    if st == ShardingType.DATA_PARALLEL:
        ids = B * P / W
        inp, out = ids * I, B / W * F * d * O
        fwd = (inp + ids * max(d * bpw, m) + out) / bw
        bwd = BWD_COMPUTE_MULTIPLIER * fwd + DP_ELEMENTWISE_KERNELS_PERF_FACTOR * rows * d * bpw / bw
        allreduce = 2 * (W - 1) / W * rows * d * 4 / net
        return Perf(fwd, 0.0, bwd, allreduce), ids, int(inp), int(out)

    if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) and not table.is_pooled:
        n = max(1, num_row_shards)
        ids = B * P / n
        inp, out = ids * I, ids * d * O  # each id's row comes back from the one shard holding it
        fwd = (inp + ids * max(d * bpw, m) + out) / bw
        bwd = BWD_COMPUTE_MULTIPLIER * fwd
        fwd_comms = a2a * (inp + out) / net
        bwd_comms = a2a * out / net
        c = d
    elif st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        n = max(1, num_row_shards)
        ids = B * P / n
        inp, out = ids * I, B * F * d * O
        fwd = (inp + ids * max(d * bpw, m) + out) / bw
        bwd = BWD_COMPUTE_MULTIPLIER * fwd + BATCHED_COPY_PERF_FACTOR * out / bw
        if st == ShardingType.ROW_WISE:
            out_comm = (n - 1) / n * out / net
        else:
            out_comm = (n - 1) / n * out / topology.intra_host_bw
            if H > 1:
                out_comm += (H - 1) / H * out / n / topology.inter_host_bw
        fwd_comms = a2a * inp / net + out_comm
        bwd_comms = out_comm
        c = d
    else:  # table_wise, column_wise, table_column_wise
        c = cols
        ids = B * P
        inp, out = ids * I, B * F * c * O
        fwd = (inp + ids * max(c * bpw, m) + out) / bw
        bwd = BWD_COMPUTE_MULTIPLIER * fwd
        fwd_comms = a2a * (inp + out) / net
        bwd_comms = a2a * out / net
    if compute_kernel == ComputeKernel.DENSE:
        dense_extra = ids * c * (2 * 4 + 2 * bpw) / bw
    return Perf(fwd, fwd_comms, bwd + dense_extra, bwd_comms), ids, int(inp), int(out)


# ----------------------------------------------------------------------------- fixed latencies
#: Seconds of one kernel launch (CUDA: host-side launch + scheduling of a small kernel, ~5 us; CPU:
#: PyTorch's per-op dispatch, ~10 us) and of one small-message collective (NCCL within an NVLink host
#: ~20 us, across hosts ~40 us; gloo on the loopback ~100 us).  Orders of magnitude from vendor and
#: NCCL-tests small-message figures, not measured here; they do not scale with bytes, so the
#: bandwidth model above misses them.
KERNEL_LAUNCH_S = {"cuda": 5e-6, "cpu": 10e-6}
COLLECTIVE_S = {"cuda": (20e-6, 40e-6), "cpu": (100e-6, 100e-6)}  # (one host, several hosts)
#: collectives one step issues per output-dist kind, forward + backward (dlrmctl's sharded EBC):
#: pooled all-to-all there and back; row-wise reduce-scatter + all-gather; table_row_wise does both
#: inside the host and an all-to-all across hosts
_OUTPUT_COLLECTIVES = {
    ShardingType.TABLE_WISE: ("a2a", 2), ShardingType.COLUMN_WISE: ("a2a", 2),
    ShardingType.TABLE_COLUMN_WISE: ("a2a", 2), ShardingType.ROW_WISE: ("rw", 2),
    ShardingType.TABLE_ROW_WISE: ("twrw", 4),
}


def step_latency(topology: Topology, options: list, ranks: list) -> tuple[float, int, int]:
    """Fixed latency per training step that the bandwidth model does not contain.

    Kernels (busiest rank): per compute kernel on the rank one forward and one backward
    (fused: one TBE for all its tables; dense: one per table), plus one bucketize/permute per
    sharding type there.  Collectives (every rank, W > 1): the size exchange, the input
    all-to-all of lengths + ids, each output-dist kind's forward and backward collectives, and
    one gradient all-reduce when data_parallel tables exist.

    Args:
        options, ranks: a placement (``Partition.options`` / ``Partition.ranks``).

    Returns:
        ``(seconds, kernel launches on the busiest rank, collectives per step)``.
    """
    W = topology.world_size
    per_rank: list[set] = [set() for _ in range(W)]
    dense_tables = [0] * W
    for opt, rs in zip(options, ranks):
        for r in set(x for x in rs if x is not None):
            per_rank[r].add(("type", opt.sharding_type))
            if opt.compute_kernel == ComputeKernel.DENSE:
                dense_tables[r] += 1
            else:
                per_rank[r].add(("fused", None))
    kernels = max((2 * (dense_tables[r] + (("fused", None) in per_rank[r]))
                   + sum(1 for k in per_rank[r] if k[0] == "type") for r in range(W)), default=0)
    collectives = 0
    if W > 1:
        types = {o.sharding_type for o in options}
        kinds = {_OUTPUT_COLLECTIVES[t] for t in types if t in _OUTPUT_COLLECTIVES}
        collectives = (2 if kinds else 0) + sum(n for _, n in kinds) + (1 if ShardingType.DATA_PARALLEL in types else 0)
    coll = COLLECTIVE_S[topology.compute_device][1 if topology.num_hosts > 1 else 0]
    return kernels * KERNEL_LAUNCH_S[topology.compute_device] + collectives * coll, kernels, collectives
