"""Detecting a MovieLens release by its files and reading it whole (:func:`read_movielens`): the
ratings (a typed ``pyarrow.csv`` fast path, a line-by-line scan naming the first bad line), then
the side files of :mod:`dlrmctl.data.movielens.side_files`, every rated movie and rater checked."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from dlrmctl.data.columnar import DataError
from dlrmctl.data.movielens.side_files import read_genre_names, read_movies, read_tags, read_users
from dlrmctl.data.movielens.text import check_csv_header, csv_data_rows, decode_text, parse_int, text_lines

__all__ = ["MovieLensData", "detect_release", "read_movielens"]


@dataclasses.dataclass
class MovieLensData:
    """One release, parsed (raw ids, not yet encoded).

    Attributes:
        release: ``"ml-100k"``, ``"ml-1m"`` (also ml-10m) or ``"ml-latest"`` (csv releases).
        files: role (``ratings``, ``movies``, ``users``, ``tags``) -> path read.
        user, item: ``[n]`` int64 raw ids of the ratings.
        rating: ``[n]`` float32 stars.
        timestamp: ``[n]`` int64 Unix seconds (UTC).
        movies: raw movie id -> ``(title, [genre, ...], year or None)``.
        users: raw user id -> ``{"gender", "age", "occupation", "zip"}`` (strings / int age code),
            or None when the release has no users file.
        tags: ``(user [m] int64, item [m] int64, tag list[str] of m, timestamp [m] int64)`` or None.
        encodings: path -> encoding used to decode it.
    """

    release: str
    files: dict[str, Path]
    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    movies: dict[int, tuple[str, list[str], int | None]]
    users: dict[int, dict[str, Any]] | None
    tags: tuple[np.ndarray, np.ndarray, list[str], np.ndarray] | None
    encodings: dict[str, str]



# =============================================================================== detection
def detect_release(input_dir: str | Path) -> tuple[str, dict[str, Path]]:
    """Which MovieLens release layout ``input_dir`` holds, by its files.

    Args:
        input_dir: an unpacked MovieLens directory.

    Returns:
        ``(release, files)``: release ``"ml-100k"`` | ``"ml-1m"`` | ``"ml-latest"`` and the
        files to read by role (``ratings``, ``movies``, optional ``users``, ``tags``).

    Raises:
        DataError: the directory does not exist; no ratings file; several layouts mixed in one
            directory; or the movies (ml-100k: users) file of the layout is missing.
    """
    d = Path(input_dir)
    if not d.is_dir():
        raise DataError("not a directory (expected an unpacked MovieLens release)", path=d)
    layouts = {
        "ml-100k": "u.data",
        "ml-1m": "ratings.dat",
        "ml-latest": "ratings.csv",
    }
    found = [r for r, f in layouts.items() if (d / f).is_file()]
    if len(found) > 1:
        raise DataError("mixed MovieLens releases in one directory: found "
                        + ", ".join(layouts[r] for r in found) + "; keep one release per directory", path=d)
    if not found:
        present = sorted(p.name for p in d.iterdir())[:12]
        hint = ""
        if (d / "movies.dat").is_file():
            hint = " (movies.dat is here but ratings.dat is not: an incomplete ml-1m copy?)"
        raise DataError("no MovieLens ratings file: expected u.data (ml-100k), ratings.dat (ml-1m/ml-10m) "
                        f"or ratings.csv (ml-latest-small/ml-20m/ml-25m){hint}; found {present}", path=d)
    release = found[0]
    names = {
        "ml-100k": {"ratings": "u.data", "movies": "u.item", "users": "u.user", "genres": "u.genre"},
        "ml-1m": {"ratings": "ratings.dat", "movies": "movies.dat", "users": "users.dat", "tags": "tags.dat"},
        "ml-latest": {"ratings": "ratings.csv", "movies": "movies.csv", "tags": "tags.csv"},
    }[release]
    required = {"ratings", "movies"} | ({"users"} if release == "ml-100k" else set())
    files = {}
    for role, name in names.items():
        p = d / name
        if p.is_file():
            files[role] = p
        elif role in required:
            raise DataError(f"{release} layout ({names['ratings']} found) needs {name}, which is missing", path=d)
    return release, files



# --------------------------------------------------------------------------- ratings
def _scan_ratings(path: Path, sep: str, header: bool) -> None:
    """Slow path: find and raise the first bad line of a ratings file (after a fast-path failure)."""
    names = ("userId", "movieId", "rating", "timestamp")
    if header:  # CSV: quoted fields (csv.QUOTE_ALL / QUOTE_NONNUMERIC writers) read like the fast path
        rows: Iterator[tuple[int, list[str]]] = csv_data_rows(path)[0]
    else:
        rows = ((lineno, line.split(sep)) for lineno, line in text_lines(decode_text(path, "latin-1")[0]))
    for lineno, parts in rows:
        line = sep.join(parts)
        if len(parts) != 4:
            raise DataError(f"expected 4 {sep!r}-separated fields (userId, movieId, rating, timestamp), got "
                            f"{len(parts)}: {line[:100]!r}", path=path, line=lineno)
        for name, v in zip(names, parts):
            if name == "rating":
                try:
                    r = float(v)
                except ValueError:
                    raise DataError(f"expected a number, got {v!r}", path=path, line=lineno, field=name) from None
                if not 0.0 < r <= 5.0:
                    raise DataError(f"rating {v} is outside (0, 5] stars", path=path, line=lineno, field=name)
            else:
                x = parse_int(v, path, lineno, name)
                if x < 0:
                    raise DataError(f"must be >= 0, got {x}", path=path, line=lineno, field=name)


def _read_ratings(path: Path, release: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ratings file -> ``(user int64 [n], item int64 [n], rating float32 [n], timestamp int64 [n])``.

    Fast path: ``pyarrow.csv`` with typed columns (``::`` is rewritten to TAB first, ratings
    are numeric); any failure or out-of-range value re-reads the file line by line to name the
    first bad line.

    Raises:
        DataError: ``path:line: [field X:] problem``.
    """
    header = release == "ml-latest"
    sep = {"ml-100k": "\t", "ml-1m": "::", "ml-latest": ","}[release]
    names = ["userId", "movieId", "rating", "timestamp"]
    types = {"userId": pa.int64(), "movieId": pa.int64(), "rating": pa.float64(), "timestamp": pa.int64()}
    raw = path.read_bytes()
    if header:
        first = raw.split(b"\n", 1)[0].decode("utf-8", "replace").lstrip("\ufeff").rstrip("\r")
        check_csv_header(path, next(csv.reader([first])), 1)
    if release == "ml-1m":
        raw = raw.replace(b"::", b"\t")
    try:
        table = pa_csv.read_csv(
            pa.BufferReader(raw),
            read_options=pa_csv.ReadOptions(column_names=None if header else names, skip_rows=0,
                                            use_threads=False, block_size=16 << 20),
            # CSV quoting (RFC 4180: "..." with "" inside) in ratings.csv; none in the TAB / '::' files
            parse_options=pa_csv.ParseOptions(delimiter="," if header else "\t",
                                              quote_char='"' if header else False, double_quote=True),
            convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                                  quoted_strings_can_be_null=False),
        )
        if table.column_names != names:
            raise pa.ArrowInvalid(f"columns {table.column_names}")
        user = table["userId"].to_numpy()
        item = table["movieId"].to_numpy()
        rating = table["rating"].to_numpy()
        ts = table["timestamp"].to_numpy()
        if table.num_rows == 0:
            raise DataError("no ratings", path=path)
        ok = bool((rating > 0).all() and (rating <= 5).all() and (user >= 0).all() and (item >= 0).all()
                  and (ts >= 0).all())
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        _scan_ratings(path, sep, header)
        raise DataError(f"cannot parse ratings: {e}", path=path) from None
    if not ok:
        _scan_ratings(path, sep, header)
        raise DataError("a rating is outside (0, 5] or an id / timestamp is negative", path=path)
    return user.astype(np.int64), item.astype(np.int64), rating.astype(np.float32), ts.astype(np.int64)


def _first_line_of_row(path: Path, release: str, row: int) -> int:
    """1-based line of the ``row``-th (0-based) data row of a ratings file (blank lines skipped)."""
    if release == "ml-latest":
        lines: Iterator[int] = (lineno for lineno, _row in csv_data_rows(path)[0])
    else:
        lines = (lineno for lineno, _line in text_lines(decode_text(path, "latin-1")[0]))
    for k, lineno in enumerate(lines):
        if k == row:
            return lineno
    return -1  # pragma: no cover - row beyond the file


def _check_known(ids: np.ndarray, known: dict, kind: str, side: Path, field: str, ratings: Path, release: str) -> None:
    """Raise DataError naming the first ratings line whose ``field`` id (``ids`` [N] int64, one per
    rating) is not a key of ``known`` (the ids the ``side`` file describes)."""
    missing = ~np.isin(ids, np.fromiter(known.keys(), dtype=np.int64, count=len(known)))
    if missing.any():
        r = int(np.flatnonzero(missing)[0])
        raise DataError(f"{kind} id {int(ids[r])} is not in {side.name} ({int(missing.sum())} ratings "
                        f"refer to unknown {kind}s: files from different releases?)",
                        path=ratings, line=_first_line_of_row(ratings, release, r), field=field)


def read_movielens(input_dir: str | Path) -> MovieLensData:
    """Detect and parse one MovieLens release (see the module docstring for the layouts).

    Args:
        input_dir: directory of an unpacked release.

    Returns:
        :class:`MovieLensData` with raw ids.

    Raises:
        DataError: see :func:`detect_release`; a bad line (``path:line: [field X:] ...``); a rated
            movie missing from the movies file or a rater missing from the users file (names the
            ratings line).
    """
    release, files = detect_release(input_dir)
    encodings: dict[str, str] = {}
    user, item, rating, ts = _read_ratings(files["ratings"], release)
    encodings[str(files["ratings"])] = "numeric (encoding-agnostic)"
    genre_names = read_genre_names(files["genres"]) if "genres" in files else None
    movies, enc = read_movies(files["movies"], release, genre_names)
    encodings[str(files["movies"])] = enc
    _check_known(item, movies, "movie", files["movies"], "movieId", files["ratings"], release)
    users = None
    if "users" in files:
        users = read_users(files["users"], release)
        encodings[str(files["users"])] = "latin-1"
        _check_known(user, users, "user", files["users"], "userId", files["ratings"], release)
    tags = None
    if "tags" in files:
        tags, enc = read_tags(files["tags"], release)
        encodings[str(files["tags"])] = enc
    return MovieLensData(release, files, user, item, rating, ts, movies, users, tags, encodings)
