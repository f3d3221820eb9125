"""Planner accuracy on this machine: estimated vs measured embedding step time, per plan.

Runs the sharded EmbeddingBagCollection (``dlrmctl.distributed``) on N gloo
ranks on CPU — what ``dlrmctl train --nproc N`` does — for several plans of
the same tables: the planner's choice (on the same topology) and the
uniform plans of ``plan_from_types`` (all table_wise, all row_wise, ...).  For
each it prints the estimate (``evaluate_plan``: the critical path = max over ranks
of the estimated forward + backward compute and communication, with the cache hits
of the placed shards, plus the fixed per-step latency; the planner reports this
same figure for its own plan, and the script prints both) and the measured time
per step (forward, backward with the fused optimizer, dense-kernel optimizer step
and data-parallel gradient sync), then whether the estimates order the plans as
the measurements do (Kendall's tau) and where the planner's plan ranks.

Measurement: all plans' modules are built first; each gets ``--warmup`` untimed
steps (first touch of the tables' pages: the first fused backward calls of a large
table are several times slower), then ``--windows`` rounds run every plan in turn
(one untimed step, a barrier, ``--steps`` timed steps): a load change on the machine
hits every plan alike.  Each rank times its window before the closing barrier; a
window's time is the slowest rank's; the measured step time is the median over the
windows (their min-max is printed).  All plans' tables are held at once (about 0.7 GB
of weights per rank on 2 ranks).  Without FBGEMM every plan and estimate uses the dense kernel (the EBC
would otherwise run ``dense`` where the plan and the estimate say ``fused``).

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
       [--windows 5] [--warmup 5] [--topology topo.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ROWS = [100_000, 200_000, 50_000, 1_000, 100, 300_000, 20_000, 10]
POOLING = [1, 4, 20, 1, 2, 8, 30, 1]
DIM = 64


def _tables():
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=DIM) for i, n in enumerate(ROWS)]


def _worker(env0, plans: dict, batch: int, steps: int, windows: int, warmup: int) -> dict[str, list[float]]:
    """One rank (:func:`run_local_ranks`: a gloo group, 1 thread): per plan, seconds per step of
    each timed window."""
    from dlrmctl.distributed.comm import barrier
    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    rank, ws = env0.rank, env0.world_size
    tables = _tables()
    B = batch // ws
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.tensor([[p] * B for p in POOLING]).reshape(-1)
    values = torch.cat([torch.randint(0, n, (p * B,), generator=gen) for n, p in zip(ROWS, POOLING)])
    kjt = KeyedJaggedTensor([t.name for t in tables], values, lengths=lengths)

    def make_step(pd: dict):
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

        return step

    fns = {name: make_step(pd) for name, pd in plans.items()}
    for fn in fns.values():  # first touch of the tables' pages, lazy init (calibrate.measure_lookup's warm-up)
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(windows):
        for name, fn in fns.items():  # interleaved: a load change on the machine hits every plan alike
            fn()  # untimed: this plan's rows back in the cache after the previous plan's window
            barrier(env0.pg)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            out[name].append((time.perf_counter() - t0) / steps)  # this rank's time, before the closing barrier
            barrier(env0.pg)
    return out


def measured_step_time(per_rank: dict[int, list[float]]) -> tuple[float, float, float]:
    """The robust measured step time of one plan.

    Args:
        per_rank: per rank, seconds per step of each timed window (same window count on every rank).

    Returns:
        ``(median, min, max)`` over the windows of the slowest rank's seconds per step in that
        window (the step waits for the slowest rank; the median keeps one disturbed window out).

    Raises:
        ValueError: no windows, or ranks with different window counts.
    """
    counts = {len(v) for v in per_rank.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every rank needs the same number (>= 1) of timed windows, got {sorted(counts)}")
    worst = [max(v[i] for v in per_rank.values()) for i in range(counts.pop())]
    return statistics.median(worst), min(worst), max(worst)


def _kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def build_plans(ws: int, lws: int, batch: int, topology_file: str | None, dense_only: bool = False):
    """The plans to compare and their estimates, computed as the planner ranks plans.

    Every estimate is ``evaluate_plan`` on the planner's own topology object (same per-op
    latencies, sharding-group cost, world size and global ``batch``), which is also how the
    planner makes its final choice and what it reports (``PlanResult.step_time_ms``).

    Args:
        dense_only: FBGEMM absent: every table is planned and run with the dense kernel (the
            EBC would silently run ``dense`` where a plan says ``fused``).

    Returns:
        ``(plans, parts, specs, topology, planner_result)``: plans by name, their
        ``evaluate_plan`` partitions (``critical_path`` = estimate, seconds).

    Raises:
        SystemExit: ``batch`` not a multiple of ``ws`` (each rank runs ``batch // ws`` samples,
            the estimate would be for another batch).
    """
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.types import ComputeKernel
    from dlrmctl.planner.planner import EmbeddingShardingPlanner, evaluate_plan
    from dlrmctl.planner.types import TableSpec, Topology

    if batch % ws:
        raise SystemExit(f"--batch {batch} must be a multiple of --nproc {ws}: each rank runs batch / nproc samples")
    topo = Topology.from_device_or_file("cpu", topology_file, ws, lws, ddr_gb=4.0)
    kernels = [ComputeKernel.DENSE] if dense_only else None
    kernel = ComputeKernel.DENSE if dense_only else ComputeKernel.FUSED
    specs = [TableSpec(f"t{i}", n, DIM, [float(p)], compute_kernels=kernels) for i, (n, p) in enumerate(zip(ROWS, POOLING))]
    res = EmbeddingShardingPlanner(topo, batch).plan(specs)
    plans = {"planner": res.plan}
    types = ["table_wise", "row_wise", "column_wise", "data_parallel"] + (
        ["table_row_wise", "table_column_wise"] if lws < ws else [])
    for st in types:
        plans[f"all {st}"] = plan_from_types(_tables(), st, ws, lws, compute_kernel=kernel)
    heavy = {f"t{i}": ("row_wise" if p >= 8 else "table_wise") for i, p in enumerate(POOLING)}
    plans["heavy row_wise"] = plan_from_types(_tables(), heavy, ws, lws, compute_kernel=kernel)
    small = {f"t{i}": ("data_parallel" if n <= 1_000 else "table_wise") for i, n in enumerate(ROWS)}
    plans["small data_parallel"] = plan_from_types(_tables(), small, ws, lws, compute_kernel=kernel)  # DP: dense kernel
    parts = {k: evaluate_plan(p, specs, topo, batch) for k, p in plans.items()}
    return plans, parts, specs, topo, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--local-world-size", type=int, default=None, help="ranks per pretend host (default: nproc)")
    ap.add_argument("--batch", type=int, default=4096, help="global batch (a multiple of --nproc)")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows per plan (the median is reported)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per plan before the first window")
    ap.add_argument("--topology", default=None, help="topology file from `dlrmctl plan --calibrate` (default: cpu preset)")
    a = ap.parse_args()
    if min(a.steps, a.windows) < 1 or a.warmup < 0:
        raise SystemExit("--steps and --windows must be >= 1, --warmup >= 0")

    from dlrmctl import _fbgemm

    dense_only = not _fbgemm.ensure_checked()
    ws, lws = a.nproc, a.local_world_size or a.nproc
    plans, parts, specs, topo, res = build_plans(ws, lws, a.batch, a.topology, dense_only)
    est = {k: p.critical_path for k, p in parts.items()}

    from dlrmctl.distributed.local_ranks import run_local_ranks

    got = dict(enumerate(run_local_ranks(_worker, ws, ({k: p.to_dict() for k, p in plans.items()}, a.batch,
                                                        a.steps, a.windows, a.warmup),
                                         timeout_s=1800, what="bench_planner_accuracy")))
    stats = {k: measured_step_time({r: got[r][k] for r in got}) for k in plans}
    meas = {k: v[0] for k, v in stats.items()}

    print(f"{ws} gloo ranks ({ws // lws} pretend host(s)), global batch {a.batch}, {len(specs)} tables dim {DIM}"
          f"{' (dense kernel: no FBGEMM)' if dense_only else ''}; {a.warmup} warm-up steps, {a.windows} windows x "
          f"{a.steps} steps per plan, interleaved; measured = median over the windows of the slowest rank's "
          f"ms per step; topology: {a.topology or 'cpu preset'}")
    print(f"planner's reported estimate {res.step_time_ms:.3f} ms, evaluate_plan of its plan "
          f"{est['planner'] * 1e3:.3f} ms")
    print(f"{'plan':<22} {'estimated (ms)':>15} {'of which fixed':>15} {'measured (ms)':>14} {'windows min-max':>16} "
          f"{'measured/est':>13}")
    for k in plans:
        lo, hi = stats[k][1], stats[k][2]
        print(f"{k:<22} {est[k] * 1e3:>15.2f} {parts[k].latency * 1e3:>15.2f} {meas[k] * 1e3:>14.2f} "
              f"{f'{lo * 1e3:.2f}-{hi * 1e3:.2f}':>16} {meas[k] / est[k]:>13.2f}")
    keys = list(plans)
    tau = _kendall_tau([est[k] for k in keys], [meas[k] for k in keys])
    order = sorted(keys, key=lambda k: meas[k])
    ratios = [meas[k] / est[k] for k in keys]
    inside = sum(0.8 <= r <= 1.25 for r in ratios)
    print(f"Kendall tau (estimated vs measured ordering of {len(keys)} plans): {tau:.2f} (goal >= 0.8)")
    print(f"measured/estimated {min(ratios):.2f}-{max(ratios):.2f}; {inside} of {len(keys)} plans within 0.8-1.25x")
    print(f"planner's plan is measured #{order.index('planner') + 1} of {len(keys)} (fastest measured: {order[0]})")


if __name__ == "__main__":
    main()
