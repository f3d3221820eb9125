"""The embedding sharding planner: tables + topology -> :class:`ShardingPlan`.

Pipeline (TorchRec ``EmbeddingShardingPlanner``): enumerate options per table
(:mod:`.enumerator`, with :mod:`.storage` and :mod:`.perf` estimates, each table at
its placement-free cache hit prior ``perf.cache_hit_prior``), propose combinations
(:mod:`.proposer`), place each proposal (:mod:`.partitioner`), re-estimate the
:data:`RERANK` best placements (and the single-type ones) with the cache hits of
their placed shards (:func:`evaluate_plan`), keep the one of those with the shortest
critical path (slowest rank's estimated time plus the fixed latency; ties broken by
total work), and report it (:mod:`.report`).  When nothing fits,
:class:`PlanError` says which table, how many bytes, and what would fit (:mod:`.explain`).

Entry points:

* :class:`EmbeddingShardingPlanner` — ``plan(tables) -> PlanResult``.
* :func:`table_specs_from_config` — the planner's view of an experiment config
  (:mod:`.config_tables`, re-exported here).
* :func:`plan_for_config` — what ``dlrmctl train --nproc N`` calls when no plan is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlrmctl.distributed.types import (
    ComputeKernel,
    ShardingPlan,
    ShardingType,
    construct_parameter_sharding,
)
from dlrmctl.planner.config_tables import (  # noqa: F401  (count_dense_params: re-exported)
    count_dense_params,
    reservation_for_config,
    table_specs_from_config,
)
from dlrmctl.planner.enumerator import apply_cache_hits, build_option, enumerate_options
from dlrmctl.planner.explain import PlanExplainer
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
from dlrmctl.planner.storage import HeuristicStorageReservation
from dlrmctl.planner.types import (
    DEVICE_PRESETS,
    PlanError,
    ShardingOption,
    TableSpec,
    Topology,
    fmt_bytes,
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

    @property
    def explainer(self) -> PlanExplainer:
        """What the error of a plan that does not fit says (:class:`~dlrmctl.planner.explain.PlanExplainer`)."""
        return PlanExplainer(self.topology, self.batch_size, self.reservation)

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
            raise PlanError(self.explainer.explain_tables(rejected))
        need = sum(min(o.total_storage for o in opts) for opts in options)
        have = self.usable * self.topology.world_size
        if need > have:
            raise PlanError(self.explainer.explain_total(tables, options, need, have))
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
            raise PlanError(self.explainer.explain_partition(evaluated[min_memory_proposal(options)[0]][1]))
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


# ------------------------------------------------------------ config bridge
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
