"""Every ``torch.distributed`` collective dlrmctl issues, with autograd where gradients flow.

Rule (checked by ``tests/distributed/test_comm_rule.py``, an AST scan of the package): no
module outside this package calls ``torch.distributed`` collectives; process-group creation and
teardown live in :mod:`dlrmctl.distributed.env`, and the checkpoint's DCP
save/load calls are DCP's own.

Devices: **every tensor handed to a collective is on the device its process
group serves** — ``env.device``: CPU tensors on a ``gloo`` group, CUDA tensors
(of the rank's ``cuda:<local_rank>``) on an ``nccl`` group.  The groups are
single-backend on purpose (no ``cpu:gloo,cuda:nccl`` fallback that would hide a
CPU tensor on the GPU path as a slow host round trip).  Callers pass
``device=`` (``env.device``) where they build tensors.  Pickled-object
collectives (:func:`broadcast_object`, :func:`all_gather_object`: the plan, the
checkpoint's file lists) use torch's object collectives, which put their byte
buffers on the current CUDA device for NCCL and on the CPU for gloo.

* :func:`all_to_all_single` — flat ``all_to_all_single`` with explicit split
  sizes whose backward is the reverse all-to-all (pooled embeddings out,
  gradients back); :func:`pooled_all_to_all` does several groups in one.
* both take ``qdtype`` (``sharding.comm_precision``): quantized communication of the
  pooled embeddings and their gradients (TorchRec's qcomm codecs: cast to bf16 / fp16
  for the wire, back on arrival).
* :func:`reduce_scatter_v` — sum rows over ranks and keep each rank's own rows
  (row-wise output dist).  On NCCL the real ``reduce_scatter``; elsewhere (gloo)
  an all-to-all of the row blocks followed by a local sum.  Backward is the
  matching all-gather.
* :func:`hierarchical_reduce_all_to_all` — table_row_wise across hosts: partial sums are
  added inside each host first (an all-to-all with intra-host splits only), then one summed
  block per destination crosses hosts (``1/L`` of the flat scheme's inter-host bytes).
* :func:`all_to_all_ints` — the (non-differentiable) exchange of ids / lengths,
  optionally asynchronous.
* :class:`GradBucketReducer` — DDP-style bucketed SUM all-reduce of replicated
  dense gradients, each bucket launched asynchronously as soon as backward has
  produced all of its gradients (overlapping the rest of backward);
  :func:`sync_dense_grads` is the one-bucket, after-backward variant.
* :func:`sync_sparse_grads` — SUM of replicated tables' sparse (row) gradients,
  all-gathered as (rows, values), never densified.
* small helpers: :func:`all_reduce`, :func:`broadcast`, :func:`barrier`,
  :func:`broadcast_object`, :func:`all_gather_object`, :func:`all_gather_tensor`,
  :func:`group_rank_size`.
* :func:`ring_shift` — point-to-point shift of rows to the next rank of a ring (the
  evaluation's distributed AUC, :mod:`dlrmctl.metrics`).

Every function takes the process group explicitly and is a no-op (identity)
when it is ``None``.  A group of ONE rank runs the real collectives (so one GPU
exercises every collective of the multi-GPU path: ``sharding.enabled: true``).

The package: :mod:`~dlrmctl.distributed.comm.base` (awaitables, the small collectives),
:mod:`~dlrmctl.distributed.comm.all_to_all`, :mod:`~dlrmctl.distributed.comm.reduce` (the
reducing output dists), :mod:`~dlrmctl.distributed.comm.grads` (gradient sync); every public name
is importable from ``dlrmctl.distributed.comm``.
"""

from dlrmctl.distributed.comm.base import (
    Awaitable,
    DoneAwaitable,
    LazyAwaitable,
    all_gather_flat,
    all_gather_object,
    all_gather_tensor,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    default_group,
    group_rank_size,
    reduce_scatter_flat,
    ring_shift,
    world_of,
)
from dlrmctl.distributed.comm.all_to_all import (
    COMM_DTYPES,
    FP16_MAX,
    all_to_all_ints,
    all_to_all_single,
    comm_dtype,
    grad_wire_scale,
    pooled_all_to_all,
    pooled_all_to_all_async,
    to_wire,
)
from dlrmctl.distributed.comm.reduce import (
    hierarchical_reduce_all_to_all,
    reduce_scatter_v,
)
from dlrmctl.distributed.comm.grads import (
    DENSE_GRAD_MAX_BYTES,
    GLOO_GATHER_CHUNK_BYTES,
    GradBucketReducer,
    sync_dense_grads,
    sync_sparse_grads,
)

__all__ = [
    "Awaitable",
    "DoneAwaitable",
    "LazyAwaitable",
    "all_gather_flat",
    "all_gather_object",
    "all_gather_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "default_group",
    "group_rank_size",
    "reduce_scatter_flat",
    "ring_shift",
    "world_of",
    "COMM_DTYPES",
    "FP16_MAX",
    "all_to_all_ints",
    "all_to_all_single",
    "comm_dtype",
    "grad_wire_scale",
    "pooled_all_to_all",
    "pooled_all_to_all_async",
    "to_wire",
    "hierarchical_reduce_all_to_all",
    "reduce_scatter_v",
    "DENSE_GRAD_MAX_BYTES",
    "GLOO_GATHER_CHUNK_BYTES",
    "GradBucketReducer",
    "sync_dense_grads",
    "sync_sparse_grads",
]
