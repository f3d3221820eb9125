"""The embedding sharding planner: tables + topology -> :class:`ShardingPlan`.

Pipeline (TorchRec ``EmbeddingShardingPlanner``): enumerate options per table
(:mod:`.enumerator`, with :mod:`.storage` and :mod:`.perf` estimates, each table at
its placement-free cache hit prior ``perf.cache_hit_prior``), propose combinations
(:mod:`.proposer`), place each proposal (:mod:`.partitioner`), re-estimate the
:data:`RERANK` best placements (and the single-type ones) with the cache hits of
their placed shards (:func:`evaluate_plan`), keep the one of those with the shortest
critical path (slowest rank's estimated time plus the fixed latency; ties broken by
total work), and report it (:mod:`.report`).  When nothing fits,
:class:`PlanError` says which table, how many bytes, and what would fit.

Entry points:

* :class:`EmbeddingShardingPlanner` — ``plan(tables) -> PlanResult``.
* :func:`table_specs_from_config` — the planner's view of an experiment config.
* :func:`plan_for_config` — what ``dlrmctl train --nproc N`` calls when no plan is given.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dlrmctl.distributed.types import (
    ComputeKernel,
    ShardingPlan,
    ShardingType,
    construct_parameter_sharding,
)
from dlrmctl.planner.enumerator import Rejected, apply_cache_hits, build_option, enumerate_options
from dlrmctl.planner.partitioner import Partition, partition, refine
from dlrmctl.planner.perf import cache_hit_fractions, cache_hit_prior
from dlrmctl.planner.proposer import (
    fastest_proposal,
    grid_proposals,
    grid_size,
    min_memory_proposal,
    neighbour_proposals,
    threshold_proposals,
    uniform_proposals,
)
from dlrmctl.optim.registry import embedding_optimizer
from dlrmctl.planner.storage import HeuristicStorageReservation, dense_model_bytes
from dlrmctl.planner.types import (
    DEVICE_PRESETS,
    GB,
    PlanError,
    ShardingOption,
    TableSpec,
    Topology,
    compute_kernels_of,
    fmt_bytes,
    optimizer_name,
    sharding_types_of,
)

GRID_LIMIT = 4096  #: exhaustive over option combinations up to this many
#: best search candidates (by the search's placement-free estimate) re-estimated with the cache hit
#: fractions of their placement (:func:`evaluate_plan`) before the final choice; the single-type
#: ("all <type>") candidates are re-estimated too, as the report's baseline
RERANK = 16


@dataclass
class PlanResult:
    """A plan and everything the report needs.

    Attributes:
        plan: the sharding plan (what ``plan.yaml`` holds).
        partition: the chosen placement (loads in seconds, memory in bytes per rank), as
            :func:`evaluate_plan` estimates ``plan`` (placement-aware cache hits), so
            :attr:`step_time_ms` is what ``evaluate_plan`` and
            ``scripts/bench_planner_accuracy.py`` give for this plan.
        label: which proposer produced it.
        runner_up: the best other re-estimated proposal ``(label, partition)``, or None.
        best_uniform: the best re-estimated "every table one sharding type" proposal
            ``(label, partition)`` other than the chosen one, or None (a familiar baseline).
        proposals_evaluated: partitions computed by the search.
        topology, tables, batch_size, reservation: the problem.
        reranked: candidates re-estimated with their placement's cache hits (:data:`RERANK`
            best plus the single-type ones) among which the plan was chosen.
        reranked_single: of ``reranked``, the single-type plans outside the :data:`RERANK`
            best (so ``reranked - reranked_single`` of the best were re-estimated).
    """

    plan: ShardingPlan
    partition: Partition
    label: str
    runner_up: tuple[str, Partition] | None
    proposals_evaluated: int
    topology: Topology
    tables: list[TableSpec]
    batch_size: int
    reservation: HeuristicStorageReservation
    best_uniform: tuple[str, Partition] | None = None
    reranked: int = 0
    reranked_single: int = 0

    @property
    def step_time_ms(self) -> float:
        """Estimated embedding time per step (critical path), milliseconds."""
        return self.partition.critical_path * 1e3

    def report(self) -> str:
        """The human-readable report (see :func:`dlrmctl.planner.report.format_report`)."""
        from dlrmctl.planner.report import format_report

        return format_report(self)


def partition_to_plan(p: Partition, topology: Topology) -> ShardingPlan:
    """Turn a placement into a :class:`ShardingPlan` (shard metadata via ``construct_parameter_sharding``)."""
    out = ShardingPlan(topology.world_size, topology.local_world_size)
    for opt, ranks in zip(p.options, p.ranks):
        t = opt.table
        st = opt.sharding_type
        if st == ShardingType.DATA_PARALLEL:
            ps = construct_parameter_sharding(st, t.num_embeddings, t.embedding_dim, list(range(topology.world_size)))
        elif st in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
            ps = construct_parameter_sharding(
                st, t.num_embeddings, t.embedding_dim, ranks, opt.compute_kernel, [s.size[1] for s in opt.shards]
            )
        else:
            ps = construct_parameter_sharding(st, t.num_embeddings, t.embedding_dim, ranks, opt.compute_kernel)
        out.plan[t.name] = ps
    return out


def evaluate_plan(plan: ShardingPlan, tables: list[TableSpec], topology: Topology, batch_size: int,
                  usable: int | None = None) -> Partition:
    """The cost model applied to a given plan (e.g. a hand-written one, or one from ``dlrmctl plan``).

    Unlike the planner's search (which charges each table the placement-free
    ``perf.cache_hit_prior``), the shards are estimated with the last-level cache hit
    fractions of this placement (``perf.cache_hit_fractions``: the shards sharing one cache
    compete for it).

    Returns:
        a :class:`Partition` with per-rank loads (seconds), memory (bytes) and the fixed
        latency (``critical_path`` = slowest rank + latency, seconds);
        ``failed`` names tables whose ranks exceed ``usable`` bytes (default: no limit).
        :meth:`EmbeddingShardingPlanner.plan` makes its final choice and reports its
        estimate with this function, so for a plan it chose the two agree.
    """
    options, ranks = [], []
    for t in tables:
        ps = plan.plan[t.name]
        st = ps.sharding_type
        if st == ShardingType.DATA_PARALLEL:
            opt = build_option(topology, t, st, ComputeKernel.DENSE, batch_size)
        else:
            cols = [s.sizes[1] for s in ps.shards or []] if st in (
                ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE) else None
            opt = build_option(topology, t, st, ps.compute_kernel, batch_size, [s.rank for s in ps.shards or []], cols)
        options.append(opt)
        ranks.append([s.rank for s in opt.shards])
    if topology.llc_bytes > 0:  # the placement is known: hit fractions per cache domain (perf module docstring)
        for opt, h in zip(options, cache_hit_fractions(topology, options, ranks, batch_size)):
            apply_cache_hits(topology, opt, h, batch_size)  # perf only: the shards are not built twice
    W = topology.world_size
    loads, mem = [0.0] * W, [0] * W
    for o, rk in zip(options, ranks):
        for s, r in zip(o.shards, rk):
            loads[r] += s.time
            mem[r] += s.mem
    cap = usable if usable is not None else max(mem) + 1
    failed = [o.table.name for o, rk in zip(options, ranks) if any(mem[r] > cap for r in rk)]
    return Partition(options, ranks, loads, mem, cap, failed, topology)


class EmbeddingShardingPlanner:
    """Plans a set of tables on a topology.

    Args:
        topology: the machine.
        batch_size: global batch (samples per step over all ranks).
        reservation: memory held back per rank (default 15%, no dense model).
        grid_limit: exhaustive search over option combinations when there are
            at most this many.
        greedy_budget: max partitions evaluated by the greedy feedback proposer
            (default 200 for <= 100 tables, else 60).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        reservation: HeuristicStorageReservation | None = None,
        grid_limit: int = GRID_LIMIT,
        greedy_budget: int | None = None,
    ) -> None:
        if batch_size <= 0:
            raise PlanError(f"batch size must be > 0, got {batch_size}")
        self.topology = topology
        self.batch_size = batch_size
        self.reservation = reservation or HeuristicStorageReservation()
        self.grid_limit = grid_limit
        self.greedy_budget = greedy_budget

    @property
    def usable(self) -> int:
        """Bytes per rank available to table shards."""
        return self.reservation.usable(self.topology)

    def enumerate(self, tables: list[TableSpec]) -> list[list[ShardingOption]]:
        """Options per table that fit one rank.

        Raises:
            PlanError: some table has no option that fits (the message explains
                each such table), or the tables together exceed all ranks' memory.
        """
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise PlanError(f"duplicate table name(s) {dup}")
        options, rejected = [], []
        prior = cache_hit_prior(self.topology, tables, self.batch_size)
        for t in tables:
            opts, rej = enumerate_options(t, self.topology, self.batch_size, self.usable, prior[t.name])
            options.append(opts)
            if rej is not None:
                rejected.append(rej)
        if rejected:
            raise PlanError(self._explain_tables(rejected))
        need = sum(min(o.total_storage for o in opts) for opts in options)
        have = self.usable * self.topology.world_size
        if need > have:
            raise PlanError(self._explain_total(tables, options, need, have))
        return options

    def plan(self, tables: list[TableSpec]) -> PlanResult:
        """Choose a sharding for every table.

        Returns:
            :class:`PlanResult` (``.plan`` is the :class:`ShardingPlan`).

        Raises:
            PlanError: infeasible (see :meth:`enumerate`), or no proposal
                could be placed within memory (names the tables left over).
        """
        if not tables:
            raise PlanError("no tables to plan")
        options = self.enumerate(tables)
        topo, usable = self.topology, self.usable
        evaluated: dict[tuple[int, ...], tuple[str, Partition]] = {}

        def ev(ch: tuple[int, ...], label: str) -> Partition:
            if ch not in evaluated:
                evaluated[ch] = (label, partition([options[t][k] for t, k in enumerate(ch)], topo, usable))
            return evaluated[ch][1]

        for ch, label in [fastest_proposal(options), min_memory_proposal(options)]:
            ev(ch, label)
        for ch, label in uniform_proposals(options) + threshold_proposals(options):
            ev(ch, label)
        use_grid = grid_size(options) <= self.grid_limit
        for ch, label in grid_proposals(options, self.grid_limit):
            ev(ch, label)

        def best_ok() -> tuple[tuple[int, ...], Partition] | None:
            ok = [(p.key, ch) for ch, (_, p) in evaluated.items() if p.ok]
            if not ok:
                return None
            ch = min(ok)[1]
            return ch, evaluated[ch][1]

        budget = self.greedy_budget if self.greedy_budget is not None else (200 if len(tables) <= 100 else 60)
        spent = 0
        while spent < budget:
            cur = best_ok()
            if cur is None:
                break
            ch, p = cur
            improved = False
            for nch, label in neighbour_proposals(options, ch, p):
                if nch in evaluated or spent >= budget:
                    continue
                spent += 1
                q = ev(nch, label)
                if q.ok and q.key < p.key:
                    improved = True
            if not improved:
                break

        ok = sorted((p.key, ch) for ch, (_, p) in evaluated.items() if p.ok)
        if not ok:
            raise PlanError(self._explain_partition(evaluated[min_memory_proposal(options)[0]][1]))
        for _, ch in ok if use_grid else ok[:3]:
            refine(evaluated[ch][1])
        ok = sorted((p.key, ch) for ch, (_, p) in evaluated.items() if p.ok)
        # the final choice: the best candidates of the search, each re-estimated the way evaluate_plan
        # estimates a given plan (cache hits of the placed shards instead of the prior), so the reported
        # step time is the one evaluate_plan / bench_planner_accuracy.py give for the chosen plan
        cand = [ch for _, ch in ok[:RERANK]]
        singles = [ch for _, ch in ok[RERANK:] if evaluated[ch][0].startswith("all ")]
        cand += singles
        placed: dict[tuple[int, ...], tuple[str, Partition]] = {}
        for ch in cand:
            label, p = evaluated[ch]
            q = evaluate_plan(partition_to_plan(p, topo), tables, topo, self.batch_size, usable)
            if q.ok:  # the same shards and bytes as the search's placement, so it fits as that did
                placed[ch] = (label, q)
        if not placed:  # cannot happen: storage does not depend on the cache hits
            raise PlanError(f"internal error: none of the {len(cand)} best placements fits when re-estimated "
                               f"with evaluate_plan (usable {fmt_bytes(usable)} per rank)")
        ok = sorted((p.key, ch) for ch, (_, p) in placed.items())
        label, best = placed[ok[0][1]]
        runner = placed[ok[1][1]] if len(ok) > 1 else None
        uniform = next((placed[ch] for _, ch in ok[1:] if placed[ch][0].startswith("all ")), None)
        return PlanResult(
            partition_to_plan(best, topo), best, label, runner, len(evaluated), topo, list(tables),
            self.batch_size, self.reservation, uniform, len(placed), sum(ch in placed for ch in singles),
        )

    # ---------------------------------------------------------------- errors
    def _capacity_line(self) -> str:
        t = self.topology
        cap = t.table_mem_cap
        return (
            f"each of the {t.world_size} rank(s) has {fmt_bytes(self.usable)} usable of {fmt_bytes(cap)} "
            f"{t.table_mem_name} ({cap / GB:.0f} GB; {self.reservation.percentage:.0%} and "
            f"{fmt_bytes(self.reservation.dense_bytes)} for the dense model reserved)"
        )

    def _fits_rw(self, table: TableSpec, world: int | None = None) -> int:
        """Largest row-wise shard of ``table`` over ``world`` ranks (default: this topology), bytes."""
        topo = self.topology
        if world is not None and world != topo.world_size:
            topo = dataclasses.replace(topo, world_size=world, local_world_size=1)
        kernel = (table.compute_kernels or [ComputeKernel.FUSED])[0]
        if kernel == ComputeKernel.DENSE and table.compute_kernels and ComputeKernel.FUSED in table.compute_kernels:
            kernel = ComputeKernel.FUSED
        opt = build_option(topo, table, ShardingType.ROW_WISE, kernel, self.batch_size, list(range(topo.world_size)))
        return opt.max_shard_storage

    @staticmethod
    def _one_rank_bytes(rej: Rejected) -> int:
        """Bytes the largest shard of a rejected table's smallest allowed sharding needs on one rank."""
        return max(s.storage.hbm + s.storage.ddr for s in rej.option.shards)

    def _explain_tables(self, rejected: list[Rejected], listed: int = 8) -> str:
        """The rejected table needing the most memory explained in full (:meth:`_explain_table`: what it
        needs, what a rank has, what would make it fit); the others one line, by name and bytes."""
        order = sorted(rejected, key=self._one_rank_bytes, reverse=True)
        text = self._explain_table(order[0])
        rest = order[1:]
        if rest:
            names = ", ".join(f"'{r.option.table.name}' {fmt_bytes(self._one_rank_bytes(r))}" for r in rest[:listed])
            more = f" and {len(rest) - listed} more" if len(rest) > listed else ""
            text += (f"\n  {len(rest)} more table(s) cannot be placed either (on one rank in their smallest "
                     f"sharding): {names}{more}; the remedies above apply to them in turn")
        return text

    def _explain_table(self, rej: Rejected) -> str:
        o, t, topo = rej.option, rej.option.table, self.topology
        usable = self.usable
        big = max(o.shards, key=lambda s: s.storage.hbm + s.storage.ddr)
        prec = {4: "fp32", 2: "fp16"}.get(t.weight_bytes, f"{t.weight_bytes}-byte")
        weights = t.weight_bytes_total
        from dlrmctl.planner.storage import optimizer_state_bytes

        opt_b = optimizer_state_bytes(t.optimizer, t.num_embeddings, t.embedding_dim)
        allowed = (
            f"sharding types {[x.value for x in t.sharding_types]}" if t.sharding_types is not None else "any sharding type"
        )
        if t.fixed is not None:
            allowed = f"fixed by sharding.tables.{t.name} to {t.fixed[0].value}"
        lines = [
            f"table '{t.name}' ({t.num_embeddings:,} rows x {t.embedding_dim}, {prec}, {optimizer_name(t.optimizer)}; "
            f"{allowed}) cannot be placed:",
            f"  it needs {fmt_bytes(weights + opt_b)} in total (weights {fmt_bytes(weights)} + optimizer state "
            f"{fmt_bytes(opt_b)}); the {topo.world_size} rank(s) have {fmt_bytes(usable * topo.world_size)} usable together",
            f"  its smallest allowed sharding, {o.label()}, needs {fmt_bytes(big.storage.hbm + big.storage.ddr)} on one rank "
            f"(weights {fmt_bytes(big.weights_bytes)} + optimizer {fmt_bytes(big.optimizer_bytes)} + buffers/gradients "
            f"{fmt_bytes(big.storage.hbm + big.storage.ddr - big.weights_bytes - big.optimizer_bytes)}), but "
            + self._capacity_line(),
            "  what would make it fit:",
        ]
        fixes = []
        W = topo.world_size
        rw_here = self._fits_rw(dataclasses.replace(t, ranks=None))
        restricted = t.fixed is not None or (
            t.sharding_types is not None
            and not {ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE} & set(t.sharding_types)
        ) or t.ranks is not None
        if restricted and rw_here <= usable:
            fixes.append(f"allow row_wise over all {W} ranks: {fmt_bytes(rw_here)} per rank")
        if rw_here > usable and usable > 0:
            n = max(W + 1, math.ceil((weights + opt_b) / usable))
            for _ in range(64):
                if self._fits_rw(t, n) <= usable:
                    break
                n = n + max(1, n // 16)
            fixes.append(f"more ranks: >= {n} x {topo.device if topo.topology_file is None else topo.compute_device + ' rank'} split row-wise ({fmt_bytes(self._fits_rw(t, n))} per rank)")
        opt_now = optimizer_name(t.optimizer)
        rec = embedding_optimizer(opt_now)
        lighter = rec.row_wise_variant
        if lighter is not None:
            # keep Adam's (LAMB's) first moment per weight, one second moment per row: about half the state
            b = self._fits_rw(dataclasses.replace(t, optimizer=lighter, ranks=None))
            if b <= usable:
                fixes.append(f"{lighter} (first moment per weight, second moment one fp32 per row) instead of "
                             f"{opt_now}: {fmt_bytes(b)} per rank row-wise on {W} ranks")
        if rec.state_per_weight:  # state per weight: row-wise Adagrad keeps one value per row
            t2 = dataclasses.replace(t, optimizer="exact_rowwise_adagrad", ranks=None)
            b = self._fits_rw(t2)
            if b <= usable:
                fixes.append(f"exact_rowwise_adagrad (one fp32 per row) instead of {opt_now}: "
                             f"{fmt_bytes(b)} per rank row-wise on {W} ranks")
        if t.weight_bytes > 2:
            b = self._fits_rw(dataclasses.replace(t, weight_bytes=2, ranks=None))
            if b <= usable:
                fixes.append(f"fp16 weights: {fmt_bytes(b)} per rank row-wise on {W} ranks")
        if rw_here > usable:
            step = 4 if t.embedding_dim % 4 == 0 else 1
            for d in range(t.embedding_dim - step, 0, -step):
                b = self._fits_rw(dataclasses.replace(t, embedding_dim=d, ranks=None))
                if b <= usable:
                    fixes.append(f"a smaller embedding_dim: <= {d} ({fmt_bytes(b)} per rank row-wise on {W} ranks)")
                    break
        if topo.compute_device == "cuda":
            rw_ddr = min(rw_here, o.max_shard_storage)
            where = "would" if rw_ddr <= topo.ddr_cap else "would not"
            fixes.append(
                f"UVM / DDR offload: {fmt_bytes(rw_ddr)} per rank {where} fit the {topo.ddr_cap / GB:.0f} GB of host "
                f"memory per rank, but needs a fused_uvm kernel, which dlrmctl does not have yet"
            )
        if not fixes:
            fixes.append("a larger --hbm-gb/--ddr-gb, a smaller --batch-size, or a smaller table")
        lines += [f"    - {f}" for f in fixes]
        return "\n".join(lines)

    def _explain_total(self, tables, options, need: int, have: int) -> str:
        per = sorted(((min(o.total_storage for o in opts), t.name) for t, opts in zip(tables, options)), reverse=True)
        top = ", ".join(f"'{n}' {fmt_bytes(b)}" for b, n in per[:5])
        n = math.ceil(need / max(1, self.usable))
        return (
            f"the tables together need at least {fmt_bytes(need)} (each in its smallest sharding) but the "
            f"{self.topology.world_size} rank(s) have {fmt_bytes(have)} usable; "
            f"{self._capacity_line()}.\n  largest tables: {top}.\n"
            f"  what would make it fit: at least {n} ranks of this kind (a lower bound: total bytes / usable per rank), fp16 weights, exact_rowwise_adagrad (or partial_rowwise_adam instead of adam), "
            f"smaller embedding dims, or UVM/DDR offload (no fused_uvm kernel in dlrmctl yet)"
        )

    def _explain_partition(self, p: Partition) -> str:
        used = ", ".join(f"rank {r}: {fmt_bytes(m)}" for r, m in enumerate(p.mem))
        return (
            f"no placement fits: table(s) {p.failed} could not be placed even with each table in its smallest "
            f"sharding; {self._capacity_line()}.\n  memory used per rank when they were left over: {used}.\n"
            f"  what would make it fit: more ranks, fewer pinned ranks / fixed shardings, row_wise for the "
            f"largest tables, or smaller tables"
        )


# ------------------------------------------------------------ config bridge
def count_dense_params(cfg: Any, num_features: int, num_dense: int, key_dims: list[int] | None = None) -> int:
    """Parameters of the dense part of a DLRM config (bottom MLP, interaction, top MLP).

    Bottom MLP ``num_dense -> dense_arch_layer_sizes``; the top MLP's input is,
    for ``dot``: ``d + F(F-1)/2`` with ``F = num_features + 1`` (DLRM, Naumov et
    al. 2019); for ``dcn``: ``(num_features + 1) * d`` plus the DCN-v2 low-rank
    layers ``2 * n * (F*d) * r + n * F*d``; for ``projection``: as ``dot`` (an
    approximation; these bytes only enter the memory reservation).  ``d`` is
    ``dense_arch_layer_sizes[-1]`` (the interaction width; it equals ``model.embedding_dim``
    unless that is ``auto``).  ``key_dims``: the widths of the pooled embeddings; each one
    narrower than ``d`` adds its projection ``w * d`` (no bias; ``embedding_dim: auto``).
    """
    m = cfg.model
    d = m.dense_arch_layer_sizes[-1]

    def mlp(n_in: int, sizes: list[int]) -> tuple[int, int]:
        n = 0
        for s in sizes:
            n += n_in * s + s
            n_in = s
        return n, n_in

    n, _ = mlp(num_dense, m.dense_arch_layer_sizes)
    F = num_features + 1
    if m.interaction == "dcn":
        fd = F * d
        n += m.dcn_num_layers * (2 * fd * m.dcn_low_rank_dim + fd)
        top_in = fd
    else:
        top_in = d + F * (F - 1) // 2
    n += mlp(top_in, m.over_arch_layer_sizes)[0]
    n += sum(w * d for w in key_dims or [] if w != d)
    if m.first_order:  # FirstOrder: bias-free Linear(num_dense, 1) + Linear(pooled width, 1)
        n += num_dense + (sum(key_dims) if key_dims else num_features * d)
    return n


def table_specs_from_config(cfg: Any, meta: dict | None, weight_bytes: int | None = None,
                            fused_available: bool = True) -> list[TableSpec]:
    """The planner's tables for an :class:`~dlrmctl.config.ExperimentConfig`.

    * rows / dim / features: :func:`dlrmctl.config.resolve_tables` (meta.json when
      the config says so).
    * pooling factor of a feature: meta.json's ``sparse_features[i].mean_pooling_factor``
      (1.0 when absent), times ``data.multi_hot_sizes[i]`` when set (each id becomes
      a bag of that many ids).  ``i`` is the feature's position in meta.json, or
      without meta.json its position in the tables' feature lists.
    * optimizer: ``optimizer.embedding.type`` (also used by dense-kernel tables).
    * bytes per weight: ``weight_bytes``, default from ``model.embedding_precision`` (fp32 4, fp16 2).
    * kernels: ``model.compute_kernel: dense`` allows only ``dense``; ``fused`` allows both.
      ``fused_available=False`` (this process has no ``fbgemm_gpu``, so training runs every
      table on the dense kernel): only ``dense``, also for constraints and fixed tables, so
      the plan is costed for the kernel that will run.
    * ``sharding.constraints.<table>`` and ``sharding.tables.<table>`` (fixed).

    Raises:
        PlanError: constraints for unknown tables, bad names, or a
            ``multi_hot_sizes`` list of the wrong length.
    """
    from dlrmctl.config import resolve_tables

    if weight_bytes is None:
        weight_bytes = 2 if cfg.model.embedding_precision == "fp16" else 4
    tables = resolve_tables(cfg, meta)
    names = {t.name for t in tables}
    for where, d in (("constraints", cfg.sharding.constraints), ("tables", cfg.sharding.tables)):
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanError(f"sharding.{where}: unknown table(s) {unknown}; the model has {sorted(names)}")
    feats = [f["name"] for f in (meta or {}).get("sparse_features", [])]
    if not feats:
        feats = [f for t in tables for f in t.feature_names]
    meta_pf = {f["name"]: float(f.get("mean_pooling_factor", 1.0)) for f in (meta or {}).get("sparse_features", [])}
    mh = cfg.data.multi_hot_sizes
    if mh is not None and len(mh) != len(feats):
        raise PlanError(f"data.multi_hot_sizes has {len(mh)} sizes but there are {len(feats)} sparse features")
    pos = {f: i for i, f in enumerate(feats)}
    default_kernels = [ComputeKernel.DENSE] if cfg.model.compute_kernel == "dense" or not fused_available else None
    from dlrmctl.config import managed_collision_tables

    # managed-collision tables train row_wise by zone of their buckets (dlrmctl.distributed.sharded_mc):
    # planned (and costed) row_wise, whatever else a constraint would allow
    managed = set(managed_collision_tables(cfg, meta))
    out = []
    for t in tables:
        pfs = []
        for f in t.feature_names:
            pf = meta_pf.get(f, 1.0)
            if mh is not None and f in pos:
                pf *= mh[pos[f]]
            pfs.append(pf)
        c = cfg.sharding.constraints.get(t.name)
        fx = cfg.sharding.tables.get(t.name)
        fixed = None
        if fx is not None:
            fixed = (ShardingType(fx.sharding_type),
                     ComputeKernel(fx.compute_kernel if fused_available else "dense"), fx.ranks, fx.column_sizes)
        out.append(
            TableSpec(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                pooling_factors=pfs,
                optimizer=cfg.optimizer.embedding.type,
                weight_bytes=weight_bytes,
                sharding_types=([ShardingType.ROW_WISE] if t.name in managed
                                else sharding_types_of(c.sharding_types) if c else None),
                compute_kernels=(compute_kernels_of(c.compute_kernels) if c and c.compute_kernels and fused_available
                                 else default_kernels),
                ranks=list(c.ranks) if c and c.ranks is not None else None,
                min_column_shard_dim=c.min_column_shard_dim if c else None,
                fixed=fixed,
            )
        )
    return out


def reservation_for_config(cfg: Any, meta: dict | None, num_features: int, percentage: float = 0.15,
                           key_dims: list[int] | None = None) -> HeuristicStorageReservation:
    """15% of each rank's memory plus the dense model (:func:`count_dense_params`, ``key_dims``: the
    pooled embeddings' widths) with its optimizer."""
    num_dense = 13
    if meta:
        num_dense = int(meta.get("num_dense_features", len(meta.get("dense_features", [])) or 13))
    params = count_dense_params(cfg, num_features, num_dense, key_dims)
    return HeuristicStorageReservation(percentage, dense_model_bytes(params, cfg.optimizer.dense.type))


def plan_config(
    cfg: Any,
    topology: Topology,
    meta: dict | None,
    batch_size: int | None = None,
    weight_bytes: int | None = None,
    fused_available: bool = True,
) -> PlanResult:
    """Plan an experiment config on a topology (what ``dlrmctl plan`` runs).

    Args:
        batch_size: global batch; default ``data.batch_size``.
        weight_bytes: 4 (fp32) or 2 (fp16); default from ``model.embedding_precision``.
        fused_available: False plans every table on the dense kernel (see
            :func:`table_specs_from_config`); ``dlrmctl plan`` and the trainer both pass
            :func:`dlrmctl._fbgemm.fused_kernel_available` (the kernel ``train`` runs here).
    """
    specs = table_specs_from_config(cfg, meta, weight_bytes, fused_available)
    res = reservation_for_config(cfg, meta, sum(len(t.pooling_factors) for t in specs),
                                 key_dims=[t.embedding_dim for t in specs for _ in t.pooling_factors])
    return EmbeddingShardingPlanner(topology, batch_size or cfg.data.batch_size, res).plan(specs)


def topology_for_config(cfg: Any, world_size: int, local_world_size: int | None = None,
                        train_preset: tuple[str, float | None] | None = None) -> Topology:
    """The topology the trainer plans on: ``sharding.topology_file`` when set, else the
    ``sharding.device`` preset, with ``sharding.hbm_gb`` / ``ddr_gb``; ``local_world_size``
    defaults to ``sharding.local_world_size``, then to ``world_size``.

    ``train_preset``: ``(preset, hbm_gb)`` of the GPU training runs on
    (:func:`dlrmctl.distributed.env.device_planning_preset`), or ``None`` (CPU training, or
    ``dlrmctl plan``).  When given and ``sharding.device`` is a CPU preset (its default), a GPU
    run is planned on that GPU preset with the GPU's own memory (``sharding.hbm_gb`` still
    wins): tables are costed in HBM with NCCL bandwidths, as training places them.

    Raises:
        PlanError: an unknown device, a bad or unreadable topology file (named), inconsistent sizes.
    """
    s = cfg.sharding
    lws = local_world_size or s.local_world_size or world_size
    if local_world_size is None and s.local_world_size and world_size % s.local_world_size:
        raise PlanError(f"sharding.local_world_size {s.local_world_size} (ranks per host) must divide the "
                           f"world size {world_size}; set it to a divisor or leave it unset (the launch's hosts)")
    device, hbm_gb = s.device, s.hbm_gb
    if (train_preset is not None and not s.topology_file
            and getattr(DEVICE_PRESETS.get(device), "compute_device", None) == "cpu"):
        device = train_preset[0]
        if hbm_gb is None:
            hbm_gb = train_preset[1]
    return Topology.from_device_or_file(device, s.topology_file, world_size, lws, hbm_gb, s.ddr_gb)


def plan_for_config(cfg: Any, world_size: int, local_world_size: int | None = None, meta: dict | None = None,
                    train_preset: tuple[str, float | None] | None = None) -> ShardingPlan:
    """The plan ``dlrmctl train --nproc N`` applies when no plan is given (rank 0 plans, then broadcasts).

    Topology: ``sharding.topology_file`` when set (``dlrmctl plan --calibrate``), else the
    ``sharding.device`` preset (``cpu`` by default: every table in DDR,
    fused = FBGEMM TBE on CPU, dense = torch EmbeddingBag) with
    ``sharding.hbm_gb`` / ``sharding.ddr_gb`` overrides; ``local_world_size``
    defaults to ``sharding.local_world_size``, then to ``world_size``.  Without ``fbgemm_gpu``
    in this process every table is planned (and costed) on the dense kernel, the one
    training will run.  ``train_preset``: the training GPU's preset (:func:`topology_for_config`).

    Returns:
        a :class:`ShardingPlan` that passes ``validate(resolve_tables(cfg, meta), world_size)``.

    Raises:
        PlanError: infeasible (the message says what would fit).
    """
    topo = topology_for_config(cfg, world_size, local_world_size, train_preset)
    from dlrmctl import _fbgemm

    # without fbgemm_gpu training runs every table on the dense kernel: plan (and cost) that
    return plan_config(cfg, topo, meta, fused_available=_fbgemm.fused_kernel_available()).plan
