"""Weighted features (issue 12 item 3) together with shared features and ``on_invalid_id``
(items 4 and 9).

One weighted feature ``f1`` feeds two weighted tables of different sizes (TA 100 rows, TB 1000
rows, mean pooling); ``f2`` (weighted) also feeds TB; ``f3`` feeds the unweighted table TC (its
ids carry weight 1.0).  Under ``on_invalid_id: zero`` an id invalid for one table is dropped from
that table's bag only, and its weight with it.  The eager EBC (both kernels, the module or the
loader applying the policy), the sharded EBC on 2 gloo ranks and the exported TorchScript model
all give the output of an independent reference that pools ``w_i * row(id_i)`` over the ids
valid for each table.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.sparse import KeyedJaggedTensor
from tests.dist_utils import run_multiprocess
from tests.helpers.kjt import slice_kjt

KERNELS = ("fused", "dense") if HAS_FBGEMM else ("dense",)
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")
ATOL = 1e-5
FEATS = ["f1", "f2", "f3"]
WEIGHTED = ["f1", "f2"]  # f3 feeds the unweighted table TC
KEYS = ["f1@TA", "f1@TB", "f2", "f3"]


def tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="TA", num_embeddings=100, embedding_dim=8, feature_names=["f1"]),
        EmbeddingBagConfig(name="TB", num_embeddings=1000, embedding_dim=8, feature_names=["f1", "f2"],
                           pooling="mean"),
        EmbeddingBagConfig(name="TC", num_embeddings=50, embedding_dim=8, feature_names=["f3"]),
    ]


def dirty_batch(B: int, seed: int, f3_weight: float | None = 1.0) -> KeyedJaggedTensor:
    """Random valid ids with invalid ones planted: f1 500 (valid for TB only) and -3 (none), f2
    5000 (none), f3 60 (none).  Weights of f1 / f2 in [0.5, 1.5); f3's are ``f3_weight`` (the
    loader's 1.0 for an unweighted table's feature), or random when None."""
    gen = torch.Generator().manual_seed(seed)
    valid = {"f1": 100, "f2": 1000, "f3": 50}
    bad = {"f1": (500, -3), "f2": (5000, None), "f3": (60, None)}
    lengths = torch.randint(1, 4, (len(FEATS), B), generator=gen)
    lengths[0, 1] = 0  # an empty bag
    vals = []
    for i, f in enumerate(FEATS):
        v = torch.randint(0, valid[f], (int(lengths[i].sum()),), generator=gen)
        v[0] = bad[f][0]
        if bad[f][1] is not None:
            v[-1] = bad[f][1]
        vals.append(v)
    values = torch.cat(vals)
    w = torch.rand(values.numel(), generator=gen) + 0.5
    if f3_weight is not None:
        n3 = int(lengths[2].sum())
        w[values.numel() - n3:] = f3_weight
    return KeyedJaggedTensor(FEATS, values, lengths=lengths.reshape(-1), weights=w)


def expected(kjt: KeyedJaggedTensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Independent reference, lookups in table order: pool ``w * row`` over the ids valid for the
    table (weight 1.0 for the unweighted table's feature); mean divides by the valid count."""
    B = kjt.stride()
    cols = []
    for t in tables():
        rows = weights[t.name].detach().cpu()
        for f in t.feature_names:
            jt = kjt[f]
            offs, ids, pw = jt.offsets().tolist(), jt.values().tolist(), jt.weights().tolist()
            out = torch.zeros(B, t.embedding_dim)
            for b in range(B):
                n = 0
                for j in range(offs[b], offs[b + 1]):
                    if 0 <= ids[j] < t.num_embeddings:
                        out[b] += rows[ids[j]] * (pw[j] if f in WEIGHTED else 1.0)
                        n += 1
                if t.pooling.value == "mean" and n:
                    out[b] /= n
            cols.append(out)
    return torch.cat(cols, dim=1)


def test_config_accepts_a_feature_shared_by_two_weighted_tables():
    from dlrmctl.config import ConfigError, config_from_dict, weighted_features

    def raw(weighted_tb: bool) -> dict:
        return {"name": "x", "data": {"path": "d"}, "train": {"run_dir": "r"},
                "model": {"on_invalid_id": "zero", "tables": [
                    {"name": "TA", "num_embeddings": 100, "feature_names": ["f1"], "weighted": True},
                    {"name": "TB", "num_embeddings": 1000, "feature_names": ["f1", "f2"], "weighted": weighted_tb},
                    {"name": "TC", "num_embeddings": 50, "feature_names": ["f3"]}]}}

    assert weighted_features(config_from_dict(raw(True))) == ["f1", "f2"]
    with pytest.raises(ConfigError, match=r"feature 'f1' feeds the weighted and the unweighted tables \['TA', 'TB'\]"):
        config_from_dict(raw(False))


# ---------------------------------------------------------------------- eager
@pytest.mark.parametrize("kernel", KERNELS)
def test_eager_both_kernels_module_or_loader_policy_drop_the_weights_with_the_ids(kernel):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, table_id_bounds
    from dlrmctl.sparse.validation import apply_id_policy

    kjt = dirty_batch(6, 1)
    ebc = EmbeddingBagCollection(tables(), is_weighted=True, compute_kernel=kernel, seed=4, on_invalid_id="zero")
    want = expected(kjt, ebc.embedding_weights())
    with torch.no_grad():
        out = ebc(kjt)
    assert out.keys() == KEYS
    torch.testing.assert_close(out.values(), want, rtol=0, atol=ATOL)
    # the loader's policy: f1 comes as f1@TA / f1@TB, each with the weights of its valid ids
    pre = apply_id_policy(kjt, table_id_bounds(tables()), "zero")
    assert pre.keys() == ["f1@TA", "f1@TB", "f2", "f3"]
    for k in pre.keys():
        assert pre[k].weights().numel() == pre[k].values().numel(), k
    f1 = kjt["f1"]
    keep = (f1.values() >= 0) & (f1.values() < 100)
    assert pre["f1@TA"].weights().tolist() == f1.weights()[keep].tolist()
    trusting = EmbeddingBagCollection(tables(), is_weighted=True, compute_kernel=kernel, seed=4, check_ids=False,
                                      on_invalid_id="zero")
    with torch.no_grad():
        torch.testing.assert_close(trusting(pre).values(), want, rtol=0, atol=ATOL)


def test_loader_with_weights_and_zero_gives_the_eager_output(tmp_path):
    """Data f0 (4 rows in meta) read by weighted tables of 2 and 4 rows: the loader's f0@TA drops
    ids >= 2 and their weights; the trusting EBC then equals the EBC applying the policy itself."""
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, table_id_bounds
    from tests.modules.test_weighted_features import write_data

    data = write_data(tmp_path)
    tabs = [EmbeddingBagConfig(name="TA", num_embeddings=2, embedding_dim=4, feature_names=["f0"]),
            EmbeddingBagConfig(name="TB", num_embeddings=4, embedding_dim=4, feature_names=["f0", "f1"])]
    kw = {"features": ["f0", "f1"], "weighted_features": ["f0"], "prefetch": 0}
    raw = next(iter(BatchLoader(data, "train", 40, **kw))).sparse_features
    pre = next(iter(BatchLoader(data, "train", 40, id_bounds=table_id_bounds(tabs), on_invalid_id="zero",
                                **kw))).sparse_features
    assert pre.keys() == ["f0@TA", "f0@TB", "f1"]
    ta = pre["f0@TA"]
    assert ta.weights().numel() == ta.values().numel() and int(ta.values().max()) < 2
    keep = raw["f0"].values() < 2
    assert ta.weights().tolist() == raw["f0"].weights()[keep].tolist()
    assert pre["f1"].weights().tolist() == [1.0] * 40
    ebc = EmbeddingBagCollection(tabs, is_weighted=True, compute_kernel="dense", seed=1, on_invalid_id="zero")
    trusting = EmbeddingBagCollection(tabs, is_weighted=True, compute_kernel="dense", seed=1, check_ids=False)
    with torch.no_grad():
        torch.testing.assert_close(trusting(pre).values(), ebc(raw).values(), rtol=0, atol=ATOL)


# -------------------------------------------------------------------- sharded
def _sharded_worker(env) -> dict[str, str | None]:
    import traceback

    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec, table_id_bounds
    from dlrmctl.sparse.validation import apply_id_policy

    ws, rank = env.world_size, env.rank
    B = 7
    s, e = rank * B // ws, (rank + 1) * B // ws
    spec = EmbeddingOptimizerSpec("exact_sgd", lr=0.1)
    ref = EmbeddingBagCollection(tables(), is_weighted=True, compute_kernel="dense", seed=6)
    weights = {k: v.detach().clone() for k, v in ref.embedding_weights().items()}
    kjt = dirty_batch(B, 3)
    want = expected(kjt, weights)[s:e]
    local = slice_kjt(kjt, s, e)
    out: dict[str, str | None] = {}
    for st in SHARDING_TYPES:
        try:
            plan = plan_from_types(tables(), st, ws)
            inputs = {"module": (True, local),
                      "loader": (False, apply_id_policy(local, table_id_bounds(tables()), "zero"))}
            out[st] = None
            for how, (check, inp) in inputs.items():
                sebc = ShardedEmbeddingBagCollection(tables(), plan, env, True, spec, seed=6, check_ids=check,
                                                     on_invalid_id="zero")
                sebc.load_full_weights(weights)
                kt = sebc(inp)
                if kt.keys() != KEYS:
                    out[st] = f"{st} ({how}): keys {kt.keys()}"
                    break
                err = (kt.values().detach() - want).abs().max().item() if e > s else 0.0
                if err > ATOL:
                    out[st] = f"{st} ({how} applies zero): output differs from the reference by {err:.3g}"
                    break
        except Exception:  # noqa: BLE001 - reported per case; a failure desynchronises the ranks
            out[st] = traceback.format_exc()
            break
    return out


@functools.lru_cache(maxsize=None)
def _sharded_results() -> list[dict[str, str | None]]:
    return run_multiprocess(_sharded_worker, 2, timeout_s=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_sharded_on_2_gloo_ranks_gives_the_reference(sharding_type):
    for rank, res in enumerate(_sharded_results()):
        err = res.get(sharding_type, "not run (an earlier case failed)")
        assert err is None, f"rank {rank}: {err}"


# --------------------------------------------------------------------- export
@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
@pytest.mark.parametrize("artifact", ["pt2", "torchscript"])
def test_exported_model_copies_and_drops_the_weights_like_eager(tmp_path, artifact):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    B = 6
    kjt = dirty_batch(B, 9)
    dense = torch.randn(B, 3, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(), is_weighted=True, compute_kernel="dense", seed=3, on_invalid_id="zero")
    model = DLRM(ebc, 3, [8], [8, 1], len(KEYS), 8).eval()
    res = export_model(model, tmp_path / "m", ExportOptions("fp32", weighted_features=WEIGHTED, artifact=artifact))
    man = res.manifest
    assert man["on_invalid_id"] == "zero" and man["weighted_features"] == WEIGHTED
    assert man["sparse_features"] == FEATS and [lk["key"] for lk in man["lookups"]] == KEYS
    assert [t["weighted"] for t in man["tables"]] == [True, True, False]
    m = load_exported(tmp_path / "m")
    with torch.no_grad():
        pooled = ebc(kjt)
        torch.testing.assert_close(pooled.values(), expected(kjt, ebc.embedding_weights()), rtol=0, atol=ATOL)
        eager_logits = model(dense, kjt).squeeze(1)
    values, lengths, w = kjt.values(), kjt.lengths(), kjt.weights()
    if artifact == "torchscript":  # the TorchScript module's parts (the .pt2 program is one graph)
        torch.testing.assert_close(m.module.embeddings(values, lengths, w), pooled.values(), rtol=0, atol=ATOL)
    torch.testing.assert_close(m.logits_kjt(dense, kjt), eager_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(m.logits(dense, values, lengths, w), eager_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(m.score_kjt(dense, kjt), torch.sigmoid(eager_logits), rtol=0, atol=1e-6)
    # the unweighted table's feature: its weight entries are ignored (1.0) by the artifact
    noisy = dirty_batch(B, 9, f3_weight=None)
    assert noisy.values().tolist() == values.tolist() and noisy.weights().tolist() != w.tolist()
    torch.testing.assert_close(m.logits_kjt(dense, noisy), eager_logits, rtol=0, atol=1e-5)
    # key order of the KJT does not matter; weights are required
    torch.testing.assert_close(m.logits_kjt(dense, kjt.permute([2, 0, 1])), eager_logits, rtol=0, atol=1e-5)
    with pytest.raises(ExportError, match=r"has weighted features \['f1', 'f2'\]"):
        m.logits(dense, values, lengths)
