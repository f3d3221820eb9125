#!/usr/bin/env python3
"""Day-by-day training on the drifting synthetic log: a managed-collision table of N rows vs one row
per id ever seen vs modulo hashing into N rows (benchmarks/managed_collision.md).

Each variant trains day 0 from scratch and every later day with ``--init-from`` the day before,
one epoch a day (configs/drift_mc.yaml), and is scored on the NEXT day's validation rows
(``dlrmctl evaluate RUN --data <day+1>``): tomorrow's ids, some never seen.

    python scripts/bench_managed_collision.py --work /tmp/mcbench --days 5 --rows 80000 --churn 0.3 --size 2200

Prints a markdown table (AUC per next day, mean, and the mean gap to the Bayes AUC).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "drift_mc.yaml"


def cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dlrmctl.cli", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: dlrmctl {' '.join(map(str, args))}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="directory for the data and runs")
    p.add_argument("--days", type=int, default=5)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--alive", type=int, default=2000)
    p.add_argument("--churn", type=float, default=0.2, help="fraction of the alive ids retired (and born) each day")
    p.add_argument("--size", type=int, default=2500, help="N: rows of the managed-collision and modulo tables")
    p.add_argument("--epochs", type=int, default=1, help="epochs over each day's rows")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    work = Path(a.work)
    ever = a.alive + (a.days - 1) * round(a.churn * a.alive)
    variants = {  # name -> (data kind, --set overrides)
        f"managed collision, N = {a.size}": ("raw", [f"model.managed_collision.size={a.size}"]),
        f"one row per id ever seen ({ever})": ("raw", [f"model.managed_collision.size={ever}"]),
        f"modulo hashing into N = {a.size}": ("mod", []),
    }
    bayes = {}
    for d in range(a.days):
        for kind in ("raw", "mod"):
            out = work / kind / f"day_{d}"
            extra = ["--modulo", str(a.size)] if kind == "mod" else []
            if not (out / "meta.json").is_file():
                cli("preprocess", "synthetic-drift", "--day", d, "--rows", a.rows, "--alive", a.alive,
                    "--churn", a.churn, "--seed", a.seed, "--out", out, *extra)
        bayes[d] = json.loads((work / "raw" / f"day_{d}" / "meta.json").read_text())["bayes_auc"]
    results: dict[str, list[float]] = {}
    for vi, (name, (kind, sets)) in enumerate(variants.items()):
        aucs = []
        for d in range(a.days - 1):
            run_name = f"v{vi}_day{d}"
            args = ["train", CONFIG, "--set", f"data.path={work / kind / f'day_{d}'}", "--set", f"name={run_name}",
                    "--set", f"train.run_dir={work / 'runs'}", "--set", f"train.epochs={a.epochs}"]
            for s in sets:
                args += ["--set", s]
            if d > 0:
                args += ["--init-from", work / "runs" / f"v{vi}_day{d - 1}"]
            if not (work / "runs" / run_name / "summary.json").is_file():
                cli(*args)
            out = cli("evaluate", work / "runs" / run_name, "--data", work / kind / f"day_{d + 1}", "--split", "val", "--any-split")
            aucs.append(float(re.search(r"^\s*auc\s+([0-9.]+)", out, re.M).group(1)))
            print(f"{name}: trained day {d}, AUC on day {d + 1} = {aucs[-1]:.4f}", file=sys.stderr)
        results[name] = aucs
    days = list(range(1, a.days))
    print("| model | " + " | ".join(f"day {d}" for d in days) + " | mean | mean gap to Bayes |")
    print("| --- | " + " | ".join("---:" for _ in days) + " | ---: | ---: |")
    mb = sum(bayes[d] for d in days) / len(days)
    print("| Bayes AUC (planted probabilities) | " + " | ".join(f"{bayes[d]:.4f}" for d in days) + f" | {mb:.4f} | 0 |")
    for name, aucs in results.items():
        m = sum(aucs) / len(aucs)
        print(f"| {name} | " + " | ".join(f"{x:.4f}" for x in aucs) + f" | {m:.4f} | {m - mb:+.4f} |")


if __name__ == "__main__":
    main()
