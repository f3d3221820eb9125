"""Pass 1's decoded blocks: ``<out>/.counts/<part>.decoded.arrow``, read back by pass 2, so an input
file is parsed once in vocabulary mode (as ``preprocess criteo``'s ``.decoded`` files).

Pass 1 (:func:`dlrmctl.data.logs.preprocess.count_task`) writes every good row of a file, already
decoded (:class:`dlrmctl.data.logs.transform.Decoded`), one record batch per block that kept a row;
pass 2 reads them back in order instead of parsing the file again, then deletes the file.  The
marker ``<part>.decoded.json`` (written last) holds pass 1's fingerprint and the bad lines skipped:
a cache counts only with a matching marker, else pass 2 parses the input (resume, or a pass 1
reused from an earlier run).

Columns: ``key`` int64 (the row key); ``label`` float32; ``time`` int64; ``group``, ``order`` int64
(a per-group split's keys); ``d<i>`` per dense column
(float64 for ``standardize``, else float32: the value ``dense_values`` casts to float32 anyway);
``k<f>`` per categorical column (uint32 for a one-hot ``parse: hex`` column, whose keys are 32-bit,
else int64; a ``list`` for a multi-valued one) with ``p<f>`` bool present (one-hot) and ``w<f>``
float32 weights.  Bytes per row: about ``12 + 4 * dense + 4.1 * hex categoricals`` (Criteo's 40
columns: 171, 0.7x its TSV).  Read with plain file reads, one batch at a time (no memory map: the
pages read do not stay in the process's RSS).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.data.columnar import write_json_atomic
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.transform import CategoricalValues, Decoded

__all__ = ["DecodedCache", "read_cache", "remove_cache"]

CACHE_FORMAT = 1


def _paths(out_dir: str | os.PathLike, part: str) -> tuple[Path, Path]:
    d = Path(out_dir) / ".counts"
    return d / f"{part}.decoded.arrow", d / f"{part}.decoded.json"


def _schema(s: LogSchema) -> pa.Schema:
    fields = [pa.field("key", pa.int64())]
    if s.label is not None:
        fields.append(pa.field("label", pa.float32()))
    if s.time:
        fields.append(pa.field("time", pa.int64()))
    if s.split is not None and s.split.group:  # a per-group split's keys (dlrmctl.data.logs.split)
        fields += [pa.field("group", pa.int64()), pa.field("order", pa.int64())]
    fields += [pa.field(f"d{i}", pa.float64() if d.transform == "standardize" else pa.float32())
               for i, d in enumerate(s.dense)]
    for f, c in enumerate(s.categorical):
        if c.multi:
            fields.append(pa.field(f"k{f}", pa.list_(pa.int64())))
            if c.weights:
                fields.append(pa.field(f"w{f}", pa.list_(pa.float32())))
        else:
            fields.append(pa.field(f"k{f}", pa.uint32() if c.parse == "hex" and c.mode != "raw" else pa.int64()))
            fields.append(pa.field(f"p{f}", pa.bool_()))
            if c.weights:
                fields.append(pa.field(f"w{f}", pa.float32()))
    return pa.schema(fields)


def _offsets(lengths: np.ndarray) -> pa.Array:
    offs = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offs[1:])
    return pa.array(offs)


class DecodedCache:
    """Writes one file's decoded blocks (built in ``<name>.tmp``, renamed by :meth:`close`).

    Args:
        out_dir: the preprocess output directory.
        part: the input file's part name.
        schema: the log schema.
    """

    def __init__(self, out_dir: str | os.PathLike, part: str, schema: LogSchema) -> None:
        self.path, self.marker = _paths(out_dir, part)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.marker.unlink(missing_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._schema = _schema(schema)
        self._spec = schema
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._writer = ipc.new_file(self._sink, self._schema)
        self.bad = 0

    def write(self, d: Decoded) -> None:
        """Append a decoded block (its bad rows are counted; a block without rows writes nothing)."""
        self.bad += d.bad
        if not len(d.keys):
            return
        cols = [pa.array(d.keys, pa.int64())]
        if d.label is not None:
            cols.append(pa.array(d.label, pa.float32()))
        if d.time is not None:
            cols.append(pa.array(d.time, pa.int64()))
        if d.group is not None:
            cols += [pa.array(d.group, pa.int64()), pa.array(d.order, pa.int64())]
        for spec, x in zip(self._spec.dense, d.dense):
            cols.append(pa.array(x) if spec.transform == "standardize" else pa.array(x.astype(np.float32)))
        for spec, v in zip(self._spec.categorical, d.categorical):
            if spec.multi:
                offs = _offsets(v.lengths)
                cols.append(pa.ListArray.from_arrays(offs, pa.array(v.keys, pa.int64())))
                if spec.weights:
                    cols.append(pa.ListArray.from_arrays(offs, pa.array(v.weights, pa.float32())))
            else:
                cols.append(pa.array(v.keys.astype(np.uint32) if spec.parse == "hex" and spec.mode != "raw"
                                     else v.keys, self._schema.field(len(cols)).type))
                cols.append(pa.array(v.present, pa.bool_()))
                if spec.weights:
                    cols.append(pa.array(v.weights, pa.float32()))
        self._writer.write_batch(pa.record_batch(cols, schema=self._schema))

    def close(self, fingerprint: str) -> None:
        """Finish the file and write the marker (pass 1's ``fingerprint``, the bad lines)."""
        self._writer.close()
        self._sink.close()
        os.replace(self._tmp, self.path)
        write_json_atomic(self.marker, {"format": CACHE_FORMAT, "fingerprint": fingerprint, "bad": self.bad})

    def abort(self) -> None:
        """Drop the unfinished file."""
        try:
            self._writer.close()
            self._sink.close()
        except (OSError, pa.ArrowException):
            pass
        self._tmp.unlink(missing_ok=True)


def read_cache(out_dir: str | os.PathLike, part: str, fingerprint: str,
               schema: LogSchema) -> Iterator[Decoded] | None:
    """The decoded blocks pass 1 wrote for ``part`` with ``fingerprint`` (then one empty block
    carrying the bad lines skipped), or None when there is no such complete cache."""
    path, marker = _paths(out_dir, part)
    try:
        st = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if st.get("format") != CACHE_FORMAT or st.get("fingerprint") != fingerprint or not path.is_file():
        return None
    return _blocks(path, schema, int(st.get("bad", 0)))


def _blocks(path: Path, s: LogSchema, bad: int) -> Iterator[Decoded]:
    from dlrmctl.data.criteo.parallel import report_rows

    with pa.OSFile(str(path), "rb") as f:
        reader = ipc.open_file(f)
        for i in range(reader.num_record_batches):
            rb = reader.get_batch(i)
            col = dict(zip(rb.schema.names, rb.columns))
            cats = []
            for f_, spec in enumerate(s.categorical):
                k = col[f"k{f_}"]
                w = col.get(f"w{f_}")
                if spec.multi:
                    lengths = np.diff(k.offsets.to_numpy()).astype(np.int64)
                    keys = k.flatten().to_numpy()
                    cats.append(CategoricalValues(keys, np.ones(len(keys), bool), lengths,
                                                  None if w is None else w.flatten().to_numpy()))
                else:
                    cats.append(CategoricalValues(k.to_numpy().astype(np.int64, copy=False),
                                                  col[f"p{f_}"].to_numpy(zero_copy_only=False), None,
                                                  None if w is None else w.to_numpy()))
            d = Decoded(col["key"].to_numpy(), col["label"].to_numpy() if "label" in col else None,
                        [col[f"d{j}"].to_numpy() for j in range(len(s.dense))],
                        col["time"].to_numpy() if "time" in col else None, cats, 0,
                        *((col["group"].to_numpy(), col["order"].to_numpy()) if "group" in col else ()))
            report_rows(rb.num_rows)
            yield d
    report_rows(bad)
    yield Decoded(np.zeros(0, np.int64), None, [], None, [], bad)


def remove_cache(out_dir: str | os.PathLike, part: str) -> None:
    """Delete ``part``'s cache and marker (after pass 2 wrote the part)."""
    for p in _paths(out_dir, part):
        p.unlink(missing_ok=True)
