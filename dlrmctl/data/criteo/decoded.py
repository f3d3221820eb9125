"""Pass 1's decoded rows: ``<out>/.decoded/<part>.arrow``, read back by pass 2 (vocabulary mode).

In vocabulary mode the raw TSV is parsed once.  Pass 1 (:func:`dlrmctl.data.criteo.vocab.count_file`)
parses each input file, counts its train rows' categorical values and writes every good row,
already decoded, to a temporary Arrow IPC file; pass 2
(:func:`dlrmctl.data.criteo.preprocess.process_file`) memory-maps that file, maps the categorical
values to ids with the vocabulary and writes the final shards, then deletes it.

Layout: one record batch per CSV block that kept at least one row (so pass 2 writes exactly the
record batches a single pass would), columns

* ``split`` int8: 0 train, 1 val, 2 test (:func:`~dlrmctl.data.criteo.parse.split_of_block`);
* ``label`` float32 (labelled input only);
* ``I1..I13`` float32, already ``log(max(x, 0) + 1)``;
* ``C1..C26`` uint32, the decoded 8-hex-digit value, null where the field is empty (the Arrow
  validity bitmap, 1 bit per row; omitted in a batch where no value is missing).

Disk: at most :data:`BYTES_PER_ROW` bytes per labelled row (``1 + 4 + 13*4 + 26*4 + 26/8``;
160.25 without the label), plus per-batch padding and metadata (< 1 KiB per ~16k-row block), i.e.
about 0.7x the size of Kaggle-style TSV.  All parts' files exist together between the passes
(the vocabulary needs every file's counts), so a run needs that much free space in ``<out>``:
~0.72 TB for the 4.4 billion rows of Criteo 1TB; each is deleted once its part is written.

Next to it, ``<part>.json`` (written last) records the pass-1 fingerprint, the rows and the bad
lines skipped; a decoded file counts as complete only with a matching marker (resume).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.data.columnar import LABEL_COLUMN, DataError, ShardWriter, write_json_atomic
from dlrmctl.data.criteo.parse import DENSE_FEATURES, NUM_DENSE, NUM_SPARSE, SPARSE_FEATURES

__all__ = ["BYTES_PER_ROW", "DECODED_FORMAT", "DecodedBatch", "DecodedWriter", "decoded_paths",
           "decoded_schema", "read_decoded", "read_marker", "remove_decoded", "write_marker"]

#: version of the ``.decoded/<part>.arrow`` layout (part of pass 1's resume fingerprint)
DECODED_FORMAT = 1
#: upper bound of the decoded file's bytes per labelled row (split + label + dense + values + null bits)
BYTES_PER_ROW = 1 + 4 + 4 * NUM_DENSE + 4 * NUM_SPARSE + NUM_SPARSE / 8
SPLIT_COLUMN = "split"
DIR_NAME = ".decoded"


def decoded_schema(labelled: bool) -> pa.Schema:
    """Schema of a decoded file: ``split`` int8, [``label`` float32], ``I*`` float32, ``C*`` uint32 (nullable)."""
    fields = [pa.field(SPLIT_COLUMN, pa.int8(), nullable=False)]
    if labelled:
        fields.append(pa.field(LABEL_COLUMN, pa.float32(), nullable=False))
    fields += [pa.field(n, pa.float32(), nullable=False) for n in DENSE_FEATURES]
    fields += [pa.field(n, pa.uint32(), nullable=True) for n in SPARSE_FEATURES]
    return pa.schema(fields)


def decoded_paths(out_dir: str | os.PathLike, part: str) -> tuple[Path, Path]:
    """``(<out>/.decoded/<part>.arrow, <out>/.decoded/<part>.json)``: the rows and their marker."""
    d = Path(out_dir) / DIR_NAME
    return d / f"{part}.arrow", d / f"{part}.json"


def write_marker(marker: Path, fingerprint: str, rows: int, bad_lines: int) -> None:
    """Record a complete decoded file (atomic): its pass-1 fingerprint, rows and bad lines skipped."""
    write_json_atomic(marker, {"fingerprint": fingerprint, "rows": rows, "bad_lines": bad_lines,
                               "format": DECODED_FORMAT})


def read_marker(out_dir: str | os.PathLike, part: str, fingerprint: str) -> dict | None:
    """The marker of ``part``'s decoded file if it is complete for ``fingerprint``, else None."""
    path, marker = decoded_paths(out_dir, part)
    if not (marker.is_file() and path.is_file()):
        return None
    try:
        m = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return m if m.get("fingerprint") == fingerprint else None


def remove_decoded(out_dir: str | os.PathLike, part: str) -> None:
    """Delete ``part``'s decoded file and marker (marker first: never a marker without its file)."""
    path, marker = decoded_paths(out_dir, part)
    for p in (marker, path, path.with_name(path.name + ".tmp")):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


class DecodedWriter(ShardWriter):
    """Streams decoded blocks into ``path`` atomically (``path + '.tmp'`` renamed by :meth:`close`;
    :meth:`close` / :meth:`abort` are :class:`~dlrmctl.data.columnar.ShardWriter`'s).

    Args:
        path: the final ``.decoded/<part>.arrow`` path (parent created).
        labelled: whether rows have a label.
    """

    def __init__(self, path: Path, labelled: bool) -> None:
        super().__init__(path, decoded_schema(labelled))
        self.labelled = labelled

    def write(self, codes: np.ndarray, label: np.ndarray | None, dense: list[np.ndarray],
              sparse_h: list[np.ndarray], sparse_present: list[np.ndarray]) -> None:
        """Append one block of ``n > 0`` rows as one record batch.

        Args:
            codes: ``[n]`` int8 split codes.
            label: ``[n]`` float32 (labelled) or None.
            dense: 13 x ``[n]`` float32 transformed values.
            sparse_h: 26 x ``[n]`` uint64 decoded values (< 2^32; 0 where missing).
            sparse_present: 26 x ``[n]`` bool, False where the field was empty.
        """
        n = len(codes)
        arrays = [pa.array(codes, pa.int8())]
        if self.labelled:
            arrays.append(pa.array(label, pa.float32()))
        arrays += [pa.array(d, pa.float32()) for d in dense]
        for h, present in zip(sparse_h, sparse_present):
            h32 = pa.py_buffer(h.astype(np.uint32))
            missing = n - int(np.count_nonzero(present))
            valid = pa.py_buffer(np.packbits(present, bitorder="little")) if missing else None
            arrays.append(pa.Array.from_buffers(pa.uint32(), n, [valid, h32], null_count=missing))
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.rows += n


@dataclass
class DecodedBatch:
    """One record batch of a decoded file (arrays are views of the memory map where possible)."""

    codes: np.ndarray  # [n] int8 split codes
    label: np.ndarray | None  # [n] float32
    dense: list[np.ndarray]  # 13 x [n] float32
    sparse_h: list[np.ndarray]  # 26 x [n] uint32 (0 where missing)
    sparse_present: list[np.ndarray]  # 26 x [n] bool


def _u32(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    n, off = len(arr), arr.offset
    valid, data = arr.buffers()
    h = np.frombuffer(data, dtype=np.uint32, count=n, offset=off * 4)
    if valid is None or arr.null_count == 0:
        return h, np.ones(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(valid, dtype=np.uint8), count=off + n, bitorder="little")
    return h, bits[off:].view(bool)


def read_decoded(path: Path, labelled: bool) -> Iterator[DecodedBatch]:
    """Memory-map a decoded file and yield its record batches in order.

    Raises:
        DataError: the file is missing, unreadable, or has another schema (delete ``.decoded`` and rerun).
    """
    try:
        reader = ipc.open_file(pa.memory_map(str(path)))
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"cannot read pass 1's decoded rows: {e}; delete the {DIR_NAME} directory "
                        "and rerun", path=path) from None
    if not reader.schema.equals(decoded_schema(labelled)):
        raise DataError(f"decoded rows have schema {reader.schema}, expected {decoded_schema(labelled)}; "
                        f"delete the {DIR_NAME} directory and rerun", path=path)
    first_c = 1 + labelled + NUM_DENSE
    for i in range(reader.num_record_batches):
        rb = reader.get_batch(i)
        cols = rb.columns
        codes = cols[0].to_numpy()
        label = cols[1].to_numpy() if labelled else None
        dense = [c.to_numpy() for c in cols[1 + labelled:first_c]]
        hs, pres = [], []
        for c in cols[first_c:first_c + NUM_SPARSE]:
            h, p = _u32(c)
            hs.append(h)
            pres.append(p)
        yield DecodedBatch(codes, label, dense, hs, pres)
