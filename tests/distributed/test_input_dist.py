"""The sharded EBC's input dist on FBGEMM's permute kernel and on the torch path: the same lookup
KJTs (keys, lengths, ids, weights, length_per_key, stride) and the same pooled outputs, on random
jagged batches with empty bags, zero-length features, ranks of uneven batch (one with none), weighted
and unweighted, every sharding type in one plan, on 3 gloo ranks (that either equals the single-process reference:
tests/distributed/test_sharding.py, on both paths)."""

import pytest
import torch

from dlrmctl.sparse.permute import fbgemm_permute_available
from tests.dist_utils import run_multiprocess

pytestmark = pytest.mark.multiprocess


def _tables():
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name="t0", num_embeddings=31, embedding_dim=8, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t1", num_embeddings=17, embedding_dim=8, feature_names=["c"], pooling="mean"),
        EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=4, feature_names=["d"]),
        EmbeddingBagConfig(name="t3", num_embeddings=23, embedding_dim=8, feature_names=["e"]),
        EmbeddingBagConfig(name="t4", num_embeddings=13, embedding_dim=8, feature_names=["f"]),
        EmbeddingBagConfig(name="t5", num_embeddings=9, embedding_dim=4, feature_names=["g"]),
    ]


def _batch(rank: int, step: int, weighted: bool):
    from dlrmctl.sparse import KeyedJaggedTensor

    tables = _tables()
    g = torch.Generator().manual_seed(100 * step + rank)
    B = [4, 0, 7][rank] if step == 0 else [1, 5, 3][rank]  # uneven, one rank with no sample
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 4, (len(keys), B), generator=g)
    lengths[keys.index("c")] = 0  # a feature with no id at all in this batch
    if B:
        lengths[0, 0] = 0  # an empty bag
    vals = torch.cat([torch.randint(0, n, (int(lengths[i].sum()),), generator=g) for i, n in enumerate(rows)])
    w = torch.rand(vals.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys, vals, lengths=lengths.reshape(-1), weights=w)


def _worker(env):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.sparse import permute

    types = {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel", "t3": "column_wise",
             "t4": "table_row_wise", "t5": "table_column_wise"}
    plan = plan_from_types(_tables(), types, env.world_size, column_sizes={"t3": [4, 4]}, ranks={"t3": [2, 0]})
    out = {}
    for weighted in (False, True):
        for path in ("fbgemm", "torch"):
            permute.USE_FBGEMM = path == "fbgemm"
            ebc = ShardedEmbeddingBagCollection(_tables(), plan, env, is_weighted=weighted, seed=5)
            res = []
            for step in range(2):
                ctx = ebc.input_dist(_batch(env.rank, step, weighted)).wait()
                kjts = []
                for k in ctx.lookup_kjts:
                    if k is None:
                        continue
                    w = k.weights_or_none()
                    kjts.append((k.keys(), k.lengths().clone(), k.values().clone(),
                                 None if w is None else w.clone(), k.length_per_key(), k.stride()))
                pooled = ebc.compute_and_output_dist(ctx).values().detach()
                res.append((kjts, pooled, ctx.batch_sizes))
            out[weighted, path] = res
    permute.USE_FBGEMM = True
    return out


@pytest.mark.skipif(not fbgemm_permute_available(), reason="compares FBGEMM's kernel with the torch path")
def test_fbgemm_and_torch_input_dist_give_identical_kjts_and_outputs():
    for rank, out in enumerate(run_multiprocess(_worker, 3, timeout_s=180)):
        for weighted in (False, True):
            a, b = out[weighted, "fbgemm"], out[weighted, "torch"]
            for step, ((ka, pa, bsa), (kb, pb, bsb)) in enumerate(zip(a, b)):
                assert bsa == bsb
                assert len(ka) == len(kb) >= 4
                for x, y in zip(ka, kb):
                    assert x[0] == y[0] and x[4] == y[4] and x[5] == y[5] == sum(bsa)
                    assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
                    assert (x[3] is None) == (not weighted) and (x[3] is None or torch.equal(x[3], y[3]))
                    assert x[1].dtype == torch.int64 and x[2].dtype == torch.int64
                    assert int(x[1].sum()) == sum(x[4]) == x[2].numel()
                assert torch.equal(pa, pb), f"rank {rank} step {step}: pooled outputs differ"
