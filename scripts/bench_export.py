#!/usr/bin/env python
"""Size and accuracy of exported models: fp32 / fp16 / int8 / int4 embeddings.

    python scripts/bench_export.py RUN_DIR DATA_DIR [--split val] [--batch-size 8192] [--quantize-dense]
    python scripts/bench_export.py --peak-rss [--rows 10000000] [--dim 64] [--dtype int8] [--work DIR]

Exports RUN_DIR's default checkpoint (the best when the run kept one, else the newest; the eager
reference evaluates the same one) once per embedding dtype (into a temp dir), evaluates each
artifact on DATA_DIR's split with :func:`dlrmctl.inference.export.evaluate_exported`, and prints:

* per dtype: AUC, AUC - AUC(fp32 artifact), logloss, embedding bytes (as allocated by FBGEMM's
  IntNBit TBE, row and 128-byte table padding included), ratio to fp32, model.pt bytes,
  and whether the acceptance targets hold (|dAUC| <= 0.0002 fp16, 0.001 int8, 0.005 int4;
  bytes <= 0.3x fp32 for int8, <= 0.17x for int4);
* the eager (training-code) model's AUC, which the fp32 artifact must reproduce;
* the bytes-per-row ratio to fp32 by embedding dim (int8 ``(D+4)/4D``, int4 ``(D/2+4)/4D``).

``--artifacts``: the artifacts of one precision side by side: the torch.export program
(``model.pt2``, the default; fused embedding-bag lookups), its AOTInductor package (``--aot``, run
from Python through ``load_exported(..., artifact="aoti")``) and the TorchScript model on FBGEMM's
IntNBit TBE (``--torchscript``).  Prints max |Δlogit| of each against the pt2 program on
DATA_DIR's split (and the float model's, from the parity report), the peak RSS of a fresh
process that loads the artifact and scores batches of 4096, p50 latency and rows/s at batch 1 /
64 / 4096 (:func:`interleaved`: one id per feature, one call timed, on the process's CPU time and
on wall time; the median over ``--rounds`` rounds, the artifacts' calls interleaved one by one
within each, so a shared machine's load falls on all of them alike), each artifact's rows/s over
TorchScript's and the AOTInductor package's over the program's (with the range over the rounds),
file bytes, the machine, threads and load average.

    python scripts/bench_export.py --artifacts RUN_DIR DATA_DIR [--dtype int8] [--split val] [--threads N] [--reuse DIR] [--rounds 5]

``--peak-rss``: peak memory of ``dlrmctl export`` (issue 13: export builds the model on the meta
device and reads, quantizes and drops one table at a time).  It makes a run whose table C1 is
``--rows x --dim`` (default 10M x 64: 2.56 GB float32; the 25 other tables have 10 rows) by
training 1 step on 2,000 synthetic rows (the fused kernel), then exports it to ``--dtype`` in a
fresh subprocess and reports that process's peak RSS (``VmHWM``, Linux), the RSS of the same process
before export (Python + torch + fbgemm imports), and checks what export added against the goal
``1.5 x table + artifact`` (and the whole peak, imports included).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

TARGET_DAUC = {"fp16": 0.0002, "int8": 0.001, "int4": 0.005}
TARGET_BYTES = {"int8": 0.3, "int4": 0.17}


# VmHWM (this process's peak RSS; Linux) rather than ru_maxrss, which a child inherits from the
# process it was forked from (here the one that trained the big run)
_CHILD = r"""
import json, sys, time
from dlrmctl.inference.export import export_run
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
base = hwm()
t0 = time.perf_counter()
res = export_run(sys.argv[1], sys.argv[2], sys.argv[3], data_dir=sys.argv[4], force=True)
print(json.dumps({"base_rss": base, "peak_rss": hwm(), "seconds": time.perf_counter() - t0,
                  "stored": res.embedding_bytes}))
"""


def peak_rss(rows: int, dim: int, dtype: str, work: str | None) -> int:
    """Build the big-table run (or reuse it in ``work``) and measure one export's peak RSS."""
    import json
    import os
    import subprocess

    import yaml

    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.worker import run_training

    root = Path(work or tempfile.mkdtemp(prefix="bench_export_rss_"))
    data, run_dir = root / "data", root / "runs" / "big"
    if not (run_dir / "checkpoints").is_dir():
        t0 = time.perf_counter()
        generate_synthetic(data, rows=2000, seed=0, num_embeddings=[rows] + [10] * 25)
        cfg = {
            "name": "big",
            "data": {"path": str(data), "batch_size": 64, "eval_batch_size": 256, "prefetch": 0},
            "model": {"embedding_dim": dim, "dense_arch_layer_sizes": [64, dim], "over_arch_layer_sizes": [64, 1],
                      "compute_kernel": "fused"},
            "train": {"epochs": 1, "max_steps": 1, "run_dir": str(root / "runs"), "progress": False,
                      "pipeline": "none", "device": "cpu", "eval_every": 0},
        }
        (root / "big.yaml").write_text(yaml.safe_dump(cfg))
        run_training(str(root / "big.yaml"), [], overwrite=True)
        print(f"made the run in {time.perf_counter() - t0:.0f} s: {run_dir}")
    ck = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    out = root / f"export-{dtype}"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(run_dir), dtype, str(out), str(data)],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        print(r.stdout, r.stderr)
        return 1
    m = json.loads(r.stdout.strip().splitlines()[-1])
    table = rows * dim * 4
    goal = 1.5 * table + m["stored"]
    gb = 1e9
    print(f"export of a {rows:,} x {dim} table ({table / gb:.2f} GB fp32) to {dtype}; checkpoint {ck / gb:.2f} GB")
    print(f"  artifact embeddings {m['stored'] / gb:.2f} GB; export {m['seconds']:.1f} s")
    print(f"  peak RSS {m['peak_rss'] / gb:.2f} GB (process before export: {m['base_rss'] / gb:.2f} GB; "
          f"export added {(m['peak_rss'] - m['base_rss']) / gb:.2f} GB = "
          f"{(m['peak_rss'] - m['base_rss'] - m['stored']) / table:.2f} x table + artifact)")
    added = m["peak_rss"] - m["base_rss"]
    print(f"  goal: added <= 1.5 x table + artifact = {goal / gb:.2f} GB: {'ok' if added <= goal else 'MISS'} "
          f"(with the imports counted: {'ok' if m['peak_rss'] <= goal else 'MISS'})")
    return 0


_RSS_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from dlrmctl.inference.export import load_exported
from dlrmctl.inference.parity import _synthetic
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
m = load_exported(sys.argv[1], artifact=sys.argv[2])
args = _synthetic(m, 4096, torch.Generator().manual_seed(0))[:3]
with torch.no_grad():
    for _ in range(5):
        m.logits(*args)
print(json.dumps({"peak_rss": hwm()}))
"""


def _peak_rss(model_dir: Path, artifact: str) -> int:
    """Peak RSS (VmHWM) of a fresh process that loads ``artifact`` of ``model_dir`` and scores five
    batches of 4096 rows: what serving that artifact holds at its largest."""
    import json
    import subprocess

    import torch

    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(model_dir), artifact, str(torch.get_num_threads())],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"peak RSS of {artifact}: {r.stderr[-2000:]}")
    return int(json.loads(r.stdout.strip().splitlines()[-1])["peak_rss"])


def interleaved(like, fns: list, rounds: int, clocks: dict, budget_s: float = 1.0, max_calls: int = 60) -> dict:
    """Per clock, per artifact, per batch size (:data:`~dlrmctl.inference.parity.LATENCY_BATCHES`)
    the p50 milliseconds of each round: one call of each artifact in turn (``fns``: ``(name,
    logits)``), up to ``max_calls`` each or ``budget_s`` seconds per round and batch (at least 5),
    after 3 warm-up calls each; inputs as :func:`dlrmctl.inference.parity.latency`'s (one id per
    feature, ``like``'s tables)."""
    import numpy as np
    import torch

    from dlrmctl.inference.parity import LATENCY_BATCHES, _synthetic

    out = {c: {name: {str(b): [] for b in LATENCY_BATCHES} for name, _ in fns} for c in clocks}
    g = torch.Generator().manual_seed(0)
    inputs = {b: _synthetic(like, b, g)[:3] for b in LATENCY_BATCHES}
    with torch.no_grad():
        for _ in range(rounds):
            for b in LATENCY_BATCHES:
                for _, fn in fns:
                    for _ in range(3):
                        fn(*inputs[b])
                ts = {c: {name: [] for name, _ in fns} for c in clocks}
                t_end = time.perf_counter() + budget_s
                n = 0
                while n < max_calls and (n < 5 or time.perf_counter() < t_end):
                    for name, fn in fns:
                        t0 = {c: clock() for c, clock in clocks.items()}
                        fn(*inputs[b])
                        t1 = {c: clock() for c, clock in clocks.items()}
                        for c in clocks:
                            ts[c][name].append((t1[c] - t0[c]) * 1e3)
                    n += 1
                for c in clocks:
                    for name, _ in fns:
                        out[c][name][str(b)].append(float(np.percentile(ts[c][name], 50)))
    return out


def artifacts(run_dir: str, data_dir: str, dtype: str, split: str, reuse: str | None = None,
              rounds: int = 5) -> int:
    """``--artifacts``: parity and latency of every artifact of ``dtype`` (module doc)."""
    import datetime
    import os
    import platform

    import numpy as np
    import torch

    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.inference.export import export_run, load_exported
    from dlrmctl.inference.parity import LATENCY_BATCHES

    t0 = time.perf_counter()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{datetime.date.today()}  {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average before {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_export_") as scratch:
        tmp = reuse or scratch
        t = time.perf_counter()
        if reuse and (Path(tmp) / "pt2" / "manifest.json").is_file():
            r2 = load_exported(Path(tmp) / "pt2", artifact="pt2")
        else:
            r2 = export_run(run_dir, dtype, Path(tmp) / "pt2", data_dir=data_dir, aot=True, force=True)
        t_pt2 = time.perf_counter() - t
        t = time.perf_counter()
        if not (reuse and (Path(tmp) / "ts" / "manifest.json").is_file()):
            export_run(run_dir, dtype, Path(tmp) / "ts", data_dir=data_dir, artifact="torchscript", parity_split=None,
                       force=True)
        t_ts = time.perf_counter() - t
        p2, ts = load_exported(Path(tmp) / "pt2", artifact="pt2"), load_exported(Path(tmp) / "ts")
        aoti = load_exported(Path(tmp) / "pt2", artifact="aoti")
        variants = [("pt2 program (torch.export.load)", p2.logits, r2.manifest["files"]["model.pt2"]["bytes"],
                     (Path(tmp) / "pt2", "pt2")),
                    ("AOTInductor package (--aot)", aoti.logits, r2.manifest["files"]["model_aoti.pt2"]["bytes"],
                     (Path(tmp) / "pt2", "aoti")),
                    ("TorchScript + FBGEMM TBE (--torchscript)", ts.logits, ts.manifest["model_bytes"],
                     (Path(tmp) / "ts", "torchscript"))]
        loader = BatchLoader(str(data_dir), split, 8192, shuffle=False, features=p2.feature_names, prefetch=0)
        ref = {}
        for name, fn, _, _ in variants:
            with torch.no_grad():
                ref[name] = np.concatenate([fn(b.dense_features.float(), *p2._kjt_inputs(b.sparse_features)[:2]).cpu().numpy()
                                            for b in loader])
        base = ref[variants[0][0]]
        par = r2.manifest.get("parity") or {}
        print(f"  export (pt2 + aot) {t_pt2:.0f} s, torchscript {t_ts:.0f} s; {split}: {len(base):,} rows; "
              f"pt2 vs float model max |dlogit| {par.get('max_abs_dlogit', float('nan')):.3g} "
              f"(AUC {par.get('artifact', {}).get('auc', float('nan')):.6f} vs {par.get('float', {}).get('auc', float('nan')):.6f})")
        print()
        print("| artifact | file bytes | max \\|Δlogit\\| vs pt2 | peak RSS (B=4096) | "
              + " | ".join(f"B={b} CPU p50 ms (rows/s)" for b in LATENCY_BATCHES) + " | "
              + " | ".join(f"B={b} wall p50 ms" for b in LATENCY_BATCHES) + " |")
        print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in 2 * LATENCY_BATCHES) + " |")
        # rounds; in each, per batch size, the artifacts' calls interleaved one by one (A B C A B C ...):
        # a shared machine's load (another process on the sibling hyperthread, drifting load) falls
        # on every artifact alike; p50 = median over the rounds of each round's p50, on this
        # process's CPU time (other processes' load does not inflate it) and on wall time
        clocks = {"cpu": time.process_time, "wall": time.perf_counter}
        p50s = interleaved(p2, [(name, fn) for name, fn, _, _ in variants], rounds, clocks)
        p50 = {c: {name: {b: float(np.median(v)) for b, v in per.items()} for name, per in by.items()}
               for c, by in p50s.items()}
        for name, fn, nbytes, (mdir, fmt) in variants:
            d = float(np.max(np.abs(ref[name].astype(np.float64) - base)))
            rss = _peak_rss(mdir, fmt)
            print(f"| {name} | {f'{nbytes:,}' if nbytes else '-'} | {d:.3g} | {rss / 2**20:,.0f} MiB | "
                  + " | ".join(f"{p50['cpu'][name][str(b)]:.3f} ({b / p50['cpu'][name][str(b)] * 1e3:,.0f})"
                               for b in LATENCY_BATCHES) + " | "
                  + " | ".join(f"{p50['wall'][name][str(b)]:.3f}" for b in LATENCY_BATCHES) + " |")
        ts_name, pt2_name = variants[-1][0], variants[0][0]
        for c in clocks:
            for name, ref_name in [(v[0], ts_name) for v in variants[:-1]] + [(variants[1][0], pt2_name)]:
                per_round = {b: [r / x for r, x in zip(p50s[c][ref_name][str(b)], p50s[c][name][str(b)])]
                             for b in LATENCY_BATCHES}
                print(f"  {name} rows/s / {ref_name.split(' ')[0]}'s ({c} time): " + ", ".join(
                    f"B={b} {p50[c][ref_name][str(b)] / p50[c][name][str(b)]:.2f}x "
                    f"(rounds {min(per_round[b]):.2f}-{max(per_round[b]):.2f})" for b in LATENCY_BATCHES)
                    + f" (median of {rounds} interleaved rounds)")
    print(f"\n{time.perf_counter() - t0:.0f} s; load average after {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--artifacts" in argv:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--artifacts", action="store_true")
        ap.add_argument("run_dir")
        ap.add_argument("data_dir")
        ap.add_argument("--dtype", default="int8", choices=["fp32", "fp16", "int8", "int4"])
        ap.add_argument("--split", default="val")
        ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
        ap.add_argument("--reuse", help="keep the exports in this directory (pt2/ with --aot, ts/) and reuse them "
                                        "when present (default: a temporary directory)")
        ap.add_argument("--rounds", type=int, default=5, help="latency rounds, the artifacts' calls interleaved in each "
                                                              "(p50: median over the rounds)")
        a = ap.parse_args(argv)
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        return artifacts(a.run_dir, a.data_dir, a.dtype, a.split, a.reuse, a.rounds)
    if "--peak-rss" in argv:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--peak-rss", action="store_true")
        ap.add_argument("--rows", type=int, default=10_000_000)
        ap.add_argument("--dim", type=int, default=64)
        ap.add_argument("--dtype", default="int8", choices=["fp32", "fp16", "int8", "int4"])
        ap.add_argument("--work", help="directory for the data and run (kept; reused when it has the run)")
        a = ap.parse_args(argv)
        return peak_rss(a.rows, a.dim, a.dtype, a.work)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--split", default="val")
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--quantize-dense", action="store_true", help="also dynamic-int8 the MLPs")
    args = ap.parse_args(argv)

    from dlrmctl.inference.export import evaluate_exported, export_run
    from dlrmctl.inference.quantize import tbe_row_bytes
    from dlrmctl.train.reload import evaluate_run

    t0 = time.perf_counter()
    eager = evaluate_run(args.run_dir, args.split, args.data_dir, args.batch_size)
    rows = []
    dims = set()
    with tempfile.TemporaryDirectory(prefix="bench_export_") as tmp:
        for dtype in ("fp32", "fp16", "int8", "int4"):
            res = export_run(args.run_dir, dtype, Path(tmp) / dtype, data_dir=args.data_dir,
                             quantize_dense=args.quantize_dense)
            dims |= {t["embedding_dim"] for t in res.manifest["tables"]}
            m = evaluate_exported(res.model_dir, args.data_dir, args.split, args.batch_size)
            rows.append((dtype, m, res.embedding_bytes, res.embedding_bytes_fp32, res.manifest["model_bytes"]))
    base_auc = rows[0][1]["auc"]
    print(f"run {args.run_dir}  data {args.data_dir} [{args.split}, n={rows[0][1]['num_samples']}]"
          f"  dense: {'dynamic int8' if args.quantize_dense else 'fp32'}")
    print(f"eager model AUC {eager['auc']:.6f} (fp32 artifact - eager = {base_auc - eager['auc']:+.2e})")
    print()
    hdr = f"{'embeddings':<10} {'AUC':>9} {'dAUC':>10} {'logloss':>9} {'emb bytes':>12} {'x fp32':>7} {'model.pt':>11}  targets"
    print(hdr)
    print("-" * len(hdr))
    ok_all = True
    for dtype, m, b, b32, mb in rows:
        d = m["auc"] - base_auc
        ratio = b / b32
        checks = []
        if dtype in TARGET_DAUC:
            ok = abs(d) <= TARGET_DAUC[dtype]
            checks.append(f"|dAUC|<={TARGET_DAUC[dtype]}: {'ok' if ok else 'MISS'}")
            ok_all &= ok
        if dtype in TARGET_BYTES:
            ok = ratio <= TARGET_BYTES[dtype]
            checks.append(f"bytes<={TARGET_BYTES[dtype]}x: {'ok' if ok else 'MISS'}")
            ok_all &= ok
        auc_s = f"{m['auc']:.6f}" if not math.isnan(m["auc"]) else "nan"
        print(f"{dtype:<10} {auc_s:>9} {d:>+10.2e} {m['logloss']:>9.5f} {b:>12,} {ratio:>7.3f} {mb:>11,}  {'; '.join(checks)}")
    print()
    print("bytes per row relative to fp32 (FBGEMM IntNBit rows on CPU; fp16 scale+bias = 4 bytes):")
    print(f"{'dim':>5} {'fp16':>6} {'int8':>6} {'int4':>6}")
    for dim in sorted(dims | {16, 20, 24, 32, 64, 128}):
        r = [tbe_row_bytes(dim, t) / (4 * dim) for t in ("fp16", "int8", "int4")]
        mark = "  <- this model" if dim in dims else ""
        print(f"{dim:>5} {r[0]:>6.3f} {r[1]:>6.3f} {r[2]:>6.3f}{mark}")
    print(f"\n{time.perf_counter() - t0:.1f} s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
