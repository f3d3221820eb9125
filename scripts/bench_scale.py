#!/usr/bin/env python
"""Criteo-1TB-scale benchmark: bounded memory on every path, measured on generated day files.

Not a test: it prints figures (and writes them as JSON).  Stages (``--stages``, default all):

``gen``
    ``--lines`` (default 20,000,000) synthetic Criteo-1TB-format lines split over ``--days`` day
    files ``day_0 .. day_{k-1}`` (40 TAB-separated fields: label, I1..I13, C1..C26; ~20 % empty
    integer and ~10 % empty categorical fields; Zipf(1.2) ids; column C3 draws 60 % of its values
    uniformly from 2^32 so it has > 10M distinct values at 20M lines).  ``--gz`` gzips them.
``preprocess``
    ``dlrmctl preprocess criteo`` of all day files with ``--workers`` processes, in vocabulary mode
    (``--frequency-threshold 3``) and in hashing mode (``--num-embeddings 1000000``).  Reports rows/s
    per core (rows / CPU seconds of the whole process tree) and peak RSS (the largest single
    process: GNU time's ``Maximum resident set size``).
``train``
    peak RSS of ``dlrmctl train`` after 50 shuffled steps on the first 2M rows and on all rows.
``eval``
    ``scripts/bench_eval.py``: evaluation on 2 gloo ranks over 5M and 2.5M rows.
``export``
    ``scripts/bench_export.py --rows 10000000 --dim 64``: export peak RSS against the goal
    1.5 x table + artifact.
``reshard``
    ``dlrmctl checkpoint reshard`` 2 -> 3 ranks: bytes read in total against the checkpoint size.

Usage::

    python scripts/bench_scale.py --workdir /tmp/scale --lines 20000000 [--stages gen,preprocess,...]

Every stage's command is printed with its figures; ``--workdir`` keeps the generated data so later
stages (or re-runs) reuse it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

REPO = Path(__file__).resolve().parents[1]
STAGES = ("gen", "preprocess", "train", "eval", "export", "reshard")
BLOCK = 1_000_000


def _hex8(ids: np.ndarray) -> pa.Array:
    """uint32-valued ``[n]`` int array -> string array of 8 lowercase hex digits each (vectorised)."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    chars = digits[(ids.astype(np.uint64)[:, None] >> shifts) & np.uint64(15)]
    n = len(ids)
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32).tobytes())
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(chars.tobytes()))


def day_block(rng: np.random.Generator, rows: int, cards: list[int]) -> pa.Table:
    """``rows`` Criteo-1TB lines as a string table (40 columns, nulls = empty fields)."""
    null = pa.scalar(None, pa.string())
    cols = {"label": pc.cast(pa.array((rng.random(rows) < 0.25).astype(np.int8)), pa.string())}
    for i in range(13):
        v = pc.cast(pa.array(rng.geometric(0.05, rows) - 2), pa.string())  # includes -1 (like I2)
        cols[f"I{i + 1}"] = pc.if_else(pa.array(rng.random(rows) < 0.2), null, v)
    for i in range(26):
        ids = (rng.zipf(1.2, rows) % cards[i]) * 2654435761 % (1 << 32)
        if i == 2:  # C3: the huge-cardinality column
            wide = rng.random(rows) < 0.6
            ids[wide] = rng.integers(0, 1 << 32, int(wide.sum()))
        cols[f"C{i + 1}"] = pc.if_else(pa.array(rng.random(rows) < 0.1), null, _hex8(ids))
    return pa.table(cols)


def generate_days(out: Path, lines: int, days: int, gz: bool, seed: int = 0) -> list[Path]:
    """Write ``lines`` lines over ``days`` files ``day_<d>`` (``.gz`` if ``gz``); returns the paths.

    Written block by block (1M lines), so memory is independent of ``lines``; each file goes to a
    ``.tmp`` name first and is renamed when complete.
    """
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cards = [int(10 ** rng.uniform(1, 7)) for _ in range(26)]
    per_day = -(-lines // days)
    paths = []
    opts = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    for d in range(days):
        n = min(per_day, lines - d * per_day)
        path = out / (f"day_{d}.gz" if gz else f"day_{d}")
        paths.append(path)
        if path.exists():
            continue
        tmp = path.with_name(path.name + ".tmp")
        with (gzip.open(tmp, "wb", compresslevel=1) if gz else open(tmp, "wb")) as f:
            done = 0
            while done < n:
                b = min(BLOCK, n - done)
                sink = pa.BufferOutputStream()
                pa_csv.write_csv(day_block(rng, b, cards), sink, opts)
                f.write(sink.getvalue().to_pybytes())
                done += b
        os.replace(tmp, path)
    return paths


def timed(cmd: list[str], env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``cmd`` under GNU time; returns wall s, CPU s (user+sys, whole tree), peak RSS MB (largest process)."""
    fmt = "%e %U %S %M"
    t = time.perf_counter()
    with open(log, "w") if log else open(os.devnull, "w") as out:
        p = subprocess.run(["/usr/bin/time", "-f", f"TIME {fmt}", *cmd], stdout=out, stderr=subprocess.PIPE,
                           text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t
    m = re.findall(r"TIME ([\d.]+) ([\d.]+) ([\d.]+) (\d+)", p.stderr)
    if p.returncode != 0 or not m:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"failed ({p.returncode}): {shlex.join(cmd)}")
    e, u, s, rss = m[-1]
    return {"cmd": shlex.join(cmd), "wall_s": round(wall, 2), "cpu_s": round(float(u) + float(s), 2),
            "peak_rss_mb": round(int(rss) / 1024, 1)}


def du_mb(p: Path) -> float:
    return round(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6, 1) if p.exists() else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dlrmctl_scale"))
    ap.add_argument("--lines", type=int, default=20_000_000)
    ap.add_argument("--days", type=int, default=4)
    ap.add_argument("--gz", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = sorted(set(stages) - set(STAGES))
    if bad:
        ap.error(f"unknown stage(s) {bad}; expected some of {list(STAGES)}")
    w = args.workdir
    w.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    dl = [py, "-m", "dlrmctl.cli"]
    res: dict = {"lines": args.lines, "days": args.days, "workers": args.workers, "cores": os.cpu_count()}
    raw = w / "days"
    if "gen" in stages:
        t = time.perf_counter()
        generate_days(raw, args.lines, args.days, args.gz)
        res["gen"] = {"wall_s": round(time.perf_counter() - t, 1), "disk_mb": du_mb(raw)}
        print(f"gen: {args.lines:,} lines in {args.days} day files, {res['gen']['disk_mb']:,.0f} MB "
              f"({res['gen']['wall_s']} s)", flush=True)
    if "preprocess" in stages:
        for mode, extra in (("vocab", ["--frequency-threshold", "3"]), ("hash", ["--num-embeddings", "1000000"])):
            out = w / f"pre_{mode}"
            shutil.rmtree(out, ignore_errors=True)
            r = timed(dl + ["preprocess", "criteo", "-i", str(raw), "-o", str(out), "--val-ratio", "0.05",
                            "--workers", str(args.workers), "--quiet", *extra])
            r["rows_per_s_per_core"] = round(args.lines / r["cpu_s"])
            r["disk_mb"] = du_mb(out)
            res[f"preprocess_{mode}"] = r
            print(f"preprocess {mode}: {r['rows_per_s_per_core']:,} rows/s per core, peak RSS "
                  f"{r['peak_rss_mb']:,.0f} MB, {r['wall_s']} s wall, output {r['disk_mb']:,.0f} MB\n  {r['cmd']}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
