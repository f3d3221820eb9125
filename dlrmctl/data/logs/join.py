"""Side tables joined to a log's rows (``join:`` in the schema): e.g. a movies file whose ``genres``
become a column of every rating, looked up by the rating's ``movieId``.

* :func:`prepare_joins` (once, before the passes): each side file is read whole with pyarrow (CSV /
  TSV with a header, Parquet, JSON lines; compressed by its suffix), its key column ``key`` and the
  listed ``columns`` only; a missing column, a missing key or a key twice is a :class:`DataError`
  naming the file.  The key and the columns are written, sorted by key, to
  ``vocab/join_<i>.arrow`` in the data directory (``key``: the raw id of the value,
  :func:`dlrmctl.data.ids.raw_ids`, so ``1`` and ``"1"`` match): the dataset (and a model exported
  from it) carries what its rows were joined with, checksummed like the vocabularies.
* :func:`join_columns` (per block, in every pass and in ``predict`` / ``serve``): the block's ``key``
  values are looked up (binary search over the memory-mapped keys: the side table is held once per
  process, in the page cache); the columns of the matching side rows are added to the block.  A
  value the side table lacks, or a missing key value, is a bad row naming ``file:line``, the
  column and the side file (``missing: error``), or gives missing values (null: an empty bag, the
  missing id, the ``fill``) with ``missing: empty``.

CSV / TSV side columns are read as text (a feature reads them as it reads the log's own text);
Parquet and JSON keep their types.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.file_cache import FileCache
from dlrmctl.data.logs.bad_rows import bad_rows, shown_value
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs.read import RowBatch
from dlrmctl.data.logs.schema import JoinSpec, LogSchema
from dlrmctl.errors import quoted

__all__ = ["KEY", "find_sorted", "join_columns", "prepare_joins", "read_side_columns", "read_side_keys", "recorded",
           "side_path", "with_tables", "write_table"]

KEY = "key"


def write_table(path: Path, table: pa.Table) -> None:
    """Write ``table`` to the Arrow IPC file ``path`` atomically (a temp file, then a rename): the
    data directory's side tables, bags, train counts and rewritten vocabularies."""
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    os.replace(tmp, path)


def find_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(pos, hit)``: per value of ``keys``, its position in ``sorted_keys`` (ascending; clamped to
    a valid index, 0 when empty) and whether it is there (``sorted_keys[pos] == keys``)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return pos, sorted_keys[pos] == keys


def side_path(spec: JoinSpec, inputs: list[Path]) -> Path:
    """The side file of ``spec``: its ``path``, relative to the first input's directory."""
    p = Path(os.path.expanduser(spec.path))
    return p if p.is_absolute() or not inputs else Path(inputs[0]).parent / p


def _read_side(spec: JoinSpec, path: Path, fmt: str, extra: tuple[str, ...] = ()) -> pa.Table:
    want = [spec.key, *spec.columns, *extra]
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            have = pq.ParquetFile(path).schema_arrow.names
            _check_columns(spec, path, have)
            return pq.read_table(path, columns=want)
        if fmt == "jsonl":
            import pyarrow.json as pj

            t = pj.read_json(path)
            _check_columns(spec, path, t.column_names)
            return t.select(want)
        import pyarrow.csv as pcsv

        delim = "\t" if fmt == "tsv" else (spec.delimiter or ",")
        with pcsv.open_csv(path, parse_options=pcsv.ParseOptions(delimiter=delim)) as r:
            have = r.schema.names
        _check_columns(spec, path, have)
        return pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter=delim),
                             convert_options=pcsv.ConvertOptions(include_columns=want,
                                                                 column_types={c: pa.string() for c in want}))
    except FileNotFoundError:
        raise DataError(f"side table of `join` by '{spec.key}' not found (a relative `path` is taken from the first "
                        "input's directory)", path=path) from None
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"side table of `join` by '{spec.key}' cannot be read as {fmt}: {e}", path=path) from None


def _check_columns(spec: JoinSpec, path: Path, have: list[str]) -> None:
    for c in (spec.key, *spec.columns, *[c for c in ((spec.many or {}).get("time"), (spec.many or {}).get("group")) if c]):
        if c not in have:
            raise DataError(f"column '{c}' named by `join` by '{spec.key}' is not in the side table (its columns: "
                            f"{quoted(', '.join(have))})", path=path)


def read_side_keys(spec: JoinSpec, inputs: list[Path], schema: LogSchema) -> pa.Array:
    """The key column of ``spec``'s side file, as read for the join (``[rows]`` Arrow strings for CSV /
    TSV, the file's type for Parquet / JSON lines), in file order.

    Raises:
        DataError: an unreadable side file or a missing column.
    """
    return read_side_columns(spec, inputs, schema, []).column(spec.key).combine_chunks()


def read_side_columns(spec: JoinSpec, inputs: list[Path], schema: LogSchema, extra: list[str]) -> pa.Table:
    """The side file of ``spec`` whole: its key, its columns and ``extra`` columns (CSV / TSV: text).

    Raises:
        DataError: an unreadable side file or a missing column.
    """
    path = side_path(spec, inputs)
    return _read_side(spec, path, schema.format_of(path) if spec.format is None else spec.format, tuple(extra))


def prepare_joins(schema: LogSchema, inputs: list[Path], out_dir: str | os.PathLike) -> tuple[LogSchema, list[dict]]:
    """Read the schema's side tables and write their sorted copies into ``out_dir/vocab``.

    Args:
        schema: a schema with ``join`` entries (without: returned as it is).
        inputs: the input files (a relative side ``path`` is taken from the first one's directory).
        out_dir: the data directory.

    Returns:
        ``(schema with each join's table set to its written copy (absolute path), [per join: source, file
        (relative to out_dir), rows]``) for the passes and meta.json.

    Raises:
        DataError: an unreadable side file, a missing column, a missing or repeated key.
    """
    specs, info = [], []
    for i, j in enumerate(schema.join):
        if j.many:  # aggregated after the split (dlrmctl.data.logs.bags)
            specs.append(j)
            continue
        path = side_path(j, inputs)
        t = _read_side(j, path, schema.format_of(path) if j.format is None else j.format)
        keys = raw_ids(t.column(j.key))
        if (keys == 0).any():
            r = int(np.flatnonzero(keys == 0)[0])
            raise DataError(f"data row {r + 1}: the key '{j.key}' is empty", path=path)
        order = np.argsort(keys, kind="stable")
        ks = keys[order]
        dup = np.flatnonzero(ks[1:] == ks[:-1])
        if dup.size:
            a, b = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
            raise DataError(f"the key {j.key} = {quoted(str(t.column(j.key)[a].as_py()))} is in data rows {a + 1} and "
                            f"{b + 1}: a side table holds one row per key", path=path)
        rel = f"vocab/join_{i}.arrow"
        out = Path(out_dir) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        sorted_t = t.take(pa.array(order)).select(list(j.columns)).add_column(0, KEY, pa.array(ks, pa.int64()))
        write_table(out, sorted_t)
        specs.append(dataclasses.replace(j, table=str(out)))
        info.append({"source": str(path), "file": rel, "rows": int(t.num_rows), "key": j.key, "columns": list(j.columns)})
    return dataclasses.replace(schema, join=tuple(specs)), info


def with_tables(schema: LogSchema, data_dir: str | os.PathLike) -> LogSchema:
    """``schema`` (as recorded in meta.json) with each join's table resolved against ``data_dir``."""
    if not schema.join:
        return schema
    return dataclasses.replace(schema, join=tuple(
        dataclasses.replace(j, table=str(Path(data_dir) / (j.table or ""))) for j in schema.join))


def recorded(schema: LogSchema) -> LogSchema:
    """``schema`` with each join's table relative to the data directory (what meta.json records)."""
    if not schema.join:
        return schema
    return dataclasses.replace(schema, join=tuple(
        dataclasses.replace(j, table=f"vocab/{Path(j.table).name}" if j.table else None) for j in schema.join))


def _read_table(path: Path) -> tuple[np.ndarray, pa.Table]:
    t = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    return t.column(KEY).to_numpy(), t


#: the side tables this process has read (sorted keys, table), by file version
_TABLES: FileCache[tuple[np.ndarray, pa.Table]] = FileCache(_read_table, limit=64)


def _table(path: str) -> tuple[np.ndarray, pa.Table]:
    try:
        return _TABLES.get(path)
    except (OSError, pa.ArrowInvalid, KeyError) as e:
        raise DataError(f"cannot read the joined side table (preprocess the data again): {e}", path=path) from None


def join_columns(batch: RowBatch, schema: LogSchema, drop: np.ndarray, on_bad_line: str,
                 scoring: bool = False) -> RowBatch:
    """``batch`` with the columns of the schema's side tables added (module docstring).

    Args:
        batch: a block of the log (its ``key`` columns).
        schema: a schema whose joins have their ``table`` (:func:`prepare_joins`, :func:`with_tables`).
        drop: ``[n]`` bool rows already bad; rows whose key the side table lacks are added
            (``missing: error`` with ``on_bad_line='skip'``).
        scoring: raw rows scored by a model (``predict`` / ``serve``, whose side tables are the
            copies its export carries): the error says so and how to score new keys.

    Raises:
        DataError: a key the side table lacks (``missing: error``, ``on_bad_line='error'``), naming
            ``file:line``, the column and the side file.
    """
    cols = dict(batch.columns)
    for j in schema.join:
        keys_sorted, t = _table(j.table)
        on = batch.columns[j.key]
        try:
            keys = raw_ids(on)
        except TypeError as e:
            raise batch.error(0, j.key, f"expected strings or integers (the key of `join`): {e}") from None
        pos, hit = find_sorted(keys_sorted, keys)
        hit &= keys != 0
        if j.missing == "error":
            bad = ~hit & ~drop
            if scoring and on_bad_line == "error" and bad.any():  # the side table as it was at preprocessing
                i = int(np.flatnonzero(bad)[0])
                raise batch.error(i, j.key, (
                    f"{shown_value(on, i)} is not a key of the side table {j.path} as this model holds it (the copy "
                    f"made when its data was preprocessed; the schema's `join` has `missing: error`, so such a "
                    f"row is refused rather than scored without {', '.join(j.columns)}); to score new keys, "
                    f"add them to {j.path}, then preprocess logs, train and export again (with `missing: "
                    f"empty` such rows would get missing values: an empty bag, the missing id, the fill)"))
            drop |= bad_rows(batch, bad, j.key, f"a key of the side table {j.path}", on, on_bad_line,
                             hint=" (or set `missing: empty` in its `join`)")
        idx = pa.array(pos, pa.int64(), mask=~hit)
        for c in j.columns:
            cols[c] = t.column(c).take(idx).combine_chunks()
    return dataclasses.replace(batch, columns=cols)
