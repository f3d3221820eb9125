"""``model.on_invalid_id``: one rule for ids outside their table on every path.

``error``: EmbeddingIdError naming table, feature, id and range (before any
lookup, bucketization or collective).  ``zero``: the id is dropped from its bag
for that table (adds a zero row, a mean counts only the valid ids, its weight
goes with it, no gradient).  The same batch with invalid ids goes through the
fused and dense kernels, the loader, every sharding type on 2 gloo ranks and the
exported model; every path gives the output of an independent reference that
pools only the valid ids.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.sparse import KeyedJaggedTensor
from tests.dist_utils import run_multiprocess
from tests.helpers.kjt import slice_kjt

ALL_TYPES = ["data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"]
KERNELS = ("fused", "dense") if HAS_FBGEMM else ("dense",)
ATOL = 1e-5
ERROR = r"table 'T1', feature 'f1': id 500 is out of range; expected 0 <= id < num_embeddings = 100"


def tables(dims=(4, 8, 8)):
    """f1 in T1 (100 rows) and T2 (1000 rows); f2 in T2 and T3 (600 rows, mean); f3 in T3."""
    return [
        EmbeddingBagConfig(name="T1", num_embeddings=100, embedding_dim=dims[0], feature_names=["f1"]),
        EmbeddingBagConfig(name="T2", num_embeddings=1000, embedding_dim=dims[1], feature_names=["f1", "f2"]),
        EmbeddingBagConfig(name="T3", num_embeddings=600, embedding_dim=dims[2], feature_names=["f2", "f3"],
                           pooling="mean"),
    ]


FEATS = ["f1", "f2", "f3"]
VALID = {"f1": 100, "f2": 600, "f3": 600}
# invalid ids put at the front of sample 0 and the back of the last sample of each feature:
# f1 500 (T2 only), -3 (none); f2 800 (T2 only), 5000 (none); f3 600 (none), -1 (none)
BAD = {"f1": (500, -3), "f2": (800, 5000), "f3": (600, -1)}


def dirty_batch(B: int, seed: int, weighted: bool, bad: dict = BAD) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(FEATS), B), generator=gen)
    lengths[0, 1] = 0  # an empty bag
    vals = []
    for i, f in enumerate(FEATS):
        v = torch.randint(0, VALID[f], (int(lengths[i].sum()),), generator=gen)
        if f in bad:
            v[0] = bad[f][0]
            if len(bad[f]) > 1:
                v[-1] = bad[f][1]
        vals.append(v)
    values = torch.cat(vals)
    w = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(FEATS, values, lengths=lengths.reshape(-1), weights=w)


def expected(kjt: KeyedJaggedTensor, weights: dict[str, torch.Tensor], tabs) -> torch.Tensor:
    """Independent reference: per (table, feature) lookup, pool only the ids valid for that table."""
    B = kjt.stride()
    cols = []
    for t in tabs:
        w = weights[t.name].detach().cpu()
        for f in t.feature_names:
            jt = kjt[f]
            offs = jt.offsets().tolist()
            ids = jt.values().tolist()
            pw = jt.weights_or_none()
            out = torch.zeros(B, t.embedding_dim)
            for b in range(B):
                n = 0
                for j in range(offs[b], offs[b + 1]):
                    if 0 <= ids[j] < t.num_embeddings:
                        out[b] += w[ids[j]] * (float(pw[j]) if pw is not None else 1.0)
                        n += 1
                if t.pooling.value == "mean" and n:
                    out[b] /= n
            cols.append(out)
    return torch.cat(cols, dim=1)


# ----------------------------------------------------------------- policy itself
def test_zero_drops_the_id_shortens_its_bag_and_expands_a_feature_feeding_tables_of_different_sizes():
    from dlrmctl.modules.embedding_modules import table_id_bounds
    from dlrmctl.sparse.validation import apply_id_policy

    kjt = KeyedJaggedTensor(["f1", "f3"], torch.tensor([500, 3, -3, 7, 599, 600]),
                            lengths=torch.tensor([2, 2, 1, 1]), weights=torch.tensor([1., 2., 3., 4., 5., 6.]))
    out = apply_id_policy(kjt, table_id_bounds(tables()), "zero")
    assert out.keys() == ["f1@T1", "f1@T2", "f3"]
    assert out["f1@T1"].values().tolist() == [3, 7] and out["f1@T1"].lengths().tolist() == [1, 1]
    assert out["f1@T2"].values().tolist() == [500, 3, 7] and out["f1@T2"].lengths().tolist() == [2, 1]
    assert out["f1@T2"].weights().tolist() == [1., 2., 4.]
    assert out["f3"].values().tolist() == [599] and out["f3"].lengths().tolist() == [1, 0]
    assert out.length_per_key() == [2, 3, 1]
    out.validate()
    # nothing invalid: the same object back (no copy on the hot path)
    clean = KeyedJaggedTensor(["f3"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    assert apply_id_policy(clean, table_id_bounds(tables()), "zero") is clean
    assert apply_id_policy(clean, table_id_bounds(tables()), "error") is clean


def test_the_policy_is_validated_everywhere(tmp_path):
    from dlrmctl.config import ConfigError, config_from_dict
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    with pytest.raises(ValueError, match="on_invalid_id must be one of"):
        EmbeddingBagCollection(tables(), compute_kernel="dense", on_invalid_id="clamp")
    with pytest.raises(ConfigError, match="model.on_invalid_id"):
        config_from_dict({"model": {"on_invalid_id": "clamp"}})
    assert config_from_dict({}).model.on_invalid_id == "error"


# -------------------------------------------------------------------- kernels
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_and_dense_give_the_reference_under_zero_and_the_same_error_under_error(weighted):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingIdError

    kjt = dirty_batch(5, 1, weighted)
    outs = {}
    for k in KERNELS:
        ebc = EmbeddingBagCollection(tables(), is_weighted=weighted, compute_kernel=k, seed=4, on_invalid_id="zero")
        outs[k] = ebc(kjt).values().detach()
        torch.testing.assert_close(outs[k], expected(kjt, ebc.embedding_weights(), tables()), rtol=0, atol=ATOL)
        strict = EmbeddingBagCollection(tables(), is_weighted=weighted, compute_kernel=k, seed=4)
        with pytest.raises(EmbeddingIdError, match=ERROR):
            strict(dirty_batch(5, 1, weighted, {"f1": (500,)}))
    if len(outs) == 2:
        torch.testing.assert_close(outs["fused"], outs["dense"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_dropped_id_gets_no_gradient_and_row_0_is_not_trained(kernel):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    t = [EmbeddingBagConfig(name="T", num_embeddings=10, embedding_dim=4, feature_names=["f"], pooling="mean")]
    dirty = KeyedJaggedTensor(["f"], torch.tensor([3, 12, 5, -1, 4]), lengths=torch.tensor([3, 2]))
    clean = KeyedJaggedTensor(["f"], torch.tensor([3, 5, 4]), lengths=torch.tensor([2, 1]))
    w = {}
    for name, kjt in (("dirty", dirty), ("clean", clean)):
        spec = EmbeddingOptimizerSpec("exact_rowwise_adagrad", lr=0.5)
        ebc = EmbeddingBagCollection(t, compute_kernel=kernel, seed=1, optimizer=spec, on_invalid_id="zero")
        dp = ebc.lookup.dense_parameters()
        opt = embedding_optimizer_for_dense(dp, spec.type, spec.lr, spec.eps, 0.0) if dp else None
        ebc(kjt).values().sum().backward()
        if opt is not None:
            opt.step()
        w[name] = ebc.embedding_weights()["T"].detach().clone()
    torch.testing.assert_close(w["dirty"], w["clean"], rtol=0, atol=0)
    w0 = EmbeddingBagCollection(t, compute_kernel="dense", seed=1).embedding_weights()["T"].detach()
    torch.testing.assert_close(w["dirty"][0], w0[0], rtol=0, atol=0)  # row 0 untouched (FBGEMM's WARNING would train it)


def test_variable_batch_inputs_keep_their_batch_under_zero():
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    t = [EmbeddingBagConfig(name="T", num_embeddings=10, embedding_dim=4, feature_names=["a", "b"])]
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 11, 2, 3]), lengths=torch.tensor([2, 1, 1]),
                            stride_per_key_per_rank=[[1], [2]],
                            inverse_indices=(["a", "b"], torch.tensor([[0, 0], [0, 1]])))
    ebc = EmbeddingBagCollection(t, compute_kernel="dense", on_invalid_id="zero")
    out = ebc(kjt)
    w = ebc.embedding_weights()["T"].detach()
    torch.testing.assert_close(out["a"].detach(), torch.stack([w[1], w[1]]))
    torch.testing.assert_close(out["b"].detach(), torch.stack([w[2], w[3]]))


# -------------------------------------------------------------------- loader
@pytest.fixture(scope="module")
def wide_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("wide")
    generate_synthetic(d, rows=300, seed=2, num_embeddings=[60] * 26)
    return str(d)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_the_loader_applies_the_policy_on_the_cpu_batch(wide_data, prefetch):
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.modules.embedding_modules import table_id_bounds
    from dlrmctl.sparse.validation import EmbeddingIdError

    tabs = [EmbeddingBagConfig(name="A", num_embeddings=30, embedding_dim=4, feature_names=["C1"]),
            EmbeddingBagConfig(name="B", num_embeddings=60, embedding_dim=4, feature_names=["C1", "C2"])]
    bounds = table_id_bounds(tabs)
    raw = next(iter(BatchLoader(wide_data, "train", 64, features=["C1", "C2"])))
    c1 = raw.sparse_features["C1"].values()
    assert int(c1.max()) >= 30
    z = next(iter(BatchLoader(wide_data, "train", 64, prefetch=prefetch, features=["C1", "C2", "C1"],
                              id_bounds=bounds, on_invalid_id="zero")))
    kjt = z.sparse_features
    assert kjt.keys() == ["C1@A", "C1@B", "C2"]
    assert kjt["C1@A"].values().tolist() == c1[c1 < 30].tolist()
    assert kjt["C1@A"].lengths().tolist() == (c1 < 30).long().tolist()
    assert kjt["C1@B"].values().tolist() == c1.tolist()
    with pytest.raises(EmbeddingIdError, match=r"train split, epoch 1, batch 1: table 'A', feature 'C1': id \d+ is "
                                               r"out of range; expected 0 <= id < num_embeddings = 30"):
        next(iter(BatchLoader(wide_data, "train", 64, prefetch=prefetch, features=["C1", "C2"], id_bounds=bounds)))


def test_trainer_with_zero_trains_on_data_with_ids_beyond_the_tables(wide_data, tmp_path):
    from dlrmctl.config import config_from_dict
    from dlrmctl.sparse.validation import EmbeddingIdError
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    def cfg(policy):
        return config_from_dict({
            "name": policy, "data": {"path": wide_data, "batch_size": 64, "eval_batch_size": 256, "prefetch": 1},
            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [8], "over_arch_layer_sizes": [8, 1],
                      "on_invalid_id": policy, "tables": [{"name": f"t{i}", "num_embeddings": 40,
                                                           "feature_names": [f"C{i}"]} for i in range(1, 27)]},
            "train": {"max_steps": 2, "run_dir": str(tmp_path), "progress": False, "pipeline": "none"},
        })
    t = Trainer(cfg("zero"), RunEnv(), os.path.join(tmp_path, "zero"))
    t.train()
    assert np.isfinite(t.loss_window.last_loss)
    with pytest.raises(EmbeddingIdError, match=r"train split, epoch 1, batch 1: table 't\d+', feature 'C\d+'"):
        Trainer(cfg("error"), RunEnv(), os.path.join(tmp_path, "error")).train()


# ------------------------------------------------------------------- sharded
def _sharded_case(env, st: str, weighted: bool) -> str | None:
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingIdError,
        EmbeddingOptimizerSpec,
        table_id_bounds,
    )
    from dlrmctl.sparse.validation import apply_id_policy

    ws, rank = env.world_size, env.rank
    B = 7
    s, e = rank * B // ws, (rank + 1) * B // ws
    spec = EmbeddingOptimizerSpec("exact_sgd", lr=0.1)
    plan = plan_from_types(tables(), st, ws)
    ref = EmbeddingBagCollection(tables(), is_weighted=weighted, compute_kernel="dense", seed=6)
    weights = {k: v.detach().clone() for k, v in ref.embedding_weights().items()}
    kjt = dirty_batch(B, 3, weighted)
    want = expected(kjt, weights, tables())[s:e]
    # (a) the module applies the policy; (b) the loader does (CPU batch), the module trusts it
    local = slice_kjt(kjt, s, e)
    inputs = {"module": (True, local),
              "loader": (False, apply_id_policy(local, table_id_bounds(tables()), "zero"))}
    for how, (check, inp) in inputs.items():
        sebc = ShardedEmbeddingBagCollection(tables(), plan, env, weighted, spec, seed=6, check_ids=check,
                                             on_invalid_id="zero")
        sebc.load_full_weights(weights)
        got = sebc(inp).values().detach()
        err = (got - want).abs().max().item() if e > s else 0.0
        if err > ATOL:
            return f"{st} ({how} applies zero): output differs from the reference by {err:.3g}"
    # error: each rank's slice has f1 = 500 (valid for T2 only); raised before any collective
    strict = ShardedEmbeddingBagCollection(tables(), plan, env, weighted, spec, seed=6)
    bad = slice_kjt(dirty_batch(B, 3, weighted, {"f1": (500, 500)}), s, e)
    try:
        strict(bad)
        return f"{st}: no error for id 500 of f1 (T1 has 100 rows)"
    except EmbeddingIdError as ex:
        if "table 'T1', feature 'f1': id 500 is out of range" not in str(ex):
            return f"{st}: unexpected message {ex}"
    return None


def _sharded_worker(env) -> dict[str, str | None]:
    import traceback

    out: dict[str, str | None] = {}
    for st in ALL_TYPES:
        for weighted in (False, True):
            key = f"{st}-{'weighted' if weighted else 'unweighted'}"
            try:
                out[key] = _sharded_case(env, st, weighted)
            except Exception:  # noqa: BLE001 - reported per case
                out[key] = traceback.format_exc()
                return out
    return out


@functools.lru_cache(maxsize=None)
def _sharded_results() -> list[dict[str, str | None]]:
    return run_multiprocess(_sharded_worker, 2, timeout_s=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("weighted", ["unweighted", "weighted"])
@pytest.mark.parametrize("sharding_type", ALL_TYPES)
def test_every_sharding_type_applies_the_policy_before_bucketization_on_2_ranks(sharding_type, weighted):
    for rank, res in enumerate(_sharded_results()):
        err = res.get(f"{sharding_type}-{weighted}", "not run (an earlier case failed)")
        assert err is None, f"rank {rank}: {err}"


# -------------------------------------------------------------------- export
@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
def test_the_exported_model_applies_the_same_policy(tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    kjt = dirty_batch(6, 9, False)
    dense = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    scores = {}
    for policy in ("zero", "error"):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables((8, 8, 8)), compute_kernel="dense", seed=3, on_invalid_id=policy)
        model = DLRM(ebc, 3, [8], [8, 1], 5, 8).eval()
        res = export_model(model, tmp_path / policy, ExportOptions("fp32"))
        assert res.manifest["on_invalid_id"] == policy
        m = load_exported(tmp_path / policy)
        if policy == "zero":
            with torch.no_grad():
                eager = torch.sigmoid(model(dense, kjt).squeeze(1))
                pooled = ebc(kjt)
                torch.testing.assert_close(pooled.values(), expected(kjt, ebc.embedding_weights(), tables((8, 8, 8))),
                                           rtol=0, atol=ATOL)
                ref = torch.sigmoid(model.dense_forward(dense, pooled).squeeze(1))
            scores["zero"] = m.score_kjt(dense, kjt)
            torch.testing.assert_close(scores["zero"], eager, rtol=0, atol=1e-6)
            torch.testing.assert_close(scores["zero"], ref, rtol=0, atol=1e-6)
        else:
            one = dirty_batch(6, 9, False, {"f1": (500,)})
            with pytest.raises(ExportError, match=r"table 'T1', feature 'f1', sample 0: id 500 is out of range; "
                                                  r"expected 0 <= id < 100"):
                m.score_kjt(dense, one)
