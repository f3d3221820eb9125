"""Planner vocabulary: the machine (:class:`Topology`), the problem (:class:`TableSpec`)
and the candidate answers (:class:`ShardingOption` made of :class:`Shard`).

Names follow ``torchrec.distributed.planner.types`` (Topology, ShardingOption,
Shard, Storage, Perf).  Units are explicit in every attribute name or docstring:
bytes for memory, bytes/s for bandwidths, seconds for :class:`Perf` (the report
prints milliseconds).

The machine is :mod:`dlrmctl.planner.devices` (device presets, their sources, topology files) and
:mod:`dlrmctl.planner.topology` (:class:`Topology`); their names are re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from dlrmctl.distributed.types import ComputeKernel, PlanError, ShardingType
from dlrmctl.optim.registry import OPTIMIZER_ALIASES
from dlrmctl.planner.devices import (  # noqa: F401  (the planner's vocabulary, importable from here)
    DEFAULT_FIXED_US,
    DEFAULT_LLC_MB,
    DEVICE_PRESETS,
    GB,
    TOPOLOGY_DIVISOR_MIN,
    TOPOLOGY_FILE_KEYS,
    TOPOLOGY_VALUE_MAX,
    DevicePreset,
    GiB,
    MiB,
    detect_llc_bytes,
    host_memory_bytes,
    load_topology_file,
    save_topology_file,
)
from dlrmctl.planner.topology import BWD_COMPUTE_MULTIPLIER, Topology  # noqa: F401

#: sharding types of an unpooled (EmbeddingCollection) table: what
#: ``dlrmctl.distributed.sharded_ec.SEQUENCE_SHARDING_CLASSES`` implements
UNPOOLED_SHARDING_TYPES: tuple[ShardingType, ...] = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
)


#: the former name of :class:`dlrmctl.distributed.types.PlanError` (one class: a plan that cannot be
#: made, read or applied); kept while other branches move to the one name
PlannerError = PlanError


@dataclass
class TableSpec:
    """One table as the planner sees it (the problem, not the answer).

    Attributes:
        name: table name.
        num_embeddings: rows.
        embedding_dim: columns.
        pooling_factors: mean ids per sample of each feature looked up in this
            table (TorchRec ``ParameterConstraints.pooling_factors``); their sum
            is the ids per sample, their count the pooled outputs per sample.
        optimizer: embedding optimizer: a name of :data:`dlrmctl.optim.registry.EMBEDDING_OPTIMIZERS`
            or one of its aliases (``rowwise_adagrad``, ``adagrad``, ``sgd``).
        weight_bytes: bytes per weight (4 fp32, 2 fp16).
        sharding_types: allowed sharding types (None: all).
        compute_kernels: allowed kernels (None: all).
        ranks: ranks the table's shards may be placed on (None: any).
        min_column_shard_dim: narrowest column shard (None: 32, or 4 when dim < 64).
        fixed: a hand-given sharding (``sharding.tables.<name>``) the planner must
            keep: ``(sharding_type, compute_kernel, ranks or None, column_sizes or None)``.
        is_pooled: True for an EmbeddingBagCollection table (one pooled embedding
            per feature and sample); False for an EmbeddingCollection table (one
            embedding row per id: output / comm bytes scale with the pooling
            factor; only :data:`UNPOOLED_SHARDING_TYPES` are enumerated).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    optimizer: str = "exact_rowwise_adagrad"
    weight_bytes: int = 4
    sharding_types: list[ShardingType] | None = None
    compute_kernels: list[ComputeKernel] | None = None
    ranks: list[int] | None = None
    min_column_shard_dim: int | None = None
    fixed: tuple[ShardingType, ComputeKernel, list[int] | None, list[int] | None] | None = None
    is_pooled: bool = True

    @property
    def ids_per_sample(self) -> float:
        """Sum of the features' pooling factors: ids looked up per sample."""
        return float(sum(self.pooling_factors))

    @property
    def num_poolings(self) -> int:
        """Pooled embeddings per sample (one per feature)."""
        return len(self.pooling_factors)

    @property
    def output_rows_per_sample(self) -> float:
        """Embedding rows the lookups output per sample: one per feature when pooled
        (:attr:`num_poolings`), one per id when not (:attr:`ids_per_sample`)."""
        return float(self.num_poolings) if self.is_pooled else self.ids_per_sample

    @property
    def weight_bytes_total(self) -> int:
        """Bytes of the full weight matrix: rows * dim * weight_bytes."""
        return self.num_embeddings * self.embedding_dim * self.weight_bytes


@dataclass
class Storage:
    """Bytes of one shard (or one rank) in device memory (``hbm``) and host memory (``ddr``)."""

    hbm: int = 0
    ddr: int = 0

    def __add__(self, o: "Storage") -> "Storage":
        return Storage(self.hbm + o.hbm, self.ddr + o.ddr)


@dataclass
class Perf:
    """Estimated time of one shard per training step, seconds (TorchRec ``Perf``).

    ``total = fwd_compute + fwd_comms + bwd_compute + bwd_comms``.
    """

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the four parts, seconds."""
        return self.fwd_compute + self.fwd_comms + self.bwd_compute + self.bwd_comms


@dataclass(slots=True)
class Shard:
    """One block of a table in a candidate plan.

    Attributes:
        size: ``[rows, cols]``.
        offset: ``[row, col]`` in the full table.
        storage: bytes it occupies on its rank (weights + optimizer state + dist buffers).
        perf: estimated time it adds to its rank per step (seconds).
        input_bytes: bytes of ids it receives per step (input_dist).
        output_bytes: bytes of pooled embeddings it sends per step (output_dist).
        weights_bytes, optimizer_bytes: parts of ``storage`` (for error messages).
        rank: where it is placed; ``None`` until partitioned (fixed types set it).
        time: ``perf.total`` (seconds), filled in by the enumerator.
        mem: ``storage.hbm + storage.ddr`` (bytes), filled in by the enumerator.
    """

    size: list[int]
    offset: list[int]
    storage: Storage
    perf: Perf
    input_bytes: int
    output_bytes: int
    weights_bytes: int
    optimizer_bytes: int
    rank: int | None = None
    time: float = 0.0
    mem: int = 0


@dataclass
class ShardingOption:
    """One way to shard one table (TorchRec ``ShardingOption``).

    Attributes:
        table: the table.
        sharding_type, compute_kernel: the choice.
        shards: its shards (ranks set for placement-free types: row_wise and
            data_parallel; set by the partitioner for the others).
        host_bound: TWRW / TWCW — every shard on one host (the partitioner picks it).

    Shards are not modified after construction, so the aggregates below are
    computed once: ``total_perf`` (sum of shard times, seconds: the work this
    option adds to the job), ``max_shard_perf`` (slowest shard, seconds: a lower
    bound on the critical path with this option), ``max_shard_storage`` (bytes of
    the largest shard), ``total_storage`` (bytes of all shards), ``placed``
    (every shard's rank is already known: row_wise, data_parallel, pinned).
    """

    table: TableSpec
    sharding_type: ShardingType
    compute_kernel: ComputeKernel
    shards: list[Shard]
    host_bound: bool = False
    total_perf: float = field(init=False, default=0.0)
    max_shard_perf: float = field(init=False, default=0.0)
    max_shard_storage: int = field(init=False, default=0)
    total_storage: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        times = [s.time for s in self.shards]
        mems = [s.mem for s in self.shards]
        self.total_perf = sum(times)
        self.max_shard_perf = max(times)
        self.max_shard_storage = max(mems)
        self.total_storage = sum(mems)
        self.initial_ranks = [s.rank for s in self.shards]
        self.placed = all(r is not None for r in self.initial_ranks)
        self._placed_vecs = None

    def placed_vectors(self, world_size: int):
        """For an option whose shard ranks are all known: per-rank (time seconds, memory bytes) as numpy arrays, cached."""
        if self._placed_vecs is None:
            import numpy as np

            t, m = np.zeros(world_size), np.zeros(world_size, dtype=np.int64)
            for s in self.shards:
                t[s.rank] += s.time
                m[s.rank] += s.mem
            self._placed_vecs = (t, m)
        return self._placed_vecs

    @property
    def ranks(self) -> list[int]:
        """Ranks of the shards in shard order (after partitioning)."""
        return [s.rank for s in self.shards]  # type: ignore[misc]

    @property
    def is_pooled(self) -> bool:
        """The table's lookups pool (EmbeddingBagCollection) or not (EmbeddingCollection)."""
        return self.table.is_pooled

    def label(self) -> str:
        """Short name, e.g. ``column_wise/fused x4``."""
        n = len(self.shards)
        return f"{self.sharding_type.value}/{self.compute_kernel.value}" + (f" x{n}" if n > 1 else "")


def fmt_bytes(n: float) -> str:
    """Human bytes in GiB / MiB / KiB (binary units, as memory is allocated)."""
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def optimizer_name(name: str) -> str:
    """Canonical optimizer name (``rowwise_adagrad`` -> ``exact_rowwise_adagrad`` ...).

    Raises:
        PlanError: unknown optimizer.
    """
    try:
        return OPTIMIZER_ALIASES[name]
    except KeyError:
        raise PlanError(
            f"unknown embedding optimizer {name!r}; expected one of {sorted(OPTIMIZER_ALIASES)}"
        ) from None


def _enum_values(names: Sequence[str] | None, kind: type[enum.Enum], what: str) -> list | None:
    """``names`` as members of ``kind`` (None stays None).

    Raises:
        PlanError: an unknown name (``unknown <what> in [...]; expected [...]``).
    """
    if names is None:
        return None
    try:
        return [kind(n) for n in names]
    except ValueError:
        raise PlanError(f"unknown {what} in {list(names)}; expected {[k.value for k in kind]}") from None


def sharding_types_of(names: Sequence[str] | None) -> list[ShardingType] | None:
    """Parse sharding type names (None stays None).  Raises PlanError on an unknown name."""
    return _enum_values(names, ShardingType, "sharding type")


def compute_kernels_of(names: Sequence[str] | None) -> list[ComputeKernel] | None:
    """Parse compute kernel names (None stays None).  Raises PlanError on an unknown name."""
    return _enum_values(names, ComputeKernel, "compute kernel")
