"""Why a plan does not fit, and what would make it fit: the text of the :class:`PlanError` the
planner (:class:`~dlrmctl.planner.planner.EmbeddingShardingPlanner`) raises when a table has no
sharding that fits one rank, when the tables together exceed every rank's memory, or when no
placement fits.  Each message names the table, the bytes it needs and has, and the remedies that
would work (more ranks, a row-wise optimizer, fp16 weights, a smaller embedding dim), each one
checked by building the option it proposes."""

from __future__ import annotations

import dataclasses
import math

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.optim.registry import embedding_optimizer
from dlrmctl.planner.enumerator import Rejected, build_option
from dlrmctl.planner.partitioner import Partition
from dlrmctl.planner.storage import HeuristicStorageReservation
from dlrmctl.planner.types import GB, TableSpec, Topology, fmt_bytes, optimizer_name


class PlanExplainer:
    """The explanations of an infeasible plan for one planner's settings.

    Args:
        topology: the machine (:class:`~dlrmctl.planner.types.Topology`).
        batch_size: global batch (samples per step over all ranks).
        reservation: the memory held back per rank.
    """

    def __init__(self, topology: Topology, batch_size: int, reservation: HeuristicStorageReservation) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self.reservation = reservation

    @property
    def usable(self) -> int:
        """Bytes per rank available to table shards."""
        return self.reservation.usable(self.topology)

    def capacity_line(self) -> str:
        t = self.topology
        cap = t.table_mem_cap
        return (
            f"each of the {t.world_size} rank(s) has {fmt_bytes(self.usable)} usable of {fmt_bytes(cap)} "
            f"{t.table_mem_name} ({cap / GB:.0f} GB; {self.reservation.percentage:.0%} and "
            f"{fmt_bytes(self.reservation.dense_bytes)} for the dense model reserved)"
        )

    def fits_rw(self, table: TableSpec, world: int | None = None) -> int:
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
    def one_rank_bytes(rej: Rejected) -> int:
        """Bytes the largest shard of a rejected table's smallest allowed sharding needs on one rank."""
        return max(s.storage.hbm + s.storage.ddr for s in rej.option.shards)

    def explain_tables(self, rejected: list[Rejected], listed: int = 8) -> str:
        """The rejected table needing the most memory explained in full (:meth:`explain_table`: what it
        needs, what a rank has, what would make it fit); the others one line, by name and bytes."""
        order = sorted(rejected, key=self.one_rank_bytes, reverse=True)
        text = self.explain_table(order[0])
        rest = order[1:]
        if rest:
            names = ", ".join(f"'{r.option.table.name}' {fmt_bytes(self.one_rank_bytes(r))}" for r in rest[:listed])
            more = f" and {len(rest) - listed} more" if len(rest) > listed else ""
            text += (f"\n  {len(rest)} more table(s) cannot be placed either (on one rank in their smallest "
                     f"sharding): {names}{more}; the remedies above apply to them in turn")
        return text

    def explain_table(self, rej: Rejected) -> str:
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
            + self.capacity_line(),
            "  what would make it fit:",
        ]
        fixes = []
        W = topo.world_size
        rw_here = self.fits_rw(dataclasses.replace(t, ranks=None))
        restricted = t.fixed is not None or (
            t.sharding_types is not None
            and not {ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE} & set(t.sharding_types)
        ) or t.ranks is not None
        if restricted and rw_here <= usable:
            fixes.append(f"allow row_wise over all {W} ranks: {fmt_bytes(rw_here)} per rank")
        if rw_here > usable and usable > 0:
            n = max(W + 1, math.ceil((weights + opt_b) / usable))
            for _ in range(64):
                if self.fits_rw(t, n) <= usable:
                    break
                n = n + max(1, n // 16)
            fixes.append(f"more ranks: >= {n} x {topo.device if topo.topology_file is None else topo.compute_device + ' rank'} split row-wise ({fmt_bytes(self.fits_rw(t, n))} per rank)")
        opt_now = optimizer_name(t.optimizer)
        rec = embedding_optimizer(opt_now)
        lighter = rec.row_wise_variant
        if lighter is not None:
            # keep Adam's (LAMB's) first moment per weight, one second moment per row: about half the state
            b = self.fits_rw(dataclasses.replace(t, optimizer=lighter, ranks=None))
            if b <= usable:
                fixes.append(f"{lighter} (first moment per weight, second moment one fp32 per row) instead of "
                             f"{opt_now}: {fmt_bytes(b)} per rank row-wise on {W} ranks")
        if rec.state_per_weight:  # state per weight: row-wise Adagrad keeps one value per row
            t2 = dataclasses.replace(t, optimizer="exact_rowwise_adagrad", ranks=None)
            b = self.fits_rw(t2)
            if b <= usable:
                fixes.append(f"exact_rowwise_adagrad (one fp32 per row) instead of {opt_now}: "
                             f"{fmt_bytes(b)} per rank row-wise on {W} ranks")
        if t.weight_bytes > 2:
            b = self.fits_rw(dataclasses.replace(t, weight_bytes=2, ranks=None))
            if b <= usable:
                fixes.append(f"fp16 weights: {fmt_bytes(b)} per rank row-wise on {W} ranks")
        if rw_here > usable:
            step = 4 if t.embedding_dim % 4 == 0 else 1
            for d in range(t.embedding_dim - step, 0, -step):
                b = self.fits_rw(dataclasses.replace(t, embedding_dim=d, ranks=None))
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

    def explain_total(self, tables, options, need: int, have: int) -> str:
        per = sorted(((min(o.total_storage for o in opts), t.name) for t, opts in zip(tables, options)), reverse=True)
        top = ", ".join(f"'{n}' {fmt_bytes(b)}" for b, n in per[:5])
        n = math.ceil(need / max(1, self.usable))
        return (
            f"the tables together need at least {fmt_bytes(need)} (each in its smallest sharding) but the "
            f"{self.topology.world_size} rank(s) have {fmt_bytes(have)} usable; "
            f"{self.capacity_line()}.\n  largest tables: {top}.\n"
            f"  what would make it fit: at least {n} ranks of this kind (a lower bound: total bytes / usable per rank), fp16 weights, exact_rowwise_adagrad (or partial_rowwise_adam instead of adam), "
            f"smaller embedding dims, or UVM/DDR offload (no fused_uvm kernel in dlrmctl yet)"
        )

    def explain_partition(self, p: Partition) -> str:
        used = ", ".join(f"rank {r}: {fmt_bytes(m)}" for r, m in enumerate(p.mem))
        return (
            f"no placement fits: table(s) {p.failed} could not be placed even with each table in its smallest "
            f"sharding; {self.capacity_line()}.\n  memory used per rank when they were left over: {used}.\n"
            f"  what would make it fit: more ranks, fewer pinned ranks / fixed shardings, row_wise for the "
            f"largest tables, or smaller tables"
        )
