"""comm.py pieces on real gloo ranks: the bucketed dense-gradient all-reduce (overlap
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
                ok = (g.is_sparse and g.is_coalesced() and torch.equal(g._indices()[0], touched)
                      and torch.allclose(g.to_dense(), ref, atol=1e-6))
            report.append((step, k, bool(ok)))
    return report


def test_sparse_grad_sync_sums_rows_over_ranks_in_pieces_and_groups():
    """``sync_sparse_grads`` on 2 and 3 gloo ranks: tables of two dims (two gather groups), cut in
    pieces of 3 and 6 rows, a rank without a gradient, three steps on one workspace — each table's
    gradient is the coalesced sum of every rank's rows (the densified one: the dense sum)."""
    for ws in (2, 3):
        for report in run_multiprocess(_sparse_sync_worker, ws, timeout_s=180):
            bad = [(s, k) for s, k, ok in report if not ok]
            assert not bad, f"{ws} ranks: wrong gradient at (step, table) {bad}"
