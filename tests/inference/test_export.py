"""Export -> load -> score of a small hand-trained DLRM (tensor interface, manifest, atomicity)."""

import json

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.dlrm import DLRM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")

D_IN = 13
DIM = 8
ROWS = {"t_a": 50, "t_c": 30}
FEATS = ["a", "b", "c"]  # a, b share t_a; c is mean-pooled


def _tables():
    return [EmbeddingBagConfig(name="t_a", num_embeddings=ROWS["t_a"], embedding_dim=DIM, feature_names=["a", "b"]),
            EmbeddingBagConfig(name="t_c", num_embeddings=ROWS["t_c"], embedding_dim=DIM, feature_names=["c"],
                               pooling="mean")]


def _batch(B, g):
    lengths = torch.randint(0, 4, (3 * B,), generator=g)
    lengths[0] = 0  # an empty bag
    n_ab = int(lengths[: 2 * B].sum())
    n_c = int(lengths[2 * B:].sum())
    values = torch.cat([torch.randint(0, ROWS["t_a"], (n_ab,), generator=g),
                        torch.randint(0, ROWS["t_c"], (n_c,), generator=g)])
    dense = torch.rand(B, D_IN, generator=g) * 3
    return dense, KeyedJaggedTensor(FEATS, values, lengths=lengths)


def _label(dense, kjt):
    # a learnable rule: click iff dense[0] large or feature a hits an even id
    a = kjt["a"]
    hit = torch.zeros(dense.shape[0])
    for i, bag in enumerate(a.to_dense()):
        hit[i] = float(bool((bag % 2 == 0).any()))
    return ((dense[:, 0] > 1.5) | (hit > 0)).float()


@pytest.fixture(scope="module")
def trained():
    """A DLRM trained by hand for 60 SGD steps (dense kernel, sparse grads)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(), compute_kernel="dense", seed=1)
    model = DLRM(ebc, D_IN, [16, DIM], [16, 1], 3, DIM)
    sparse = [p for n, p in model.named_parameters() if n.startswith("sparse_arch")]
    dense_p = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch")]
    opt_s, opt_d = torch.optim.SGD(sparse, lr=0.5), torch.optim.Adam(dense_p, lr=0.01)
    for _ in range(60):
        dense, kjt = _batch(64, g)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), _label(dense, kjt))
        opt_s.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_s.step()
        opt_d.step()
    model.eval()
    return model


def _eager_scores(model, dense, kjt):
    with torch.no_grad():
        return torch.sigmoid(model(dense, kjt).squeeze(1))


def _auc(s, y):
    from dlrmctl.metrics import auc

    return auc(np.asarray(s), np.asarray(y))


def test_fp32_export_reproduces_the_eager_model_and_quantized_ones_stay_close(trained, tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    g = torch.Generator().manual_seed(7)
    dense, kjt = _batch(256, g)
    ref = _eager_scores(trained, dense, kjt)
    y = _label(dense, kjt)
    assert _auc(ref, y) > 0.75  # the hand training learned something
    errs = {}
    for dtype in ("fp32", "fp16", "int8", "int4"):
        res = export_model(trained, tmp_path / dtype, ExportOptions(dtype))
        m = load_exported(tmp_path / dtype)
        got = m.score(dense, kjt.values(), kjt.lengths())
        assert got.shape == (256,) and got.dtype == torch.float32
        errs[dtype] = float((got - ref).abs().max())
        assert res.manifest["embedding_bytes"]["stored"] == res.embedding_bytes
    assert errs["fp32"] <= 1e-6
    assert errs["fp16"] <= 1e-3 and errs["int8"] <= 1e-2 and errs["int4"] <= 0.1, errs
    assert errs["fp16"] <= errs["int8"] <= errs["int4"]


def test_scores_do_not_depend_on_batch_composition(trained, tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    export_model(trained, tmp_path / "m", ExportOptions("int8"))
    m = load_exported(tmp_path / "m")
    g = torch.Generator().manual_seed(3)
    dense, kjt = _batch(10, g)
    full = m.score(dense, kjt.values(), kjt.lengths())
    for i in (0, 9):
        one = KeyedJaggedTensor.from_jt_dict({
            f: type(kjt[f])(kjt[f].to_dense()[i], lengths=kjt[f].lengths()[i:i + 1]) for f in FEATS
        })
        s = m.score(dense[i:i + 1], one.values(), one.lengths())
        torch.testing.assert_close(s, full[i:i + 1], rtol=0, atol=1e-6)


def test_manifest_describes_features_tables_quantization_and_bytes(trained, tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model

    meta = {"dataset": "toy", "dense_features": [f"I{i}" for i in range(1, 14)], "label": "label",
            "sparse_features": [{"name": f, "num_embeddings": 10, "multi_hot": False} for f in FEATS],
            "transforms": {"dense": "log1p"}, "splits": {"train": {"rows": 1, "files": []}}}
    res = export_model(trained, tmp_path / "m", ExportOptions(
        "int4", data_meta=meta, source={"run_dir": "runs/x", "metrics": {"auc": 0.8}}, artifact="torchscript"))
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert man == json.loads(json.dumps(res.manifest))
    assert man["sparse_features"] == FEATS
    assert man["dense_features"] == meta["dense_features"]
    assert [(t["name"], t["features"], t["pooling"], t["embedding_dim"], t["dtype"], t["row_bytes"]) for t in man["tables"]] == [
        ("t_a", ["a", "b"], "sum", DIM, "int4", DIM // 2 + 4), ("t_c", ["c"], "mean", DIM, "int4", DIM // 2 + 4)]
    assert man["quantization"]["embeddings"] == "int4" and man["quantization"]["dense"] == "fp32"
    assert man["embedding_bytes"]["fp32"] == (50 + 30) * DIM * 4
    rows_bytes = (50 + 30) * (DIM // 2 + 4)
    assert rows_bytes <= man["embedding_bytes"]["stored"] <= rows_bytes + 2 * 128
    assert man["preprocessing"]["transforms"] == {"dense": "log1p"}
    assert "splits" not in man["preprocessing"]["meta"]
    assert man["source"]["metrics"] == {"auc": 0.8}
    assert man["model_bytes"] == (tmp_path / "m" / "model.pt").stat().st_size
    assert man["inputs"]["lengths"]["dtype"] == "int64" and man["output"]["shape"] == ["B"]


def test_bad_inputs_are_rejected_with_the_feature_and_sample_named(trained, tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    export_model(trained, tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    m = load_exported(tmp_path / "m")
    g = torch.Generator().manual_seed(5)
    dense, kjt = _batch(4, g)
    v = kjt.values().clone()
    v[-1] = ROWS["t_c"]  # last id belongs to feature c, last sample with ids
    with pytest.raises(ExportError, match=r"feature 'c', sample \d: id 30 is out of range; expected 0 <= id < 30"):
        m.score(dense, v, kjt.lengths())
    with pytest.raises(ExportError, match=r"lengths must have num_features \* B = 3 \* 4"):
        m.score(dense, kjt.values(), kjt.lengths()[:-1])
    with pytest.raises(ExportError, match=r"dense must be \[B, 13\]"):
        m.score(dense[:, :5], kjt.values(), kjt.lengths())
    with pytest.raises(ExportError, match=r"sum\(lengths\)"):
        m.score(dense, kjt.values()[:-1], kjt.lengths())


def test_export_is_atomic_and_refuses_to_overwrite(trained, tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model
    from dlrmctl.inference.quantize import QuantizationError

    out = tmp_path / "m"
    export_model(trained, out, ExportOptions("int8", artifact="torchscript"))
    before = (out / "model.pt").read_bytes()
    with pytest.raises(ExportError, match="already exists; pass --force"):
        export_model(trained, out, ExportOptions("int4", artifact="torchscript"))
    assert (out / "model.pt").read_bytes() == before
    # a failing export (NaN weight) leaves neither the target nor temp directories behind
    bad = type(trained)  # same class, weights copied then poisoned
    import copy

    poisoned = copy.deepcopy(trained)
    with torch.no_grad():
        poisoned.sparse_arch.embedding_weights()["t_c"][17, 3] = float("nan")
    with pytest.raises(QuantizationError, match=r"table 't_c', row 17: contains NaN"):
        export_model(poisoned, tmp_path / "p", ExportOptions("int8", artifact="torchscript"))
    assert not (tmp_path / "p").exists()
    export_model(trained, out, ExportOptions("int4", force=True, artifact="torchscript"))
    assert json.loads((out / "manifest.json").read_text())["quantization"]["embeddings"] == "int4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    del bad


def test_dynamic_int8_dense_layers(trained, tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    res = export_model(trained, tmp_path / "m", ExportOptions("int8", quantize_dense=True, artifact="torchscript"))
    assert res.manifest["quantization"]["dense"] == "dynamic_int8"
    m = load_exported(tmp_path / "m")
    code = m.module.dense_part.inlined_graph.__str__() if hasattr(m.module.dense_part, "inlined_graph") else ""
    assert "quantized::linear_dynamic" in code
    g = torch.Generator().manual_seed(9)
    dense, kjt = _batch(64, g)
    ref = _eager_scores(trained, dense, kjt)
    assert float((m.score(dense, kjt.values(), kjt.lengths()) - ref).abs().max()) < 0.05


def test_dcn_interaction_exports(tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported
    from dlrmctl.modules.interactions import InteractionDCNArch, LowRankCrossNet  # noqa: F401
    from dlrmctl.config import ModelConfig
    from dlrmctl.modules.interactions import build_interaction

    torch.manual_seed(0)
    inter = build_interaction(ModelConfig(interaction="dcn", dcn_num_layers=2, dcn_low_rank_dim=8), 3, DIM)
    model = DLRM(EmbeddingBagCollection(_tables(), compute_kernel="fused"), D_IN, [16, DIM], [16, 1], 3, DIM,
                 interaction=inter).eval()
    export_model(model, tmp_path / "m", ExportOptions("fp32"))
    dense, kjt = _batch(5, torch.Generator().manual_seed(2))
    got = load_exported(tmp_path / "m").score(dense, kjt.values(), kjt.lengths())
    torch.testing.assert_close(got, _eager_scores(model, dense, kjt), rtol=0, atol=1e-6)


def test_first_order_term_exports(tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    torch.manual_seed(0)
    model = DLRM(EmbeddingBagCollection(_tables(), compute_kernel="fused"), D_IN, [16, DIM], [16, 1], 3, DIM,
                 first_order_width=3 * DIM).eval()
    with torch.no_grad():  # non-zero, so the term changes the scores
        model.first_order.dense.weight.normal_()
        model.first_order.sparse.weight.normal_()
    export_model(model, tmp_path / "m", ExportOptions("fp32"))
    dense, kjt = _batch(5, torch.Generator().manual_seed(2))
    got = load_exported(tmp_path / "m").score(dense, kjt.values(), kjt.lengths())
    torch.testing.assert_close(got, _eager_scores(model, dense, kjt), rtol=0, atol=1e-6)
    model.first_order = None
    assert float((got - _eager_scores(model, dense, kjt)).abs().max()) > 1e-3


def test_export_without_fbgemm_fails_clearly(trained, tmp_path, monkeypatch):
    from dlrmctl import _fbgemm
    from dlrmctl.inference.export import ExportOptions, export_model

    monkeypatch.setattr(_fbgemm, "HAS_FBGEMM", False)
    with pytest.raises(RuntimeError, match="dlrmctl export needs fbgemm_gpu"):
        export_model(trained, tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    assert not (tmp_path / "m").exists()


def test_load_rejects_non_artifacts_and_truncated_models(trained, tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    with pytest.raises(ExportError, match="not an exported model"):
        load_exported(tmp_path)
    export_model(trained, tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    p = tmp_path / "m" / "model.pt"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ExportError, match="truncated"):
        load_exported(tmp_path / "m")


def test_evaluate_exported_matches_eager_metrics_on_columnar_data(trained, tmp_path):
    from dlrmctl.data.columnar import shard_schema, write_meta, write_split_shard
    from dlrmctl.inference.export import ExportOptions, evaluate_exported, export_model
    from dlrmctl.metrics import compute_metrics

    g = torch.Generator().manual_seed(11)
    n = 300
    dense = torch.rand(n, D_IN, generator=g) * 3
    ids = {"a": torch.randint(0, 50, (n,), generator=g), "b": torch.randint(0, 50, (n,), generator=g),
           "c": torch.randint(0, 30, (n,), generator=g)}
    kjt = KeyedJaggedTensor(FEATS, torch.cat([ids[f] for f in FEATS]), lengths=torch.ones(3 * n, dtype=torch.int64))
    labels = _label(dense, kjt)
    dense_names = [f"I{i}" for i in range(1, 14)]
    cols = {"label": labels.numpy(), **{nm: dense[:, i].numpy() for i, nm in enumerate(dense_names)},
            **{f: ids[f].numpy() for f in FEATS}}
    data = tmp_path / "data"
    write_split_shard(data / "parts" / "p0" / "val.arrow", cols, shard_schema(dense_names, FEATS))
    write_meta(data, {"format_version": 1, "dataset": "toy", "dense_features": dense_names,
                      "sparse_features": [{"name": f, "num_embeddings": 50 if f != "c" else 30, "multi_hot": False} for f in FEATS],
                      "label": "label", "splits": {"val": {"rows": n, "files": ["parts/p0/val.arrow"]}}})
    export_model(trained, tmp_path / "m", ExportOptions("fp32"))
    got = evaluate_exported(tmp_path / "m", data, "val", batch_size=128)
    want = compute_metrics(_eager_scores(trained, dense, kjt).numpy(), labels.numpy())
    assert got["num_samples"] == n
    for k in ("auc", "logloss", "ne"):
        assert got[k] == pytest.approx(want[k], abs=1e-6)
