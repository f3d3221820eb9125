"""Writing a split's shards: :class:`ShardWriter` streams record batches into one Arrow IPC file
through a temporary renamed when complete (removed on failure).  Part of
:mod:`dlrmctl.data.columnar`, which re-exports every public name."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.data.columnar.format import DataError



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
