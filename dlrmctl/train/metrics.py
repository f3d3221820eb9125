"""Binary-classification metrics for CTR models (numpy; float64 accumulation).

* AUC: exact ROC AUC via the Mann–Whitney U statistic with tied scores given
  their average rank, so a tied positive/negative pair counts 1/2
  (Hanley & McNeil, Radiology 1982).  ``O(n log n)``.
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


def auc(preds: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC with ties counted as 1/2.

    Args:
        preds: ``[N]`` scores (any monotone scale: probabilities or logits).
        labels: ``[N]`` in {0, 1}.

    Returns:
        AUC in [0, 1]; ``nan`` when only one class is present.
    """
    preds = np.asarray(preds, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inv, counts = np.unique(preds, return_inverse=True, return_counts=True)
    # 1-based average rank of each distinct score: end of its run minus (count-1)/2
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum_pos = avg_rank[inv][labels].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy (natural log) of probabilities ``[N]`` vs labels ``[N]``."""
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def entropy(p: float) -> float:
    """Binary entropy ``H(p)`` in nats."""
    p = min(max(p, _EPS), 1 - _EPS)
    return float(-(p * np.log(p) + (1 - p) * np.log(1 - p)))


def compute_metrics(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """All metrics for probabilities ``[N]`` float and labels ``[N]`` in {0,1}.

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``.
    """
    probs = np.asarray(probs, dtype=np.float64).ravel()
    labels = np.asarray(labels, dtype=np.float64).ravel()
    n = labels.size
    if n == 0:
        return {"auc": float("nan"), "logloss": float("nan"), "ne": float("nan"), "calibration": float("nan"),
                "accuracy": float("nan"), "ctr": float("nan"), "num_samples": 0}
    ctr = float(labels.mean())
    ll = logloss(probs, labels)
    return {
        "auc": auc(probs, labels),
        "logloss": ll,
        "ne": ll / entropy(ctr) if 0 < ctr < 1 else float("nan"),
        "calibration": float(probs.sum() / labels.sum()) if labels.sum() > 0 else float("nan"),
        "accuracy": float(((probs > 0.5) == (labels > 0.5)).mean()),
        "ctr": ctr,
        "num_samples": int(n),
    }
