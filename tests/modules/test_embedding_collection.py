"""EmbeddingCollection (unpooled lookups) and ShardedEmbeddingCollection.

* unsharded: ``fused`` (FBGEMM sequence TBE) == ``dense`` (nn.Embedding) forward and
  updates over three steps, every embedding optimizer, duplicate ids and empty bags;
  rows == ``weight[ids]``; TorchRec's API (names, signature, ``embeddings.<t>.weight``,
  ``need_indices``); refusals.
* sharded table_wise / row_wise / column_wise (and a mix) on 2 and 3 gloo ranks
  against the single-process EmbeddingCollection: every rank's output at every
  step and every table's weights after three fused optimizer steps; uneven local
  batches, empty bags, duplicate ids, a last batch leaving a rank with no sample,
  fewer rows than ranks, a column shard narrower than 4 (dense inside fused).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import pytest
import torch

try:  # tests/ as a package or as a plain directory on sys.path
    from tests.dist_utils import run_multiprocess
except ImportError:  # pragma: no cover
    from dist_utils import run_multiprocess
from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from dlrmctl.modules.embedding_modules import EmbeddingIdError, EmbeddingOptimizerSpec
from dlrmctl.modules.sequence_embeddings import EmbeddingCollection
from dlrmctl.sparse import KeyedJaggedTensor
from dlrmctl.optim.dense import embedding_optimizer_for_dense

KERNELS = ["dense"] + (["fused"] if HAS_FBGEMM else [])
OPTIMIZERS = ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"]
ATOL = 1e-6


def _tables(dim: int = 8) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(num_embeddings=10, embedding_dim=dim, name="t_a", feature_names=["f_a", "f_b"]),
        EmbeddingConfig(num_embeddings=23, embedding_dim=dim, name="t_b", feature_names=["f_c"]),
        EmbeddingConfig(num_embeddings=2, embedding_dim=dim, name="t_tiny", feature_names=["f_d"]),
    ]


def _global_batch(gen: torch.Generator, B: int, tables) -> KeyedJaggedTensor:
    """Random bags (0-3 ids) with forced duplicates and empty bags."""
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 4, (len(keys), B), generator=gen)
    if B:
        lengths[0, 0] = 3  # f_a bag 0: a duplicate id
        lengths[1, B // 2] = 0  # an empty bag
    vals = []
    for i, n in enumerate(rows):
        v = torch.randint(0, n, (int(lengths[i].sum()),), generator=gen)
        if i == 0 and B:
            v[:3] = torch.tensor([7, 7, 9])
        if i == 2 and v.numel() >= 3:
            v[:3] = torch.tensor([0, 11, 22])  # one id in every row shard
        vals.append(v)
    return KeyedJaggedTensor(keys, torch.cat(vals), lengths=lengths.reshape(-1))


def _loss(out: dict, grads: dict) -> torch.Tensor:
    return sum((out[k].values() * grads[k]).sum() for k in out)


def _grads(gen: torch.Generator, out: dict) -> dict:
    return {k: torch.randn(jt.values().shape, generator=gen) for k, jt in out.items()}


# ------------------------------------------------------------------- unsharded
def test_embedding_config_has_torchrecs_fields_in_torchrecs_order():
    names = list(inspect.signature(EmbeddingConfig).parameters)
    assert names == ["num_embeddings", "embedding_dim", "name", "data_type", "feature_names", "weight_init_max",
                     "weight_init_min", "num_embeddings_post_pruning", "init_fn", "need_pos"]
    c = EmbeddingConfig(100, 8, "t0")
    assert c.feature_names == ["t0"] and c.pooling == PoolingType.NONE
    with pytest.raises(ValueError, match="embedding_dim must be an int > 0"):
        EmbeddingConfig(10, 0, "t")
    sig = list(inspect.signature(EmbeddingCollection).parameters)
    assert sig[:3] == ["tables", "device", "need_indices"]


def test_torchrec_import_names():
    import dlrmctl
    import dlrmctl.modules
    from dlrmctl.modules import embedding_configs, embedding_modules

    assert dlrmctl.EmbeddingCollection is EmbeddingCollection is dlrmctl.modules.EmbeddingCollection
    assert embedding_modules.EmbeddingCollection is EmbeddingCollection
    assert dlrmctl.EmbeddingConfig is EmbeddingConfig is embedding_configs.EmbeddingConfig


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_are_the_table_rows_of_each_id_with_input_lengths_and_indices(kernel):
    ec = EmbeddingCollection(_tables(), need_indices=True, compute_kernel=kernel)
    kjt = _global_batch(torch.Generator().manual_seed(0), 5, _tables())
    out = ec(kjt)
    assert list(out) == ["f_a", "f_b", "f_c", "f_d"]
    w = ec.embedding_weights()
    for t in _tables():
        assert ec.embeddings[t.name].weight.shape == (t.num_embeddings, 8)
        for f in t.feature_names:
            jt = out[f]
            assert jt.values().dtype == torch.float32
            torch.testing.assert_close(jt.values(), w[t.name][kjt[f].values()], atol=0, rtol=0)
            assert torch.equal(jt.lengths(), kjt[f].lengths())
            assert torch.equal(jt.weights(), kjt[f].values())
    assert sorted(ec.state_dict()) == ["embeddings.t_a.weight", "embeddings.t_b.weight", "embeddings.t_tiny.weight"]
    assert ec.embedding_configs()[0].name == "t_a" and ec.need_indices() and ec.embedding_dim() == 8
    assert EmbeddingCollection(_tables(), compute_kernel=kernel)(kjt)["f_a"].weights_or_none() is None


@pytest.mark.skipif(not HAS_FBGEMM, reason="needs the fused kernel")
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("dim", [8, 6])
def test_fused_and_dense_kernels_match_forward_and_updates_over_three_steps(opt, dim):
    spec = EmbeddingOptimizerSpec(opt, lr=0.1, eps=1e-8)
    fused = EmbeddingCollection(_tables(dim), compute_kernel="fused", optimizer=spec, seed=5)
    dense = EmbeddingCollection(_tables(dim), compute_kernel="dense", optimizer=spec, seed=5)
    assert (len(fused.lookup.tbes) == 1) == (dim % 4 == 0)  # dim 6: TBE needs multiples of 4 -> dense
    d_opt = embedding_optimizer_for_dense(dense.embedding_dense_parameters(), opt, 0.1, 1e-8, 0.0)
    f_dense = fused.embedding_dense_parameters()
    f_opt = embedding_optimizer_for_dense(f_dense, opt, 0.1, 1e-8, 0.0) if f_dense else None
    for name, w in fused.embedding_weights().items():
        assert torch.equal(w, dense.embedding_weights()[name]), "same deterministic init on both kernels"
    gen = torch.Generator().manual_seed(11)
    for B in (7, 4, 1):
        kjt = _global_batch(gen, B, _tables(dim))
        of, od = fused(kjt), dense(kjt)
        for k in of:
            torch.testing.assert_close(of[k].values(), od[k].values(), atol=ATOL, rtol=0)
        g = _grads(gen, of)
        _loss(of, g).backward()
        _loss(od, g).backward()
        for o in (d_opt, f_opt):
            if o is not None:
                o.step()
                o.zero_grad()
    for name, w in fused.embedding_weights().items():
        torch.testing.assert_close(w.detach(), dense.embedding_weights()[name].detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sgd_step_is_the_textbook_update_with_duplicate_ids_summed(kernel):
    t = [EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])]
    ec = EmbeddingCollection(t, compute_kernel=kernel, optimizer=EmbeddingOptimizerSpec("exact_sgd", lr=0.5))
    opt = embedding_optimizer_for_dense(ec.embedding_dense_parameters(), "exact_sgd", 0.5, 0, 0) if kernel == "dense" else None
    w0 = ec.embedding_weights()["t"].detach().clone()
    kjt = KeyedJaggedTensor(["f"], torch.tensor([3, 3, 1]), lengths=torch.tensor([2, 0, 1]))
    ec(kjt)["f"].values().sum().backward()
    if opt:
        opt.step()
    expect = w0.clone()
    expect[3] -= 0.5 * 2
    expect[1] -= 0.5
    torch.testing.assert_close(ec.embedding_weights()["t"].detach(), expect)


def test_state_dict_round_trip_and_fused_optimizer_lr():
    ec = EmbeddingCollection(_tables(), compute_kernel=KERNELS[-1])
    other = EmbeddingCollection(_tables(), compute_kernel=KERNELS[-1], seed=9)
    other.load_state_dict(ec.state_dict())
    for n, w in ec.embedding_weights().items():
        assert torch.equal(other.embedding_weights()[n], w)
    fo = ec.fused_optimizer()
    fo.set_lr(0.01)
    assert fo.lr == 0.01


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="same embedding dimension.*'t1' has embedding_dim 4 != 8"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0"), EmbeddingConfig(5, 4, "t1")])
    with pytest.raises(ValueError, match="EmbeddingBagConfig"):
        EmbeddingCollection([EmbeddingBagConfig(5, 8, "t0")])
    with pytest.raises(ValueError, match="feature 'f' is looked up in tables 't0' and 't1'"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0", feature_names=["f"]), EmbeddingConfig(5, 8, "t1", feature_names=["f"])])
    with pytest.raises(ValueError, match="duplicate table name"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0"), EmbeddingConfig(5, 8, "t0", feature_names=["g"])])
    ec = EmbeddingCollection([EmbeddingConfig(5, 8, "t0", feature_names=["f"])])
    with pytest.raises(EmbeddingIdError, match="table 't0', feature 'f': id 5"):
        ec(KeyedJaggedTensor(["f"], torch.tensor([1, 5]), lengths=torch.tensor([1, 1])))


@pytest.mark.skipif(not HAS_FBGEMM, reason="compares against FBGEMM's bucketizer")
def test_torch_sequence_bucketize_matches_fbgemm():
    from dlrmctl.distributed.sharded_ec import sequence_bucketize_torch

    gen = torch.Generator().manual_seed(3)
    F, B, W, rows = 2, 5, 3, [10, 7]
    lengths = torch.randint(0, 4, (F * B,), generator=gen)
    vals = torch.cat([torch.randint(0, rows[f], (int(lengths[f * B:(f + 1) * B].sum()),), generator=gen) for f in range(F)])
    blk = [-(-r // W) for r in rows]
    fb = torch.ops.fbgemm.block_bucketize_sparse_features(lengths, vals, False, True, torch.tensor(blk), W, None)
    base = torch.tensor([0, rows[0]])
    starts = torch.tensor([b + r * blk[f] for f, b in enumerate([0, rows[0]]) for r in range(W)])
    ranks = torch.tensor([r for _ in range(F) for r in range(W)])
    # clamp the starts of empty trailing shards to the table end (as RowWiseLikeSharding builds them)
    starts = torch.minimum(starts, torch.tensor([base[f] + rows[f] for f in range(F) for _ in range(W)]))
    lens, local, unb = sequence_bucketize_torch(vals, lengths, F, B, W, base, starts, ranks)
    assert torch.equal(lens.reshape(-1), fb[0]) and torch.equal(local, fb[1]) and torch.equal(unb, fb[4].long())


def test_sharded_ec_refuses_other_sharding_types_naming_the_table():
    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ec import ShardedEmbeddingCollection
    from dlrmctl.distributed.types import PlanError

    tables = _tables()
    for st in ("data_parallel", "table_row_wise", "table_column_wise"):
        plan = plan_from_types(tables, {"t_a": "table_wise", "t_b": st, "t_tiny": "row_wise"}, 1)
        with pytest.raises(PlanError, match=f"table 't_b': sharding type {st} is not supported.*"
                                            "supported: table_wise, row_wise, column_wise"):
            ShardedEmbeddingCollection(tables, plan, ShardingEnv.single())


def test_sharded_ec_on_one_process_without_a_group_matches_the_module():
    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ec import ShardedEmbeddingCollection

    tables = _tables()
    plan = plan_from_types(tables, {"t_a": "table_wise", "t_b": "row_wise", "t_tiny": "column_wise"}, 1)
    sec = ShardedEmbeddingCollection(tables, plan, ShardingEnv.single(), need_indices=True, seed=4)
    ref = EmbeddingCollection(tables, need_indices=True, seed=4, compute_kernel=KERNELS[-1])
    kjt = _global_batch(torch.Generator().manual_seed(2), 6, tables)
    a, b = sec(kjt), ref(kjt)
    for k in b:
        torch.testing.assert_close(a[k].values(), b[k].values(), atol=0, rtol=0)
        assert torch.equal(a[k].lengths(), b[k].lengths()) and torch.equal(a[k].weights(), b[k].weights())


# --------------------------------------------------------------- multi-process
@dataclass
class Case:
    name: str
    types: str | dict
    opt: str = "exact_rowwise_adagrad"
    kernels: dict = field(default_factory=dict)
    column_sizes: dict | None = None
    ranks: dict | None = None
    need_indices: bool = False


def cases(ws: int) -> list[Case]:
    return [
        Case(f"table_wise_on_{ws}_ranks", "table_wise", kernels={"t_b": "dense"}, need_indices=True),
        Case(f"row_wise_on_{ws}_ranks", "row_wise", kernels={"t_a": "dense"}),
        Case(f"row_wise_ranks_reversed_torch_bucketizer_on_{ws}_ranks", "row_wise", "exact_sgd",
             ranks={t.name: list(reversed(range(ws))) for t in _tables()}),
        Case(f"column_wise_on_{ws}_ranks", "column_wise", "exact_adagrad", kernels={"t_tiny": "dense"}),
        Case(f"mixed_tw_rw_cw_two_column_shards_on_one_rank_on_{ws}_ranks",
             {"t_a": "column_wise", "t_b": "row_wise", "t_tiny": "table_wise"}, "exact_sgd",
             column_sizes={"t_a": [4, 2, 2]}, ranks={"t_a": [0, 1, 0]}, need_indices=True),
    ]


def local_range(B: int, ws: int, rank: int) -> tuple[int, int]:
    base, rem = divmod(B, ws)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def _slice(kjt: KeyedJaggedTensor, start: int, end: int) -> KeyedJaggedTensor:
    F, B = len(kjt.keys()), kjt.stride()
    offs = kjt.offsets()
    vals = [kjt.values()[int(offs[f * B + start]):int(offs[f * B + end])] for f in range(F)]
    return KeyedJaggedTensor(kjt.keys(), torch.cat(vals), lengths=kjt.lengths_2d()[:, start:end].reshape(-1),
                             stride=end - start)


def _run_case(env, case: Case) -> str | None:
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ec import ShardedEmbeddingCollection

    tables = _tables()
    ws, rank = env.world_size, env.rank
    spec = EmbeddingOptimizerSpec(case.opt, lr=0.1, eps=1e-8)
    plan = plan_from_types(tables, case.types, ws, None, case.kernels, case.column_sizes, case.ranks)
    sec = ShardedEmbeddingCollection(tables, plan, env, case.need_indices, spec, seed=3)
    ref = EmbeddingCollection(tables, need_indices=case.need_indices, compute_kernel="fused", optimizer=spec, seed=3)
    # each rank initialised its own shards: they must already be the unsharded table's values
    for name, shards in sec.local_shards().items():
        for m, w, _ in shards:
            (r0, c0), (nr, nc) = m.offsets, m.sizes
            if not torch.equal(w.detach().cpu(), ref.embedding_weights()[name].detach()[r0:r0 + nr, c0:c0 + nc]):
                return f"rank {rank}'s initial shard {m.to_dict()} of {name} differs from the unsharded init"
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for w in ref.embedding_weights().values():
            w.copy_(torch.rand(w.shape, generator=gen) - 0.5)
    sec.load_full_weights({k: v.detach().clone() for k, v in ref.embedding_weights().items()})
    s_dense = sec.embedding_dense_parameters()
    s_opt = embedding_optimizer_for_dense(s_dense, case.opt, 0.1, 1e-8, 0.0) if s_dense else None
    batch_sizes = [3 * ws + 1, 2 * ws, ws - 1]  # uneven slices; the last leaves rank ws-1 with no sample
    for step, Bg in enumerate(batch_sizes):
        kjt = _global_batch(gen, Bg, tables)
        s, e = local_range(Bg, ws, rank)
        out = sec(_slice(kjt, s, e))
        ref_out = ref(kjt)
        grads = _grads(gen, ref_out)
        local_grads = {}
        for f, jt in ref_out.items():
            offs = kjt[f].offsets()
            a, b = int(offs[s]), int(offs[e])
            if out[f].values().shape != (b - a, 8):
                return f"step {step}: feature {f}: shape {tuple(out[f].values().shape)}, expected {(b - a, 8)}"
            err = (out[f].values().detach() - jt.values()[a:b].detach()).abs().max().item() if b > a else 0.0
            if err > ATOL:
                return f"step {step}: feature {f}: rows differ by {err:.3g} on rank {rank}"
            if not torch.equal(out[f].lengths(), kjt[f].lengths()[s:e]):
                return f"step {step}: feature {f}: lengths differ on rank {rank}"
            if case.need_indices and not torch.equal(out[f].weights(), kjt[f].values()[a:b]):
                return f"step {step}: feature {f}: need_indices ids differ on rank {rank}"
            local_grads[f] = grads[f][a:b]
        _loss(out, local_grads).backward()
        _loss(ref_out, grads).backward()
        if s_opt is not None:
            s_opt.step()
            s_opt.zero_grad()
    full = sec.gather_full_weights()
    for name, w in ref.embedding_weights().items():
        err = (full[name].cpu() - w.detach()).abs().max().item()
        if err > ATOL:
            return f"after {len(batch_sizes)} steps: table {name} weights differ by {err:.3g}"
    return None


def _parity_worker(env, case_list: list[Case]) -> dict[str, str | None]:
    import traceback

    out = {}
    for c in case_list:
        try:
            out[c.name] = _run_case(env, c)
        except Exception:  # noqa: BLE001 - a failure leaves the group out of step: stop here
            out[c.name] = traceback.format_exc()
            break
    return out


@functools.lru_cache(maxsize=None)
def _results(ws: int) -> dict[str, str | None]:
    per_rank = run_multiprocess(_parity_worker, ws, cases(ws), timeout_s=180)
    merged: dict[str, str | None] = {}
    for c in cases(ws):
        errs = [f"rank {r}: {res.get(c.name, 'not run (an earlier case failed)')}" for r, res in enumerate(per_rank)
                if res.get(c.name, "missing") is not None]
        merged[c.name] = "\n".join(errs) or None
    return merged


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_FBGEMM, reason="reference uses the fused kernel")
@pytest.mark.parametrize("ws,case", [(ws, c.name) for ws in (2, 3) for c in cases(ws)], ids=lambda x: str(x))
def test_sharded_ec_matches_single_process_reference(ws, case):
    err = _results(ws)[case]
    assert err is None, err


# --------------------------------------------------------------------- planner
def _planner_topology():
    from dlrmctl.planner.types import Topology

    return Topology(world_size=4, local_world_size=4, compute_device="cuda", hbm_cap=int(10e9), ddr_cap=int(100e9),
                    hbm_mem_bw=1e12, ddr_mem_bw=1e11, intra_host_bw=1e11, inter_host_bw=1e10)


@pytest.mark.parametrize("st", ["table_wise", "row_wise", "column_wise"])
def test_planner_counts_one_output_row_per_id_for_an_unpooled_table_not_for_a_pooled_one(st):
    from dlrmctl.distributed.types import ComputeKernel, ShardingType
    from dlrmctl.planner.enumerator import build_option
    from dlrmctl.planner.types import TableSpec

    st = ShardingType(st)
    B, d, topo = 1024, 64, _planner_topology()
    cols = [32, 32] if st == ShardingType.COLUMN_WISE else None
    est = {}
    for pooled in (True, False):
        for pf in (1.0, 4.0, 16.0):
            t = TableSpec("t", 1000, d, [pf, 2.0], is_pooled=pooled)
            opt = build_option(topo, t, st, ComputeKernel.FUSED, B, None, cols)
            assert opt.is_pooled == pooled
            est[pooled, pf] = opt
    for pf in (1.0, 4.0, 16.0):
        ec, ebc = est[False, pf].shards[0], est[True, pf].shards[0]
        c = ec.size[1]
        n = 4 if st == ShardingType.ROW_WISE else 1
        # EBC: one pooled row per (sample, feature), whatever the pooling factor
        assert ebc.output_bytes == B * 2 * c * 4
        # EC: one row per id, pooling factor x batch x dim x 4 (a row shard: its share of the ids)
        assert ec.output_bytes == int(B * (pf + 2.0) / n * c * 4)
    for pooled, grows in ((True, False), (False, True)):
        outs = [est[pooled, pf].shards[0].output_bytes for pf in (1.0, 4.0, 16.0)]
        mems = [est[pooled, pf].shards[0].mem for pf in (1.0, 4.0, 16.0)]
        comms = [est[pooled, pf].shards[0].perf.fwd_comms for pf in (1.0, 4.0, 16.0)]
        if grows:
            assert outs[0] < outs[1] < outs[2] and mems[0] < mems[1] < mems[2] and comms[0] < comms[1] < comms[2]
        else:
            assert outs[0] == outs[1] == outs[2]


def test_planner_enumerates_only_the_sharded_ec_types_for_an_unpooled_table():
    from dlrmctl.distributed.sharded_ec import SEQUENCE_SHARDING_CLASSES
    from dlrmctl.distributed.types import ComputeKernel, ShardingType
    from dlrmctl.planner.enumerator import enumerate_options
    from dlrmctl.planner.types import UNPOOLED_SHARDING_TYPES, PlanError, TableSpec

    assert set(UNPOOLED_SHARDING_TYPES) == set(SEQUENCE_SHARDING_CLASSES)
    topo = _planner_topology()
    opts, _ = enumerate_options(TableSpec("t", 1000, 64, [3.0], is_pooled=False), topo, 1024, int(9e9))
    assert {o.sharding_type for o in opts} <= set(UNPOOLED_SHARDING_TYPES) and opts
    pooled, _ = enumerate_options(TableSpec("t", 1000, 64, [3.0]), topo, 1024, int(9e9))
    assert ShardingType.DATA_PARALLEL in {o.sharding_type for o in pooled}
    fixed = TableSpec("t", 1000, 64, [3.0], is_pooled=False,
                      fixed=(ShardingType.DATA_PARALLEL, ComputeKernel.DENSE, None, None))
    with pytest.raises(PlanError, match="data_parallel is not supported for an unpooled"):
        enumerate_options(fixed, topo, 1024, int(9e9))
