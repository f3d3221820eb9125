"""Binary-classification metrics for CTR models (numpy; float64 terms, exact sums).

Every evaluation path (``Trainer.evaluate``, ``evaluate_run``, ``evaluate_exported``,
``predict``) calls :func:`compute_metrics_from_logits`: AUC ranks the logits and log loss
uses a stable log-sigmoid, both in float64.  Probabilities from a float32 sigmoid are not
enough: above a logit of about 16.6, ``float32(sigmoid(z)) == 1.0``, so a model whose logits
are all large would tie every sample (AUC 0.5) and lose its log loss to clipping.
:func:`compute_metrics` (probabilities in) stays for callers that only have probabilities.

**Distributed, O(local rows) per rank.**  With a process group (``pg=``), each rank passes
only its own rows and gets the metrics of the union of all ranks' rows; no rank ever holds
more than its own rows plus one other rank's rows of the rarer class (the AUC ring below).
The one-process call runs the same code with a world of one.

**Exactness: the figure does not depend on the world size, the split of the rows over ranks
or the eval batch size.**  Every metric is a ratio of sums of per-row float64 terms (each term
computed row by row, the same wherever the row lives).  Those sums are *exact*
(:func:`~dlrmctl.metrics.exact.exact_sum`: each float64 is an integer multiple of 2^-1074,
summed as integers), a rank's exact sum travels as a few non-overlapping float64 pieces
(:func:`~dlrmctl.metrics.exact.sum_pieces`, at most
:data:`~dlrmctl.metrics.exact.SUM_PIECES`), and the final ratios are rounded once from
the exact rationals.  That machinery (and the AUC's :class:`~dlrmctl.metrics.exact.PairCounter`)
lives in :mod:`dlrmctl.metrics.exact`; this module re-exports its public names.
So the result is bit-identical for any partition of the rows.  One exception: the *weighted*
AUC's per-row terms use float64 cumulative sums of the weights of one rank's rows, so it may
differ in the last bits between partitions (relative difference below ~n·2^-53 for n rows,
about 1e-15 in the tests, which assert 1e-12).  The unweighted AUC is an integer pair count:
bit-identical.

* AUC: exact ROC AUC via the Mann–Whitney U statistic with tied scores given
  their average rank, so a tied positive/negative pair counts 1/2
  (Hanley & McNeil, Radiology 1982).  Each rank sorts its rows of the more frequent class;
  the rows of the rarer class (positives in CTR data) visit every rank around a ring
  (``W - 1`` point-to-point shifts, :func:`dlrmctl.distributed.comm.ring_shift`), and each
  visiting row counts, by binary search, the local rows strictly below it and tied with it.
  ``O(n_local log n_local + n_rare log n_local)`` per rank.
  **Single class** (all labels 1, or all 0, or one class with zero total weight): AUC is
  undefined; it is reported as **0.5** (TorchRec's convention) and a one-line warning is
  logged (logger ``dlrmctl.metrics``).  No rows at all: ``nan``.

**Labels are 0 or 1.**  Every public function refuses any other label (2, -1, 0.5, NaN) with a
``ValueError`` naming how many there are and the first one (one vectorised check): a log loss of
labels outside {0, 1} can be negative and its NE meaningless, so none is computed from them.

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
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Callable

import numpy as np

from dlrmctl.metrics.exact import (
    CHUNK_ROWS,
    SUM_PIECES,
    PairCounter,
    circulating_rows,
    exact_sum,
    from_pieces,
    local_pair_total,
    ratio,
    sum_pieces,
)

_EPS = 1e-15

log = logging.getLogger("dlrmctl.metrics")

#: AUC reported when only one class is present (TorchRec's convention); a warning is logged.
SINGLE_CLASS_AUC = 0.5

def _host_f64(x) -> np.ndarray:
    """``x`` (numpy array, sequence, or torch tensor on any device, with or without grad) as a
    flat float64 numpy array on the host."""
    if hasattr(x, "detach") and hasattr(x, "device"):  # a torch tensor: no torch import needed here
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64).ravel()


def _labels(labels) -> np.ndarray:
    """Labels ``[N]`` as float64, each exactly 0 or 1 (one vectorised check).

    Raises:
        ValueError: naming how many labels are not 0 or 1 (NaN included) and the first of them.
    """
    y = _host_f64(labels)
    bad = (y != 0) & (y != 1)  # NaN compares unequal to both
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"labels must be 0 or 1: {int(np.count_nonzero(bad))} of {y.size} are not "
                         f"(e.g. {float(y[i])!r} at index {i})")
    return y


def _weights(weights: np.ndarray | None, n: int) -> np.ndarray | None:
    """Validate optional sample weights ``[N]``: finite and >= 0."""
    if weights is None:
        return None
    w = _host_f64(weights)
    if w.size != n:
        raise ValueError(f"weights: {w.size} values for {n} samples")
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError("weights must be finite and >= 0")
    return w


# ------------------------------------------------------------------ partials
@dataclass
class MetricPartials:
    """Sufficient statistics of a set of rows: counts, and exact sums of per-row float64 terms.

    Two sets' partials add (:meth:`add`); the metrics of the union follow (:func:`_finish`).
    ``w`` is the sample weight (1 without weights), ``y`` the label, ``p`` the prediction
    (``sigmoid(z)`` in float64 from logits), ``ℓ`` the row's log loss.

    Attributes:
        num_samples: rows.
        num_bad: rows whose score (logit or probability) is not finite (the metrics are then ``nan``).
        num_pos: rows with ``y > 0.5`` (the AUC's positives).
        weight: ``Σ w``.  pos_weight: ``Σ w y``.  loss: ``Σ w ℓ``.  pred: ``Σ w p``.
        correct: ``Σ w [(p > 0.5) == (y > 0.5)]``.
        auc_pos_weight / auc_neg_weight: ``Σ w`` over rows with ``y > 0.5`` / ``y <= 0.5``.
    """

    num_samples: int = 0
    num_bad: int = 0
    num_pos: int = 0
    weight: Fraction | float = Fraction(0)
    pos_weight: Fraction | float = Fraction(0)
    loss: Fraction | float = Fraction(0)
    pred: Fraction | float = Fraction(0)
    correct: Fraction | float = Fraction(0)
    auc_pos_weight: Fraction | float = Fraction(0)
    auc_neg_weight: Fraction | float = Fraction(0)

    COUNTS = ("num_samples", "num_bad", "num_pos")
    SUMS = ("weight", "pos_weight", "loss", "pred", "correct", "auc_pos_weight", "auc_neg_weight")

    def add(self, other: "MetricPartials") -> "MetricPartials":
        """In-place sum with ``other`` (exact); returns ``self``."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(counts int64 [3], sums float64 [7, SUM_PIECES])`` for a collective (see :func:`sum_pieces`)."""
        counts = np.array([getattr(self, k) for k in self.COUNTS], dtype=np.int64)
        sums = np.stack([sum_pieces(getattr(self, k)) for k in self.SUMS])
        return counts, sums

    @classmethod
    def from_arrays(cls, counts: np.ndarray, sums: np.ndarray) -> "MetricPartials":
        """The partials of all ranks from gathered ``counts [W, 3]`` and ``sums [W, 7, SUM_PIECES]``."""
        c = np.asarray(counts, dtype=np.int64).reshape(-1, len(cls.COUNTS)).sum(axis=0)
        s = np.asarray(sums, dtype=np.float64).reshape(-1, len(cls.SUMS), SUM_PIECES)
        kw = {k: int(v) for k, v in zip(cls.COUNTS, c.tolist())}
        kw.update({k: from_pieces(s[:, i]) for i, k in enumerate(cls.SUMS)})
        return cls(**kw)


def _row_partials(scores: np.ndarray, y: np.ndarray, w: np.ndarray | None, from_logits: bool) -> MetricPartials:
    """:class:`MetricPartials` of rows ``scores [N]`` float64, ``y [N]`` float64, ``w [N] | None``,
    processed :data:`CHUNK_ROWS` rows at a time (temporaries bounded by the chunk)."""
    n = y.size
    pos_rows = y > 0.5
    out = MetricPartials(num_samples=int(n), num_pos=int(pos_rows.sum()))
    out.num_bad = int((~np.isfinite(scores)).sum())
    for s in range(0, max(n, 1), CHUNK_ROWS):
        z, yy, pr = scores[s : s + CHUNK_ROWS], y[s : s + CHUNK_ROWS], pos_rows[s : s + CHUNK_ROWS]
        if w is None:  # counts are exact integers: no float sums needed for them
            ww, npos = None, int(np.count_nonzero(pr))
            part = MetricPartials(weight=Fraction(yy.size), pos_weight=exact_sum(yy),
                                  auc_pos_weight=Fraction(npos), auc_neg_weight=Fraction(yy.size - npos))
        else:
            ww = w[s : s + CHUNK_ROWS]
            part = MetricPartials(weight=exact_sum(ww), pos_weight=exact_sum(ww * yy),
                                  auc_pos_weight=exact_sum(ww[pr]), auc_neg_weight=exact_sum(ww[~pr]))
        if not out.num_bad:
            if from_logits:
                ll = -(yy * log_sigmoid(z) + (1 - yy) * log_sigmoid(-z))
                p = sigmoid(z)
                ok = (z > 0) == pr
            else:
                pc = np.clip(z, _EPS, 1 - _EPS)
                ll = -(yy * np.log(pc) + (1 - yy) * np.log(1 - pc))
                p = z
                ok = (z > 0.5) == pr
            if ww is None:
                part.loss, part.pred, part.correct = exact_sum(ll), exact_sum(p), Fraction(int(np.count_nonzero(ok)))
            else:
                part.loss, part.pred, part.correct = exact_sum(ww * ll), exact_sum(ww * p), exact_sum(ww * ok)
        out.add(part)
    return out


def _single_class_auc(p: MetricPartials, warn: bool) -> float:
    if warn:
        log.warning("AUC is undefined when every label is %d (%d samples): reporting %.1f (TorchRec's convention)",
                    int(p.auc_pos_weight > 0), p.num_samples, SINGLE_CLASS_AUC)
    return SINGLE_CLASS_AUC


def auc(preds: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Exact ROC AUC with ties counted as 1/2, optionally with sample weights.

    A (positive i, negative j) pair counts ``w_i * w_j`` times: 1 if
    ``preds[i] > preds[j]``, 1/2 if tied, 0 otherwise, over ``W_pos * W_neg``.
    With integer weights this is the AUC of the data with each row repeated
    ``w`` times (TorchRec's ``AUCMetric`` takes weights the same way).  Same counting as
    the distributed path (:class:`PairCounter`, one rank).

    Args:
        preds: ``[N]`` scores (any monotone scale: probabilities or logits).
        labels: ``[N]``, each 0 or 1 (anything else, NaN included, is a ValueError).
        weights: optional ``[N]`` non-negative sample weights (default all 1).

    Returns:
        AUC in [0, 1]; :data:`SINGLE_CLASS_AUC` (0.5, with a logged warning) when the positives
        or the negatives have zero total weight (one class only); ``nan`` with no rows.

    Raises:
        ValueError: a label other than 0 or 1 (NaN included); weights of another length, negative
            or not finite.
    """
    z = _host_f64(preds)
    pos = _labels(labels) > 0.5
    w = _weights(weights, z.size)
    ww = np.ones(z.size) if w is None else w
    p = MetricPartials(num_samples=z.size, num_pos=int(pos.sum()),
                       auc_pos_weight=exact_sum(ww[pos]), auc_neg_weight=exact_sum(ww[~pos]))
    return _auc_of(p, lambda circ: local_pair_total(z, pos, w, circ), warn=True)


def _auc_of(p: MetricPartials, pair_total: Callable[[bool], Fraction | float], warn: bool) -> float:
    """AUC from the combined partials and ``pair_total(circulate_pos)`` (the exact numerator)."""
    if p.num_samples == 0 or (p.auc_pos_weight == 0 and p.auc_neg_weight == 0):
        return float("nan")
    if p.auc_pos_weight == 0 or p.auc_neg_weight == 0:
        return _single_class_auc(p, warn)
    circulate_pos = p.num_pos <= p.num_samples - p.num_pos  # the rarer class travels
    return ratio(pair_total(circulate_pos), p.auc_pos_weight * p.auc_neg_weight)


# ------------------------------------------------------------------ metrics
def logloss(probs: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """(Weighted) mean binary cross-entropy (natural log) of probabilities ``[N]`` vs labels ``[N]``.

    Raises:
        ValueError: a label other than 0 or 1, invalid weights (see :func:`auc`).
    """
    p = np.clip(_host_f64(probs), _EPS, 1 - _EPS)
    y = _labels(labels)
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


def _finish(p: MetricPartials, pair_total: Callable[[bool], Fraction | float], warn: bool) -> dict[str, float]:
    """The metrics of the rows summarised by the (all-rank) partials ``p``.

    ``pair_total(circulate_pos)`` returns the AUC numerator (called only when the AUC is defined;
    every rank of a group reaches the same decision, so its collectives match)."""
    n = p.num_samples
    if n == 0 or p.weight == 0:
        return _empty_metrics(n)
    ctr = ratio(p.pos_weight, p.weight)
    if p.num_bad:
        if warn:
            log.warning("%d of %d scores are not finite (nan/inf): metrics are nan", p.num_bad, n)
        return dict(_empty_metrics(n), ctr=ctr)
    ll = ratio(p.loss, p.weight)
    return {
        "auc": _auc_of(p, pair_total, warn),
        "logloss": ll,
        "ne": ll / entropy(ctr) if 0 < ctr < 1 else float("nan"),
        "calibration": ratio(p.pred, p.pos_weight) if p.pos_weight > 0 else float("nan"),
        "accuracy": ratio(p.correct, p.weight),
        "ctr": ctr,
        "num_samples": int(n),
    }


def _prepare(scores, labels, weights, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    z = _host_f64(scores)
    y = _labels(labels)
    if z.size != y.size:
        raise ValueError(f"{what}: {z.size} values for {y.size} labels")
    return z, y, _weights(weights, y.size)


def compute_metrics_from_logits(
    logits: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None, *, pg=None, device=None,
) -> dict[str, float]:
    """All metrics from logits (what every evaluation path uses), in float64.

    * AUC ranks the logits (ties 1/2; single class: 0.5 with a warning, see :func:`auc`), so it
      does not saturate where a float32 sigmoid rounds to 1.0 (logits above ~16.6);
    * logloss: ``mean(softplus(z) - y z)`` = ``-mean(y log σ(z) + (1-y) log σ(-z))``, stable
      log-sigmoid, no clipping;
    * NE: logloss / ``H(ctr)``; calibration: ``sum(w σ(z)) / sum(w y)`` with σ in float64;
      accuracy: ``(z > 0) == (y > 0.5)``.

    The result depends only on the multiset of ``(logit, label, weight)`` rows: not on their
    order, the world size or the eval batch size (bit for bit; weighted AUC to ~1e-15 relative,
    see the module docstring).

    **Distributed** (``pg`` a process group): every rank of ``pg`` calls this with *its own*
    rows and all get the metrics of the union.  Memory per rank: its own rows (float64 copies),
    the sorted rows of its more frequent class, and two ``[m, 1 or 2]`` float64 buffers of the
    rarer class (its own and one visiting rank's), i.e. O(local rows); traffic: the rarer
    class's rows around the ring (``W - 1`` point-to-point shifts), plus a few KB of partials.
    Warnings are logged by group rank 0 only.

    Args:
        logits: ``[N]`` (any float dtype; cast to float64): numpy, or a torch tensor on any device
            (copied to the host; also with ``requires_grad``); labels and weights likewise.
        labels: ``[N]``, each 0 or 1 (anything else, NaN included, is a ValueError).
        weights: optional ``[N]`` >= 0 sample weights (see :func:`compute_metrics`); with ``pg``,
            all ranks or none must pass weights.
        pg: process group (None: these rows are all the rows).
        device: device of the collectives' tensors (the group's: ``env.device``; default CPU).

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``; all ``nan``
        without rows or with zero total weight; all but ``ctr`` / ``num_samples`` ``nan`` (and a
        logged warning) when a logit is nan or infinite.

    Raises:
        ValueError: ``logits`` and ``labels`` of different lengths, a label other than 0 or 1 (NaN
            included: names the count and the first bad value), invalid weights, inputs that
            cannot be read as numbers (with ``pg``: on every rank, naming the rank at fault, so no
            rank waits in a collective), weights on some ranks only.
    """
    if pg is None:
        z, y, w = _prepare(logits, labels, weights, "logits")
        pos = y > 0.5
        return _finish(_row_partials(z, y, w, from_logits=True), lambda c: local_pair_total(z, pos, w, c), warn=True)
    return _distributed_metrics(logits, labels, weights, pg, device)


def _distributed_metrics(logits, labels, weights, pg, device) -> dict[str, float]:
    import torch

    from dlrmctl.distributed import comm

    device = torch.device("cpu") if device is None else torch.device(device)
    me, ws = comm.group_rank_size(pg)
    err = ""
    try:
        z, y, w = _prepare(logits, labels, weights, "logits")
        part = _row_partials(z, y, w, from_logits=True)
    except (ValueError, TypeError, RuntimeError) as e:  # told to every rank below: none waits forever
        err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        z, y, w, part = np.zeros(0), np.zeros(0), None, MetricPartials()
    counts, sums = part.to_arrays()
    flags = np.array([int(bool(err)), int(w is not None)], dtype=np.int64)
    allc = comm.all_gather_tensor(torch.from_numpy(np.concatenate([counts, flags])).to(device), pg).cpu().numpy()
    bad_ranks = np.flatnonzero(allc[:, -2]).tolist()
    if bad_ranks:
        raise ValueError(f"rank {me}: {err}" if err else f"invalid metric input on rank(s) {bad_ranks}")
    weighted = allc[:, -1]
    if weighted.min() != weighted.max():
        raise ValueError(f"weights given on rank(s) {np.flatnonzero(weighted).tolist()} only: "
                         "pass weights on every rank or on none")
    alls = comm.all_gather_tensor(torch.from_numpy(sums).to(device), pg).cpu().numpy()
    total = MetricPartials.from_arrays(allc[:, : len(MetricPartials.COUNTS)], alls)
    rows_pos = allc[:, 2].tolist()
    rows_neg = (allc[:, 0] - allc[:, 2]).tolist()
    pos = y > 0.5

    def ring_pair_total(circulate_pos: bool) -> Fraction | float:
        counter = PairCounter(z, pos, w, circulate_pos)
        cz, cw = circulating_rows(z, pos, w, circulate_pos)
        buf = torch.from_numpy(np.stack([cz] if cw is None else [cz, cw], axis=1)).to(device)  # [m, 1 | 2] float64
        del cz, cw
        rows = rows_pos if circulate_pos else rows_neg
        for step in range(ws):
            if step:  # the rows that started on rank (me - step) mod W
                buf = comm.ring_shift(buf, rows[(me - step) % ws], pg)
            b = buf.cpu().numpy()
            counter.visit(np.ascontiguousarray(b[:, 0]), None if w is None else np.ascontiguousarray(b[:, 1]))
        del buf
        mine_total = sum_pieces(counter.total)
        got = comm.all_gather_tensor(torch.from_numpy(mine_total).to(device), pg).cpu().numpy()
        return from_pieces(got)

    return _finish(total, ring_pair_total, warn=me == 0)


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
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``; all but ``ctr``
        / ``num_samples`` ``nan`` (and a logged warning) when a probability is nan or infinite.

    Raises:
        ValueError: a label other than 0 or 1, invalid weights (see :func:`auc`).
    """
    p, y, w = _prepare(probs, labels, weights, "probs")
    pos = y > 0.5
    return _finish(_row_partials(p, y, w, from_logits=False), lambda c: local_pair_total(p, pos, w, c), warn=True)
