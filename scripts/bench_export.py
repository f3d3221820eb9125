#!/usr/bin/env python
"""Size and accuracy of exported models: fp32 / fp16 / int8 / int4 embeddings.

    python scripts/bench_export.py RUN_DIR DATA_DIR [--split val] [--batch-size 8192] [--quantize-dense]

Exports RUN_DIR's default checkpoint (the best when the run kept one, else the newest; the eager
reference evaluates the same one) once per embedding dtype (into a temp dir), evaluates each
artifact on DATA_DIR's split with :func:`dlrmctl.inference.export.evaluate_exported`, and prints:

* per dtype: AUC, AUC - AUC(fp32 artifact), logloss, embedding bytes (as allocated by FBGEMM's
  IntNBit TBE, row and 128-byte table padding included), ratio to fp32, model.pt bytes,
  and whether the acceptance targets hold (|dAUC| <= 0.0002 fp16, 0.001 int8, 0.005 int4;
  bytes <= 0.3x fp32 for int8, <= 0.17x for int4);
* the eager (training-code) model's AUC, which the fp32 artifact must reproduce;
* the bytes-per-row ratio to fp32 by embedding dim (int8 ``(D+4)/4D``, int4 ``(D/2+4)/4D``).
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--split", default="val")
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--quantize-dense", action="store_true", help="also dynamic-int8 the MLPs")
    args = ap.parse_args(argv)

    from dlrmctl.inference.export import evaluate_exported, export_run
    from dlrmctl.inference.quantize import tbe_row_bytes
    from dlrmctl.train.loop import evaluate_run

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
