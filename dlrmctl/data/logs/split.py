"""Time splits of a log: one global cut (:func:`time_cutoffs`), or per group (``split: {by: time,
group: G, tiebreak: T}`` in the schema).

Each group's rows (e.g. a user's ratings) are ordered by ``(time, tiebreak)``; of a group's ``n``
rows the last ``floor(n * test_ratio)`` are test, the ``floor(n * val_ratio)`` before them val,
the rest train: the "leave-last-out" protocol (He et al., "Neural Collaborative Filtering", WWW
2017) generalised to ratios, as ``preprocess movielens`` splits each user's ratings.  So no val or
test row of a group is older than any of that group's train rows; a group of fewer than
``1 / test_ratio`` rows has no test row (likewise val).

Pass 0 collects every good row's ``(group key, time, tiebreak)`` (24 bytes a row, held by the
driver while it sorts them: the one part of ``preprocess logs`` whose memory grows with the rows);
what the later passes use is, per group, the ``(time, tiebreak)`` where its val and its test rows
start (:class:`GroupCutoffs`, 40 bytes a group); a row's split is found by comparing its own
``(time, tiebreak)`` with its group's.  Hence rows of one group with equal ``(time, tiebreak)`` are
never cut between two splits: at a cut they all go to the later split.

* group key: the raw id of the value (:func:`dlrmctl.data.ids.raw_ids`); a missing value is a bad row.
* tiebreak: an integer column (or text of integers) is compared as integers, any other text by the
  raw id of the value (a stable, arbitrary order); a missing value is a bad row.  Without
  ``tiebreak`` only the time orders a group's rows.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmctl.data.columnar import DataError
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs.bad_rows import bad_rows
from dlrmctl.data.logs.read import RowBatch
from dlrmctl.data.logs.schema import SplitSpec

__all__ = ["GroupCutoffs", "concat_keys", "group_cutoffs", "split_keys", "split_mode", "time_cutoffs"]

_LAST = np.iinfo(np.int64).max  # the cutoff of a split a group has no rows in


def split_mode(split_by: str | None, schema) -> str:
    """The split of a run: ``split_by`` (``--split-by``), else the schema's ``split.by``, else ``"row"``.

    Raises:
        ValueError: ``split_by`` is neither ``row``, ``time`` nor None, or ``row`` for a schema whose
            ``split.group`` splits by time.
    """
    if split_by not in ("row", "time", None):
        raise ValueError(f"--split-by must be 'row' or 'time', got {split_by!r}")
    if split_by == "row" and schema.split is not None and schema.split.group:
        raise ValueError(f"--split-by row: the schema {schema.source} splits each '{schema.split.group}' by time "
                         "(split.group); drop --split-by or the schema's `split`")
    return split_by or (schema.split.by if schema.split is not None else "row")


def split_keys(batch: RowBatch, spec: SplitSpec, drop: np.ndarray, on_bad_line: str) -> tuple[np.ndarray, np.ndarray]:
    """The group keys and tiebreak values of a block's rows.

    Args:
        batch: the block (its ``spec.group`` and ``spec.tiebreak`` columns).
        spec: the schema's ``split``.
        drop: ``[n]`` bool, rows already bad; rows with a missing group or tiebreak are added
            (``on_bad_line='skip'``).

    Returns:
        ``(group [n] int64, tiebreak [n] int64)`` (tiebreak 0 without ``spec.tiebreak``).

    Raises:
        DataError: a missing value (``on_bad_line='error'``), naming ``file:line`` and the column.
    """
    col = batch.columns[spec.group]
    try:
        group = raw_ids(col)
    except TypeError as e:
        raise batch.error(0, spec.group, f"expected strings or integers (the split's group): {e}") from None
    drop |= bad_rows(batch, (group == 0) & ~drop, spec.group, "a value (the split's group)", None, on_bad_line)
    if spec.tiebreak is None:
        return group, np.zeros(len(group), np.int64)
    t = batch.columns[spec.tiebreak]
    if isinstance(t, pa.ChunkedArray):
        t = t.combine_chunks()
    missing = t.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_string(t.type) or pa.types.is_large_string(t.type):
        missing |= pc.fill_null(pc.equal(t, ""), False).to_numpy(zero_copy_only=False)
        try:
            t = pc.cast(pc.if_else(pa.array(missing), pa.scalar("0"), t), pa.int64())
        except pa.ArrowInvalid:  # not integers: order by the raw id of the text
            t = pa.array(raw_ids(t))
    elif not pa.types.is_integer(t.type):
        raise batch.error(0, spec.tiebreak, f"expected integers or text (the split's tiebreak), got Arrow type {t.type}")
    drop |= bad_rows(batch, missing & ~drop, spec.tiebreak, "a value (the split's tiebreak)", None, on_bad_line)
    order = pc.fill_null(pc.cast(t, pa.int64()), 0).to_numpy(zero_copy_only=False)
    return group, np.where(missing, 0, order).astype(np.int64)


@dataclasses.dataclass
class GroupCutoffs:
    """Where each group's val and test rows start.

    Attributes:
        train_rows: rows in train (0: the ratios leave none; the caller words the error).
        groups: ``[G]`` int64 sorted group keys.
        val: ``[G, 2]`` int64 ``(time, tiebreak)`` of the group's first val row (its first test
            row when it has no val row; ``int64 max`` when neither).
        test: ``[G, 2]`` int64 ``(time, tiebreak)`` of the group's first test row (``int64 max``: none).
    """

    train_rows: int
    groups: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def codes(self, group: np.ndarray, time: np.ndarray, order: np.ndarray) -> np.ndarray:
        """``[n]`` int8 split codes (0 train, 1 val, 2 test) of rows ``(group, time, order)`` (``[n]``
        int64 each); a group pass 0 did not see (not possible for the same input) is train."""
        pos = np.minimum(np.searchsorted(self.groups, group), max(len(self.groups) - 1, 0))
        known = self.groups[pos] == group if len(self.groups) else np.zeros(len(group), bool)

        def at_or_after(c: np.ndarray) -> np.ndarray:
            ct, co = c[pos, 0], c[pos, 1]
            return known & ((time > ct) | ((time == ct) & (order >= co)))

        return np.where(at_or_after(self.test), 2, np.where(at_or_after(self.val), 1, 0)).astype(np.int8)

    def digest(self) -> str:
        """A short hash of the cutoffs (part of each pass's fingerprint)."""
        h = hashlib.sha256()
        for a in (self.groups, self.val, self.test):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def describe(self, time: str, spec: SplitSpec, val_ratio: float, test_ratio: float) -> dict:
        """What ``meta.json`` records as ``transforms.split``: the rule, the ratios, the number of groups
        and of groups with val / test rows."""
        return {"mode": "time_per_group", "column": time, "group": spec.group, "tiebreak": spec.tiebreak,
                "val_ratio": val_ratio, "test_ratio": test_ratio, "groups": int(len(self.groups)),
                "groups_with_val": int((self.val != self.test).any(axis=1).sum()),
                "groups_with_test": int((self.test[:, 0] != _LAST).sum()),
                "rule": f"each {spec.group}'s rows ordered by ({time}, {spec.tiebreak or 'nothing'}): the last "
                        "floor(n*test_ratio) -> test, the floor(n*val_ratio) before -> val, the rest -> train; rows "
                        "of equal order are never cut",
                "source": "leave-last-out protocol (He et al. 2017, Neural Collaborative Filtering), as ratios"}


def concat_keys(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """``(group, time, tiebreak)`` of several blocks or files, concatenated (``[n]`` int64 each)."""
    return tuple(np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64) for k in range(3))


def group_cutoffs(group: np.ndarray, time: np.ndarray, order: np.ndarray, val_ratio: float,
                  test_ratio: float) -> GroupCutoffs:
    """The per-group cutoffs of rows ``(group, time, order)`` (``[n]`` int64 each, any row order):
    the module docstring's rule, the one implementation of ``preprocess logs`` (``split.group``)
    and ``preprocess movielens`` (:func:`dlrmctl.data.movielens.time_ordered_split`)."""
    n = len(group)
    idx = np.lexsort((order, time, group))
    g, t, o = group[idx], time[idx], order[idx]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if n else np.zeros(0, np.int64)
    counts = np.diff(np.r_[starts, n])
    n_test = np.floor(counts * test_ratio + 1e-9).astype(np.int64)  # as dlrmctl.data.movielens.time_ordered_split
    n_val = np.floor(counts * val_ratio + 1e-9).astype(np.int64)

    def cut(first: np.ndarray, has: np.ndarray) -> np.ndarray:
        c = np.full((len(starts), 2), _LAST, np.int64)
        f = first[has]
        c[has, 0], c[has, 1] = t[f], o[f]
        return c

    test = cut(starts + counts - n_test, n_test > 0)
    val = cut(starts + counts - n_test - n_val, n_val > 0)
    val[n_val == 0] = test[n_val == 0]
    return GroupCutoffs(int((counts - n_test - n_val).sum()), g[starts], val, test)


def time_cutoffs(counts: pa.Table, o, source: str) -> tuple[float, float]:
    """The global time split (no ``split.group``): ``(first val time, first test time)``; the latest
    time values holding ``test_ratio`` of the rows are test, the ones before them holding
    ``val_ratio`` val (``inf`` for an empty split).

    Args:
        counts: ``value`` (a time), ``count`` (its rows) int64 columns.
        o: the :class:`~dlrmctl.data.logs.preprocess.LogOptions` (``val_ratio``, ``test_ratio``).

    Raises:
        DataError: no time value is left for train.
    """
    t = counts.sort_by([("value", "descending")])
    values, cnt = t.column("value").to_numpy(), t.column("count").to_numpy()
    total = int(cnt.sum())
    cum = np.cumsum(cnt)
    inf = float("inf")
    n_test = int(np.searchsorted(cum, o.test_ratio * total - 1e-6, side="left")) + 1 if o.test_ratio else 0
    n_vt = int(np.searchsorted(cum, (o.val_ratio + o.test_ratio) * total - 1e-6,
                                   side="left")) + 1 if o.val_ratio else n_test
    t_test = float(values[n_test - 1]) if n_test else inf
    t_val = float(values[n_vt - 1]) if n_vt > n_test else t_test
    if n_vt >= len(values):
        raise DataError(f"--split-by time: the {len(values)} distinct time values leave no rows to train on "
                        f"with --val-ratio {o.val_ratio} --test-ratio {o.test_ratio}; use a finer time column or "
                        "smaller ratios", path=source)
    return t_val, t_test
