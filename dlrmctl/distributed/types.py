"""Sharding plan types shared by the planner (which writes plans) and the
sharded modules (which apply them).

Names follow ``torchrec.distributed.types``: ``ShardingType``, ``ShardMetadata``,
``ParameterSharding``, ``ShardingPlan``.  This module imports neither
``torch.distributed`` nor the planner, so both sides can depend on it.

Plan file format (YAML, written by ``dlrmctl plan``, read by ``dlrmctl train --plan``)::

    world_size: 4
    local_world_size: 2
    tables:
      t_cat_0:
        sharding_type: row_wise
        compute_kernel: fused
        ranks: [0, 1, 2, 3]
        shards:                    # absent for data_parallel (replicated)
          - {rank: 0, offsets: [0, 0], sizes: [4, 16]}
          - {rank: 1, offsets: [4, 0], sizes: [4, 16]}
          ...
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dlrmctl.errors import UserError


class PlanError(ValueError, UserError):
    """A sharding plan that cannot be made, read or applied: a plan file that is malformed or does
    not match the model / world size, a topology the planner cannot use, or tables that no plan
    fits into the memory under the constraints (the message then names the table(s), the bytes
    needed and available per rank, and what would make the problem fit)."""


class ShardingType(str, enum.Enum):
    """How one embedding table is split over ranks (TorchRec's names)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


class ComputeKernel(str, enum.Enum):
    """Lookup kernel of a shard.

    * ``dense``: ``torch.nn.EmbeddingBag`` with autograd; gradients go to a
      regular torch optimizer (the only kernel for ``data_parallel``).
    * ``fused``: FBGEMM table-batched embedding (TBE) with the optimizer fused
      into the backward pass.
    """

    DENSE = "dense"
    FUSED = "fused"


@dataclass
class ShardMetadata:
    """One shard of a table: a ``sizes[0] x sizes[1]`` block at ``offsets`` on ``rank``.

    Attributes:
        rank: global rank holding the shard.
        offsets: ``[row_offset, col_offset]`` in the full table.
        sizes: ``[rows, cols]`` of the shard (rows may be 0 for a trailing
            row-wise shard when rows < ranks).
    """

    rank: int
    offsets: list[int]
    sizes: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "offsets": list(self.offsets), "sizes": list(self.sizes)}

    @staticmethod
    def from_dict(d: dict[str, Any], where: str) -> "ShardMetadata":
        try:
            return ShardMetadata(int(d["rank"]), [int(x) for x in d["offsets"]], [int(x) for x in d["sizes"]])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{where}: a shard needs rank, offsets [row, col] and sizes [rows, cols]: {e}") from e


@dataclass
class ParameterSharding:
    """How one table is sharded.

    Attributes:
        sharding_type: see :class:`ShardingType`.
        compute_kernel: see :class:`ComputeKernel`.
        ranks: ranks holding shards, in shard order (all ranks for data_parallel).
        shards: shard metadata; ``None`` for data_parallel (full replica everywhere).
    """

    sharding_type: ShardingType
    compute_kernel: ComputeKernel = ComputeKernel.FUSED
    ranks: list[int] = field(default_factory=list)
    shards: list[ShardMetadata] | None = None

    def __post_init__(self) -> None:
        self.sharding_type = ShardingType(self.sharding_type)
        self.compute_kernel = ComputeKernel(self.compute_kernel)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
        }
        if self.shards is not None:
            d["shards"] = [s.to_dict() for s in self.shards]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any], where: str) -> "ParameterSharding":
        try:
            st = ShardingType(d["sharding_type"])
        except (KeyError, ValueError) as e:
            raise PlanError(
                f"{where}.sharding_type: expected one of {[t.value for t in ShardingType]}, got {d.get('sharding_type')!r}"
            ) from e
        try:
            ck = ComputeKernel(d.get("compute_kernel", "fused"))
        except ValueError as e:
            raise PlanError(
                f"{where}.compute_kernel: expected one of {[k.value for k in ComputeKernel]}, got {d.get('compute_kernel')!r}"
            ) from e
        shards = d.get("shards")
        return ParameterSharding(
            st,
            ck,
            [int(r) for r in d.get("ranks", [])],
            None if shards is None else [ShardMetadata.from_dict(s, f"{where}.shards[{i}]") for i, s in enumerate(shards)],
        )


def row_wise_shard_sizes(num_rows: int, num_shards: int) -> list[int]:
    """Row counts of a row-wise split: blocks of ``ceil(rows / shards)``, the last ones smaller.

    Every rank sees the same block size, so a global id maps to shard
    ``id // block`` and local row ``id % block`` (as in FBGEMM's
    ``block_bucketize_sparse_features``).  Example: 10 rows on 3 ranks ->
    ``[4, 4, 2]``; 3 rows on 4 ranks -> ``[1, 1, 1, 0]``.
    """
    if num_shards <= 0:
        raise PlanError(f"row-wise split needs at least one shard, got {num_shards}")
    block = math.ceil(num_rows / num_shards)
    return [max(0, min(block, num_rows - i * block)) for i in range(num_shards)]


def even_column_split(dim: int, num_shards: int) -> list[int]:
    """Column widths splitting ``dim`` into ``num_shards`` near-equal parts (first ones wider)."""
    if not 0 < num_shards <= dim:
        raise PlanError(f"cannot split {dim} columns into {num_shards} column-wise shards")
    base, rem = divmod(dim, num_shards)
    return [base + (1 if i < rem else 0) for i in range(num_shards)]


def construct_parameter_sharding(
    sharding_type: ShardingType | str,
    num_rows: int,
    dim: int,
    ranks: Sequence[int],
    compute_kernel: ComputeKernel | str = ComputeKernel.FUSED,
    column_sizes: Sequence[int] | None = None,
) -> ParameterSharding:
    """Build a :class:`ParameterSharding` with its shard metadata.

    Args:
        sharding_type: the type.
        num_rows, dim: full table shape.
        ranks: for TW one rank; for RW / TWRW the ranks sharing the rows
            (TWRW: the ranks of one host); for CW / TWCW one rank per column
            shard (may repeat); for DP all ranks.
        column_sizes: CW / TWCW column widths (default: even split over ``ranks``).

    Raises:
        PlanError: inconsistent ranks / column sizes for the type.
    """
    st = ShardingType(sharding_type)
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise PlanError(f"{st.value}: needs at least one rank")
    if st == ShardingType.DATA_PARALLEL:
        return ParameterSharding(st, ComputeKernel.DENSE, ranks, None)
    if st == ShardingType.TABLE_WISE:
        if len(ranks) != 1:
            raise PlanError(f"table_wise places a table on exactly one rank, got ranks {ranks}")
        shards = [ShardMetadata(ranks[0], [0, 0], [num_rows, dim])]
    elif st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        sizes = row_wise_shard_sizes(num_rows, len(ranks))
        shards, off = [], 0
        for r, n in zip(ranks, sizes):
            shards.append(ShardMetadata(r, [off, 0], [n, dim]))
            off += n
    else:  # column-wise kinds
        cols = list(column_sizes) if column_sizes is not None else even_column_split(dim, len(ranks))
        if len(cols) != len(ranks):
            raise PlanError(f"{st.value}: {len(cols)} column shards but {len(ranks)} ranks")
        if sum(cols) != dim or any(c <= 0 for c in cols):
            raise PlanError(f"{st.value}: column sizes {cols} must be positive and sum to dim {dim}")
        shards, off = [], 0
        for r, c in zip(ranks, cols):
            shards.append(ShardMetadata(r, [0, off], [num_rows, c]))
            off += c
    return ParameterSharding(st, ComputeKernel(compute_kernel), ranks, shards)


@dataclass
class ShardingPlan:
    """Table name -> :class:`ParameterSharding` for one world size.

    Attributes:
        world_size: number of ranks the plan is for.
        local_world_size: ranks per host (TWRW / TWCW group by host).
        plan: per-table sharding.
    """

    world_size: int
    local_world_size: int
    plan: dict[str, ParameterSharding] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "tables": {name: ps.to_dict() for name, ps in self.plan.items()},
        }

    @staticmethod
    def from_dict(d: dict[str, Any], where: str = "plan") -> "ShardingPlan":
        for k in ("world_size", "tables"):
            if k not in d:
                raise PlanError(f"{where}: missing key '{k}'")
        try:
            ws = int(d["world_size"])
            lws = int(d.get("local_world_size", ws))
            tables = {n: ParameterSharding.from_dict(p, f"{where}: tables.{n}") for n, p in d["tables"].items()}
        except (ValueError, TypeError, AttributeError, KeyError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"{where}: not a sharding plan ({type(e).__name__}: {e}); expected world_size: <int>, "
                            "local_world_size: <int>, tables: {<table>: {sharding_type, compute_kernel, ranks, "
                            "shards}}, as `dlrmctl plan` writes") from None
        return ShardingPlan(ws, lws, tables)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as YAML (:func:`dlrmctl.fileio.write_text_atomic`: temp file, fsync,
        rename, so a crash never leaves half a plan)."""
        import yaml

        from dlrmctl.fileio import write_text_atomic

        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))

    @staticmethod
    def load(path: str | os.PathLike) -> "ShardingPlan":
        from dlrmctl.yaml_file import read_yaml_mapping

        path = os.fspath(path)
        d = read_yaml_mapping(path, PlanError, "plan", "world_size, tables")
        return ShardingPlan.from_dict(d, where=path)

    def validate(self, tables: Iterable[Any], world_size: int, where: str = "plan") -> None:
        """Check the plan against the model's tables and the actual world size.

        Args:
            tables: objects with ``name``, ``num_embeddings``, ``embedding_dim``
                (e.g. :class:`~dlrmctl.modules.embedding_configs.EmbeddingBagConfig`).
            world_size: ranks of the running job.

        Raises:
            PlanError: wrong world size, a table missing from / unknown to the
                plan, ranks out of range, or shards that do not tile the table.
        """
        if self.world_size != world_size:
            raise PlanError(
                f"{where}: plan is for world_size {self.world_size} but the job has {world_size} ranks; "
                f"re-plan with `dlrmctl plan --gpus {world_size}` or reshard"
            )
        if self.local_world_size <= 0 or world_size % self.local_world_size:
            raise PlanError(f"{where}: local_world_size {self.local_world_size} must divide world_size {world_size}")
        tables = list(tables)
        names = {t.name for t in tables}
        missing = [t.name for t in tables if t.name not in self.plan]
        if missing:
            raise PlanError(f"{where}: no sharding for table(s) {missing}")
        unknown = sorted(set(self.plan) - names)
        if unknown:
            raise PlanError(f"{where}: plan names table(s) {unknown} that the model does not have")
        lws = self.local_world_size
        for t in tables:
            ps = self.plan[t.name]
            w = f"{where}: table '{t.name}' ({ps.sharding_type.value})"
            bad = [r for r in ps.ranks if not 0 <= r < world_size]
            if bad:
                raise PlanError(f"{w}: ranks {bad} out of range for world_size {world_size}")
            if ps.sharding_type == ShardingType.DATA_PARALLEL:
                if ps.compute_kernel != ComputeKernel.DENSE:
                    raise PlanError(f"{w}: data_parallel tables use the dense kernel, got {ps.compute_kernel.value}")
                continue
            if not ps.shards:
                raise PlanError(f"{w}: has no shards")
            if ps.sharding_type in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
                hosts = {s.rank // lws for s in ps.shards}
                if len(hosts) != 1:
                    raise PlanError(f"{w}: shards must lie on one host (local_world_size {lws}), got ranks {ps.ranks}")
            if ps.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
                off = 0
                for s in ps.shards:
                    if s.offsets != [off, 0] or s.sizes[1] != t.embedding_dim:
                        raise PlanError(f"{w}: row shards must be contiguous full-width blocks, got {s.to_dict()}")
                    off += s.sizes[0]
                if off != t.num_embeddings:
                    raise PlanError(f"{w}: row shards cover {off} rows, table has {t.num_embeddings}")
            elif ps.sharding_type in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
                off = 0
                for s in ps.shards:
                    if s.offsets != [0, off] or s.sizes[0] != t.num_embeddings or s.sizes[1] <= 0:
                        raise PlanError(f"{w}: column shards must be contiguous full-height blocks, got {s.to_dict()}")
                    off += s.sizes[1]
                if off != t.embedding_dim:
                    raise PlanError(f"{w}: column shards cover {off} columns, table dim is {t.embedding_dim}")
            else:  # table_wise
                s = ps.shards[0]
                if len(ps.shards) != 1 or s.sizes != [t.num_embeddings, t.embedding_dim]:
                    raise PlanError(f"{w}: a table_wise table is one full shard, got {[x.to_dict() for x in ps.shards]}")
