"""Dense features a schema derives instead of reading a number column (``dense[]`` keys):

* ``extract: {column, pattern}``: the number matched by the regex's first group in a text column
  (e.g. a film's year at the end of its title: ``'\\((\\d{4})\\)\\s*$'``); no match, an empty
  match or a missing value is a missing value (``fill``); a match that is not a number is a bad
  row (named by its ``file:line``, or skipped and counted).  Computed per row, in every pass.
* ``count_of: COLUMN``: the number of TRAIN rows whose one-valued ``vocab`` / ``ids: raw``
  categorical ``COLUMN`` has this row's value (0 for a value without one), e.g. an item's
  popularity (NVTabular's ``JoinGroupby`` count on the train split).  Pass 1's train counts are
  written to ``vocab/count_<name>.arrow`` (``value`` sorted raw key, ``count``), carried into
  exports, and looked up in pass 2, ``predict`` and ``serve``.
* ``years_since: FEATURE``: the UTC calendar year of the row's ``time`` (Unix seconds, or an ISO
  8601 time) minus the value of the dense feature ``FEATURE`` (a year) after its ``fill`` and
  before its ``standardize`` (the schema refuses one whose ``transform`` is ``log1p``), e.g. a
  film's age when it was rated.

``fill: mean`` (any dense feature read or extracted): a missing value takes the mean of the train
split's present values (after ``log1p`` when that is the transform); with ``standardize`` it
becomes 0.  Then ``transform`` (``log1p`` clamps negatives to 0 first).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dlrmctl.data.columnar import DataError
from dlrmctl.data.criteo.vocab import merge_counts
from dlrmctl.data.logs.bad_rows import bad_rows
from dlrmctl.data.logs.join import find_sorted, write_table
from dlrmctl.data.logs.read import RowBatch
from dlrmctl.data.logs.schema import DenseSpec, LogSchema

__all__ = ["NUMBER", "CountTable", "count_paths", "extracted", "finish_dense", "write_count_tables"]


#: a number as text (spaces and tabs around it are trimmed first): what a dense field and an
#: ``extract`` group must hold
NUMBER = r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$"


def extracted(batch: RowBatch, spec: DenseSpec, drop: np.ndarray, on_bad_line: str) -> tuple[np.ndarray, np.ndarray]:
    """``([n] float64 numbers, [n] bool missing)`` of an ``extract`` feature of one block.

    Args:
        batch: the block; ``spec``: the feature.
        drop: ``[n]`` bool, rows already bad; rows whose match is not a number are added
            (``on_bad_line='skip'``, :func:`dlrmctl.data.logs.bad_rows.bad_rows`).

    Raises:
        DataError: the column is not text (names the first row and the column); a match that is
            not a number (:data:`NUMBER`) with ``on_bad_line='error'`` (names its ``file:line``,
            the column and the matched text).
    """
    column, pattern = spec.extract
    col = batch.columns[column]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_null(col.type):
        return np.zeros(len(col)), np.ones(len(col), bool)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise batch.error(0, column, f"expected text to extract '{spec.name}' from, got Arrow type {col.type}")
    named = _named_first_group(pattern)  # pyarrow's extract_regex (RE2) returns named groups only
    got = None
    if named is not None:
        try:
            got = pc.extract_regex(col, named).flatten()[0]  # (flatten: a row without a match is null)
        except pa.ArrowInvalid:  # a pattern RE2 does not take: Python's re
            got = None
    if got is None:
        import re

        rx = re.compile(pattern)
        texts = col.to_pylist()
        nums = [(m.group(1) if m else None) for m in (rx.search(t) if t is not None else None for t in texts)]
        got = pa.array(nums, pa.string())
    if not len(got):
        return np.zeros(0), np.zeros(0, bool)
    text = pc.utf8_trim(got, " \t")
    empty = pc.fill_null(pc.equal(text, ""), False).to_numpy(zero_copy_only=False)  # (an empty group: missing)
    ok = pc.fill_null(pc.match_substring_regex(text, NUMBER), True).to_numpy(zero_copy_only=False) | empty
    drop |= bad_rows(batch, ~ok & ~drop, column, f"a number matched by the first group of extract.pattern of "
                     f"'{spec.name}'", got, on_bad_line)
    x = pc.cast(pc.if_else(pa.array(ok & ~empty), text, pa.scalar(None, pa.string())), pa.float64())
    missing = x.is_null().to_numpy(zero_copy_only=False)
    v = pc.fill_null(x, 0.0).to_numpy(zero_copy_only=False).astype(np.float64)
    return np.where(np.isfinite(v), v, 0.0), missing  # (a number of over 308 digits: inf; kept finite)


def _named_first_group(pattern: str) -> str | None:
    """``pattern`` with its first capturing group named ``v`` (None when it has none outside
    escapes and character classes, or a named one already)."""
    i, cls = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if cls:
            cls = ch != "]"
        elif ch == "[":
            cls = True
            if pattern[i + 1: i + 2] == "]":
                i += 1
        elif ch == "(" and pattern[i + 1: i + 2] != "?":
            return pattern[: i + 1] + "?P<v>" + pattern[i + 1:]
        i += 1
    return None


def count_paths(schema: LogSchema) -> dict[str, str]:
    """``{dense name: "vocab/count_<name>.arrow"}`` of the schema's ``count_of`` features."""
    return {d.name: f"vocab/count_{d.name}.arrow" for d in schema.dense if d.count_of}


def write_count_tables(schema: LogSchema, counted: list[int], count_files: list[str],
                       out_dir: str | os.PathLike) -> dict[str, str]:
    """Merge pass 1's train counts of each ``count_of`` column into ``vocab/count_<name>.arrow``.

    Args:
        schema: the schema; ``counted``: the categorical indices pass 1 counted, in the count
            files' batch order; ``count_files``: one per input file.
        out_dir: the data directory.

    Returns:
        :func:`count_paths` (relative to ``out_dir``).
    """
    paths = count_paths(schema)
    names = [c.name for c in schema.categorical]
    for d in schema.dense:
        if not d.count_of:
            continue
        j = counted.index(names.index(d.count_of))
        t = merge_counts([pa.Table.from_batches([ipc.open_file(pa.memory_map(f)).get_batch(j)]) for f in count_files])
        t = t.sort_by("value")
        write_table(Path(out_dir) / paths[d.name], t)
    return paths


class CountTable:
    """A ``vocab/count_<name>.arrow`` file: sorted keys -> train counts.

    Raises:
        DataError: not such a file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            t = ipc.open_file(pa.memory_map(os.fspath(path))).read_all()
            self.keys = t.column("value").to_numpy()
            self.counts = t.column("count").to_numpy()
        except (OSError, pa.ArrowInvalid, KeyError) as e:
            raise DataError(f"cannot read the train counts of a count_of feature (preprocess the data again): {e}",
                            path=path) from None

    def lookup(self, keys: np.ndarray, present: np.ndarray) -> np.ndarray:
        """``[n]`` float64 train counts of ``keys`` (``[n]`` int64); 0 where absent or not ``present``."""
        if not len(self.keys):
            return np.zeros(len(keys))
        pos, hit = find_sorted(self.keys, keys)
        return np.where(hit & present, self.counts[pos], 0).astype(np.float64)


def finish_dense(d, schema: LogSchema, stats: dict, counts: dict[str, CountTable]) -> None:
    """Set the ``count_of`` and ``years_since`` features of a decoded block (in place, before
    :func:`dlrmctl.data.logs.transform.dense_values`).

    Args:
        d: a :class:`dlrmctl.data.logs.transform.Decoded` block (``dense[i]``: ``[n]`` float64).
        schema: its schema; ``stats``: ``{name: (mean, std)}`` of the train split;
        counts: ``{dense name: CountTable}`` of the ``count_of`` features.
    """
    cats = {c.name: k for k, c in enumerate(schema.categorical)}
    idx = {x.name: k for k, x in enumerate(schema.dense)}
    for i, spec in enumerate(schema.dense):
        if spec.count_of:
            v = d.categorical[cats[spec.count_of]]
            x = counts[spec.name].lookup(v.keys, v.present)
        elif spec.years_since:
            year = d.dense[idx[spec.years_since]]
            if np.isnan(year).any():  # fill: mean
                year = np.where(np.isnan(year), stats[spec.years_since][0], year)
            x = (d.time.astype("datetime64[s]").astype("datetime64[Y]").astype(np.int64) + 1970) - year
        else:
            continue
        d.dense[i] = np.log1p(np.maximum(x, 0.0)) if spec.transform == "log1p" else x
