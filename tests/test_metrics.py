"""Metrics against brute-force definitions."""

import itertools
import math

import numpy as np
import pytest

from dlrmctl.train.metrics import auc, compute_metrics, entropy, logloss


def brute_force_auc(preds, labels):
    pos = [p for p, y in zip(preds, labels) if y == 1]
    neg = [p for p, y in zip(preds, labels) if y == 0]
    s = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return s / (len(pos) * len(neg))


def test_auc_with_ties_counts_half_pairs():
    assert auc(np.array([0.1, 0.5, 0.5, 0.9]), np.array([0, 1, 0, 1])) == pytest.approx(0.875)


def test_auc_matches_pair_counting_on_random_tied_scores():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = rng.integers(2, 60)
        p = rng.integers(0, 5, n) / 4.0  # many ties
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        assert auc(p, y) == pytest.approx(brute_force_auc(p, y))


def test_auc_single_class_is_nan():
    assert math.isnan(auc(np.array([0.2, 0.3]), np.array([1, 1])))


def test_ne_of_base_rate_predictor_is_one_and_logloss_matches_formula():
    y = np.array([1, 0, 0, 0])
    p = np.full(4, 0.25)
    m = compute_metrics(p, y)
    assert m["ne"] == pytest.approx(1.0)
    assert m["logloss"] == pytest.approx(-(math.log(0.25) + 3 * math.log(0.75)) / 4)
    assert entropy(0.25) == pytest.approx(m["logloss"])
    assert m["calibration"] == pytest.approx(1.0)
    assert m["accuracy"] == pytest.approx(0.75)


def test_logloss_clips_certain_wrong_predictions():
    assert math.isfinite(logloss(np.array([0.0, 1.0]), np.array([1, 0])))
