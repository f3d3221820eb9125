"""Metrics against brute-force definitions."""

import itertools
import logging
import math

import numpy as np
import pytest

from dlrmctl.metrics import auc, compute_metrics, compute_metrics_from_logits, entropy, logloss


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


@pytest.mark.parametrize("label", [1, 0])
def test_single_class_auc_is_half_with_a_one_line_warning_and_logloss_stays_defined(label, caplog):
    # issue 12 item 5: preds [0.1, 0.4, 0.35, 0.8] with labels all 1 (or all 0) gave NaN silently
    p = np.array([0.1, 0.4, 0.35, 0.8])
    y = np.full(4, label)
    z = np.log(p / (1 - p))
    want_ll = float(np.mean(-np.log(p if label else 1 - p)))
    for fn, x in ((compute_metrics_from_logits, z), (compute_metrics, p)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dlrmctl.metrics"):
            m = fn(x, y)
        assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
        assert f"every label is {label}" in caplog.records[0].getMessage() and "0.5" in caplog.records[0].getMessage()
        assert m["auc"] == 0.5
        assert m["logloss"] == pytest.approx(want_ll, abs=1e-12)
        assert math.isnan(m["ne"])  # H(CTR) = 0
        assert m["ctr"] == label and m["num_samples"] == 4
    if label:
        assert want_ll == pytest.approx(1.1230, abs=1e-4)
    # no rows at all stays nan (nothing to report), without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlrmctl.metrics"):
        assert math.isnan(compute_metrics_from_logits(np.zeros(0), np.zeros(0))["auc"])
    assert not caplog.records


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


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_probability_or_logit_makes_every_score_metric_nan_with_a_warning(bad, caplog):
    # the probability path counted no bad scores: a nan probability gave AUC 0.25 from a nan-sorted order
    y = np.array([0, 1, 0, 1.0])
    for fn, x in ((compute_metrics, np.array([bad, 0.2, 0.3, 0.4])), (compute_metrics_from_logits, np.array([bad, 2, 3, 4.0]))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dlrmctl.metrics"):
            m = fn(x, y)
        assert all(math.isnan(m[k]) for k in ("auc", "logloss", "ne", "calibration", "accuracy")), (fn, m)
        assert m["ctr"] == 0.5 and m["num_samples"] == 4
        assert "1 of 4 scores are not finite" in caplog.records[0].getMessage()


def test_weights_at_the_ends_of_the_float64_range_give_numbers_or_nan_not_overflow_errors():
    # sums of weights beyond float64's range raised OverflowError from float(Fraction) in the ratios
    z, y = np.array([1.0, 2.0, 3.0]), np.array([0, 1, 0.0])
    m = compute_metrics_from_logits(z, y, np.full(3, 1e308))
    assert m["ctr"] == pytest.approx(1 / 3) and m["num_samples"] == 3
    assert math.isnan(m["logloss"]) and math.isnan(m["auc"])  # w * loss and the pair weights overflow: inf / inf
    # a quotient beyond the range (calibration over a subnormal positive weight) is inf
    m = compute_metrics_from_logits(z, y, np.array([1.0, 5e-324, 1.0]))
    assert m["calibration"] == math.inf and 0 <= m["ctr"] < 1e-300
    assert compute_metrics(np.array([0.2, 0.7, 0.1]), y, np.array([1.0, 5e-324, 1.0]))["calibration"] == math.inf
