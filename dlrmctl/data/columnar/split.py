"""A split of a dataset as the loader and the evaluators read it: the row checks (labels, finite
dense values), :class:`SplitData` over its shards, :func:`open_split`, and the dense columns'
statistics.  Part of :mod:`dlrmctl.data.columnar`, which re-exports every public name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from dlrmctl.data.columnar.format import META_FILE, DataError, read_meta
from dlrmctl.data.columnar.mapped import MappedShard



def check_rows(path: str | os.PathLike, split: str, rows: np.ndarray | int, scalar: Mapping[str, np.ndarray],
               label: str | None, dense: Sequence[str]) -> None:
    """Refuse labels outside {0, 1} and non-finite dense values in rows read from one shard.

    One vectorised pass per column (no per-element Python): what the loader calls on every
    piece of a shard it reads, before the rows become a batch.

    Args:
        path: the shard file the rows come from (named in the error).
        split: the split's name (named in the error).
        rows: ``[n]`` int64 row indices of the rows inside that shard (0-based), or the index of
            the first of ``n`` contiguous rows.
        scalar: column name -> ``[n]`` values (float32) of those rows; must hold ``label`` (when
            not None) and every name of ``dense``.
        label: the label column, or None for unlabelled data (not checked).
        dense: the dense columns.

    Raises:
        DataError: ``<shard>: field <column>: <split> split, row <r> of the shard: ...`` with the
            value, what was expected and the remedy, and how many rows of the piece are bad.
    """
    if label is not None:
        y = scalar[label]
        bad = (y != 0) & (y != 1)  # NaN compares unequal to both
        if bad.any():
            _raise_bad(path, split, rows, y, bad, label,
                       "a label must be 0 or 1 (clicked or not); fix the source data (or its preprocessing) and "
                       "re-run `dlrmctl preprocess`")
    for name in dense:
        x = scalar[name]
        bad = ~np.isfinite(x)
        if bad.any():
            _raise_bad(path, split, rows, x, bad, name,
                       "a dense value must be a finite number (NaN and inf are refused, not treated as missing); "
                       "fix the source data (or its preprocessing) and re-run `dlrmctl preprocess`")


def _raise_bad(path, split: str, rows: np.ndarray | int, values: np.ndarray, bad: np.ndarray, column: str,
               expected: str) -> None:
    i = int(np.flatnonzero(bad)[0])
    n = int(np.count_nonzero(bad))
    more = f" (and {n - 1} more of the {len(values)} rows read with it)" if n > 1 else ""
    row = rows + i if isinstance(rows, (int, np.integer)) else int(rows[i])
    raise DataError(f"{split} split, row {row} of the shard (0-based): value {float(values[i])!r}{more}; "
                    f"{expected}", path=path, field=column)


class SplitData:
    """All shards of one split, addressed by a global row id ``[0, rows)``.

    Args:
        data_dir: preprocessed directory.
        split: a key of ``meta["splits"]``.
        meta: the meta dict (read when None).

    Attributes:
        rows: total rows of the split.
        shards: list of :class:`MappedShard`, in meta order; global rows are their concatenation.
        meta: the meta dict.

    Raises:
        DataError: unknown split (names the available ones), a shard missing or not the bytes
            meta.json's checksum records, or a row count that disagrees with meta.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, meta: dict | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.meta = meta if meta is not None else read_meta(data_dir)
        if split not in self.meta["splits"]:
            raise DataError(f"unknown split '{split}'; this directory has "
                            f"{sorted(self.meta['splits'])}", path=self.data_dir / META_FILE)
        self.split = split
        info = self.meta["splits"][split]
        from dlrmctl.data.checksums import verify_files

        verify_files(self.data_dir, self.meta, info["files"], DataError)  # once per process per file version
        self.shards = [MappedShard(self.data_dir / f) for f in info["files"]]
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.rows for s in self.shards], out=self.starts[1:])
        self.rows = int(self.starts[-1])
        if self.rows != int(info["rows"]):
            raise DataError(f"split '{split}' has {self.rows} rows in its shards but meta says "
                            f"{info['rows']}; the directory is inconsistent, re-run preprocessing",
                            path=self.data_dir / META_FILE)

    def group(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Split global row ids ``[n]`` by shard -> ``[(shard index, positions in rows, local rows)]``."""
        if len(self.shards) == 1:
            return [(0, slice(None), rows)]
        sid = np.searchsorted(self.starts, rows, side="right") - 1
        order = np.argsort(sid, kind="stable")
        sorted_sid = sid[order]
        bounds = np.flatnonzero(np.diff(sorted_sid)) + 1
        out = []
        for pos in np.split(order, bounds):
            if len(pos):
                s = int(sid[pos[0]])
                out.append((s, pos, rows[pos] - self.starts[s]))
        return out


#: rows :func:`dense_column_stats` reads at most (evenly spaced blocks): ~0.2 s of reading, and a
#: standard error of the mean of std/2048 — far below what a standardisation needs
DENSE_STATS_MAX_ROWS = 1 << 22


def dense_column_stats(data_dir: str | os.PathLike, split: str = "train", block_rows: int = 1 << 16,
                       max_rows: int | None = DENSE_STATS_MAX_ROWS,
                       meta: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and (population) std of a split's dense features, ``[D]`` float64 each.

    Reads the dense columns only, ``block_rows`` rows at a time (memory O(block_rows), not
    O(split)).  A split of at most ``max_rows`` rows (None: no limit) is read whole and the
    result equals ``np.mean`` / ``np.std`` of each column up to float64 rounding; a larger one
    (Criteo 1TB: 4.2e9 rows) is estimated from ``max_rows`` rows in blocks spread evenly over
    every shard in proportion to its rows, so the cost stays O(max_rows) whatever the split's
    size (every rank reads the same rows: deterministic).  Blocks are merged with Chan et al.'s
    pairwise update ("Updating Formulae and a Pairwise Algorithm for Computing Sample
    Variances", 1979).  A constant column (or an empty split) gets std 1 (a column holding NaN / inf
    gets a non-finite mean and std, which the trainer reports), so
    ``(x - mean) / std`` is always defined (as ``scripts/baselines_common.dense_stats``).

    ``meta``: the directory's meta.json when the caller has read it (else read here).

    Raises:
        DataError: the split is missing or unreadable (names the path).
        ValueError: ``block_rows`` or ``max_rows`` < 1.
    """
    if block_rows < 1 or (max_rows is not None and max_rows < 1):
        raise ValueError(f"dense_column_stats: block_rows and max_rows must be >= 1, got {block_rows}, {max_rows}")
    sd = SplitData(data_dir, split, meta)
    names = list(sd.meta["dense_features"])
    n = 0
    mean = np.zeros(len(names))
    m2 = np.zeros(len(names))
    total = sum(sh.rows for sh in sd.shards)
    for sh in sd.shards:
        if max_rows is None or total <= max_rows:
            starts = range(0, sh.rows, block_rows)
            size = block_rows
        else:  # this shard's share of max_rows, as evenly spaced blocks
            want = max(1, round(max_rows * sh.rows / total))
            size = min(block_rows, want)
            k = -(-want // size)
            starts = sorted({int(i * (sh.rows - size) / max(1, k - 1)) for i in range(k)}) if k > 1 else [0]
        for r0 in starts:
            loc = sh.locate(np.arange(r0, min(sh.rows, r0 + size), dtype=np.int64))
            x = np.stack([sh.take(c, loc) for c in names], axis=1).astype(np.float64) if names else None
            if x is None or len(x) == 0:
                continue
            nb, mb = len(x), x.mean(axis=0)
            m2b = ((x - mb) ** 2).sum(axis=0)
            delta = mb - mean
            tot = n + nb
            mean = mean + delta * (nb / tot)
            m2 = m2 + m2b + delta ** 2 * (n * nb / tot)
            n = tot
    std = np.sqrt(m2 / n) if n else np.ones(len(names))
    return mean, np.where(std == 0, 1.0, std)  # a NaN / inf column keeps its non-finite std (the caller rejects it)


def open_split(data_dir: str | os.PathLike, split: str) -> SplitData:
    """Open one split of a preprocessed directory, memory-mapped (see :class:`SplitData`)."""
    return SplitData(data_dir, split)
