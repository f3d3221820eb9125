"""ms per step of bench_planner_accuracy's all-data_parallel plan, by phase, on N gloo ranks.

Same tables, batch and optimizer (``exact_rowwise_adagrad``, dense kernel) as
``scripts/bench_planner_accuracy.py``; prints per rank the mean ms per step of the
forward, backward, ``sync_replicated_grads`` (the data_parallel gradient sync of
``comm.sync_sparse_grads``), the optimizer step and ``zero_grad``, and the total
(barrier to barrier), next to the planner's estimate of the plan.  On a shared VM the
figures are noisy: run it a few times.

Usage: python scripts/bench_dp_step.py [--nproc 2] [--batch 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_planner_accuracy as B  # noqa: E402


def _worker(env, pd: dict, batch: int, steps: int) -> dict:
    """One rank (:func:`run_local_ranks`: a gloo group, 1 thread): mean ms per step by phase."""
    from dlrmctl.distributed import comm
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    rank, ws = env.rank, env.world_size
    tables = B._tables()
    bl = batch // ws
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.tensor([[p] * bl for p in B.POOLING]).reshape(-1)
    values = torch.cat([torch.randint(0, n, (p * bl,), generator=gen) for n, p in zip(B.ROWS, B.POOLING)])
    kjt = KeyedJaggedTensor([t.name for t in tables], values, lengths=lengths)
    plan = ShardingPlan.from_dict(pd)
    sebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=0, check_ids=False)
    opt = embedding_optimizer_for_dense(sebc.embedding_dense_parameters(), "exact_rowwise_adagrad", 0.01, 1e-8, 0.0)
    ph = dict.fromkeys(("fwd", "bwd", "sync", "opt", "zero"), 0.0)

    def step(acc: dict | None) -> None:
        t = [time.perf_counter()]
        o = sebc(kjt).values()
        t.append(time.perf_counter())
        o.sum().backward()
        t.append(time.perf_counter())
        sebc.sync_replicated_grads()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        opt.zero_grad()
        t.append(time.perf_counter())
        if acc is not None:
            for i, k in enumerate(acc):
                acc[k] += t[i + 1] - t[i]

    for _ in range(2):
        step(None)
    comm.barrier(env.pg)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(ph)
    comm.barrier(env.pg)
    res = {k: v / steps * 1e3 for k, v in ph.items()}
    res["total"] = (time.perf_counter() - t0) / steps * 1e3
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4096, help="global batch")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()

    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.planner.planner import evaluate_plan
    from dlrmctl.planner.types import TableSpec, Topology

    ws = a.nproc
    plan = plan_from_types(B._tables(), "data_parallel", ws, ws)
    specs = [TableSpec(f"t{i}", n, B.DIM, [float(p)]) for i, (n, p) in enumerate(zip(B.ROWS, B.POOLING))]
    est = evaluate_plan(plan, specs, Topology.from_preset("cpu", ws, ws, ddr_gb=4.0), a.batch).critical_path
    from dlrmctl.distributed.local_ranks import run_local_ranks

    got = dict(enumerate(run_local_ranks(_worker, ws, (plan.to_dict(), a.batch, a.steps), timeout_s=1200,
                                         what="bench_dp_step")))
    print(f"all data_parallel, {ws} gloo ranks, global batch {a.batch}, {a.steps} timed steps; "
          f"estimated {est * 1e3:.1f} ms (cpu preset)")
    for r in sorted(got):
        print(f"rank {r}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in got[r].items()))


if __name__ == "__main__":
    main()
