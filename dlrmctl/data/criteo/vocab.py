"""Criteo categorical vocabularies: count, merge one feature at a time, look ids up by hash.

Three steps, each bounded in memory:

1. **Count** (:func:`count_file`, one input file per task, in the worker pool): the file is
   parsed (the only time it is), the raw values of its *train* rows are counted per feature and
   written to ``.counts/<part>.arrow`` as 26 record batches, batch ``f`` = feature ``C{f+1}``
   (columns ``value`` int64, ``count`` int64), and its decoded rows to ``.decoded/<part>.arrow``
   (:mod:`dlrmctl.data.criteo.decoded`) for the transform pass.  A worker holds the counts of one
   file at a time.
2. **Merge** (:func:`build_vocab`, in the parent): for each feature in turn, batch ``f`` of every
   count file is read (memory-mapped, only that batch) and summed, a few files at a time; values
   with ``count >= T`` are kept and ordered by descending count, ties by ascending value, and
   written to ``vocab/<feature>.arrow`` (row ``i`` = id ``i``).  Only one feature's counts are
   ever in memory, so the peak is set by the largest feature, not by the sum of all 26.
3. **Look up** (:class:`HashLookup`, :class:`VocabSet`): a worker loads a feature's vocabulary
   the first time it needs it, once per process, into an open-addressing hash table.

The result is the same as counting every train row of every file at once (the merge is a sum;
the order is a total order), which ``tests/data/test_data_criteo.py`` checks against a plain
reference implementation.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dlrmctl.data.criteo import decoded as _decoded
from dlrmctl.data.criteo.parallel import report_rows
from dlrmctl.data.criteo.parse import NUM_SPARSE, SPARSE_FEATURES, FileTask, read_blocks, split_of_block
from dlrmctl.data.file_cache import FileCache

__all__ = ["COUNTS_FORMAT", "HashLookup", "VocabSet", "build_vocab", "clear_cache", "count_file", "merge_counts",
           "write_count_file"]

#: version of the ``.counts/<part>.arrow`` layout (part of the count pass's resume fingerprint)
COUNTS_FORMAT = 3  # 3: pass 1 also writes .decoded/<part>.arrow
#: count files merged together at a time per feature (bounds the merge's transient memory)
MERGE_FAN_IN = 4
_COUNT_SCHEMA = pa.schema([("value", pa.int64()), ("count", pa.int64())])
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: Fibonacci hashing (Knuth, TAOCP 6.4)
_LOW32 = np.uint64(0xFFFFFFFF)


# =============================================================================== lookup
class HashLookup:
    """Open-addressing hash table ``32-bit value -> id`` (linear probing, vectorised with numpy).

    Each slot is one uint64: ``value << 32 | (id + 1)`` (0 = empty), so one gather gives both the
    key and the id.  The table has ``2^k >= 2 V`` slots (load factor <= 1/2; 16-32 bytes per
    entry); the home slot of ``v`` is the top ``k`` bits of ``v * 0x9E3779B97F4A7C15 mod 2^64``
    (Fibonacci hashing).  A lookup costs about 1.5 probes per present value and 2.5 per absent one
    (Knuth, TAOCP vol. 3, 6.4, linear probing at load 1/2), against ``log2 V`` (25 at 40M) cache
    misses for a sorted search.

    Args:
        values: ``[V]`` int64 distinct values in ``[0, 2^32)``; ``values[i]`` gets id ``i``.

    Raises:
        ValueError: a value outside ``[0, 2^32)`` or a duplicate value.
    """

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        self.size = v_count = len(values)
        bits = max(4, int(np.ceil(np.log2(2 * v_count)))) if v_count else 4
        self._shift = np.uint64(64 - bits)
        self._mask = (1 << bits) - 1
        self._table = np.zeros(1 << bits, dtype=np.uint64)
        if v_count == 0:
            return
        if int(values.min()) < 0 or int(values.max()) >= 1 << 32:
            raise ValueError(f"vocabulary values must be 32-bit (in [0, 2^32)), got "
                             f"[{int(values.min())}, {int(values.max())}]")
        keys = values.astype(np.uint64)
        entry = (keys << np.uint64(32)) | np.arange(1, v_count + 1, dtype=np.uint64)
        slot = self._home(keys)
        table = self._table
        pending = np.arange(v_count)
        while len(pending):
            s = slot[pending]
            occupant = table[s]
            free = occupant == 0
            if not free.all():
                blocked = pending[~free]
                dup = (occupant[~free] >> np.uint64(32)) == keys[blocked]
                if dup.any():
                    raise ValueError(f"duplicate vocabulary value {int(keys[blocked[dup][0]])}")
            cand, cs = pending[free], s[free]
            table[cs] = entry[cand]  # several candidates for one slot: exactly one of them lands
            won = table[cs] == entry[cand]
            lost = cand[~won]
            if len(lost):
                dup = (table[cs[~won]] >> np.uint64(32)) == keys[lost]
                if dup.any():
                    raise ValueError(f"duplicate vocabulary value {int(keys[lost[dup][0]])}")
            pending = np.concatenate([pending[~free], lost])
            slot[pending] = (slot[pending] + 1) & self._mask

    def _home(self, h: np.ndarray) -> np.ndarray:
        return ((h * _GOLDEN) >> self._shift).astype(np.intp)

    @property
    def nbytes(self) -> int:
        """Bytes held by the table (``8 * slots``)."""
        return int(self._table.nbytes)

    def lookup(self, h: np.ndarray) -> np.ndarray:
        """``[n]`` uint64 values -> ``[n]`` int64 ids; ``size`` (the out-of-vocabulary id) when absent."""
        h = np.asarray(h, dtype=np.uint64)
        out = np.full(len(h), self.size, dtype=np.int64)
        if self.size == 0 or len(h) == 0:
            return out
        table = self._table
        slot = self._home(h)
        hk = h << np.uint64(32)
        e = table[slot]
        # y = (e ^ h << 32) - 1 (mod 2^64) is the id when the slot holds h (then e ^ h << 32 = id + 1
        # in [1, 2^32)), and >= 2^32 - 1 otherwise (another key, or an empty slot: 0 - 1 wraps)
        y = (e ^ hk) - np.uint64(1)
        hit = y < _LOW32
        np.copyto(out, y.view(np.int64), where=hit)
        go = (e != 0) & ~hit  # occupied by another value: probe on
        idx = np.flatnonzero(go)
        hk = hk[idx]
        slot = slot[idx]
        while len(idx):
            slot = (slot + 1) & self._mask
            e = table[slot]
            y = (e ^ hk) - np.uint64(1)
            hit = y < _LOW32
            if hit.any():
                out[idx[hit]] = y[hit].view(np.int64)
            go = (e != 0) & ~hit
            idx, hk, slot = idx[go], hk[go], slot[go]
        return out


def _read_vocab(path: Path) -> HashLookup:
    from dlrmctl.data.columnar import DataError

    try:
        values = ipc.open_file(pa.memory_map(str(path))).read_all().column("value").to_numpy()
    except (OSError, pa.ArrowInvalid, KeyError) as e:
        raise DataError(f"cannot read vocabulary (expected an Arrow file with an int64 'value' "
                        f"column): {e}", path=path) from None
    try:
        return HashLookup(values)
    except ValueError as e:  # a damaged vocabulary: a value outside 32 bits or listed twice
        raise DataError(f"not a vocabulary: {e}", path=path) from None


#: the vocabularies this process has loaded, by file version; those of one data directory at a time
_CACHE: FileCache[HashLookup] = FileCache(_read_vocab, one_dir=True)


def clear_cache() -> None:
    """Drop the vocabularies this process has loaded (they are reloaded on the next use)."""
    _CACHE.clear()


class VocabSet:
    """The 26 vocabularies of a preprocessed directory, each loaded on first use, once per process.

    Args:
        paths: 26 paths of ``vocab/<feature>.arrow`` files, in ``C1..C26`` order.

    ``vocabs[f]`` is the :class:`HashLookup` of feature ``f`` (``.size`` = V, ``.lookup``).

    Raises:
        DataError: (on first use of a feature) its file is missing or is not a vocabulary (not an
            Arrow file with an int64 ``value`` column, a value outside ``[0, 2^32)`` or a duplicate).
    """

    def __init__(self, paths: list[Path]) -> None:
        if len(paths) != NUM_SPARSE:
            raise ValueError(f"expected {NUM_SPARSE} vocabulary paths, got {len(paths)}")
        self.paths = [Path(p) for p in paths]
        self._tables: list[HashLookup | None] = [None] * NUM_SPARSE

    @classmethod
    def of_dir(cls, vocab_dir: str | os.PathLike) -> "VocabSet":
        """The vocabularies ``vocab_dir/C1.arrow .. C26.arrow``."""
        return cls([Path(vocab_dir) / f"{n}.arrow" for n in SPARSE_FEATURES])

    def __getitem__(self, f: int) -> HashLookup:
        t = self._tables[f]
        if t is None:
            t = self._tables[f] = _CACHE.get(self.paths[f])
        return t


# =============================================================================== pass 1: parse, count, keep
def count_file(task: FileTask) -> str:
    """Pass 1 of vocabulary mode: parse one input file once, count its train rows' values, keep its rows.

    Writes, each atomically (temp file + rename):

    * ``.counts/<part>.arrow``: 26 record batches, batch ``f`` for feature ``C{f+1}`` (``value``
      int64, ``count`` int64, distinct values, any order), and ``.counts/<part>.done`` holding the
      task's fingerprint;
    * ``.decoded/<part>.arrow`` and its marker: every good row, decoded (split code, label, dense
      float32, categorical uint32 + missing bits; :mod:`dlrmctl.data.criteo.decoded`, at most
      :data:`~dlrmctl.data.criteo.decoded.BYTES_PER_ROW` bytes per row), which pass 2 maps to ids
      instead of parsing the TSV again.

    Both are reused when their fingerprint matches (resume); a file is parsed again when either is
    stale or missing.

    Returns:
        The count file's path.

    Raises:
        DataError: a bad line (``path:line: field X: ...``) when ``on_bad_line='error'``.
    """
    out = Path(task.out_dir) / ".counts" / f"{task.part}.arrow"
    done = out.with_suffix(".done")
    dec_path, dec_marker = _decoded.decoded_paths(task.out_dir, task.part)
    if (done.is_file() and done.read_text() == task.fingerprint and out.is_file()
            and _decoded.read_marker(task.out_dir, task.part, task.fingerprint) is not None):
        report_rows(-1)  # nothing to do; tells the progress that one file was skipped
        return str(out)
    _decoded.remove_decoded(task.out_dir, task.part)
    acc: list[list[pa.Table]] = [[] for _ in range(NUM_SPARSE)]
    writer = _decoded.DecodedWriter(dec_path, task.labelled)
    bad_lines = 0
    try:
        for blk in read_blocks(task):
            if blk is None:  # the careful reader restarts the file
                acc = [[] for _ in range(NUM_SPARSE)]
                writer.abort()
                writer = _decoded.DecodedWriter(dec_path, task.labelled)
                bad_lines = 0
                continue
            bad_lines += blk.bad_skipped
            if len(blk.lines) == 0:
                continue
            codes = split_of_block(task, blk)
            writer.write(codes, blk.label, blk.dense, blk.sparse_h, blk.sparse_present)
            train = codes == 0
            all_train = bool(train.all())
            for f in range(NUM_SPARSE):
                sel = blk.sparse_present[f] if all_train else train & blk.sparse_present[f]
                vc = pc.value_counts(pa.array(blk.sparse_h[f][sel].astype(np.int64)))
                acc[f].append(pa.table({"value": vc.field("values"), "count": vc.field("counts")}))
                if len(acc[f]) >= 64:
                    acc[f] = [merge_counts(acc[f])]
            report_rows(len(blk.lines))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    write_count_file(out, acc)
    _decoded.write_marker(dec_marker, task.fingerprint, writer.rows, bad_lines)
    done.write_text(task.fingerprint)
    return str(out)


def write_count_file(out: Path, acc: list[list[pa.Table]]) -> None:
    """Write one count file atomically: batch ``f`` = the merged counts of ``acc[f]`` (tables of
    ``value`` int64, ``count`` int64; emptied as they are written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, _COUNT_SCHEMA) as w:
        for f in range(len(acc)):
            t = merge_counts(acc[f]) if acc[f] else _COUNT_SCHEMA.empty_table()
            acc[f] = []
            batches = t.cast(_COUNT_SCHEMA).combine_chunks().to_batches()
            w.write_batch(batches[0] if batches else
                          pa.record_batch([pa.array([], pa.int64())] * 2, schema=_COUNT_SCHEMA))
    os.replace(tmp, out)


def merge_counts(tables: list[pa.Table]) -> pa.Table:
    """Sum counts of equal values: ``value`` int64, ``count`` int64 (distinct values)."""
    t = pa.concat_tables(tables).group_by("value").aggregate([("count", "sum")])
    return pa.table({"value": t.column("value"), "count": t.column("count_sum")})


def _feature_counts(count_file_path: str, f: int, num_features: int = NUM_SPARSE) -> pa.Table:
    """Batch ``f`` of a count file (memory-mapped: only that batch's pages are read)."""
    r = ipc.open_file(pa.memory_map(count_file_path))
    if r.num_record_batches != num_features:
        from dlrmctl.data.columnar import DataError

        raise DataError(f"count file has {r.num_record_batches} record batches, expected {num_features} "
                        "(one per feature); delete the .counts directory and rerun", path=count_file_path)
    return pa.Table.from_batches([r.get_batch(f)])


# =============================================================================== merge
def build_vocab(count_files: list[str], vocab_dir: Path, threshold: int | list[int | None],
                features: list[str] | None = None) -> list[dict]:
    """Merge the per-file counts one feature at a time; write ``vocab/<feature>.arrow``.

    For each feature: the counts of all files are summed (``MERGE_FAN_IN`` files at a time),
    values with ``count >= threshold`` are kept, ordered by descending count then ascending value
    (row ``i`` = id ``i``), and written atomically (temp file + rename).

    Args:
        count_files: paths written by :func:`count_file`.
        vocab_dir: output directory (created).
        threshold: minimum train count ``T`` (>= 1), or one per feature; a feature whose threshold is
            None is only counted (no file written: its ``size`` is 0).
        features: the features, in the count files' batch order (default Criteo's ``C1..C26``).

    Returns:
        Per feature ``{"size": V, "distinct_train_values": distinct values seen in train rows}``.

    Raises:
        DataError: a count file that does not have one batch per feature.
    """
    vocab_dir.mkdir(parents=True, exist_ok=True)
    features = SPARSE_FEATURES if features is None else list(features)
    thresholds = threshold if isinstance(threshold, list) else [threshold] * len(features)
    info = []
    for f, name in enumerate(features):
        merged: pa.Table | None = None
        for i in range(0, len(count_files), MERGE_FAN_IN):
            group = [_feature_counts(cf, f, len(features)) for cf in count_files[i:i + MERGE_FAN_IN]]
            merged = merge_counts(group + ([merged] if merged is not None else []))
        if merged is None or merged.num_rows == 0:
            values = np.zeros(0, np.int64)
            counts = np.zeros(0, np.int64)
        else:
            values = merged.column("value").to_numpy()
            counts = merged.column("count").to_numpy()
        del merged
        distinct = len(values)
        if thresholds[f] is None:
            info.append({"size": 0, "distinct_train_values": int(distinct)})
            continue
        keep = counts >= thresholds[f]
        values, counts = values[keep], counts[keep]
        order = np.lexsort((values, -counts))  # most frequent first, ties by value
        values, counts = values[order], counts[order]
        vt = pa.table({"value": pa.array(values, pa.int64()), "count": pa.array(counts, pa.int64())})
        path = vocab_dir / f"{name}.arrow"
        tmp = path.with_name(path.name + ".tmp")
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, vt.schema) as w:
            w.write_table(vt)
        os.replace(tmp, path)
        info.append({"size": int(len(values)), "distinct_train_values": int(distinct)})
    return info
