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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_preprocess import _hex8  # noqa: E402  (8-hex-digit categoricals, vectorised)
STAGES = ("gen", "preprocess", "train", "eval", "export", "reshard")
BLOCK = 1_000_000


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


TRAIN_CFG = """name: {name}
data:
  path: {data}
  batch_size: 1024
  eval_batch_size: 8192
model:
  embedding_dim: 16
  dense_arch_layer_sizes: [64, 32, 16]
  over_arch_layer_sizes: [64, 32, 1]
optimizer:
  embedding: {{type: exact_rowwise_adagrad, lr: 0.05}}
  dense: {{type: adagrad, lr: 0.05}}
train:
  run_dir: {runs}
  epochs: 1
  max_steps: {steps}
  log_every: 25
  progress: false
"""


def _config(w: Path, name: str, data: Path, steps: int) -> Path:
    p = w / f"{name}.yaml"
    p.write_text(TRAIN_CFG.format(name=name, data=data, runs=w / "runs", steps=steps))
    return p


def train_stage(w: Path, raw: Path, args: argparse.Namespace, dl: list[str]) -> dict:
    """Peak RSS of 50 shuffled training steps on the first ``--train-small-rows`` lines and on all
    lines (both hashed to 1M rows per table, so the model is the same size and only the data differs;
    val is 0.05 % of the rows, so the evaluation at the end adds next to nothing)."""
    small_raw = w / "days_small"
    if not (small_raw / "day_0").exists():
        small_raw.mkdir(parents=True, exist_ok=True)
        src = sorted(p for p in raw.iterdir() if p.name.startswith("day_") and not p.name.endswith(".tmp"))
        left = args.train_small_rows
        with open(small_raw / "day_0.tmp", "wb") as out:
            for p in src:
                with (gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")) as f:
                    for line in f:
                        out.write(line)
                        left -= 1
                        if left == 0:
                            break
                if left == 0:
                    break
        os.replace(small_raw / "day_0.tmp", small_raw / "day_0")
    out: dict = {}
    for label, data_raw, rows in (("small", small_raw, args.train_small_rows), ("large", raw, args.lines)):
        data = w / f"pre_train_{label}"  # a tiny val split: the end-of-run evaluation stays negligible
        if not (data / "meta.json").exists():
            timed(dl + ["preprocess", "criteo", "-i", str(data_raw), "-o", str(data), "--val-ratio", "0.0005",
                        "--workers", str(args.workers), "--quiet", "--num-embeddings", "1000000"])
        cfg = _config(w, f"scale_train_{label}", data, 50)
        r = timed(dl + ["train", str(cfg), "--overwrite"], log=w / f"train_{label}.log")
        r["rows"] = rows
        out[label] = r
        print(f"train 50 shuffled steps on {rows:,} rows: peak RSS {r['peak_rss_mb']:,.0f} MB ({r['wall_s']} s)\n"
              f"  {r['cmd']}", flush=True)
    out["rss_difference_mb"] = round(out["large"]["peak_rss_mb"] - out["small"]["peak_rss_mb"], 1)
    print(f"train: large - small peak RSS = {out['rss_difference_mb']} MB (goal < 50 MB)", flush=True)
    return out


def reshard_stage(w: Path, args: argparse.Namespace, dl: list[str]) -> dict:
    """Bytes read by ``dlrmctl checkpoint reshard`` 2 -> 3 ranks of a 2-rank run (26 tables of
    ``--reshard-rows`` x 16), against the checkpoint's size (goal <= 1.2x)."""
    data = w / "reshard_data"
    if not (data / "meta.json").exists():
        timed(dl + ["preprocess", "synthetic", "--out", str(data), "--rows", "50000",
                    "--num-embeddings", str(args.reshard_rows)])
    cfg = _config(w, "scale_reshard", data, 5)
    run = w / "runs" / "scale_reshard"
    timed(dl + ["train", str(cfg), "--overwrite", "--nproc", "2"], log=w / "reshard_train.log")
    out_run = w / "runs" / "scale_reshard_3"
    shutil.rmtree(out_run, ignore_errors=True)
    r = timed(dl + ["checkpoint", "reshard", str(run), "--nproc", "3", "--out", str(out_run)],
              log=w / "reshard.log")
    found = None
    for m in out_run.rglob("meta.json"):
        d = json.loads(m.read_text())
        if "resharded_from" in d:
            found = d["resharded_from"]
    if found is None:
        raise SystemExit(f"no meta.json with resharded_from under {out_run}")
    r.update({"checkpoint_bytes": found["bytes"], "bytes_read": found["bytes_read"],
              "bytes_read_per_rank": found["bytes_read_per_rank"],
              "read_ratio": round(found["bytes_read"] / found["bytes"], 3)})
    print(f"reshard 2->3: read {r['bytes_read']:,} B of a {r['checkpoint_bytes']:,} B checkpoint = "
          f"{r['read_ratio']}x (goal <= 1.2x), {r['wall_s']} s\n  {r['cmd']}", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dlrmctl_scale"))
    ap.add_argument("--lines", type=int, default=20_000_000)
    ap.add_argument("--days", type=int, default=4)
    ap.add_argument("--gz", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--train-small-rows", type=int, default=2_000_000, help="rows of the small training set")
    ap.add_argument("--eval-rows", type=int, default=5_000_000)
    ap.add_argument("--reshard-rows", type=int, default=400_000,
                    help="rows per table of the 2-rank run that is resharded to 3 ranks (26 tables x 16 dims)")
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
    if "train" in stages:
        res["train"] = train_stage(w, raw, args, dl)
    if "eval" in stages:
        r = timed([py, "scripts/bench_eval.py", "--rows", str(args.eval_rows)], log=w / "bench_eval.log")
        r["table"] = (w / "bench_eval.log").read_text()
        res["eval"] = r
        print(f"eval ({args.eval_rows:,} rows, 2 gloo ranks):\n{r['table']}  {r['cmd']}", flush=True)
    if "export" in stages:
        r = timed([py, "scripts/bench_export.py", "--peak-rss", "--work", str(w / "export")],
                  log=w / "bench_export.log")
        r["report"] = (w / "bench_export.log").read_text()[-3000:]
        res["export"] = r
        print(f"export (10M x 64 table):\n{r['report']}  {r['cmd']}", flush=True)
    if "reshard" in stages:
        res["reshard"] = reshard_stage(w, args, dl)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
