"""The side files of a MovieLens release: movies (titles, genres, release years), ml-100k's genre
names, users (gender, age group, occupation, zip code) and tags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from dlrmctl.data.columnar import DataError
from dlrmctl.data.movielens.text import csv_data_rows, decode_text, parse_int, split_dat3, split_exact, text_lines

__all__ = ["ML100K_GENRES", "ML1M_AGE_CODES", "NO_GENRES", "read_genre_names", "read_movies", "read_tags",
           "read_users"]

ML100K_GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
]
ML1M_AGE_CODES = (1, 18, 25, 35, 45, 50, 56)
NO_GENRES = "(no genres listed)"
_YEAR_IN_TITLE = re.compile(r"\((\d{4})(?:[-\u2013]\d{0,4})?\)\s*$")


def _year_of_title(title: str) -> int | None:
    m = _YEAR_IN_TITLE.search(title)
    return int(m.group(1)) if m else None


def _check_fields(row: list[str], names: tuple[str, ...], path: Path, lineno: int) -> None:
    """Raise DataError (naming ``path:lineno``) unless the CSV ``row`` has one field per name."""
    if len(row) != len(names):
        raise DataError(f"expected {len(names)} comma-separated fields ({', '.join(names)}), got {len(row)}: "
                        f"{','.join(row)[:100]!r}", path=path, line=lineno)


def _add_movie(movies: dict, mid: int, entry: tuple, path: Path, lineno: int, first_line: dict) -> None:
    if mid in movies:
        raise DataError(f"movie id {mid} appears twice (first on line {first_line[mid]})", path=path, line=lineno)
    movies[mid] = entry
    first_line[mid] = lineno


def read_movies(path: Path, release: str, genre_names: list[str] | None) -> tuple[dict, str]:
    """Movies file -> ``({raw id: (title, genres, year | None)}, encoding)``.

    Raises:
        DataError: wrong field count, non-integer id, bad genre flag, duplicated id, wrong header.
    """
    movies: dict[int, tuple[str, list[str], int | None]] = {}
    first: dict[int, int] = {}
    if release == "ml-latest":
        rows, enc = csv_data_rows(path)
        for lineno, row in rows:
            _check_fields(row, ("movieId", "title", "genres"), path, lineno)
            mid = parse_int(row[0], path, lineno, "movieId")
            genres = [] if row[2].strip() == NO_GENRES else [g for g in row[2].strip().split("|") if g]
            _add_movie(movies, mid, (row[1], genres, _year_of_title(row[1])), path, lineno, first)
        return movies, enc
    text, enc = decode_text(path, "latin-1")
    if release == "ml-1m":
        for lineno, line in text_lines(text):
            a, title, g = split_dat3(line, path, lineno, "MovieID, Title, Genres")
            mid = parse_int(a, path, lineno, "MovieID")
            genres = [] if g.strip() == NO_GENRES else [x for x in g.strip().split("|") if x]
            _add_movie(movies, mid, (title, genres, _year_of_title(title)), path, lineno, first)
        return movies, enc
    names = genre_names or ML100K_GENRES
    n = 5 + len(names)
    for lineno, line in text_lines(text):
        parts = split_exact(line, "|", n, path, lineno,
                             f"id, title, release date, video date, URL, {len(names)} genre flags")
        mid = parse_int(parts[0], path, lineno, "movie id")
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


def read_genre_names(path: Path) -> list[str]:
    """ml-100k ``u.genre`` (``name|index``) -> names in index order."""
    text, _ = decode_text(path, "latin-1")
    out: dict[int, str] = {}
    for lineno, line in text_lines(text):
        name, idx = split_exact(line, "|", 2, path, lineno, "genre, index")
        out[parse_int(idx, path, lineno, "index")] = name
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


def read_users(path: Path, release: str) -> dict[int, dict[str, Any]]:
    """Users file -> ``{raw id: {gender, age (ml-1m code), occupation, zip}}``.

    Raises:
        DataError: wrong field count, non-integer id / age, gender not M/F, duplicated id.
    """
    text, _ = decode_text(path, "latin-1")
    users: dict[int, dict[str, Any]] = {}
    first: dict[int, int] = {}
    for lineno, line in text_lines(text):
        if release == "ml-1m":
            uid_s, gender, age_s, occ, zipc = split_exact(line, "::", 5, path, lineno,
                                                           "UserID, Gender, Age, Occupation, Zip-code")
            age = parse_int(age_s, path, lineno, "Age")
            if age not in ML1M_AGE_CODES:
                raise DataError(f"age code must be one of {list(ML1M_AGE_CODES)}, got {age}", path=path,
                                line=lineno, field="Age")
            parse_int(occ, path, lineno, "Occupation")
        else:
            uid_s, age_s, gender, occ, zipc = split_exact(line, "|", 5, path, lineno,
                                                           "user id, age, gender, occupation, zip")
            age = _age_code(parse_int(age_s, path, lineno, "age"))
        uid = parse_int(uid_s, path, lineno, "user id")
        if gender not in ("M", "F"):
            raise DataError(f"gender must be M or F, got {gender!r}", path=path, line=lineno, field="gender")
        if uid in users:
            raise DataError(f"user id {uid} appears twice (first on line {first[uid]})", path=path, line=lineno)
        users[uid] = {"gender": gender, "age": age, "occupation": occ.strip(), "zip": zipc.strip()}
        first[uid] = lineno
    return users


# --------------------------------------------------------------------------- tags
def read_tags(path: Path, release: str) -> tuple[tuple[np.ndarray, np.ndarray, list[str], np.ndarray], str]:
    """Tags file -> ``((user [m], item [m], tags, timestamp [m]), encoding)``.

    Raises:
        DataError: wrong header / field count, non-integer id or timestamp.
    """
    us, its, tags, tss = [], [], [], []
    if release == "ml-latest":
        rows, enc = csv_data_rows(path)
        for lineno, row in rows:
            _check_fields(row, ("userId", "movieId", "tag", "timestamp"), path, lineno)
            us.append(parse_int(row[0], path, lineno, "userId"))
            its.append(parse_int(row[1], path, lineno, "movieId"))
            tags.append(row[2])
            tss.append(parse_int(row[3], path, lineno, "timestamp"))
    else:
        text, enc = decode_text(path, "latin-1")
        for lineno, line in text_lines(text):
            if line.count("::") < 3:
                raise DataError(f"expected 4 '::'-separated fields (UserID, MovieID, Tag, Timestamp): {line[:100]!r}",
                                path=path, line=lineno)
            u, m, rest = line.split("::", 2)
            tag, ts = rest.rsplit("::", 1)
            us.append(parse_int(u, path, lineno, "UserID"))
            its.append(parse_int(m, path, lineno, "MovieID"))
            tags.append(tag)
            tss.append(parse_int(ts, path, lineno, "Timestamp"))
    return (np.asarray(us, dtype=np.int64), np.asarray(its, dtype=np.int64), tags,
            np.asarray(tss, dtype=np.int64)), enc
