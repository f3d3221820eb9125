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
  user's train ratings.  Rows of each split are written in the ratings file's order.

Features (sparse ids are int64 in ``[0, num_embeddings)``; a categorical's unknown value has
the last id, ``missing_id``, as in Criteo):

* ``user_id``, ``item_id``: rank of the raw id among the sorted raw ids (users: those with
  ratings; items: every movie of the movies file).  Vocabularies in ``vocab/<name>.arrow``
  (``value`` raw id int64, ``count`` train ratings int64; row ``i`` is id ``i``).
* ``genres`` (multi-hot): the movie's genres in the movies file's order, repeats dropped
  (``(no genres listed)`` -> empty bag); ids by genre name.
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
  ``release_year = (year - mean) / std`` (mean / std over train rows with a known year, ``std =
  sqrt(mean(year^2) - mean^2)`` as ``preprocess logs`` computes it; unknown
  -> 0), ``years_since_release = log(1 + max(0, year of the rating - release year))`` (unknown
  release year -> the train mean year).

String vocabularies are in ``meta["vocabularies"]``; every transform is in
``meta["transforms"]``.
"""

from dlrmctl.data.movielens.preprocess import (
    DENSE_FEATURES,
    MovieLensOptions,
    MovieLensReport,
    preprocess_movielens,
    time_ordered_split,
)
from dlrmctl.data.movielens.read import MovieLensData, detect_release, read_movielens

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
