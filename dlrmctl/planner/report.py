"""The plan report: per rank, per table, step time, proposals, runner-up (printed and saved).

Columns follow TorchRec's ``EmbeddingStats`` report.  Units: GB = 1e9 bytes,
MB = 1e6 bytes, ms = milliseconds of estimated time per training step.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from dlrmctl.planner.partitioner import Partition
from dlrmctl.planner.perf import step_latency

if TYPE_CHECKING:  # pragma: no cover
    from dlrmctl.planner.planner import PlanResult

_ABBR = {
    "data_parallel": "DP",
    "table_wise": "TW",
    "row_wise": "RW",
    "table_row_wise": "TWRW",
    "column_wise": "CW",
    "table_column_wise": "TWCW",
}
RANK_COLUMNS = ["Rank", "HBM (GB)", "DDR (GB)", "Perf (ms)", "Input (MB)", "Output (MB)", "Shards"]
TABLE_COLUMNS = ["Table", "Sharding", "Kernel", "Ranks", "Shard sizes", "Storage", "Pooling factor", "Dim", "Rows", "Perf (ms)"]


def fmt_ms(seconds: float) -> str:
    """Seconds -> milliseconds text: 3 decimals from 0.1 ms up, else 3 significant digits (0.00312)."""
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms >= 0.1 or ms == 0 else f"{ms:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), sep] + [fmt(r) for r in rows])


def compact_ranks(ranks: list[int]) -> str:
    """``[0,1,2,3,5]`` -> ``0-3,5`` (order kept; runs of consecutive ranks collapse)."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def compact_sizes(sizes: list[list[int]]) -> str:
    """Shard shapes with runs collapsed: ``7x[4,16] + [2,16]``."""
    out, i = [], 0
    while i < len(sizes):
        j = i
        while j + 1 < len(sizes) and sizes[j + 1] == sizes[i]:
            j += 1
        n = j - i + 1
        s = f"[{sizes[i][0]},{sizes[i][1]}]"
        out.append(s if n == 1 else f"{n}x{s}")
        i = j + 1
    return " + ".join(out)


def why_slower(p: Partition, limit: int = 3) -> str:
    """What loads the slowest rank of ``p``: ``rank 3 holds t_a (table_wise, 5.10 ms), ...``."""
    a = max(range(len(p.loads)), key=lambda r: p.loads[r])
    contrib = []
    for opt, ranks in zip(p.options, p.ranks):
        x = sum(s.time for s, r in zip(opt.shards, ranks) if r == a)
        if x > 0:
            contrib.append((x, opt))
    contrib.sort(key=lambda c: -c[0])
    parts = [f"{o.table.name} ({o.sharding_type.value}, {fmt_ms(x)} ms)" for x, o in contrib[:limit]]
    more = f" and {len(contrib) - limit} more" if len(contrib) > limit else ""
    return f"its slowest rank {a} holds {len(contrib)} table(s): " + ", ".join(parts) + more


def _lost(entry: tuple[str, Partition], chosen: Partition) -> str:
    """``<label>, X ms vs Y ms: <why>`` for a proposal that lost to ``chosen``."""
    label, q = entry
    if q.critical_path > chosen.critical_path * (1 + 1e-9) and q.bandwidth_path <= chosen.bandwidth_path and q.topology:
        _, nk, nc = step_latency(q.topology, q.options, q.ranks)
        why = (f"more fixed latency ({fmt_ms(q.latency)} ms vs {fmt_ms(chosen.latency)} ms: "
               f"{len({o.sharding_type for o in q.options})} sharding group(s), {nk} kernel launches on the busiest "
               f"rank, {nc} collectives)")
    elif q.critical_path > chosen.critical_path * (1 + 1e-9):
        why = why_slower(q)
    else:
        why = (f"same critical path, more total work ({fmt_ms(sum(q.loads))} ms vs "
               f"{fmt_ms(sum(chosen.loads))} ms over all ranks)")
    return f"{label}, {fmt_ms(q.critical_path)} ms vs {fmt_ms(chosen.critical_path)} ms: {why}"


def proposals_line(res: "PlanResult") -> str:
    """How many proposals the search scored and how many of them were re-estimated placement-aware
    (the :data:`~dlrmctl.planner.planner.RERANK` best, plus the single-type plans outside them),
    e.g. ``Proposals evaluated: 40 scored by the search; the best 16 and the 2 single-type plan(s)
    outside them (18) re-estimated with the cache hit rates of their placed shards``."""
    n, best, single = res.proposals_evaluated, res.reranked - res.reranked_single, res.reranked_single
    if single:
        which = f"the best {best} and the {single} single-type plan(s) outside them ({res.reranked})"
    elif best >= n:
        which = f"all {n}"
    else:
        which = f"the best {best} (every feasible single-type plan among them)"
    return (f"Proposals evaluated: {n} scored by the search; {which} re-estimated with the cache hit rates of "
            f"their placed shards (as evaluate_plan does)")


def why_chosen(res: "PlanResult", hbm: list[int], ddr: list[int]) -> str:
    """One line: the chosen plan's balance, its memory headroom and the runner-up's cost."""
    p, topo = res.partition, res.topology
    W = topo.world_size
    mean = sum(p.loads) / W
    slow = max(range(W), key=lambda r: p.loads[r])
    used = hbm if topo.compute_device == "cuda" else ddr
    full = max(range(W), key=lambda r: used[r])
    usable = res.reservation.usable(topo)
    head = f"{1 - used[full] / usable:.0%} headroom" if usable > 0 else "no table memory"
    parts = [
        f"the lowest estimated step time of the {res.reranked} re-estimated proposal(s)",
        f"balance max/mean {p.bandwidth_path / mean if mean else 1.0:.3f} (slowest rank {slow})",
        f"fullest rank {full} holds {used[full] / 1e9:.3f} of {usable / 1e9:.2f} GB usable "
        f"{topo.table_mem_name} ({head})",
    ]
    if res.runner_up is not None:
        label, q = res.runner_up
        a, b = p.critical_path, q.critical_path
        parts.append(f"runner-up {label} costs {fmt_ms(b)} ms vs {fmt_ms(a)} ms"
                     + (f" ({100 * (b / a - 1):+.1f}%)" if a > 0 else ""))
    else:
        parts.append("no runner-up (one feasible proposal)")
    return "; ".join(parts)


def format_report(res: "PlanResult") -> str:
    """The full report as text (see module docstring for units)."""
    p, topo = res.partition, res.topology
    W = topo.world_size
    hbm, ddr = [0] * W, [0] * W
    inp, outp = [0] * W, [0] * W
    kinds: list[Counter] = [Counter() for _ in range(W)]
    for opt, ranks in zip(p.options, p.ranks):
        for s, r in zip(opt.shards, ranks):
            hbm[r] += s.storage.hbm
            ddr[r] += s.storage.ddr
            inp[r] += s.input_bytes
            outp[r] += s.output_bytes
            kinds[r][_ABBR[opt.sharding_type.value]] += 1
    rank_rows = [
        [
            str(r),
            f"{hbm[r] / 1e9:.3f}",
            f"{ddr[r] / 1e9:.3f}",
            fmt_ms(p.loads[r]),
            f"{inp[r] / 1e6:.2f}",
            f"{outp[r] / 1e6:.2f}",
            ", ".join(f"{k}: {n}" for k, n in sorted(kinds[r].items())) or "-",
        ]
        for r in range(W)
    ]
    table_rows = []
    for opt, ranks in zip(p.options, p.ranks):
        t = opt.table
        table_rows.append(
            [
                t.name,
                opt.sharding_type.value,
                opt.compute_kernel.value,
                compact_ranks(list(ranks)),  # type: ignore[arg-type]
                compact_sizes([s.size for s in opt.shards]),
                f"{opt.total_storage / 1e9:.3f} GB",
                "+".join(f"{x:g}" for x in t.pooling_factors),
                str(t.embedding_dim),
                str(t.num_embeddings),
                fmt_ms(opt.total_perf),
            ]
        )
    mean = sum(p.loads) / W
    lat, n_kernels, n_coll = step_latency(topo, p.options, p.ranks)
    n_groups = len({o.sharding_type for o in p.options})
    lines = [
        f"Sharding plan: {len(p.options)} table(s) on {topo.describe()}",
        f"global batch {res.batch_size}; usable table memory per rank {res.reservation.usable(topo) / 1e9:.2f} GB "
        f"({res.reservation.percentage:.0%} + {res.reservation.dense_bytes / 1e9:.3f} GB dense model reserved)",
        "",
        "Per rank:",
        _table(RANK_COLUMNS, rank_rows),
        "",
        "Per table:",
        _table(TABLE_COLUMNS, table_rows),
        "",
        f"Estimated embedding step time: {fmt_ms(p.critical_path)} ms = bandwidth (slowest rank): "
        f"{fmt_ms(p.bandwidth_path)} ms (mean rank {fmt_ms(mean)} ms, balance max/mean "
        f"{p.bandwidth_path / mean if mean else 1.0:.3f}) + fixed latency {fmt_ms(lat)} ms ({n_groups} sharding "
        f"group(s) x {topo.lookup_fixed_s * 1e6:.3g} us, {n_kernels} kernel launches on the busiest rank x "
        f"{topo.kernel_launch_s * 1e6:.3g} us, {n_coll} collectives x {topo.collective_s * 1e6:.3g} us)",
        proposals_line(res) + f"; chosen: {res.label}",
        "Why this plan: " + why_chosen(res, hbm, ddr),
    ]
    if res.runner_up is None:
        lines.append("Runner-up: none (only one feasible proposal)")
    else:
        lines.append("Runner-up: " + _lost(res.runner_up, p))
    if res.best_uniform is not None and res.best_uniform is not res.runner_up:
        lines.append("Best single-type plan: " + _lost(res.best_uniform, p))
    lines.append("Units: GB = 1e9 bytes, MB = 1e6 bytes; Perf = estimated forward + backward compute and communication "
                 "per step (bandwidth model); the step time adds the plan's fixed latency and ranks the plans.")
    return "\n".join(lines) + "\n"
