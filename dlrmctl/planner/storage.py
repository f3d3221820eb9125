"""Storage estimator: bytes each shard occupies, and what is reserved for the rest of the model.

Reference: TorchRec ``planner/shard_estimators.py`` (``calculate_shard_storages``,
``_calculate_storage_specific_sizes``, ``_get_optimizer_multipler``) and
``planner/storage_reservations.py`` (``HeuristicalStorageReservation``).

Per shard of ``r`` rows x ``c`` columns (all in bytes)::

    weights   = r * c * weight_bytes                       (4 fp32, 2 fp16)
    optimizer = exact_rowwise_adagrad: r * 4               (one fp32 accumulator per row, FBGEMM momentum1)
                exact_adagrad:         r * c * 4           (one fp32 per weight)
                adam, lamb:            2 * r * c * 4       (first and second moments, fp32)
                partial_rowwise_adam,  r * c * 4 + r * 4   (first moment per weight, second moment
                partial_rowwise_lamb:                       one fp32 per row: FBGEMM momentum2 [rows])
                exact_sgd:             0
    gradient  = data_parallel:  r * c * 4                  (dense gradient all-reduced, as DDP)
                dense kernel:   ids * (c * 4 + 8)          (sparse COO gradient of the looked-up rows:
                                                            nn.EmbeddingBag(sparse=True) values + int64 indices)
                fused kernel:   0                          (optimizer runs inside the TBE backward)
    buffers   = input_bytes + output_bytes                 (ids received by input_dist + embeddings
                                                            sent by output_dist: pooled rows, or one
                                                            row per id for unpooled tables; perf.py)

Optimizer state is kept in fp32 whatever the weight precision (FBGEMM keeps
momentum in fp32).  All of it lives in HBM when the compute device is ``cuda``
and in DDR when it is ``cpu`` (the kernels here, ``fused`` and ``dense``, keep
rows in the compute device's memory; there is no UVM kernel yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.optim.registry import DENSE_OPTIMIZERS, embedding_optimizer
from dlrmctl.planner.types import Storage, Topology, optimizer_name

GRAD_BYTES = 4  #: fp32 gradients
INDEX_BYTES = 8  #: int64 ids / indices


def optimizer_state_bytes(optimizer: str, rows: int, cols: int) -> int:
    """Bytes of optimizer state of a ``rows x cols`` shard (see module docstring).

    Example: 1000 x 64 with exact_rowwise_adagrad = 4,000 B; exact_adagrad =
    256,000 B; adam / lamb = 512,000 B; partial_rowwise_adam / partial_rowwise_lamb =
    260,000 B; exact_sgd = 0 (the registry's ``state_per_weight`` / ``state_per_row``).

    Raises:
        PlanError: unknown optimizer.
    """
    return embedding_optimizer(optimizer_name(optimizer)).state_bytes(rows, cols)


def dense_optimizer_states_per_param(dense_optimizer: str) -> int:
    """fp32 state tensors per dense parameter (the record's ``state_per_param``: adagrad 1, adam 2,
    sgd 0); an unknown name counts as adagrad's 1."""
    rec = DENSE_OPTIMIZERS.get(dense_optimizer)
    return 1 if rec is None else rec.state_per_param


@dataclass
class ShardBytes:
    """The parts of one shard's storage, bytes."""

    weights: int
    optimizer: int
    gradient: int
    buffers: int

    @property
    def total(self) -> int:
        """weights + optimizer + gradient + buffers."""
        return self.weights + self.optimizer + self.gradient + self.buffers


def shard_bytes(
    sharding_type: ShardingType,
    compute_kernel: ComputeKernel,
    rows: int,
    cols: int,
    weight_bytes: int,
    optimizer: str,
    ids: float,
    input_bytes: int,
    output_bytes: int,
) -> ShardBytes:
    """Bytes of one shard, split into parts (formulas in the module docstring).

    Args:
        rows, cols: shard shape.
        weight_bytes: 4 (fp32) or 2 (fp16).
        optimizer: embedding optimizer name.
        ids: ids this shard looks up per step (for the dense kernel's sparse gradient).
        input_bytes, output_bytes: dist buffers of the shard per step, bytes.
    """
    w = rows * cols * weight_bytes
    o = optimizer_state_bytes(optimizer, rows, cols)
    if sharding_type == ShardingType.DATA_PARALLEL:
        g = rows * cols * GRAD_BYTES
    elif compute_kernel == ComputeKernel.DENSE:
        g = math.ceil(ids * (cols * GRAD_BYTES + INDEX_BYTES)) if rows else 0
    else:
        g = 0
    return ShardBytes(w, o, g, input_bytes + output_bytes)


def to_storage(topology: Topology, b: ShardBytes) -> Storage:
    """Place a shard's bytes: HBM on cuda, DDR on cpu."""
    return Storage(hbm=b.total, ddr=0) if topology.compute_device == "cuda" else Storage(hbm=0, ddr=b.total)


@dataclass
class HeuristicStorageReservation:
    """Memory held back from the tables on every rank (TorchRec ``HeuristicalStorageReservation``).

    ``reserved = percentage * capacity + dense_bytes`` where ``dense_bytes`` is
    the dense model replicated on every rank: parameters x (weight + gradient +
    optimizer states) x 4 bytes, see :func:`dense_model_bytes`.  The percentage
    (TorchRec's default 0.15) covers activations, the CUDA/NCCL context and
    allocator fragmentation.

    Attributes:
        percentage: fraction of each rank's table memory kept free (0..1).
        dense_bytes: bytes of the dense model per rank.
    """

    percentage: float = 0.15
    dense_bytes: int = 0

    def reserved(self, topology: Topology) -> int:
        """Bytes per rank not available to tables."""
        return int(self.percentage * topology.table_mem_cap) + self.dense_bytes

    def usable(self, topology: Topology) -> int:
        """Bytes per rank available to table shards (capacity - reserved, never below 0)."""
        return max(0, topology.table_mem_cap - self.reserved(topology))


def dense_model_bytes(num_dense_params: int, dense_optimizer: str = "adagrad") -> int:
    """Bytes of the dense (MLP) model on each rank: ``params * 4 * (1 weight + 1 grad + states)``."""
    return num_dense_params * 4 * (2 + dense_optimizer_states_per_param(dense_optimizer))
