"""The schema's transforms of one block of rows, vectorised (no Python loop per value).

* label: the column read as a number and required to be 0 or 1, or the rule ``op value`` applied
  (``rating >= 4``); a missing or unparseable label is a bad row.
* dense: a number (text is parsed, spaces and tabs around it ignored; NaN / inf are refused, an empty
  field or string is missing); a missing value takes ``fill``; ``log1p``: ``log(max(x, 0) + 1)``
  (DLRM reference ``data_utils.py``);
  ``standardize``: ``(x - mean) / std`` with the train split's mean and standard deviation
  (``std`` 0 -> 1); ``none``: ``x``.  float32.
* categorical: each value becomes a 63-bit key: its raw id (:func:`dlrmctl.data.ids.raw_ids` of its
  text), or in ``vocab`` and ``hash`` modes with ``parse: hex`` its 8 hex digits as an integer
  (Criteo's keys; ``parse: hex`` also refuses a value that is not 8 hex digits).  Then per mode:
  ``vocab``: the key's rank in the train vocabulary (:class:`VocabLookup`), ``V`` for an unseen or
  rare value, ``V + 1`` for a missing one (table ``V + 2`` rows, as Criteo's);
  ``hash``: ``raw_id mod buckets`` (missing -> 0, the raw id of a missing value); with ``parse:
  hex`` ``h mod (buckets - 1)``, missing -> ``buckets - 1`` (``preprocess criteo --num-embeddings
  buckets-1``, DLRM reference ``data_utils.py``: ``int(x, 16) % N``);
  ``raw``: the raw id itself (``ids: raw``).
* multi-valued: an Arrow list or text split at ``delimiter``; empty elements dropped; the first
  ``max_len`` kept; a missing value is an empty bag.  The optional weight column gives one float
  per value (the same number of elements, else a bad row).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmctl.data.columnar import DataError
from dlrmctl.data.criteo.parse import non_finite_hint
from dlrmctl.data.ids import hash_buckets, raw_ids
from dlrmctl.data.logs.bad_rows import bad_rows
from dlrmctl.data.logs.derived import NUMBER, extracted
from dlrmctl.data.logs.join import join_columns
from dlrmctl.data.logs.read import RowBatch
from dlrmctl.data.logs.schema import CategoricalSpec, LogSchema
from dlrmctl.data.logs.vocab_lookup import VocabLookup
from dlrmctl.data.logs.split import split_keys

__all__ = ["CategoricalValues", "Decoded", "VocabLookup", "decode", "dense_values", "ids_of"]

@dataclasses.dataclass
class CategoricalValues:
    """One categorical column of ``n`` rows: ``m`` values (``m == n`` for a one-hot column).

    Attributes:
        keys: ``[m]`` int64 keys (raw ids, or hex integers with ``parse: hex``).
        present: ``[m]`` bool (one-hot: False where missing; multi: all True).
        lengths: ``[n]`` int64 bag lengths, or None (one-hot).
        weights: ``[m]`` float32 per-value weights, or None.
    """

    keys: np.ndarray
    present: np.ndarray
    lengths: np.ndarray | None
    weights: np.ndarray | None

    def select(self, rows: np.ndarray) -> "CategoricalValues":
        """The values of the rows ``rows`` (``[n]`` bool)."""
        if self.lengths is None:
            return CategoricalValues(self.keys[rows], self.present[rows], None,
                                     None if self.weights is None else self.weights[rows])
        elem = np.repeat(rows, self.lengths)
        return CategoricalValues(self.keys[elem], self.present[elem], self.lengths[rows],
                                 None if self.weights is None else self.weights[elem])


@dataclasses.dataclass
class Decoded:
    """A block of good rows, parsed (bad rows dropped or raised).

    Attributes:
        keys: ``[n]`` int64 row keys (line / file row, for the split hash).
        label: ``[n]`` float32 0/1, or None (no label in the schema).
        dense: per dense column ``[n]`` float64 after ``fill`` and ``log1p`` (``standardize`` is
            applied by :func:`dense_values` with the train statistics).
        time: ``[n]`` int64, or None.
        categorical: per categorical column, :class:`CategoricalValues`.
        bad: rows dropped from this block (``on_bad_line='skip'``), the parser's included.
        group, order: ``[n]`` int64 group keys and tiebreak values of a per-group time split
            (:mod:`dlrmctl.data.logs.split`), or None.
    """

    keys: np.ndarray
    label: np.ndarray | None
    dense: list[np.ndarray]
    time: np.ndarray | None
    categorical: list[CategoricalValues]
    bad: int
    group: np.ndarray | None = None
    order: np.ndarray | None = None


def _numbers(batch: RowBatch, name: str, drop: np.ndarray, on_bad_line: str, what: str = "a number",
             missing_ok: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A column as ``([n] float64, [n] bool missing)``; unparseable / non-finite values are bad
    (``missing_ok``: whether the caller takes an empty field as a missing value, for the advice)."""
    col = batch.columns[name]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    missing = col.is_null().to_numpy(zero_copy_only=False)
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:  # the common case: every value parses (NaN / inf are refused below)
            x = pc.cast(col, pa.float64())
        except pa.ArrowInvalid:  # an empty string (e.g. in Parquet, or a split text bag) is a missing value
            empty = pc.fill_null(pc.equal(col, ""), False).to_numpy(zero_copy_only=False)
            missing = missing | empty
            text = pc.utf8_trim(col, " \t")  # spaces and tabs around a number, as the CSV reader's numbers
            ok = pc.fill_null(pc.match_substring_regex(text, NUMBER), True).to_numpy(zero_copy_only=False) | empty
            drop |= bad_rows(batch, ~ok & ~drop, name, what, col, on_bad_line)
            x = pc.cast(pc.if_else(pa.array(ok & ~empty), text, pa.scalar("0")), pa.float64())
    elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        x = pc.cast(col, pa.float64())
    else:
        raise batch.error(0, name, f"expected {what}, got a column of Arrow type {t}")
    v = x.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)  # (a null: NaN, missing)
    finite = np.isfinite(v)
    drop |= bad_rows(batch, ~finite & ~missing & ~drop, name, what + non_finite_hint(missing_ok), col, on_bad_line)
    return np.where(finite, v, 0.0), missing


def _filled_numbers(batch: RowBatch, name: str, fill: float) -> np.ndarray | None:
    """A numeric column as ``[n]`` float64 with ``fill`` for a missing value when every present
    value is a finite number (a number column, or text that Arrow casts whole), else None (the
    caller then takes :func:`_numbers`'s way, which names or drops the bad rows): the common case
    in two passes over the block instead of one per check."""
    col = batch.columns[name]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t)):
        return None
    try:
        x = pc.cast(col, pa.float64())
    except pa.ArrowInvalid:
        return None
    if x.null_count:
        x = pc.fill_null(x, pa.scalar(float(fill), pa.float64()))
    v = x.to_numpy(zero_copy_only=False)
    if not np.isfinite(v).all():
        return None
    return v


def _label(batch: RowBatch, schema: LogSchema, drop: np.ndarray, on_bad_line: str) -> np.ndarray:
    spec = schema.label
    x, missing = _numbers(batch, spec.column, drop, on_bad_line, "a number" if spec.op else "0 or 1", missing_ok=False)
    col = batch.columns[spec.column]
    if spec.op is None:
        bad = ((x != 0) & (x != 1)) | missing
        drop |= bad_rows(batch, bad & ~drop, spec.column, "0 or 1 (the label)", col, on_bad_line)
        return x.astype(np.float32)
    drop |= bad_rows(batch, missing & ~drop, spec.column, f"a number (the label is {spec.describe()})", col, on_bad_line)
    ops = {">=": np.greater_equal, ">": np.greater, "<=": np.less_equal, "<": np.less, "==": np.equal,
           "!=": np.not_equal}
    return ops[spec.op](x, spec.value).astype(np.float32)


def _time(batch: RowBatch, name: str, drop: np.ndarray, on_bad_line: str) -> np.ndarray:
    """The time column as ``[n]`` int64 seconds since the epoch (UTC).

    Text values are integers (taken as they are) or ISO 8601 times: a date, a date and time with
    ``T`` or a space, fractional seconds, and ``Z`` or a UTC offset (``+02:00``, ``+0200``), which
    is applied; a time without one is read as UTC.  One column holds one of the two kinds, the
    kind of its first value: a value of the other kind, or of neither, is a bad row named by its
    line."""
    col = batch.columns[name]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        col = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64())
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        col = _text_times(batch, name, col, drop, on_bad_line)
    elif not pa.types.is_integer(t):
        raise batch.error(0, name, f"expected integers or timestamps (the time column), got Arrow type {t}")
    missing = col.is_null().to_numpy(zero_copy_only=False)
    drop |= bad_rows(batch, missing & ~drop, name, "a time (the time column)", batch.columns[name], on_bad_line)
    return pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(zero_copy_only=False)


# an ISO 8601 time's zone designator, after a time of day (a date's "-02" is its day, not a zone)
_ZONE = r"[T ]\d\d(:?\d\d(:?\d\d([.,]\d+)?)?)?(Z|[+-]\d\d(:?\d\d)?)$"


def _iso_seconds(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``([m] int64 seconds (UTC), [m] bool parsed)`` of ISO 8601 strings without nulls."""
    m = len(values)
    secs, ok = np.zeros(m, np.int64), np.zeros(m, bool)
    zone = pc.fill_null(pc.match_substring_regex(values, _ZONE), False).to_numpy(zero_copy_only=False)
    for part, tz in ((zone, "UTC"), (~zone, None)):
        idx = np.flatnonzero(part)
        if not idx.size:
            continue
        sub = values.take(pa.array(idx))
        got = None
        for unit in ("s", "ns"):  # whole seconds, else fractions (years 1677-2262)
            try:
                got = pc.cast(pc.cast(sub, pa.timestamp(unit, tz=tz)), pa.int64()).to_numpy(zero_copy_only=False)
                secs[idx], ok[idx] = (got if unit == "s" else got // 10**9), True
                break
            except pa.ArrowInvalid:
                continue
        if got is None:  # some value of this part does not parse: find which, one by one
            for j, v in zip(idx.tolist(), sub.to_pylist()):
                for unit in ("s", "ns"):
                    try:
                        x = pc.cast(pc.cast(pa.array([v]), pa.timestamp(unit, tz=tz)), pa.int64())[0].as_py()
                        secs[j], ok[j] = (x if unit == "s" else x // 10**9), True
                        break
                    except pa.ArrowInvalid:
                        continue
    return secs, ok


def _text_times(batch: RowBatch, name: str, col: pa.Array, drop: np.ndarray, on_bad_line: str) -> pa.Array:
    """Text times -> int64 seconds (nulls kept); values not of the column's kind are bad rows."""
    s = pc.utf8_trim_whitespace(col)
    present = ~col.is_null().to_numpy(zero_copy_only=False)
    isint = pc.fill_null(pc.match_substring_regex(s, r"^-?\d{1,18}$"), False).to_numpy(zero_copy_only=False)
    if not present.any():
        return pa.nulls(len(col), pa.int64())
    first = int(np.flatnonzero(present)[0])
    like = f"like line {int(batch.keys[first])}'s" if batch.row_group is None else "like the first row's"
    secs = np.zeros(len(col), np.int64)
    if isint[first]:
        ok = isint
        secs[isint] = pc.cast(s.filter(pa.array(isint)), pa.int64()).to_numpy(zero_copy_only=False)
    else:
        idx = np.flatnonzero(present & ~isint)
        got, parsed = _iso_seconds(s.take(pa.array(idx)))
        ok = np.zeros(len(col), bool)
        ok[idx], secs[idx] = parsed, got
    bad = present & ~ok & ~drop
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        if isint[first] != isint[i] and (isint[i] or _iso_seconds(s.take(pa.array([i])))[1][0]):
            what = (f"an integer time {like} (the time column holds one kind of time)" if isint[first] else
                    f"an ISO 8601 time {like} (the time column holds one kind of time)")
        else:
            what = "an integer or an ISO 8601 time (the time column)"
        drop |= bad_rows(batch, bad, name, what, col, on_bad_line)
    return pa.array(secs, pa.int64(), mask=~present)


def _keys(batch: RowBatch, spec: CategoricalSpec, values: pa.Array, drop: np.ndarray, on_bad_line: str,
          column: str, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keys ``[m]`` int64 and present ``[m]`` bool of a flat array of values (``null_values`` are
    missing; ``rows``: the row of each value of a multi-valued column, None: value ``i`` is row ``i``)."""
    keys, present = _keys_of(batch, spec, values, drop, on_bad_line, column, rows)
    if spec.null_values:
        present = present & ~np.isin(raw_ids(values) if spec.parse == "hex" else keys, raw_ids(list(spec.null_values)))
    return keys, present


def _keys_of(batch: RowBatch, spec: CategoricalSpec, values: pa.Array, drop: np.ndarray, on_bad_line: str,
             column: str, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_keys` before ``null_values``.  Whole numbers (JSON, Parquet doubles) are the
    integer's key (``12.0`` as ``12``), others bad rows; values of another type (booleans,
    objects) are refused naming the first one's row."""
    if spec.parse == "hex":
        from dlrmctl.data.criteo.parse import hex_to_uint32

        if not (pa.types.is_string(values.type) or pa.types.is_binary(values.type) or pa.types.is_null(values.type)):
            raise batch.error(0, column, f"parse: hex needs text values, got Arrow type {values.type}")
        if pa.types.is_null(values.type):
            values = pc.fill_null(pc.cast(values, pa.binary()), b"")
        elif pa.types.is_string(values.type):
            values = values.view(pa.binary())  # the same buffers: the bytes are checked as hex digits
        h, present, bad = hex_to_uint32(values)
        if values.null_count:  # a null's bytes are not read as a value (its key is never used)
            valid = values.is_valid().to_numpy(zero_copy_only=False)
            present &= valid
            if bad is not None:
                bad &= valid
        if bad is not None:
            if spec.multi and bad.any():
                raise DataError(f"field {column}: expected 8 hex digits in every element of a multi-valued column",
                                path=batch.path)
            if not spec.multi:
                drop |= bad_rows(batch, bad & ~drop, column, "8 hex digits", values, on_bad_line)
        if spec.mode == "raw":  # raw ids: the raw id of the text itself
            return raw_ids(values), present
        return h.view(np.int64), present  # vocab and hash: the integer (Criteo's keys; < 2^32: the same bits)
    t = values.type
    if pa.types.is_floating(t):
        x = pc.fill_null(values, 0.0).to_numpy(zero_copy_only=False)
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(x) & (np.floor(x) == x) & (np.abs(x) < 2.0**63)
        badv = valid & ~whole
        if badv.any():
            mask = np.zeros(batch.num_rows, bool)
            mask[badv.nonzero()[0] if rows is None else rows[badv]] = True
            drop |= bad_rows(batch, mask & ~drop, column, "a string or an integer (an id), not a number with a fraction",
                         batch.columns[column], on_bad_line)
        values = pa.array(np.where(whole, x, 0).astype(np.int64), pa.int64(), mask=~(valid & whole))
    try:
        k = raw_ids(values)
    except TypeError as e:
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        first = int(np.flatnonzero(valid)[0]) if valid.any() else 0
        raise batch.error(first if rows is None else int(rows[first]), column,
                          f"expected strings or integers: {e}") from None
    return k, k != 0


def _categorical(batch: RowBatch, spec: CategoricalSpec, drop: np.ndarray, on_bad_line: str) -> CategoricalValues:
    col = batch.columns[spec.name]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if not spec.multi:
        keys, present = _keys(batch, spec, col, drop, on_bad_line, spec.name)
        w = None
        if spec.weights:
            w, wmiss = _numbers(batch, spec.weights, drop, on_bad_line, "a weight", missing_ok=False)
            drop |= bad_rows(batch, wmiss & present & ~drop, spec.weights, f"a weight (the value of {spec.name} is "
                         "present)", batch.columns[spec.weights], on_bad_line)
            w = w.astype(np.float32)
        return CategoricalValues(keys, present, None, w)
    lists = _as_list(batch, col, spec.delimiter, spec.name)
    n = len(lists)
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(lists)
    keys, present = _keys(batch, spec, flat, drop, on_bad_line, spec.name, np.repeat(np.arange(n), lengths))
    weights = None
    if spec.weights:
        wl = _as_list(batch, batch.columns[spec.weights], spec.delimiter, spec.weights)
        wlen = pc.fill_null(pc.list_value_length(wl), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        wflat = pc.list_flatten(wl)
        match = wlen == lengths
        drop |= bad_rows(batch, ~match & ~drop, spec.weights, f"one weight per value of {spec.name}",
                     batch.columns[spec.weights], on_bad_line)
        wflat = wflat.filter(pa.array(np.repeat(match, wlen)))
        wtab = RowBatch({spec.weights: wflat}, np.repeat(batch.keys[match], lengths[match]), batch.path,
                        batch.row_group, batch.group_start)
        ebad = np.zeros(len(wflat), bool)  # per weight: does not parse, NaN / inf (set by _numbers when skipping)
        wv, wmiss = _numbers(wtab, spec.weights, ebad, on_bad_line, "a weight", missing_ok=False)
        # an empty element's weight may be empty too (an empty bag written as "" with weights "")
        ebad |= bad_rows(wtab, wmiss & present[np.repeat(match, lengths)], spec.weights, "a weight", wflat, on_bad_line)
        if ebad.any():  # --on-bad-line skip: a row with a bad weight is dropped whole
            rows = np.zeros(n, bool)
            rows[np.repeat(np.flatnonzero(match), lengths[match])[ebad]] = True
            drop |= rows
        weights = np.zeros(len(keys), np.float32)
        weights[np.repeat(match, lengths)] = wv
    row_of = np.repeat(np.arange(n), lengths)
    keep = present.copy()
    if spec.max_len is not None:
        c = np.cumsum(keep)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        before = np.concatenate([[0], c])[starts]
        rank = c - before[row_of]  # 1-based rank of a kept element within its row
        keep &= rank <= spec.max_len
    new_len = np.bincount(row_of[keep], minlength=n).astype(np.int64)
    return CategoricalValues(keys[keep], np.ones(int(keep.sum()), bool), new_len,
                             None if weights is None else weights[keep])


def _as_list(batch: RowBatch, col, delimiter: str | None, name: str) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return col
    if pa.types.is_null(t):  # every value missing (e.g. JSON rows whose bags are all null): empty bags
        return pa.nulls(len(col), pa.list_(pa.string()))
    if delimiter is not None and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
        return pc.split_pattern(pc.cast(col, pa.string()), delimiter)
    raise batch.error(0, name, f"a multi-valued column must be an Arrow list or text split at `multi.delimiter`, "
                      f"got Arrow type {t}" + ("" if delimiter else " and no delimiter"))


def decode(batch: RowBatch, schema: LogSchema, on_bad_line: str, scoring: bool = False) -> Decoded:
    """Parse a block: label, dense (before ``standardize``), time, categorical keys.  ``scoring``:
    raw rows scored by a model (:func:`dlrmctl.data.logs.join.join_columns`' messages).

    Raises:
        DataError: a bad value (``on_bad_line='error'``), naming ``file:line`` (or Parquet row group
            and row) and the column.
    """
    n = batch.num_rows
    drop = np.zeros(n, dtype=bool)
    if schema.join:  # the side tables' columns
        batch = join_columns(batch, schema, drop, on_bad_line, scoring)
    group = order = None
    if schema.split is not None and schema.split.group:  # a per-group split's keys
        group, order = split_keys(batch, schema.split, drop, on_bad_line)
    label = _label(batch, schema, drop, on_bad_line) if schema.label else None
    time = _time(batch, schema.time, drop, on_bad_line) if schema.time else None
    dense = []
    for d in schema.dense:
        x = None if d.derived or d.fill == "mean" else _filled_numbers(batch, d.name, d.fill)
        if x is None:  # derived, or a value that does not parse, NaN or inf: found and named (or its row dropped)
            if d.derived:  # (count_of, years_since: set by derived.finish_dense in pass 2)
                x, missing = extracted(batch, d, drop, on_bad_line) if d.extract else (np.zeros(n), np.zeros(n, bool))
            else:
                x, missing = _numbers(batch, d.name, drop, on_bad_line)
            x = np.where(missing, np.nan if d.fill == "mean" else d.fill, x)
        if d.transform == "log1p":
            x = np.maximum(x, 0.0)
            np.log1p(x, out=x)
        dense.append(x)
    cats = [_categorical(batch, c, drop, on_bad_line) for c in schema.categorical]
    nbad = int(drop.sum())
    if nbad:
        keep = ~drop
        return Decoded(batch.keys[keep], None if label is None else label[keep], [x[keep] for x in dense],
                       None if time is None else time[keep], [c.select(keep) for c in cats], nbad + batch.bad_skipped,
                       None if group is None else group[keep], None if order is None else order[keep])
    return Decoded(batch.keys, label, dense, time, cats, batch.bad_skipped, group, order)


def dense_values(decoded: Decoded, schema: LogSchema, stats: dict[str, tuple[float, float]]) -> list[np.ndarray]:
    """The dense columns as float32 ``[n]``, ``fill: mean`` and ``standardize`` applied with
    ``stats[name] = (mean, std)`` of the train split."""
    out = []
    for d, x in zip(schema.dense, decoded.dense):
        if d.fill == "mean":  # (dlrmctl.data.logs.derived)
            x = np.where(np.isnan(x), stats[d.name][0], x)
        if d.transform == "standardize":
            mean, std = stats[d.name]
            x = (x - mean) / (std if std > 0 else 1.0)
        out.append(x.astype(np.float32))
    return out


# ----------------------------------------------------------------------------- ids
def ids_of(spec: CategoricalSpec, v: CategoricalValues, vocab: VocabLookup | None) -> np.ndarray:
    """``[m]`` int64 ids of a column's values by its mode (see the module docstring)."""
    if spec.mode == "vocab":
        ids = vocab.lookup(v.keys)
        ids[~v.present] = vocab.size + 1
        return ids
    if spec.mode == "hash":
        if spec.parse == "hex":  # preprocess criteo --num-embeddings N - 1: h mod (N - 1), missing -> N - 1
            ids = v.keys % (spec.buckets - 1)
            ids[~v.present] = spec.buckets - 1
            return ids
        return hash_buckets(v.keys, spec.buckets)
    return v.keys


def table_rows(spec: CategoricalSpec, vocab_size: int | None, distinct: int | None) -> int:
    """``num_embeddings`` of a feature: ``V + 2`` (vocab; ``V`` with ``oov: error``), ``buckets`` (hash),
    distinct train raw ids (raw)."""
    if spec.mode == "vocab":
        return int(vocab_size) + (0 if spec.oov == "error" else 2)
    if spec.mode == "hash":
        return spec.buckets
    return max(int(distinct or 0), 1)


def vocab_path(data_dir: str | os.PathLike, feature: str) -> Path:
    return Path(data_dir) / "vocab" / f"{feature}.arrow"
