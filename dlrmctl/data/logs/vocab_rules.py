"""The ``vocab`` keys beyond ``min_count`` (``order``, ``from``, ``oov``) of ``preprocess logs``,
applied to the vocabularies pass 1 wrote (:func:`dlrmctl.data.criteo.vocab.build_vocab`: most
frequent train value first, ties by key):

* ``from: join``: the vocabulary is every key of the side table the column is the ``join`` key of
  (a catalogue: a movie never rated, or rated in val / test only, keeps its own row); ``count`` is
  its train rows (0 for a key without one); for the column a ``many`` side table brings, the values
  it kept (:mod:`dlrmctl.data.logs.bags`), ``count`` their counted events.
* ``order: value``: ids by the sorted values, numerically when every value is an integer (an
  Arrow integer, a whole number, or decimal text such as ``"17"``), else by their text (Unicode
  code points); ``parse: hex`` values by their integer.  The values are the column's own (a second
  read of that column, or the side table's keys): vocabulary files hold keys (raw ids), which do
  not sort like the values they hash.
* ``oov: error``: the table holds the vocabulary only (``V`` rows, no out-of-vocabulary or
  missing row); a row whose value is outside it, or missing, is a bad row
  (:func:`outside_vocabulary`), at preprocess and in ``predict`` / ``serve``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dlrmctl.data.columnar import DataError
from dlrmctl.data.criteo.parallel import report_rows
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs.bags import values_file
from dlrmctl.data.logs.join import find_sorted, join_columns, read_side_keys, write_table
from dlrmctl.data.logs.read import iter_batches
from dlrmctl.data.logs.schema import CategoricalSpec, LogSchema
from dlrmctl.data.logs.transform import Decoded, VocabLookup, ids_of

__all__ = ["describe", "drop_outside", "finish_vocabs", "outside_vocabulary", "value_order", "value_texts"]

_INTEGER = re.compile(r"^[-+]?\d+$")


def _reordered(schema: LogSchema) -> list[int]:
    """The categoricals whose vocabulary file is rewritten (``from: join`` or ``order: value``)."""
    return [i for i, c in enumerate(schema.categorical)
            if c.mode == "vocab" and (c.vocab_from == "join" or c.order == "value")]


def _flat_values(col: Any, spec: CategoricalSpec) -> pa.Array:
    """A block's column -> its distinct present values (bags flattened; empty, null and
    ``null_values`` dropped)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if spec.multi:
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            col = pc.list_flatten(col)
        elif spec.delimiter is not None and not pa.types.is_null(col.type):
            col = pc.list_flatten(pc.split_pattern(pc.cast(col, pa.string()), spec.delimiter))
    if pa.types.is_floating(col.type):  # whole numbers are the integer's key (as transform.py reads them)
        x = pc.fill_null(col, 0.5).to_numpy(zero_copy_only=False)
        col = pa.array(x[np.isfinite(x) & (np.floor(x) == x)].astype(np.int64))
    col = pc.unique(col.drop_null())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = col.filter(pc.not_equal(col, ""))
        if spec.null_values:
            col = col.filter(pc.invert(pc.is_in(col, pa.array(list(spec.null_values)))))
    return col


def value_texts(task: Any) -> dict[int, pa.Array]:
    """Per input file (a pass on the worker pool): the distinct values of each ``order: value``
    column read from the log (joined columns included).

    Args:
        task: a :class:`dlrmctl.data.logs.preprocess.LogTask` (``path``, ``schema``, ``opts``).

    Returns:
        ``{categorical index: distinct values}`` (Arrow strings or integers).
    """
    s = task.schema
    want = [i for i in _reordered(s) if s.categorical[i].vocab_from == "train" and s.categorical[i].parse != "hex"]
    acc: dict[int, list[pa.Array]] = {i: [] for i in want}
    if not want:
        return {}
    for b in iter_batches(task.path, s, task.opts.on_bad_line, task.opts.block_size):
        report_rows(b.num_rows + b.bad_skipped)
        if s.join:
            b = join_columns(b, s, np.zeros(b.num_rows, bool), "skip")
        for i in want:
            acc[i].append(_flat_values(b.columns[s.categorical[i].name], s.categorical[i]))
            if len(acc[i]) >= 8:
                acc[i] = [_unique(acc[i])]
    return {i: _unique(a) for i, a in acc.items()}


def _unique(arrays: list[pa.Array]) -> pa.Array:
    arrays = [a for a in arrays if len(a)] or arrays[:1]
    if not arrays:
        return pa.array([], pa.string())
    types = {a.type for a in arrays}
    if len(types) > 1:  # integers in one block, text in another (JSON lines): compare as text
        arrays = [pc.cast(a, pa.string()) for a in arrays]
    return pc.unique(pa.concat_arrays(arrays))


def value_order(values: pa.Array) -> np.ndarray:
    """``[V]`` int64 permutation sorting ``values``: numerically when every value is an integer
    (an Arrow integer array, or text of decimal integers), else by text (Unicode code points).

    Args:
        values: ``[V]`` distinct Arrow strings or integers, no nulls.
    """
    if pa.types.is_integer(values.type):
        return np.argsort(values.to_numpy(zero_copy_only=False), kind="stable")
    texts = values.to_pylist()
    if all(_INTEGER.match(t) for t in texts):
        return np.asarray(sorted(range(len(texts)), key=lambda k: int(texts[k])), np.int64)
    return np.asarray(sorted(range(len(texts)), key=lambda k: texts[k]), np.int64)


def _write_vocab(path: Path, keys: np.ndarray, counts: np.ndarray) -> None:
    write_table(path, pa.table({"value": pa.array(keys, pa.int64()), "count": pa.array(counts, pa.int64())}))


def finish_vocabs(schema: LogSchema, files: list[Path], out_dir: str | os.PathLike, vocab_info: dict[int, dict],
                  run: Callable[[Callable, str], list]) -> dict[int, dict]:
    """Rewrite the vocabulary files of ``from: join`` / ``order: value`` columns (module docstring).

    Args:
        schema: the schema, its joins prepared (:func:`dlrmctl.data.logs.join.prepare_joins`).
        files: the input files (a side table's relative path is taken from the first one's directory).
        out_dir: the data directory (``vocab/<name>.arrow`` as pass 1 wrote them).
        vocab_info: pass 1's ``{categorical index: {"size", "distinct_train_values"}}``.
        run: ``run(fn, label)`` runs ``fn`` over one task per input file, returning the results.

    Returns:
        ``vocab_info`` with each rewritten vocabulary's ``size``.

    Raises:
        DataError: a value of the log, or a key of the side table, whose text is not known (a
            vocabulary that changed under the run).
    """
    idx = _reordered(schema)
    if not idx:
        return vocab_info
    texts: dict[int, list[pa.Array]] = {i: [] for i in idx}
    if any(schema.categorical[i].vocab_from == "train" and schema.categorical[i].order == "value"
           and schema.categorical[i].parse != "hex" for i in idx):
        for got in run(value_texts, "logs pass 1 (values)"):
            for i, a in got.items():
                texts[i].append(a)
    info = dict(vocab_info)
    for i in idx:
        spec = schema.categorical[i]
        path = Path(out_dir) / "vocab" / f"{spec.name}.arrow"
        t = ipc.open_file(pa.memory_map(str(path))).read_all()
        keys, counts = t.column("value").to_numpy(), t.column("count").to_numpy()
        bag = next((k for k, j in enumerate(schema.join) if j.many and spec.name in j.columns), None)
        if spec.vocab_from == "join" and bag is not None:  # the values a `many` side table kept (bags.py)
            kept = ipc.open_file(pa.memory_map(str(Path(out_dir) / values_file(bag)))).read_all()
            values = kept.column("value").combine_chunks()
            keys, counts = raw_ids(values), kept.column("count").to_numpy()
        elif spec.vocab_from == "join":
            j = next(j for j in schema.join if j.key == spec.name)
            side = read_side_keys(j, files, schema)
            side_keys = raw_ids(side)
            cat_counts = np.zeros(len(side_keys), np.int64)
            srt = np.argsort(side_keys, kind="stable")
            sk = side_keys[srt]
            pos, hit = find_sorted(sk, keys)
            cat_counts[srt[pos[hit]]] = counts[hit]
            keys, counts, values = side_keys, cat_counts, side
        elif spec.order == "value" and spec.parse != "hex":
            values = _unique(texts[i])
        if spec.order == "value":
            if spec.parse == "hex":
                order = np.argsort(keys, kind="stable")
            else:
                vkeys = raw_ids(values)
                order_v = value_order(values)
                rank = dict(zip(vkeys[order_v].tolist(), range(len(vkeys))))
                try:
                    r = np.fromiter((rank[k] for k in keys.tolist()), np.int64, count=len(keys))
                except KeyError as e:
                    raise DataError(f"vocabulary of {spec.name}: the key {e} has no value in the input (was it "
                                    "changed during the run?)", path=path) from None
                order = np.argsort(r, kind="stable")
        else:  # a catalogue by train count: most frequent first, ties by key (build_vocab's order)
            order = np.lexsort((keys, -counts))
        _write_vocab(path, keys[order], counts[order])
        info[i] = {**info.get(i, {}), "size": int(len(keys))}
    return info


def outside_vocabulary(spec: CategoricalSpec, ids: np.ndarray, lengths: np.ndarray | None, size: int) -> np.ndarray:
    """Rows with a value outside the vocabulary, or missing, of an ``oov: error`` column.

    Args:
        spec: the column (``vocab`` mode).
        ids: ``[m]`` int64 ids of its values (:func:`dlrmctl.data.logs.transform.ids_of`: ``size``
            for an unknown value, ``size + 1`` for a missing one).
        lengths: ``[n]`` int64 bag lengths (multi-valued), or None (``m == n``).
        size: ``V``, the vocabulary's size.

    Returns:
        ``[n]`` bool, True for a bad row (all False unless ``spec.oov == 'error'``).
    """
    n = len(ids) if lengths is None else len(lengths)
    if spec.mode != "vocab" or spec.oov != "error":
        return np.zeros(n, bool)
    bad = ids >= size
    if lengths is None:
        return bad
    return np.bincount(np.repeat(np.arange(n), lengths)[bad], minlength=n) > 0


def describe(spec: CategoricalSpec) -> dict:
    """meta.json's words for a ``vocab`` column (``transforms.sparse[name]``), built from its
    rules: where the values come from (``min_count`` only for the train split's), the id order, and
    what an out-of-vocabulary or missing value becomes; ``from`` / ``order`` / ``oov`` repeat the
    rules that differ from the defaults."""
    bag = spec.vocab_from == "join" and spec.multi  # (schema: a `from: join` bag is multi, a key is not)
    out: dict[str, Any] = {"mode": "vocab"}
    if spec.vocab_from == "join":
        out["built_on"] = "the values the `many` side table kept" if bag else "every key of the joined side table"
        values, count = out["built_on"], "counted events" if bag else "train rows"
    else:
        out.update(min_count=spec.min_count, built_on="train split")
        values, count = "the values with train count >= min_count", "train count"
    order = ("rank of the value among the sorted values (integers numerically, else by text)" if spec.order == "value"
             else f"rank by descending {count} (ties by key)")
    fate = ("a value outside it, or missing, is a bad row (no oov_id or missing_id)" if spec.oov == "error" else
            "any other value -> oov_id = V; missing -> V + 1")
    out["formula"] = f"over {values} (V of them): id = {order}; {fate}"
    if spec.vocab_from == "join":
        out["from"] = out["built_on"] + f" (count: its {count})"
    if spec.order == "value":
        out["order"] = f"id = {order}"
    if spec.oov == "error":
        out["oov"] = "no out-of-vocabulary or missing row: such a value is a bad row"
    return out


def drop_outside(schema: LogSchema, d: Decoded, vocabs: list[VocabLookup | None], path: str,
                 on_bad_line: str) -> tuple[Decoded, list[np.ndarray]]:
    """``d`` without the rows an ``oov: error`` column refuses (:func:`outside_vocabulary`), and
    the ids of its categoricals (:func:`dlrmctl.data.logs.transform.ids_of`, once per block).

    Args:
        schema: the schema; ``vocabs``: per categorical its vocabulary (None but in ``vocab`` mode).
        d: a decoded block; ``path``: its file (in the message).
        on_bad_line: ``error``: raise naming the first such row; ``skip``: drop and count them.

    Returns:
        ``(d without the refused rows, [per categorical: ids of the rows kept])``.

    Raises:
        DataError: ``path:line`` (Parquet: ``path: row R``), the column, the value's fate.
    """
    ids = [ids_of(spec, v, voc) for spec, v, voc in zip(schema.categorical, d.categorical, vocabs)]
    bad = np.zeros(len(d.keys), bool)
    for spec, v, voc, x in zip(schema.categorical, d.categorical, vocabs, ids):
        if spec.mode != "vocab" or spec.oov != "error":
            continue
        rows = outside_vocabulary(spec, x, v.lengths, voc.size)
        if on_bad_line == "error" and rows.any():
            r = int(np.flatnonzero(rows)[0])
            key = int(d.keys[r])
            where = dict(path=f"{path}: row {key}") if str(path).endswith((".parquet", ".pq")) else dict(path=path, line=key)
            raise DataError("expected a value of the vocabulary (`vocab.oov: error`: the table has no "
                            "out-of-vocabulary or missing row), got an unknown or missing value", field=spec.name, **where)
        bad |= rows
    if not bad.any():
        return d, ids
    keep = ~bad
    ids = [x[keep] if v.lengths is None else x[np.repeat(keep, v.lengths)] for x, v in zip(ids, d.categorical)]
    return dataclasses.replace(
        d, keys=d.keys[keep], label=None if d.label is None else d.label[keep], dense=[x[keep] for x in d.dense],
        time=None if d.time is None else d.time[keep], categorical=[c.select(keep) for c in d.categorical],
        bad=d.bad + int(bad.sum()), group=None if d.group is None else d.group[keep],
        order=None if d.order is None else d.order[keep]), ids
