"""comm/ pieces on real gloo ranks: the bucketed dense-gradient all-reduce (overlap
with backward, same sums as one bucket) and the int32 input_dist wire format."""

import pytest
import torch

from tests.dist_utils import run_multiprocess

pytestmark = pytest.mark.multiprocess


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def _reducer_worker(env):
    from dlrmctl.distributed.comm import GradBucketReducer, sync_dense_grads

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(env.rank))
    ref_model, model = _mlp(0), _mlp(0)
    ref_model(x).sum().backward()
    sync_dense_grads(list(ref_model.parameters()), env.pg)
    # ~17 KB buckets: several of them, the first ones complete early in backward
    red = GradBucketReducer(list(model.parameters()), env.pg, bucket_cap_mb=0.016)
    out = model(x).sum()

    def arm(g):
        red.arm()
        torch.autograd.Variable._execution_engine.queue_callback(red.finish)
        return g

    out.register_hook(arm)
    out.backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(ref_model.parameters(), model.parameters()))
    # a second backward through the same reducer (state reset between steps)
    for p in model.parameters():
        p.grad = None
    out = model(x).sum()
    out.register_hook(arm)
    out.backward()
    same2 = all(torch.equal(a.grad, b.grad) for a, b in zip(ref_model.parameters(), model.parameters()))
    return len(red.buckets), red.launched_during_backward, same, same2


def test_bucketed_all_reduce_overlaps_backward_and_sums_like_one_bucket():
    for n_buckets, early, same, same2 in run_multiprocess(_reducer_worker, 2, timeout_s=120):
        assert n_buckets >= 3
        assert early >= 1, "no bucket was launched before the end of backward"
        assert same and same2


def _in_bucket(g, flat):
    """``g`` lies inside ``flat``'s storage range (a view of the bucket)."""
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return lo <= g.data_ptr() and g.data_ptr() + g.numel() * g.element_size() <= hi


def _bucket_view_worker(env):
    """Gradient as bucket view: over 4 steps (zero_grad to None, in place, and a parameter without
    a gradient), every ``p.grad`` is a view of its bucket after the reduce, the buffers are never
    reallocated, no ``torch.cat`` runs while reducing, and the sums equal ``sync_dense_grads``'s."""
    from dlrmctl.distributed.comm import GradBucketReducer, sync_dense_grads

    ref_model, model = _mlp(0), _mlp(0)
    # a float64 parameter (its own bucket: one dtype per bucket) and one that never gets a gradient
    ref_model.register_parameter("scale", torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    ref_model.register_parameter("unused", torch.nn.Parameter(torch.zeros(5)))
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(5)))
    red = GradBucketReducer(list(model.parameters()), env.pg, bucket_cap_mb=0.016)
    ptrs = [f.data_ptr() for f in red.flats]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    cats = []
    real_cat = torch.cat

    def counting_cat(*a, **k):
        cats.append(1)
        return real_cat(*a, **k)

    def arm(g):
        red.arm()
        torch.autograd.Variable._execution_engine.queue_callback(red.finish)
        return g

    def loss_of(m, x):
        return m(x).sum() * m.scale.sum().float()

    checks = []
    for step in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + env.rank))
        ref_opt.zero_grad(set_to_none=True)
        loss_of(ref_model, x).backward()
        sync_dense_grads(list(ref_model.parameters()), env.pg)
        opt.zero_grad(set_to_none=step % 2 == 0)
        out = loss_of(model, x)
        out.register_hook(arm)
        torch.cat = counting_cat
        try:
            out.backward()
        finally:
            torch.cat = real_cat
        views = all(_in_bucket(p.grad, red.flats[red._bucket_of[id(p)]]) for p in model.parameters())
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(ref_model.parameters(), model.parameters()))
        checks.append((views, same, model.unused.grad is not None and not model.unused.grad.any().item()))
        ref_opt.step()
        opt.step()
    n_dtypes = sorted({str(f.dtype) for f in red.flats})
    return checks, [f.data_ptr() for f in red.flats] == ptrs, len(cats), n_dtypes, len(red.buckets)


def test_gradients_are_views_of_the_buckets_across_steps_and_zero_grad():
    for checks, same_buffers, n_cat, dtypes, n_buckets in run_multiprocess(_bucket_view_worker, 2, timeout_s=120):
        assert n_buckets >= 3
        assert dtypes == ["torch.float32", "torch.float64"]
        for step, (views, same, unused_zero) in enumerate(checks):
            assert views, f"step {step}: a p.grad is not a view of its bucket"
            assert same, f"step {step}: the bucketed sums differ from sync_dense_grads"
            assert unused_zero, f"step {step}: the parameter without a gradient is not a zero view"
        assert same_buffers, "bucket buffers were reallocated between steps"
        assert n_cat == 0, f"{n_cat} torch.cat calls during backward + reduce"


def _sync_dense_view_worker(env):
    """sync_dense_grads: the second call on gradients that are its views (zeroed in place) copies
    nothing and allocates nothing: the all-reduce runs on the same buffer."""
    from dlrmctl.distributed.comm import sync_dense_grads

    model = _mlp(0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(env.rank))
    model(x).sum().backward()
    expect = [p.grad.clone() for p in model.parameters()]
    sync_dense_grads(list(model.parameters()), env.pg)
    base = model[0].weight.grad._base
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    model(x).sum().backward()
    sync_dense_grads(list(model.parameters()), env.pg)
    same_base = all(p.grad._base is base for p in model.parameters())
    again = all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
    return same_base, again, [e.shape == f.shape for e, f in zip(expect, first)]


def test_sync_dense_grads_reuses_its_bucket_when_grads_are_its_views():
    for same_base, again, shapes in run_multiprocess(_sync_dense_view_worker, 2, timeout_s=120):
        assert same_base and again and all(shapes)


def _wire_worker(env):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.sparse import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(num_embeddings=50 + 7 * i, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(4)]
    types = {"t0": "table_wise", "t1": "row_wise", "t2": "column_wise", "t3": "table_row_wise"}
    plan = plan_from_types(tables, types, env.world_size)
    g = torch.Generator().manual_seed(env.rank)
    B = 5 + env.rank
    lengths = torch.randint(0, 4, (4 * B,), generator=g)
    vals = torch.cat([torch.randint(0, 50 + 7 * (i // B), (int(n),), generator=g) for i, n in enumerate(lengths)])
    w = torch.rand(vals.numel(), generator=g)
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(4)], vals, lengths=lengths, weights=w)
    out = {}
    for dt in (torch.int64, None):
        ebc = ShardedEmbeddingBagCollection(tables, plan, env, is_weighted=True, seed=3, input_dist_dtype=dt)
        out[str(dt)] = (ebc(kjt).values().detach(), ebc.input_dist_bytes, ebc.input_dist_dtype)
    return out


def test_int32_wire_halves_the_id_bytes_and_changes_nothing():
    for r in run_multiprocess(_wire_worker, 2, timeout_s=120):
        (v64, b64, d64), (v32, b32, d32) = r["torch.int64"], r["None"]
        assert d64 == torch.int64 and d32 == torch.int32
        assert torch.equal(v64, v32)
        assert b32[0] == b64[0] and b32[1] * 2 == b64[1] and b32[1] > 0


def test_wire_dtype_validation():
    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0"])]
    env = ShardingEnv.single()
    plan = plan_from_types(tables, "table_wise", 1)
    with pytest.raises(ValueError, match="input_dist_dtype must be"):
        ShardedEmbeddingBagCollection(tables, plan, env, input_dist_dtype=torch.float32)


def _qcomm_worker(env):
    """pooled_all_to_all and reduce_scatter_v (all-to-all path) with and without bf16 / fp16 qcomm;
    then a ShardedEBC forward + backward under comm_precision bf16 against fp32."""
    from dlrmctl.distributed.comm import pooled_all_to_all, reduce_scatter_v
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.sparse import KeyedJaggedTensor

    W, me = env.world_size, env.rank
    bs = [3, 5]
    widths = [[4, 8], [8, 4]]  # widths[d][g]: rank d's columns of group g
    g = torch.Generator().manual_seed(10 + me)
    inputs = [(torch.randn(sum(bs), widths[me][k], generator=g) * 10).requires_grad_() for k in range(2)]
    up = [[torch.randn(bs[me], widths[d][k], generator=g) * 10 for k in range(2)] for d in range(W)]
    res = {}
    for name, qd in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for x in inputs:
            x.grad = None
        out = pooled_all_to_all(inputs, bs, widths, env.pg, qd)
        sum((o * u).sum() for od, ud in zip(out, up) for o, u in zip(od, ud)).backward()
        res[name] = ([o.detach() for od in out for o in od], [x.grad.clone() for x in inputs])
    # row-wise output dist: partial sums [sum(bs), D] reduced over ranks
    part = (torch.randn(sum(bs), 6, generator=g) * 10).requires_grad_()
    rs = {}
    for name, qd in (("fp32", None), ("bf16", torch.bfloat16)):
        part.grad = None
        red = reduce_scatter_v(part, bs, env.pg, use_collective=False, qdtype=qd)
        red.backward(torch.full_like(red, 1.0 / 3))
        rs[name] = (red.detach(), part.grad.clone(), part.detach().to(qd or torch.float32).float())
    # the sharded EBC end to end (table_wise: all-to-all; row_wise: reduce-scatter)
    tables = [EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
              for i in range(2)]
    plan = plan_from_types(tables, {"t0": "table_wise", "t1": "row_wise"}, W)
    B = 4 + me
    lengths = torch.randint(1, 4, (2 * B,), generator=g)
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.randint(0, 40, (int(lengths.sum()),), generator=g), lengths=lengths)
    ebc_out = {}
    for prec in ("fp32", "bf16"):
        ebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=1, comm_precision=prec)
        ebc_out[prec] = ebc(kjt).values().detach()
    # fp16 wire edges: values beyond the fp16 range saturate (no inf), and mean-loss gradients of a
    # large global batch (~1e-7, fp16 subnormals) keep fp16's relative precision
    bs = [3000, 5000]  # a global batch of 8,000: gradients scaled by 8,192 on the wire
    big = torch.full((sum(bs), widths[me][0]), 1e6).requires_grad_()
    tiny_up = [[torch.full((bs[me], widths[d][0]), 1e-7) for _ in range(1)] for d in range(W)]
    out = pooled_all_to_all([big], bs, [[w[0]] for w in widths], env.pg, torch.float16)
    sum((o * u).sum() for od, ud in zip(out, tiny_up) for o, u in zip(od, ud)).backward()
    edges = {"sat": [o.detach() for od in out for o in od], "tiny_grad": big.grad.clone()}
    rpart = torch.full((sum(bs), 3), 1e6).requires_grad_()
    red = reduce_scatter_v(rpart, bs, env.pg, use_collective=False, qdtype=torch.float16)
    red.backward(torch.full_like(red, 1e-7))
    edges["rs_sat"], edges["rs_tiny_grad"] = red.detach(), rpart.grad.clone()
    # asked for the reduce_scatter collective (NCCL's default), an fp16 wire still sums in fp32:
    # two partials of 40,000 make 80,000, not an fp16 inf
    edges["rs_collective"] = reduce_scatter_v(torch.full((8, 2), 40000.0), [4, 4], env.pg, use_collective=True,
                                              qdtype=torch.float16)
    return res, rs, ebc_out, edges


def test_qcomm_fp16_saturates_and_keeps_small_gradients():
    from dlrmctl.distributed.comm import FP16_MAX, grad_wire_scale

    assert grad_wire_scale(torch.float16, 65536) == 65536.0 and grad_wire_scale(torch.float16, 2500) == 2048.0
    assert grad_wire_scale(torch.bfloat16, 65536) == 1.0 and grad_wire_scale(None, 8) == 1.0
    for *_, edges in run_multiprocess(_qcomm_worker, 2, timeout_s=180):
        assert all(torch.equal(o, torch.full_like(o, FP16_MAX)) for o in edges["sat"])
        assert torch.equal(edges["rs_sat"], torch.full_like(edges["rs_sat"], 2 * FP16_MAX))
        assert torch.equal(edges["rs_collective"], torch.full((4, 2), 80000.0))
        # 1e-7 is an fp16 subnormal (spacing 2^-24 ~ 6e-8: a plain cast is 19 % off); scaled by
        # the global batch's power of two it arrives within fp16's 2^-11
        want = torch.tensor(1e-7)
        assert torch.allclose(edges["tiny_grad"], want.expand_as(edges["tiny_grad"]), rtol=2.0 ** -11, atol=0)
        assert torch.allclose(edges["rs_tiny_grad"], want.expand_as(edges["rs_tiny_grad"]), rtol=2.0 ** -11, atol=0)
        assert (torch.tensor(1e-7).half().float() - want).abs() / want > 0.05  # what a plain cast gives


def test_fp16_wire_scales_an_fp16_gradient_too():
    """The receiver always divides by the wire scale, so an fp16 tensor (already in the wire dtype)
    must still be multiplied by it: returned unscaled, an fp16 gradient arrived divided by ~the batch."""
    from dlrmctl.distributed.comm import to_wire

    g = torch.full((3, 2), 1e-3, dtype=torch.float16)
    assert torch.equal(to_wire(g, torch.float16, 8.0), g * 8)
    assert torch.equal(to_wire(g, torch.float16), g)
    assert torch.equal(to_wire(torch.full((2,), 4e4, dtype=torch.float16), torch.float16, 4.0),
                       torch.full((2,), 65504.0, dtype=torch.float16))  # saturates, no inf


def test_qcomm_all_to_all_round_trips_within_bf16_and_fp16_precision():
    results = run_multiprocess(_qcomm_worker, 2, timeout_s=180)
    all_parts = {}
    for r, (res, rs, ebc_out, _) in enumerate(results):
        (f_out, f_grad) = res["fp32"]
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            q_out, q_grad = res[name]
            # a cast there and back: exactly the fp32 values rounded once to the wire dtype
            for a, b in zip(f_out, q_out):
                assert torch.equal(b, a.to(dt).float())
                assert not torch.equal(a, b)  # the values did go through the narrower type
            for a, b in zip(f_grad, q_grad):
                rel = 2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -11
                assert torch.allclose(b, a, rtol=rel, atol=0)
                assert torch.equal(b, a.to(dt).float())  # each gradient block is sent once
        all_parts[r] = rs
        # sharded EBC: the pooled rows differ from fp32 only by bf16 rounding (row_wise: of each of the
        # two partial sums, which may cancel: the bound is relative to the largest value)
        f, q = ebc_out["fp32"], ebc_out["bf16"]
        assert f.dtype == q.dtype == torch.float32
        assert (q - f).abs().max() <= 2.0 ** -7 * f.abs().max() and not torch.equal(q, f)
    bs = [3, 5]
    for r in range(2):
        red_f, grad_f, _ = all_parts[r]["fp32"]
        red_q, grad_q, _ = all_parts[r]["bf16"]
        rows = slice(sum(bs[:r]), sum(bs[: r + 1]))
        # forward: the bf16-rounded blocks summed in fp32
        want = sum(all_parts[s]["bf16"][2][rows] for s in range(2))
        assert torch.equal(red_q, want)
        # each partial sum rounded once (bf16 unit roundoff 2^-8): the error is bounded by the partials' sizes
        bound = 2.0 ** -8 * sum(all_parts[s]["fp32"][2][rows].abs() for s in range(2)) + 1e-6
        assert ((red_q - red_f).abs() <= bound).all()
        # backward: 1/3 rounded to bf16 and back
        assert torch.equal(grad_q, torch.full_like(grad_f, 1.0 / 3).to(torch.bfloat16).float())


#: (rows, dim) of the replicated tables of the sparse-gradient test; "s" is densified
_SPARSE_TABLES = {"a": (50, 8), "b": (40, 4), "c": (30, 8), "s": (10, 4)}


def _sparse_grads(rank: int, step: int) -> dict:
    """Rank ``rank``'s uncoalesced ``nn.EmbeddingBag``-like gradient per table at ``step``
    (uneven id counts per rank and step; table "c" has none on rank 1 at step 0)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    out = {}
    for name, (rows, dim) in _SPARSE_TABLES.items():
        n = 0 if (name == "c" and rank == 1 and step == 0) else int(torch.randint(5, 40, (1,), generator=gen)) + 7 * step
        ids = torch.randint(0, rows, (n,), generator=gen)
        out[name] = torch.sparse_coo_tensor(ids[None], torch.randn(n, dim, generator=gen), (rows, dim))
    return out


def _sparse_sync_worker(env):
    from dlrmctl.distributed.comm import sync_sparse_grads

    params = {k: torch.nn.Parameter(torch.zeros(r, d)) for k, (r, d) in _SPARSE_TABLES.items()}
    ws, workspace, report = env.world_size, {}, []
    for step in range(3):  # the workspace buffers are reused, grown and shrunk
        mine = _sparse_grads(env.rank, step)
        for k, p in params.items():
            p.grad = None if mine[k]._nnz() == 0 else mine[k]
        # "s" (160 B) densified; 3 rows of dim 8 per gather piece: several pieces, the last one partial
        sync_sparse_grads(list(params.values()), env.pg, dense_max_bytes=200, workspace=workspace, chunk_bytes=96)
        for k, p in params.items():
            ref = sum(_sparse_grads(r, step)[k].to_dense() for r in range(ws))
            g = p.grad
            if k == "s":
                ok = not g.is_sparse and torch.allclose(g, ref, atol=1e-6)
            else:
                touched = torch.nonzero(ref.ne(0).any(1) | torch.zeros(ref.shape[0], dtype=torch.bool).index_fill_(
                    0, torch.cat([_sparse_grads(r, step)[k]._indices()[0] for r in range(ws)]), True)).reshape(-1)
                # uncoalesced (no host-sized unique): every rank's ids, in (rank, position) order
                ids = torch.cat([_sparse_grads(r, step)[k]._indices()[0] for r in range(ws)])
                ok = (g.is_sparse and not g.is_coalesced() and torch.equal(g._indices()[0], ids)
                      and torch.equal(torch.unique(g._indices()[0]), touched)
                      and torch.allclose(g.to_dense(), ref, atol=1e-6))
            report.append((step, k, bool(ok)))
    return report


def test_sparse_grad_sync_sums_rows_over_ranks_in_pieces_and_groups():
    """``sync_sparse_grads`` on 2 and 3 gloo ranks: tables of two dims (two gather groups), cut in
    pieces of 3 and 6 rows, a rank without a gradient, three steps on one workspace — each table's
    gradient is the sum of every rank's rows (its entries: every rank's ids, uncoalesced) (the densified one: the dense sum)."""
    for ws in (2, 3):
        for report in run_multiprocess(_sparse_sync_worker, ws, timeout_s=180):
            bad = [(s, k) for s, k, ok in report if not ok]
            assert not bad, f"{ws} ranks: wrong gradient at (step, table) {bad}"


def _sparse_sync_step_worker(env, opt):
    """Weights after 3 steps of the dense-kernel embedding optimizer on the synced gradients, and on
    every rank's gradients concatenated in one process (the single-process global batch)."""
    from dlrmctl.distributed.comm import sync_sparse_grads
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    def init():
        return {k: torch.nn.Parameter(torch.randn(r, d, generator=torch.Generator().manual_seed(r)))
                for k, (r, d) in _SPARSE_TABLES.items() if k != "s"}

    synced, ref = init(), init()
    o1 = embedding_optimizer_for_dense(list(synced.values()), opt, lr=0.1, eps=1e-8, weight_decay=0.0)
    o2 = embedding_optimizer_for_dense(list(ref.values()), opt, lr=0.1, eps=1e-8, weight_decay=0.0)
    for step in range(3):
        for k, p in synced.items():
            g = _sparse_grads(env.rank, step)[k]
            p.grad = None if g._nnz() == 0 else g
        sync_sparse_grads(list(synced.values()), env.pg, dense_max_bytes=0, workspace={}, chunk_bytes=96)
        o1.step()
        for k, p in ref.items():
            gs = [_sparse_grads(r, step)[k] for r in range(env.world_size)]
            p.grad = torch.sparse_coo_tensor(torch.cat([g._indices() for g in gs], 1),
                                             torch.cat([g._values() for g in gs]), p.shape)
        o2.step()
    return [(k, float((synced[k] - ref[k]).abs().max())) for k in synced]


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "adam"])
def test_synced_sparse_grads_train_as_the_single_process_global_batch(opt):
    """The uncoalesced synced gradient (no unique per table) steps the dense-kernel optimizer as the
    single-process gradient of the global batch does."""
    for report in run_multiprocess(_sparse_sync_step_worker, 2, opt, timeout_s=180):
        assert all(d <= 1e-6 for _, d in report), report
