#!/usr/bin/env python
"""Training throughput of a Criteo-shaped DLRM on this machine (CPU).

Model (issue "Pipelined training"): 26 tables x 100,000 rows x dim 64,
bottom MLP 13-512-256-64, top MLP 512-256-1, dot interaction, global batch
2048, fused row-wise Adagrad (FBGEMM TBE).  Runs world size 1 and 2 (gloo,
through ``dlrmctl train --nproc``, i.e. torchx) with the ``base`` and
``sparse_dist`` pipelines, and prints a markdown table of samples/s (global,
steady state: the first ``--warmup`` steps are excluded) with the share of
step time spent waiting on data and on the input_dist all-to-all.

    python scripts/bench_train.py [--steps 60] [--warmup 10] [--worlds 1,2] [--emb-optimizer adam]

``--emb-optimizer`` picks ``optimizer.embedding.type`` (default ``exact_rowwise_adagrad``,
fused in FBGEMM's CPU TBE; the Adam family runs on the ``dense`` kernel on CPU) and
``--emb-lr`` its lr (default 0.05 for the Adagrads / SGD, 0.001 for the Adam family).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(cfg_path: str, data: str, runs: str, world: int, pipeline: str, steps: int, kernel: str,
        sharding: str | None) -> dict:
    name = f"bench_w{world}_{pipeline}_{kernel}"
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", cfg_path, "--overwrite",
           "--set", f"data.path={data}", "--set", f"train.run_dir={runs}", "--set", f"name={name}",
           "--set", f"train.pipeline={pipeline}", "--set", f"train.max_steps={steps}",
           "--set", f"model.compute_kernel={kernel}"]
    if sharding:
        cmd += ["--set", "sharding.tables={" + ", ".join(f"t_C{i}: {{sharding_type: {sharding}}}" for i in range(1, 27)) + "}"]
    if world > 1:
        cmd += ["--nproc", str(world)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(os.path.join(runs, name, "metrics.jsonl"))]
    train = [r for r in recs if r["kind"] == "train"]
    return {"records": train, "wall_s": time.perf_counter() - t0}


def steady(records: list[dict], warmup: int, batch: int) -> tuple[float, float, float]:
    """samples/s over steps after ``warmup`` from the cumulative per-step samples/s log."""
    # samples_per_s at step s is cumulative: samples(s) / time(s) -> time(s) = s * batch / sps(s)
    r0 = next(r for r in records if r["step"] == warmup)
    r1 = records[-1]
    t0 = r0["step"] * batch / r0["samples_per_s"]
    t1 = r1["step"] * batch / r1["samples_per_s"]
    sps = (r1["step"] - r0["step"]) * batch / max(t1 - t0, 1e-9)
    return sps, r1.get("data_wait_share", 0.0), r1.get("comm_wait_share", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--pipelines", default="base,sparse_dist")
    ap.add_argument("--kernel", default="fused")
    ap.add_argument("--sharding", default=None, help="force one sharding type for all tables at world > 1")
    ap.add_argument("--rows", type=int, default=200_000, help="synthetic rows to generate")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; the table shows the best and all")
    ap.add_argument("--emb-optimizer", default="exact_rowwise_adagrad",
                    choices=["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd", "adam", "partial_rowwise_adam",
                             "lamb", "partial_rowwise_lamb"], help="optimizer.embedding.type")
    ap.add_argument("--emb-lr", type=float, default=None, help="optimizer.embedding.lr (default 0.05; Adam family 0.001)")
    a = ap.parse_args()
    emb_lr = a.emb_lr if a.emb_lr is not None else (0.001 if "adam" in a.emb_optimizer or "lamb" in a.emb_optimizer else 0.05)
    batch = 2048
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        from dlrmctl.data.synthetic import generate_synthetic

        generate_synthetic(data, rows=a.rows, seed=0, num_embeddings=[100_000] * 26)
        cfg = os.path.join(tmp, "bench.yaml")
        with open(cfg, "w") as f:
            f.write(f"""name: bench
data: {{path: {data}, batch_size: {batch}, eval_batch_size: 16384, num_samples: {a.steps * batch + batch}}}
model:
  embedding_dim: 64
  dense_arch_layer_sizes: [512, 256, 64]
  over_arch_layer_sizes: [512, 256, 1]
optimizer:
  embedding: {{type: {a.emb_optimizer}, lr: {emb_lr}}}
  dense: {{type: adagrad, lr: 0.05}}
train: {{epochs: 1, log_every: 1, progress: false}}
""")
        rows = []
        for w in [int(x) for x in a.worlds.split(",")]:
            for p in a.pipelines.split(","):
                tries = []
                for _ in range(a.repeat):
                    res = run(cfg, data, os.path.join(tmp, "runs"), w, p, a.steps, a.kernel, a.sharding if w > 1 else None)
                    tries.append(steady(res["records"], a.warmup, batch))
                    print(f"world {w} {p:<11} {tries[-1][0]:>10,.0f} samples/s", file=sys.stderr, flush=True)
                sps, dw, cw = max(tries)
                rows.append((w, p, sps, dw, cw, [t[0] for t in tries]))
    print(f"\nCriteo-shaped DLRM: 26 x 100,000 x 64, bottom 512-256-64, top 512-256-1, global batch {batch}, "
          f"{a.kernel} kernel, embedding optimizer {a.emb_optimizer} (lr {emb_lr}); {a.steps} steps, first {a.warmup} excluded; "
          f"{os.cpu_count()} CPU cores\n")
    print("| world size | pipeline | samples/s (best) | all runs | waiting on data | waiting on input_dist |")
    print("|---:|---|---:|---|---:|---:|")
    for w, p, sps, dw, cw, all_ in rows:
        note = " (no input_dist on 1 rank: same as base)" if w == 1 and p == "sparse_dist" else ""
        print(f"| {w} | {p}{note} | {sps:,.0f} | {', '.join(f'{x:,.0f}' for x in all_)} | {100 * dw:.1f}% | {100 * cw:.1f}% |")


if __name__ == "__main__":
    main()
