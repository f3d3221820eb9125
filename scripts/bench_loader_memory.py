#!/usr/bin/env python
"""Peak RSS (MB) of ``dlrmctl train`` after ``--steps`` shuffled steps, for several train-split sizes.

For each ``--rows`` value, generates a synthetic Criteo-schema dataset (``dlrmctl preprocess
synthetic``; the validation split is held at about ``--val-rows`` rows for every size, so the final
evaluation costs the same and the figure shows the train loader), then runs ``dlrmctl train CONFIG``
(default ``configs/demo.yaml``, shuffling on) for ``--steps`` steps in a fresh child process and
reads the child's peak resident set size with ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
(kilobytes on Linux).  Goal (issue 13): the sizes differ by under 50 MB, i.e. the loader's memory
does not grow with the row count.

Usage:
    python scripts/bench_loader_memory.py [--rows 2000000 10000000] [--steps 50] [--config configs/demo.yaml]
        [--data-root DIR] [--set key=value ...]

``--data-root DIR`` keeps the generated datasets as ``DIR/rows_<N>`` (reused when present);
otherwise they live in a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _child(config: str, data: str, run_dir: str, steps: int, extra: list[str]) -> None:
    """Run ``dlrmctl train`` in this process, then print this process's peak RSS in kB."""
    from dlrmctl.cli import app

    args = ["train", config, "--set", f"data.path={data}", "--set", f"train.run_dir={run_dir}",
            "--set", "name=bench_memory", "--set", f"train.max_steps={steps}", "--set", "train.progress=false",
            "--set", "data.shuffle=true", "--set", f"train.log_every={steps}"]
    for kv in extra:
        args += ["--set", kv]
    try:
        app(args, standalone_mode=False)
    finally:
        print(f"PEAK_RSS_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)


def generate(data: Path, rows: int, val_rows: int) -> float:
    """Generate ``rows`` synthetic rows (about ``val_rows`` of them validation, no test split) into ``data``;
    returns the seconds it took (0 when ``data`` already has a meta.json)."""
    if (data / "meta.json").is_file():
        return 0.0
    from dlrmctl.data.synthetic import generate_synthetic

    t = time.perf_counter()
    generate_synthetic(data, rows=rows, seed=0, val_ratio=min(0.5, val_rows / rows), test_ratio=0.0)
    return time.perf_counter() - t


def measure(rows: int, steps: int = 50, config: str = str(REPO / "configs" / "demo.yaml"), data_root: str | None = None,
            val_rows: int = 20_000, extra: list[str] | None = None) -> dict:
    """Generate (or reuse) a ``rows``-row dataset and train ``steps`` shuffled steps in a child process.

    Returns:
        ``{"rows", "train_rows", "steps", "peak_rss_mb", "train_s", "generate_s"}`` (MB = 2**20 bytes,
        seconds of wall time).

    Raises:
        RuntimeError: the child failed (its output is in the message).
    """
    from dlrmctl.data.columnar import read_meta

    with tempfile.TemporaryDirectory() as td:
        data = Path(data_root) / f"rows_{rows}" if data_root else Path(td) / "data"
        gen_s = generate(data, rows, val_rows)
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--child", str(Path(config).resolve()), str(data), str(Path(td) / "runs"),
               str(steps), *(extra or [])]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        train_s = time.perf_counter() - t
        peak = [ln for ln in p.stdout.splitlines() if ln.startswith("PEAK_RSS_KB ")]
        if p.returncode != 0 or not peak:
            raise RuntimeError(f"training on {rows:,} rows failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
                               f"{p.stderr[-3000:]}")
        train_rows = read_meta(data)["splits"]["train"]["rows"]
    return {"rows": rows, "train_rows": train_rows, "steps": steps, "peak_rss_mb": int(peak[-1].split()[1]) / 1024,
            "train_s": train_s, "generate_s": gen_s}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        config, data, run_dir, steps, *extra = sys.argv[2:]
        _child(config, data, run_dir, int(steps), extra)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2_000_000, 10_000_000])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--val-rows", type=int, default=20_000)
    ap.add_argument("--data-root", default=None, help="keep the generated datasets here (reused when present)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override key=value")
    args = ap.parse_args()
    results = []
    for rows in args.rows:
        r = measure(rows, args.steps, args.config, args.data_root, args.val_rows, args.extra)
        results.append(r)
        print(f"{r['rows']:>12,} rows ({r['train_rows']:,} train): peak RSS {r['peak_rss_mb']:8.1f} MB after "
              f"{r['steps']} shuffled steps (train {r['train_s']:.1f} s, generate {r['generate_s']:.1f} s)", flush=True)
    if len(results) > 1:
        spread = max(r["peak_rss_mb"] for r in results) - min(r["peak_rss_mb"] for r in results)
        print(f"peak RSS spread over sizes: {spread:.1f} MB (goal: < 50 MB)")


if __name__ == "__main__":
    main()
