"""Raw rows in a schema's format -> the ids and dense values of training, for ``predict`` and ``serve``.

:class:`RawTransformer` is built from a dataset's (or an exported model's) ``meta.json``: the schema
recorded there, the train statistics of ``standardize`` columns and the vocabulary files; it runs the
very readers and transforms of the preprocess (:mod:`.read`, :mod:`.transform`), so a row scores
with exactly the inputs it would have been trained on.  Rows come from a file in the schema's
format (:meth:`~RawTransformer.file`), from text lines in memory (:meth:`~RawTransformer.lines`:
CSV / TSV lines without a header, in the column order of the training input, or JSON objects) or
from dicts keyed by column name (:meth:`~RawTransformer.records`).  The label, the time and ignored
columns may be absent; with a label, its values are returned.  A schema with multi-valued or
weighted columns gives :class:`~dlrmctl.data.raw_rows.Bags` for the ids (bags cut to ``max_len``,
the weight column's per-id weights), exactly as the preprocess writes them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.logs.join import with_tables
from dlrmctl.data.logs.read import RowBatch, file_columns, iter_batches
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.transform import VocabLookup, decode, dense_values
from dlrmctl.data.logs.derived import CountTable, count_paths, finish_dense
from dlrmctl.data.logs.vocab_rules import drop_outside
from dlrmctl.data.raw_rows import Bags

__all__ = ["RawTransformer"]

#: ``(dense [n, D] float32, ids [n, S] int64 or Bags, labels [n] float32 or None)``
Chunk = tuple[np.ndarray, "np.ndarray | Bags", "np.ndarray | None"]


class RawTransformer:
    """A schema dataset's transforms, built once, applied to raw rows.

    Args:
        meta: the dataset's ``meta.json`` dict (``schema``, ``transforms``, ``vocab_files``,
            ``input_columns``).
        data_dir: the directory the vocabulary paths are relative to.
        source: what the meta came from, for messages.

    Raises:
        DataError: no schema in the meta, a missing vocabulary file.
    """

    def __init__(self, meta: dict, data_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
        if not isinstance(meta.get("schema"), dict):
            raise DataError("no schema recorded in the data meta: raw rows cannot be transformed", path=source)
        self.schema = with_tables(LogSchema.from_dict(meta["schema"]), data_dir)  # side tables: vocab/join_<i>.arrow
        #: the ids come as Bags (a multi-valued or weighted column), not ``[n, S]``
        self.bags = any(c.multi or c.weights for c in self.schema.categorical)
        dense = (meta.get("transforms") or {}).get("dense") or {}
        self.stats = {n: (float(t["mean"]), float(t["std"])) for n, t in dense.items() if "mean" in t}
        vf = meta.get("vocab_files") or {}
        self.vocabs = [VocabLookup.read(Path(data_dir) / vf[c.name]) if c.mode == "vocab" else None
                       for c in self.schema.categorical]
        self.counts = {n: CountTable(Path(data_dir) / vf.get(f"count:{n}", p)) for n, p in count_paths(self.schema).items()}
        self.input_columns = list(meta.get("input_columns") or self.schema.columns or [])
        self.input_format = self.schema.format or meta.get("input_format") or "csv"

    # ------------------------------------------------------------------ schema of the rows to score
    def _scoring_schema(self, columns: list[str], base: LogSchema | None = None) -> LogSchema:
        """The schema (``base``: how the rows are read) for rows with ``columns``: the label when
        present, no time (unless a ``years_since`` feature reads it), the ignored columns present."""
        s = base or self.schema
        have = set(columns)
        keep_time = any(d.years_since for d in s.dense)  # (the row's year is a feature)
        drop = {s.time} if s.time and not keep_time else set()
        label = s.label if s.label and s.label.column in have else None
        if s.label and label is None:
            drop.add(s.label.column)
        ignore = tuple(c for c in (*s.ignore, *drop) if c in have)
        return dataclasses.replace(s, label=label, time=s.time if keep_time else None, ignore=ignore, split=None)

    def _chunks(self, batches: Iterator[RowBatch], schema: LogSchema, batch_rows: int) -> Iterator[Chunk]:
        for b in batches:
            d, per = drop_outside(schema, decode(b, schema, "error", scoring=True), self.vocabs, b.path, "error")
            finish_dense(d, schema, self.stats, self.counts)
            n = len(d.keys)
            if n == 0:
                continue
            dense = np.stack(dense_values(d, schema, self.stats), axis=1) if schema.dense else np.zeros((n, 0), np.float32)
            if self.bags:
                ids = Bags(per, np.stack([v.lengths if v.lengths is not None else np.ones(n, np.int64)
                                          for v in d.categorical]).reshape(len(per), n),
                           [v.weights for v in d.categorical])
            else:
                ids = np.stack(per, axis=1) if per else np.zeros((n, 0), np.int64)
            for s in range(0, n, batch_rows):
                e = min(n, s + batch_rows)
                part = ids.rows(s, e) if self.bags else ids[s:e]
                yield dense[s:e], part, (d.label[s:e] if d.label is not None else None)

    def file(self, path: str | os.PathLike, batch_rows: int = 65536) -> Iterator[Chunk]:
        """A file in the schema's format -> chunks of at most ``batch_rows`` rows:
        ``(dense [n, D] float32, ids [n, S] int64, labels [n] float32 or None)`` in file order.

        Raises:
            DataError: a bad row (``file:line``, column), a missing or unnamed column.
        """
        cols = file_columns(path, self.schema)
        if cols is None:
            return
        if not self.schema.header and self.schema.label and self.schema.format != "parquet":
            from dlrmctl.data.logs.read import first_line

            fmt = self.schema.format_of(path)
            if fmt in ("csv", "tsv") and len(next(_split_first(first_line(path, None) or b"",
                                                                 "\t" if fmt == "tsv" else self.schema.delimiter or ","))) \
                    == len(cols) - 1:  # a headerless file without its label column (e.g. Criteo's test.txt)
                cols = [c for c in cols if c != self.schema.label.column]
        schema = self._scoring_schema(cols)
        yield from self._chunks(iter_batches(path, schema, "error", columns=cols, scoring=True), schema, batch_rows)

    def _one(self, parts: list[Chunk], n: int, name: str) -> Chunk:
        got = sum(len(p[0]) for p in parts)
        if got != n:  # pragma: no cover - the reader raises on a bad row first
            raise DataError(f"parsed {got} of {n} rows", path=name)
        if len(parts) == 1:
            return parts[0]
        ids = Bags.concat([p[1] for p in parts]) if self.bags else np.concatenate([p[1] for p in parts])
        return (np.concatenate([p[0] for p in parts]), ids,
                None if parts[0][2] is None else np.concatenate([p[2] for p in parts]))

    def lines(self, lines: list[bytes], name: str = "<lines>") -> Chunk:
        """Raw text lines in memory: CSV / TSV lines without a header (the fields of the training
        input, in its column order; any line may leave the label out, alone or next to lines that
        hold it: the label is then not read), or JSON objects keyed by column
        name (whatever the schema's format) -> one chunk of ``n = len(lines)`` rows.

        Raises:
            DataError: no lines, a line break inside a line, a bad row (``name:line``, column).
        """
        if not lines:
            raise DataError("no lines", path=name)
        for i, ln in enumerate(lines):
            if b"\n" in ln.rstrip(b"\r\n") or b"\r" in ln.rstrip(b"\r\n"):
                raise DataError("one raw row per element: this one holds a line break", path=name, line=i + 1)
        fmt = self.input_format
        if fmt != "jsonl" and all(ln.lstrip()[:1] == b"{" for ln in lines):
            return self.records(_json_objects(lines, name), name)  # JSON objects keyed by column name
        body = b"\n".join(ln.rstrip(b"\r\n") for ln in lines) + b"\n"
        if fmt == "parquet":
            raise DataError("a Parquet schema's raw rows are JSON objects keyed by column name (records), not "
                            "text lines", path=name)
        if fmt == "jsonl":
            schema = dataclasses.replace(self.schema, format="jsonl")
            cols = file_columns(Path(name), schema, data=body)
            schema = self._scoring_schema(cols, schema)
        else:
            cols = list(self.input_columns)
            label = self.schema.label.column if self.schema.label and self.schema.label.column in cols else None
            short = [False] * len(lines)
            if label:  # each line with all the columns, or all but the label (scored alike, alone or batched)
                d = "\t" if fmt == "tsv" else self.schema.delimiter or ","
                short = [_field_count(ln, d, fmt) == len(cols) - 1 for ln in lines]
                if all(short):
                    cols.remove(label)
                elif any(short):  # the label's field added empty to the lines without it, and not read
                    k = cols.index(label)
                    lines = [_with_empty_field(ln, k, d, fmt) if sh else ln for ln, sh in zip(lines, short)]
                    body = b"\n".join(ln.rstrip(b"\r\n") for ln in lines) + b"\n"
            schema = self._scoring_schema(cols, dataclasses.replace(self.schema, header=False, columns=tuple(cols),
                                                                    format=fmt))
            if any(short) and not all(short):
                schema = dataclasses.replace(schema, label=None, ignore=(*schema.ignore, label))
        batches = iter_batches(Path(name), schema, "error", block_size=max(len(body) + 1, 1 << 16), data=body,
                               columns=cols, scoring=True)
        return self._one(list(self._chunks(batches, schema, len(lines))), len(lines), name)

    def records(self, rows: list[dict], name: str = "<records>") -> Chunk:
        """Rows as dicts keyed by column name (e.g. a JSON request) -> one chunk of ``len(rows)`` rows.

        Each column's values are converted by the column's role in the schema, so one column may
        mix JSON kinds across rows: a categorical's integer is its decimal text (the key a CSV
        input or a JSON-lines input gives it; a whole float ``12.0`` as ``12``), a dense, label or
        time value given as text is parsed as the CSV reader parses it, and a multi-valued column
        takes a one-id scalar as a one-element bag.  A key absent from every row is a missing value
        (its ``fill`` / the missing id) unless the column is required at scoring: the time when a
        ``years_since`` feature reads it and the join keys.

        Raises:
            DataError: no rows, a row that is not an object, all the required columns absent (one
                message naming each), a value that cannot be converted (``name:row``, column).
        """
        if not rows:
            raise DataError("no rows", path=name)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise DataError(f"expected an object keyed by column name, got {type(r).__name__}", path=name,
                                line=i + 1)
        cols = list(dict.fromkeys(k for r in rows for k in r))
        schema = self._scoring_schema(cols)
        have = set(cols)
        required = [c for c in schema.used_columns() if c not in have and c in _required_columns(schema)]
        if required:
            raise DataError(f"column(s) {', '.join(repr(c) for c in required)} named by the schema "
                            f"{schema.source} are needed to score a row and are in no row", path=name)
        absent = [c for c in schema.used_columns() if c not in have]  # missing values
        from dlrmctl.data.logs.read import check_columns

        check_columns(name, schema, cols + absent, scoring=True)
        kinds = _column_kinds(schema)
        batch = RowBatch({c: _record_column(rows, c, kinds.get(c, "text"), name) for c in schema.used_columns()},
                         np.arange(1, len(rows) + 1, dtype=np.int64), name)
        return self._one(list(self._chunks(iter([batch]), schema, len(rows))), len(rows), name)


def _required_columns(schema: LogSchema) -> set[str]:
    """Columns a scored row cannot go without: the time a ``years_since`` feature reads, the join keys."""
    out = {j.key for j in schema.join}
    if schema.time and any(d.years_since for d in schema.dense):
        out.add(schema.time)
    return out


def _column_kinds(schema: LogSchema) -> dict[str, str]:
    """Column -> ``"id"`` (one-valued categorical), ``"ids"`` (multi-valued: ``"ids|<delimiter>"``
    for delimited text), ``"number"`` (dense, label, weights) or ``"time"``; others are text."""
    out: dict[str, str] = {}
    for d in schema.dense:
        if not (d.count_of or d.years_since or d.extract):
            out[d.name] = "number"
    for c in schema.categorical:
        out[c.name] = ("ids|" + c.delimiter if c.delimiter else "ids") if c.multi else "id"
        if c.weights:
            out[c.weights] = "numbers|" + c.delimiter if c.delimiter else "numbers"
    if schema.label:
        out[schema.label.column] = "number"
    if schema.time:
        out[schema.time] = "time"
    return out


def _scalar_text(v, kind: str, name: str, row: int, column: str) -> str:
    """A JSON number as the text a CSV input would hold for it (ids and times: whole numbers)."""
    if isinstance(v, float) and kind in ("id", "ids", "time"):
        if not (v == v and abs(v) < 2.0**63 and v == int(v)):
            raise DataError(f"expected a string or an integer, got {v!r}", path=name, line=row + 1, field=column)
        return str(int(v))
    return str(v) if isinstance(v, int) else repr(v)


def _record_column(rows: list[dict], column: str, kind: str, name: str) -> pa.Array:
    """The ``[n]`` Arrow column ``column`` of JSON ``rows`` (absent or ``null``: null), its values
    converted by ``kind`` (:func:`_column_kinds`) when the rows mix JSON kinds.

    Raises:
        DataError: a value of no convertible kind (an object, a boolean among other kinds, a list
            in a one-valued column), naming its row and the column.
    """
    base, _, delim = kind.partition("|")
    delim = delim if _ else None
    values = [r.get(column) for r in rows]

    def what(v) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "bool"
        if isinstance(v, (int, float)):
            return "number"
        return {str: "text", list: "list"}.get(type(v), type(v).__name__)

    seen = {what(v) for v in values} - {"null"}
    for i, v in enumerate(values):
        w = what(v)
        if w not in ("null", "bool", "number", "text", "list") or (w == "list" and base not in ("ids", "numbers")) \
                or (w == "bool" and len(seen) > 1):
            raise DataError(f"expected {'a list, ' if base in ('ids', 'numbers') else ''}a string or a number, got "
                            f"{'an object' if isinstance(v, dict) else repr(v) if w != 'list' else 'a list'}",
                            path=name, line=i + 1, field=column)
    if len(seen) > 1 or (base in ("ids", "numbers") and "list" in seen):
        out = []
        for i, v in enumerate(values):
            if v is None or isinstance(v, str):
                out.append(v if delim is not None or base not in ("ids", "numbers") or v is None else [v])
            elif isinstance(v, list):
                el = [x if isinstance(x, str) or x is None else _scalar_text(x, base, name, i, column) for x in v]
                out.append(delim.join("" if x is None else x for x in el) if delim is not None else el)
            else:
                t = _scalar_text(v, base, name, i, column)
                out.append(t if delim is not None or base not in ("ids", "numbers") else [t])
        values = out
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise DataError(f"the values do not form one column: {e}", path=name, field=column) from None


def _json_objects(lines: list[bytes], name: str) -> list[dict]:
    import json

    out = []
    for i, ln in enumerate(lines):
        try:
            out.append(json.loads(ln))
        except ValueError as e:
            raise DataError(f"not a JSON object: {e}", path=name, line=i + 1) from None
    return out


def _field_count(line: bytes, delimiter: str, fmt: str) -> int:
    """Fields of a CSV / TSV line (TSV: no quoting, as the reader)."""
    line = line.rstrip(b"\r\n")
    if fmt == "tsv" or b'"' not in line:
        return line.count(delimiter.encode()) + 1
    return len(next(iter(_split_first(line, delimiter))))


def _with_empty_field(line: bytes, k: int, delimiter: str, fmt: str) -> bytes:
    """``line`` with an empty field inserted before its field ``k``."""
    import csv
    import io

    line = line.rstrip(b"\r\n")
    if fmt == "tsv" or b'"' not in line:
        parts = line.split(delimiter.encode())
        return delimiter.encode().join(parts[:k] + [b""] + parts[k:])
    fields = next(iter(_split_first(line, delimiter)))
    out = io.StringIO()
    csv.writer(out, delimiter=delimiter, lineterminator="").writerow(fields[:k] + [""] + fields[k:])
    return out.getvalue().encode()


def _split_first(line: bytes, delimiter: str):
    import csv
    import io

    return csv.reader(io.StringIO(line.decode("utf-8", "replace").rstrip("\r\n")), delimiter=delimiter)
