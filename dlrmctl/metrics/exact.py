"""Exact summation and AUC pair counting behind :mod:`dlrmctl.metrics` (numpy, float64).

What makes the metrics independent of the world size, the split of the rows over ranks and the
eval batch size:

* :func:`exact_sum`: the exact (unrounded) sum of float64 values, as a
  :class:`fractions.Fraction` (each float64 is an integer multiple of 2^-1074, summed as integers);
* :func:`sum_pieces` / :func:`from_pieces`: one exact sum as at most :data:`SUM_PIECES`
  non-overlapping float64 pieces (what a collective carries between ranks) and back;
* :func:`ratio`: a quotient of two exact sums, rounded once;
* :class:`PairCounter`, :func:`circulating_rows`, :func:`local_pair_total`: the AUC numerator
  (Mann–Whitney U, ties 1/2) counted by binary search of the visiting rows of one class among
  the sorted local rows of the other.

The metrics themselves (labels, weights, log loss, NE, calibration, the distributed ring) are in
:mod:`dlrmctl.metrics`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


#: float64 pieces that carry one exact sum between ranks.  A finite exact sum of float64
#: values spans at most 2^1024·2^63 down to 2^-1074 (about 2,160 bits) and every piece
#: removes at least 53 of them, so 41 suffice.
SUM_PIECES = 48

#: rows per chunk of the per-row terms (bounds the temporaries: ~10 float64 arrays of it)
CHUNK_ROWS = 1 << 18

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


def to_float(x: Fraction | float) -> float:
    """``float(x)``, ``±inf`` where an exact value lies beyond float64's range (instead of OverflowError)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def ratio(a: Fraction | float, b: Fraction | float) -> float:
    """``a / b`` correctly rounded from the exact values (``nan`` for 0/0, as float division would;
    ``±inf`` when the quotient or an operand lies beyond float64's range)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b == 0:
            return float("nan") if a == 0 else (math.inf if a > 0 else -math.inf)
        return to_float(a / b)
    with np.errstate(all="ignore"):
        return float(np.float64(to_float(a)) / np.float64(to_float(b)))


# ----------------------------------------------------------------------- AUC
class PairCounter:
    """This rank's part of the AUC numerator: pairs between visiting rows of the circulating class
    and the local rows of the other class.

    The numerator is ``Σ_{pos i, neg j} w_i w_j ([s_i > s_j] + ½ [s_i == s_j])``.  The local rows
    of the class that stays (``stay``) are sorted once (``[m]`` float64, plus the ``[m + 1]``
    float64 cumulative sum of their weights when weighted); each visiting row of the other class
    counts, by ``np.searchsorted``, the staying rows strictly below it and tied with it.  After
    every rank's circulating rows have visited every rank, the exact sum over ranks of
    :attr:`total` is the numerator.  Visiting rows arrive sorted (:func:`circulating_rows`),
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
        for s in range(0, scores.size, CHUNK_ROWS):
            z = scores[s : s + CHUNK_ROWS]
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
            self.total += exact_sum(w[s : s + CHUNK_ROWS] * term)


def circulating_rows(z: np.ndarray, pos: np.ndarray, w: np.ndarray | None,
                      circulate_pos: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """This rank's rows of the travelling class: scores ``[m]`` float64 sorted ascending, and their
    weights ``[m]`` (or None).  Sorted, the binary searches of :meth:`PairCounter.visit` walk the
    local sorted rows in order (numpy reuses the previous key's bounds): ~15x faster than random keys."""
    mine = pos if circulate_pos else ~pos
    if w is None:
        return np.sort(z[mine]), None
    order = np.argsort(z[mine], kind="stable")
    return z[mine][order], w[mine][order]


def local_pair_total(z: np.ndarray, pos: np.ndarray, w: np.ndarray | None, circulate_pos: bool):
    """The AUC numerator of one process's rows (the ring of one rank)."""
    c = PairCounter(z, pos, w, circulate_pos)
    c.visit(*circulating_rows(z, pos, w, circulate_pos))
    return c.total
