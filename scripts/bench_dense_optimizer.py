"""CPU time of the dense kernel's embedding optimizer step (no assertions; not a test).

``--tables`` tables of ``--rows`` x ``--dim`` fp32, each with an uncoalesced sparse gradient of
``--ids`` ids per step (the ``nn.EmbeddingBag(sparse=True)`` gradient: one row per id), skewed ids
(``rows * u ** 3``, ``u`` uniform: many duplicates), the optimizer of
:func:`dlrmctl.optim.dense.embedding_optimizer_for_dense`.  One thread; the figure is the CPU
time of this process per step (``time.process_time``), so the load of other processes on a
shared machine changes it less than wall time.  The gradients are built once: only the
optimizer's step is timed.

Usage: python scripts/bench_dense_optimizer.py [--opt exact_rowwise_adagrad,adam] [--tables 26]
       [--rows 100000] [--dim 64] [--ids 2048] [--steps 5] [--repeat 4]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opt", default="exact_rowwise_adagrad,adam")
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=4)
    a = ap.parse_args()
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = (a.rows, a.dim)
    ids = [(torch.rand(a.ids) ** 3 * a.rows).long() for _ in range(a.tables)]
    grads = [torch.sparse_coo_tensor(i[None], torch.randn(a.ids, a.dim), shape) for i in ids]
    distinct = sum(int(i.unique().numel()) for i in ids) / a.tables
    print(f"{a.tables} tables x {a.rows:,} rows x dim {a.dim}, {a.ids} ids a table ({distinct:,.0f} distinct), 1 thread")
    for opt in a.opt.split(","):
        params = [torch.nn.Parameter(torch.randn(shape) * 0.01) for _ in range(a.tables)]
        o = embedding_optimizer_for_dense(params, opt, 0.05, 1e-8, 0.0)
        times = []
        for r in range(a.repeat + 1):  # the first round warms up (state allocation)
            t0 = time.process_time()
            for _ in range(a.steps):
                for p, g in zip(params, grads):
                    p.grad = g
                o.step()
            if r:
                times.append((time.process_time() - t0) / a.steps * 1e3)
        print(f"{opt}: {' '.join(f'{t:.0f}' for t in times)} ms CPU per step (best {min(times):.0f})")


if __name__ == "__main__":
    main()
