"""Weighted features end to end (issue 12, item 3).

Setup used throughout: table T0 4 x 4 with row i = [i]*4; one sample whose bag of feature f0 is
ids [1, 2] with weights [10, 100]; sum pooling gives [210]*4 (unweighted it would be [3]*4).
"""

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor, SparseInputError

from tests.dist_utils import run_multiprocess

KERNELS = ["dense"] + (["fused"] if HAS_FBGEMM else [])
WANT = [[210.0] * 4]


def setup_tables(extra: bool = False) -> list[EmbeddingBagConfig]:
    t = [EmbeddingBagConfig(name="T0", num_embeddings=4, embedding_dim=4, feature_names=["f0"])]
    if extra:  # an unweighted neighbour table
        t.append(EmbeddingBagConfig(name="T1", num_embeddings=3, embedding_dim=4, feature_names=["f1"]))
    return t


def setup_kjt(weighted: bool = True) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f0"], torch.tensor([1, 2]), lengths=torch.tensor([2]),
                             weights=torch.tensor([10.0, 100.0]) if weighted else None)


def set_rows(weights: dict[str, torch.Tensor]) -> None:
    """Row i of every table = [i] * dim."""
    with torch.no_grad():
        for w in weights.values():
            w.copy_(torch.arange(w.shape[0], dtype=torch.float32)[:, None].expand_as(w))


# ------------------------------------------------------------------------ EBC
@pytest.mark.parametrize("kernel", KERNELS)
def test_weighted_ebc_pools_the_setup_to_210(kernel):
    ebc = EmbeddingBagCollection(setup_tables(), is_weighted=True, compute_kernel=kernel)
    set_rows(ebc.embedding_weights())
    assert ebc(setup_kjt()).values().tolist() == WANT
    ebc.eval()
    with torch.no_grad():
        assert ebc(setup_kjt()).values().tolist() == WANT


@pytest.mark.parametrize("kernel", KERNELS)
def test_unweighted_ebc_given_weights_raises_naming_tables_and_features(kernel):
    ebc = EmbeddingBagCollection(setup_tables(), compute_kernel=kernel)
    set_rows(ebc.embedding_weights())
    with pytest.raises(SparseInputError, match=r"EmbeddingBagCollection \(tables \['T0'\], features \['f0'\]\) is "
                       r"unweighted.*per-id weights.*TorchRec ignores them silently"):
        ebc(setup_kjt())
    assert ebc(setup_kjt(weighted=False)).values().tolist() == [[3.0] * 4]


def test_weighted_ebc_without_weights_raises():
    ebc = EmbeddingBagCollection(setup_tables(), is_weighted=True, compute_kernel="dense")
    with pytest.raises(SparseInputError, match=r"\['T0'\].*is weighted.*has no per-id weights"):
        ebc(setup_kjt(weighted=False))


SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]


def _sharded_rank(env):
    """Per sharding type: this rank's pooled output for its local batch of setup samples, and the
    messages of the weights-missing / weights-given-to-unweighted errors."""
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    tables = setup_tables()
    B = 1 + env.rank  # local batches differ between ranks
    kjt = KeyedJaggedTensor(["f0"], torch.tensor([1, 2] * B), lengths=torch.tensor([2] * B),
                            weights=torch.tensor([10.0, 100.0] * B))
    out = {}
    for st in SHARDING_TYPES:
        plan = plan_from_types(tables, {"T0": st}, env.world_size)
        ebc = ShardedEmbeddingBagCollection(tables, plan, env, is_weighted=True, seed=0)
        with torch.no_grad():
            for meta, w, _ in ebc.local_shards()["T0"] if "T0" in ebc.local_shards() else []:
                r0 = meta.offsets[0]
                w.copy_(torch.arange(r0, r0 + w.shape[0], dtype=torch.float32)[:, None].expand_as(w))
        res = {"pooled": ebc(kjt).values().tolist()}
        for name, m, k in [("missing", ebc, setup_kjt(weighted=False)),
                           ("extra", ShardedEmbeddingBagCollection(tables, plan, env, seed=0), kjt)]:
            try:
                m(k)
                res[name] = None
            except SparseInputError as e:
                res[name] = str(e)
        out[st] = res
    return out


def test_sharded_ebc_on_2_gloo_ranks_carries_the_weights_for_every_sharding_type():
    per_rank = run_multiprocess(_sharded_rank, 2, timeout_s=180)
    for rank, out in enumerate(per_rank):
        for st in SHARDING_TYPES:
            res = out[st]
            assert res["pooled"] == WANT * (1 + rank), (rank, st, res["pooled"])
            assert "is weighted" in res["missing"] and "ShardedEmbeddingBagCollection" in res["missing"]
            assert "is unweighted" in res["extra"] and "['T0']" in res["extra"]
