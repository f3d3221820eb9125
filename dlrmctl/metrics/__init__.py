"""Evaluation metrics of binary click models, shared by training and inference (below every
package that uses them; numpy only at import time).

* :mod:`~dlrmctl.metrics.compute`: AUC, logloss, normalized entropy (NE), calibration and
  accuracy, of probabilities or logits, weighted or not, on one process or over a process group
  (:func:`compute_metrics_from_logits`);
* :mod:`~dlrmctl.metrics.exact`: the exact arithmetic that makes the distributed AUC equal the
  single-process one (pair counts, exact sums, the ring of rows).
"""

from dlrmctl.metrics.compute import (
    SINGLE_CLASS_AUC,
    MetricPartials,
    auc,
    compute_metrics,
    compute_metrics_from_logits,
    entropy,
    log_sigmoid,
    logloss,
    sigmoid,
)

__all__ = ["SINGLE_CLASS_AUC", "MetricPartials", "auc", "compute_metrics", "compute_metrics_from_logits", "entropy",
           "log_sigmoid", "logloss", "sigmoid"]
