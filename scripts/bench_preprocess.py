#!/usr/bin/env python
"""Benchmark ``dlrmctl preprocess criteo`` (and ``preprocess logs`` on the same lines): rows/s per core
and peak RSS, vocabulary and hashing modes.

Input: existing Criteo files (``--input``: a file, directory or glob, e.g. ``day_*`` files made
by ``scripts/bench_scale.py``), or ``--rows`` (default 1,000,000) generated lines (40
tab-separated fields, ~20 % empty dense fields, some negative integers, 10 % empty
categoricals, Zipf(1.2) ids over 10..10^6 distinct values per feature), split into
``--files`` files.

Each mode runs in a fresh child process (``--modes``, default ``vocab,hash``):

* ``vocab``: vocabulary mode, ``--threshold`` (default 3): a count pass, the feature-by-feature
  merge, then the transform pass;
* ``hash``: hashing mode, ``--num-embeddings`` (default 100000) for every feature;
* ``logs-vocab``, ``logs-hash``: the same lines through ``preprocess logs`` with
  ``configs/schemas/criteo.yaml`` (vocabulary, ``min_count`` = ``--threshold``), or with every
  categorical ``hash: --num-embeddings`` (the raw-id hash); with both a Criteo mode and its logs
  mode, their ratio (rows per CPU second) is printed.

Printed per mode: rows, wall seconds, rows/s end to end, rows/s per core (end to end / the
number of worker processes used = min(--workers, files)), rows per CPU second (user + sys of the
run and its workers: the per-core rate a loaded machine's wall clock hides; start-up and imports
included), the steady rate inside the workers of
the transform pass, the peak RSS of the main process and the largest peak RSS of any worker
(the main process: ``VmHWM`` of ``/proc/self/status`` where there is one -- Linux carries
``ru_maxrss`` across ``exec``, so it would report the generating parent's peak --, else
``getrusage`` ``ru_maxrss``; workers: ``ru_maxrss`` of the children).
Goals (issue 13): >= 300k rows/s per core with vocabulary; hashing >= 650k rows/s per core.

With ``--rounds R`` the modes run in turn R times on the same input (vocab, logs-vocab, hash,
logs-hash, vocab, ...), each round printing its ratios and the load, then the range over the rounds.

Usage: python scripts/bench_preprocess.py [--rows N | --input PATH] [--files F] [--workers W]
       [--modes vocab,hash] [--threshold T] [--workdir DIR] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _hex8(ids: np.ndarray) -> pa.Array:
    """uint32 ``[n]`` -> string array of 8 lowercase hex digits each (vectorised)."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    chars = digits[(ids.astype(np.uint64)[:, None] >> shifts) & np.uint64(15)]
    n = len(ids)
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32).tobytes())
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(chars.tobytes()))


def make_tsv(path: Path, rows: int, seed: int = 0) -> None:
    """Write ``rows`` synthetic Criteo lines to ``path`` (vectorised, via pyarrow's CSV writer)."""
    rng = np.random.default_rng(seed)
    null = pa.scalar(None, pa.string())
    cols = {"label": pc.cast(pa.array(rng.integers(0, 2, rows)), pa.string())}
    for i in range(13):
        v = pc.cast(pa.array(rng.geometric(0.05, rows) - 2), pa.string())  # includes -1 (like I2)
        cols[f"I{i + 1}"] = pc.if_else(pa.array(rng.random(rows) < 0.2), null, v)
    for i in range(26):
        card = int(10 ** rng.uniform(1, 6))
        ids = (rng.zipf(1.2, rows) % card) * 2654435761 % (1 << 32)
        cols[f"C{i + 1}"] = pc.if_else(pa.array(rng.random(rows) < 0.1), null, _hex8(ids))
    pa_csv.write_csv(pa.table(cols), str(path),
                     pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))


def _own_peak_rss() -> int | None:
    """This process's own peak RSS in bytes (``VmHWM``: the high-water mark of this process image,
    which ``ru_maxrss`` is not after an ``exec``), or None without ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _run_one(args: argparse.Namespace) -> None:
    """Child: one preprocess run; prints a JSON line with its figures."""
    from dlrmctl.data.criteo.parse import CriteoOptions, expand_inputs
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    files = expand_inputs(args.input)
    if args.one.startswith("logs"):
        import dataclasses

        from dlrmctl.data.logs import LogOptions, load_schema, preprocess_logs

        schema = load_schema(Path(__file__).resolve().parents[1] / "configs" / "schemas" / "criteo.yaml")
        cats = tuple(dataclasses.replace(c, min_count=args.threshold) if args.one == "logs-vocab" else
                     dataclasses.replace(c, mode="hash", buckets=args.num_embeddings) for c in schema.categorical)
        schema = dataclasses.replace(schema, categorical=cats)
        run = lambda out: preprocess_logs(schema, args.input, out, LogOptions(val_ratio=0.1, workers=args.workers),
                                          progress=False)
    elif args.one == "vocab":
        opts = CriteoOptions(frequency_threshold=args.threshold, val_ratio=0.1, workers=args.workers)
    else:
        opts = CriteoOptions(num_embeddings=[args.num_embeddings] * 26, val_ratio=0.1, workers=args.workers)
    if not args.one.startswith("logs"):
        run = lambda out: preprocess_criteo(args.input, out, opts, progress=False)  # noqa: E731
    out = Path(args.out)
    t = time.perf_counter()
    rep = run(out)
    wall = time.perf_counter() - t
    done = [json.loads(p.read_text()) for p in (out / "parts").glob("*/done.json")]
    kb = 1024 if sys.platform != "darwin" else 1  # ru_maxrss: KiB on Linux, bytes on macOS
    print(json.dumps({
        "rows": sum(rep.rows.values()), "wall": wall, "inner": sum(d["seconds"] for d in done),
        "procs": min(args.workers, len(files)),
        "cpu": sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime")),
        "rss_main": _own_peak_rss() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kb,
        "rss_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kb,
        "vocab": [f.get("num_embeddings") for f in json.loads((out / "meta.json").read_text())["sparse_features"]],
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="generated lines (without --input)")
    ap.add_argument("--input", help="existing Criteo file, directory or glob (skips generation)")
    ap.add_argument("--files", type=int, default=1, help="generated input split into this many files")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--modes", default="vocab,hash", help="comma list of vocab, hash, logs-vocab, logs-hash")
    ap.add_argument("--threshold", type=int, default=3, help="vocabulary frequency threshold")
    ap.add_argument("--num-embeddings", type=int, default=100_000, help="hashing modulus")
    ap.add_argument("--workdir", help="directory for generated input and outputs (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes in turn this many times (A/B/A/B) and print each round's ratios and their range")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _run_one(args)
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as td:
        td = Path(td)
        inp = args.input
        if inp is None:
            t0 = time.perf_counter()
            gen = td / "in"
            gen.mkdir()
            per = -(-args.rows // args.files)
            for j in range(args.files):
                make_tsv(gen / f"day_{j}", min(per, args.rows - j * per), seed=j)
            size = sum(f.stat().st_size for f in gen.iterdir())
            print(f"generated {args.rows:,} lines in {args.files} file(s), {size / 1e6:.0f} MB, "
                  f"in {time.perf_counter() - t0:.1f} s")
            inp = str(gen)
        ratios: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}, load {_load()}")
            per_cpu = {}
            for mode in args.modes.split(","):
                out = td / f"out_{mode}"
                cmd = [sys.executable, __file__, "--one", mode, "--input", inp, "--out", str(out),
                       "--workers", str(args.workers), "--threshold", str(args.threshold),
                       "--num-embeddings", str(args.num_embeddings)]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    sys.exit(f"{mode}: failed\n{res.stderr}")
                r = json.loads(res.stdout.strip().splitlines()[-1])
                label = (mode.removesuffix("vocab").removesuffix("hash") +
                         (f"vocab T={args.threshold}" if mode.endswith("vocab") else f"hash N={args.num_embeddings}"))
                extra = (f"; largest table {max(r['vocab']):,} rows" if mode.endswith("vocab") else "")
                per_cpu[mode] = r["rows"] / r["cpu"]
                print(f"{label:>14}, {r['procs']} worker process(es): {r['rows']:,} rows in {r['wall']:.2f} s -> "
                      f"{r['rows'] / r['wall']:,.0f} rows/s end to end, {r['rows'] / r['wall'] / r['procs']:,.0f} "
                      f"rows/s per core, {r['rows'] / r['cpu']:,.0f} rows per CPU second (user + sys, all "
                      f"processes); transform pass inside workers {r['rows'] / r['inner']:,.0f} rows/s; "
                      f"peak RSS main {r['rss_main'] / 2**20:,.0f} MiB, largest worker "
                      f"{r['rss_worker'] / 2**20:,.0f} MiB{extra}")
                shutil.rmtree(out, ignore_errors=True)
            for m in ("vocab", "hash"):
                if m in per_cpu and f"logs-{m}" in per_cpu:
                    ratios.setdefault(m, []).append(per_cpu[f"logs-{m}"] / per_cpu[m])
                    print(f"preprocess logs / preprocess criteo, {m}: {ratios[m][-1]:.2f}x rows per CPU second")
        if args.rounds > 1:
            for m, rs in ratios.items():
                print(f"preprocess logs / preprocess criteo, {m}, {len(rs)} rounds: {min(rs):.2f}-{max(rs):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in rs)}); load now {_load()}")


def _load() -> str:
    """The 1, 5 and 15 minute load averages (``os.getloadavg``), or "?" where there are none."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"

if __name__ == "__main__":
    main()
