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
(:func:`exact_sum`: each float64 is an integer multiple of 2^-1074, summed as integers), a
rank's exact sum travels as a few non-overlapping float64 pieces (:func:`sum_pieces`, at
most :data:`SUM_PIECES`), and the final ratios are rounded once from the exact rationals.
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
import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Callable

import numpy as np

_EPS = 1e-15

log = logging.getLogger("dlrmctl.metrics")

#: AUC reported when only one class is present (TorchRec's convention); a warning is logged.
SINGLE_CLASS_AUC = 0.5

#: float64 pieces that carry one exact sum between ranks.  A finite exact sum of float64
#: values spans at most 2^1024·2^63 down to 2^-1074 (about 2,160 bits) and every piece
#: removes at least 53 of them, so 41 suffice.
SUM_PIECES = 48

#: rows per chunk of the per-row terms (bounds the temporaries: ~10 float64 arrays of it)
_CHUNK_ROWS = 1 << 18

# exact_sum: a finite float64 with biased exponent field E (bits 52..62) and 52-bit fraction F is
# ±M·2^(max(E, 1) - 1075) with the integer M = F + 2^52·[E > 0] < 2^53.  M is split into
# hi = M >> 26 (< 2^27) and lo = M mod 2^26, and both are summed per E with np.bincount in
# float64, which is exact while a bucket's partial sums are integers below 2^53: flushed to
# Python integers every 2^24 rows.  Chunks of 2^16 rows keep the temporaries in the heap.
_EXACT_CHUNK = 1 << 16
_EXACT_FLUSH = 1 << 24
_FRAC_MASK = (1 << 52) - 1
_LO_MASK = (1 << 26) - 1


def _flush_buckets(hs: np.ndarray, ls: np.ndarray) -> Fraction:
    """Exact value of the per-exponent sums ``hs, ls [2048]`` (integer-valued float64)."""
    hs[1] += hs[0]  # subnormals (E = 0) share the unit of E = 1
    ls[1] += ls[0]
    nz = np.flatnonzero((hs[1:] != 0) | (ls[1:] != 0)) + 1
    if nz.size == 0:
        return Fraction(0)
    b0 = int(nz[0])
    acc = 0
    for b in nz.tolist():
        acc += ((int(hs[b]) << 26) + int(ls[b])) << (b - b0)
    return Fraction(acc) * Fraction(2) ** (b0 - 1075)


def exact_sum(x: np.ndarray) -> Fraction | float:
    """The exact (unrounded) sum of float64 values.

    Args:
        x: ``[N]`` values (cast to float64).

    Returns:
        the exact sum as a :class:`fractions.Fraction` when every value is finite; otherwise
        ``float`` ``inf``, ``-inf`` or ``nan`` (numpy's sum).  ``float(exact_sum(x))`` is the
        correctly rounded sum (what ``math.fsum`` returns), independent of the order of ``x``.
    """
    x = np.ascontiguousarray(x, dtype=np.float64).ravel()
    if not np.isfinite(x).all():
        return float(x.sum())
    hs, ls = np.zeros(2048), np.zeros(2048)
    total, pending = Fraction(0), 0
    for s in range(0, x.size, _EXACT_CHUNK):
        bits = x[s : s + _EXACT_CHUNK].view(np.int64)
        e = (bits >> 52) & 0x7FF
        m = (bits & _FRAC_MASK) | ((e != 0).astype(np.int64) << 52)
        neg = bits < 0
        hi = (m >> 26).astype(np.float64)
        lo = (m & _LO_MASK).astype(np.float64)
        np.negative(hi, out=hi, where=neg)
        np.negative(lo, out=lo, where=neg)
        hs += np.bincount(e, weights=hi, minlength=2048)
        ls += np.bincount(e, weights=lo, minlength=2048)
        pending += bits.size
        if pending >= _EXACT_FLUSH:
            total += _flush_buckets(hs, ls)
            hs[:], ls[:], pending = 0.0, 0.0, 0
    return total + _flush_buckets(hs, ls)


def sum_pieces(s: Fraction | float, n: int = SUM_PIECES) -> np.ndarray:
    """An exact sum as ``[n]`` float64 pieces whose exact sum is ``s`` (zero padded).

    Pieces are non-overlapping (each the correctly rounded remainder of the ones before), so
    ``math.fsum`` of the pieces of several sums is the correctly rounded total of those sums.
    A non-finite ``s`` (or one beyond float64's range) is one ``inf`` / ``nan`` piece.
    """
    out = np.zeros(n, dtype=np.float64)
    if isinstance(s, float):
        out[0] = s
        return out
    r = s
    for i in range(n):
        if r == 0:
            return out
        try:
            p = float(r)
        except OverflowError:
            out[:] = 0.0
            out[0] = math.inf if r > 0 else -math.inf
            return out
        out[i] = p
        r -= Fraction(p)
    if r != 0:  # pragma: no cover - impossible for finite float64 inputs (see SUM_PIECES)
        raise ArithmeticError(f"exact sum needs more than {n} float64 pieces")
    return out


def from_pieces(pieces: np.ndarray) -> Fraction | float:
    """The exact sum of float64 ``pieces`` (any shape): a Fraction, or a non-finite float."""
    p = np.asarray(pieces, dtype=np.float64).ravel()
    if not np.isfinite(p).all():
        return float(p.sum())
    return sum((Fraction(float(v)) for v in p[p != 0]), Fraction(0))


def _to_float(x: Fraction | float) -> float:
    """``float(x)``, ``±inf`` where an exact value lies beyond float64's range (instead of OverflowError)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _ratio(a: Fraction | float, b: Fraction | float) -> float:
    """``a / b`` correctly rounded from the exact values (``nan`` for 0/0, as float division would;
    ``±inf`` when the quotient or an operand lies beyond float64's range)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b == 0:
            return float("nan") if a == 0 else (math.inf if a > 0 else -math.inf)
        return _to_float(a / b)
    with np.errstate(all="ignore"):
        return float(np.float64(_to_float(a)) / np.float64(_to_float(b)))


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
    processed :data:`_CHUNK_ROWS` rows at a time (temporaries bounded by the chunk)."""
    n = y.size
    pos_rows = y > 0.5
    out = MetricPartials(num_samples=int(n), num_pos=int(pos_rows.sum()))
    out.num_bad = int((~np.isfinite(scores)).sum())
    for s in range(0, max(n, 1), _CHUNK_ROWS):
        z, yy, pr = scores[s : s + _CHUNK_ROWS], y[s : s + _CHUNK_ROWS], pos_rows[s : s + _CHUNK_ROWS]
        if w is None:  # counts are exact integers: no float sums needed for them
            ww, npos = None, int(np.count_nonzero(pr))
            part = MetricPartials(weight=Fraction(yy.size), pos_weight=exact_sum(yy),
                                  auc_pos_weight=Fraction(npos), auc_neg_weight=Fraction(yy.size - npos))
        else:
            ww = w[s : s + _CHUNK_ROWS]
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


# ----------------------------------------------------------------------- AUC
class PairCounter:
    """This rank's part of the AUC numerator: pairs between visiting rows of the circulating class
    and the local rows of the other class.

    The numerator is ``Σ_{pos i, neg j} w_i w_j ([s_i > s_j] + ½ [s_i == s_j])``.  The local rows
    of the class that stays (``stay``) are sorted once (``[m]`` float64, plus the ``[m + 1]``
    float64 cumulative sum of their weights when weighted); each visiting row of the other class
    counts, by ``np.searchsorted``, the staying rows strictly below it and tied with it.  After
    every rank's circulating rows have visited every rank, the exact sum over ranks of
    :attr:`total` is the numerator.  Visiting rows arrive sorted (:func:`_circulating_rows`),
    which makes the binary searches cache friendly; the counts do not depend on it.

    Args:
        scores: ``[N]`` float64 local scores; pos: ``[N]`` bool (``label > 0.5``);
        w: ``[N]`` float64 weights or None; circulate_pos: True when the positives travel.
    """

    def __init__(self, scores: np.ndarray, pos: np.ndarray, w: np.ndarray | None, circulate_pos: bool) -> None:
        stay = ~pos if circulate_pos else pos
        self.circulate_pos = circulate_pos
        if w is None:
            self.sorted = np.sort(scores[stay])
            self.cum_w = None
        else:
            order = np.argsort(scores[stay], kind="stable")
            self.sorted = scores[stay][order]
            self.cum_w = np.concatenate([[0.0], np.cumsum(w[stay][order])])
        self.total: Fraction | float = Fraction(0)

    def visit(self, scores: np.ndarray, w: np.ndarray | None) -> None:
        """Count the pairs of visiting rows ``scores [m]`` (weights ``w [m]`` or None) with the local rows."""
        if scores.size == 0 or self.sorted.size == 0:
            return
        for s in range(0, scores.size, _CHUNK_ROWS):
            z = scores[s : s + _CHUNK_ROWS]
            lo = np.searchsorted(self.sorted, z, side="left")
            hi = np.searchsorted(self.sorted, z, side="right")
            if self.cum_w is None:
                # integer pair counts, twice: 2·below + tied = lo + hi for a visiting positive,
                # 2·above + tied = 2·m - lo - hi for a visiting negative (int64: m < 2^41 rows)
                twice = int((lo + hi).sum(dtype=np.int64))
                if not self.circulate_pos:
                    twice = 2 * self.sorted.size * z.size - twice
                self.total += Fraction(twice, 2)
                continue
            below, upto, total = self.cum_w[lo], self.cum_w[hi], float(self.cum_w[-1])
            eq = upto - below
            # visiting positive: beats the local negatives below it; visiting negative: is beaten by
            # the local positives above it; ties count 1/2 either way
            term = below + 0.5 * eq if self.circulate_pos else (total - upto) + 0.5 * eq
            self.total += exact_sum(w[s : s + _CHUNK_ROWS] * term)


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
    return _auc_of(p, lambda circ: _local_pair_total(z, pos, w, circ), warn=True)


def _circulating_rows(z: np.ndarray, pos: np.ndarray, w: np.ndarray | None,
                      circulate_pos: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """This rank's rows of the travelling class: scores ``[m]`` float64 sorted ascending, and their
    weights ``[m]`` (or None).  Sorted, the binary searches of :meth:`PairCounter.visit` walk the
    local sorted rows in order (numpy reuses the previous key's bounds): ~15x faster than random keys."""
    mine = pos if circulate_pos else ~pos
    if w is None:
        return np.sort(z[mine]), None
    order = np.argsort(z[mine], kind="stable")
    return z[mine][order], w[mine][order]


def _local_pair_total(z: np.ndarray, pos: np.ndarray, w: np.ndarray | None, circulate_pos: bool):
    """The AUC numerator of one process's rows (the ring of one rank)."""
    c = PairCounter(z, pos, w, circulate_pos)
    c.visit(*_circulating_rows(z, pos, w, circulate_pos))
    return c.total


def _auc_of(p: MetricPartials, pair_total: Callable[[bool], Fraction | float], warn: bool) -> float:
    """AUC from the combined partials and ``pair_total(circulate_pos)`` (the exact numerator)."""
    if p.num_samples == 0 or (p.auc_pos_weight == 0 and p.auc_neg_weight == 0):
        return float("nan")
    if p.auc_pos_weight == 0 or p.auc_neg_weight == 0:
        return _single_class_auc(p, warn)
    circulate_pos = p.num_pos <= p.num_samples - p.num_pos  # the rarer class travels
    return _ratio(pair_total(circulate_pos), p.auc_pos_weight * p.auc_neg_weight)


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
    ctr = _ratio(p.pos_weight, p.weight)
    if p.num_bad:
        if warn:
            log.warning("%d of %d scores are not finite (nan/inf): metrics are nan", p.num_bad, n)
        return dict(_empty_metrics(n), ctr=ctr)
    ll = _ratio(p.loss, p.weight)
    return {
        "auc": _auc_of(p, pair_total, warn),
        "logloss": ll,
        "ne": ll / entropy(ctr) if 0 < ctr < 1 else float("nan"),
        "calibration": _ratio(p.pred, p.pos_weight) if p.pos_weight > 0 else float("nan"),
        "accuracy": _ratio(p.correct, p.weight),
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
        return _finish(_row_partials(z, y, w, from_logits=True), lambda c: _local_pair_total(z, pos, w, c), warn=True)
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
        cz, cw = _circulating_rows(z, pos, w, circulate_pos)
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
    return _finish(_row_partials(p, y, w, from_logits=False), lambda c: _local_pair_total(p, pos, w, c), warn=True)
