#!/usr/bin/env python
"""Same-run training throughput: dlrmctl against TorchRec 1.8 on the bench model (issue 17).

TorchRec is a benchmark peer, never a dependency of dlrmctl: it runs in its own virtual
environment (``--venv``, default ``.venv-torchrec``, git-ignored), created on first use with
``python3.11 -m venv`` and ``pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0``
(pip resolves TorchRec's own dependencies).  If the venv cannot be created the script exits
with status 2 and says which step failed.

Model (the same as ``scripts/bench_train.py``): 26 tables x 100,000 rows x dim 64 (one id per
feature per sample), bottom MLP 13-512-256-64, top MLP 415-512-256-1, dot interaction, global
batch 2048, BCE-with-logits loss.  TorchRec side: ``torchrec.models.dlrm.DLRM`` wrapped in
``DLRMTrain``; the ``EmbeddingBagCollection``'s parameters get FBGEMM's fused row-wise Adagrad
(lr 0.05) through ``apply_optimizer_in_backward`` and the module is sharded by
``DistributedModelParallel`` on a gloo group (every table ``table_wise``, ``fused``
kernel: FBGEMM's CPU TBE, as dlrmctl's ``fused`` kernel); the dense parameters train with
``torch.optim.Adagrad`` (lr 0.05) through ``KeyedOptimizerWrapper``.  Batches are pre-generated
(``--num-batches`` distinct ones, cycled; uniform ids, dense features N(0, 1), Bernoulli(0.5)
labels), so TorchRec has no loader cost; dlrmctl runs its real loader through
``scripts/bench_train.py``.  Variants: ``fp32``; ``fp32_onednn``: dlrmctl with
``train.cpu_linear: onednn`` (the MLPs on oneDNN's fp32 GEMM) against TorchRec fp32 (a TorchRec fp32
run of its own); and ``bf16``: for TorchRec the forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, for dlrmctl ``train.precision: bf16``.

samples/s = ``(steps - warmup) x 2048 / seconds`` over the steps after ``--warmup``.  Runs
alternate dlrmctl / TorchRec per config, ``--repeat`` times, and the table gives the best and
all runs of each side and the ratio of the bests.

    python scripts/bench_torchrec.py [--venv .venv-torchrec] [--steps 60] [--warmup 10] [--repeat 2]
                                     [--variants fp32,fp32_onednn,bf16] [--worlds 1,2]

World size 1: TorchRec gets the intra-op threads that dlrmctl's side picks at that moment
(``OMP_NUM_THREADS`` when set, else the CPUs left idle by the load: both sides 2 threads on an idle
2-core machine, 1 on a busy one).  World size > 1 (``--worlds``): TorchRec starts one process per rank (gloo, ``OMP_NUM_THREADS=1``,
every table ``table_wise``, ``2048 / world`` samples per rank per step); dlrmctl runs
``bench_train.py --worlds N --sharding table_wise`` (``dlrmctl train --nproc N``, torchrun sets 1
thread per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PIP_SPECS = ["torch==2.13.0", "fbgemm-gpu-cpu==1.8.0", "torchrec==1.8.0"]
BATCH = 2048
NUM_TABLES, ROWS, DIM = 26, 100_000, 64
BOTTOM, TOP = [512, 256, 64], [512, 256, 1]


def ensure_venv(venv: str) -> str:
    """Create ``venv`` with TorchRec 1.8 if it is missing; return its python executable.

    Raises:
        SystemExit(2): ``python3.11 -m venv`` or a pip step failed, or TorchRec does not import
            afterwards (the message, on stderr, names the step and shows the tail of its output).
    """

    def die(msg: str) -> None:
        print(f"bench_torchrec: {msg}", file=sys.stderr)
        sys.exit(2)

    venv = os.path.abspath(venv)  # the import check runs with cwd="/": a relative path would miss
    py = os.path.join(venv, "bin", "python")

    def ok() -> bool:
        return os.path.exists(py) and subprocess.run(
            [py, "-c", "import torchrec, fbgemm_gpu"], capture_output=True, cwd="/").returncode == 0

    if ok():
        return py
    steps = []
    if not os.path.exists(py):
        steps.append(["python3.11", "-m", "venv", venv])
    steps.append([py, "-m", "pip", "install", *PIP_SPECS])
    # torchrec 1.8.0 requires an unpinned ``fbgemm-gpu`` (the CUDA build, newest release), whose
    # ``fbgemm_gpu`` package overwrites fbgemm-gpu-cpu's and then fails to load on a CPU-only
    # torch: drop it and put the CPU build's files back.
    steps.append([py, "-m", "pip", "uninstall", "-y", "fbgemm-gpu"])
    steps.append([py, "-m", "pip", "install", "--force-reinstall", "--no-deps", "fbgemm-gpu-cpu==1.8.0"])
    for cmd in steps:
        print(f"[bench_torchrec] {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            die(f"cannot create the TorchRec venv {venv!r}: `{' '.join(cmd)}` could not "
                     f"start ({e}); python3.11 and a reachable package registry are needed")
        if p.returncode != 0:
            die(f"cannot create the TorchRec venv {venv!r}: `{' '.join(cmd)}` exited "
                     f"{p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    if not ok():
        die(f"the venv {venv!r} was created but `import torchrec, fbgemm_gpu` fails in it")
    return py


# ---------------------------------------------------------------- TorchRec side (runs in the venv)

def torchrec_worker(precision: str, steps: int, warmup: int, num_batches: int, seed: int) -> dict:
    """Train TorchRec's DLRM for ``steps`` steps; return ``{"samples_per_s", "loss"}`` (JSON-able).

    Runs only inside the TorchRec venv (imports torchrec).  ``precision``: ``fp32`` or ``bf16``
    (forward under CPU bf16 autocast; backward and optimizers outside it, as TorchRec's examples).
    Rank and world size come from ``RANK`` / ``WORLD_SIZE`` (default 0 / 1); each rank trains on
    ``2048 / world_size`` samples per step; samples/s is global (rank 0's clock).
    """
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    local_batch = BATCH // world
    torch.manual_seed(seed)
    names = [f"C{i}" for i in range(1, NUM_TABLES + 1)]
    tables = [EmbeddingBagConfig(name=f"t_{n}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[n])
              for n in names]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                           dense_arch_layer_sizes=BOTTOM, over_arch_layer_sizes=TOP,
                           dense_device=torch.device("cpu")))
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    constraints = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                   for t in tables}
    topology = Topology(world_size=world, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=0.05))

    g = torch.Generator().manual_seed(seed + rank)
    batches = []
    for _ in range(num_batches):
        ids = torch.randint(0, ROWS, (NUM_TABLES * local_batch,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=ids,
                                                  lengths=torch.ones(NUM_TABLES * local_batch, dtype=torch.int32))
        batches.append(Batch(dense_features=torch.randn(local_batch, 13, generator=g), sparse_features=kjt,
                             labels=torch.randint(0, 2, (local_batch,), generator=g).float()))

    def step(b):
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = dmp(b)
            loss = loss.float()
        else:
            loss, _ = dmp(b)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        return loss

    t0 = None
    for s in range(steps):
        if s == warmup:
            t0 = time.perf_counter()
        loss = step(batches[s % num_batches])
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"samples_per_s": (steps - warmup) * BATCH / elapsed, "loss": float(loss.detach())}


def run_torchrec(py: str, precision: str, world: int, a, timeout_s: float = 600.0) -> float:
    """One TorchRec run in the venv's python on ``world`` gloo ranks; returns global samples/s.

    World size > 1 starts one process per rank (``OMP_NUM_THREADS=1`` each, as torchrun does
    for dlrmctl).  Raises RuntimeError when a rank fails or runs past ``timeout_s`` seconds.
    """
    import socket

    cmd = [py, os.path.abspath(__file__), "--torchrec-worker", "--precision", precision, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--num-batches", str(a.num_batches)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    if world > 1:
        base["OMP_NUM_THREADS"] = "1"
    elif not os.environ.get("OMP_NUM_THREADS"):
        # the intra-op threads dlrmctl's side picks now (the idle CPUs: 1 on a busy machine), not torch's
        # default of every core, which spins OpenMP against other jobs and made TorchRec 5-10x slower
        from dlrmctl.procs import intra_op_threads

        base["OMP_NUM_THREADS"] = str(intra_op_threads(1)[0])
        print(f"[bench_torchrec] TorchRec at world size 1: OMP_NUM_THREADS={base['OMP_NUM_THREADS']}",
              file=sys.stderr, flush=True)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(base, RANK=str(r)), cwd="/") for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"TorchRec run on {world} ranks ran past {timeout_s:.0f} s: {' '.join(cmd)}")
    def result(out: str) -> dict | None:
        lines = out.strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else None
        except ValueError:
            return None

    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            if p.returncode < 0 and result(out) is not None:
                # TorchRec's gloo teardown sometimes aborts ("terminate called without an active
                # exception", SIGABRT) after the timed steps reported: the figure stands
                print(f"[bench_torchrec] TorchRec rank {r} of {world} exited {p.returncode} after reporting its "
                      f"result (a teardown abort); the result is kept", file=sys.stderr, flush=True)
                continue
            raise RuntimeError(f"TorchRec run failed (rank {r} of {world}, exit {p.returncode}): {' '.join(cmd)}\n"
                               f"{(out + err)[-3000:]}")
    res = result(outs[0][0])
    if res is None:
        raise RuntimeError(f"TorchRec rank 0 printed no result line: {' '.join(cmd)}\n{outs[0][0][-3000:]}")
    return res["samples_per_s"]


# ---------------------------------------------------------------- dlrmctl side (this interpreter)

_GEMM = re.compile(r"GEMM rate .*")


def run_dlrmctl(precision: str, world: int, a) -> tuple[float, str]:
    """One ``scripts/bench_train.py`` run (sparse_dist; all tables table_wise at world size > 1).

    Returns (global samples/s, the GEMM-rate line it printed).  Raises RuntimeError on failure.
    """
    cmd = [sys.executable, os.path.join(HERE, "bench_train.py"), "--worlds", str(world), "--pipelines", "sparse_dist",
           "--variants", precision, "--steps", str(a.steps), "--warmup", str(a.warmup), "--repeat", "1"]
    if world > 1:
        cmd += ["--sharding", "table_wise"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"dlrmctl run failed: {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}")
    row = next(line for line in p.stdout.splitlines() if line.startswith(f"| {world} |"))
    sps = float(row.split("|")[4].replace(",", ""))
    m = _GEMM.search(p.stderr)
    return sps, m.group(0) if m else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-torchrec"), help="TorchRec venv (created if missing)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2, help="alternated runs per side and config")
    ap.add_argument("--variants", default="fp32,bf16", help="fp32, fp32_onednn (dlrmctl with train.cpu_linear: onednn "
                                                            "against TorchRec fp32), bf16 (TorchRec: autocast; dlrmctl: "
                                                            "train.precision)")
    ap.add_argument("--worlds", default="1", help="world sizes, e.g. 1,2 (> 1: gloo, all tables table_wise, "
                                                  "1 thread per rank)")
    ap.add_argument("--num-batches", type=int, default=16, help="distinct pre-generated TorchRec batches, cycled")
    ap.add_argument("--torchrec-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.warmup >= a.steps:
        ap.error(f"--warmup ({a.warmup}) must be below --steps ({a.steps})")
    if a.torchrec_worker:
        print(json.dumps(torchrec_worker(a.precision, a.steps, a.warmup, a.num_batches, seed=0)), flush=True)
        return
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in ("fp32", "fp32_onednn", "bf16")]
    if bad:
        ap.error(f"--variants: unknown {bad}; expected fp32, fp32_onednn and/or bf16")
    py = ensure_venv(a.venv)
    worlds = [int(w) for w in a.worlds.split(",")]
    configs = [(w, v) for w in worlds for v in variants]
    res = {c: {"dlrmctl": [], "torchrec": []} for c in configs}
    gemm = ""
    loads: list[float] = []
    from bench_machine import cpu_model, uptime  # scripts/ is sys.path[0]

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {cpu_model()}; uptime at start: {uptime()}",
          flush=True)
    for r in range(a.repeat):
        for w, v in configs:
            l0 = os.getloadavg()[0]
            sps, line = run_dlrmctl(v, w, a)
            gemm = gemm or line
            res[w, v]["dlrmctl"].append(sps)
            l1 = os.getloadavg()[0]
            print(f"[{r}] ws{w} dlrmctl  {v:<5} {sps:>10,.0f} samples/s (1-min load average {l0:.2f} -> {l1:.2f})",
                  file=sys.stderr, flush=True)
            sps = run_torchrec(py, "fp32" if v == "fp32_onednn" else v, w, a)
            res[w, v]["torchrec"].append(sps)
            l2 = os.getloadavg()[0]
            print(f"[{r}] ws{w} torchrec {v:<5} {sps:>10,.0f} samples/s (1-min load average {l1:.2f} -> {l2:.2f})",
                  file=sys.stderr, flush=True)
            loads += [l0, l1, l2]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; uptime at end: {uptime()}; 1-min load average "
          f"between runs {min(loads):.2f}-{max(loads):.2f} (it counts the benchmark's own processes)", flush=True)
    names = {"fp32": ("fp32", "fp32"), "fp32_onednn": ("fp32 (train.cpu_linear: onednn)", "fp32"),
             "bf16": ("bf16 (train.precision)", "bf16 autocast")}
    print(f"\nSame run, {os.cpu_count()} CPU cores; {a.steps} steps, first {a.warmup} excluded; "
          f"{a.repeat} alternated runs per side (best, then all); world size > 1: gloo, all tables table_wise, "
          f"1 thread per rank.\n{gemm}\n")
    print("| config | dlrmctl samples/s | TorchRec samples/s | ratio (best / best) |")
    print("|---|---:|---:|---:|")

    def fmt(xs: list[float]) -> str:
        return f"{max(xs):,.0f} ({', '.join(f'{x:,.0f}' for x in xs)})"

    for w, v in configs:
        d, t = res[w, v]["dlrmctl"], res[w, v]["torchrec"]
        print(f"| ws{w} dlrmctl {names[v][0]} vs TorchRec {names[v][1]} | {fmt(d)} | {fmt(t)} | {max(d) / max(t):.2f}× |")
        if v == "bf16" and (w, "fp32") in res:
            t = res[w, "fp32"]["torchrec"]
            print(f"| ws{w} dlrmctl bf16 (train.precision) vs TorchRec fp32 | {max(d):,.0f} | {max(t):,.0f} "
                  f"| {max(d) / max(t):.2f}× |")


if __name__ == "__main__":
    main()
