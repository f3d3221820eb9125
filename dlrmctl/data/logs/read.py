"""Streaming readers of a click log in the schema's format: CSV / TSV (``pyarrow.csv``), JSON lines
(``pyarrow.json``), Parquet (``pyarrow.parquet``, one row group at a time); plain or compressed
(``.gz``, ``.bz2``, ``.zst``, ``.lz4``: detected from the name).  Each yields :class:`RowBatch`
blocks (a few MB each: memory does not grow with the file) that know where every row came from,
so an error names ``file:line`` (text formats: the physical line, the header being line 1) or
``file: row group G, row R`` (Parquet) and the column.

Columns: every column the schema uses must be in the file, and every column of the file must be
named by the schema (a feature, the label, the time, a weight column, or ``ignore``): a file with
other columns than expected is refused before any row is read (:func:`check_columns`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import math
import os
import re
import threading
import time
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.criteo.parse import block_lines, paced_input
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.long_lines import FullReads, LineLimit, long_line_message
from dlrmctl.errors import delimiter_hint, quoted

__all__ = ["RowBatch", "check_columns", "file_columns", "first_line", "iter_batches"]

DEFAULT_BLOCK_SIZE = 4 << 20  # bytes of text per block (as the Criteo reader)
PARQUET_BATCH_ROWS = 65536
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark


@dataclasses.dataclass
class RowBatch:
    """``n`` rows of one input file, the columns the schema uses, and where each row came from.

    Attributes:
        columns: column name -> ``pa.Array`` ``[n]`` (text formats: strings, null = empty field).
        keys: ``[n]`` int64 row keys: the 1-based physical line (text formats) or the 1-based row of
            the file (Parquet); the row-hash split hashes them.
        path: the input file.
        row_group: Parquet row group of every row, or None (text formats).
        group_start: Parquet: the file row (0-based) of the row group's first row.
        bad_skipped: rows the parser dropped before this batch (``on_bad_line='skip'``).
    """

    columns: dict[str, pa.Array]
    keys: np.ndarray
    path: str
    row_group: int | None = None
    group_start: int = 0
    bad_skipped: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.keys)

    def error(self, i: int, column: str | None, message: str) -> DataError:
        """A :class:`DataError` naming row ``i`` of this batch (``file:line`` or row group / row)."""
        if self.row_group is None:
            return DataError(message, path=self.path, line=int(self.keys[i]), field=column)
        row = int(self.keys[i]) - 1 - self.group_start
        return DataError(message, path=f"{self.path}: row group {self.row_group}, row {row}", field=column)

    def take(self, keep: np.ndarray) -> "RowBatch":
        """The rows where ``keep`` (``[n]`` bool) is True."""
        idx = pa.array(np.flatnonzero(keep))
        return dataclasses.replace(self, columns={k: v.take(idx) for k, v in self.columns.items()},
                                   keys=self.keys[keep])


class _Gate:
    """Holds an Arrow reader's I/O thread back to at most ``ahead`` reads past the batches taken.

    Arrow's CSV and JSON stream readers read ahead on their I/O thread as fast as the input allows,
    through a Python file too: a file read faster than it is transformed ended up in memory (peak
    RSS grew with the file).  Each read of the input waits here while ``ahead`` blocks are read and
    not yet taken as batches; when the consumer has waited for its batch for a second with the
    reader held (a reader that needs more blocks than that for one batch), the read goes on, so
    the two never wait on each other."""

    def __init__(self, ahead: int = 4) -> None:
        self._cv = threading.Condition()
        self.reads = 0
        self.taken = 0
        self.ahead = ahead
        self._waiting_since: float | None = None
        self._closed = False

    def before_read(self) -> None:
        with self._cv:
            while not self._closed and self.reads - self.taken >= self.ahead:
                since = self._waiting_since
                if since is not None and time.monotonic() - since > 1.0:
                    break
                self._cv.wait(0.25)
            self.reads += 1

    @contextlib.contextmanager
    def taking(self):
        """Around the consumer's call that waits for a batch (or opens the reader)."""
        with self._cv:
            self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            with self._cv:
                self._waiting_since = None
                self.taken += 1
                self._cv.notify_all()

    def close(self) -> None:
        """Let a held read go (the consumer stopped)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class _Gated(io.RawIOBase):
    """A readable binary file: ``inner``'s bytes, each read after :meth:`_Gate.before_read`.

    ``read(n)`` (what Arrow calls) joins ``inner``'s pieces once: the default ``RawIOBase.read``
    would zero a new buffer, copy the pieces into it and copy it again into the bytes it returns."""

    def __init__(self, inner: FullReads, gate: _Gate) -> None:
        super().__init__()
        self._inner = inner
        self._gate = gate

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        self._gate.before_read()
        if n is None or n < 0:
            return self._inner.read()
        pieces, got = [], 0
        while got < n:
            p = self._inner.read_some(n - got)
            if not p:
                break
            pieces.append(p)
            got += len(p)
        return pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)

    def readinto(self, b) -> int:
        self._gate.before_read()
        return self._inner.readinto(b)

    def close(self) -> None:
        self._inner.close()
        super().close()


def _text_stream(path: str | os.PathLike, data: bytes | None, block_size: int | None = None,
                 long_line: Callable[[int], bytes] | None = None, gate: _Gate | None = None):
    """The bytes of a text input (decompressed by its name's suffix), read as the parser asks; a
    line too long for a block of ``block_size`` bytes reaches it as ``long_line(line)``; with
    ``gate``, read at most its ``ahead`` blocks past the batches taken."""
    if data is not None:
        return pa.BufferReader(data)
    if gate is None or block_size is None or long_line is None:
        return paced_input(path, block_size, long_line)
    raw = LineLimit(lambda: pa.input_stream(os.fspath(path), compression="detect"), block_size, long_line)
    return pa.PythonFile(_Gated(raw, gate), mode="r")


def first_line(path: str | os.PathLike, data: bytes | None) -> bytes | None:
    """The first line of a text input (decompressed; without its line break and without a UTF-8
    byte order mark before it), None for an empty one.

    Raises:
        DataError: the file cannot be read or decoded.
    """
    try:
        with _text_stream(path, data) as f:
            buf = b""
            while b"\n" not in buf:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                buf += chunk
    except (OSError, EOFError, pa.ArrowInvalid) as e:
        raise DataError(f"cannot be read (is it complete and of the kind its name says?): {e}", path=path) from None
    if buf.startswith(_BOM):  # a UTF-8 byte order mark is not part of the first field (Arrow's readers skip it too)
        buf = buf[len(_BOM):]
    if not buf:
        return None
    return buf.split(b"\n", 1)[0].rstrip(b"\r")


def _delimiter(schema: LogSchema, fmt: str) -> str:
    return "\t" if fmt == "tsv" else (schema.delimiter or ",")


def file_columns(path: str | os.PathLike, schema: LogSchema, data: bytes | None = None) -> list[str] | None:
    """The columns of an input file: the header (CSV / TSV with ``header: true``), the schema's
    ``columns``, the first object's keys (JSON lines) or the Parquet schema; None for an empty file.

    Raises:
        DataError: the file cannot be read or decoded.
    """
    fmt = schema.format_of(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(os.fspath(path)).schema_arrow.names)
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"not a readable Parquet file: {e}", path=path) from None
    first = first_line(path, data)
    if first is None or not first.strip():
        return None
    if fmt == "jsonl":
        import json

        try:
            obj = json.loads(first)
        except ValueError as e:
            raise DataError(f"not a JSON object: {e}", path=path, line=1) from None
        if not isinstance(obj, dict):
            raise DataError(f"expected a JSON object per line, got a {type(obj).__name__}", path=path, line=1)
        return list(obj)
    if not schema.header:
        return list(schema.columns or [])
    try:
        text = first.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError("the header line is not UTF-8 text", path=path, line=1) from None
    return next(csv.reader(io.StringIO(text), delimiter=_delimiter(schema, fmt)))


def _text_table(path: str | os.PathLike, schema: LogSchema) -> bool:
    """Whether ``path`` is read as CSV / TSV (a header line); False where the format is unknown
    (rows given as records)."""
    from dlrmctl.data.logs.schema import SchemaError

    try:
        return schema.format_of(path) in ("csv", "tsv")
    except SchemaError:
        return False


def check_columns(path: str | os.PathLike, schema: LogSchema, columns: list[str], scoring: bool = False) -> None:
    """Every column the schema names is in the file and every column of the file is named; a
    column a side table brings (``join[i].columns``) must not be in the file: in a log to
    preprocess that is a conflict of the schema, in raw rows to score (``scoring``: predict,
    serve) the model joins it itself.

    Raises:
        DataError: naming the column, the file and the schema (and the side table).
    """
    have = set(columns)
    missing = [c for c in schema.named_columns() if c not in have]
    if schema.header and missing and len(missing) == len(schema.named_columns()) and _text_table(path, schema):
        fmt = schema.format_of(path)
        sep = _delimiter(schema, fmt)
        hint = delimiter_hint(sep.join(columns), sep, fmt)
        raise DataError(f"the first line is not a header: none of its fields ({quoted(', '.join(columns))}) names a "
                        f"column of the schema {schema.source}, which says `header: true`; "
                        + (f"{hint}: give the file in that format, or set the schema's `format` / `delimiter` to the file's"
                           if hint else "give the file its header line, or set `header: false` and list the "
                           "`columns:` in order"), path=path, line=1)
    dup = sorted({c for c in columns if columns.count(c) > 1})
    if dup:
        raise DataError(f"the file names column(s) {dup} twice", path=path, line=1)
    if missing:
        raise DataError(f"column '{missing[0]}' named by the schema {schema.source} is not in the input "
                        f"(its columns: {quoted(', '.join(columns))})", path=path)
    named = set(schema.named_columns())
    extra = [c for c in columns if c not in named]
    brought = [(c, schema.join_bringing(c)) for c in extra if schema.join_bringing(c)]
    if brought and scoring:
        raise DataError(f"column '{brought[0][0]}' comes from the model's side table {brought[0][1]}: raw rows must "
                        "not carry it (the model looks it up by the key); leave it out of the rows", path=path)
    if brought:
        raise DataError(f"column '{brought[0][0]}' is in the input and also brought by {brought[0][1]} of the schema "
                        f"{schema.source}: a row cannot take it from both; remove it from that join's `columns:` to "
                        "read the input's own values, or leave it out of the input", path=path)
    if extra:
        raise DataError(f"column '{extra[0]}' of the input is not named by the schema {schema.source}: give it a "
                        "role, or list it under `ignore:`", path=path)


def iter_batches(path: str | os.PathLike, schema: LogSchema, on_bad_line: str = "error",
                 block_size: int = DEFAULT_BLOCK_SIZE, data: bytes | None = None,
                 columns: list[str] | None = None, scoring: bool = False) -> Iterator[RowBatch]:
    """Stream a file's rows, the schema's used columns only.

    Args:
        path: the input file (with ``data``: only its name, in messages).
        on_bad_line: text formats: a line with the wrong number of fields raises ("error") or is
            counted in ``bad_skipped`` ("skip").
        block_size: bytes of text per block.
        data: the file's bytes (a served request's lines), instead of reading ``path``.
        columns: the file's columns (:func:`file_columns`), when known.
        scoring: raw rows to score (:func:`check_columns`).

    Raises:
        DataError: an unreadable file, wrong columns, a line with the wrong number of fields.
    """
    fmt = schema.format_of(path)
    used = schema.used_columns()
    if fmt == "jsonl":  # each line names its keys: see dlrmctl.data.logs.read_json
        yield from _jsonl(path, used, on_bad_line, block_size, data)
        return
    cols = columns if columns is not None else file_columns(path, schema, data)
    if cols is None:
        return
    check_columns(path, schema, cols, scoring)
    if fmt == "parquet":
        yield from _parquet(path, used)
    else:
        yield from _csv(path, schema, fmt, cols, used, on_bad_line, block_size, data)


def _parquet(path: str | os.PathLike, used: list[str]) -> Iterator[RowBatch]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(os.fspath(path))
    start = 0
    for g in range(pf.num_row_groups):
        off = start
        try:
            for rb in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g], columns=used):
                n = rb.num_rows
                yield RowBatch({c: rb.column(c) for c in used}, np.arange(off + 1, off + n + 1, dtype=np.int64),
                               os.fspath(path), row_group=g, group_start=start)
                off += n
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"row group {g}: cannot be read: {e}", path=path) from None
        start += pf.metadata.row_group(g).num_rows


def _jsonl(path: str | os.PathLike, used: list[str], on_bad_line: str, block_size: int,
           data: bytes | None) -> Iterator[RowBatch]:
    from dlrmctl.data.logs.read_json import iter_json_lines

    def row_batch(cols: dict, keys: np.ndarray, bad: int) -> RowBatch:
        return RowBatch(cols, keys, os.fspath(path), bad_skipped=bad)

    try:
        yield from iter_json_lines(path, used, on_bad_line, block_size, lambda: (
            pa.BufferReader(data) if data is not None else pa.input_stream(os.fspath(path), compression="detect")),
            row_batch)
    except (OSError, EOFError) as e:
        raise DataError(f"cannot be read as JSON lines: {e}", path=path) from None


def _shared_columns(schema: LogSchema) -> set[str]:
    """Columns read by a second role besides their feature: the split's group and tiebreak, the
    join keys and the text columns of ``extract`` features (the schema allows one role otherwise)."""
    return {c for c in ((schema.split.group, schema.split.tiebreak) if schema.split else ()) if c} | \
        {j.key for j in schema.join} | {d.extract[0] for d in schema.dense if d.extract}


def _hex_columns(schema: LogSchema) -> set[str]:
    """The one-hot ``parse: hex`` categorical columns that no other role reads: read as bytes."""
    shared = _shared_columns(schema)
    return {c.name for c in schema.categorical if c.parse == "hex" and not c.multi and c.name not in shared}


def _number_columns(schema: LogSchema) -> set[str]:
    """The dense columns that no other role reads: the CSV reader converts them to float64 itself
    (a missing value: null), instead of handing on text that is then cast."""
    shared = _shared_columns(schema)
    read = set(schema.used_columns())  # (not the columns a side table brings)
    return {d.name for d in schema.dense if not d.derived and d.name not in shared and d.name in read}


def _finite(col: pa.Array) -> bool:
    """Whether every value of a float64 column is finite: False for NaN or inf, and also where the
    values' sum passes 1.8e308 or a null's slot holds a non-finite number (harmless: the file is
    then read as text, which decides exactly)."""
    x = np.frombuffer(col.buffers()[1], np.float64, count=len(col), offset=col.offset * 8)
    return math.isfinite(float(np.add.reduce(x)))


class _AsText(Exception):
    """Internal: a column read as numbers holds a value that does not parse, NaN or inf: the file
    is read again with every column as text, so the bad value is named (or its row dropped) as
    text is."""


def _csv(path, schema: LogSchema, fmt: str, cols: list[str], used: list[str], on_bad_line: str, block_size: int,
         data: bytes | None) -> Iterator[RowBatch]:
    """The rows of a CSV / TSV input.  The dense columns are read as float64 by the parser
    (:func:`_number_columns`); a block where one does not parse or is NaN or inf makes the rest of
    the file be read as text, from that block on (the rows before it are not given twice): a
    value is then accepted, refused or named exactly as it is in text."""
    done = 0  # the last physical line of the batches given (rows and dropped lines)
    try:
        for b in _csv_pass(path, schema, fmt, cols, used, on_bad_line, block_size, data, _number_columns(schema), 0):
            yield b
            if b.num_rows:
                done = int(b.keys[-1])
    except _AsText:
        yield from _csv_pass(path, schema, fmt, cols, used, on_bad_line, block_size, data, set(), done)


def _csv_pass(path, schema: LogSchema, fmt: str, cols: list[str], used: list[str], on_bad_line: str,
              block_size: int, data: bytes | None, numbers: set[str], after: int) -> Iterator[RowBatch]:
    """One read of a CSV / TSV input: ``numbers`` read as float64 (raises :class:`_AsText` where
    one does not parse or is not finite), the rest as text; rows and dropped lines up to physical
    line ``after`` are not given (given by an earlier pass)."""
    import pyarrow.csv as pa_csv

    skipped: list[int] = []
    first_error: list[tuple[int, str]] = []
    long_lines: set[int] = set()

    def long_line(ln: int) -> bytes:  # a row of one field too many: reported or skipped by its line
        long_lines.add(ln)
        return _delimiter(schema, fmt).encode() * len(cols)

    def invalid(row) -> str:
        if on_bad_line == "error" and not first_error:
            got = row.actual_columns
            first_error.append((row.number, long_line_message(block_size) if row.number in long_lines else
                                f"expected {len(cols)} {fmt.upper()} fields, got {got}"
                                + (f" (the first missing: '{cols[got]}')" if got < len(cols) else "")))
        skipped.append(row.number)
        return "skip"

    def raise_first() -> None:
        if first_error:
            ln, msg = first_error[0]
            raise DataError(msg, path=path, line=ln)

    def dropped(lo: int, hi: int) -> int:  # lines the parser dropped in skipped[lo:hi] not given before
        return sum(1 for ln in skipped[lo:hi] if ln > after) if after else hi - lo

    types = {c: pa.binary() for c in _hex_columns(schema)}  # read without a UTF-8 check: checked as hex digits
    types.update({c: pa.float64() for c in numbers})
    gate = _Gate()
    try:
        try:
            with gate.taking():
                reader = pa_csv.open_csv(
                    _text_stream(path, data, block_size, long_line, gate),
                    read_options=pa_csv.ReadOptions(column_names=cols, skip_rows=1 if schema.header else 0,
                                                    use_threads=False, block_size=block_size),
                    parse_options=pa_csv.ParseOptions(delimiter=_delimiter(schema, fmt), ignore_empty_lines=False,
                                                      invalid_row_handler=invalid,
                                                      quote_char=False if fmt == "tsv" else '"'),
                    convert_options=pa_csv.ConvertOptions(
                        include_columns=used, column_types={c: types.get(c, pa.string()) for c in used},
                        strings_can_be_null=True, null_values=[""], quoted_strings_can_be_null=True,
                        check_utf8=True))
        except (pa.ArrowInvalid, OSError, EOFError) as e:
            if numbers and isinstance(e, pa.ArrowInvalid):
                raise _AsText() from None
            raise_first()
            if "Empty CSV file" in str(e):
                return
            raise DataError(f"cannot be read as {fmt.upper()}: {e}", path=path) from None
        next_line = 2 if schema.header else 1
        pos = 0
        while True:
            try:
                with gate.taking():
                    rb = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError, EOFError) as e:
                if numbers and isinstance(e, pa.ArrowInvalid):
                    raise _AsText() from None
                raise_first()
                raise DataError(f"cannot be read as {fmt.upper()} after line {next_line - 1}: {e}", path=path) from None
            if numbers and not all(_finite(rb.column(c)) for c in numbers):
                raise _AsText()  # NaN or inf: named, or dropped, as text
            raise_first()
            n = rb.num_rows
            lines, next_line, bad, pos = block_lines(skipped, pos, next_line, n)
            if after and n and lines[-1] <= after:
                continue
            if after and n and lines[0] <= after:
                keep = int(np.searchsorted(lines, after, side="right"))
                rb, lines = rb.slice(keep), lines[keep:]
                n = rb.num_rows
            bad = dropped(pos - bad, pos)
            if n or bad:
                yield RowBatch({c: rb.column(c) for c in used}, lines, os.fspath(path), bad_skipped=bad)
    finally:
        gate.close()
    raise_first()  # a bad row in a block that had no good one (a request of one short line)
    if dropped(pos, len(skipped)):
        yield RowBatch({c: pa.array([], pa.string()) for c in used}, np.zeros(0, np.int64), os.fspath(path),
                       bad_skipped=dropped(pos, len(skipped)))
