#!/usr/bin/env python
"""Distributed evaluation: seconds and peak RSS per rank vs local and total rows (issue 13).

    python scripts/bench_eval.py [--rows 5000000] [--ctr 0.25] [--seed 0]

Runs :func:`dlrmctl.metrics.compute_metrics_from_logits` with a gloo process group (what
``Trainer.evaluate`` calls after its forward passes) on synthetic float32 logits and labels (the
``[n_local, 2]`` float32 rows ``Trainer.evaluate`` holds; labels ~ Bernoulli(``--ctr``), logits
``2·(label - ctr) + N(0, 1.5²)``, so AUC ≈ 0.83), in four configurations:

* 2 ranks × ROWS/2 (ROWS in total), 2 ranks × ROWS/4 (ROWS/2 in total): RSS per rank follows
  the LOCAL rows;
* 1 rank × ROWS/2 (same local rows as the first line, half the total): RSS equals the first
  line's, i.e. does not depend on the total;
* 1 rank × ROWS: what a rank held when evaluation gathered every row to rank 0.

Every rank is a fresh ``spawn`` process (torch imported once in it).  Columns: seconds of the
metrics call (slowest rank), the rank's peak RSS (``ru_maxrss``, MB = 10^6 bytes), the peak's
increase over the RSS before the rows were made (``Δ MB``: the rows plus everything the metrics
need), and that increase in bytes per local row.  All ranks of a configuration must return the
same metrics (checked), and each configuration's AUC is printed.

Timings depend on the machine and its load (on a shared VM they are noisy); RSS does not.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # Linux: KB


def _rank(env, n_local: int, ctr: float, seed: int) -> tuple:
    """One rank (:func:`run_local_ranks`, 1 thread): ``(metrics, seconds, base_mb, peak_mb)``; a
    one-rank run evaluates without a process group (the single-process path)."""
    import numpy as np
    import torch

    from dlrmctl.metrics import compute_metrics_from_logits

    pg = env.pg if env.world_size > 1 else None
    base = _rss_mb()
    rows = np.empty((n_local, 2), dtype=np.float32)  # [logit, label], as Trainer.evaluate holds them
    rng = np.random.default_rng([seed, env.rank])
    for s in range(0, n_local, 1 << 20):
        e = min(n_local, s + (1 << 20))
        y = rng.random(e - s) < ctr
        rows[s:e, 1] = y
        rows[s:e, 0] = 2.0 * (y - ctr) + rng.normal(0.0, 1.5, e - s)
    t0 = time.perf_counter()
    m = compute_metrics_from_logits(rows[:, 0], rows[:, 1], pg=pg, device=torch.device("cpu"))
    sec = time.perf_counter() - t0
    return m, sec, base, _rss_mb()


def run(world: int, total: int, ctr: float, seed: int) -> list[tuple]:
    """``[(metrics, seconds, base_mb, peak_mb)]`` per rank of one configuration."""
    from dlrmctl.distributed.local_ranks import run_local_ranks

    return run_local_ranks(_rank, world, (total // world, ctr, seed), timeout_s=900, what="bench_eval")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5_000_000, help="total rows of the largest configuration")
    ap.add_argument("--ctr", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = args.rows
    configs = [(2, n), (2, n // 2), (1, n // 2), (1, n)]
    print(f"{'ranks':>5} {'total rows':>11} {'local rows':>11} {'seconds':>8} {'peak RSS MB/rank':>17} "
          f"{'Δ MB/rank':>10} {'B/local row':>11} {'AUC':>8}")
    for world, total in configs:
        res = run(world, total, args.ctr, args.seed)
        metrics = [r[0] for r in res]
        if any(m != metrics[0] for m in metrics):
            print(f"ranks disagree: {metrics}", file=sys.stderr)
            return 1
        sec = max(r[1] for r in res)
        peak = "/".join(f"{r[3]:.0f}" for r in res)
        delta = [r[3] - r[2] for r in res]
        local = total // world
        print(f"{world:>5} {total:>11,} {local:>11,} {sec:>8.2f} {peak:>17} "
              f"{'/'.join(f'{d:.0f}' for d in delta):>10} {max(delta) * 1e6 / local:>11.1f} "
              f"{metrics[0]['auc']:>8.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
