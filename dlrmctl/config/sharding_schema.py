"""The ``sharding`` section of the experiment YAML (:class:`ShardingConfig` and its per-table
entries), as :mod:`dlrmctl.config.schema`'s other sections: each key documented by the attribute
docstring under its field.  :mod:`dlrmctl.config.schema` re-exports every name.  Nothing here
imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class TableShardingConfig:
    """``sharding.tables.<name>``: a hand-given sharding for one table."""

    sharding_type: Literal[
        "data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"
    ] = "table_wise"
    """How the table is split over ranks (see docs/distributed.md#sharding-types)."""
    compute_kernel: Literal["fused", "dense"] = "fused"
    """The table's kernel, as ``model.compute_kernel``."""
    ranks: Optional[list[int]] = None
    """For ``table_wise`` one rank; for column kinds one per column shard; for row kinds the
    ranks sharing rows (null: all ranks, or one host for ``table_row_wise``). Each >= 0."""
    column_sizes: Optional[list[int]] = None
    """Widths of the column shards (each >= 1, summing to the table's dim)."""


@dataclass
class TableConstraintsConfig:
    """``sharding.constraints.<table>``: what the planner may choose for a table."""

    sharding_types: Optional[list[str]] = None
    """The sharding types allowed; null: any."""
    compute_kernels: Optional[list[str]] = None
    """The compute kernels allowed (``fused``, ``dense``); null: what ``model.compute_kernel``
    allows (``dense``: only dense; ``fused``: both)."""
    ranks: Optional[list[int]] = None
    """The ranks the table may be placed on; null: any."""
    min_column_shard_dim: Optional[int] = None
    """The narrowest column shard the planner may cut; null: 32, or 4 when the table is
    narrower than 64."""


@dataclass
class ShardingConfig:
    """``sharding``: how tables are placed when training with several ranks.

    Tables not in ``tables`` (or ``plan_file``) are placed by the planner, within
    ``constraints``, for the topology of ``device`` / ``topology_file``.
    """

    plan_file: Optional[str] = None
    """A plan written by ``dlrmctl plan`` (the same as ``train --plan``)."""
    force: bool = False
    """Run the sharded path (DistributedModelParallel, every collective, the ``sparse_dist``
    pipeline) even with ONE process, on a one-rank process group (gloo on CPU, nccl on CUDA):
    one GPU then exercises all the code a multi-GPU job uses."""
    local_world_size: Optional[int] = None
    """Ranks per host (null: all ranks on one host); lets one machine pretend to be several hosts
    (4 ranks = 2 hosts x 2) for ``table_row_wise`` / ``table_column_wise``."""
    tables: dict[str, TableShardingConfig] = field(default_factory=dict)
    """A hand-given sharding per table name (``sharding.tables.<table>`` below)."""
    constraints: dict[str, TableConstraintsConfig] = field(default_factory=dict)
    """The planner's limits per table name (``sharding.constraints.<table>`` below)."""
    device: str = "cpu"
    """The topology preset the trainer's planner uses (:data:`dlrmctl.planner.types.DEVICE_PRESETS`:
    ``cpu``, ``a100``, ``h100``, ``h200``), with ``hbm_gb`` / ``ddr_gb``."""
    comm_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The pooled embeddings' output_dist (forward all-to-all / reduce-scatter) and its gradient
    travel in this precision and are cast back to fp32 on arrival (TorchRec's qcomm codecs);
    ``fp32``: no cast. See docs/distributed.md#quantized-communication."""
    overlap_output_dist: bool = True
    """Launch the pooled embeddings' all-to-all asynchronously and wait on it after the dense
    arch (TorchRec's ``LazyAwaitable``), so the bottom MLP's forward and backward run while it
    travels; bit-identical results either way. See docs/distributed.md#output_dist-overlap."""
    hbm_gb: Optional[float] = None
    """Device memory per rank in GB (1e9 bytes), overriding the preset's; > 0."""
    ddr_gb: Optional[float] = None
    """Host memory per rank in GB, overriding the preset's (null: the preset's, or this
    machine's); > 0."""
    topology_file: Optional[str] = None
    """A file written by ``dlrmctl plan --calibrate``; replaces the ``device`` preset for the
    trainer's planner and ``dlrmctl plan`` (``plan --topology FILE`` overrides it). Every number
    must be finite and >= 0. Bandwidths (``input_dist_bw_gbps`` and ``output_dist_bw_gbps``
    included, or null), kernel efficiencies and cache speedups must be > 0;
    ``default_gpus_per_host`` is an integer >= 1 or null. Files without ``llc_mb`` or
    ``*_cache_speedup`` load with the defaults."""
