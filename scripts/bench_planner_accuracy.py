"""Planner accuracy on this machine: estimated vs measured embedding step time, per plan.

Runs the sharded EmbeddingBagCollection (``dlrmctl.distributed``) on N gloo
ranks on CPU — what ``dlrmctl train --nproc N`` does — for several plans of
the same tables: the planner's choice (``--device cpu`` preset) and the
uniform plans of ``plan_from_types`` (all table_wise, all row_wise, ...).  For
each it prints the planner's estimated critical path (max over ranks of the
estimated forward + backward compute and communication) and the measured
wall time per step (forward, backward with the fused optimizer, dense-kernel
optimizer step and data-parallel gradient sync; barrier-to-barrier, so the
slowest rank), then whether the estimates order the plans as the
measurements do (Kendall's tau) and where the planner's plan ranks.

Only embeddings are timed (no MLPs, no data loading).  On a shared 2-core VM
the numbers are noisy; what matters is the ordering, not the absolute values.

Plans (at least 6 on 2 ranks): the planner's, every single-type plan the world size
allows, and mixed plans (the heavy tables row_wise + the rest table_wise; the small
tables data_parallel + the rest table_wise).  The estimate is the cost model's
critical path including the fixed per-step latency; ``--topology FILE`` uses a
topology file written by ``dlrmctl plan --calibrate`` (default: the ``cpu`` preset).
The issue's goal: Kendall tau >= 0.8 and measured/estimated within 0.8-1.25x; both
are printed.

Usage: python scripts/bench_planner_accuracy.py [--nproc 2] [--batch 4096] [--steps 10]
       [--topology topo.yaml]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.multiprocessing as mp

ROWS = [100_000, 200_000, 50_000, 1_000, 100, 300_000, 20_000, 10]
POOLING = [1, 4, 20, 1, 2, 8, 30, 1]
DIM = 64


def _tables():
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=DIM) for i, n in enumerate(ROWS)]


def _worker(rank: int, ws: int, port: int, plans: dict, batch: int, steps: int, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.train.optim import embedding_optimizer_for_dense

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=600))
    tables = _tables()
    B = batch // ws
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.tensor([[p] * B for p in POOLING]).reshape(-1)
    values = torch.cat([torch.randint(0, n, (p * B,), generator=gen) for n, p in zip(ROWS, POOLING)])
    kjt = KeyedJaggedTensor([t.name for t in tables], values, lengths=lengths)
    out: dict[str, float] = {}
    for name, pd in plans.items():
        plan = ShardingPlan.from_dict(pd)
        env = ShardingEnv.from_process_group(local_world_size=plan.local_world_size)
        sebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=0, check_ids=False)
        dense = sebc.embedding_dense_parameters()
        opt = embedding_optimizer_for_dense(dense, "exact_rowwise_adagrad", 0.01, 1e-8, 0.0) if dense else None

        def step() -> None:
            o = sebc(kjt).values()
            o.sum().backward()
            sebc.sync_replicated_grads()
            if opt is not None:
                opt.step()
                opt.zero_grad()

        for _ in range(2):
            step()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        out[name] = (time.perf_counter() - t0) / steps
    q.put((rank, out))
    dist.destroy_process_group()


def _kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--local-world-size", type=int, default=None, help="ranks per pretend host (default: nproc)")
    ap.add_argument("--batch", type=int, default=4096, help="global batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--topology", default=None, help="topology file from `dlrmctl plan --calibrate` (default: cpu preset)")
    a = ap.parse_args()

    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.planner.planner import EmbeddingShardingPlanner, evaluate_plan
    from dlrmctl.planner.types import TableSpec, Topology, load_topology_file

    ws, lws = a.nproc, a.local_world_size or a.nproc
    device = load_topology_file(a.topology) if a.topology else "cpu"
    topo = Topology.from_preset(device, ws, lws, ddr_gb=4.0, name=a.topology)
    specs = [TableSpec(f"t{i}", n, DIM, [float(p)]) for i, (n, p) in enumerate(zip(ROWS, POOLING))]
    res = EmbeddingShardingPlanner(topo, a.batch).plan(specs)
    plans = {"planner": res.plan}
    types = ["table_wise", "row_wise", "column_wise", "data_parallel"] + (
        ["table_row_wise", "table_column_wise"] if lws < ws else [])
    for st in types:
        plans[f"all {st}"] = plan_from_types(_tables(), st, ws, lws)
    heavy = {f"t{i}": ("row_wise" if p >= 8 else "table_wise") for i, p in enumerate(POOLING)}
    plans["heavy row_wise"] = plan_from_types(_tables(), heavy, ws, lws)
    small = {f"t{i}": ("data_parallel" if n <= 1_000 else "table_wise") for i, n in enumerate(ROWS)}
    plans["small data_parallel"] = plan_from_types(_tables(), small, ws, lws)  # data_parallel: dense kernel
    parts = {k: evaluate_plan(p, specs, topo, a.batch) for k, p in plans.items()}
    est = {k: p.critical_path for k, p in parts.items()}

    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ws, port, {k: p.to_dict() for k, p in plans.items()},
                                               a.batch, a.steps, q)) for r in range(ws)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    meas = {k: max(got[r][k] for r in got) for k in plans}

    print(f"{ws} gloo ranks ({ws // lws} pretend host(s)), global batch {a.batch}, {len(specs)} tables dim {DIM}, "
          f"{a.steps} timed steps; topology: {a.topology or 'cpu preset'}")
    print(f"{'plan':<22} {'estimated (ms)':>15} {'of which fixed':>15} {'measured (ms)':>14} {'measured/est':>13}")
    for k in plans:
        print(f"{k:<22} {est[k] * 1e3:>15.2f} {parts[k].latency * 1e3:>15.2f} {meas[k] * 1e3:>14.2f} "
              f"{meas[k] / est[k]:>13.2f}")
    keys = list(plans)
    tau = _kendall_tau([est[k] for k in keys], [meas[k] for k in keys])
    order = sorted(keys, key=lambda k: meas[k])
    ratios = [meas[k] / est[k] for k in keys]
    inside = sum(0.8 <= r <= 1.25 for r in ratios)
    print(f"Kendall tau (estimated vs measured ordering of {len(keys)} plans): {tau:.2f} (goal >= 0.8)")
    print(f"measured/estimated {min(ratios):.2f}-{max(ratios):.2f}; {inside} of {len(keys)} plans within 0.8-1.25x")
    print(f"planner's plan is measured #{order.index('planner') + 1} of {len(keys)} (fastest measured: {order[0]})")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
