"""Partitioner: place the shards of one proposal on ranks (TorchRec ``GreedyPerfPartitioner``).

Algorithm (greedy list scheduling, then local search):

1. Shards whose rank is already known (row_wise, data_parallel, pinned fixed
   shardings) are added to their ranks first.
2. The other options are placed largest first (by their slowest shard, then by
   storage, as TorchRec sorts ``sharding_options`` by perf): each table_wise /
   column_wise shard goes to the allowed rank with the lowest current load
   (seconds) that has memory left and holds no other shard of the same table;
   a table_row_wise table goes to the host whose resulting slowest rank is the
   least loaded; a table_column_wise table goes to the host where placing its
   column shards greedily on that host's ranks gives the lowest maximum.
3. :func:`refine` (optional) moves single table_wise / column_wise shards off
   the slowest rank, or swaps one with a smaller shard elsewhere, while that
   lowers the slowest rank's load and memory allows.

Ties in step 2 go to the rank with less memory used, then the lower rank.

A rank's load is the sum of its shards' ``time`` (= ``perf.total``); the critical path of
the partition is the largest load (the step waits for the slowest rank) plus the plan's
fixed per-step latency (:func:`dlrmctl.planner.perf.step_latency`: sharding groups,
kernel launches, collectives), so proposals that mix more sharding types or issue more
collectives pay for it.
Memory per rank is checked against the usable bytes (after the reservation).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from dlrmctl.distributed.types import ShardingType
from dlrmctl.planner.perf import step_latency
from dlrmctl.planner.types import ShardingOption, Topology

_EPS = 1e-12
_MOVABLE = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)


@dataclass
class Partition:
    """Placement of one proposal.

    Attributes:
        options: the proposal (one option per table, in table order).
        ranks: per option, the rank of each shard (``None`` entries if it failed).
        loads: per rank estimated time per step, seconds.
        mem: per rank table-memory bytes used.
        failed: names of tables that could not be placed (memory); empty on success.
        usable: bytes per rank available to tables.
        topology: the machine (for :meth:`update_latency`); ``None``: no fixed latency.
        latency: fixed seconds per step (:func:`~dlrmctl.planner.perf.step_latency`), kept
            current by :func:`partition` and :func:`refine`.
    """

    options: list[ShardingOption]
    ranks: list[list[int | None]]
    loads: list[float]
    mem: list[int]
    usable: int
    failed: list[str] = field(default_factory=list)
    topology: Topology | None = field(default=None, repr=False)
    latency: float = 0.0

    def __post_init__(self) -> None:
        self.update_latency()

    def update_latency(self) -> None:
        """Recompute :attr:`latency` from the current placement (0 without a topology or when it failed)."""
        if self.topology is not None and not self.failed:
            self.latency = step_latency(self.topology, self.options, self.ranks)[0]

    @property
    def ok(self) -> bool:
        """True when every table is placed within memory."""
        return not self.failed

    @property
    def bandwidth_path(self) -> float:
        """Max over ranks of the load (bytes / bandwidth), seconds."""
        return max(self.loads)

    @property
    def critical_path(self) -> float:
        """Estimated embedding step time = max over ranks of the load + fixed latency, seconds."""
        return max(self.loads) + self.latency

    @property
    def key(self) -> tuple[float, float]:
        """Selection key: (critical path, total load) — lower is better."""
        return (max(self.loads) + self.latency, sum(self.loads))


def _allowed(opt: ShardingOption, W: int) -> list[int]:
    return sorted(set(opt.table.ranks)) if opt.table.ranks is not None else list(range(W))


class _Loads:
    """Per-rank loads (seconds) and memory (bytes) with a lazy min-heap over (load, mem, rank).

    Loads only grow during greedy placement, so a heap entry is current iff it
    equals ``(loads[r], mem[r])``; stale entries are dropped when popped.
    """

    def __init__(self, W: int) -> None:
        self.loads = [0.0] * W
        self.mem = [0] * W
        self.heap = [(0.0, 0, r) for r in range(W)]

    def add(self, r: int, t: float, m: int) -> None:
        self.loads[r] += t
        self.mem[r] += m
        heapq.heappush(self.heap, (self.loads[r], self.mem[r], r))

    def least_loaded(self, need: int, usable: int, used: set[int]) -> int | None:
        """The least-loaded rank (ties: less memory) not in ``used`` with ``need`` bytes free."""
        aside, found = [], None
        h, loads, mem = self.heap, self.loads, self.mem
        while h:
            e = heapq.heappop(h)
            l, m, r = e
            if l != loads[r] or m != mem[r]:
                continue  # stale
            aside.append(e)
            if r in used or m + need > usable:
                continue
            found = r
            break
        for e in aside:
            heapq.heappush(h, e)
        return found


def partition(options: list[ShardingOption], topology: Topology, usable: int) -> Partition:
    """Greedy placement of one proposal (steps 1 and 2 of the module docstring).

    Args:
        options: one option per table.
        usable: bytes per rank available to table shards.

    Returns:
        a :class:`Partition`; ``failed`` lists the tables that did not fit.
    """
    W = topology.world_size
    st = _Loads(W)
    ranks: list[list[int | None]] = []
    failed: list[str] = []
    free_order = []
    placed = []
    for i, o in enumerate(options):
        if o.placed:
            placed.append(o.placed_vectors(W))
        else:
            free_order.append(i)
        ranks.append(list(o.initial_ranks))
    if placed:
        st.loads = [float(x) for x in np.sum([v[0] for v in placed], axis=0)]
        st.mem = [int(x) for x in np.sum([v[1] for v in placed], axis=0)]
    loads, mem = st.loads, st.mem
    st.heap = [(loads[r], mem[r], r) for r in range(W)]
    heapq.heapify(st.heap)
    over = {r for r in range(W) if mem[r] > usable}
    if over:
        free = set(free_order)
        for i, o in enumerate(options):
            if i not in free and any(r in over for r in ranks[i]):
                failed.append(o.table.name)
    free_order.sort(key=lambda i: (-options[i].max_shard_perf, -options[i].max_shard_storage, options[i].table.name))
    for i in free_order:
        o = options[i]
        if o.host_bound:
            allowed = set(_allowed(o, W))
            best = None
            for h in range(topology.num_hosts):
                hr = [r for r in topology.host_ranks(h) if r in allowed]
                if o.sharding_type == ShardingType.TABLE_ROW_WISE:
                    if len(hr) != len(o.shards):
                        continue
                    if any(mem[r] + s.mem > usable for s, r in zip(o.shards, hr)):
                        continue
                    cand = list(hr)
                else:
                    cand = _greedy_scan(o, hr, loads, mem, usable)
                    if cand is None:
                        continue
                worst = max(loads[r] + s.time for s, r in zip(o.shards, cand))
                if best is None or worst < best[0] - _EPS:
                    best = (worst, cand)
            if best is None:
                failed.append(o.table.name)
                continue
            ranks[i] = list(best[1])
        elif o.table.ranks is not None:
            cand = _greedy_scan(o, _allowed(o, W), loads, mem, usable)
            if cand is None:
                failed.append(o.table.name)
                continue
            ranks[i] = cand
        else:
            used: set[int] = set()
            cand = [None] * len(o.shards)
            for j in sorted(range(len(o.shards)), key=lambda j: -o.shards[j].time):
                r = st.least_loaded(o.shards[j].mem, usable, used)
                if r is None:
                    break
                used.add(r)
                cand[j] = r
            if any(r is None for r in cand):
                failed.append(o.table.name)
                continue
            ranks[i] = cand
        for s, r in zip(o.shards, ranks[i]):
            st.add(r, s.time, s.mem)
    return Partition(list(options), ranks, loads, mem, usable, failed, topology)


def _greedy_scan(o: ShardingOption, allowed: list[int], loads, mem, usable) -> list[int] | None:
    """Each shard of ``o`` (slowest first) onto the least-loaded allowed rank with memory, all ranks distinct."""
    order = sorted(range(len(o.shards)), key=lambda j: -o.shards[j].time)
    used: set[int] = set()
    out: list[int | None] = [None] * len(o.shards)
    for j in order:
        need = o.shards[j].mem
        best = None
        for r in allowed:
            if r in used or mem[r] + need > usable:
                continue
            if best is None or loads[r] < loads[best] - _EPS or (abs(loads[r] - loads[best]) <= _EPS and mem[r] < mem[best]):
                best = r
        if best is None:
            return None
        used.add(best)
        out[j] = best
    return out  # type: ignore[return-value]


def refine(p: Partition, max_iters: int = 200, targets: int = 8) -> Partition:
    """Local search on a successful partition (step 3 of the module docstring); modifies and returns ``p``.

    Each iteration takes the slowest rank ``a`` and applies the best of: moving
    one of its table_wise / column_wise shards (time ``x``) to a rank ``b`` with
    ``max(load[a] - x, load[b] + x) < load[a]``; else swapping it with a shard
    ``y < x`` on ``b`` with ``max(load[a] - x + y, load[b] - y + x) < load[a]``.
    ``b`` runs over the ``targets`` least-loaded ranks.  Memory, pinned ranks
    and "one column shard of a table per rank" are kept.
    """
    if not p.ok:
        return p
    W = len(p.loads)
    loads, mem = p.loads, p.mem
    on_rank: list[list[tuple[int, int]]] = [[] for _ in range(W)]
    allowed: dict[int, set[int] | None] = {}
    for i, o in enumerate(p.options):
        if o.sharding_type in _MOVABLE and o.table.fixed is None:
            allowed[i] = set(o.table.ranks) if o.table.ranks is not None else None
            for j, r in enumerate(p.ranks[i]):
                on_rank[r].append((i, j))  # type: ignore[index]
    if not allowed:
        return p

    def can_take(i: int, j: int, r: int, extra_free: int = 0) -> bool:
        al = allowed[i]
        if (al is not None and r not in al) or mem[r] - extra_free + p.options[i].shards[j].mem > p.usable:
            return False
        return all(r2 != r for j2, r2 in enumerate(p.ranks[i]) if j2 != j)

    for _ in range(max_iters):
        order = sorted(range(W), key=lambda r: loads[r])
        a = order[-1]
        la = loads[a]
        tol = 1e-9 * la
        cands = [b for b in order[:targets] if b != a]
        best = None  # (new_max, kind, payload)
        for i, j in on_rank[a]:
            x = p.options[i].shards[j].time
            for b in cands:
                nm = max(la - x, loads[b] + x)
                if nm >= la - tol or (best is not None and nm >= best[0]):
                    continue
                if can_take(i, j, b):
                    best = (nm, "move", (i, j, b))
        if best is None:
            for i, j in on_rank[a]:
                s = p.options[i].shards[j]
                for b in cands:
                    for i2, j2 in on_rank[b]:
                        if i2 == i:
                            continue
                        t = p.options[i2].shards[j2]
                        if t.time >= s.time:
                            continue
                        nm = max(la - s.time + t.time, loads[b] - t.time + s.time)
                        if nm >= la - tol or (best is not None and nm >= best[0]):
                            continue
                        if can_take(i, j, b, t.mem) and can_take(i2, j2, a, s.mem):
                            best = (nm, "swap", (i, j, i2, j2, b))
        if best is None:
            break
        if best[1] == "move":
            i, j, b = best[2]
            s = p.options[i].shards[j]
            loads[a] -= s.time
            loads[b] += s.time
            mem[a] -= s.mem
            mem[b] += s.mem
            p.ranks[i][j] = b
            on_rank[a].remove((i, j))
            on_rank[b].append((i, j))
        else:
            i, j, i2, j2, b = best[2]
            s, t = p.options[i].shards[j], p.options[i2].shards[j2]
            loads[a] += t.time - s.time
            loads[b] += s.time - t.time
            mem[a] += t.mem - s.mem
            mem[b] += s.mem - t.mem
            p.ranks[i][j], p.ranks[i2][j2] = b, a
            on_rank[a].remove((i, j))
            on_rank[b].remove((i2, j2))
            on_rank[a].append((i2, j2))
            on_rank[b].append((i, j))
    p.update_latency()
    return p
