#!/usr/bin/env python
"""Benchmark :class:`dlrmctl.data.loader.BatchLoader` throughput (batches/s, samples/s).

Generates a synthetic Criteo-schema dataset (``--rows``, default 1,000,000) in a temp dir (or
uses ``--data DIR``), then iterates the train split with batch size ``--batch-size`` (default
2048), shuffled and not, with the default prefetch thread.  Target: far above 100k samples/s on
one core, so data loading is never the bottleneck.

With ``--step-ms T`` each batch is followed by a fake training step of T ms, the step time a GPU
would have (1 ms: an H200 on the demo model), and the line gives ``data_wait_share``: the share of
the wall time after the first batch spent waiting for the next batch (0: the loader keeps up; the
first batch's wait, the loader's start and first shuffle window, is given apart).  The step is a
sleep (the host free while the device works) and, separately, a busy loop holding the GIL (the
host busy launching kernels: the loader's threads get the GIL only between bytecodes and in the
calls that release it).

``--workers N`` (default 2) measures each line with the batches made in a thread of the
process (``workers=0``) and in ``N`` worker processes (``workers=N``), one after the other on
the same data: the ratio of the two ``data_wait_share`` is the gain of the processes at this
machine's load.  ``--gil-step`` keeps only the busy (GIL-holding) step.

``--versus DIR`` runs the same measurements, on the same data and in the same run, with the
``dlrmctl`` of another checkout ``DIR`` (e.g. a worktree of an earlier commit) first, so the two
loaders are compared as ratios at the same machine load.

Usage: python scripts/bench_loader.py [--rows N] [--batch-size B] [--data DIR] [--batches K] [--step-ms T]
       [--gil-step] [--workers N] [--versus DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# --versus runs this script again with another checkout's dlrmctl (named by this variable)
sys.path.insert(0, os.environ.get("BENCH_LOADER_DLRMCTL") or str(Path(__file__).resolve().parents[1]))
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
          busy: bool = False, workers: int = 0) -> None:
    kw = {"workers": workers} if workers else {}  # (a --versus checkout may predate workers)
    loader = BatchLoader(data, "train", batch_size, shuffle=shuffle, seed=0, **kw)
    n = samples = 0
    wait = first = 0.0
    t0 = time.perf_counter()
    it = iter(loader)
    while True:
        tw = time.perf_counter()
        b = next(it, None)
        if n == 0:
            first = time.perf_counter() - tw
        else:
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
    step = (f", fake step {step_ms:g} ms ({'busy, GIL held' if busy else 'sleep'}): data_wait_share "
            f"{wait / max(dt - first, 1e-9):.1%}" if step_ms else "")
    print(f"batch {batch_size}, shuffle={shuffle!s:5}, workers={workers}: {n} batches in {dt:.2f} s -> "
          f"{n / dt:,.0f} batches/s, {samples / dt:,.0f} samples/s, first batch {first * 1000:.0f} ms{step}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=400, help="stop after this many batches")
    ap.add_argument("--data", type=Path, default=None, help="existing preprocessed dir (skips generation)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a fake training step after each batch (ms)")
    ap.add_argument("--gil-step", action="store_true", help="only the busy, GIL-holding fake step")
    ap.add_argument("--workers", type=int, default=2, help="worker processes measured next to the thread (0: only it)")
    ap.add_argument("--versus", type=Path, default=None,
                    help="another checkout whose dlrmctl is measured first, on the same data")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as td:
        data = args.data
        if data is None:
            data = Path(td)
            t = time.perf_counter()
            generate_synthetic(data, rows=args.rows, seed=0)
            print(f"generated {args.rows:,} synthetic rows in {time.perf_counter() - t:.1f} s")
        if args.versus is not None:
            cmd = [sys.executable, __file__, "--data", str(data), "--batch-size", str(args.batch_size),
                   "--batches", str(args.batches), "--step-ms", str(args.step_ms), "--workers", "0"]
            cmd += ["--gil-step"] if args.gil_step else []
            print(f"--- dlrmctl of {args.versus}:", flush=True)
            subprocess.run(cmd, env={**os.environ, "BENCH_LOADER_DLRMCTL": str(args.versus.resolve())}, check=True)
            print(f"--- dlrmctl of {Path(__file__).resolve().parents[1]}:", flush=True)
        kinds = [0] + ([args.workers] if args.workers > 0 else [])
        for shuffle in (False, True):
            for workers in kinds:
                if not args.gil_step:
                    bench(data, args.batch_size, shuffle, args.batches, workers=workers)
                if args.step_ms:
                    for busy in ((True,) if args.gil_step else (False, True)):
                        bench(data, args.batch_size, shuffle, args.batches, args.step_ms, busy, workers)

if __name__ == "__main__":
    main()
