"""Reading a shard: :class:`MappedShard`, one memory-mapped Arrow IPC file with vectorised row
gathers across its record batches.  Part of :mod:`dlrmctl.data.columnar`, which re-exports it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.data.columnar.format import DataError



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
        return jagged_gather(src, vstart, lengths), lengths

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


def jagged_gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``src[starts[i] : starts[i] + lengths[i]]`` for all i, vectorised -> ``[sum(lengths)]``."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=src.dtype)
    excl = np.cumsum(lengths) - lengths
    idx = np.repeat(starts - excl, lengths) + np.arange(total, dtype=np.int64)
    return src[idx]
