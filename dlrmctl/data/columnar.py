"""Columnar on-disk format shared by every dataset: Arrow IPC shards + ``meta.json``.

Layout of a preprocessed directory::

    DIR/meta.json                        description of everything below (see FORMAT below)
    DIR/parts/<part>/<split>.arrow       Arrow IPC *file* format shards, uncompressed, memory-mappable
    DIR/vocab/<feature>.arrow            optional vocabularies (criteo ``--frequency-threshold``)

Every shard holds one column per feature, no nulls:

* ``label``: float32 ``[rows]`` (0.0 / 1.0); absent for unlabelled data.
* one float32 ``[rows]`` column per dense feature (already transformed, e.g. log(x+1)), finite.

Values are checked where they enter training and evaluation (:func:`check_rows`, called by the
loader on every piece of a shard it reads, vectorised): a label other than 0 or 1 (NaN included)
or a dense value that is NaN or infinite is a :class:`DataError` naming the shard, the split,
the row, the column and the value.  No value is ever silently replaced: missing dense values
are the preprocessor's business (Criteo's empty field -> 0 before ``log(x+1)``).
* one int64 ``[rows]`` column per one-hot sparse feature (ids in ``[0, num_embeddings)``).
* one ``list<int64>`` column per multi-hot sparse feature (bags of ids).
* a *raw-id* sparse feature (meta.json ``"ids": "raw"``, :data:`IDS_KEY` = :data:`IDS_RAW`) holds raw
  64-bit ids from :func:`dlrmctl.data.ids.raw_ids` instead (int64 in ``[0, 2**63)``, 0 = missing),
  not bounded by ``num_embeddings``; its ``num_embeddings`` is the exact number of distinct raw ids
  in the train split (informational).  Only a managed-collision table may read such a feature.
* optional per-id weights of a sparse feature ``F`` (weighted features, see ``model.tables[].weighted``):
  a column ``F__weight`` (:func:`weight_column`), float32 ``[rows]`` for a one-hot feature,
  ``list<float32>`` with the same bag lengths as ``F`` for a multi-hot one; meta.json marks the
  feature ``"weighted": true``.  Criteo and MovieLens write none; ``dlrmctl preprocess synthetic
  --weighted-features`` does.

A shard may hold several record batches (written while streaming).  Readers map the whole
file once and address every column of every record batch inside that one mapping
(:class:`MappedShard`), so a batch gather over many record batches is a handful of numpy
fancy-index operations, not a Python loop over chunks.

FORMAT (``meta.json``, ``format_version`` 1)::

    {
      "format_version": 1,
      "dataset": "criteo" | "synthetic" | ...,
      "dense_features": ["I1", ...],
      "sparse_features": [{"name": "C1", "num_embeddings": N, "multi_hot": false,
                           "mean_pooling_factor": 1.0, "max_pooling_factor": 1,
                           "weighted": false (optional: true when the shards have C1__weight),
                           "ids": "raw" (optional: raw 64-bit ids; absent = index ids), ...}, ...],
      "label": "label" | null,
      "splits": {"train": {"rows": n, "files": ["parts/x/train.arrow", ...]}, "val": ..., "test": ...},
      "ctr": {"train": 0.25, ...},            # mean label per split (null when no rows / no label)
      "transforms": {...},                    # every transform applied, with its source
      "vocab_files": {"C1": "vocab/C1.arrow", ...},   # may be empty
      ...dataset-specific keys (e.g. "bayes_auc" for synthetic)
    }

File paths inside meta are relative to DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.errors import UserError
from dlrmctl.fileio import write_text_atomic

FORMAT_VERSION = 1
META_FILE = "meta.json"
LABEL_COLUMN = "label"
#: suffix of a sparse feature's optional per-id weight column (``C1`` -> ``C1__weight``)
WEIGHT_SUFFIX = "__weight"
SPLITS = ("train", "val", "test")
#: key of a ``sparse_features`` entry in meta.json that says how its ids are stored
IDS_KEY = "ids"
#: value of :data:`IDS_KEY` for raw 64-bit ids (:mod:`dlrmctl.data.ids`); absent = index ids
IDS_RAW = "raw"

__all__ = [
    "DataError",
    "FORMAT_VERSION",
    "IDS_KEY",
    "IDS_RAW",
    "MappedShard",
    "SplitData",
    "check_rows",
    "is_raw_feature",
    "open_split",
    "read_meta",
    "shard_schema",
    "weight_column",
    "write_meta",
    "write_split_shard",
]


class DataError(ValueError, UserError):
    """Bad input data or a bad preprocessed directory.

    The message always names the file, and the line and field when known, in the form
    ``path:line: field X: what was wrong``.

    Attributes:
        path: offending file (str) or None.
        line: 1-based physical line number or None.
        field: field / column name or None.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None,
                 line: int | None = None, field: str | None = None) -> None:
        prefix = ""
        if path is not None:
            prefix = f"{path}:{line}: " if line is not None else f"{path}: "
        if field is not None:
            prefix += f"field {field}: "
        super().__init__(prefix + message)
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field


# ---------------------------------------------------------------------------- writing
def is_raw_feature(sparse_feature: Mapping[str, Any]) -> bool:
    """Whether a meta.json ``sparse_features`` entry holds raw 64-bit ids (``"ids": "raw"``)."""
    return sparse_feature.get(IDS_KEY) == IDS_RAW


def weight_column(feature: str) -> str:
    """Name of the per-id weight column of sparse feature ``feature`` (``C1`` -> ``C1__weight``)."""
    return feature + WEIGHT_SUFFIX


def shard_schema(dense_features: Sequence[str], sparse_features: Sequence[str],
                 multi_hot: Sequence[bool] | None = None, labelled: bool = True,
                 weighted: Sequence[bool] | None = None) -> pa.Schema:
    """Arrow schema of a shard.

    Args:
        dense_features: names of the float32 columns, in order.
        sparse_features: names of the id columns, in order.
        multi_hot: per sparse feature, True for a ``list<int64>`` column (bag), False for int64.
        labelled: include the float32 ``label`` column first.
        weighted: per sparse feature, True to add its weight column :func:`weight_column`
            (float32, or ``list<float32>`` for a multi-hot feature); default none.

    Returns:
        ``pa.Schema`` with columns ``[label], dense..., sparse..., weights of weighted sparse...``.
    """
    mh = list(multi_hot) if multi_hot is not None else [False] * len(sparse_features)
    wt = list(weighted) if weighted is not None else [False] * len(sparse_features)
    fields = [pa.field(LABEL_COLUMN, pa.float32(), nullable=False)] if labelled else []
    fields += [pa.field(n, pa.float32(), nullable=False) for n in dense_features]
    fields += [pa.field(n, pa.list_(pa.int64()) if m else pa.int64(), nullable=False)
               for n, m in zip(sparse_features, mh)]
    fields += [pa.field(weight_column(n), pa.list_(pa.float32()) if m else pa.float32(), nullable=False)
               for n, m, w in zip(sparse_features, mh, wt) if w]
    return pa.schema(fields)


class ShardWriter:
    """Streams record batches into one Arrow IPC file, atomically (temp file + rename).

    Args:
        path: final ``.arrow`` path; written as ``path + '.tmp'`` until :meth:`close`.
        schema: from :func:`shard_schema`.

    The file appears at ``path`` only after :meth:`close`; :meth:`abort` removes the temp file.  A
    constructor that fails or is interrupted (Ctrl-C) leaves no temp file behind.
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema) -> None:
        self.path = Path(path)
        self.schema = schema
        self.rows = 0
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._sink = self._writer = None
        try:
            self._tmp.parent.mkdir(parents=True, exist_ok=True)
            self._sink = pa.OSFile(str(self._tmp), "wb")
            self._writer = ipc.new_file(self._sink, schema)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise _write_error(e, self.path) from None
            raise

    def write(self, columns: Mapping[str, Any]) -> None:
        """Append rows.

        Args:
            columns: column name -> numpy array ``[n]`` (float32 / int64) or ``pa.Array``
                (``list<int64>`` for multi-hot); every schema column must be present, all of
                length ``n``.  ``n == 0`` is a no-op.

        Raises:
            DataError: a column is missing or lengths differ.
        """
        arrays = []
        n = None
        for f in self.schema:
            if f.name not in columns:
                raise DataError(f"column '{f.name}' missing from write (have {sorted(columns)})",
                                path=self.path)
            a = columns[f.name]
            if not isinstance(a, pa.Array):
                a = pa.array(np.ascontiguousarray(a), type=f.type)
            elif a.type != f.type:
                a = a.cast(f.type)
            if n is None:
                n = len(a)
            elif len(a) != n:
                raise DataError(f"column '{f.name}' has {len(a)} rows, expected {n}", path=self.path)
            arrays.append(a)
        if not n:
            return
        try:
            self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        except OSError as e:
            raise _write_error(e, self.path) from None
        self.rows += n

    def close(self) -> Path:
        """Finish the file and rename it into place; returns the final path.  On a failure (or a
        Ctrl-C) before the rename the temp file is removed, as by :meth:`abort`.

        Raises:
            DataError: the file system refused the write (full, read-only, ...; named with the path).
        """
        try:
            self._writer.close()
            self._sink.close()
            os.replace(self._tmp, self.path)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise _write_error(e, self.path) from None
            raise
        return self.path

    def abort(self) -> None:
        """Drop the partial file (an error closing or removing it, e.g. a full disk or a temp path
        that is a directory, is ignored: the error that made the caller abort is the one to report)."""
        for part in (self._writer, self._sink):
            try:
                if part is not None:
                    part.close()
            except Exception:  # noqa: BLE001 - already closed, or the disk that failed the write
                pass
        with contextlib.suppress(OSError):
            self._tmp.unlink(missing_ok=True)


def _write_error(e: OSError, path: Path) -> Exception:
    """A write of ``path`` refused by the file system (pyarrow raises ``OSError: ... No space left
    on device`` without an errno) as a :class:`DataError` naming the file, the condition and the
    remedy; any other OSError is returned as it is."""
    from dlrmctl.errors import OS_CONDITIONS, os_errno

    code = os_errno(e)
    if code is None:
        return e
    what, remedy = OS_CONDITIONS[code]
    return DataError(f"cannot write: {what}; {remedy} (re-running the command resumes / rewrites it)", path=path)


def write_split_shard(path: str | os.PathLike, columns: Mapping[str, Any], schema: pa.Schema) -> Path:
    """Write one complete shard (all rows at once) atomically.

    Args:
        path: destination ``.arrow`` file (parents created).
        columns: column name -> ``[rows]`` numpy array or ``pa.Array`` (see :meth:`ShardWriter.write`).
        schema: from :func:`shard_schema`.

    Returns:
        The written path.

    Raises:
        DataError: missing column / inconsistent lengths.
    """
    w = ShardWriter(path, schema)
    try:
        w.write(columns)
    except BaseException:
        w.abort()
        raise
    return w.close()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` (:func:`dlrmctl.fileio.write_text_atomic`: never
    half-written)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_split_ratios(val_ratio: float, test_ratio: float) -> None:
    """The ``--val-ratio`` / ``--test-ratio`` of every preprocessor: each in [0, 1), their sum < 1
    (rows are left to train on).

    Raises:
        ValueError: naming the option and the value.
    """
    for name, r in (("--val-ratio", val_ratio), ("--test-ratio", test_ratio)):
        if not 0.0 <= r < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {r}")
    if val_ratio + test_ratio >= 1.0:
        raise ValueError(f"--val-ratio + --test-ratio must be < 1, got {val_ratio + test_ratio}")


def write_meta(data_dir: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Validate and write ``DIR/meta.json`` atomically, with the size and SHA-256 of every file it
    names (``checksums``, :mod:`dlrmctl.data.checksums`); returns its path.

    Raises:
        DataError: ``meta`` lacks a required key (see :func:`read_meta`).
    """
    from dlrmctl.data.checksums import CHECKSUMS_KEY, file_checksums, meta_files

    path = Path(data_dir) / META_FILE
    _validate_meta(dict(meta), path)
    meta = {**meta, CHECKSUMS_KEY: file_checksums(data_dir, meta_files(dict(meta)))}
    write_json_atomic(path, meta)
    return path


# ---------------------------------------------------------------------------- reading
_REQUIRED_META = ("format_version", "dataset", "dense_features", "sparse_features", "label", "splits")


def _validate_meta(meta: dict, path: Path) -> None:
    for k in _REQUIRED_META:
        if k not in meta:
            raise DataError(f"meta is missing the key '{k}' (required: {list(_REQUIRED_META)})", path=path)
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"format_version {meta['format_version']!r} is not supported "
                        f"(this dlrmctl reads {FORMAT_VERSION}); re-run preprocessing", path=path)
    from dlrmctl.data.checksums import check_meta_paths

    why = check_meta_paths(meta)
    if why is not None:
        raise DataError(f"corrupt meta.json: {why}", path=path)
    for i, sf in enumerate(meta["sparse_features"]):
        for k in ("name", "num_embeddings", "multi_hot"):
            if k not in sf:
                raise DataError(f"sparse_features[{i}] is missing '{k}'", path=path)
        if IDS_KEY in sf and sf[IDS_KEY] != IDS_RAW:
            raise DataError(f"sparse_features[{i}] ({sf['name']}): '{IDS_KEY}' must be "
                            f"{IDS_RAW!r} or absent, got {sf[IDS_KEY]!r}", path=path)
    for name, s in meta["splits"].items():
        if "rows" not in s or "files" not in s:
            raise DataError(f"splits.{name} needs 'rows' and 'files'", path=path)


def read_meta(data_dir: str | os.PathLike) -> dict:
    """Read and validate ``DIR/meta.json``.

    Returns:
        The meta dict (schema in the module docstring).

    Raises:
        DataError: naming the file, when it is missing, not JSON, of another format version,
            or lacks a required key.
    """
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        hint = " (the directory does not exist)" if not Path(data_dir).exists() else ""
        raise DataError(f"not found{hint}; preprocess the data first "
                        "(`dlrmctl preprocess criteo|synthetic --out DIR`)", path=path)
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt meta.json: {e}", path=path) from None
    if not isinstance(meta, dict):
        raise DataError("corrupt meta.json: top level is not an object", path=path)
    _validate_meta(meta, path)
    return meta


class MappedShard:
    """One memory-mapped Arrow IPC shard, with vectorised row gathers across record batches.

    The file is mapped once (``pyarrow.memory_map``); every column of every record batch is
    located by its byte offset inside that mapping, so ``take`` over rows of many record
    batches is ``view[base[chunk] + local_row]`` — no copy of the file, no per-chunk loop.

    Args:
        path: ``.arrow`` file written by :class:`ShardWriter`.

    Attributes:
        rows: number of rows.
        schema: the Arrow schema.

    Raises:
        DataError: the file is missing, not Arrow IPC, compressed, has nulls, or a column of an
            unsupported type (only float32, int64, list<int64> and list<float32> are read).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None  # opened by read_range
        if not self.path.is_file():
            raise DataError("shard file not found (was the directory moved or partly deleted?)",
                            path=self.path)
        # Locating the record batches reads each batch's metadata message through a first mapping;
        # the page faults pull neighbouring pages in too (fault-around / readahead: ~3.4 bytes per
        # row of a Criteo shard), so that mapping is closed once the offsets are known and the
        # mapping kept for ``take`` starts untouched: RSS does not grow with the file's rows.
        try:
            meta_mm = pa.memory_map(str(self.path), "r")
            self._buf = meta_mm.read_buffer()
            reader = ipc.open_file(self._buf)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"not a readable Arrow IPC file: {e}", path=self.path) from None
        try:
            self._locate_batches(reader)
        finally:
            del reader
            self._buf = None
            meta_mm.close()
        self._mm = pa.memory_map(str(self.path), "r")
        self._buf = self._mm.read_buffer()
        size = self._buf.size
        # file-wide typed views (the mapping is page aligned)
        self._views = {
            4: (np.frombuffer(self._buf, dtype=np.float32, count=size // 4),
                np.frombuffer(self._buf, dtype=np.int32, count=size // 4)),
            8: np.frombuffer(self._buf, dtype=np.int64, count=size // 8),
        }

    def _locate_batches(self, reader: Any) -> None:
        """Byte offsets of every column of every record batch (``_base``, ``_vbase``, ``_starts``)."""
        self.schema = reader.schema
        nb = reader.num_record_batches
        base_addr = self._buf.address
        counts = np.zeros(nb, dtype=np.int64)
        self._base: dict[str, np.ndarray] = {}
        self._vbase: dict[str, np.ndarray] = {}
        self._kind: dict[str, str] = {}
        for f in self.schema:
            if f.type == pa.float32():
                self._kind[f.name] = "f32"
            elif f.type == pa.int64():
                self._kind[f.name] = "i64"
            elif f.type == pa.list_(pa.int64()):
                self._kind[f.name] = "list"
            elif f.type == pa.list_(pa.float32()):
                self._kind[f.name] = "listf32"  # per-id weights of a multi-hot feature
            else:
                raise DataError(f"column '{f.name}' has type {f.type}; expected float32, int64, "
                                "list<int64> or list<float32>", path=self.path)
            self._base[f.name] = np.zeros(nb, dtype=np.int64)
            if self._kind[f.name] in ("list", "listf32"):
                self._vbase[f.name] = np.zeros(nb, dtype=np.int64)
        for b in range(nb):
            rb = reader.get_batch(b)
            counts[b] = rb.num_rows
            for f, col in zip(self.schema, rb.columns):
                if col.null_count:
                    raise DataError(f"column '{f.name}' has {col.null_count} nulls", path=self.path)
                kind = self._kind[f.name]
                bufs = col.buffers()
                if kind in ("list", "listf32"):
                    off_b, val_b = bufs[1], bufs[3]
                    self._base[f.name][b] = self._elem(off_b, base_addr, 4) + col.offset
                    self._vbase[f.name][b] = (self._elem(val_b, base_addr, 8 if kind == "list" else 4)
                                              + col.values.offset if val_b is not None else 0)
                else:
                    self._base[f.name][b] = self._elem(bufs[1], base_addr, 4 if kind == "f32" else 8) \
                        + col.offset if bufs[1] is not None else 0
        self._starts = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(counts, out=self._starts[1:])
        self.rows = int(self._starts[-1])

    def _elem(self, buf: pa.Buffer, base_addr: int, itemsize: int) -> int:
        if buf.size == 0:  # e.g. the values of a list column whose bags are all empty
            return 0
        off = buf.address - base_addr
        if off < 0 or off + buf.size > self._buf.size or off % itemsize:
            raise DataError(f"buffer at byte {off} is outside the mapping or not {itemsize}-byte "
                            "aligned (compressed or foreign IPC file?)", path=self.path)
        return off // itemsize

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map shard row ids ``[n] int64`` -> (record batch index ``[n]``, row within it ``[n]``)."""
        if len(self._starts) == 2:
            return np.zeros(len(rows), dtype=np.int64), rows
        chunk = np.searchsorted(self._starts, rows, side="right") - 1
        return chunk, rows - self._starts[chunk]

    def take(self, name: str, loc: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Gather a float32 / int64 column at ``loc`` (from :meth:`locate`) -> ``[n]`` copy."""
        chunk, local = loc
        kind = self._kind[name]
        view = self._views[4][0] if kind == "f32" else self._views[8]
        return view[self._base[name][chunk] + local]

    def take_list(self, name: str, loc: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Gather a ``list<int64>`` (or ``list<float32>``) column at ``loc`` -> (values ``[sum(lengths)]``
        int64 (float32), lengths ``[n]`` int64)."""
        chunk, local = loc
        off32 = self._views[4][1]
        oi = self._base[name][chunk] + local
        start = off32[oi].astype(np.int64)
        lengths = off32[oi + 1].astype(np.int64) - start
        vstart = self._vbase[name][chunk] + start
        src = self._views[8] if self._kind[name] == "list" else self._views[4][0]
        return _jagged_gather(src, vstart, lengths), lengths

    def copy_range(self, name: str, chunk: int, start: int, n: int, out: np.ndarray) -> None:
        """Copy rows ``[start, start + n)`` of record batch ``chunk`` of a float32 / int64 column from
        the mapping into ``out [n]`` (one slice copy: what an in-order pass reads a batch with).

        Raises:
            DataError: the range lies outside the record batch.
        """
        if start < 0 or n < 0 or start + n > int(self._starts[chunk + 1] - self._starts[chunk]):
            raise DataError(f"rows [{start}, {start + n}) outside record batch {chunk} of column '{name}'",
                            path=self.path)
        b = int(self._base[name][chunk]) + start
        out[...] = (self._views[4][0] if self._kind[name] == "f32" else self._views[8])[b:b + n]

    @property
    def chunk_rows(self) -> np.ndarray:
        """Rows of each record batch (row group) ``[num_record_batches] int64``."""
        return np.diff(self._starts)

    def _pread_into(self, out: np.ndarray, byte_offset: int) -> np.ndarray:
        """Fill ``out`` from the file at ``byte_offset`` with ``os.preadv`` (a plain read, not a
        touch of the mapping, so the pages do not stay in this process's RSS)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], byte_offset + done)
            if got <= 0:
                raise DataError(f"short read at byte {byte_offset + done} (file truncated?)", path=self.path)
            done += got
        return out

    def read_range(self, name: str, chunk: int, start: int, n: int,
                   out: np.ndarray | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Read rows ``[start, start + n)`` of record batch ``chunk`` of one column from the file.

        Unlike :meth:`take` this reads with ``pread`` (the GIL released) into fresh arrays, or into
        ``out``: the bytes read are copied once and the mapping is not touched, so a sequential pass
        over a large shard leaves no mapped pages behind (memory = the rows read).

        Args:
            out: for a float32 / int64 column, a C-contiguous ``[n]`` array of the column's dtype
                to read into (e.g. a row of a batch's stacked columns); None: a new array.

        Returns:
            float32 / int64 ``[n]`` for a scalar column (``out`` when given); ``(values
            [sum(lengths)], lengths [n] int64)`` for a ``list<int64>`` (values int64) or
            ``list<float32>`` (values float32) column.

        Raises:
            DataError: the range lies outside the record batch, or the file is shorter than its footer says.
            ValueError: ``out`` of another dtype or size, or given for a list column.
        """
        rows = int(self._starts[chunk + 1] - self._starts[chunk])
        if start < 0 or n < 0 or start + n > rows:
            raise DataError(f"rows [{start}, {start + n}) outside record batch {chunk} ({rows} rows) "
                            f"of column '{name}'", path=self.path)
        kind = self._kind[name]
        base = int(self._base[name][chunk]) + start
        if kind in ("f32", "i64"):
            dtype, size = (np.float32, 4) if kind == "f32" else (np.int64, 8)
            if out is None:
                out = np.empty(n, dtype)
            elif out.dtype != dtype or out.shape != (n,) or not out.flags.c_contiguous:
                raise ValueError(f"read_range: out must be a contiguous [{n}] {np.dtype(dtype)} array for "
                                 f"column '{name}', got {out.dtype} {out.shape}")
            return self._pread_into(out, base * size) if n else out
        if out is not None:
            raise ValueError(f"read_range: out is for float32 / int64 columns, not the list column '{name}'")
        offsets = self._pread_into(np.empty(n + 1, np.int32), base * 4).astype(np.int64)
        dtype, size = (np.int64, 8) if kind == "list" else (np.float32, 4)
        values = np.empty(int(offsets[-1] - offsets[0]), dtype)
        if len(values):
            self._pread_into(values, (int(self._vbase[name][chunk]) + int(offsets[0])) * size)
        return values, np.diff(offsets)

    def close(self) -> None:
        """Close the file descriptor :meth:`read_range` opened (the mapping stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def read_column(self, name: str) -> np.ndarray:
        """Whole float32 / int64 column ``[rows]`` (a copy)."""
        rows = np.arange(self.rows, dtype=np.int64)
        return self.take(name, self.locate(rows))


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


def _jagged_gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``src[starts[i] : starts[i] + lengths[i]]`` for all i, vectorised -> ``[sum(lengths)]``."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=src.dtype)
    excl = np.cumsum(lengths) - lengths
    idx = np.repeat(starts - excl, lengths) + np.arange(total, dtype=np.int64)
    return src[idx]


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
