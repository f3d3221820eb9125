#!/usr/bin/env python
"""Training throughput of a Criteo-shaped DLRM on this machine (CPU).

Model (issue "Pipelined training"): 26 tables x 100,000 rows x dim 64,
bottom MLP 13-512-256-64, top MLP 512-256-1, dot interaction, global batch
2048, fused row-wise Adagrad (FBGEMM TBE).  Runs world size 1 and 2 (gloo,
through ``dlrmctl train --nproc``, i.e. torchx) with the ``base`` and
``sparse_dist`` pipelines, and prints a markdown table of samples/s (global,
steady state: the first ``--warmup`` steps are excluded) with the share of
step time spent waiting on data and on the input_dist all-to-all.

    python scripts/bench_train.py [--steps 60] [--warmup 10] [--worlds 1,2] [--variants fp32,fp32_onednn,bf16,comm_bf16]
                                  [--emb-optimizer adam]

Rows per ``--variants``: ``fp32`` (``train.cpu_linear: aten``, MKL's sgemm); ``fp32_onednn`` (``train.cpu_linear: onednn``: the MLPs on
oneDNN's fp32 GEMM; its share uses oneDNN's own GEMM rate, measured at start by the same
microbenchmark through ``torch.ops.mkldnn._linear_pointwise``, and a line after the table gives its
share of torch.mm's rate too); ``bf16`` (``train.precision: bf16``, the dense part under
``torch.autocast``); ``comm_bf16`` (``sharding.comm_precision: bf16``, world size > 1 only).
Each row also gives the share of the machine's arithmetic limit:
``samples/s x model FLOPs per sample / GEMM rate``, the GEMM rate measured at start by a
``torch.mm`` microbenchmark (n x n times n x n, ``--gemm-n``, in fp32 and in bf16; bf16 rows use
the bf16 rate).  Model FLOPs per sample (:func:`model_flops_per_sample`, forward + backward,
multiply-add = 2 FLOPs; embedding pooling and element-wise ops are not counted):

* each Linear ``in -> out``: forward ``2 in out``, backward ``2 in out`` for the weight gradient
  and ``2 in out`` for the input gradient (none for the first bottom layer: its input needs no
  gradient);
* dot interaction over ``N = F + 1`` vectors of width ``d``: forward ``T T^T`` = ``2 N^2 d``,
  backward one bmm ``(G + G^T) T`` = ``2 N^2 d`` (dlrmctl's ``_DotInteraction``).

For the bench model: bottom 13-512-256-64, top (64 + 26*27/2 = 415)-512-256-1, N = 27, d = 64:
about 3.16 MFLOP per sample.

Samples/s come from the run's ``metrics.jsonl`` records at step ``--warmup`` and at the last
step; the run writes a train record every ``gcd(--warmup, --steps)`` steps (each one a loss
all-reduce and host read, as ``train.log_every`` does), not every step.

``--emb-optimizer`` picks ``optimizer.embedding.type`` (default ``exact_rowwise_adagrad``,
fused in FBGEMM's CPU TBE; the Adam family runs on the ``dense`` kernel on CPU) and
``--emb-lr`` its lr (default 0.05 for the Adagrads / SGD, 0.001 for the Adam family).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time


BOTTOM = [13, 512, 256, 64]
TOP_HIDDEN = [512, 256, 1]
NUM_TABLES, DIM = 26, 64


def model_flops_per_sample(bottom: list[int], top_hidden: list[int], num_tables: int, dim: int) -> int:
    """Forward + backward FLOPs per sample of the DLRM's GEMMs (formula in the module docstring)."""
    flops = 0
    for i, (a, b) in enumerate(zip(bottom[:-1], bottom[1:])):
        flops += (4 if i == 0 else 6) * a * b  # the first layer's input needs no gradient
    n = num_tables + 1
    top = [dim + num_tables * (num_tables + 1) // 2] + top_hidden
    for a, b in zip(top[:-1], top[1:]):
        flops += 6 * a * b
    return flops + 4 * n * n * dim


def gemm_rate(dtype, n: int, seconds: float = 1.0, onednn: bool = False) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices of ``dtype`` (best of repeated timings);
    ``onednn``: of oneDNN's fp32 linear instead (``torch.ops.mkldnn._linear_pointwise``, what
    ``train.cpu_linear: onednn`` runs)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    if onednn:
        def mm():
            torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    else:
        def mm():
            torch.mm(a, b)
    for _ in range(3):
        mm()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def run(cfg_path: str, data: str, runs: str, world: int, pipeline: str, steps: int, kernel: str,
        sharding: str | None, variant: str = "fp32") -> dict:
    name = f"bench_w{world}_{pipeline}_{kernel}_{variant}"
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", cfg_path, "--overwrite",
           "--set", f"data.path={data}", "--set", f"train.run_dir={runs}", "--set", f"name={name}",
           "--set", f"train.pipeline={pipeline}", "--set", f"train.max_steps={steps}",
           "--set", f"model.compute_kernel={kernel}"]
    if variant == "bf16":
        cmd += ["--set", "train.precision=bf16"]
    elif variant == "fp32_onednn":
        cmd += ["--set", "train.cpu_linear=onednn"]
    elif variant == "fp32":  # MKL's sgemm (F.linear) whatever train.cpu_linear auto picks on this CPU
        cmd += ["--set", "train.cpu_linear=aten"]
    elif variant == "comm_bf16":
        cmd += ["--set", "sharding.comm_precision=bf16"]
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
    ap.add_argument("--variants", default="fp32,bf16,comm_bf16",
                    help="rows per world size and pipeline: fp32, fp32_onednn (train.cpu_linear: onednn), "
                         "bf16 (train.precision), comm_bf16 "
                         "(sharding.comm_precision; world size > 1 only)")
    ap.add_argument("--gemm-n", type=int, default=1024, help="matrix size of the torch.mm GEMM-rate microbenchmark")
    ap.add_argument("--emb-lr", type=float, default=None, help="optimizer.embedding.lr (default 0.05; Adam family 0.001)")
    a = ap.parse_args()
    emb_lr = a.emb_lr if a.emb_lr is not None else (0.001 if "adam" in a.emb_optimizer or "lamb" in a.emb_optimizer else 0.05)
    batch = 2048
    import torch

    from dlrmctl.modules.mlp import onednn_linear_available

    rates = {"fp32": gemm_rate(torch.float32, a.gemm_n), "bf16": gemm_rate(torch.bfloat16, a.gemm_n)}
    if "fp32_onednn" in a.variants.split(","):
        if not onednn_linear_available():
            ap.error("--variants fp32_onednn: this torch build has no oneDNN linear")
        rates["fp32_onednn"] = gemm_rate(torch.float32, a.gemm_n, onednn=True)
    flops = model_flops_per_sample(BOTTOM, TOP_HIDDEN, NUM_TABLES, DIM)
    onednn_note = (f", fp32 oneDNN {rates['fp32_onednn'] / 1e9:,.0f} GFLOP/s (limit {rates['fp32_onednn'] / flops:,.0f})"
                   if "fp32_onednn" in rates else "")
    print(f"GEMM rate (torch.mm {a.gemm_n}^3): fp32 {rates['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {rates['bf16'] / 1e9:,.0f} "
          f"GFLOP/s; model {flops / 1e6:.2f} MFLOP/sample -> limit {rates['fp32'] / flops:,.0f} samples/s fp32, "
          f"{rates['bf16'] / flops:,.0f} bf16{onednn_note}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        from dlrmctl.data.synthetic import generate_synthetic

        generate_synthetic(data, rows=a.rows, seed=0, num_embeddings=[100_000] * 26)
        cfg = os.path.join(tmp, "bench.yaml")
        # a train record (a loss all-reduce and host read) only at the steps steady() reads, not every
        # step: the real default is every 50, and TorchRec's side reads no loss while it is timed
        log_every = math.gcd(a.warmup, a.steps)
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
train: {{epochs: 1, log_every: {log_every}, progress: false}}
""")
        rows = []
        for w in [int(x) for x in a.worlds.split(",")]:
            for p in a.pipelines.split(","):
                for v in a.variants.split(","):
                    if v == "comm_bf16" and w == 1:
                        continue
                    tries = []
                    for _ in range(a.repeat):
                        res = run(cfg, data, os.path.join(tmp, "runs"), w, p, a.steps, a.kernel,
                                  a.sharding if w > 1 else None, v)
                        tries.append(steady(res["records"], a.warmup, batch))
                        print(f"world {w} {p:<11} {v:<9} {tries[-1][0]:>10,.0f} samples/s", file=sys.stderr, flush=True)
                    sps, dw, cw = max(tries)
                    share = sps * flops / rates.get(v, rates["fp32"])
                    rows.append((w, p, v, sps, share, dw, cw, [t[0] for t in tries]))
    print(f"\nCriteo-shaped DLRM: 26 x 100,000 x 64, bottom 512-256-64, top 512-256-1, global batch {batch}, "
          f"{a.kernel} kernel, embedding optimizer {a.emb_optimizer} (lr {emb_lr}); {a.steps} steps, first {a.warmup} excluded; "
          f"{os.cpu_count()} CPU cores; GEMM rate fp32 {rates['fp32'] / 1e9:,.0f} / bf16 {rates['bf16'] / 1e9:,.0f} GFLOP/s "
          f"(torch.mm {a.gemm_n}^3){onednn_note}, model {flops / 1e6:.2f} MFLOP/sample\n")
    print("| world size | pipeline | precision | samples/s (best) | all runs | share of arithmetic limit "
          "| waiting on data | waiting on input_dist |")
    print("|---:|---|---|---:|---|---:|---:|---:|")
    names = {"fp32": "fp32", "bf16": "bf16 (train.precision)", "comm_bf16": "fp32, comm_precision bf16",
             "fp32_onednn": "fp32, train.cpu_linear onednn"}
    for w, p, v, sps, share, dw, cw, all_ in rows:
        note = " (no input_dist on 1 rank: same as base)" if w == 1 and p == "sparse_dist" else ""
        print(f"| {w} | {p}{note} | {names.get(v, v)} | {sps:,.0f} | {', '.join(f'{x:,.0f}' for x in all_)} "
              f"| {100 * share:.0f}% | {100 * dw:.1f}% | {100 * cw:.1f}% |")
    for w, p, v, sps, *_ in rows:
        if v == "fp32_onednn":
            print(f"\nworld size {w} {p} fp32 with train.cpu_linear onednn: {100 * sps * flops / rates['fp32']:.0f}% of the "
                  f"limit by torch.mm's (MKL) fp32 rate; the table's share uses oneDNN's own rate")


if __name__ == "__main__":
    main()
