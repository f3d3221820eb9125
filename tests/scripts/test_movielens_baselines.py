"""scripts/movielens_baselines.py: exact AUC with ties, and both baselines run on a preprocessed directory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="scikit-learn is the bench/test extra: pip install -e '.[test]'")

from dlrmctl.data.movielens import MovieLensOptions, preprocess_movielens
from tests.helpers.scripts import load_script
from tests.data.test_movielens import make_ml100k


def _script():
    return load_script("movielens_baselines")


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 60).astype(np.float32)
    s = rng.integers(0, 5, 60).astype(np.float64)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    brute = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert _script().auc(y, s) == pytest.approx(brute, abs=1e-12)
    assert np.isnan(_script().auc(np.ones(3), np.arange(3.0)))


def test_baselines_print_prior_popularity_and_lr_on_val_and_test(tmp_path, capsys):
    out = tmp_path / "ml"
    preprocess_movielens(make_ml100k(tmp_path / "in"), out, MovieLensOptions(val_ratio=0.2, test_ratio=0.2))
    res = _script().main([str(out), "--C", "0.1,1"])
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:20].strip() + " " + ln[20:].split()[0] for ln in lines] == [
        "CTR prior val", "CTR prior test", "item popularity val", "item popularity test",
        "logistic regression val", "logistic regression test"]
    assert res["C"] in (0.1, 1.0) and res["prior"]["test"]["auc"] == 0.5
    for s in ("val", "test"):
        m = res["logistic_regression"][s]
        assert 0.0 <= m["auc"] <= 1.0 and m["logloss"] > 0
    # val rows: user 1 / movie 40 (5 stars), users 2 and 3 / movie 40 (1 and 2 stars): one item,
    # so popularity cannot rank them: AUC exactly 0.5
    assert res["item_popularity"]["val"] == 0.5 and "(3 rows)" in lines[2]
