"""table_row_wise across hosts: the two-level output dist on 4 gloo ranks as 2 hosts x 2.

Checked against the flat scheme (``twrw_hierarchical=False``) on the same ranks, with dense
kernels so that the embedding gradients can be compared: the pooled outputs and the gradients
of the tables (and of a dense layer on top) agree, for an uneven batch (one rank with no sample)
and for every ``comm_precision``; and the bytes each rank hands to the float all-to-alls for
ranks of the *other* host are 1/L of the flat scheme's, forward and backward, and equal the
planner's :attr:`CommBytes.output_inter_host` (the parity with the single-process reference is
in ``test_sharding.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_multiprocess

pytestmark = pytest.mark.multiprocess

L = 2
#: (name, rows, dim, ids per bag); tables go to host 0, 1, 0 (default_ranks: round robin)
SPECS = [("t0", 40, 8, 3), ("t1", 23, 12, 2), ("t2", 7, 4, 1)]
B_EVEN = 4


def _tables():
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"],
                               pooling="mean" if n == "t1" else "sum") for n, r, d, _ in SPECS]


def _batch(rank: int, B: int):
    from dlrmctl.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + rank)
    lengths = torch.tensor([p for *_, p in SPECS for _ in range(B)])
    values = torch.cat([torch.randint(0, r, (B * p,), generator=g) for _, r, _, p in SPECS])
    return KeyedJaggedTensor([f"f_{n}" for n, *_ in SPECS], values, lengths=lengths)


def _run(env, hierarchical: bool, precision: str, B: int, counts: dict, phase: list):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    tables = _tables()
    plan = plan_from_types(tables, "table_row_wise", env.world_size, L, compute_kernel="dense")
    sebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=7, comm_precision=precision,
                                         twrw_hierarchical=hierarchical)
    assert bool(sebc._own_out) == hierarchical
    torch.manual_seed(0)
    head = torch.nn.Linear(sum(d for _, _, d, _ in SPECS), 1)
    phase[0] = "fwd"
    out = sebc(_batch(env.rank, B)).values()
    phase[0] = "bwd"
    head(out).sum().backward()
    grads = {n: p.grad.to_dense().clone() for n, p in sebc.named_parameters() if p.grad is not None}
    return out.detach(), grads, head.weight.grad.clone(), dict(counts)


def _worker(env):
    import torch.distributed as dist

    me = env.rank
    phase = ["fwd"]
    counts: dict = {}
    a2a = dist.all_to_all_single

    def counting(out, inp, out_splits=None, in_splits=None, *a, **k):
        if inp.is_floating_point():
            splits = in_splits if in_splits is not None else [inp.numel() // env.world_size] * env.world_size
            off_host = sum(n for r, n in enumerate(splits) if r // L != me // L)
            counts[phase[0]] = counts.get(phase[0], 0) + off_host * inp.element_size()
        return a2a(out, inp, out_splits, in_splits, *a, **k)

    dist.all_to_all_single = counting
    res = {}
    try:
        for precision in ("fp32", "bf16", "fp16"):
            # even; uneven with rank 2 empty (3, 4, 0, 1)
            for label, B in ((B_EVEN, B_EVEN), ("uneven", 3 - me // 2 * 3 + me % 2)):
                for hier in (False, True):
                    counts.clear()
                    res[precision, label, hier] = _run(env, hier, precision, B, counts, phase)
    finally:
        dist.all_to_all_single = a2a
    return res


@pytest.fixture(scope="module")
def results():
    return run_multiprocess(_worker, 4, local_world_size=L, timeout_s=240)


TOL = {"fp32": 1e-6, "bf16": 2e-2, "fp16": 4e-3}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("batch", [B_EVEN, "uneven"])
def test_two_level_output_dist_equals_the_flat_one(results, precision, batch):
    tol = TOL[precision]
    for rank, res in enumerate(results):
        (o_f, g_f, h_f, _), (o_h, g_h, h_h, _) = res[precision, batch, False], res[precision, batch, True]
        assert o_f.shape == o_h.shape
        scale = max(1.0, o_f.abs().max().item()) if o_f.numel() else 1.0
        assert torch.allclose(o_h, o_f, atol=tol * scale, rtol=tol), f"rank {rank}: outputs differ"
        assert g_f.keys() == g_h.keys() and g_f
        for name in g_f:
            gs = max(1.0, g_f[name].abs().max().item())
            assert torch.allclose(g_h[name], g_f[name], atol=tol * gs, rtol=tol), f"rank {rank}: grad of {name}"
        assert torch.allclose(h_h, h_f, atol=tol * max(1.0, h_f.abs().max().item()), rtol=tol)


def test_bytes_between_hosts_are_one_lth_of_the_flat_scheme_and_what_the_planner_charges(results):
    from dlrmctl.distributed.types import ShardingType
    from dlrmctl.planner.perf import shard_comm_bytes
    from dlrmctl.planner.types import TableSpec

    W = 4
    model = sum(shard_comm_bytes(TableSpec(n, r, d, [float(p)]), ShardingType.TABLE_ROW_WISE, d, L, B_EVEN * W, W,
                                 L).output_inter_host * L  # per table: L shards
                for n, r, d, p in SPECS)
    for precision, elem in (("fp32", 4), ("bf16", 2)):
        for batch in (B_EVEN, "uneven"):
            flat = {k: sum(res[precision, batch, False][3].get(k, 0) for res in results) for k in ("fwd", "bwd")}
            hier = {k: sum(res[precision, batch, True][3].get(k, 0) for res in results) for k in ("fwd", "bwd")}
            assert flat["fwd"] > 0 and flat["fwd"] == flat["bwd"]
            assert hier["fwd"] * L == flat["fwd"] and hier["bwd"] * L == flat["bwd"], (precision, batch)
            if batch == B_EVEN:
                assert hier["fwd"] == model * elem / 4
