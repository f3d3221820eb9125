"""Single-process tests of the sharding pieces (bucketizer, plans, env, world size 1),
plus one 2-rank test of the checkpoint / optimizer views."""

from __future__ import annotations

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.distributed.env import ShardingEnv, init_distributed
from dlrmctl.distributed.model_parallel import DistributedModelParallel, describe_plan, plan_from_types
from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
from dlrmctl.distributed.sharding.bucketize import bucketize_torch
from dlrmctl.distributed.sharding.common import int64_to_weights, weights_to_int64
from dlrmctl.distributed.types import ComputeKernel, ParameterSharding, PlanError, ShardingPlan, ShardMetadata
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
from dlrmctl.sparse import KeyedJaggedTensor

try:
    from tests.dist_utils import run_multiprocess
except ImportError:  # pragma: no cover
    from dist_utils import run_multiprocess

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=["a", "b"], pooling="sum"),
    EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=4, feature_names=["c"], pooling="mean"),
    EmbeddingBagConfig(name="t2", num_embeddings=3, embedding_dim=6, feature_names=["d"], pooling="mean"),
]
TYPES = ["data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"]


def _kjt(B: int, weighted: bool, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = ["a", "b", "c", "d"]
    rows = [10, 10, 7, 3]
    lengths = torch.randint(0, 4, (4, B), generator=g)
    vals = torch.cat([torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, r in enumerate(rows)])
    w = torch.rand(vals.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys, vals, lengths=lengths.reshape(-1), weights=w)


@pytest.mark.skipif(not HAS_FBGEMM, reason="compares with fbgemm.block_bucketize_sparse_features")
@pytest.mark.parametrize("W", [2, 3, 4])
def test_torch_bucketizer_matches_fbgemm_block_bucketize(W):
    import fbgemm_gpu  # noqa: F401

    rows = [10, 23, 3]
    F, B = 3, 5
    g = torch.Generator().manual_seed(W)
    lengths = torch.randint(0, 4, (F, B), generator=g)
    vals = torch.cat([torch.randint(0, r, (int(lengths[f].sum()),), generator=g) for f, r in enumerate(rows)])
    weights = torch.rand(vals.numel(), generator=g)
    blocks = [-(-r // W) for r in rows]
    fl, fv, fw, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths.reshape(-1), vals, False, False, torch.tensor(blocks), W, weights)
    base, starts, ranks, acc = [], [], [], 0
    for r, blk in zip(rows, blocks):
        base.append(acc)
        for k in range(W):
            starts.append(acc + min(k * blk, r))
            ranks.append(k)
        acc += r
    tl, tv, tw = bucketize_torch(vals, lengths.reshape(-1), weights, F, B, W, torch.tensor(base),
                                 torch.tensor(starts), torch.tensor(ranks))
    assert torch.equal(tl.reshape(-1), fl)
    assert torch.equal(tv, fv)
    assert torch.equal(tw, fw)


def test_row_wise_splits_10_rows_on_3_ranks_as_4_4_2_and_3_rows_on_4_ranks_with_an_empty_shard():
    plan = plan_from_types([EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4)], "row_wise", 3)
    assert [m.sizes for m in plan.plan["t"].shards] == [[4, 4], [4, 4], [2, 4]]
    assert [m.offsets for m in plan.plan["t"].shards] == [[0, 0], [4, 0], [8, 0]]
    plan = plan_from_types([EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=4)], "row_wise", 4)
    assert [m.sizes[0] for m in plan.plan["t"].shards] == [1, 1, 1, 0]


def test_table_row_wise_and_table_column_wise_keep_each_table_on_one_host():
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=20, embedding_dim=8) for i in range(3)]
    for st in ("table_row_wise", "table_column_wise"):
        plan = plan_from_types(tables, st, 4, local_world_size=2)
        assert [plan.plan[t.name].ranks for t in tables] == [[0, 1], [2, 3], [0, 1]]


def test_describe_plan_names_every_table_type_kernel_ranks_and_shard_blocks():
    plan = plan_from_types(TABLES, {"t0": "row_wise", "t1": "data_parallel", "t2": "column_wise"}, 2)
    text = describe_plan(plan, TABLES)
    assert "world_size 2" in text
    assert "t0" in text and "row_wise" in text and "0: [0, 5) [0, 8); 1: [5, 10) [0, 8)" in text
    assert "t1" in text and "data_parallel" in text and "replicated" in text
    assert "t2" in text and "column_wise" in text and "[0, 3) [0, 3)" in text and "[0, 3) [3, 6)" in text
    assert "rank  shards" in text


def test_plan_with_two_row_shards_on_one_rank_is_rejected():
    ps = ParameterSharding("row_wise", ComputeKernel.FUSED, [0, 0],
                           [ShardMetadata(0, [0, 0], [5, 8]), ShardMetadata(0, [5, 0], [5, 8])])
    plan = ShardingPlan(2, 2, {"t0": ps, "t1": ParameterSharding("data_parallel", "dense", [0, 1]),
                               "t2": ParameterSharding("data_parallel", "dense", [0, 1])})
    with pytest.raises(PlanError, match="two row shards on one rank"):
        ShardedEmbeddingBagCollection(TABLES, plan, ShardingEnv(2, 0))


def test_plan_for_another_world_size_is_rejected_with_the_replan_hint():
    plan = plan_from_types(TABLES, "table_wise", 2)
    with pytest.raises(PlanError, match="world_size 2 but the job has 1"):
        ShardedEmbeddingBagCollection(TABLES, plan, ShardingEnv.single())


@pytest.mark.parametrize("st", TYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_every_sharding_type_on_one_rank_equals_the_unsharded_ebc(st, weighted):
    plan = plan_from_types(TABLES, st, 1)
    sebc = ShardedEmbeddingBagCollection(TABLES, plan, ShardingEnv.single(), weighted, seed=5)
    ref = EmbeddingBagCollection(TABLES, is_weighted=weighted, seed=5)
    kjt = _kjt(6, weighted)
    torch.testing.assert_close(sebc(kjt).values(), ref(kjt).values(), atol=1e-6, rtol=0)
    full = sebc.gather_full_weights()
    for k, w in ref.embedding_weights().items():
        assert torch.equal(full[k], w.detach())


def test_weights_travel_bit_exactly_as_int64():
    w = torch.tensor([0.0, -1.5, 3.25e-8, float("inf"), -0.0])
    back = int64_to_weights(weights_to_int64(w))
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))


def test_init_distributed_without_world_size_is_a_single_process_env(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    env = init_distributed(backend="gloo")
    assert (env.rank, env.world_size, env.pg, env.device.type) == (0, 1, None, "cpu")


def test_sharding_env_rejects_a_local_world_size_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match="local_world_size 3 must be > 0 and divide world_size 4"):
        ShardingEnv(4, 0, local_world_size=3)


def _dlrm(seed=0):
    from dlrmctl.modules.dlrm import DLRM

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=12, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(3)]
    return DLRM(EmbeddingBagCollection(tables), 3, [8, 4], [8, 1], 3, 4)


def test_model_parallel_without_plan_needs_world_size_1():
    with pytest.raises(PlanError, match="2 ranks need a sharding plan"):
        DistributedModelParallel(_dlrm(), ShardingEnv(2, 0), None,
                                 EmbeddingOptimizerSpec())


def test_model_parallel_unsharded_on_one_process_is_the_plain_model():
    ref = _dlrm()
    dmp = DistributedModelParallel(_dlrm(), ShardingEnv.single(), None, EmbeddingOptimizerSpec())
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 3, (3 * 4,), generator=g)
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(3)], torch.randint(0, 12, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    dense = torch.randn(4, 3, generator=g)
    torch.testing.assert_close(dmp(dense, kjt), ref(dense, kjt))
    kt = dmp.compute_and_output_dist(dmp.sparse_input_dist(kjt).wait())
    torch.testing.assert_close(dmp.dense_forward(dense, kt), ref(dense, kjt))
    assert len(dmp.dense_parameters()) == len([p for n, p in ref.named_parameters() if not n.startswith("sparse")])
    assert "unsharded" in dmp.describe_plan()


# ---------------------------------------------------------------- 2 ranks
def _views_worker(env):
    tables = [EmbeddingBagConfig(name="rw", num_embeddings=10, embedding_dim=8, feature_names=["a"]),
              EmbeddingBagConfig(name="cw", num_embeddings=6, embedding_dim=8, feature_names=["b"]),
              EmbeddingBagConfig(name="dp", num_embeddings=5, embedding_dim=4, feature_names=["c"])]
    plan = plan_from_types(tables, {"rw": "row_wise", "cw": "column_wise", "dp": "data_parallel"}, 2,
                           column_sizes={"cw": [4, 4]}, ranks={"cw": [env.rank * 0, 0]})
    sebc = ShardedEmbeddingBagCollection(tables, plan, env, optimizer=EmbeddingOptimizerSpec("exact_adagrad"))
    shards = sebc.local_shards()
    out = {k: [(m.to_dict(), tuple(w.shape), [tuple(s.shape) for s in st]) for m, w, st in v] for k, v in shards.items()}
    # views are live: writing through them changes the gathered table
    for m, w, _ in shards["rw"]:
        with torch.no_grad():
            w.fill_(float(env.rank + 1))
    full = sebc.gather_full_weights()["rw"]
    opt_keys = sorted(sebc.fused_optimizer().state_dict()["state"])
    return out, full[:, 0].tolist(), opt_keys


def test_local_shards_and_fused_optimizer_views_on_2_ranks():
    if not HAS_FBGEMM:
        pytest.skip("fused optimizer state needs fbgemm")
    (r0, full0, keys0), (r1, full1, keys1) = run_multiprocess(_views_worker, 2, timeout_s=120)
    assert [s[0] for s in r0["rw"]] == [{"rank": 0, "offsets": [0, 0], "sizes": [5, 8]}]
    assert [s[0] for s in r1["rw"]] == [{"rank": 1, "offsets": [5, 0], "sizes": [5, 8]}]
    assert r0["rw"][0][2] == [(5, 8)]  # exact_adagrad momentum [rows, cols]
    # both column blocks of "cw" on rank 0 (two shards of one table on one rank)
    assert [s[0]["offsets"] for s in r0["cw"]] == [[0, 0], [0, 4]] and "cw" not in r1
    assert "cw@0" in keys0 and "cw@1" in keys0 and "rw" in keys1
    assert r0["dp"][0][0]["sizes"] == [5, 4] and r1["dp"][0][0]["sizes"] == [5, 4]
    assert full0 == full1 == [1.0] * 5 + [2.0] * 5
