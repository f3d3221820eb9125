#!/usr/bin/env python
"""Benchmark :class:`dlrmctl.data.loader.BatchLoader` throughput (batches/s, samples/s).

Generates a synthetic Criteo-schema dataset (``--rows``, default 1,000,000) in a temp dir (or
uses ``--data DIR``), then iterates the train split with batch size ``--batch-size`` (default
2048), shuffled and not, with the default prefetch thread.  Target: far above 100k samples/s on
one core, so data loading is never the bottleneck.

With ``--step-ms T`` each batch is followed by a fake training step of T ms, the step time a GPU
would have (1 ms: an H200 on the demo model), and the line gives ``data_wait_share``: the share of
the wall time spent waiting for the next batch (0: the loader keeps up).  The step is a sleep (the
host free while the device works) and, separately, a busy loop holding the GIL (the host busy
launching kernels: the loader thread gets the GIL only between bytecodes).

Usage: python scripts/bench_loader.py [--rows N] [--batch-size B] [--data DIR] [--batches K] [--step-ms T]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlrmctl.data.loader import BatchLoader  # noqa: E402
from dlrmctl.data.synthetic import generate_synthetic  # noqa: E402


def _fake_step(step_s: float, busy: bool) -> None:
    if not busy:
        time.sleep(step_s)
        return
    end = time.perf_counter() + step_s
    while time.perf_counter() < end:  # holds the GIL like a host launching kernels
        pass


def bench(data: Path, batch_size: int, shuffle: bool, max_batches: int, step_ms: float = 0.0,
          busy: bool = False) -> None:
    loader = BatchLoader(data, "train", batch_size, shuffle=shuffle, seed=0)
    n = samples = 0
    wait = 0.0
    t0 = time.perf_counter()
    it = iter(loader)
    while True:
        tw = time.perf_counter()
        b = next(it, None)
        wait += time.perf_counter() - tw
        if b is None:
            break
        n += 1
        samples += b.batch_size
        if step_ms:
            _fake_step(step_ms / 1000, busy)
        if n >= max_batches:
            break
    dt = time.perf_counter() - t0
    step = f", fake step {step_ms:g} ms ({'busy, GIL held' if busy else 'sleep'}): data_wait_share {wait / dt:.1%}" \
        if step_ms else ""
    print(f"batch {batch_size}, shuffle={shuffle!s:5}: {n} batches in {dt:.2f} s -> "
          f"{n / dt:,.0f} batches/s, {samples / dt:,.0f} samples/s{step}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=400, help="stop after this many batches")
    ap.add_argument("--data", type=Path, default=None, help="existing preprocessed dir (skips generation)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a fake training step after each batch (ms)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as td:
        data = args.data
        if data is None:
            data = Path(td)
            t = time.perf_counter()
            generate_synthetic(data, rows=args.rows, seed=0)
            print(f"generated {args.rows:,} synthetic rows in {time.perf_counter() - t:.1f} s")
        for shuffle in (False, True):
            bench(data, args.batch_size, shuffle, args.batches)
            if args.step_ms:
                for busy in (False, True):
                    bench(data, args.batch_size, shuffle, args.batches, args.step_ms, busy)


if __name__ == "__main__":
    main()
