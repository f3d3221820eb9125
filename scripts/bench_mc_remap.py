"""Time the training remap of one managed-collision table: the incremental step (topk eviction,
sorted ids merged) against the full sort of every row, in one run.

    python scripts/bench_mc_remap.py [--sizes 2000 100000] [--ids 128] [--steps 200]

Each remapper is first filled (evicting from then on), then timed for ``--steps`` steps of
``--ids`` Zipf-drawn raw ids, one thread; prints ms per step and the ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dlrmctl.modules.managed_collision import ManagedCollisionRemapper


def time_remap(size: int, policy: str, incremental: bool, batches: list[torch.Tensor], warm: int) -> float:
    m = ManagedCollisionRemapper(size, policy)
    m.incremental = incremental
    for b in batches[:warm]:
        m.remap_train(b)
    t0 = time.perf_counter()
    for b in batches[warm:]:
        m.remap_train(b)
    return (time.perf_counter() - t0) / (len(batches) - warm) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 100000])
    p.add_argument("--ids", type=int, default=128, help="ids per step")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    a = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("| N | policy | full sort (ms/step) | incremental (ms/step) | ratio |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for size in a.sizes:
        warm = 2 * size // a.ids + 10  # enough distinct ids to fill the table first
        batches = [torch.from_numpy(rng.zipf(1.05, a.ids).astype(np.int64) * 7919 + rng.integers(0, 1 << 40))
                   for _ in range(warm + a.steps)]
        for policy in ("lfu", "lru"):
            full = time_remap(size, policy, False, batches, warm)
            inc = time_remap(size, policy, True, batches, warm)
            print(f"| {size:,} | {policy} | {full:.2f} | {inc:.2f} | {full / inc:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
