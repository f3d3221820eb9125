"""Perf estimator: seconds each shard adds to its rank per training step, from the bytes
dlrmctl's sharded modules actually move.

Reference for the approach: TorchRec ``planner/shard_estimators.py``
(``EmbeddingPerfEstimator``) and ``planner/constants.py`` (``kernel_bw_lookup``,
``BWD_COMPUTE_MULTIPLIER``, ``DP_ELEMENTWISE_KERNELS_PERF_FACTOR``).  The model is
*bytes moved / bandwidth* plus fixed per-op costs (:func:`step_latency`).  Unlike
TorchRec's estimator, the communication bytes follow dlrmctl's implementation
(``dlrmctl/distributed/sharded_ebc.py``, ``sharding/*.py``, ``comm/``) exactly;
:func:`shard_comm_bytes` gives them and ``tests/planner/test_planner_comm_bytes.py`` checks
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

**Time** per shard::

    fwd_bytes   = (in_local + ids*max(c*bpw, m) + out) / bw_k     # read ids, rows; write pooled
    fwd_compute = fwd_bytes + ids*fused_fwd_id_s + bags*fused_fwd_bag_s   # fused kernel only: per id, per bag
    bwd_compute = bwd_compute_multiplier * fwd_bytes               # Topology; TorchRec: 2.0
                  # (dense kernel: Topology.dense_bwd_compute_multiplier when calibrated;
                  #  it contains the optimizer step)
                + ids*fused_bwd_id_s + bags*fused_bwd_bag_s        # fused kernel only (bags = B*R; unpooled: ids)
                + ids*c*(2*4 + 2*bpw) / bw_k                       # dense kernel, uncalibrated only
    fwd_comms   = input_dist + out_s;   bwd_comms = out_s
    out_s       = a2a*out / out_bw                   # flat all-to-all
                | (L-1)/L*out / min(out_cal, intra) + inter_host / min(out_cal, inter)
                                                     # TWRW across hosts (two levels)
    out_bw      = min(Topology.output_dist_bw, net)  # calibrated: comm.pooled_all_to_all's whole path
                | net                                # presets
    out_cal     = Topology.output_dist_bw (0: no limit); intra / inter = Topology.intra_host_bw / inter_host_bw
    input_dist  = max(in / Topology.input_dist_bw, a2a*in / net)   # calibrated (plan --calibrate)
                | a2a*in / net                     # presets: the wire bytes only

with ``ids`` = ``B*P`` (column / table kinds) or ``B*P/n`` (row kinds) and
``in_local`` the ids + lengths it reads.  data_parallel (dense kernel, local batch
``B/W``)::

    ids = B*P/W;  fwd_compute = (ids*8 + ids*max(d*bpw, m) + B/W*R*d*O) / bw_dense
    bwd_compute = mult*fwd_compute + 9.22*rows_touched*d*bpw / bw_dense      # presets
                  # DP_ELEMENTWISE_KERNELS_PERF_FACTOR (TorchRec); rows_touched = rows (dense
                  # gradient) or min(rows, B*P) (gathered sparse rows: every replica updates
                  # the rows of all ranks' ids)
                | mult*fwd_compute + max(0, rows_touched - ids)*d*(2*4 + 2*bpw) / bw_dense
                  # calibrated dense multiplier: it already holds the optimizer step for the
                  # local ids, so only the other rows' optimizer pass is added
    bwd_comms   = 2*(W-1)/W*grad / net    (all-reduce, ring)
                | (W-1)*grad / net        (all-gather: W-1 other ranks' rows arrive)

``input_dist_bw`` (``Topology``; 0 = not calibrated) is the rate at which the whole input dist
handles the id all-to-all bytes a rank receives: routing and packing the ids per destination,
the all-to-all, the int32 / int64 casts on both sides, splitting the receive buffer and
building the lookup KJT (``ShardedEmbeddingBagCollection._input_dist`` then ``wait()``).
Profiled on the dev VM (2 gloo ranks, the 8 tables of ``scripts/bench_planner_accuracy.py``,
per-phase timers, 2026-12-01): ``input_dist`` + ``wait()`` took 2.0-2.2 ms per step of all
column_wise (1.23 MB received per rank; 0.77 ms charged as wire bytes) while the same EBC's
input dist of a two-sample batch (its fixed part) takes 0.7-0.9 ms.  ``plan --calibrate``
times ``input_dist(kjt).wait()`` of a two-table table_wise EBC with 80 ids per bag against the
same EBC with two samples (the fixed part, already in ``lookup_fixed_s``), alternating within
each repeat, and divides the bytes received per rank by the difference (with 20 ids per bag
the difference was too small against the noise: 0.5-2.6 GB/s over one calibration's repeats).
The wire bytes are inside the calibrated figure (not charged twice).  On the dev VM it comes
out at 1.4-2.1 GB/s against the wire model's 2.0-2.7: the input dist costs about its wire bytes
(the term moves the bench plans' estimates by ~0.1 ms).

``output_dist_bw`` (``Topology``; 0 = ``net``) is the same for the pooled output dist: the bytes
leaving a rank per second of ``comm.pooled_all_to_all`` forward + backward (packing, the
asynchronous all-to-all and its wait, the receive-buffer split, the gradient copy into the
backward send buffer) on 2 gloo ranks, 4 MiB per rank, minus the two collectives' fixed latency
(in :func:`step_latency`).  The dev VM (2026-12-01, seven calibrations): 0.55-0.75 GB/s through
this path where the calibration's bare 8 MiB ``all_to_all_single`` reached 1.0-1.4 GB/s — the
bare figure charged every communicating plan of ``scripts/bench_planner_accuracy.py`` 10-40%
too little while data_parallel (whose gradient sync keeps ``net``) came out at ~1.0.  The path's
copies (the gradient copy into the backward send buffer, the receive-buffer split) are inside
the calibrated figure; the column reassembly after the output dist (``AssembleColumns``) is not.

``fused_fwd_bag_s`` / ``fused_bwd_bag_s`` (``Topology``; 0 unless calibrated) are paid per
bag (pooled output row; every shard of a table runs every bag of the global batch): the
same 40,960 ids in 40,960 one-id bags instead of 2,048 bags of 20 took 0.40 -> 0.72 ms
forward and 0.9 -> 2.9 ms backward on the dev VM (``calibrate.fit_fused_lookup``), which a
model of bytes and ids misses for one-id-per-bag tables (every Criteo feature).

``fused_fwd_id_s`` (``Topology``; 0 unless calibrated) is the same for the forward: the
CPU TBE forward's time barely depends on the row width (dev VM, 2048 bags x 20 ids, 1
thread: 0.39 ms at 64 fp32 columns, 0.35 ms at 16 over the same ids), so a column shard,
which looks up every id of its table, costs nearly a whole table's forward; a bytes-only
model charged it half and ranked column_wise plans ahead of table_wise ones that ran faster.

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

A dense-kernel shard of the other types runs an unfused optimizer step after its
backward (``optim.dense.embedding_optimizer_for_dense``).  With a calibrated
``Topology.dense_bwd_compute_multiplier`` that step is already inside the multiplier
(``plan --calibrate`` times forward + backward + ``opt.step()`` of the dense kernel:
``calibrate.kernel_figures``), so nothing is added.  Without one (the presets; files
from before the dense multiplier existed), the multiplier is the fused kernel's, whose
optimizer is fused into the backward, and the pass is added:
``ids*c*(2*4 + 2*bpw) / bw_k`` (write + read the sparse gradient, read + write the
rows; our estimate, TorchRec only halves the kernel bandwidth).

Not modelled: the size of a collective (gloo moves one large buffer far slower than
the same bytes in pieces; ``comm.sync_sparse_grads`` gathers in ``GLOO_GATHER_CHUNK_BYTES``
pieces), per-id weights of weighted features (they travel with the ids and add
``B*P*I`` input bytes), the tiny size exchange all-to-all (its latency is in
:func:`step_latency`), and, without a calibrated ``output_dist_bw``, the copies of the output
dist's buffers (with it they are in the calibrated rate).

The bytes each shard moves are :mod:`dlrmctl.planner.comm_bytes` (formulas there); the
last-level cache term is :mod:`dlrmctl.planner.cache` (Che's approximation there).
"""

from __future__ import annotations

import math

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.planner.cache import (  # noqa: F401  (the cache model, importable from here)
    DEFAULT_CACHE_SPEEDUP,
    MIN_ROW_READ_BYTES,
    cache_hit_fractions,
    cache_hit_prior,
    cache_row_bytes,
    cache_speedup,
    che_hit_fractions,
)
from dlrmctl.planner.comm_bytes import (  # noqa: F401  (the bytes of a shard, importable from here)
    DENSE_GRAD_MAX_BYTES,
    OUTPUT_ELEM_BYTES,
    ROW_TYPES,
    CommBytes,
    dp_dense_grad,
    input_id_bytes,
    shard_comm_bytes,
    twrw_hierarchical,
)
from dlrmctl.planner.types import Perf, TableSpec, Topology

DP_ELEMENTWISE_KERNELS_PERF_FACTOR = 9.22  #: TorchRec constants.py (DP optimizer sweep)

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

def kernel_efficiency(topology: Topology, kernel: ComputeKernel) -> float:
    """Fraction of ``mem_bw`` ``kernel`` reaches: ``topology.kernel_efficiency`` (calibrated) or the default."""
    return topology.kernel_efficiency.get(kernel.value, KERNEL_EFFICIENCY[(topology.compute_device, kernel)])


def kernel_bandwidth(topology: Topology, kernel: ComputeKernel) -> float:
    """Effective lookup bandwidth, bytes/s = table memory bandwidth * kernel efficiency."""
    return topology.mem_bw * kernel_efficiency(topology, kernel)


def estimate_shard(
    topology: Topology,
    table: TableSpec,
    sharding_type: ShardingType,
    compute_kernel: ComputeKernel,
    rows: int,
    cols: int,
    num_row_shards: int,
    batch_size: int,
    hit: float = 0.0,
) -> tuple[Perf, float, int, int]:
    """Estimate one shard (formulas in the module docstring).

    Args:
        rows, cols: shard shape (a row shard with 0 rows costs nothing).
        num_row_shards: ``n`` for row_wise / table_row_wise, else 1.
        batch_size: global batch ``B`` (samples per step over all ranks).
        hit: fraction of the shard's lookups served by the last-level cache (0..1;
            :func:`cache_hit_prior` / :func:`cache_hit_fractions`): its compute time is
            scaled by ``(1 - hit) + hit / cache_speedup(kernel)``.

    Raises:
        ValueError: ``hit`` outside [0, 1].

    Returns:
        ``(perf seconds, ids looked up per step, input_bytes, output_bytes)``; the two byte
        counts are the shard's input_dist / output_dist bytes per step
        (:func:`shard_comm_bytes`; data_parallel: local ids * 8 and its local pooled output).
    """
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"cache hit fraction must be in [0, 1], got {hit}")
    if rows == 0:
        return Perf(), 0.0, 0, 0
    scale = (1.0 - hit) + hit / cache_speedup(topology, compute_kernel)  # compute only (module docstring)
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
    # the dense kernel's unfused optimizer pass is added below unless a calibrated multiplier already
    # contains it (``calibrate.kernel_figures``: (forward + backward + optimizer step) / forward - 1)
    dense_opt_pass = compute_kernel == ComputeKernel.DENSE
    if compute_kernel == ComputeKernel.DENSE and topology.dense_bwd_compute_multiplier is not None:
        mult = topology.dense_bwd_compute_multiplier
        dense_opt_pass = False
    st = sharding_type
    cb = shard_comm_bytes(table, st, cols, num_row_shards, batch_size, W, topology.local_world_size)
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
        if topology.dense_bwd_compute_multiplier is not None:
            # calibrated: the multiplier already holds backward + optimizer step for this rank's
            # own ids; the replica also updates the rows the other ranks' ids touched (gathered
            # sparse rows) or every row (dense gradient): one optimizer pass over those extra rows
            bwd = mult * fwd + max(0.0, touched - ids) * d * (2 * 4 + 2 * bpw) / bw
        else:
            bwd = mult * fwd + DP_ELEMENTWISE_KERNELS_PERF_FACTOR * touched * d * bpw / bw
        return Perf(fwd * scale, 0.0, bwd * scale, comm), ids, int(inp), int(out)

    c = d if st in ROW_TYPES else cols
    fwd = (cb.input + ids * max(c * bpw, m) + cb.output) / bw
    bwd = mult * fwd
    if compute_kernel == ComputeKernel.DENSE:
        if dense_opt_pass:  # uncalibrated: TorchRec's multiplier is a backward with the optimizer fused into it
            bwd += ids * c * (2 * 4 + 2 * bpw) / bw
    else:
        # pooled: every shard of a table sees every bag of the global batch (row shards: some empty);
        # unpooled (sequence TBE): a bag per id, and a row shard outputs only its own ids' rows
        bags = B * R if table.is_pooled else ids
        fwd += ids * topology.fused_fwd_id_s + bags * topology.fused_fwd_bag_s  # index loads; bag loop (docstring)
        bwd += ids * topology.fused_bwd_id_s + bags * topology.fused_bwd_bag_s  # csr2csc, optimizer prologue; per bag
    # the output dist, forward and again backward
    if st == ShardingType.TABLE_ROW_WISE and twrw_hierarchical(W, topology.local_world_size):
        L = topology.local_world_size
        cal = topology.output_dist_bw if topology.output_dist_bw > 0 else math.inf
        out_s = ((L - 1) / L * cb.output / min(cal, topology.intra_host_bw)
                 + cb.output_inter_host / min(cal, topology.inter_host_bw))
    else:
        out_s = a2a * cb.output / topology.output_bw  # pooled all-to-all
    return (Perf(fwd * scale, input_dist_seconds(topology, cb.input) + out_s, bwd * scale, out_s),
            ids, int(cb.input), int(cb.output))


def input_dist_seconds(topology: Topology, input_bytes: float) -> float:
    """Seconds the input dist of one shard costs its rank per step (module docstring).

    Args:
        input_bytes: the shard's id all-to-all bytes per step, all sources together
            (:attr:`CommBytes.input`: lengths + ids it receives, ``I``-byte elements).

    Returns:
        the wire time of the bytes that leave the ranks, ``(W-1)/W * input_bytes / comm_bw``;
        when calibrated, ``input_bytes / Topology.input_dist_bw`` (the whole input dist:
        routing, packing, the all-to-all, casts and unpacking, per byte received) if that is
        larger: a calibration on one host says nothing of a slower link between hosts, and the
        bytes cannot cross a link faster than it carries them.
    """
    W = topology.world_size
    wire = (W - 1) / W * input_bytes / topology.comm_bw
    if topology.input_dist_bw > 0:
        return max(input_bytes / topology.input_dist_bw, wire)
    return wire


# ----------------------------------------------------------------------------- fixed latencies
def step_latency(topology: Topology, options: list, ranks: list) -> tuple[float, int, int]:
    """Fixed cost per training step that the bandwidth model does not contain, seconds.

    Counted as dlrmctl's sharded EBC issues them (``sharded_ebc.py``, ``comm/``):

    * sharding groups: every rank runs the routing / combine code of every sharding type
      in the plan (one group per type), ``Topology.lookup_fixed_s`` each;
    * kernels (busiest rank): one fused TBE per sharding type holding fused shards there,
      one ``EmbeddingBag`` per dense-kernel shard, forward and backward each,
      ``Topology.kernel_launch_s`` each;
    * collectives (every rank, ``W > 1``), ``Topology.collective_s`` each: with any
      communicating type the size all-to-all and the data all-to-all of the input dist; the
      pooled all-to-all forward and backward (row_wise on CUDA/NCCL instead: its own
      reduce-scatter forward and all-gather backward; table_row_wise across hosts instead:
      its two all-to-alls forward and two backward); data_parallel: one all-reduce for
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
        hier = ShardingType.TABLE_ROW_WISE in comm_types and twrw_hierarchical(W, topology.local_world_size)
        if comm_types:
            collectives += 2  # input dist: sizes + data
            own = ({ShardingType.ROW_WISE} if nccl_rs else set()) | ({ShardingType.TABLE_ROW_WISE} if hier else set())
            if comm_types - own:
                collectives += 2  # pooled all-to-all forward + backward
            if nccl_rs:
                collectives += 2  # reduce-scatter forward + all-gather backward
            if hier:
                collectives += 4  # intra-host + cross-host all-to-all, forward and backward
        dp = [o.table for o in options if o.sharding_type == ShardingType.DATA_PARALLEL]
        collectives += (1 if any(dp_dense_grad(t) for t in dp) else 0) + (3 if any(not dp_dense_grad(t) for t in dp) else 0)
    seconds = (len(types) * topology.lookup_fixed_s + kernels * topology.kernel_launch_s
               + collectives * topology.collective_s)
    return seconds, kernels, collectives
