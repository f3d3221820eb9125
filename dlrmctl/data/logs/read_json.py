"""JSON lines in blocks of whole lines, each parsed by Arrow's JSON reader, with exact ``file:line``
errors and ``--on-bad-line skip`` for every kind of bad line.

* Columns: a key the schema does not name is ignored, on any line; a column the schema uses that
  is absent from a line (or ``null``) is a missing value there (its ``fill``, the missing id, or a
  bad row for the label and the time); a column the schema uses that no line of the file holds is
  an error naming the file and the column, raised after the file is read.
* Types: each used key keeps the type of its first non-null values (Arrow's inference: integers
  and numbers with a fraction in one block make doubles).  A line is bad when it is not a JSON
  object, holds ``NaN`` / ``Infinity``, gives a key a value of another kind (a string where numbers
  were, a number where lists were, a number with a fraction where integers were), or is of
  ``block_size`` bytes or more.  A bad line raises one error naming ``file:line`` and the key
  (``on_bad_line='error'``) or is skipped and counted (``'skip'``).
* Blocks: the input is read through :class:`~dlrmctl.data.long_lines.LineLimit` (a line of
  ``block_size`` bytes or more reaches this reader as a blank line, numbered, and is bad),
  ``block_size`` bytes at a time, cut after its last line break, so memory holds about two blocks; Arrow parses a block whole (the fast path); when it refuses one,
  the block's lines are checked one by one in Python to find the bad ones, and the good ones are
  parsed again by Arrow with the types fixed so far.  Blank lines are skipped (and numbered).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.long_lines import LineLimit, long_line_message

__all__ = ["iter_json_lines"]

_BOM = b"\xef\xbb\xbf"


def _kind(v) -> str:
    """The JSON kind of a Python value from ``json.loads``."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number with a decimal point or an exponent"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object"


def _type_kind(t: pa.DataType) -> str:
    """What values an Arrow type of a JSON column holds, in words."""
    if pa.types.is_boolean(t):
        return "booleans"
    if pa.types.is_integer(t):
        return "integers"
    if pa.types.is_floating(t):
        return "numbers"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_timestamp(t):
        return "strings"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "lists"
    return "objects"


def _fits(v, t: pa.DataType) -> bool:
    """Whether ``json.loads``'s value ``v`` (not None) reads as Arrow type ``t``."""
    if pa.types.is_boolean(t):
        return isinstance(v, bool)
    if pa.types.is_integer(t):
        return isinstance(v, int) and not isinstance(v, bool)
    if pa.types.is_floating(t):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_timestamp(t):
        return isinstance(v, str)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return isinstance(v, list) and all(x is None or _fits(x, t.value_type) for x in v)
    if pa.types.is_null(t):
        return True
    return isinstance(v, dict)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _chunks(open_stream: Callable[[], object], block_size: int,
            long_line: Callable[[int], bytes]) -> Iterator[tuple[bytes, int]]:
    """``(bytes of whole lines, the 1-based number of its first line)`` of the input ``open_stream()``
    opens, read ``block_size`` bytes at a time through a :class:`~dlrmctl.data.long_lines.LineLimit`:
    a line of ``block_size`` bytes or more is replaced by ``long_line(its number)``."""
    buf = b""
    line = 1
    with LineLimit(open_stream, block_size, long_line) as f:
        while data := f.read(block_size):
            buf += data
            cut = buf.rfind(b"\n")
            if cut >= 0:
                chunk, buf = buf[:cut + 1], buf[cut + 1:]
                yield chunk, line
                line += chunk.count(b"\n")
    if buf:
        yield buf + b"\n", line


def iter_json_lines(path: str | os.PathLike, used: list[str], on_bad_line: str, block_size: int,
                    open_stream: Callable[[], object], row_batch) -> Iterator:
    """The rows of a JSON-lines input as ``row_batch(columns, keys, bad_skipped)`` (module docstring).

    Args:
        path: the input's name (messages).
        used: the columns the schema uses.
        on_bad_line: ``'error'`` or ``'skip'``.
        block_size: bytes read at a time; a line of this many bytes or more is bad.
        open_stream: opens the input's (decompressed) binary stream, with ``read(n)`` and ``close()``
            (called once to read, and again to number a long line).
        row_batch: builds a batch: ``(columns {name: pa.Array}, keys [n] int64 lines, bad_skipped)``.

    Raises:
        DataError: a bad line (``on_bad_line='error'``), naming ``file:line`` and the key; a used
            column no line holds.
    """
    import pyarrow.json as pj

    fixed: dict[str, pa.DataType] = {}  # a used column's type, once a block held a non-null value
    seen: set[str] = set()
    state = {"long": 0, "rows": 0}
    long_lines: set[int] = set()  # the numbers of lines of block_size bytes or more: blank lines here

    def mark_long(line: int) -> bytes:
        long_lines.add(line)
        return b""

    def bad(line: int, key: str | None, what: str) -> None:
        if on_bad_line == "error":
            raise DataError(what, path=path, line=line, field=key)

    def long_line(line: int) -> None:
        bad(line, None, long_line_message(block_size))
        state["long"] += 1

    def parse(chunk: bytes) -> pa.Table:
        opts = pj.ParseOptions(explicit_schema=pa.schema([(c, t) for c, t in fixed.items()]),
                               unexpected_field_behavior="infer")
        return pj.read_json(pa.BufferReader(chunk), read_options=pj.ReadOptions(use_threads=False,
                                                                                 block_size=max(len(chunk), 1 << 16) + 1),
                            parse_options=opts)

    for chunk, first in _chunks(open_stream, block_size, mark_long):
        if first == 1 and chunk.startswith(_BOM):
            chunk = chunk[len(_BOM):]
        lines = chunk.split(b"\n")[:-1]
        keep = [i for i, ln in enumerate(lines) if ln.strip()]
        for i in (i for i, ln in enumerate(lines) if not ln and first + i in long_lines):
            long_lines.discard(first + i)
            long_line(first + i)
        if len(keep) != len(lines):
            chunk = b"".join(lines[i] + b"\n" for i in keep)
        keys = first + np.array(keep, dtype=np.int64)
        skipped = state["long"]
        state["long"] = 0
        tab = None
        if keep:
            try:
                tab = parse(chunk)
                if tab.num_rows != len(keep):
                    tab = None
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                tab = None
        if tab is None and keep:  # find the bad lines one by one
            good = []
            kinds: dict[str, pa.DataType] = dict(fixed)
            for j, i in enumerate(keep):
                ln = int(keys[j])
                try:
                    obj = json.loads(lines[i], parse_constant=_no_constant)
                except (ValueError, RecursionError) as e:
                    bad(ln, None, f"bad JSON line ({e}; each line is one object)")
                    continue
                if not isinstance(obj, dict):
                    bad(ln, None, f"expected a JSON object per line, got {_kind(obj)}")
                    continue
                ok = True
                for c in used:
                    v = obj.get(c)
                    if v is None:
                        continue
                    t = kinds.get(c)
                    if t is None:  # the first value of this key: its kind (integers widen to numbers)
                        try:
                            kinds[c] = pa.array([v]).type
                        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                            bad(ln, c, f"key '{c}': a value Arrow cannot read ({_kind(v)})")
                            ok = False
                            break
                    elif not _fits(v, t):
                        if pa.types.is_integer(t) and isinstance(v, float) and c not in fixed:
                            kinds[c] = pa.float64()  # integers then fractions in one block: numbers
                            continue
                        bad(ln, c, f"key '{c}': expected {_type_kind(t)} (as the lines before), got {_kind(v)}")
                        ok = False
                        break
                if ok:
                    good.append(j)
            skipped += len(keep) - len(good)
            keys = keys[good]
            if good:
                try:
                    tab = parse(b"".join(lines[keep[j]] + b"\n" for j in good))
                except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                    raise DataError(f"cannot be read as JSON lines (lines {int(keys[0])}-{int(keys[-1])}): {e}",
                                    path=path) from None
        n = 0 if tab is None else tab.num_rows
        state["rows"] += n
        if tab is not None:
            for c in used:
                if c in tab.column_names:
                    seen.add(c)
                    t = tab.schema.field(c).type
                    if c not in fixed and not pa.types.is_null(t) and tab.column(c).null_count < n:
                        fixed[c] = t
        cols = {c: (tab.column(c).combine_chunks() if tab is not None and c in tab.column_names
                    else pa.nulls(n)) for c in used}
        if n or skipped:
            yield row_batch(cols, keys[:n] if n else np.zeros(0, np.int64), skipped)
    for line in sorted(long_lines):  # the last line, without a line break after it
        long_line(line)
    if state["long"]:
        yield row_batch({c: pa.nulls(0) for c in used}, np.zeros(0, np.int64), state["long"])
    absent = [c for c in used if c not in seen]
    if absent and state["rows"]:
        raise DataError(f"column '{absent[0]}' named by the schema is in no line of the input (a key absent "
                        "from a line is a missing value there; absent from every line, a missing column)", path=path)
