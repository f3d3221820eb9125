"""``preprocess movielens``: the per-user time split, ids, features and shards of a release read by
:func:`dlrmctl.data.movielens.read.read_movielens` (semantics in the package docstring)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

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
from dlrmctl.data.logs.bags import bags_of, normalized
from dlrmctl.data.logs.split import group_cutoffs
from dlrmctl.data.movielens.read import MovieLensData, read_movielens
from dlrmctl.data.movielens.side_files import NO_GENRES

__all__ = ["DENSE_FEATURES", "MovieLensOptions", "MovieLensReport", "preprocess_movielens", "time_ordered_split"]

DENSE_FEATURES = ["item_popularity", "user_activity", "release_year", "years_since_release"]
CHUNK_ROWS = 1 << 20


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


# =============================================================================== split
def time_ordered_split(user: np.ndarray, timestamp: np.ndarray, val_ratio: float, test_ratio: float,
                       tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Per-user time-ordered split codes.

    Each user's rows are ordered by ``(timestamp, tiebreak)``; of a user's ``n`` rows the last
    ``floor(n * test_ratio)`` are test (2), the ``floor(n * val_ratio)`` before them val (1),
    the rest train (0).  The schema path's per-group split computes it
    (:func:`dlrmctl.data.logs.split.group_cutoffs`): one rule for both.

    Args:
        user: ``[n]`` int64 user ids (any values).
        timestamp: ``[n]`` int64 seconds.
        val_ratio, test_ratio: fractions in ``[0, 1)``.
        tiebreak: ``[n]`` int64 secondary key for equal timestamps (e.g. the item id); default
            the row index.  Rows of one user equal in ``(timestamp, tiebreak)`` are never cut
            between two splits (the later split takes them all).

    Returns:
        ``[n]`` int8 codes (0 train, 1 val, 2 test), in the input row order.
    """
    user, timestamp = np.asarray(user, np.int64), np.asarray(timestamp, np.int64)
    order = np.arange(len(user), dtype=np.int64) if tiebreak is None else np.asarray(tiebreak, np.int64)
    return group_cutoffs(user, timestamp, order, val_ratio, test_ratio).codes(user, timestamp, order)


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


def _tag_bags(data: MovieLensData, item_ids: dict[int, int], user_cutoff: dict[int, int], o: MovieLensOptions
              ) -> tuple[list[str], list[list[int]], dict[str, Any]]:
    """Train-visible tags -> (vocabulary, per-item bags of tag ids, stats)."""
    tu, ti, tt, tts = data.tags  # type: ignore[misc]
    used: list[tuple[int, str]] = []
    dropped = 0
    for u, m, tag, t in zip(tu.tolist(), ti.tolist(), tt, tts.tolist()):
        cut = user_cutoff.get(u)
        tag = normalized(tag)
        if cut is None or t > cut or m not in item_ids or not tag:
            dropped += 1
            continue
        used.append((item_ids[m], tag))
    vocab_list, counts, per_item = bags_of(used, o.min_tag_count, o.max_tags_per_item)  # (the schema's `many` rules)
    vocab = {t: i for i, t in enumerate(vocab_list)}
    bags = [[vocab[t] for t in per_item.get(i, ())] for i in range(len(item_ids))]
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
    # mean and std as preprocess logs computes them (sums of x and x^2: one formula for both paths)
    year_mean = float(row_year[known].sum()) / int(known.sum()) if known.any() else 2000.0
    year_var = float(np.square(row_year[known]).sum()) / int(known.sum()) - year_mean * year_mean if known.any() else 1.0
    year_std = float(np.sqrt(max(year_var, 0.0))) if known.sum() > 1 else 1.0
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
    # a bag in the movies file's order, repeats dropped (as preprocess logs reads a delimited column)
    multi["genres"] = _bags([[genre_vocab[g] for g in dict.fromkeys(data.movies[m][1])] for m in raw_items.tolist()])
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
    # ---- write shards (rows of each split in the ratings file's order, as preprocess logs writes them)
    splits_meta, rows, ctr = {}, {}, {}
    pooling: dict[str, dict[str, float]] = {}
    for code, split in enumerate(SPLITS):
        idx = np.flatnonzero(codes == code)
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
