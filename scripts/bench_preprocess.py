#!/usr/bin/env python
"""Benchmark ``dlrmctl preprocess criteo`` throughput (rows/s) on a synthetic Kaggle-format TSV.

Generates ``--rows`` (default 1,000,000) Criteo lines (40 tab-separated fields, ~20 % empty
fields, some negative integers, 8-hex-digit categoricals) in a temp dir, then preprocesses:

* 1 worker on the whole file (hashing, ``--num-embeddings 100000``, val 10 %);
* ``--workers`` (default 2) worker processes on the same rows split into that many files;
* optionally (``--vocab``) 1 worker in vocabulary mode (two passes).

Prints rows/s end to end (wall clock, process start-up included) and the per-worker steady
rate (rows / time spent inside the worker).  Target: >= 250,000 rows/s per core.

Usage: python scripts/bench_preprocess.py [--rows N] [--workers W] [--vocab]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlrmctl.data.criteo.parse import CriteoOptions  # noqa: E402
from dlrmctl.data.criteo.preprocess import preprocess_criteo  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", action="store_true", help="also time vocabulary mode (2 passes)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        t0 = time.perf_counter()
        whole = td / "one" / "train.txt"
        whole.parent.mkdir()
        make_tsv(whole, args.rows)
        parts = td / "many"
        parts.mkdir()
        per = -(-args.rows // args.workers)
        with open(whole, "rb") as f:
            lines = f.readlines()
        for w in range(args.workers):
            (parts / f"part_{w}.txt").write_bytes(b"".join(lines[w * per:(w + 1) * per]))
        del lines
        print(f"generated {args.rows:,} lines ({whole.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - t0:.1f} s")
        runs = [("hash, 1 worker", whole, 1, CriteoOptions(num_embeddings=[100000] * 26, val_ratio=0.1)),
                (f"hash, {args.workers} workers", parts, args.workers,
                 CriteoOptions(num_embeddings=[100000] * 26, val_ratio=0.1, workers=args.workers))]
        if args.vocab:
            runs.append(("vocab T=3, 1 worker", whole, 1, CriteoOptions(frequency_threshold=3, val_ratio=0.1)))
        for name, inp, w, opts in runs:
            out = td / f"out_{len(name)}_{w}"
            t = time.perf_counter()
            rep = preprocess_criteo(inp, out, opts, progress=False)
            wall = time.perf_counter() - t
            done = [json.loads(p.read_text()) for p in (out / "parts").glob("*/done.json")]
            inner = sum(d["seconds"] for d in done)
            rows = sum(rep.rows.values())
            print(f"{name:>22}: {rows:,} rows in {wall:.2f} s -> {rows / wall:,.0f} rows/s end to end; "
                  f"{rows / inner:,.0f} rows/s per worker process (rows / seconds spent inside workers)")


if __name__ == "__main__":
    main()
