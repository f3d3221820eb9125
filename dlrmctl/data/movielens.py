"""MovieLens ratings -> click-style columnar shards + ``meta.json`` (the format of
:mod:`dlrmctl.data.columnar`, read by the same loader as Criteo).

Releases, detected by their files (Harper & Konstan, "The MovieLens Datasets: History and
Context", ACM TiiS 5(4):19, 2015; each release's README describes its files):

* ``ml-100k``: ``u.data`` (``user \\t item \\t rating \\t timestamp``), ``u.item``
  (``|``-separated: id, title, release date, video date, IMDb URL, 19 genre flags),
  ``u.user`` (``id|age|gender|occupation|zip``), optional ``u.genre``.  latin-1.
* ``ml-1m`` layout (also ml-10m): ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``),
  ``movies.dat`` (``MovieID::Title::Genres``; titles contain single ``:``), optional
  ``users.dat`` (``UserID::Gender::Age::Occupation::Zip-code``) and ``tags.dat``
  (``UserID::MovieID::Tag::Timestamp``).  latin-1 (movies.dat has non-UTF-8 bytes).
* ``ml-latest`` layout (ml-latest-small, ml-20m, ml-25m, ml-latest): ``ratings.csv``,
  ``movies.csv``, optional ``tags.csv``, each with a header row; CRLF or LF; standard CSV
  quoting in every file, header included (``"..."``, a ``"`` inside doubled: what Python's
  ``csv`` module writes with any ``quoting``, e.g. ``QUOTE_ALL`` / ``QUOTE_NONNUMERIC``, and
  pandas' ``to_csv``).  The TAB / ``::`` files of ml-100k / ml-1m have no quoting (a ``"`` there
  is part of the field, e.g. of a title).
  UTF-8 (a file that is not valid UTF-8 is read as latin-1 and says so in meta).

Every rated movie must be in the movies file and every rater in the users file (when there
is one); a file with the wrong number of fields, a non-number, a rating outside ``(0, 5]``,
a wrong header or a duplicated id is a :class:`~dlrmctl.data.columnar.DataError`
``path:line: [field X:] problem``.

Task and split:

* label: ``1.0`` if ``rating >= positive_threshold`` (default 4) else ``0.0``.
* split (per user, by time, so evaluation never looks into a user's future): each user's
  ratings are ordered by ``(timestamp, movie id)``; the last ``floor(n * test_ratio)`` go to
  ``test``, the ``floor(n * val_ratio)`` before them to ``val``, the rest to ``train``
  (the "leave-last-out" protocol of e.g. He et al., "Neural Collaborative Filtering", 2017,
  generalised to ratios).  Hence no val/test rating of a user is older than any of that
  user's train ratings.  Rows of each split are written in ``(timestamp, user, item)`` order.

Features (sparse ids are int64 in ``[0, num_embeddings)``; a categorical's unknown value has
the last id, ``missing_id``, as in Criteo):

* ``user_id``, ``item_id``: rank of the raw id among the sorted raw ids (users: those with
  ratings; items: every movie of the movies file).  Vocabularies in ``vocab/<name>.arrow``
  (``value`` raw id int64, ``count`` train ratings int64; row ``i`` is id ``i``).
* ``genres`` (multi-hot): the movie's genres (``(no genres listed)`` -> empty bag).
* ``tags`` (multi-hot, releases with a tags file): the movie's distinct tags (lower-cased,
  whitespace collapsed) among tag events that are *train-visible* (timestamp <= the tagging
  user's last train rating), kept when seen in >= ``min_tag_count`` such events, at most
  ``max_tags_per_item`` per movie (most frequent first).
* ``gender``, ``age``, ``occupation``, ``zip_prefix`` (releases with a users file): ml-100k
  ages are bucketed into ml-1m's age codes (1, 18, 25, 35, 45, 50, 56); ``zip_prefix`` is the
  first ``zip_prefix_len`` characters of the zip code, upper-cased.
* dense float32, every statistic computed from the TRAIN split only:
  ``item_popularity = log(1 + train ratings of the item)``,
  ``user_activity = log(1 + train ratings of the user)``,
  ``release_year = (year - mean) / std`` (mean / std over train rows with a known year; unknown
  -> 0), ``years_since_release = log(1 + max(0, year of the rating - release year))`` (unknown
  release year -> the train mean year).

String vocabularies are in ``meta["vocabularies"]``; every transform is in
``meta["transforms"]``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from dlrmctl.data.columnar import (
    FORMAT_VERSION,
    LABEL_COLUMN,
    SPLITS,
    check_split_ratios,
    DataError,
    ShardWriter,
    shard_schema,
    write_meta,
)
from dlrmctl.errors import quoted

__all__ = [
    "DENSE_FEATURES",
    "MovieLensData",
    "MovieLensOptions",
    "MovieLensReport",
    "detect_release",
    "preprocess_movielens",
    "read_movielens",
    "time_ordered_split",
]

DENSE_FEATURES = ["item_popularity", "user_activity", "release_year", "years_since_release"]
ML100K_GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
]
ML1M_AGE_CODES = (1, 18, 25, 35, 45, 50, 56)
NO_GENRES = "(no genres listed)"
CHUNK_ROWS = 1 << 20
_YEAR_IN_TITLE = re.compile(r"\((\d{4})(?:[-\u2013]\d{0,4})?\)\s*$")
_CSV_HEADERS = {
    "ratings.csv": ["userId", "movieId", "rating", "timestamp"],
    "movies.csv": ["movieId", "title", "genres"],
    "tags.csv": ["userId", "movieId", "tag", "timestamp"],
}


# =============================================================================== options / data
@dataclasses.dataclass
class MovieLensOptions:
    """Options of :func:`preprocess_movielens` (semantics in the module docstring).

    Attributes:
        positive_threshold: ratings ``>=`` this (stars) are positives.
        val_ratio, test_ratio: fraction of each user's most recent ratings for val / test.
        min_tag_count: a tag enters the vocabulary when seen in this many train-visible events.
        max_tags_per_item: cap of a movie's tag bag.
        zip_prefix_len: characters of the zip code kept.
    """

    positive_threshold: float = 4.0
    val_ratio: float = 0.1
    test_ratio: float = 0.1
    min_tag_count: int = 2
    max_tags_per_item: int = 16
    zip_prefix_len: int = 3

    def validate(self) -> None:
        """Raise ValueError naming the CLI option when an option is out of range."""
        if not 0.0 < self.positive_threshold <= 5.0:
            raise ValueError(f"--positive-threshold must be in (0, 5] stars, got {self.positive_threshold}")
        check_split_ratios(self.val_ratio, self.test_ratio)
        if self.min_tag_count < 1:
            raise ValueError(f"--min-tag-count must be >= 1, got {self.min_tag_count}")
        if self.max_tags_per_item < 1:
            raise ValueError(f"--max-tags-per-item must be >= 1, got {self.max_tags_per_item}")
        if self.zip_prefix_len < 1:
            raise ValueError(f"--zip-prefix-len must be >= 1, got {self.zip_prefix_len}")


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


@dataclasses.dataclass
class MovieLensReport:
    """What :func:`preprocess_movielens` wrote.

    Attributes:
        out_dir: the output directory.
        release: detected release layout.
        rows: rows per split.
        ctr: positive rate per split.
        seconds: wall time.
    """

    out_dir: Path
    release: str
    rows: dict[str, int]
    ctr: dict[str, float | None]
    seconds: float


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


# =============================================================================== parsing helpers
def _decode(path: Path, encoding: str) -> tuple[str, str]:
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


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its CR/LF)`` for non-blank lines."""
    for i, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if line.strip():
            yield i, line


def _int(v: str, path: Path, line: int, field: str) -> int:
    try:
        return int(v.strip())
    except ValueError:
        raise DataError(f"expected an integer, got {quoted(v)}", path=path, line=line, field=field) from None


def _split_exact(line: str, sep: str, n: int, path: Path, lineno: int, what: str) -> list[str]:
    parts = line.split(sep)
    if len(parts) != n:
        raise DataError(f"expected {n} {sep!r}-separated fields ({what}), got {len(parts)}: {quoted(line)}",
                        path=path, line=lineno)
    return parts


def _split_dat3(line: str, path: Path, lineno: int, what: str) -> tuple[str, str, str]:
    """``a::middle::c`` where only ``middle`` may contain ``:`` (even ``::``-adjacent ones)."""
    if line.count("::") < 2:
        raise DataError(f"expected 3 '::'-separated fields ({what}), got {line.count('::') + 1}: {quoted(line)}",
                        path=path, line=lineno)
    a, rest = line.split("::", 1)
    mid, c = rest.rsplit("::", 1)
    return a, mid, c


def _csv_data_rows(path: Path) -> tuple[Iterator[tuple[int, list[str]]], str]:
    """``(iterator of (line number, fields) of the data rows, encoding)`` of a UTF-8 CSV release file.

    Quoted fields may span lines (line numbers are those of the row's first line);
    the header (line 1) is checked, blank lines are skipped.

    Raises:
        DataError: undecodable file or a header that does not match the file name.
    """
    text, enc = _decode(path, "utf-8")

    def rows() -> Iterator[tuple[int, list[str]]]:
        reader = csv.reader(io.StringIO(text, newline=""))
        prev = 0
        for row in reader:
            lineno = prev + 1
            prev = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if lineno == 1:
                _check_csv_header(path, row, lineno)
                continue
            yield lineno, row

    return rows(), enc


def _check_csv_header(path: Path, row: list[str], lineno: int) -> None:
    expect = _CSV_HEADERS[path.name]
    got = [c.strip() for c in row]
    if got != expect:
        owner = next((n for n, h in _CSV_HEADERS.items() if h == got), None)
        hint = f" (that is the header of {owner}: files mixed up?)" if owner else ""
        raise DataError(f"expected the header {','.join(expect)}, got {','.join(got)!r}{hint}", path=path, line=lineno)


# --------------------------------------------------------------------------- ratings
def _scan_ratings(path: Path, sep: str, header: bool) -> None:
    """Slow path: find and raise the first bad line of a ratings file (after a fast-path failure)."""
    names = ("userId", "movieId", "rating", "timestamp")
    if header:  # CSV: quoted fields (csv.QUOTE_ALL / QUOTE_NONNUMERIC writers) read like the fast path
        rows: Iterator[tuple[int, list[str]]] = _csv_data_rows(path)[0]
    else:
        rows = ((lineno, line.split(sep)) for lineno, line in _lines(_decode(path, "latin-1")[0]))
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
                x = _int(v, path, lineno, name)
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
        _check_csv_header(path, next(csv.reader([first])), 1)
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


# --------------------------------------------------------------------------- movies
def _year_of_title(title: str) -> int | None:
    m = _YEAR_IN_TITLE.search(title)
    return int(m.group(1)) if m else None


def _add_movie(movies: dict, mid: int, entry: tuple, path: Path, lineno: int, first_line: dict) -> None:
    if mid in movies:
        raise DataError(f"movie id {mid} appears twice (first on line {first_line[mid]})", path=path, line=lineno)
    movies[mid] = entry
    first_line[mid] = lineno


def _read_movies(path: Path, release: str, genre_names: list[str] | None) -> tuple[dict, str]:
    """Movies file -> ``({raw id: (title, genres, year | None)}, encoding)``.

    Raises:
        DataError: wrong field count, non-integer id, bad genre flag, duplicated id, wrong header.
    """
    movies: dict[int, tuple[str, list[str], int | None]] = {}
    first: dict[int, int] = {}
    if release == "ml-latest":
        rows, enc = _csv_data_rows(path)
        for lineno, row in rows:
            if len(row) != 3:
                raise DataError(f"expected 3 comma-separated fields (movieId, title, genres), got {len(row)}: "
                                f"{','.join(row)[:100]!r}", path=path, line=lineno)
            mid = _int(row[0], path, lineno, "movieId")
            genres = [] if row[2].strip() == NO_GENRES else [g for g in row[2].strip().split("|") if g]
            _add_movie(movies, mid, (row[1], genres, _year_of_title(row[1])), path, lineno, first)
        return movies, enc
    text, enc = _decode(path, "latin-1")
    if release == "ml-1m":
        for lineno, line in _lines(text):
            a, title, g = _split_dat3(line, path, lineno, "MovieID, Title, Genres")
            mid = _int(a, path, lineno, "MovieID")
            genres = [] if g.strip() == NO_GENRES else [x for x in g.strip().split("|") if x]
            _add_movie(movies, mid, (title, genres, _year_of_title(title)), path, lineno, first)
        return movies, enc
    names = genre_names or ML100K_GENRES
    n = 5 + len(names)
    for lineno, line in _lines(text):
        parts = _split_exact(line, "|", n, path, lineno,
                             f"id, title, release date, video date, URL, {len(names)} genre flags")
        mid = _int(parts[0], path, lineno, "movie id")
        flags = parts[5:]
        if any(f not in ("0", "1") for f in flags):
            bad = next(i for i, f in enumerate(flags) if f not in ("0", "1"))
            raise DataError(f"genre flag must be 0 or 1, got {flags[bad]!r}", path=path, line=lineno,
                            field=names[bad])
        genres = [g for g, f in zip(names, flags) if f == "1"]
        date = parts[2].strip()
        year = int(date[-4:]) if re.fullmatch(r"\d{1,2}-[A-Za-z]{3}-\d{4}", date) else _year_of_title(parts[1])
        _add_movie(movies, mid, (parts[1], genres, year), path, lineno, first)
    return movies, enc


def _read_genre_names(path: Path) -> list[str]:
    """ml-100k ``u.genre`` (``name|index``) -> names in index order."""
    text, _ = _decode(path, "latin-1")
    out: dict[int, str] = {}
    for lineno, line in _lines(text):
        name, idx = _split_exact(line, "|", 2, path, lineno, "genre, index")
        out[_int(idx, path, lineno, "index")] = name
    if sorted(out) != list(range(len(out))):
        raise DataError(f"genre indices must be 0..{len(out) - 1}, got {sorted(out)}", path=path)
    return [out[i] for i in range(len(out))]


# --------------------------------------------------------------------------- users
def _age_code(age: int) -> int:
    """Age in years -> ml-1m age group code (README of ml-1m: 1 '<18', 18 '18-24', ... 56 '56+')."""
    code = ML1M_AGE_CODES[0]
    for c in ML1M_AGE_CODES[1:]:
        if age >= c:
            code = c
    return code


def _read_users(path: Path, release: str) -> dict[int, dict[str, Any]]:
    """Users file -> ``{raw id: {gender, age (ml-1m code), occupation, zip}}``.

    Raises:
        DataError: wrong field count, non-integer id / age, gender not M/F, duplicated id.
    """
    text, _ = _decode(path, "latin-1")
    users: dict[int, dict[str, Any]] = {}
    first: dict[int, int] = {}
    for lineno, line in _lines(text):
        if release == "ml-1m":
            uid_s, gender, age_s, occ, zipc = _split_exact(line, "::", 5, path, lineno,
                                                           "UserID, Gender, Age, Occupation, Zip-code")
            age = _int(age_s, path, lineno, "Age")
            if age not in ML1M_AGE_CODES:
                raise DataError(f"age code must be one of {list(ML1M_AGE_CODES)}, got {age}", path=path,
                                line=lineno, field="Age")
            _int(occ, path, lineno, "Occupation")
        else:
            uid_s, age_s, gender, occ, zipc = _split_exact(line, "|", 5, path, lineno,
                                                           "user id, age, gender, occupation, zip")
            age = _age_code(_int(age_s, path, lineno, "age"))
        uid = _int(uid_s, path, lineno, "user id")
        if gender not in ("M", "F"):
            raise DataError(f"gender must be M or F, got {gender!r}", path=path, line=lineno, field="gender")
        if uid in users:
            raise DataError(f"user id {uid} appears twice (first on line {first[uid]})", path=path, line=lineno)
        users[uid] = {"gender": gender, "age": age, "occupation": occ.strip(), "zip": zipc.strip()}
        first[uid] = lineno
    return users


# --------------------------------------------------------------------------- tags
def _read_tags(path: Path, release: str) -> tuple[tuple[np.ndarray, np.ndarray, list[str], np.ndarray], str]:
    """Tags file -> ``((user [m], item [m], tags, timestamp [m]), encoding)``.

    Raises:
        DataError: wrong header / field count, non-integer id or timestamp.
    """
    us, its, tags, tss = [], [], [], []
    if release == "ml-latest":
        rows, enc = _csv_data_rows(path)
        for lineno, row in rows:
            if len(row) != 4:
                raise DataError(f"expected 4 comma-separated fields (userId, movieId, tag, timestamp), got "
                                f"{len(row)}: {','.join(row)[:100]!r}", path=path, line=lineno)
            us.append(_int(row[0], path, lineno, "userId"))
            its.append(_int(row[1], path, lineno, "movieId"))
            tags.append(row[2])
            tss.append(_int(row[3], path, lineno, "timestamp"))
    else:
        text, enc = _decode(path, "latin-1")
        for lineno, line in _lines(text):
            if line.count("::") < 3:
                raise DataError(f"expected 4 '::'-separated fields (UserID, MovieID, Tag, Timestamp): {line[:100]!r}",
                                path=path, line=lineno)
            u, m, rest = line.split("::", 2)
            tag, ts = rest.rsplit("::", 1)
            us.append(_int(u, path, lineno, "UserID"))
            its.append(_int(m, path, lineno, "MovieID"))
            tags.append(tag)
            tss.append(_int(ts, path, lineno, "Timestamp"))
    return (np.asarray(us, dtype=np.int64), np.asarray(its, dtype=np.int64), tags,
            np.asarray(tss, dtype=np.int64)), enc


def _first_line_of_row(path: Path, release: str, row: int) -> int:
    """1-based line of the ``row``-th (0-based) data row of a ratings file (blank lines skipped)."""
    if release == "ml-latest":
        lines: Iterator[int] = (lineno for lineno, _row in _csv_data_rows(path)[0])
    else:
        lines = (lineno for lineno, _line in _lines(_decode(path, "latin-1")[0]))
    for k, lineno in enumerate(lines):
        if k == row:
            return lineno
    return -1  # pragma: no cover - row beyond the file


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
    genre_names = _read_genre_names(files["genres"]) if "genres" in files else None
    movies, enc = _read_movies(files["movies"], release, genre_names)
    encodings[str(files["movies"])] = enc
    known = np.fromiter(movies.keys(), dtype=np.int64, count=len(movies))
    missing = ~np.isin(item, known)
    if missing.any():
        r = int(np.flatnonzero(missing)[0])
        raise DataError(f"movie id {int(item[r])} is not in {files['movies'].name} ({int(missing.sum())} ratings "
                        "refer to unknown movies: files from different releases?)",
                        path=files["ratings"], line=_first_line_of_row(files["ratings"], release, r), field="movieId")
    users = None
    if "users" in files:
        users = _read_users(files["users"], release)
        encodings[str(files["users"])] = "latin-1"
        known_u = np.fromiter(users.keys(), dtype=np.int64, count=len(users))
        missing = ~np.isin(user, known_u)
        if missing.any():
            r = int(np.flatnonzero(missing)[0])
            raise DataError(f"user id {int(user[r])} is not in {files['users'].name} ({int(missing.sum())} ratings "
                            "refer to unknown users: files from different releases?)",
                            path=files["ratings"], line=_first_line_of_row(files["ratings"], release, r),
                            field="userId")
    tags = None
    if "tags" in files:
        tags, enc = _read_tags(files["tags"], release)
        encodings[str(files["tags"])] = enc
    return MovieLensData(release, files, user, item, rating, ts, movies, users, tags, encodings)


# =============================================================================== split
def time_ordered_split(user: np.ndarray, timestamp: np.ndarray, val_ratio: float, test_ratio: float,
                       tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Per-user time-ordered split codes.

    Each user's rows are ordered by ``(timestamp, tiebreak)``; of a user's ``n`` rows the last
    ``floor(n * test_ratio)`` are test (2), the ``floor(n * val_ratio)`` before them val (1),
    the rest train (0).

    Args:
        user: ``[n]`` int64 user ids (any values).
        timestamp: ``[n]`` int64 seconds.
        val_ratio, test_ratio: fractions in ``[0, 1)``.
        tiebreak: ``[n]`` int64 secondary key for equal timestamps (e.g. the item id); default
            the row index.

    Returns:
        ``[n]`` int8 codes (0 train, 1 val, 2 test), in the input row order.
    """
    n = len(user)
    if tiebreak is None:
        tiebreak = np.arange(n, dtype=np.int64)
    order = np.lexsort((tiebreak, timestamp, user))
    us = user[order]
    if n == 0:
        return np.zeros(0, dtype=np.int8)
    starts = np.flatnonzero(np.r_[True, us[1:] != us[:-1]])
    counts = np.diff(np.r_[starts, n])
    pos = np.arange(n) - np.repeat(starts, counts)
    cnt = np.repeat(counts, counts)
    n_test = np.floor(cnt * test_ratio + 1e-9).astype(np.int64)
    n_val = np.floor(cnt * val_ratio + 1e-9).astype(np.int64)
    codes_sorted = np.zeros(n, dtype=np.int8)
    codes_sorted[pos >= cnt - n_test - n_val] = 1
    codes_sorted[pos >= cnt - n_test] = 2
    codes = np.empty(n, dtype=np.int8)
    codes[order] = codes_sorted
    return codes


# =============================================================================== encoding
def _vocab(values: Sequence, key=None) -> dict:
    """Sorted distinct values -> id (0..V-1)."""
    return {v: i for i, v in enumerate(sorted(set(values), key=key))}


def _bags(per_item: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per item lists of ids -> (offsets ``[I+1]`` int64, values ``[sum]`` int64)."""
    lengths = np.fromiter((len(b) for b in per_item), dtype=np.int64, count=len(per_item))
    offsets = np.zeros(len(per_item) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((x for b in per_item for x in b), dtype=np.int64, count=int(offsets[-1]))
    return offsets, values


def _gather_bags(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> pa.Array:
    """Bags of items ``rows [n]`` -> ``list<int64>`` array of ``n`` bags."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    total = int(lengths.sum())
    out_off = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out_off[1:])
    if total:
        idx = np.repeat(starts - out_off[:-1], lengths) + np.arange(total, dtype=np.int64)
        vals = values[idx]
    else:
        vals = np.zeros(0, dtype=np.int64)
    return pa.ListArray.from_arrays(pa.array(out_off, type=pa.int32()), pa.array(vals, type=pa.int64()))


def _norm_tag(t: str) -> str:
    return " ".join(t.lower().split())


def _tag_bags(data: MovieLensData, item_ids: dict[int, int], user_cutoff: dict[int, int], o: MovieLensOptions
              ) -> tuple[list[str], list[list[int]], dict[str, Any]]:
    """Train-visible tags -> (vocabulary, per-item bags of tag ids, stats)."""
    tu, ti, tt, tts = data.tags  # type: ignore[misc]
    events: dict[tuple[int, str], int] = {}
    counts: dict[str, int] = {}
    dropped = 0
    for u, m, tag, t in zip(tu.tolist(), ti.tolist(), tt, tts.tolist()):
        cut = user_cutoff.get(u)
        tag = _norm_tag(tag)
        if cut is None or t > cut or m not in item_ids or not tag:
            dropped += 1
            continue
        counts[tag] = counts.get(tag, 0) + 1
        key = (item_ids[m], tag)
        events[key] = events.get(key, 0) + 1
    vocab_list = sorted(t for t, c in counts.items() if c >= o.min_tag_count)
    vocab = {t: i for i, t in enumerate(vocab_list)}
    per_item: list[list[tuple[int, str]]] = [[] for _ in range(len(item_ids))]
    for (iid, tag), c in events.items():
        if tag in vocab:
            per_item[iid].append((-c, tag))
    bags = [sorted(vocab[t] for _, t in sorted(lst)[: o.max_tags_per_item]) for lst in per_item]
    stats = {"events": len(tu), "train_visible_events": len(tu) - dropped, "distinct_tags": len(counts),
             "vocabulary": len(vocab_list), "items_with_tags": sum(1 for b in bags if b)}
    return vocab_list, bags, stats


# =============================================================================== main entry
def preprocess_movielens(input_dir: str | Path, out_dir: str | Path, options: MovieLensOptions | None = None,
                         progress: Callable[[str], None] | None = None) -> MovieLensReport:
    """Preprocess a MovieLens release into ``out_dir`` (columnar shards + meta.json).

    Writes ``OUT/parts/movielens/{train,val,test}.arrow``, ``OUT/vocab/{user_id,item_id}.arrow``
    and ``OUT/meta.json`` (format of :mod:`dlrmctl.data.columnar`; features and transforms in
    the module docstring).

    Args:
        input_dir: unpacked release (ml-100k, ml-1m, ml-10m, ml-latest-small, ml-20m, ml-25m).
        out_dir: output directory (created; files of a previous run are replaced).
        options: :class:`MovieLensOptions` (defaults: threshold 4, val 0.1, test 0.1).
        progress: called with one line per finished stage (read, features, shards written).

    Returns:
        :class:`MovieLensReport`.

    Raises:
        ValueError: an option out of range (names the CLI option).
        DataError: unreadable / mixed-up / malformed input (names file and line).
    """
    t0 = time.perf_counter()
    o = dataclasses.replace(options) if options is not None else MovieLensOptions()
    o.validate()
    say = progress or (lambda msg: None)
    data = read_movielens(input_dir)
    say(f"movielens: read {data.release}: {len(data.rating):,} ratings of {len(data.movies):,} movies "
        f"({time.perf_counter() - t0:.1f} s)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # ---- ids
    raw_users = np.unique(data.user)
    raw_items = np.asarray(sorted(data.movies), dtype=np.int64)
    uid = np.searchsorted(raw_users, data.user)
    iid = np.searchsorted(raw_items, data.item)
    item_ids = {int(m): i for i, m in enumerate(raw_items.tolist())}
    n_users, n_items = len(raw_users), len(raw_items)

    # ---- label / split
    label = (data.rating >= o.positive_threshold).astype(np.float32)
    codes = time_ordered_split(uid, data.timestamp, o.val_ratio, o.test_ratio, tiebreak=data.item)
    train = codes == 0
    if not train.any():
        raise DataError("the train split is empty (too few ratings per user for these ratios)", path=input_dir)

    # ---- dense features (train statistics only)
    item_cnt = np.bincount(iid[train], minlength=n_items)
    user_cnt = np.bincount(uid[train], minlength=n_users)
    years = np.array([np.nan if data.movies[int(m)][2] is None else data.movies[int(m)][2] for m in raw_items],
                     dtype=np.float64)
    row_year = years[iid]
    known = train & ~np.isnan(row_year)
    year_mean = float(row_year[known].mean()) if known.any() else 2000.0
    year_std = float(row_year[known].std()) if known.sum() > 1 else 1.0
    year_std = year_std if year_std > 0 else 1.0
    rating_year = data.timestamp.astype("datetime64[s]").astype("datetime64[Y]").astype(np.int64) + 1970
    filled_year = np.where(np.isnan(row_year), year_mean, row_year)
    dense = {
        "item_popularity": np.log1p(item_cnt[iid].astype(np.float64)),
        "user_activity": np.log1p(user_cnt[uid].astype(np.float64)),
        "release_year": np.where(np.isnan(row_year), 0.0, (row_year - year_mean) / year_std),
        "years_since_release": np.log1p(np.maximum(rating_year - filled_year, 0.0)),
    }
    dense = {k: v.astype(np.float32) for k, v in dense.items()}

    # ---- sparse features
    sparse: dict[str, np.ndarray] = {"user_id": uid.astype(np.int64), "item_id": iid.astype(np.int64)}
    num_emb: dict[str, int] = {"user_id": n_users, "item_id": n_items}
    missing_id: dict[str, int] = {}
    vocabularies: dict[str, list] = {}
    multi: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    transforms_sparse: dict[str, Any] = {
        "user_id": {"rule": "rank of the raw userId among the sorted raw ids of users with ratings",
                    "vocab_file": "vocab/user_id.arrow"},
        "item_id": {"rule": "rank of the raw movieId among the sorted raw ids of the movies file",
                    "vocab_file": "vocab/item_id.arrow"},
    }
    genre_vocab = _vocab(g for m in raw_items.tolist() for g in data.movies[m][1])
    multi["genres"] = _bags([sorted(genre_vocab[g] for g in set(data.movies[m][1])) for m in raw_items.tolist()])
    num_emb["genres"] = max(len(genre_vocab), 1)
    vocabularies["genres"] = list(genre_vocab)
    transforms_sparse["genres"] = {"rule": "bag of the movie's genres; id = rank in meta.vocabularies.genres",
                                   "empty_bag": NO_GENRES if data.release != "ml-100k" else "no flag set"}

    tag_stats = None
    if data.tags is not None and len(data.tags[0]):
        cutoff_ts = np.full(n_users, -1, dtype=np.int64)
        np.maximum.at(cutoff_ts, uid[train], data.timestamp[train])
        user_cutoff = {int(raw_users[u]): int(c) for u, c in enumerate(cutoff_ts.tolist()) if c >= 0}
        tag_vocab, tag_bags, tag_stats = _tag_bags(data, item_ids, user_cutoff, o)
        if tag_vocab:
            multi["tags"] = _bags(tag_bags)
            num_emb["tags"] = len(tag_vocab)
            vocabularies["tags"] = tag_vocab
            transforms_sparse["tags"] = {
                "rule": "bag of the movie's distinct normalised tags (lower case, single spaces)",
                "train_visible": "tag event timestamp <= the tagging user's last train rating",
                "min_tag_count": o.min_tag_count, "max_tags_per_item": o.max_tags_per_item,
                "stats": tag_stats}

    if data.users is not None:
        rows_u = [data.users[int(u)] for u in raw_users.tolist()]
        for name, get, rule in (
            ("gender", lambda r: r["gender"], "M/F"),
            ("age", lambda r: r["age"], "ml-1m age group code (1,18,25,35,45,50,56); ml-100k years bucketed"),
            ("occupation", lambda r: r["occupation"], "occupation code / name of the users file"),
            ("zip_prefix", lambda r: r["zip"][: o.zip_prefix_len].upper(), f"first {o.zip_prefix_len} characters"),
        ):
            vals = [get(r) for r in rows_u]
            all_vals = [get(r) for r in data.users.values()]
            voc = _vocab([v for v in all_vals if v != ""], key=lambda v: (isinstance(v, str), v))
            miss = len(voc)
            per_user = np.array([voc.get(v, miss) for v in vals], dtype=np.int64)
            sparse[name] = per_user[uid]
            num_emb[name] = miss + 1
            missing_id[name] = miss
            vocabularies[name] = list(voc)
            transforms_sparse[name] = {"rule": f"{rule}; id = rank in meta.vocabularies.{name}",
                                       "missing_id": miss}

    sparse_names = list(sparse) + list(multi)
    schema = shard_schema(DENSE_FEATURES, sparse_names, [False] * len(sparse) + [True] * len(multi))

    say(f"movielens: split and features done ({time.perf_counter() - t0:.1f} s); writing shards")
    # ---- write shards (rows of each split in (timestamp, user, item) order)
    splits_meta, rows, ctr = {}, {}, {}
    pooling: dict[str, dict[str, float]] = {}
    for code, split in enumerate(SPLITS):
        idx = np.flatnonzero(codes == code)
        idx = idx[np.lexsort((iid[idx], uid[idx], data.timestamp[idx]))]
        rel = f"parts/movielens/{split}.arrow"
        w = ShardWriter(out / rel, schema)
        try:
            for s in range(0, len(idx), CHUNK_ROWS):
                r = idx[s: s + CHUNK_ROWS]
                cols: dict[str, Any] = {LABEL_COLUMN: label[r]}
                cols.update({k: v[r] for k, v in dense.items()})
                cols.update({k: v[r] for k, v in sparse.items()})
                cols.update({k: _gather_bags(off, val, iid[r]) for k, (off, val) in multi.items()})
                w.write(cols)
        except BaseException:
            w.abort()
            raise
        w.close()
        splits_meta[split] = {"rows": int(len(idx)), "files": [rel]}
        rows[split] = int(len(idx))
        ctr[split] = float(label[idx].mean()) if len(idx) else None
    for name, (off, _val) in multi.items():
        lens = np.diff(off)[iid]
        pooling[name] = {"mean": float(lens[train].mean()), "max": int(lens.max()) if len(lens) else 0}

    # ---- vocab files for the raw ids
    for name, raw, cnt in (("user_id", raw_users, user_cnt), ("item_id", raw_items, item_cnt)):
        vw = ShardWriter(out / "vocab" / f"{name}.arrow",
                         pa.schema([pa.field("value", pa.int64(), nullable=False),
                                    pa.field("count", pa.int64(), nullable=False)]))
        vw.write({"value": raw.astype(np.int64), "count": cnt.astype(np.int64)})
        vw.close()

    sparse_meta = []
    for name in sparse_names:
        is_multi = name in multi
        entry: dict[str, Any] = {
            "name": name, "num_embeddings": int(num_emb[name]), "multi_hot": is_multi,
            "mean_pooling_factor": pooling[name]["mean"] if is_multi else 1.0,
            "max_pooling_factor": pooling[name]["max"] if is_multi else 1,
        }
        if name in missing_id:
            entry["missing_id"] = missing_id[name]
        sparse_meta.append(entry)

    transforms = {
        "label": {"rule": f"1.0 if rating >= {o.positive_threshold} else 0.0",
                  "positive_threshold": o.positive_threshold},
        "split": {"mode": "per_user_time", "val_ratio": o.val_ratio, "test_ratio": o.test_ratio,
                  "rule": "each user's ratings ordered by (timestamp, movieId): last floor(n*test_ratio) -> test, "
                          "the floor(n*val_ratio) before -> val, rest -> train",
                  "source": "leave-last-out protocol (He et al. 2017, Neural Collaborative Filtering), as ratios"},
        "dense": {
            "item_popularity": {"formula": "log(1 + number of train ratings of the item)", "computed_on": "train"},
            "user_activity": {"formula": "log(1 + number of train ratings of the user)", "computed_on": "train"},
            "release_year": {"formula": "(year - mean) / std; unknown year -> 0", "mean": year_mean, "std": year_std,
                             "year_source": "release date (ml-100k) or '(YYYY)' at the end of the title",
                             "computed_on": "train rows with a known year"},
            "years_since_release": {"formula": "log(1 + max(0, UTC year of the rating - release year)); "
                                               "unknown release year -> mean", "mean_year": year_mean},
            "dtype": "float32",
        },
        "sparse": transforms_sparse,
    }
    elapsed = time.perf_counter() - t0
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": "movielens",
        "release": data.release,
        "dense_features": list(DENSE_FEATURES),
        "sparse_features": sparse_meta,
        "label": LABEL_COLUMN,
        "splits": splits_meta,
        "ctr": ctr,
        "transforms": transforms,
        "vocab_files": {"user_id": "vocab/user_id.arrow", "item_id": "vocab/item_id.arrow"},
        "vocabularies": vocabularies,
        "inputs": {role: str(p) for role, p in data.files.items()},
        "encodings": data.encodings,
        "num_users": n_users,
        "num_items": n_items,
        "num_ratings": int(len(data.user)),
        "seconds": elapsed,
    }
    write_meta(out, meta)
    return MovieLensReport(out, data.release, rows, ctr, elapsed)
