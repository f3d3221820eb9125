"""The sparse half of a raw-row chunk: what every dataset's raw-row transform gives ``predict``,
``serve`` and the C++ input writer.

A raw-row transform (:mod:`dlrmctl.data.datasets`) yields chunks ``(dense [n, D] float32, ids,
labels [n] float32 | None)``.  ``ids`` is ``[n, S]`` int64 (one id per feature, in the data's
feature order) when every feature holds one unweighted id per row, else :class:`Bags`: per feature
a bag of ids per row (a multi-valued column, after ``max_len``) and its per-id weights (a weight
column).  :func:`model_inputs` turns either into a model's inputs: ``values [N]`` int64 and
``lengths [F, n]`` int64 key-major (feature, then row) in the model's feature order, and
``weights [N]`` float32 when the model has weighted features -- the layout of a
KeyedJaggedTensor (TorchRec's ``values()`` / ``lengths()`` / ``weights()``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dlrmctl.errors import UserError

__all__ = ["Bags", "RawInputError", "model_inputs"]


class RawInputError(ValueError, UserError):
    """Raw rows whose features do not give a model's inputs (a feature missing, or a weighted
    feature without per-id weights)."""


@dataclasses.dataclass
class Bags:
    """The categorical ids of ``n`` rows, one bag per feature and row.

    Attributes:
        ids: per feature (data order) ``[m_f]`` int64 ids, row after row.
        lengths: ``[S, n]`` int64 bag lengths (``lengths[f].sum() == len(ids[f])``).
        weights: per feature ``[m_f]`` float32 per-id weights, or None (the feature has no weights).
    """

    ids: list[np.ndarray]
    lengths: np.ndarray
    weights: list[np.ndarray | None]

    @property
    def n(self) -> int:
        """Rows ``n``."""
        return int(self.lengths.shape[1])

    def rows(self, start: int, stop: int) -> "Bags":
        """Rows ``start .. stop - 1`` (views where possible)."""
        ln = self.lengths[:, start:stop]
        ids, ws = [], []
        for f, (a, w) in enumerate(zip(self.ids, self.weights)):
            lo = int(self.lengths[f, :start].sum())
            hi = lo + int(ln[f].sum())
            ids.append(a[lo:hi])
            ws.append(None if w is None else w[lo:hi])
        return Bags(ids, ln, ws)

    @classmethod
    def concat(cls, parts: Sequence["Bags"]) -> "Bags":
        """Rows of ``parts`` one after the other (the same features)."""
        S = len(parts[0].ids)
        return cls([np.concatenate([p.ids[f] for p in parts]) for f in range(S)],
                   np.concatenate([p.lengths for p in parts], axis=1),
                   [None if parts[0].weights[f] is None else np.concatenate([p.weights[f] for p in parts])
                    for f in range(S)])


def model_inputs(ids: np.ndarray | Bags, data_features: Sequence[str], feature_order: Sequence[str],
                 weighted: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A chunk's ids -> a model's sparse inputs.

    Args:
        ids: ``[n, S]`` int64 (one id per feature) or :class:`Bags`, features in ``data_features`` order.
        data_features: the ``S`` feature names of ``ids``.
        feature_order: the model's ``F`` sparse features (``manifest["sparse_features"]``).
        weighted: the model's weighted features (``manifest["weighted_features"]``): their ids carry
            the data's weights; every other feature's ids weigh 1.0 (a weight column of a feature
            the model does not weight is ignored, as the training loader does).

    Returns:
        ``values [N]`` int64 key-major, ``lengths [F, n]`` int64, ``weights [N]`` float32 (None
        when ``weighted`` is empty).

    Raises:
        RawInputError: a model feature absent from the data, or a weighted feature whose data has no
            weights (naming them).
    """
    missing = [f for f in feature_order if f not in data_features]
    if missing:
        raise RawInputError(f"the model needs sparse features {missing}, absent from the raw rows "
                            f"(they have {list(data_features)})")
    cols = [list(data_features).index(f) for f in feature_order]
    if isinstance(ids, np.ndarray):
        unweighted = [f for f in weighted if f in feature_order]
        if unweighted:
            raise RawInputError(f"the model has weighted features {unweighted}, and the raw rows carry no per-id "
                                "weights for them")
        n = ids.shape[0]
        values = np.ascontiguousarray(ids[:, cols].T, dtype=np.int64).reshape(-1)
        w = np.ones(values.size, np.float32) if weighted else None
        return values, np.ones((len(cols), n), np.int64), w
    no_w = [f for f, c in zip(feature_order, cols) if f in weighted and ids.weights[c] is None]
    if no_w:
        raise RawInputError(f"the model has weighted features {no_w}, and the raw rows carry no per-id weights "
                            "for them (the schema names no weight column)")
    values = np.concatenate([ids.ids[c] for c in cols]).astype(np.int64, copy=False) if cols else \
        np.zeros(0, np.int64)
    lengths = np.ascontiguousarray(ids.lengths[cols], dtype=np.int64)
    if not weighted:
        return values, lengths, None
    ws = [ids.weights[c] if f in weighted else np.ones(len(ids.ids[c]), np.float32)
          for f, c in zip(feature_order, cols)]
    return values, lengths, (np.concatenate(ws).astype(np.float32, copy=False) if ws else np.zeros(0, np.float32))
