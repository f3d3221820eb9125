"""Binary-classification metrics for CTR models (numpy; float64 accumulation).

Every evaluation path (``Trainer.evaluate``, ``evaluate_run``, ``evaluate_exported``,
``predict``) calls :func:`compute_metrics_from_logits`: AUC ranks the logits and log loss
uses a stable log-sigmoid, both in float64.  Probabilities from a float32 sigmoid are not
enough: above a logit of about 16.6, ``float32(sigmoid(z)) == 1.0``, so a model whose logits
are all large would tie every sample (AUC 0.5) and lose its log loss to clipping.
:func:`compute_metrics` (probabilities in) stays for callers that only have probabilities.

* AUC: exact ROC AUC via the Mann–Whitney U statistic with tied scores given
  their average rank, so a tied positive/negative pair counts 1/2
  (Hanley & McNeil, Radiology 1982).  ``O(n log n)``.
  **Single class** (all labels 1, or all 0, or one class with zero total weight): AUC is
  undefined; it is reported as **0.5** (TorchRec's convention) and a one-line warning is
  logged (logger ``dlrmctl.metrics``).  No rows at all: ``nan``.

Every metric takes optional per-sample ``weights`` (as TorchRec's metrics do):
the weighted metric equals the unweighted one on the data with each row
repeated ``w`` times (integer ``w``).
* logloss: mean binary cross-entropy; from logits ``softplus(z) - y z`` (exact, no clipping);
  from probabilities, clipped to ``[1e-15, 1 - 1e-15]``.  Defined for a single class too.
* NE (normalized entropy): ``logloss / H(p̄)`` with ``H(p) = -p log p - (1-p) log(1-p)``
  and ``p̄`` the mean label (He et al., "Practical Lessons from Predicting
  Clicks on Ads at Facebook", ADKDD 2014).  < 1 means better than predicting the base rate.
  ``nan`` for a single class (the CTR's entropy is 0).
* calibration: ``sum(pred) / sum(label)`` (1 is perfect); from logits ``pred = sigmoid(z)``
  in float64.  ``nan`` without positives.
* accuracy: at threshold 0.5 (``z > 0`` from logits).
"""

from __future__ import annotations

import logging

import numpy as np

_EPS = 1e-15

log = logging.getLogger("dlrmctl.metrics")

#: AUC reported when only one class is present (TorchRec's convention); a warning is logged.
SINGLE_CLASS_AUC = 0.5


def _weights(weights: np.ndarray | None, n: int) -> np.ndarray | None:
    """Validate optional sample weights ``[N]``: finite and >= 0."""
    if weights is None:
        return None
    w = np.asarray(weights, dtype=np.float64).ravel()
    if w.size != n:
        raise ValueError(f"weights: {w.size} values for {n} samples")
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError("weights must be finite and >= 0")
    return w


def auc(preds: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Exact ROC AUC with ties counted as 1/2, optionally with sample weights.

    A (positive i, negative j) pair counts ``w_i * w_j`` times: 1 if
    ``preds[i] > preds[j]``, 1/2 if tied, 0 otherwise, over ``W_pos * W_neg``.
    With integer weights this is the AUC of the data with each row repeated
    ``w`` times (TorchRec's ``AUCMetric`` takes weights the same way).

    Args:
        preds: ``[N]`` scores (any monotone scale: probabilities or logits).
        labels: ``[N]`` in {0, 1} (> 0.5 is positive).
        weights: optional ``[N]`` non-negative sample weights (default all 1).

    Returns:
        AUC in [0, 1]; :data:`SINGLE_CLASS_AUC` (0.5, with a logged warning) when the positives
        or the negatives have zero total weight (one class only); ``nan`` with no rows.

    Raises:
        ValueError: weights of another length, negative or not finite.
    """
    preds = np.asarray(preds, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    w = _weights(weights, preds.size)
    if w is None:
        w = np.ones(preds.size)
    if preds.size == 0:
        return float("nan")
    w_pos = float(w[labels].sum())
    w_neg = float(w[~labels].sum())
    if w_pos == 0 and w_neg == 0:
        return float("nan")
    if w_pos == 0 or w_neg == 0:
        log.warning("AUC is undefined when every label is %d (%d samples): reporting %.1f (TorchRec's convention)",
                    int(w_pos > 0), preds.size, SINGLE_CLASS_AUC)
        return SINGLE_CLASS_AUC
    # per distinct score (ascending): positive and negative weight; a positive beats the
    # negatives of all lower scores and ties (1/2) with those of its own score
    _, inv = np.unique(preds, return_inverse=True)
    pos_w = np.bincount(inv, weights=np.where(labels, w, 0.0))
    neg_w = np.bincount(inv, weights=np.where(labels, 0.0, w))
    neg_below = np.cumsum(neg_w) - neg_w
    return float((pos_w * (neg_below + 0.5 * neg_w)).sum() / (w_pos * w_neg))


def logloss(probs: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """(Weighted) mean binary cross-entropy (natural log) of probabilities ``[N]`` vs labels ``[N]``.

    Raises:
        ValueError: invalid weights (see :func:`auc`).
    """
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64).ravel()
    ll = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    w = _weights(weights, p.size)
    if w is None:
        return float(np.mean(ll))
    return float((w * ll).sum() / w.sum()) if w.sum() > 0 else float("nan")


def entropy(p: float) -> float:
    """Binary entropy ``H(p)`` in nats."""
    p = min(max(p, _EPS), 1 - _EPS)
    return float(-(p * np.log(p) + (1 - p) * np.log(1 - p)))


def log_sigmoid(logits: np.ndarray) -> np.ndarray:
    """``log(sigmoid(z))`` in float64, stable for any finite ``z`` (``-log(1 + exp(-z))``)."""
    z = np.asarray(logits, dtype=np.float64)
    return -np.logaddexp(0.0, -z)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """``sigmoid(z)`` in float64 without overflow (``exp(log_sigmoid(z))``)."""
    return np.exp(log_sigmoid(logits))


def _empty_metrics(n: int) -> dict[str, float]:
    nan = float("nan")
    return {"auc": nan, "logloss": nan, "ne": nan, "calibration": nan, "accuracy": nan, "ctr": nan, "num_samples": int(n)}


def compute_metrics_from_logits(
    logits: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None
) -> dict[str, float]:
    """All metrics from logits (what every evaluation path uses), in float64.

    * AUC ranks the logits (ties 1/2; single class: 0.5 with a warning, see :func:`auc`), so it
      does not saturate where a float32 sigmoid rounds to 1.0 (logits above ~16.6);
    * logloss: ``mean(softplus(z) - y z)`` = ``-mean(y log σ(z) + (1-y) log σ(-z))``, stable
      log-sigmoid, no clipping;
    * NE: logloss / ``H(ctr)``; calibration: ``sum(w σ(z)) / sum(w y)`` with σ in float64;
      accuracy: ``(z > 0) == (y > 0.5)``.

    The result depends only on the multiset of ``(logit, label, weight)`` rows: not on their
    order, the world size or the eval batch size.

    Args:
        logits: ``[N]`` (any float dtype; cast to float64), finite.
        labels: ``[N]`` in {0, 1}.
        weights: optional ``[N]`` >= 0 sample weights (see :func:`compute_metrics`).

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``; all ``nan``
        without rows or with zero total weight; all but ``ctr`` / ``num_samples`` ``nan`` (and a
        logged warning) when a logit is nan or infinite.

    Raises:
        ValueError: ``logits`` and ``labels`` of different lengths, invalid weights.
    """
    z = np.asarray(logits, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=np.float64).ravel()
    n = y.size
    if z.size != n:
        raise ValueError(f"logits: {z.size} values for {n} labels")
    w = _weights(weights, n)
    if n == 0 or (w is not None and w.sum() == 0):
        return _empty_metrics(n)
    ww = np.ones(n) if w is None else w
    tot = float(ww.sum())
    pos = float((ww * y).sum())
    ctr = pos / tot
    bad = int((~np.isfinite(z)).sum())
    if bad:
        log.warning("%d of %d logits are not finite (nan/inf): metrics are nan", bad, n)
        return dict(_empty_metrics(n), ctr=ctr)
    ll_rows = -(y * log_sigmoid(z) + (1 - y) * log_sigmoid(-z))
    ll = float((ww * ll_rows).sum() / tot)
    return {
        "auc": auc(z, y, w),
        "logloss": ll,
        "ne": ll / entropy(ctr) if 0 < ctr < 1 else float("nan"),
        "calibration": float((ww * sigmoid(z)).sum() / pos) if pos > 0 else float("nan"),
        "accuracy": float((ww * ((z > 0) == (y > 0.5))).sum() / tot),
        "ctr": ctr,
        "num_samples": int(n),
    }


def compute_metrics(probs: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """All metrics for probabilities ``[N]`` float and labels ``[N]`` in {0,1}.

    Prefer :func:`compute_metrics_from_logits` where logits exist: probabilities from a float32
    sigmoid saturate at 1.0 above a logit of ~16.6 (ties, AUC 0.5) and log loss is clipped.

    With ``weights`` (``[N]``, >= 0) every metric is the weighted one, i.e. the
    metric of the data with each row repeated ``w`` times for integer weights:
    AUC pairs weigh ``w_i * w_j``; logloss, CTR and accuracy are weighted means;
    NE is weighted logloss over the entropy of the weighted CTR; calibration is
    ``sum(w p) / sum(w y)``.  ``num_samples`` stays the number of rows.

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``.

    Raises:
        ValueError: invalid weights (see :func:`auc`).
    """
    probs = np.asarray(probs, dtype=np.float64).ravel()
    labels = np.asarray(labels, dtype=np.float64).ravel()
    n = labels.size
    w = _weights(weights, n)
    if n == 0 or (w is not None and w.sum() == 0):
        return _empty_metrics(n)
    ww = np.ones(n) if w is None else w
    tot = float(ww.sum())
    ctr = float((ww * labels).sum() / tot)
    ll = logloss(probs, labels, w)
    pos = float((ww * labels).sum())
    return {
        "auc": auc(probs, labels, w),
        "logloss": ll,
        "ne": ll / entropy(ctr) if 0 < ctr < 1 else float("nan"),
        "calibration": float((ww * probs).sum() / pos) if pos > 0 else float("nan"),
        "accuracy": float((ww * ((probs > 0.5) == (labels > 0.5))).sum() / tot),
        "ctr": ctr,
        "num_samples": int(n),
    }
