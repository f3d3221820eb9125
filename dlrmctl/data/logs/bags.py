"""Side tables of many rows per key, aggregated into one bag per key (``join[].many``): e.g.
MovieLens' tags.csv (one row per tagging event) becomes each movie's bag of tags.

Rules (``many: {time, group, normalize, min_count, max_len}``):

* the side table's one listed column holds the values; ``normalize: true`` lower-cases them and
  collapses runs of whitespace to one space (Python's ``str.lower`` and ``str.split``); an empty
  value is dropped;
* with ``time`` and ``group`` (the side columns of an event's time and of the split's group, e.g.
  the tagging user): an event counts only when its group has train rows and its time is at most
  the group's latest train time (*train-visible*: nothing from a group's val / test period
  reaches the features); without them every event counts;
* a value is kept when it is in at least ``min_count`` counted events (over all keys);
* a key's bag: its distinct kept values, the ``max_len`` most frequent among its counted events
  (ties by value), in value order (Unicode code points).

The bags are written, sorted by key (its raw id), to ``vocab/join_<i>.arrow`` like any side table
(a key without one gets an empty bag), and the kept values, sorted, with their event counts, to
``vocab/join_<i>_values.arrow``: the vocabulary of the column's feature with ``vocab: {from:
join}``.  Computed once per preprocess, after the split (pass 0); raw rows are joined with the
written bags.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs.join import KEY, find_sorted, read_side_columns, side_path, write_table
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.split import GroupCutoffs

__all__ = ["bags_of", "latest_train_times", "normalized", "prepare_bags", "values_file", "without_bags"]


def values_file(i: int) -> str:
    """The kept values of ``join[i]`` (relative to the data directory)."""
    return f"vocab/join_{i}_values.arrow"


def without_bags(schema: LogSchema) -> LogSchema:
    """``schema`` without its ``many`` joins and the categoricals of their columns (pass 0 runs
    before the bags exist)."""
    cols = {c for j in schema.join if j.many for c in j.columns}
    return dataclasses.replace(schema, join=tuple(j for j in schema.join if not j.many),
                               categorical=tuple(c for c in schema.categorical if c.name not in cols))


def latest_train_times(groups: GroupCutoffs, group: np.ndarray, time: np.ndarray, order: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per group with train rows, its latest train time.

    Args:
        groups: the per-group split; ``group``, ``time``, ``order``: ``[n]`` int64 of every row.

    Returns:
        ``(groups [G'] int64 sorted, latest train time [G'] int64)``.
    """
    train = groups.codes(group, time, order) == 0
    g, t = group[train], time[train]
    if not len(g):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    o = np.lexsort((t, g))
    g, t = g[o], t[o]
    last = np.flatnonzero(np.r_[g[1:] != g[:-1], True])
    return g[last], t[last]


def normalized(value: str) -> str:
    """``normalize: true``: lower case, runs of whitespace collapsed to one space (ends stripped)."""
    return " ".join(value.lower().split())


def bags_of(events: Iterable[tuple[int, str]], min_count: int, max_len: int
            ) -> tuple[list[str], dict[str, int], dict[int, list[str]]]:
    """The rules of the module docstring over the counted ``(key, value)`` events.

    Returns:
        ``(kept values sorted, {value: counted events}, {key: its bag})``: a value is kept when in
        ``min_count`` events or more; a key's bag is its ``max_len`` most frequent kept values
        (ties by value), in value order; a key without a kept value has no entry.
    """
    counts: dict[str, int] = {}
    per: dict[tuple[int, str], int] = {}
    for k, v in events:
        counts[v] = counts.get(v, 0) + 1
        per[(k, v)] = per.get((k, v), 0) + 1
    kept = sorted(v for v, c in counts.items() if c >= min_count)
    keep = set(kept)
    per_key: dict[int, list[tuple[int, str]]] = {}
    for (k, v), c in per.items():
        if v in keep:
            per_key.setdefault(k, []).append((-c, v))
    return kept, counts, {k: sorted(v for _, v in sorted(p)[:max_len]) for k, p in per_key.items()}


def prepare_bags(schema: LogSchema, inputs: list[Path], out_dir: str | os.PathLike,
                 latest: tuple[np.ndarray, np.ndarray] | None) -> tuple[LogSchema, list[dict]]:
    """Aggregate each ``many`` side table into bags (module docstring) and write them.

    Args:
        schema: the schema; ``inputs``: the input files (a relative side path is taken from the
            first one's directory); ``out_dir``: the data directory.
        latest: :func:`latest_train_times` (needed with ``many.time``).

    Returns:
        ``(schema with each many-join's table set, [per many-join: source, file, rows, key, columns]``).

    Raises:
        DataError: an unreadable side file, a missing column, an event time that is not an integer.
    """
    specs, info = list(schema.join), []
    for i, j in enumerate(schema.join):
        if not j.many:
            continue
        m, col = j.many, j.columns[0]
        extra = [c for c in (m["time"], m["group"]) if c]
        path = side_path(j, inputs)
        t = read_side_columns(j, inputs, schema, extra)
        keys = raw_ids(t.column(j.key))
        vals = t.column(col).to_pylist()
        vals = ["" if v is None else normalized(str(v)) if m["normalize"] else str(v) for v in vals]
        use = (keys != 0) & np.fromiter((v != "" for v in vals), bool, count=len(vals))
        if m["time"]:
            try:
                ts = np.asarray([int(x) for x in t.column(m["time"]).to_pylist()], np.int64)
            except (TypeError, ValueError) as e:
                raise DataError(f"`many.time` column '{m['time']}' of the side table must hold integers: {e}",
                                path=path) from None
            g = raw_ids(t.column(m["group"]))
            lg, lt = latest
            pos, has = find_sorted(lg, g)
            use &= has & (ts <= np.where(has, lt[pos] if len(lt) else 0, 0))
        kept, counts, per_key = bags_of(zip(keys[use].tolist(), [v for v, u in zip(vals, use.tolist()) if u]),
                                        m["min_count"], m["max_len"])
        bag_keys = np.asarray(sorted(per_key), np.int64)
        bags = [per_key[k] for k in bag_keys.tolist()]
        rel = f"vocab/join_{i}.arrow"
        out = Path(out_dir) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        write_table(out, pa.table({KEY: pa.array(bag_keys, pa.int64()), col: pa.array(bags, pa.list_(pa.string()))}))
        write_table(Path(out_dir) / values_file(i), pa.table({"value": pa.array(kept, pa.string()),
                                                        "count": pa.array([counts[v] for v in kept], pa.int64())}))
        specs[i] = dataclasses.replace(j, table=str(out))
        info.append({"source": str(path), "file": rel, "rows": int(t.num_rows), "key": j.key, "columns": [col],
                     "events_counted": int(use.sum()), "values_kept": len(kept), "keys_with_bags": len(bags)})
    return dataclasses.replace(schema, join=tuple(specs)), info
