"""Host time of the sharded EBC's input dist per step (no assertions; not a test).

Model: demo-like (configs/demo.yaml's shape): 26 tables of dim 16, one feature each, Zipf-ish
sizes from 40 to 400,000 rows; the planner-like mix on 2 ranks: the 4 largest row_wise, the 6
smallest data_parallel, 2 column_wise, the rest table_wise.  Local batch ``--batch-size``
(1024, the demo's) with 1 to 3 ids per bag, weighted off.  ``--world-size`` gloo ranks, one
thread each.

A step is ``ebc.input_dist(kjt).wait()``: the size all-to-all and its one host read, the send
buffer, the data all-to-all and the lookup KJTs.  On the CPU everything is host time.  Printed:
rank 0's median wall ms per step, and its CPU ms per step (``time.process_time``), for each
variant, measured in alternation in the same processes (``--repeat`` rounds of ``--steps``):

* ``fbgemm``: the current code with FBGEMM's ``permute_1D_sparse_data`` (when FBGEMM loads);
* ``torch``: the current code with the torch gather (``dlrmctl.sparse.permute.USE_FBGEMM =
  False``; the GPU machine's path, which has no FBGEMM);
* ``rev``: with ``--compare-rev REV``, ``dlrmctl/distributed/sharded_ebc.py`` as it was at git
  revision ``REV`` (loaded from ``git show``; it uses the sharding classes' per-destination
  ``input_dist_counts`` / ``input_dist_chunks`` / ``input_dist_recv``, which remain).

Usage: python scripts/bench_input_dist.py [--world-size 2] [--batch-size 1024] [--steps 200]
       [--repeat 5] [--compare-rev REV]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tables():
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    rows = [int(40 * (400_000 / 40) ** (i / 25)) for i in range(26)]
    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=16, feature_names=[f"f{i}"])
            for i, r in enumerate(rows)]


def _types(n: int) -> dict[str, str]:
    out = {}
    for i in range(n):
        out[f"t{i}"] = ("data_parallel" if i < 6 else "column_wise" if i in (10, 11) else
                        "row_wise" if i >= n - 4 else "table_wise")
    return out


def _old_module(rev: str, tmp: str):
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:dlrmctl/distributed/sharded_ebc.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tmp, "sharded_ebc_rev.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("sharded_ebc_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sharded_ebc_rev"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _rank_main(rank: int, args: argparse.Namespace, port: int, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.sparse import KeyedJaggedTensor, permute

    ws = args.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    env = ShardingEnv(ws, rank, dist.group.WORLD)
    tables = _tables()
    plan = plan_from_types(tables, _types(len(tables)), ws)
    variants = {"fbgemm": ShardedEmbeddingBagCollection, "torch": ShardedEmbeddingBagCollection}
    if not permute.fbgemm_permute_available():
        del variants["fbgemm"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare_rev:
            variants["rev"] = _old_module(args.compare_rev, tmp).ShardedEmbeddingBagCollection
        ebcs = {k: cls(tables, plan, env, seed=0, check_ids=False) for k, cls in variants.items()}
    g = torch.Generator().manual_seed(rank)
    B, F = args.batch_size, len(tables)
    batches = []
    for _ in range(8):
        lengths = torch.randint(1, 4, (F * B,), generator=g)
        ids = torch.cat([torch.randint(0, t.num_embeddings, (int(n),), generator=g)
                         for t, n in zip(tables, lengths.view(F, B).sum(1))])
        batches.append(KeyedJaggedTensor([f"f{i}" for i in range(F)], ids, lengths=lengths).sync())
    wall: dict[str, list[float]] = {k: [] for k in ebcs}
    cpu: dict[str, list[float]] = {k: [] for k in ebcs}
    for rep in range(args.repeat + 1):  # round 0: warm-up
        for name, ebc in ebcs.items():
            permute.USE_FBGEMM = name != "torch"
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(args.steps):
                ebc.input_dist(batches[s % len(batches)]).wait()
            if rep:
                wall[name].append((time.perf_counter() - t0) * 1e3 / args.steps)
                cpu[name].append((time.process_time() - c0) * 1e3 / args.steps)
    q.put((rank, wall, cpu))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--compare-rev", default=None, help="git revision whose sharded_ebc.py is timed too")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, q)) for r in range(args.world_size)]
    for pr in procs:
        pr.start()
    res = dict((r, (w, c)) for r, w, c in (q.get(timeout=900) for _ in procs))
    for pr in procs:
        pr.join()
    wall, cpu = res[0]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; world size {args.world_size}, local batch {args.batch_size}, "
          f"{args.repeat} rounds x {args.steps} steps, rank 0")
    base = statistics.median(wall["rev"]) if "rev" in wall else None
    for name in wall:
        mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
        rel = f"  {mw / base:.2f}x of rev" if base else ""
        print(f"{name:>7}: wall {mw:.3f} ms/step (rounds {', '.join(f'{x:.3f}' for x in wall[name])}), "
              f"CPU {mc:.3f} ms/step{rel}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
