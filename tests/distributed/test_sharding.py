"""Sharded EmbeddingBagCollection == single-process EmbeddingBagCollection, on 2-4 gloo ranks.

Each world size is spawned once (``_results``) and runs every case of the
matrix inside the same process group; each case is then reported as its own
test.  A case: the same tables (sum and mean pooling, rows not divisible by
the world size, fewer rows than ranks, a dim that is not a multiple of 4), a
sharding plan, weighted or not; three optimizer steps on global batches of
uneven size (ranks get slices differing by one; the last batch is smaller and
leaves a rank with no sample at all); random bag lengths including empty bags
and a bag whose ids span all row shards under mean pooling.  Checked: every
rank's pooled output at every step, and every table's gathered weights and
every rank's shards with their optimizer moments after the three steps, against
the reference started from the same weights (loaded with ``load_full_weights``),
atol 1e-5.  Optimizers: row-wise Adagrad / Adagrad / SGD, and the Adam family
(``adam`` on all six types; ``partial_rowwise_adam``, ``lamb``, ``partial_rowwise_lamb``
on a row_wise / table_wise / data_parallel / table_row_wise plan).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch

try:  # tests/ as a package or as a plain directory on sys.path
    from tests.dist_utils import run_multiprocess
except ImportError:  # pragma: no cover
    from dist_utils import run_multiprocess
from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

pytestmark = pytest.mark.multiprocess

ATOL = 1e-5

TABLES = [
    # two features, 10 rows (not divisible by 3, 4)
    EmbeddingBagConfig(name="t_sum", num_embeddings=10, embedding_dim=8, feature_names=["f_a", "f_b"], pooling="sum"),
    EmbeddingBagConfig(name="t_mean", num_embeddings=23, embedding_dim=12, feature_names=["f_c"], pooling="mean"),
    # fewer rows than ranks at 4 -> empty row shard
    EmbeddingBagConfig(name="t_tiny", num_embeddings=3, embedding_dim=4, feature_names=["f_d"], pooling="mean"),
    # dim 6: dense kernel inside TBE lookups
    EmbeddingBagConfig(name="t_odd", num_embeddings=9, embedding_dim=6, feature_names=["f_e"], pooling="sum"),
]

ALL_TYPES = ["data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"]


@dataclass
class Case:
    name: str
    types: str | dict
    weighted: bool = False
    kernels: dict = field(default_factory=dict)
    opt: str = "exact_rowwise_adagrad"
    lws: int | None = None
    column_sizes: dict | None = None
    ranks: dict | None = None
    reduce_scatter: bool | None = None
    batch_sizes: list | None = None
    twrw_hierarchical: bool | None = None


def cases(ws: int) -> list[Case]:
    out = []
    lws = 2 if ws == 4 else ws
    for st in ALL_TYPES:
        for weighted in (False, True):
            kernels = {"t_mean": "dense"} if weighted else {"t_sum": "dense"}
            opt = "exact_adagrad" if "column" in st else "exact_rowwise_adagrad"
            tag = "weighted" if weighted else "unweighted"
            out.append(Case(f"{st}_{tag}_on_{ws}_ranks", st, weighted, kernels, opt, lws=lws if st.startswith("table_") and st != "table_wise" else None))
    mixed = {"t_sum": "row_wise", "t_mean": "table_wise", "t_tiny": "data_parallel", "t_odd": "column_wise"}
    out.append(Case(f"mixed_plan_rw_tw_dp_cw_with_two_column_shards_on_one_rank_on_{ws}_ranks", mixed, True,
                    {"t_mean": "dense"}, "exact_adagrad", column_sizes={"t_odd": [2, 3, 1]}, ranks={"t_odd": [0, 1, 0]}))
    if ws == 4:
        mixed4 = {"t_sum": "table_row_wise", "t_mean": "table_column_wise", "t_tiny": "row_wise", "t_odd": "table_wise"}
        out.append(Case("mixed_plan_twrw_twcw_rw_tw_on_2_hosts_x_2", mixed4, False, {}, "exact_adagrad", lws=2))
        # table_row_wise across hosts: the two-level output dist is the default; the flat one
        # stays correct; hosts of one rank; tables on some ranks of a host only (hosts whose
        # ranks hold different columns)
        out.append(Case("table_row_wise_flat_output_dist_on_2_hosts_x_2", "table_row_wise", True,
                        {"t_mean": "dense"}, lws=2, twrw_hierarchical=False))
        out.append(Case("table_row_wise_hierarchical_on_4_hosts_of_1_rank", "table_row_wise", True,
                        {"t_mean": "dense"}, lws=1, twrw_hierarchical=True))
        out.append(Case("table_row_wise_hierarchical_on_part_of_each_host", "table_row_wise", False,
                        {"t_sum": "dense"}, "adam", lws=2,
                        ranks={"t_sum": [0], "t_mean": [2, 3], "t_tiny": [1], "t_odd": [3]}))
    # the Adam family: adam (per-element moments) on every type, column kinds included; the
    # optimizers with per-row state / a per-row norm (which the planner keeps off column kinds)
    # on a plan of every other type
    for i, st in enumerate(ALL_TYPES):
        out.append(Case(f"{st}_adam_on_{ws}_ranks", st, i % 2 == 0, {}, "adam",
                        lws=lws if st.startswith("table_") and st != "table_wise" else None))
    no_cols = {"t_sum": "row_wise", "t_mean": "table_wise", "t_tiny": "data_parallel", "t_odd": "table_row_wise"}
    for opt in ("partial_rowwise_adam", "lamb", "partial_rowwise_lamb"):
        out.append(Case(f"rw_tw_dp_twrw_{opt}_on_{ws}_ranks", no_cols, True, {}, opt, lws=lws))
    if ws == 2:
        out.append(Case("row_wise_reduce_scatter_collective_on_2_ranks", "row_wise", False, {}, reduce_scatter=True,
                        batch_sizes=[6, 4, 8]))
        out.append(Case("row_wise_sgd_fused_only_on_2_ranks", "row_wise", True, {}, "exact_sgd"))
    if ws <= 2:  # the two-level output dist forced on one host (one rank: what tests/modules/test_cuda.py runs)
        out.append(Case(f"table_row_wise_hierarchical_forced_on_one_host_of_{ws}", "table_row_wise", True,
                        {"t_mean": "dense"}, lws=ws, twrw_hierarchical=True))
    return out


def _global_batch(gen: torch.Generator, B: int, weighted: bool):
    from dlrmctl.sparse import KeyedJaggedTensor

    keys, rows = [], []
    for t in TABLES:
        for f in t.feature_names:
            keys.append(f)
            rows.append(t.num_embeddings)
    lengths = torch.randint(0, 4, (len(keys), B), generator=gen)
    if B:
        lengths[keys.index("f_c"), 0] = 3  # a mean-pooled bag spanning every row shard
        lengths[keys.index("f_d"), B - 1] = 0  # an empty mean-pooled bag
        lengths[keys.index("f_a"), B // 2] = 0  # an empty sum-pooled bag
    vals = []
    for i, n in enumerate(rows):
        v = torch.randint(0, n, (int(lengths[i].sum()),), generator=gen)
        if i == keys.index("f_c") and B:
            v[:3] = torch.tensor([0, 11, 22])
        vals.append(v)
    values = torch.cat(vals)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys, values, lengths=lengths.reshape(-1), weights=weights)


def _slice(kjt, start: int, end: int):
    """Samples [start, end) of a KJT (what the loader gives one rank)."""
    from dlrmctl.sparse import KeyedJaggedTensor

    F, B = len(kjt.keys()), kjt.stride()
    l2 = kjt.lengths_2d()
    offs = kjt.offsets()
    vals, ws = [], []
    for f in range(F):
        s, e = int(offs[f * B + start]), int(offs[f * B + end])
        vals.append(kjt.values()[s:e])
        if kjt.weights_or_none() is not None:
            ws.append(kjt.weights()[s:e])
    return KeyedJaggedTensor(kjt.keys(), torch.cat(vals), lengths=l2[:, start:end].reshape(-1),
                             weights=torch.cat(ws) if ws else None, stride=end - start)


def local_range(B: int, ws: int, rank: int) -> tuple[int, int]:
    """The loader's split: rank slices differing by at most one sample."""
    base, rem = divmod(B, ws)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def run_case(env, case: Case) -> str | None:
    """Run ``case`` on this rank of ``env``: None when the sharded module matches the unsharded one,
    else what differs (also what tests/modules/test_cuda.py runs on one rank)."""
    from types import SimpleNamespace

    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.optim.dense import ensure_optimizer_state
    from dlrmctl.train.checkpoint import local_embedding_shards
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    ws, rank = env.world_size, env.rank
    spec = EmbeddingOptimizerSpec(case.opt, lr=0.1, eps=1e-8)
    plan = plan_from_types(TABLES, case.types, ws, case.lws, case.kernels, case.column_sizes, case.ranks)
    sebc = ShardedEmbeddingBagCollection(TABLES, plan, env, case.weighted, spec, seed=3,
                                         reduce_scatter=case.reduce_scatter,
                                         twrw_hierarchical=case.twrw_hierarchical)
    if case.twrw_hierarchical is None and plan.world_size > plan.local_world_size > 1 and any(
            plan.plan[t.name].sharding_type.value == "table_row_wise" for t in TABLES):
        if not sebc._own_out:  # the default across hosts: the two-level output dist
            return "table_row_wise across hosts did not take the hierarchical output dist"
    ref = EmbeddingBagCollection(TABLES, is_weighted=case.weighted, compute_kernel="fused", optimizer=spec, seed=3)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, w in ref.embedding_weights().items():
            w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
    sebc.load_full_weights({k: v.detach().clone() for k, v in ref.embedding_weights().items()})
    full0 = sebc.gather_full_weights()
    for name, w in ref.embedding_weights().items():
        if not torch.equal(full0[name].cpu(), w.detach()):
            return f"load_full_weights/gather_full_weights round trip differs for {name}"
    ref_dense = ref.lookup.dense_parameters()
    ref_opt = embedding_optimizer_for_dense(ref_dense, case.opt, 0.1, 1e-8, 0.0) if ref_dense else None
    sp = sebc.embedding_dense_parameters()
    s_opt = embedding_optimizer_for_dense(sp, case.opt, 0.1, 1e-8, 0.0) if sp else None
    batch_sizes = case.batch_sizes or [3 * ws + 1, 2 * ws, ws - 1]
    for step, Bg in enumerate(batch_sizes):
        kjt = _global_batch(gen, Bg, case.weighted)
        D = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
        grad = torch.randn(Bg, D, generator=gen)
        s, e = local_range(Bg, ws, rank)
        out = sebc(_slice(kjt, s, e).to(env.device)).values()
        ref_out = ref(kjt).values()
        if out.shape != (e - s, D):
            return f"step {step}: output shape {tuple(out.shape)}, expected {(e - s, D)}"
        err = (out.detach().cpu() - ref_out[s:e]).abs().max().item() if e > s else 0.0
        if err > ATOL:
            return f"step {step}: pooled output differs by {err:.3g} on rank {rank}"
        ((out * grad[s:e].to(out.device)).sum() / Bg).backward()
        out = out.detach().cpu()
        ((ref_out * grad).sum() / Bg).backward()
        sebc.sync_replicated_grads()
        for opt in (s_opt, ref_opt):
            if opt is not None:
                opt.step()
                opt.zero_grad()
    full = sebc.gather_full_weights()
    ref_w = ref.embedding_weights()
    for name, w in ref_w.items():
        err = (full[name].cpu() - w.detach()).abs().max().item()
        if err > ATOL:
            return f"after {len(batch_sizes)} steps: table {name} weights differ by {err:.3g}"
    # every rank's own shards too (data_parallel replicas must all stay equal to the reference),
    # and their optimizer moments: per-element ones are the reference's block, per-row ones its rows
    # (except on a column shard, which keeps its own per-row state by design)
    ensure_optimizer_state(s_opt)
    ref_states = {n: st for n, _, _, _, st in local_embedding_shards(SimpleNamespace(sparse_arch=ref), ref_opt)}
    for name, shards in sebc.local_shards(s_opt).items():
        D = ref_w[name].shape[1]
        for m, w, states in shards:
            (r0, c0), (nr, nc) = m.offsets, m.sizes
            err = (w.detach().cpu() - ref_w[name].detach()[r0 : r0 + nr, c0 : c0 + nc]).abs().max().item() if w.numel() else 0.0
            if err > ATOL:
                return f"after {len(batch_sizes)} steps: rank {rank}'s shard {m.to_dict()} of {name} differs by {err:.3g}"
            if not w.numel():
                continue
            if len(states) != len(ref_states[name]):
                return f"rank {rank}'s shard {m.to_dict()} of {name}: {len(states)} optimizer states, expected {len(ref_states[name])}"
            for i, (st, rs) in enumerate(zip(states, ref_states[name])):
                if st.dim() == 2:
                    want = rs[r0 : r0 + nr, c0 : c0 + nc]
                elif nc == D:
                    want = rs[r0 : r0 + nr]
                else:
                    continue
                err = (st.detach().cpu() - want.detach().cpu()).abs().max().item()
                if err > ATOL * max(1.0, want.abs().max().item()):
                    return f"rank {rank}'s shard {m.to_dict()} of {name}: optimizer state {i} differs by {err:.3g}"
    return None


def _parity_worker(env, case_list: list[Case], permute_path: str = "fbgemm") -> dict[str, str | None]:
    import traceback

    from dlrmctl.sparse import permute

    permute.USE_FBGEMM = permute_path == "fbgemm"  # "torch": the GPU machine's path (no FBGEMM)
    out = {}
    for c in case_list:
        try:
            out[c.name] = run_case(env, c)
        except Exception:  # noqa: BLE001 - keep the process group in step? a failure here is fatal anyway
            out[c.name] = traceback.format_exc()
            break
    return out


@functools.lru_cache(maxsize=None)
def _results(ws: int, permute_path: str = "fbgemm") -> dict[str, str | None]:
    per_rank = run_multiprocess(_parity_worker, ws, cases(ws), permute_path, timeout_s=240)
    merged: dict[str, str | None] = {}
    for c in cases(ws):
        errs = [f"rank {r}: {res.get(c.name, 'not run (an earlier case failed)')}" for r, res in enumerate(per_rank)
                if res.get(c.name, "missing") is not None]
        merged[c.name] = "\n".join(errs) or None
    return merged


@pytest.mark.skipif(not HAS_FBGEMM, reason="reference uses the fused kernel")
@pytest.mark.parametrize("permute_path", ["fbgemm", "torch"])
@pytest.mark.parametrize("ws,case", [(ws, c.name) for ws in (2, 3, 4) for c in cases(ws)], ids=lambda x: str(x))
def test_sharded_ebc_matches_single_process_reference(ws, case, permute_path):
    err = _results(ws, permute_path)[case]
    assert err is None, err


# ----------------------------------------------------------------- DLRM level
def _dlrm_tables():
    return [
        EmbeddingBagConfig(name="c0", num_embeddings=40, embedding_dim=8, feature_names=["s0"], pooling="sum"),
        EmbeddingBagConfig(name="c1", num_embeddings=17, embedding_dim=8, feature_names=["s1"], pooling="mean"),
        EmbeddingBagConfig(name="c2", num_embeddings=11, embedding_dim=8, feature_names=["s2"], pooling="sum"),
        EmbeddingBagConfig(name="c3", num_embeddings=25, embedding_dim=8, feature_names=["s3"], pooling="sum"),
    ]


def _build_dlrm(seed: int):
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec

    torch.manual_seed(seed)
    spec = EmbeddingOptimizerSpec("exact_adagrad", lr=0.05)
    ebc = EmbeddingBagCollection(_dlrm_tables(), compute_kernel="fused", optimizer=spec, seed=seed)
    return DLRM(ebc, 5, [16, 8], [16, 1], num_sparse_features=4, embedding_dim=8), spec


def _dlrm_batch(gen, B):
    from dlrmctl.sparse import KeyedJaggedTensor

    tables = _dlrm_tables()
    lengths = torch.randint(0, 3, (len(tables), B), generator=gen)
    vals = [torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=gen) for i, t in enumerate(tables)]
    kjt = KeyedJaggedTensor([t.feature_names[0] for t in tables], torch.cat(vals), lengths=lengths.reshape(-1))
    return torch.randn(B, 5, generator=gen), kjt, torch.randint(0, 2, (B,), generator=gen).float()


def _dlrm_worker(env, batch_sizes, permute_path="fbgemm"):
    import torch.distributed as dist
    import torch.nn.functional as Fn

    from dlrmctl.sparse import permute

    permute.USE_FBGEMM = permute_path == "fbgemm"

    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import DistributedModelParallel, plan_from_types
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    types = {"c0": "row_wise", "c1": "table_wise", "c2": "data_parallel", "c3": "column_wise"}
    plan = plan_from_types(_dlrm_tables(), types, env.world_size)
    runs = {}
    for label, e, p in (("ref", ShardingEnv.single(), None), ("dmp", env, plan)):
        module, spec = _build_dlrm(7)
        dmp = DistributedModelParallel(module, e, p, spec, seed=7)
        dense_opt = torch.optim.Adagrad(dmp.dense_parameters(), lr=0.05)
        edp = dmp.embedding_dense_parameters()
        emb_opt = embedding_optimizer_for_dense(edp, spec.type, spec.lr, spec.eps, 0.0) if edp else None
        gen = torch.Generator().manual_seed(99)
        losses = []
        for step, Bg in enumerate(batch_sizes):
            dense, kjt, labels = _dlrm_batch(gen, Bg)
            s, t = (0, Bg) if label == "ref" else local_range(Bg, env.world_size, env.rank)
            if step == 1:  # the pipelined trainer's split API
                kt = dmp.compute_and_output_dist(dmp.sparse_input_dist(_slice(kjt, s, t)).wait())
                logits = dmp.dense_forward(dense[s:t], kt)
            else:
                logits = dmp(dense[s:t], _slice(kjt, s, t))
            loss = Fn.binary_cross_entropy_with_logits(logits.squeeze(1), labels[s:t], reduction="sum") / Bg
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            if emb_opt is not None:
                emb_opt.step()
                emb_opt.zero_grad()
            total = loss.detach().clone()
            if label == "dmp":
                dist.all_reduce(total)
            losses.append(total.item())
        sa = dmp.sparse_arch
        emb = sa.gather_full_weights() if label == "dmp" else {k: v.detach().clone() for k, v in sa.embedding_weights().items()}
        runs[label] = (losses, emb, [p.detach().clone() for p in dmp.dense_parameters()])
    return runs


@pytest.mark.parametrize("permute_path", ["fbgemm", "torch"])
def test_dlrm_on_2_ranks_matches_one_process_losses_and_weights_after_3_steps(permute_path):
    if not HAS_FBGEMM:
        pytest.skip("reference uses the fused kernel")
    res = run_multiprocess(_dlrm_worker, 2, [9, 8, 5], permute_path, timeout_s=120)
    for rank, runs in enumerate(res):
        ref_l, ref_e, ref_d = runs["ref"]
        l, e, d = runs["dmp"]
        assert l == pytest.approx(ref_l, abs=1e-5), f"rank {rank}: losses {l} vs {ref_l}"
        for k in ref_e:
            torch.testing.assert_close(e[k], ref_e[k], atol=ATOL, rtol=0, msg=f"rank {rank}: table {k}")
        for i, (a, b) in enumerate(zip(d, ref_d)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"rank {rank}: dense param {i}")


# ------------------------------------------------------------------- NCCL (GPU only)
def _nccl_worker(env):
    return run_case(env, Case("nccl_mixed", {"t_sum": "row_wise", "t_mean": "table_wise",
                                              "t_tiny": "data_parallel", "t_odd": "column_wise"}, True, {}, "exact_adagrad"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_mixed_plan_matches_reference_on_2_gpus():
    res = run_multiprocess(_nccl_worker, 2, timeout_s=240, backend="nccl")
    assert res == [None, None], res
