"""The text of MovieLens release files: decoding (UTF-8 with a latin-1 fallback), numbered lines,
fields split at TAB / ``|`` / ``::``, and the CSV files of the ml-latest layout (quoting, headers).
Every failure is a :class:`~dlrmctl.data.columnar.DataError` ``path:line: [field X:] problem``."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Iterator

from dlrmctl.data.columnar import DataError
from dlrmctl.errors import quoted

__all__ = ["CSV_HEADERS", "check_csv_header", "csv_data_rows", "decode_text", "parse_int", "split_dat3",
           "split_exact", "text_lines"]

CSV_HEADERS = {
    "ratings.csv": ["userId", "movieId", "rating", "timestamp"],
    "movies.csv": ["movieId", "title", "genres"],
    "tags.csv": ["userId", "movieId", "tag", "timestamp"],
}


def decode_text(path: Path, encoding: str) -> tuple[str, str]:
    """Whole file as text; ``encoding='utf-8'`` falls back to latin-1 on invalid bytes."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if encoding == "utf-8":
        try:
            return raw.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            return raw.decode("latin-1"), "latin-1 (not valid UTF-8)"
    return raw.decode(encoding), encoding


def text_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its CR/LF)`` for non-blank lines."""
    for i, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if line.strip():
            yield i, line


def parse_int(v: str, path: Path, line: int, field: str) -> int:
    try:
        return int(v.strip())
    except ValueError:
        raise DataError(f"expected an integer, got {quoted(v)}", path=path, line=line, field=field) from None


def split_exact(line: str, sep: str, n: int, path: Path, lineno: int, what: str) -> list[str]:
    parts = line.split(sep)
    if len(parts) != n:
        raise DataError(f"expected {n} {sep!r}-separated fields ({what}), got {len(parts)}: {quoted(line)}",
                        path=path, line=lineno)
    return parts


def split_dat3(line: str, path: Path, lineno: int, what: str) -> tuple[str, str, str]:
    """``a::middle::c`` where only ``middle`` may contain ``:`` (even ``::``-adjacent ones)."""
    if line.count("::") < 2:
        raise DataError(f"expected 3 '::'-separated fields ({what}), got {line.count('::') + 1}: {quoted(line)}",
                        path=path, line=lineno)
    a, rest = line.split("::", 1)
    mid, c = rest.rsplit("::", 1)
    return a, mid, c


def csv_data_rows(path: Path) -> tuple[Iterator[tuple[int, list[str]]], str]:
    """``(iterator of (line number, fields) of the data rows, encoding)`` of a UTF-8 CSV release file.

    Quoted fields may span lines (line numbers are those of the row's first line);
    the header (line 1) is checked, blank lines are skipped.

    Raises:
        DataError: undecodable file or a header that does not match the file name.
    """
    text, enc = decode_text(path, "utf-8")

    def rows() -> Iterator[tuple[int, list[str]]]:
        reader = csv.reader(io.StringIO(text, newline=""))
        prev = 0
        for row in reader:
            lineno = prev + 1
            prev = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if lineno == 1:
                check_csv_header(path, row, lineno)
                continue
            yield lineno, row

    return rows(), enc


def check_csv_header(path: Path, row: list[str], lineno: int) -> None:
    expect = CSV_HEADERS[path.name]
    got = [c.strip() for c in row]
    if got != expect:
        owner = next((n for n, h in CSV_HEADERS.items() if h == got), None)
        hint = f" (that is the header of {owner}: files mixed up?)" if owner else ""
        raise DataError(f"expected the header {','.join(expect)}, got {','.join(got)!r}{hint}", path=path, line=lineno)
