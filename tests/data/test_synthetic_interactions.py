"""Issue 29 item 3: ``preprocess synthetic --interaction-features``: planted pairwise interactions
(dot products of per-id latent vectors) that a linear model cannot learn; ``bayes_auc`` computed
from the planted logits; a DLRM beats the logistic regression on them."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.data.columnar import open_split, read_meta
from dlrmctl.data.criteo.parse import DENSE_FEATURES, SPARSE_FEATURES
from dlrmctl.data.synthetic import generate_synthetic, planted_model, roc_auc

runner = CliRunner()
FEATS = ["C1", "C2", "C3", "C4"]


def _columns(path, split):
    sd = open_split(path, split)
    return {c: np.concatenate([s.read_column(c) for s in sd.shards])
            for c in ["label"] + DENSE_FEATURES + SPARSE_FEATURES}


def _planted_logits(model, cols, with_interactions=True):
    """The planted logit of stored rows, recomputed term by term from the model's parameters
    (pair by pair, not through the generator's |sum|^2 identity)."""
    z = np.full(len(cols["label"]), model.bias)
    for j, f in enumerate(DENSE_FEATURES):
        z += model.w[j] * (cols[f].astype(np.float64) - model.mu[j])
    for t, f in enumerate(SPARSE_FEATURES):
        if model.effects[t] is not None:
            z += model.effects[t][cols[f]]
    if with_interactions:
        for a, b in itertools.combinations(model.interaction_tables, 2):
            va = model.latent[a][cols[SPARSE_FEATURES[a]]]
            vb = model.latent[b][cols[SPARSE_FEATURES[b]]]
            z += (va * vb).sum(axis=1)
    return z


def test_bayes_auc_is_the_auc_of_the_planted_logits_interactions_included(tmp_path):
    generate_synthetic(tmp_path, rows=30_000, seed=5, num_embeddings=40, interaction_features=FEATS,
                       interaction_dim=3, interaction_std=1.5)
    meta = read_meta(tmp_path)
    model = planted_model(5, [40] * 26, 1.05, FEATS, 3, 1.5)
    cols = _columns(tmp_path, "val")
    z = _planted_logits(model, cols)
    assert meta["bayes_auc_split"] == "val"
    # stored dense values are float32: the recomputed logits differ by ~1e-7, the AUC not visibly
    assert meta["bayes_auc"] == pytest.approx(roc_auc(z, cols["label"]), abs=2e-5)
    z0 = _planted_logits(model, cols, with_interactions=False)
    assert meta["bayes_auc_no_interactions"] == pytest.approx(roc_auc(z0, cols["label"]), abs=2e-5)
    assert meta["bayes_auc"] > meta["bayes_auc_no_interactions"] + 0.03  # the interactions carry signal
    inter = z - z0
    assert abs(inter.std() - 1.5) < 0.1 and abs(inter.mean()) < 0.1  # the documented scale
    # centred under the id distribution: no additive (per-id) part hides in the interaction term
    ids = cols["C1"]
    per_id = np.array([inter[ids == i].mean() for i in np.unique(ids) if (ids == i).sum() > 500])
    assert np.abs(per_id).max() < 0.15
    rec = meta["transforms"]["label"]["interactions"]
    assert rec["features"] == FEATS and rec["pairs"] == 6 and rec["dim"] == 3 and rec["std"] == 1.5


def test_no_interaction_features_leaves_the_output_unchanged(tmp_path):
    generate_synthetic(tmp_path / "a", rows=5_000, seed=2)
    generate_synthetic(tmp_path / "b", rows=5_000, seed=2, interaction_features=[])
    ma, mb = read_meta(tmp_path / "a"), read_meta(tmp_path / "b")
    assert ma == mb and "bayes_auc_no_interactions" not in ma
    a, b = _columns(tmp_path / "a", "train"), _columns(tmp_path / "b", "train")
    assert all(np.array_equal(a[c], b[c]) for c in a)
    # the interactions draw from their own stream: ids and dense values are those without them
    generate_synthetic(tmp_path / "c", rows=5_000, seed=2, interaction_features=FEATS)
    c = _columns(tmp_path / "c", "train")
    assert np.array_equal(a["C1"], c["C1"]) and np.array_equal(a["I1"], c["I1"])


@pytest.mark.parametrize("args, msg", [
    (["--interaction-features", "C1"], "at least 2 features"),
    (["--interaction-features", "C1,C99"], "unknown feature"),
    (["--interaction-features", "C1,C2", "--interaction-dim", "0"], "--interaction-dim must be in [1, 1024]"),
    (["--interaction-features", "C1,C2", "--interaction-dim", "100000000"], "--interaction-dim must be in [1, 1024]"),
    (["--interaction-features", "C1,C2", "--interaction-std", "0"], "--interaction-std must be a finite number in (0, 100]"),
    # 1e300 overflowed float64 in the planted scale (an OverflowError traceback)
    (["--interaction-features", "C1,C2", "--interaction-std", "1e300"], "--interaction-std must be a finite number"),
    (["--interaction-features", "C1,C2", "--interaction-std", "inf"], "--interaction-std must be a finite number"),
])
def test_bad_interaction_options_are_one_usage_error_before_any_output(tmp_path, args, msg):
    out = tmp_path / "d"
    r = runner.invoke(app, ["preprocess", "synthetic", "--out", str(out), "--rows", "1000"] + args)
    assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_dlrm_beats_the_logistic_regression_on_planted_interactions(tmp_path):
    """The CI guard of benchmarks/planted_interactions.md at small size: 100k rows (smaller tables
    than the benchmark's so the LR fits in seconds), DLRM (dot) - LR >= 0.01 test AUC."""
    pytest.importorskip("sklearn", reason="scikit-learn is the bench/test extra: pip install -e '.[test]'")
    from tests.helpers.scripts import load_script

    from dlrmctl.train.reload import run_logits
    from dlrmctl.metrics import compute_metrics_from_logits
    from dlrmctl.train.worker import run_training

    data = tmp_path / "data"
    r = runner.invoke(app, ["preprocess", "synthetic", "--out", str(data), "--rows", "100000", "--seed", "1",
                            "--num-embeddings", "50", "--interaction-features", ",".join(FEATS)])
    assert r.exit_code == 0, r.output
    meta = json.loads((data / "meta.json").read_text())
    run_training("configs/demo.yaml", [f"data.path={data}", f"train.run_dir={tmp_path / 'runs'}", "name=inter",
                                       "train.progress=false", "train.epochs=3", "data.batch_size=256",
                                       "optimizer.embedding.lr=0.1"], overwrite=True)
    z, y = run_logits(str(tmp_path / "runs" / "inter"), "test", checkpoint=None)
    dlrm = compute_metrics_from_logits(z, y)["auc"]
    bc = load_script("baselines_common")
    lr = bc.run_baselines(str(data), "val", "test", (0.1,), 0, out=lambda s: None, log=lambda s: None)
    lr_auc = lr["logistic_regression"]["test"]["auc"]
    assert dlrm - lr_auc >= 0.01, (dlrm, lr_auc, meta["bayes_auc"])
    assert lr_auc < meta["bayes_auc"] - 0.05  # the LR cannot reach the interactions' share
