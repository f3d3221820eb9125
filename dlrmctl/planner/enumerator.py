"""Enumerator: every allowed (sharding type x compute kernel x column split) of each table.

Reference: TorchRec ``planner/enumerators.py`` (``EmbeddingEnumerator``) and
``planner/utils`` (``calculate_shard_sizes_and_offsets``).  Rules:

* ``data_parallel`` only with the ``dense`` kernel, and only when the table may
  use every rank.
* ``table_row_wise`` / ``table_column_wise`` are skipped on a single host unless
  a constraint asks for them (there they equal row_wise / column_wise).
* ``column_wise`` / ``table_column_wise`` are skipped under optimizers with per-row state
  (row-wise Adagrad, partial row-wise Adam / LAMB, LAMB's trust ratio) unless a
  constraint asks for them (:func:`column_shards_change_training`).
* ``row_wise`` splits rows over all ranks (or the table's pinned ranks) in
  blocks of ``ceil(rows / n)`` (:func:`dlrmctl.distributed.types.row_wise_shard_sizes`);
  ``table_row_wise`` over the ranks of one host (the partitioner picks the host).
* column splits: ``k`` equal shards of width ``w = dim / k`` for every ``k >= 2``
  with ``dim % k == 0``, ``w >= min_column_shard_dim`` (default 32, or 4 when
  dim < 64), ``w % 4 == 0`` for the fused kernel when ``dim % 4 == 0`` (FBGEMM
  TBE needs dims that are multiples of 4), and ``k <= `` ranks available
  (``world_size`` for column_wise, ``local_world_size`` for table_column_wise);
  every column shard goes to a different rank.
* unpooled (EmbeddingCollection) tables: only ``UNPOOLED_SHARDING_TYPES``
  (table_wise, row_wise, column_wise: what the sharded EmbeddingCollection implements).
* an option whose any shard exceeds the usable memory of one rank is dropped;
  the smallest dropped option per table is kept for the error message.
* an option dominated by another of the same type and shard shapes (no faster
  and no smaller on any shard: typically ``dense`` next to ``fused``) is dropped
  (:func:`prune_dominated`).

The enumerator only does arithmetic on sizes: nothing of table size is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrmctl.distributed.types import (
    ComputeKernel,
    PlanError,
    ShardingType,
    construct_parameter_sharding,
    row_wise_shard_sizes,
)
from dlrmctl.optim.registry import find_embedding_optimizer
from dlrmctl.planner.perf import estimate_shard
from dlrmctl.planner.storage import shard_bytes, to_storage
from dlrmctl.planner.types import (
    UNPOOLED_SHARDING_TYPES,
    Shard,
    ShardingOption,
    TableSpec,
    Topology,
)

ALL_TYPES = list(ShardingType)
ALL_KERNELS = [ComputeKernel.FUSED, ComputeKernel.DENSE]
HOST_TYPES = (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE)


COLUMN_TYPES = (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)


def column_shards_change_training(optimizer: str) -> bool:
    """True for optimizers whose update of a row depends on the whole row: one state value
    per ROW (row-wise Adagrad's accumulator, partial row-wise Adam / LAMB's second moment:
    a mean of ``g ** 2`` over the row's columns) or a per-row norm (LAMB's trust ratio
    ``||w_r|| / ||u_r||``).  Each column shard computes those over its own columns (as in
    TorchRec, and FBGEMM's fused kernel cannot reduce across ranks), so a column-sharded
    table no longer trains like the unsharded one.  The planner then proposes column kinds
    only when a table's ``sharding.constraints.<t>.sharding_types`` (or ``sharding.tables``)
    asks for them.  ``adam``, ``exact_adagrad``, ``exact_sgd`` are per element: exact (the
    registry's ``row_coupled``; an unknown name: False)."""
    rec = find_embedding_optimizer(optimizer)
    return rec is not None and rec.row_coupled


def default_min_column_shard_dim(dim: int) -> int:
    """32 columns, or 4 for tables narrower than 64 (so a dim-16 table can still be split)."""
    return 32 if dim >= 64 else 4


def column_splits(dim: int, min_dim: int, max_shards: int, multiple_of_4: bool) -> list[list[int]]:
    """Equal column splits of ``dim`` into ``k >= 2`` shards (rules in the module docstring).

    Example: ``column_splits(128, 32, 8, True) == [[64, 64], [32, 32, 32, 32]]``.
    """
    out = []
    for k in range(2, max_shards + 1):
        if dim % k:
            continue
        w = dim // k
        if w < min_dim or (multiple_of_4 and w % 4):
            continue
        out.append([w] * k)
    return out


@dataclass
class Rejected:
    """The smallest option of a table that did not fit one rank (for error messages)."""

    option: ShardingOption
    usable: int


def _make_option(
    topology: Topology,
    table: TableSpec,
    st: ShardingType,
    kernel: ComputeKernel,
    sizes: list[list[int]],
    offsets: list[list[int]],
    ranks: list[int | None],
    batch_size: int,
    host_bound: bool = False,
    hits: list[float] | None = None,
) -> ShardingOption:
    """Estimate perf (memoised per distinct shard shape and cache hit fraction) and storage (per
    distinct shard shape: bytes do not depend on the hits) of each shard."""
    estimate = _shard_estimator(topology, table, st, kernel, len(sizes), batch_size)
    stored: dict[tuple[int, int], tuple] = {}
    shards = []
    for size, off, r, h in zip(sizes, offsets, ranks, hits or [0.0] * len(sizes)):
        perf, ids, inp, out = estimate(size[0], size[1], h)
        c = stored.get((size[0], size[1]))
        if c is None:
            b = shard_bytes(st, kernel, size[0], size[1], table.weight_bytes, table.optimizer, ids, inp, out)
            c = stored[size[0], size[1]] = (to_storage(topology, b), b)
        storage, b = c
        # size/off lists are never mutated
        shards.append(Shard(size, off, storage, perf, inp, out, b.weights, b.optimizer, r, perf.total, b.total))
    return ShardingOption(table, st, kernel, shards, host_bound)


def _shard_estimator(topology: Topology, table: TableSpec, st: ShardingType, kernel: ComputeKernel,
                     num_shards: int, batch_size: int):
    """``(rows, cols, hit) -> estimate_shard(...)`` for the shards of one option, memoised per
    distinct ``(rows, cols, hit)``; row kinds split the ids over their ``num_shards`` row shards."""
    n_row = num_shards if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) else 1
    memo: dict[tuple[int, int, float], tuple] = {}

    def estimate(rows: int, cols: int, hit: float) -> tuple:
        key = (rows, cols, hit)
        if key not in memo:
            memo[key] = estimate_shard(topology, table, st, kernel, rows, cols, n_row, batch_size, hit)
        return memo[key]

    return estimate


def apply_cache_hits(topology: Topology, option: ShardingOption, hits: list[float], batch_size: int) -> None:
    """Re-estimate ``option``'s shards in place at the given last-level cache hit fractions (one per
    shard, in shard order): their ``perf`` and ``time`` change, their storage does not (it does not
    depend on the hits), so a placed plan is not built twice (``planner.evaluate_plan``).

    Raises:
        ValueError: ``len(hits)`` differs from the number of shards, or a fraction outside [0, 1].
    """
    if len(hits) != len(option.shards):
        raise ValueError(f"table '{option.table.name}': {len(hits)} cache hit fractions for "
                         f"{len(option.shards)} shards")
    estimate = _shard_estimator(topology, option.table, option.sharding_type, option.compute_kernel,
                                len(option.shards), batch_size)
    for s, h in zip(option.shards, hits):
        perf = estimate(s.size[0], s.size[1], float(h))[0]
        s.perf, s.time = perf, perf.total


def build_option(
    topology: Topology,
    table: TableSpec,
    st: ShardingType,
    kernel: ComputeKernel,
    batch_size: int,
    ranks: list[int] | None = None,
    column_sizes: list[int] | None = None,
    hit: "float | list[float]" = 0.0,
) -> ShardingOption:
    """One option with its shards.

    Args:
        ranks: row_wise: the ranks sharing rows (default all / pinned);
            table_row_wise: the ranks of one host (default: partitioner picks the host);
            table_wise / column kinds: fixed placement (default: partitioner places);
            data_parallel: ignored (every rank).
        column_sizes: widths of column shards (column kinds only).
        hit: last-level cache hit fraction of every shard, or one per shard in shard order
            (``perf.estimate_shard``; 0 = all lookups at the DRAM / HBM rate).
    """
    R, D = table.num_embeddings, table.embedding_dim
    W, L = topology.world_size, topology.local_world_size

    def _make(sizes, offs, rk, host_bound=False):
        hits = list(hit) if isinstance(hit, (list, tuple)) else [float(hit)] * len(sizes)
        if len(hits) != len(sizes):
            raise ValueError(f"table '{table.name}': {len(hits)} cache hit fractions for {len(sizes)} shards")
        return _make_option(topology, table, st, kernel, sizes, offs, rk, batch_size, host_bound, hits)

    if st == ShardingType.DATA_PARALLEL:
        return _make([[R, D]] * W, [[0, 0]] * W, list(range(W)))
    if st == ShardingType.TABLE_WISE:
        return _make([[R, D]], [[0, 0]], [ranks[0] if ranks else None])
    if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        if st == ShardingType.ROW_WISE:
            rk: list[int | None] = list(ranks) if ranks else list(range(W))
        else:
            rk = list(ranks) if ranks else [None] * L
        rows = row_wise_shard_sizes(R, len(rk))
        offs, o = [], 0
        for n in rows:
            offs.append([o, 0])
            o += n
        return _make([[n, D] for n in rows], offs, rk, host_bound=(st == ShardingType.TABLE_ROW_WISE))
    cols = list(column_sizes) if column_sizes else [D]
    offs, o = [], 0
    for c in cols:
        offs.append([0, o])
        o += c
    rk = list(ranks) if ranks else [None] * len(cols)
    return _make([[R, c] for c in cols], offs, rk, host_bound=(st == ShardingType.TABLE_COLUMN_WISE))


def prune_dominated(options: list[ShardingOption]) -> list[ShardingOption]:
    """Drop an option when another of the same type and shard shapes is no slower and no larger on every shard.

    Such a pair differs only in the kernel (e.g. ``dense`` vs ``fused`` row_wise on
    cuda): the dominated one can never give a shorter critical path or fit
    where the other does not, so the search result is unchanged.
    """
    keep: list[ShardingOption] = []
    groups: dict[tuple, list[ShardingOption]] = {}
    for o in options:
        groups.setdefault((o.sharding_type, tuple(tuple(s.size) for s in o.shards)), []).append(o)
    for o in options:
        g = groups[(o.sharding_type, tuple(tuple(s.size) for s in o.shards))]
        dominated = any(
            q is not o
            and all(a.time <= b.time and a.mem <= b.mem for a, b in zip(q.shards, o.shards))
            and (any(a.time < b.time or a.mem < b.mem for a, b in zip(q.shards, o.shards)) or g.index(q) < g.index(o))
            for q in g
        )
        if not dominated:
            keep.append(o)
    return keep


def _fits(opt: ShardingOption, usable: int) -> bool:
    return all(max(s.storage.hbm, s.storage.ddr) <= usable for s in opt.shards)


def enumerate_options(
    table: TableSpec, topology: Topology, batch_size: int, usable: int, hit: float = 0.0
) -> tuple[list[ShardingOption], Rejected | None]:
    """All options of ``table`` whose every shard fits ``usable`` bytes, plus the smallest that did not.

    Args:
        usable: bytes per rank available to table shards (after the reservation).
        hit: the table's last-level cache hit fraction before placement
            (``perf.cache_hit_prior``), applied to every shard of every option.

    Raises:
        PlanError: the table's constraints or fixed sharding are inconsistent
            with the topology (rank out of range, nothing allowed).
    """
    W, L = topology.world_size, topology.local_world_size
    pinned = sorted(set(table.ranks)) if table.ranks is not None else None
    if pinned is not None:
        bad = [r for r in pinned if not 0 <= r < W]
        if bad or not pinned:
            raise PlanError(
                f"sharding.constraints.{table.name}.ranks: {table.ranks} must be non-empty ranks in [0, {W})"
            )
    candidates: list[ShardingOption] = []
    if table.fixed is not None:
        st, kernel, franks, fcols = table.fixed
        w = f"sharding.tables.{table.name}"
        if franks is not None and any(not 0 <= r < W for r in franks):
            raise PlanError(f"{w}.ranks: {franks} out of range for {W} ranks")
        if st == ShardingType.DATA_PARALLEL and kernel != ComputeKernel.DENSE:
            raise PlanError(f"{w}: data_parallel tables use the dense kernel, got {kernel.value}")
        if not table.is_pooled and st not in UNPOOLED_SHARDING_TYPES:
            raise PlanError(
                f"{w}: {st.value} is not supported for an unpooled (EmbeddingCollection) table; "
                f"supported: {', '.join(t.value for t in UNPOOLED_SHARDING_TYPES)}"
            )
        try:  # check the shape arithmetic the same way the plan will be built
            if franks is not None or st in (ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE):
                construct_parameter_sharding(st, table.num_embeddings, table.embedding_dim,
                                             franks or list(range(W)), kernel, fcols)
        except PlanError as e:
            raise PlanError(f"{w}: {e}") from None
        if st == ShardingType.TABLE_ROW_WISE and franks is not None and len({r // L for r in franks}) != 1:
            raise PlanError(f"{w}.ranks: table_row_wise ranks {franks} must lie on one host ({L} ranks per host)")
        if st in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE) and not fcols:
            # two column shards by default, each on its own rank: fewer when the job has fewer ranks
            k = len(franks) if franks else max(1, min(2, W if st == ShardingType.COLUMN_WISE else L))
            if table.embedding_dim < k:
                raise PlanError(f"{w}: cannot split dim {table.embedding_dim} into {k} column shards")
            base, rem = divmod(table.embedding_dim, k)
            fcols = [base + (1 if i < rem else 0) for i in range(k)]
        if st == ShardingType.TABLE_WISE and franks is not None and len(franks) != 1:
            raise PlanError(f"{w}.ranks: table_wise takes exactly one rank, got {franks}")
        candidates.append(build_option(topology, table, st, kernel, batch_size, franks, fcols, hit=hit))
    else:
        types = list(table.sharding_types) if table.sharding_types is not None else list(ALL_TYPES)
        if table.sharding_types is None and topology.num_hosts == 1:
            types = [t for t in types if t not in HOST_TYPES]
        if table.sharding_types is None and column_shards_change_training(table.optimizer):
            types = [t for t in types if t not in COLUMN_TYPES]
        if not table.is_pooled:
            types = [t for t in types if t in UNPOOLED_SHARDING_TYPES]
        kernels = list(table.compute_kernels) if table.compute_kernels is not None else list(ALL_KERNELS)
        # dense next to fused is built too: on a calibrated machine (a fitted fused efficiency, per-id
        # and per-bag terms, a dense multiplier of its own) either can be faster for a given shard;
        # prune_dominated drops the one that is slower and no smaller on every shard
        for st in types:
            for k in kernels:
                if st == ShardingType.DATA_PARALLEL and k != ComputeKernel.DENSE:
                    continue
                if st == ShardingType.DATA_PARALLEL:
                    if pinned is None or len(pinned) == W:
                        candidates.append(build_option(topology, table, st, k, batch_size, hit=hit))
                elif st == ShardingType.TABLE_WISE:
                    candidates.append(build_option(topology, table, st, k, batch_size, hit=hit))
                elif st == ShardingType.ROW_WISE:
                    if W > 1 or pinned is not None:
                        candidates.append(build_option(topology, table, st, k, batch_size, pinned, hit=hit))
                    elif table.sharding_types is not None:  # one rank: row_wise is one full shard
                        candidates.append(build_option(topology, table, st, k, batch_size, [0], hit=hit))
                elif st == ShardingType.TABLE_ROW_WISE:
                    if pinned is None or any(set(topology.host_ranks(h)) <= set(pinned) for h in range(topology.num_hosts)):
                        candidates.append(build_option(topology, table, st, k, batch_size, hit=hit))
                else:
                    avail = len(pinned) if pinned is not None else W
                    if st == ShardingType.TABLE_COLUMN_WISE:
                        avail = min(avail, L)
                    d = table.embedding_dim
                    min_dim = table.min_column_shard_dim or default_min_column_shard_dim(d)
                    m4 = k == ComputeKernel.FUSED and d % 4 == 0
                    for cols in column_splits(d, min_dim, avail, m4):
                        candidates.append(build_option(topology, table, st, k, batch_size, None, cols, hit=hit))
        if not candidates:
            raise PlanError(
                f"table '{table.name}': no sharding is allowed by its constraints on {W} rank(s) "
                f"(sharding_types {[t.value for t in types]}, compute_kernels {[k.value for k in kernels]}"
                f"{', ranks ' + str(pinned) if pinned is not None else ''})"
            )
    fitting = prune_dominated([o for o in candidates if _fits(o, usable)])
    rejected = None
    if not fitting:
        smallest = min(candidates, key=lambda o: o.max_shard_storage)
        rejected = Rejected(smallest, usable)
    return fitting, rejected
