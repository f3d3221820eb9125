"""Binary-classification metrics for CTR models (numpy; float64 accumulation).

* AUC: exact ROC AUC via the Mann–Whitney U statistic with tied scores given
  their average rank, so a tied positive/negative pair counts 1/2
  (Hanley & McNeil, Radiology 1982).  ``O(n log n)``.

Every metric takes optional per-sample ``weights`` (as TorchRec's metrics do):
the weighted metric equals the unweighted one on the data with each row
repeated ``w`` times (integer ``w``).
* logloss: mean binary cross-entropy, probabilities clipped to ``[1e-15, 1 - 1e-15]``.
* NE (normalized entropy): ``logloss / H(p̄)`` with ``H(p) = -p log p - (1-p) log(1-p)``
  and ``p̄`` the mean label (He et al., "Practical Lessons from Predicting
  Clicks on Ads at Facebook", ADKDD 2014).  < 1 means better than predicting the base rate.
* calibration: ``sum(pred) / sum(label)`` (1 is perfect).
* accuracy: at threshold 0.5.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-15


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
        AUC in [0, 1]; ``nan`` when the positives or the negatives have zero total weight.

    Raises:
        ValueError: weights of another length, negative or not finite.
    """
    preds = np.asarray(preds, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    w = _weights(weights, preds.size)
    if w is None:
        w = np.ones(preds.size)
    w_pos = float(w[labels].sum())
    w_neg = float(w[~labels].sum())
    if w_pos == 0 or w_neg == 0:
        return float("nan")
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


def compute_metrics(probs: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """All metrics for probabilities ``[N]`` float and labels ``[N]`` in {0,1}.

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
        return {"auc": float("nan"), "logloss": float("nan"), "ne": float("nan"), "calibration": float("nan"),
                "accuracy": float("nan"), "ctr": float("nan"), "num_samples": int(n)}
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
