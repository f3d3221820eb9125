"""Proposers: which option each table uses (TorchRec ``planner/proposers.py``).

A proposal is one option index per table.  The planner partitions every
proposal and keeps the one with the shortest critical path.  Proposers here:

* :func:`fastest_proposal` — each table its option with the least total work
  (sum of shard times): the best plan when load balance is free.
* :func:`uniform_proposals` — every table the same sharding type where allowed
  (TorchRec ``UniformProposer``): "all table_wise", "all row_wise", ...
* :func:`min_memory_proposal` — each table its option with the smallest largest
  shard: the most likely to fit when memory is tight.
* :func:`threshold_proposals` — for a time budget ``T`` each table takes its
  least-work option whose slowest shard is at most ``T`` (so no single shard
  sticks out above the balance line); ``T`` sweeps the quantiles of all options'
  slowest-shard times.  This is the greedy proposer: it trades total work for
  balance one table at a time, largest first.
* :func:`grid_proposals` — every combination, when there are at most
  ``limit`` (TorchRec ``GridSearchProposer``).
* :func:`neighbour_proposals` — greedy feedback step (TorchRec ``GreedyProposer``
  feedback): change the option of one table that loads the slowest rank of
  the current best partition.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

from dlrmctl.distributed.types import ShardingType
from dlrmctl.planner.partitioner import Partition
from dlrmctl.planner.types import ShardingOption

Proposal = tuple[tuple[int, ...], str]  #: (option index per table, label)


def fastest_proposal(options: list[list[ShardingOption]]) -> Proposal:
    """Each table's option with the least total work (ties: smaller largest shard)."""
    ch = tuple(min(range(len(o)), key=lambda k: (o[k].total_perf, o[k].max_shard_storage)) for o in options)
    return ch, "least work per table"


def min_memory_proposal(options: list[list[ShardingOption]]) -> Proposal:
    """Each table's option with the smallest largest shard (ties: least work)."""
    ch = tuple(min(range(len(o)), key=lambda k: (o[k].max_shard_storage, o[k].total_perf)) for o in options)
    return ch, "smallest shards per table"


def uniform_proposals(options: list[list[ShardingOption]]) -> list[Proposal]:
    """One proposal per sharding type: every table its fastest option of that type.

    A table that cannot use the type keeps its least-work option.  Only types
    at least one table can use are proposed.
    """
    base, _ = fastest_proposal(options)
    out = []
    for st in ShardingType:
        ch, used = [], False
        for t, o in enumerate(options):
            ks = [k for k in range(len(o)) if o[k].sharding_type == st]
            if ks:
                used = True
                ch.append(min(ks, key=lambda k: o[k].total_perf))
            else:
                ch.append(base[t])
        if used:
            out.append((tuple(ch), f"all {st.value}"))
    return out


def threshold_proposals(options: list[list[ShardingOption]], count: int = 24) -> list[Proposal]:
    """Least-work options under a cap ``T`` on the slowest shard, for ``count`` values of ``T``.

    ``T`` runs over evenly spaced quantiles of all options' ``max_shard_perf``.
    A table with no option under ``T`` takes its option with the smallest
    slowest shard.
    """
    vals = sorted({o.max_shard_perf for opts in options for o in opts})
    if not vals:
        return []
    if len(vals) > count:
        vals = [vals[min(len(vals) - 1, round(i * (len(vals) - 1) / (count - 1)))] for i in range(count)]
    pre = []
    for opts in options:
        order = sorted(range(len(opts)), key=lambda k: (opts[k].total_perf, opts[k].max_shard_perf))
        fallback = min(range(len(opts)), key=lambda k: (opts[k].max_shard_perf, opts[k].total_perf))
        pre.append((order, fallback))
    out = []
    for T in vals:
        ch = []
        for opts, (order, fallback) in zip(options, pre):
            pick = next((k for k in order if opts[k].max_shard_perf <= T), fallback)
            ch.append(pick)
        out.append((tuple(ch), f"slowest shard <= {T * 1e3:.3f} ms"))
    return out


def grid_size(options: list[list[ShardingOption]]) -> int:
    """Number of combinations (product of options per table)."""
    return math.prod(len(o) for o in options)


def grid_proposals(options: list[list[ShardingOption]], limit: int) -> Iterator[Proposal]:
    """Every combination of options when there are at most ``limit``; nothing otherwise."""
    if grid_size(options) > limit:
        return iter(())
    return ((tuple(ch), "grid search") for ch in itertools.product(*[range(len(o)) for o in options]))


def neighbour_proposals(
    options: list[list[ShardingOption]], choice: tuple[int, ...], part: Partition, max_tables: int = 4, max_alts: int = 8
) -> list[Proposal]:
    """Proposals that change one table loading the slowest rank of ``part``.

    Tables are taken by how much time they put on the slowest rank (largest
    first, at most ``max_tables``); each is offered its other options, first
    those whose slowest shard is smaller than what the table puts on that rank
    (least work first), then the rest (they can still help by moving work to
    other ranks), at most ``max_alts``.
    """
    W = len(part.loads)
    a = max(range(W), key=lambda r: part.loads[r])
    contrib = []
    for t, opt in enumerate(part.options):
        x = sum(s.time for s, r in zip(opt.shards, part.ranks[t]) if r == a)
        if x > 0 and len(options[t]) > 1:
            contrib.append((x, t))
    contrib.sort(reverse=True)
    out = []
    for x, t in contrib[:max_tables]:
        alts = sorted(
            (k for k in range(len(options[t])) if k != choice[t]),
            key=lambda k: (options[t][k].max_shard_perf >= x, options[t][k].total_perf),
        )
        for k in alts[:max_alts]:
            ch = list(choice)
            ch[t] = k
            out.append((tuple(ch), f"greedy: {options[t][k].table.name} -> {options[t][k].label()}"))
    return out
