"""The planner's communication bytes per sharding type equal what the sharded EBC sends.

A 2-rank gloo run of :class:`ShardedEmbeddingBagCollection` per sharding type counts the
bytes each rank hands to the collectives of ``dlrmctl/distributed/comm/`` (the input
dist's data all-to-all, via ``input_dist_bytes``; the float all-to-alls of the output
dist in forward and in backward; the data_parallel gradient all-reduce / all-gathers),
and the test asserts that the perf model's per-shard byte counts
(:func:`dlrmctl.planner.perf.shard_comm_bytes`, through ``evaluate_plan``) sum to exactly
those numbers.  Inputs are fixed so that row-wise bucketizing splits every feature's ids
evenly over the row blocks (the model's expectation is then exact).  Bytes only: no timings.
"""

from __future__ import annotations

import pytest

from dlrmctl.distributed.types import ShardingType
from dlrmctl.planner import perf
from dlrmctl.planner.types import TableSpec, Topology
from tests.dist_utils import run_multiprocess

ST = ShardingType
#: (name, rows, dim, pooling factor): fixed bag sizes; the third is > 8 MiB (sparse data_parallel gradient)
TABLES = [("t0", 1000, 8, 2), ("t1", 100, 16, 4)]
BIG = ("big", 40_000, 64, 2)  # 40,000 x 64 x 4 B = 10.24 MB > DENSE_GRAD_MAX_BYTES
B_LOCAL = 4
CASES = [(st, TABLES) for st in ("table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise",
                                 "data_parallel")] + [("data_parallel", TABLES + [BIG])]


def _ids(rows: int, n: int, rank: int):
    """``n`` ids of a ``rows``-row table, alternating between the two row blocks of 2 ranks
    (half in each block, whatever the rank), distinct per rank."""
    import torch

    half = -(-rows // 2)
    k = torch.arange(n) + rank * n
    return (k % 2) * half + (k // 2) % min(half, rows - half)


def _worker(env, cases):
    import torch
    import torch.distributed as dist

    from dlrmctl.distributed import comm
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.sparse import KeyedJaggedTensor

    phase = ["fwd"]
    counts: dict = {}

    def add(key, t):
        counts[key] = counts.get(key, 0) + t.numel() * t.element_size()

    a2a, allreduce, gather = dist.all_to_all_single, dist.all_reduce, comm.grads.all_gather_flat

    def a2a_count(out, inp, *a, **k):
        if inp.is_floating_point():
            add(("out", phase[0]), inp)
        return a2a(out, inp, *a, **k)

    def allreduce_count(t, *a, **k):
        add(("grad", "all_reduce"), t)
        return allreduce(t, *a, **k)

    def gather_count(out, inp, *a, **k):
        add(("grad", "all_gather"), inp)
        return gather(out, inp, *a, **k)

    dist.all_to_all_single, dist.all_reduce, comm.grads.all_gather_flat = a2a_count, allreduce_count, gather_count
    results = []
    try:
        for st, specs in cases:
            tables = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
                      for n, r, d, _ in specs]
            plan = plan_from_types(tables, st, env.world_size, env.world_size,
                                   compute_kernel="dense" if st == "data_parallel" else "fused")
            sebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=0)
            values = torch.cat([_ids(r, B_LOCAL * p, env.rank) for _, r, _, p in specs])
            lengths = torch.tensor([p for *_, p in specs for _ in range(B_LOCAL)])
            kjt = KeyedJaggedTensor([f"f_{n}" for n, *_ in specs], values, lengths=lengths)
            counts.clear()
            phase[0] = "fwd"
            out = sebc(kjt).values()
            phase[0] = "bwd"
            out.sum().backward()
            sebc.sync_replicated_grads()
            row = dict(counts)
            row["in"] = sebc.input_dist_bytes[1] if st != "data_parallel" else 0
            results.append((st, len(specs), row, plan.to_dict()))
    finally:
        dist.all_to_all_single, dist.all_reduce, comm.grads.all_gather_flat = a2a, allreduce, gather
    return results


@pytest.fixture(scope="module")
def measured():
    return run_multiprocess(_worker, 2, CASES, timeout_s=240)


def _model(st: str, specs, plan_dict) -> dict:
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.planner.planner import evaluate_plan

    W = 2
    topo = Topology.from_preset("cpu", W, W, ddr_gb=4.0)
    tspecs = [TableSpec(n, r, d, [float(p)]) for n, r, d, p in specs]
    part = evaluate_plan(ShardingPlan.from_dict(plan_dict), tspecs, topo, B_LOCAL * W)
    got = {"in": 0, "out": 0, "grad": 0.0}
    for o in part.options:
        for s in o.shards:
            cb = perf.shard_comm_bytes(o.table, o.sharding_type, s.size[1],
                                       len(o.shards) if o.sharding_type in (ST.ROW_WISE, ST.TABLE_ROW_WISE) else 1,
                                       B_LOCAL * W, W)
            if o.sharding_type == ST.DATA_PARALLEL:
                got["grad"] += cb.grad_sync
            else:
                assert (s.input_bytes, s.output_bytes) == (int(cb.input), int(cb.output))
                got["in"] += s.input_bytes
                got["out"] += s.output_bytes
    return got


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{st}-{len(t)}tables" for st, t in CASES])
def test_planner_bytes_equal_the_bytes_each_sharding_type_sends(measured, case):
    per_rank = [m[case] for m in measured]
    st, _, _, plan_dict = per_rank[0]
    specs = CASES[case][1]
    model = _model(st, specs, plan_dict)
    total = {}
    for _, _, row, _ in per_rank:
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    # input dist: every rank's data all-to-all (lengths + ids, int32) = sum of the shards' input bytes
    assert total["in"] == model["in"]
    # output dist: pooled fp32 blocks forward, the same bytes back in backward
    assert total.get(("out", "fwd"), 0) == model["out"]
    assert total.get(("out", "bwd"), 0) == model["out"]
    grad = total.get(("grad", "all_reduce"), 0) + total.get(("grad", "all_gather"), 0)
    assert grad == pytest.approx(model["grad"], abs=0)
    if st == "data_parallel":
        assert model["out"] == model["in"] == 0 and grad > 0
        # small tables densified and all-reduced, the > 8 MiB one all-gathered as sparse rows
        assert (("grad", "all_gather") in total) == any(r * d * 4 > perf.DENSE_GRAD_MAX_BYTES for _, r, d, _ in specs)
    else:
        assert model["in"] > 0 and model["out"] > 0 and grad == 0


def test_planner_constants_match_the_implementation():
    from dlrmctl.distributed.comm import DENSE_GRAD_MAX_BYTES

    assert perf.DENSE_GRAD_MAX_BYTES == DENSE_GRAD_MAX_BYTES
