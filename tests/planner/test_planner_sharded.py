"""Plans written by the planner for ``--device cpu`` run in the sharded EBC on gloo ranks
and give the unsharded module's pooled embeddings."""

from __future__ import annotations

import pytest
import torch

from dlrmctl.config import config_from_dict, resolve_tables
from dlrmctl.distributed.types import ShardingPlan
from dlrmctl.planner.planner import plan_for_config

from tests.dist_utils import run_multiprocess

pytestmark = pytest.mark.multiprocess

# one table per sharding type, so one plan exercises every type the planner can write
CONFIG = {
    "data": {"path": "/nonexistent", "batch_size": 64},
    "model": {
        "embedding_dim": 8,
        "dense_arch_layer_sizes": [16, 8],
        "tables": [
            {"name": "tw", "num_embeddings": 50},
            {"name": "rw", "num_embeddings": 37},
            {"name": "cw", "num_embeddings": 20},
            {"name": "dp", "num_embeddings": 5},
            {"name": "twrw", "num_embeddings": 41},
            {"name": "twcw", "num_embeddings": 30},
        ],
    },
    "sharding": {
        "device": "cpu",
        "ddr_gb": 4.0,
        "constraints": {
            "tw": {"sharding_types": ["table_wise"]},
            "rw": {"sharding_types": ["row_wise"]},
            "cw": {"sharding_types": ["column_wise"]},
            "dp": {"sharding_types": ["data_parallel"]},
            "twrw": {"sharding_types": ["table_row_wise"]},
            "twcw": {"sharding_types": ["table_column_wise"]},
        },
    },
}


def _forward_worker(env, plan_dict: dict, B: int) -> float:
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
    from dlrmctl.sparse import KeyedJaggedTensor

    cfg = config_from_dict(CONFIG)
    tables = resolve_tables(cfg, None)
    plan = ShardingPlan.from_dict(plan_dict)
    sebc = ShardedEmbeddingBagCollection(tables, plan, env, seed=7)
    ref = EmbeddingBagCollection(tables, compute_kernel="fused", seed=7)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (len(tables), B), generator=gen)
    values = torch.cat([torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=gen)
                        for i, t in enumerate(tables)])
    kjt = KeyedJaggedTensor([t.name for t in tables], values, lengths=lengths.reshape(-1))
    per = B // env.world_size
    s, e = env.rank * per, (env.rank + 1) * per
    vals = []
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)])
    for i in range(len(tables)):
        vals.append(values[off[i * B + s]: off[i * B + e]])
    local = KeyedJaggedTensor(kjt.keys(), torch.cat(vals), lengths=lengths[:, s:e].reshape(-1))
    out = sebc(local).values()
    out.sum().backward()  # the backward (and fused optimizer) must run on every type
    return (out.detach() - ref(kjt).values()[s:e].detach()).abs().max().item()


@pytest.mark.parametrize("world, lws", [(2, 2), (4, 2)])
def test_planner_plans_with_every_sharding_type_run_sharded_and_match_reference(world, lws):
    cfg = config_from_dict(CONFIG)
    plan = plan_for_config(cfg, world, lws, None)
    plan.validate(resolve_tables(cfg, None), world)
    assert {ps.sharding_type.value for ps in plan.plan.values()} == {
        "table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "table_column_wise"}
    errs = run_multiprocess(_forward_worker, world, plan.to_dict(), 8 * world, local_world_size=lws, timeout_s=180)
    assert max(errs) < 1e-5, errs
