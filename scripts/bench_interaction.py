#!/usr/bin/env python
"""The DLRM dot interaction in training: the fused autograd node against the plain autograd ops.

    python scripts/bench_interaction.py [--batch 2048] [--features 26] [--dim 64] [--runs 60]

Times forward + backward of :class:`dlrmctl.modules.dlrm.InteractionArch` (training uses its
``_DotInteraction`` node) and of the same formula written with plain ops under autograd
(``cat -> bmm -> upper-triangle index_select -> cat``, what the node replaced), alternating the two,
and prints the best and median CPU milliseconds of each (``time.process_time``: CPU time of this
process, so other load on the machine disturbs it less than wall time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlrmctl.modules.dlrm import InteractionArch  # noqa: E402
from dlrmctl.sparse import KeyedTensor  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=60)
    a = ap.parse_args(argv)
    B, F, d = a.batch, a.features, a.dim
    arch = InteractionArch(F)
    keys = [f"f{i}" for i in range(F)]
    dense = torch.randn(B, d, requires_grad=True)
    sparse = torch.randn(B, F * d, requires_grad=True)
    w = torch.randn(B, d + F * (F + 1) // 2)

    def fused() -> None:
        arch(dense, KeyedTensor(keys, [d] * F, sparse)).backward(w)

    def plain() -> None:
        t = torch.cat([dense, sparse], 1).view(B, F + 1, d)
        pairs = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, arch.triu_flat)
        torch.cat([dense, pairs], 1).backward(w)

    times: dict[str, list[float]] = {"fused node": [], "plain autograd ops": []}
    for fn in (fused, plain):  # warm-up
        fn()
    for _ in range(a.runs):
        for name, fn in (("fused node", fused), ("plain autograd ops", plain)):
            dense.grad = sparse.grad = None
            t0 = time.process_time()
            fn()
            times[name].append((time.process_time() - t0) * 1e3)
    print(f"dot interaction forward + backward, B {B}, F {F}, d {d}, {a.runs} alternated runs (CPU ms):")
    for name, ts in times.items():
        print(f"  {name:<20} best {min(ts):6.2f}  median {statistics.median(ts):6.2f}")


if __name__ == "__main__":
    main()
