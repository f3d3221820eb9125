"""``predict``'s check of its input before anything slow is imported (no torch, NumPy or pyarrow).

An input of the wrong kind — a directory, an empty file, a Parquet or other binary file where raw
text rows are expected, a text file where Parquet is, rows with another number of fields than the
model's training data, a header without a column the model reads — is one ``error:`` line within
a second, instead of after torch is imported and the model loaded.  It reads the exported model's
``manifest.json`` (its ``preprocessing``: the dataset and, for a schema dataset, the schema) and
the input's first line only; every later line is still checked by the reader itself
(:mod:`dlrmctl.data.criteo.raw_transform`, :mod:`dlrmctl.data.logs.raw_transform`), whose messages
these mirror.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import os
from pathlib import Path

from dlrmctl.errors import UserError, delimiter_hint, quoted

__all__ = ["InputFormatError", "check_predict_input"]

#: the first bytes read of an input (the first line must end within them to be checked)
_HEAD_BYTES = 1 << 20
_PARQUET_MAGIC = b"PAR1"
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
#: Criteo's raw rows: a label, 13 dense and 26 categorical fields, tab-separated (the label may be absent)
_CRITEO_FIELDS = (40, 39)


class InputFormatError(ValueError, UserError):
    """The input file is not of the kind the exported model scores; the message names the file
    (and line) and says what was expected and what was found."""

    def __init__(self, message: str, path: str | os.PathLike, line: int | None = None) -> None:
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


def _manifest(model_dir: Path) -> dict | None:
    """The manifest as a dict; None when it does not parse (``load_exported`` says why later).

    Raises:
        InputFormatError: no manifest at all (not an exported model)."""
    mpath = model_dir / "manifest.json"
    if not mpath.is_file():
        raise InputFormatError(f"not found; {model_dir} is not an exported model (create one with "
                               "`dlrmctl export RUN_DIR`)", mpath)
    try:
        with open(mpath, "rb") as f:
            m = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def _head(path: Path) -> tuple[bytes | None, bool]:
    """``(first bytes, whole)``: up to :data:`_HEAD_BYTES` of the decompressed input (a ``.gz`` /
    ``.bz2`` by its name), ``whole`` when that is all of it; ``(None, False)`` for a compression
    the standard library does not read (``.zst``, ``.lz4``: the reader checks those)."""
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else bz2.open if name.endswith(".bz2") else open
    if name.endswith((".zst", ".lz4")):
        return None, False
    try:
        with opener(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
            return head, not f.read(1)
    except (OSError, EOFError) as e:  # a truncated .gz, a plain file named .gz
        raise InputFormatError(f"cannot be read as {os.path.splitext(name)[1] or 'a file'} (is it complete and of "
                               f"the kind its name says?): {e}", path) from None


def _blank(path: Path, head: bytes, whole: bool) -> bool:
    """No non-blank line in the input (read on past the head only while every line is blank)."""
    if head.strip() or whole:
        return not head.strip()
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else bz2.open if name.endswith(".bz2") else open
    with opener(path, "rb") as f:
        return all(not line.strip() for line in f)


def _first_line(head: bytes, path: Path, expected: str) -> bytes:
    """The first line of a text input (without its line break).

    Raises:
        InputFormatError: binary data (Parquet, NUL bytes, gzip under another name, not UTF-8)."""
    if head.startswith(_BOM):  # a UTF-8 byte order mark is not part of the first field (as the readers read it)
        head = head[len(_BOM):]
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    if head.startswith(_PARQUET_MAGIC):
        found = "a Parquet file"
    elif head.startswith(_GZIP_MAGIC):
        found = "gzip-compressed data (name the file .gz)"
    elif b"\x00" in head[:65536]:
        found = "binary data (NUL bytes)"
    else:
        try:
            line.decode("utf-8")
            return line
        except UnicodeDecodeError:
            found = "binary data (not UTF-8 text)"
    raise InputFormatError(f"{found}, not {expected}", path, 1)


def _split(line: bytes, delimiter: str, path: Path) -> list[str]:
    """The first line's fields (CSV quoting rules).

    Raises:
        InputFormatError: a field the csv module refuses (over its 128 KiB field limit, a stray
            quote), naming the file and line 1."""
    try:
        return next(csv.reader(io.StringIO(line.decode("utf-8")), delimiter=delimiter), [])
    except csv.Error as e:
        raise InputFormatError(f"the first line does not split into fields ({e}); a header or a row of the "
                               "model's columns is expected", path, 1) from None


def _check_criteo(path: Path, head: bytes) -> None:
    line = _first_line(head, path, "raw Criteo rows (40 tab-separated fields: label, 13 dense, 26 categorical; "
                                   "or 39 without the label)")
    nf = line.count(b"\t") + 1
    if nf not in _CRITEO_FIELDS:
        hint = " (the line is comma-separated; Criteo rows are tab-separated)" \
            if line.count(b",") + 1 in _CRITEO_FIELDS else ""
        raise InputFormatError(f"expected 40 or 39 tab-separated fields (label, 13 dense, 26 categorical; the label "
                               f"may be left out), got {nf}{hint}", path, 1)


def _check_logs(path: Path, head: bytes, meta: dict, whole: bool = False) -> None:
    """A schema dataset's input: its format, the columns of its header or first object, or the
    field count of a headerless CSV / TSV (as :meth:`~dlrmctl.data.logs.raw_transform.RawTransformer.file`);
    a header and no row after it (``whole``: ``head`` is all of the input) is an empty input."""
    from dlrmctl.data.logs.schema import LogSchema

    try:
        schema = LogSchema.from_dict(meta["schema"])
    except (KeyError, TypeError, ValueError):
        return  # a manifest the loader refuses, with its own message
    fmt = schema.format_of(path)
    if fmt == "parquet":
        if not head.startswith(_PARQUET_MAGIC):
            what = "text" if _looks_text(head) else "another binary format"
            raise InputFormatError(f"not a Parquet file (it starts as {what}); the model's schema "
                                   f"{schema.name or ''} reads Parquet".replace("  ", " "), path)
        return
    line = _first_line(head, path, f"{fmt.upper()} rows of the model's schema{f' {schema.name}' if schema.name else ''}")
    joined = set(schema.joined_columns())  # brought by the side tables the model carries, by their keys
    dense = [d.extract[0] if d.extract else d.name for d in schema.dense if not (d.count_of or d.years_since)]
    dense += [schema.time] if any(d.years_since for d in schema.dense) else []  # (derived features: data/logs/derived.py)
    need = list(dict.fromkeys([n for n in dense + [c.name for c in schema.categorical]
                               if n not in joined] + [j.key for j in schema.join]))
    allowed = set(schema.named_columns())
    if fmt == "jsonl":
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise InputFormatError(f"not a JSON object: {e}", path, 1) from None
        if not isinstance(obj, dict):
            raise InputFormatError(f"expected a JSON object per line, got a {type(obj).__name__}", path, 1)
        cols = list(obj)
    elif schema.header:
        cols = _split(line, "\t" if fmt == "tsv" else schema.delimiter or ",", path)

    else:
        cols = list(meta.get("input_columns") or schema.columns or [])
        nf = len(_split(line, "\t" if fmt == "tsv" else schema.delimiter or ",", path))
        ok = {len(cols)} | ({len(cols) - 1} if schema.label else set())
        if cols and nf not in ok:
            first_missing = cols[nf] if nf < len(cols) else None
            raise InputFormatError(
                f"expected {len(cols)} {fmt.upper()} fields ({', '.join(cols)})"
                + (f" or {len(cols) - 1} without the label '{schema.label.column}'" if schema.label else "")
                + f", got {nf}" + (f" (the first missing: '{first_missing}')" if first_missing else ""), path, 1)
        return
    missing = [c for c in need if c not in cols]
    if missing and fmt != "jsonl" and not set(cols) & allowed:  # no schema column at all: not its header
        sep = "\t" if fmt == "tsv" else schema.delimiter or ","
        text = line.decode("utf-8", "replace")
        why = (delimiter_hint(text, sep, fmt, "the model's schema")
               or "the file has no header line, or is not this model's log")
        raise InputFormatError(f"the first line is not a header of the model's columns (no column of its schema "
                               f"among the line's {len(cols)} field(s); {why}); expected a header naming "
                               f"{', '.join(need[:6])}{', …' if len(need) > 6 else ''}", path, 1)
    if missing:
        raise InputFormatError(f"column '{missing[0]}' the model reads is not in the file (its columns: "
                               f"{_listing(cols)}; expected {', '.join(need)})", path, 1)
    extra = [c for c in cols if c not in allowed]
    brought = [c for c in extra if schema.join_bringing(c)]
    if brought:
        raise InputFormatError(f"column '{brought[0]}' comes from the model's side table "
                               f"{schema.join_bringing(brought[0])}: raw rows must not carry it (the model looks it "
                               "up by the key); leave it out of the file", path, 1)
    if extra:
        raise InputFormatError(f"column '{extra[0]}' of the file is not named by the model's schema (its columns: "
                               f"{', '.join(sorted(allowed))})", path, 1)
    if fmt != "jsonl" and whole and not any(r.strip() for r in head.split(b"\n")[1:]):
        raise InputFormatError("a header line and no rows after it: no lines to score", path)


def _listing(cols: list[str]) -> str:
    """Column names for a message: joined, or cut (:func:`~dlrmctl.errors.quoted`) when long."""
    text = ", ".join(cols)
    return "none" if not cols else text if len(text) <= 80 else quoted(text)


def _looks_text(head: bytes) -> bool:
    try:
        head[:4096].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in head[:4096]


def check_predict_input(model_dir: str | os.PathLike, input_path: str | os.PathLike) -> None:
    """Refuse an input ``predict`` cannot score, reading only the model's manifest and the input's
    first line (see the module docstring); passes anything the reader must judge itself.

    Raises:
        InputFormatError: no manifest in ``model_dir``; the input missing, a directory, empty (no
            non-blank line, or a schema's header and no row), binary where text rows are expected (or text where Parquet is), rows
            with another field count than the training data, or a header / first JSON object
            without a column the model reads (or with one its schema does not name).
    """
    p = Path(input_path)
    if not p.exists():
        raise InputFormatError("no such file", input_path)
    if p.is_dir():
        raise InputFormatError("is a directory; give one raw log file (--input FILE)", input_path)
    manifest = _manifest(Path(model_dir))
    head, whole = _head(p)
    if head is None:
        return
    if _blank(p, head, whole):
        raise InputFormatError("empty file: no lines to score", input_path)
    pre = (manifest or {}).get("preprocessing")
    if not isinstance(pre, dict):
        return
    if pre.get("dataset") == "criteo":
        _check_criteo(p, head)
    elif pre.get("dataset") == "logs" and isinstance(pre.get("meta"), dict):
        _check_logs(p, head, pre["meta"], whole)
