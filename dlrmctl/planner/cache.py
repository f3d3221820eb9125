"""The last-level cache term of the planner's perf model: which fraction of a shard's reads hit
the cache (CPU L3 / GPU L2) and how much faster those run.

**Cache** (:func:`cache_hit_fractions`).  A shard whose rows sit in the last-level cache
(CPU L3 / GPU L2, ``Topology.llc_bytes``) looks up and updates faster than one in DRAM /
HBM: the bench tables of ``scripts/bench_planner_accuracy.py`` that fit the dev VM's
32 MiB L3 (``t2``, ``t6``) ran 2-3x faster than the DRAM model charged.  Every compute
term above (forward, backward, per-id, dense optimizer pass) of a shard with hit fraction
``h`` is scaled by::

    (1 - h) + h / s_k          # s_k = Topology.cache_speedup[kernel] (plan --calibrate:
                               # step time on a DRAM table / on a table that fits the cache)

i.e. a hit costs ``1/s_k`` of a miss; communication is not scaled.  ``h`` is the LRU hit
probability of the shard's rows under Che's approximation (H. Che, Y. Tung, Z. Wang,
"Hierarchical Web caching systems: modeling, design and experimental results", IEEE JSAC
20(7), 2002; for variable-size items as in C. Fricker, P. Robert, J. Roberts, "A versatile
and accurate approximation for LRU cache performance", ITC 24, 2012) with the independent
reference model: every shard ``s`` sharing the cache is ``n_s`` rows of ``b_s`` bytes
(``max(cols*bpw + optimizer state per row, m)``), each read ``lambda_s = ids_s / n_s`` times
per step (ids uniform over the rows, as the bench draws them); the cache's characteristic
time ``T`` solves ``sum_s n_s*b_s*(1 - exp(-lambda_s*T)) = C`` and ``h_s = 1 -
exp(-lambda_s*T)`` (all ``h_s = 1`` when the shards' bytes fit ``C``).  Hot rows of small,
often-read tables stay resident; a large, rarely-read table gets what is left.  Which
shards share one cache (``Topology.cache_domain``): on cpu all shards of all ranks of one
host (one L3), on cuda the shards of one rank (its GPU's L2).  Not modelled: ids, pooled
outputs, gradients and the dense model also occupying the cache, and skewed (non-uniform)
id distributions (which raise the hit fraction).

Before placement (the planner's enumeration) the ranks of each shard are not known:
:func:`cache_hit_prior` gives each table the hit fraction it would have with every table
spread evenly over all caches (``num_cache_domains * C`` shared by all tables, each once).
:func:`dlrmctl.planner.planner.evaluate_plan` re-estimates a placed plan with
:func:`cache_hit_fractions` per cache domain (data_parallel replicas each occupy their
rank's cache); the planner makes its final choice among its best placements, and
reports the step time, that way (``planner.RERANK``).
"""

from __future__ import annotations

import math
from typing import Sequence

from dlrmctl.distributed.types import ComputeKernel
from dlrmctl.planner.comm_bytes import ROW_TYPES, shard_comm_bytes
from dlrmctl.planner.storage import optimizer_state_bytes
from dlrmctl.planner.types import TableSpec, Topology

#: smallest bytes a row read moves: TorchRec's ``max(emb_dim, 32)`` fp32 elements on cuda, a cache
#: line on cpu (``m`` in the formulas)
MIN_ROW_READ_BYTES = {"cuda": 128, "cpu": 64}

#: (step time of a lookup + backward + update on a table in DRAM / HBM) / (the same on a table that fits the
#: last-level cache), per device and kernel (``Topology.cache_speedup`` overrides it).  cpu: ``plan
#: --calibrate``'s cache pair on the dev VM (2048 bags x 20 ids, dim 64, 128 MB vs 8 MiB table, exact row-wise
#: Adagrad, 1 thread, medians of 5 repeats, corrected for the big table's own hits: fused 1.70, dense 1.46;
#: 2026-12-01, one calibration on a loaded 2-core machine, load average 3.3).  cuda: 1.0 = no cache term (an
#: L2-resident TBE speedup has not been measured on a GPU here).
DEFAULT_CACHE_SPEEDUP: dict[tuple[str, ComputeKernel], float] = {
    ("cuda", ComputeKernel.FUSED): 1.0, ("cuda", ComputeKernel.DENSE): 1.0,  # no cache term measured on a GPU
    ("cpu", ComputeKernel.FUSED): 1.7, ("cpu", ComputeKernel.DENSE): 1.46}


def cache_speedup(topology: Topology, kernel: ComputeKernel) -> float:
    """DRAM / in-cache step-time ratio of ``kernel``: ``topology.cache_speedup`` (calibrated) or the default."""
    return topology.cache_speedup.get(kernel.value, DEFAULT_CACHE_SPEEDUP[(topology.compute_device, kernel)])


def che_hit_fractions(rows: Sequence[float], row_bytes: Sequence[float], accesses: Sequence[float],
                      cache_bytes: float) -> list[float]:
    """LRU hit probability of each group of rows sharing one cache (Che's approximation; module docstring).

    Args:
        rows: rows of each group (a shard), > 0.
        row_bytes: bytes one row occupies in the cache.
        accesses: reads of the group per step (ids looked up); only the ratio between groups matters.
        cache_bytes: cache capacity ``C``, bytes.

    Returns:
        per group, the fraction of its reads that hit (0..1): all 1 when the groups' bytes fit
        ``C``; 0 for a group never read; ``T`` found by bisection to 1e-9 relative.
    """
    n = len(rows)
    if cache_bytes <= 0:
        return [0.0] * n
    size = [r * b for r, b in zip(rows, row_bytes)]
    if sum(size) <= cache_bytes:
        return [1.0] * n
    lam = [a / r if r > 0 else 0.0 for a, r in zip(accesses, rows)]

    def occupancy(T: float) -> float:
        return sum(sz * -math.expm1(-l * T) for sz, l in zip(size, lam) if l > 0)

    if occupancy(math.inf) <= cache_bytes:  # the groups ever read fit: they all hit
        return [1.0 if l > 0 else 0.0 for l in lam]
    lo, hi = 0.0, 1.0 / max(lam)
    while occupancy(hi) < cache_bytes:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if occupancy(mid) < cache_bytes:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    T = 0.5 * (lo + hi)
    return [-math.expm1(-l * T) for l in lam]


def cache_row_bytes(topology: Topology, table: TableSpec, cols: int) -> float:
    """Bytes one row of a ``cols``-wide shard of ``table`` occupies in the cache: the weights plus the
    optimizer state per row, at least one smallest read ``m`` (``MIN_ROW_READ_BYTES``)."""
    state = optimizer_state_bytes(table.optimizer, 1, cols)
    return float(max(cols * table.weight_bytes + state, MIN_ROW_READ_BYTES[topology.compute_device]))


def cache_hit_prior(topology: Topology, tables: Sequence[TableSpec], batch_size: int) -> dict[str, float]:
    """Per table name, the hit fraction before placement: every table's rows once, all ids of a step,
    sharing all ``num_cache_domains`` caches as one (module docstring).  ``{}``-like all zeros when
    the topology models no cache (``llc_bytes == 0``)."""
    if topology.llc_bytes <= 0:
        return {t.name: 0.0 for t in tables}
    h = che_hit_fractions([t.num_embeddings for t in tables],
                          [cache_row_bytes(topology, t, t.embedding_dim) for t in tables],
                          [batch_size * t.ids_per_sample for t in tables],
                          float(topology.llc_bytes) * topology.num_cache_domains)
    return {t.name: x for t, x in zip(tables, h)}


def cache_hit_fractions(topology: Topology, options: Sequence, ranks: Sequence[Sequence[int | None]],
                        batch_size: int) -> list[list[float]]:
    """Per option, per shard: the hit fraction of a placed plan, shards grouped by cache domain.

    Args:
        options: one :class:`~dlrmctl.planner.types.ShardingOption` per table.
        ranks: per option, the rank of each shard (``None``: unplaced, hit 0).

    Returns:
        ``hits[i][j]`` for shard ``j`` of option ``i`` (module docstring: Che's approximation over
        all shards sharing the cache of ``topology.cache_domain(rank)``).
    """
    W = topology.world_size
    out = [[0.0] * len(o.shards) for o in options]
    if topology.llc_bytes <= 0:
        return out
    groups: dict[int, list[tuple[int, int, float, float, float]]] = {}
    for i, (o, rk) in enumerate(zip(options, ranks)):
        n_row = len(o.shards) if o.sharding_type in ROW_TYPES else 1
        for j, (s, r) in enumerate(zip(o.shards, rk)):
            if r is None or s.size[0] == 0:
                continue
            ids = shard_comm_bytes(o.table, o.sharding_type, s.size[1], n_row, batch_size, W).ids
            groups.setdefault(topology.cache_domain(r), []).append(
                (i, j, float(s.size[0]), cache_row_bytes(topology, o.table, s.size[1]), ids))
    for g in groups.values():
        h = che_hit_fractions([x[2] for x in g], [x[3] for x in g], [x[4] for x in g], float(topology.llc_bytes))
        for (i, j, *_), x in zip(g, h):
            out[i][j] = x
    return out
