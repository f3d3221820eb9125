"""Planner speed benchmark: prints how long planning takes (no assertions; not a test).

Cases:
  1. the 26 MLPerf DLRMv2 (Criteo 1TB) tables, dim 128, multi-hot sizes of the
     MLPerf reference, global batch 65536, on 8 x H100-80GB (target < 2 s);
  2. 1,000 synthetic tables (seeded: rows log-uniform in [10, 5e7], dim in
     {32, 64, 128, 256}, pooling factor 1..40) on 64 x H100 = 8 hosts x 8
     (target < 10 s).

Usage: python scripts/bench_planner.py [--repeat N]
"""

from __future__ import annotations

import argparse
import random
import time

from dlrmctl.distributed.types import ShardingPlan
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.planner.planner import EmbeddingShardingPlanner
from dlrmctl.planner.types import TableSpec, Topology

DLRMV2_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
               11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
DLRMV2_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def dlrmv2_tables() -> list[TableSpec]:
    """The 26 MLPerf DLRMv2 tables (dim 128, pooling factor = multi-hot size)."""
    return [TableSpec(f"t_cat_{i}", n, 128, [float(m)]) for i, (n, m) in enumerate(zip(DLRMV2_ROWS, DLRMV2_MULTI_HOT))]


def synthetic_tables(n: int, seed: int = 0) -> list[TableSpec]:
    """``n`` seeded random tables (see module docstring)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = int(10 ** rng.uniform(1, 7.7))
        out.append(TableSpec(f"t{i}", rows, rng.choice([32, 64, 128, 256]), [float(rng.randint(1, 40))]))
    return out


def run(name: str, tables: list[TableSpec], topo: Topology, batch: int, repeat: int) -> None:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = EmbeddingShardingPlanner(topo, batch).plan(tables)
        best = min(best, time.perf_counter() - t0)
    p = res.partition
    mean = sum(p.loads) / len(p.loads)
    res.plan.validate([EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim)
                       for t in tables], topo.world_size)
    kinds: dict[str, int] = {}
    for ps in res.plan.plan.values():
        kinds[ps.sharding_type.value] = kinds.get(ps.sharding_type.value, 0) + 1
    print(
        f"{name}: {len(tables)} tables on {topo.world_size} ranks: plan in {best:.3f} s (best of {repeat}); "
        f"{res.proposals_evaluated} proposals; step {p.critical_path * 1e3:.3f} ms, balance max/mean "
        f"{p.bandwidth_path / mean:.3f}; max HBM {max(p.mem) / 1e9:.1f} GB; types {kinds}"
    )
    assert isinstance(res.plan, ShardingPlan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    run("dlrmv2 / 8 x h100", dlrmv2_tables(), Topology.from_preset("h100", 8), 65536, a.repeat)
    run("synthetic / 64 x h100", synthetic_tables(1000), Topology.from_preset("h100", 64, 8), 65536, a.repeat)


if __name__ == "__main__":
    main()
