"""Criteo click logs (Kaggle ``train.txt``, 1TB ``day_N``) -> columnar shards + ``meta.json``.

Input lines: ``label \\t I1..I13 \\t C1..C26`` (40 fields), or 39 fields without the label
(Kaggle ``test.txt``).  Any field may be empty.  Files may be plain, ``.gz`` or ``.bz2``.

Transforms (all recorded in ``meta["transforms"]``):

* dense ``I1..I13``: empty -> 0, negative -> 0, then ``log(x + 1)`` as float32
  (Naumov et al. 2019, DLRM reference ``data_utils.py``: ``X_int[X_int < 0] = 0; log(X_int + 1)``).
  A negative input therefore gives 0.0, never ``-inf`` / NaN.
* categorical ``C1..C26``: 8 hex digits -> 32-bit integer ``h`` (``int(s, 16)``), then
    - hashing (``num_embeddings=N``): id ``h mod N``; empty -> the dedicated missing id ``N``;
      the table has ``N + 1`` rows.
    - vocabulary (``frequency_threshold=T``): values seen at least ``T`` times in the *train*
      split get ids ``0..V-1`` (most frequent first, ties by value); rarer or unseen values share
      the id ``V``; empty -> the missing id ``V + 1``; the table has ``V + 2`` rows.  The
      vocabulary is saved in ``vocab/<feature>.arrow`` (columns ``value`` int64, ``count`` int64,
      row ``i`` = id ``i``).
  The missing id is always the last row of the table.
* splits: by ratio (``val_ratio``, ``test_ratio``): a row goes to val / test / train by a
  splitmix64 hash of ``(seed, file name, line number)`` -> deterministic per row, independent of
  block sizes and worker counts; or by day (``split_by_day``): every ``day_N`` file but the
  highest-numbered one is train, the last one (``day_23`` in the 1TB layout) is split by
  position: its first half (``line <= ceil(L/2)``) is validation, the rest test
  (the TorchRec / MLPerf DLRMv2 convention).
* multi-hot (``multi_hot_sizes``): MLPerf DLRMv2 materialised multi-hot bags, see
  :func:`multi_hot_expand`.

Parsing is streamed with ``pyarrow.csv.open_csv`` (explicit column types, single-threaded per
worker) and every transform is vectorised (hex decode is a SWAR computation on 64-bit words);
nothing is held in memory beyond one CSV block per worker.
"""

from __future__ import annotations

import bz2
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.ipc as ipc

from dlrmctl.data.columnar import (
    FORMAT_VERSION,
    LABEL_COLUMN,
    SPLITS,
    DataError,
    ShardWriter,
    shard_schema,
    write_json_atomic,
    write_meta,
)

DENSE_FEATURES = [f"I{i}" for i in range(1, 14)]
SPARSE_FEATURES = [f"C{i}" for i in range(1, 27)]
NUM_DENSE = 13
NUM_SPARSE = 26
DEFAULT_FREQUENCY_THRESHOLD = 3
DEFAULT_BLOCK_SIZE = 4 << 20  # bytes of CSV per block (~16k Criteo lines; cache-friendly, fastest measured)
MULTI_HOT_CACHE_VECTORS = 1024
DLRM_LOG_SOURCE = "Naumov et al. 2019 (arXiv:1906.00091), DLRM reference data_utils.py: X_int[X_int<0]=0; log(X_int+1)"

__all__ = [
    "CriteoOptions",
    "PreprocessReport",
    "DENSE_FEATURES",
    "SPARSE_FEATURES",
    "dense_log1p",
    "expand_inputs",
    "hex_to_uint32",
    "multi_hot_expand",
    "preprocess_criteo",
    "row_split_codes",
]


# =============================================================================== vector kernels
def dense_log1p(values: np.ndarray) -> np.ndarray:
    """DLRM dense transform: ``log(max(x, 0) + 1)``.

    Args:
        values: ``[n]`` int64 raw counts (missing already replaced by 0).

    Returns:
        ``[n]`` float32; ``x <= 0`` gives exactly 0.0 (never -inf/NaN).

    Source: Naumov et al. 2019, DLRM reference ``data_utils.py`` (``X_int[X_int < 0] = 0``,
    ``np.log(X_int + 1)``).
    """
    x = np.maximum(values, 0).astype(np.float64)
    return np.log1p(x).astype(np.float32)


_U = np.uint64
_HIGH = _U(0x8080808080808080)


def _decode_hex8(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``[8k]`` uint8 bytes of ``k`` 8-character hex strings -> (uint64 ``[k]``, bad bool ``[k]``).

    SWAR on one big-endian 64-bit word per string (all steps are per byte, no carries):
    fold upper case to lower (``c |= (c & 0x40) >> 1``), nibble ``n = (c & 0xF) + 9 * (c >> 6 & 1)``,
    validity by re-encoding ``n`` as lowercase ASCII (``'0' + n`` or ``'a' + n - 10``, ``n <= 15``) and
    comparing with the input, then the eight nibbles are packed pairwise into 32 bits.
    Equivalent to ``int(s, 16)`` on ``[0-9a-fA-F]{8}`` (checked exhaustively in the tests).
    """
    v = raw.view(">u8").astype(np.uint64)
    b6 = v & _U(0x4040404040404040)
    v |= b6 >> _U(1)
    n = v & _U(0x0F0F0F0F0F0F0F0F)
    b6 >>= _U(6)
    b6 *= _U(9)
    n += b6
    t = n + _U(0x7676767676767676)
    t &= _HIGH  # n >= 10
    big = (n + _U(0x7070707070707070)) & _HIGH  # n >= 16: not a hex digit
    t >>= _U(7)
    t *= _U(0x27)
    t += n
    t += _U(0x3030303030303030)
    bad = (t != v) | (big != 0)
    x = n
    x |= x >> _U(4)
    x &= _U(0x00FF00FF00FF00FF)
    x |= x >> _U(8)
    x &= _U(0x0000FFFF0000FFFF)
    x |= x >> _U(16)
    x &= _U(0xFFFFFFFF)
    return x, bad


def hex_to_uint32(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Decode a Criteo categorical column.

    Args:
        arr: ``pa.binary()`` (or string) array of ``n`` values, each empty or 8 hex digits.

    Returns:
        ``(h, present, bad)``: ``h`` uint64 ``[n]`` the decoded values (``int(s, 16)``, 0 where
        empty or bad), ``present`` bool ``[n]`` (non-empty), ``bad`` bool ``[n]`` rows whose value
        is not exactly 8 hex digits, or None when there are none.
    """
    n = len(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lens = np.diff(offsets)
    present = lens != 0
    h = np.zeros(n, dtype=np.uint64)
    k = int(np.count_nonzero(present))
    start, end = int(offsets[0]), int(offsets[-1])
    if bool(((lens | 8) == 8).all()):
        raw = data[start:end]
        vals, badv = _decode_hex8(raw)
        h[present] = vals
        if not badv.any():
            return h, present, None
        bad = np.zeros(n, dtype=bool)
        bad[present] = badv
        return h, present, bad
    # some values are not 8 characters long: decode the 8-long ones, flag the rest
    ok8 = lens == 8
    bad = present & ~ok8
    if ok8.any():
        idx = offsets[:-1][ok8].astype(np.int64)[:, None] + np.arange(8)
        vals, badv = _decode_hex8(np.ascontiguousarray(data[idx]).reshape(-1))
        h[ok8] = vals
        bad[ok8] |= badv
    del k
    return h, present, bad


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (Steele et al. 2014) on uint64 ``[n]`` -> uint64 ``[n]``."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _file_key(name: str, seed: int) -> np.uint64:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(h, "little"))


def row_split_codes(lines: np.ndarray, file_name: str, seed: int, val_ratio: float,
                    test_ratio: float) -> np.ndarray:
    """Deterministic per-row split assignment.

    Args:
        lines: ``[n]`` int64 1-based physical line numbers in the file.
        file_name: the input file's base name (part of the hash key).
        seed: split seed.
        val_ratio, test_ratio: fractions in ``[0, 1)``, sum < 1.

    Returns:
        ``[n]`` int8 codes: 0 train, 1 val, 2 test.  Row ``u = splitmix64(key ^ line) / 2^64``
        goes to val if ``u < val_ratio``, test if ``u < val_ratio + test_ratio``, else train.
    """
    with np.errstate(over="ignore"):
        z = _splitmix64(lines.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03) ^ _file_key(file_name, seed))
    u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    codes = np.zeros(len(lines), dtype=np.int8)
    codes[u < val_ratio + test_ratio] = 2
    codes[u < val_ratio] = 1
    return codes


def multi_hot_expand(ids: np.ndarray, num_embeddings: int, size: int,
                     distribution: str = "uniform", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Turn one-hot ids into multi-hot bags of exactly ``size`` ids (MLPerf DLRMv2 style).

    Bag of id ``i``: ``[i, (i + o_1) mod N, ..., (i + o_{size-1}) mod N]`` where the offset vector
    ``o = offsets[i mod 1024]`` comes from a fixed table of 1024 random offset vectors drawn once
    from ``seed``: uniform in ``[0, N)`` or ``int(pareto(a=0.25)) mod N``.  This is the approach of
    MLPerf Training DLRMv2 (``torchrec_dlrm/multi_hot.py``: one-hot id plus cached random
    offsets, modulo the table size); the bag is a deterministic function of ``(i, seed)``.

    Args:
        ids: ``[n]`` int64 one-hot ids in ``[0, num_embeddings)``.
        num_embeddings: table rows ``N``.
        size: bag size (>= 1).
        distribution: ``"uniform"`` or ``"pareto"``.
        seed: seed of the offset table (use a different one per feature).

    Returns:
        ``(values [n * size] int64, lengths [n] int64)``; bags are contiguous per sample
        (sample ``j`` owns ``values[j*size:(j+1)*size]``), every value in ``[0, N)``.

    Raises:
        ValueError: ``size < 1``, ``num_embeddings < 1``, unknown distribution, or ids out of range.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if size < 1:
        raise ValueError(f"multi_hot_expand: size must be >= 1, got {size}")
    if num_embeddings < 1:
        raise ValueError(f"multi_hot_expand: num_embeddings must be >= 1, got {num_embeddings}")
    if distribution not in ("uniform", "pareto"):
        raise ValueError(f"multi_hot_expand: distribution must be 'uniform' or 'pareto', got {distribution!r}")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_embeddings):
        raise ValueError(f"multi_hot_expand: ids must be in [0, {num_embeddings}), got "
                         f"[{ids.min()}, {ids.max()}]")
    n = len(ids)
    lengths = np.full(n, size, dtype=np.int64)
    if size == 1:
        return ids.copy(), lengths
    rng = np.random.default_rng(seed)
    shape = (MULTI_HOT_CACHE_VECTORS, size - 1)
    if distribution == "uniform":
        offsets = rng.integers(0, num_embeddings, size=shape, dtype=np.int64)
    else:
        p = np.minimum(rng.pareto(0.25, size=shape), float(1 << 62))
        offsets = p.astype(np.int64) % num_embeddings
    out = np.empty((n, size), dtype=np.int64)
    out[:, 0] = ids
    out[:, 1:] = (ids[:, None] + offsets[ids % MULTI_HOT_CACHE_VECTORS]) % num_embeddings
    return out.reshape(-1), lengths


# =============================================================================== options / inputs
@dataclasses.dataclass
class CriteoOptions:
    """Options of :func:`preprocess_criteo` (see the module docstring for the semantics).

    Exactly one of ``num_embeddings`` (hashing) and ``frequency_threshold`` (vocabulary) may be
    set; with neither, a vocabulary with threshold :data:`DEFAULT_FREQUENCY_THRESHOLD` is built.
    """

    num_embeddings: list[int] | None = None  # 26 ints (one value is broadcast by the caller)
    frequency_threshold: int | None = None
    val_ratio: float = 0.0
    test_ratio: float = 0.0
    seed: int = 0
    split_by_day: bool = False
    on_bad_line: str = "error"  # "error" | "skip"
    multi_hot_sizes: list[int] | None = None
    multi_hot_distribution: str = "uniform"
    workers: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE

    def validate(self) -> None:
        """Raise ValueError naming the option when an option is inconsistent."""
        if self.num_embeddings is not None and self.frequency_threshold is not None:
            raise ValueError("--num-embeddings (hashing) and --frequency-threshold (vocabulary) "
                             "are exclusive; give one")
        if self.num_embeddings is not None:
            if len(self.num_embeddings) != NUM_SPARSE:
                raise ValueError(f"--num-embeddings: expected 1 or {NUM_SPARSE} values, got "
                                 f"{len(self.num_embeddings)}")
            if min(self.num_embeddings) < 1:
                raise ValueError(f"--num-embeddings: values must be >= 1, got {self.num_embeddings}")
        if self.frequency_threshold is not None and self.frequency_threshold < 1:
            raise ValueError(f"--frequency-threshold must be >= 1, got {self.frequency_threshold}")
        for name, r in (("--val-ratio", self.val_ratio), ("--test-ratio", self.test_ratio)):
            if not 0.0 <= r < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {r}")
        if self.val_ratio + self.test_ratio >= 1.0:
            raise ValueError(f"--val-ratio + --test-ratio must be < 1, got {self.val_ratio + self.test_ratio}")
        if self.split_by_day and (self.val_ratio or self.test_ratio):
            raise ValueError("--split-by-day and --val-ratio/--test-ratio are exclusive")
        if self.on_bad_line not in ("error", "skip"):
            raise ValueError(f"--on-bad-line must be 'error' or 'skip', got {self.on_bad_line!r}")
        if self.multi_hot_sizes is not None:
            if len(self.multi_hot_sizes) != NUM_SPARSE or min(self.multi_hot_sizes) < 1:
                raise ValueError(f"--multi-hot-sizes: expected {NUM_SPARSE} integers >= 1, got "
                                 f"{self.multi_hot_sizes}")
        if self.multi_hot_distribution not in ("uniform", "pareto"):
            raise ValueError("--multi-hot-distribution must be 'uniform' or 'pareto'")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")

    @property
    def mode(self) -> str:
        return "hash" if self.num_embeddings is not None else "vocab"

    @property
    def threshold(self) -> int:
        return self.frequency_threshold if self.frequency_threshold is not None else DEFAULT_FREQUENCY_THRESHOLD


_DAY_RE = re.compile(r"^day_(\d+)(?:\.[A-Za-z0-9]+)*$")


def expand_inputs(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve ``--input``: a file, a directory (all non-hidden regular files in it), or a glob.

    Returns:
        Sorted list of files (``day_N`` files sorted by N).

    Raises:
        DataError: nothing matches, or two inputs share a base name (their outputs would collide).
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    files: list[Path] = []
    for s in specs:
        p = Path(s)
        if p.is_dir():
            files += [f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")]
        elif p.is_file():
            files.append(p)
        else:
            matched = [Path(m) for m in glob.glob(str(s)) if Path(m).is_file()]
            if not matched:
                raise DataError("no such file, directory or glob match", path=s)
            files += matched

    def key(f: Path):
        m = _DAY_RE.match(f.name)
        return (0, int(m.group(1)), f.name) if m else (1, 0, f.name)

    files = sorted(set(files), key=key)
    if not files:
        raise DataError("no input files found", path=str(spec))
    names = [f.name for f in files]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DataError(f"several inputs share the base name(s) {sorted(dup)}; outputs are keyed by "
                        "base name, rename them", path=str(spec))
    return files


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def _num_fields(path: Path) -> int | None:
    """Field count of the first line (None for an empty file)."""
    with _open_text(path) as f:
        first = f.readline()
    if not first:
        return None
    return first.rstrip(b"\r\n").count(b"\t") + 1


def _count_lines(path: Path) -> int:
    """Number of lines (a last line without a newline counts)."""
    n = 0
    last = b"\n"
    with _open_text(path) as f:
        while True:
            b = f.read(16 << 20)
            if not b:
                break
            n += b.count(b"\n")
            last = b[-1:]
    return n + (last != b"\n")


# =============================================================================== reading blocks
_CONV_RE = re.compile(r"column #(\d+): Row #(\d+): CSV conversion error to \w+: invalid value '(.*)'", re.S)


class _NeedCareful(Exception):
    """Internal: the fast path met a non-integer dense value in skip mode; redo the file carefully."""


@dataclasses.dataclass
class _Block:
    lines: np.ndarray  # [n] int64 physical 1-based line numbers
    label: np.ndarray | None  # [n] float32
    dense: list[np.ndarray]  # 13 x [n] float32
    sparse_h: list[np.ndarray]  # 26 x [n] uint64 decoded hashes
    sparse_present: list[np.ndarray]  # 26 x [n] bool
    bad_skipped: int


class _BlockReader:
    """Streams one Criteo file as vectorised blocks; validates and reports bad lines.

    Args:
        path: input file.
        labelled: 40 fields (True) or 39 (False).
        on_bad_line: "error" raises :class:`DataError` at the first bad line; "skip" drops it.
        careful: read dense fields as bytes and validate them (needed to *skip* bad integers;
            the default fast path lets Arrow convert them and reports the first error).
    """

    def __init__(self, path: Path, labelled: bool, on_bad_line: str, careful: bool, block_size: int):
        self.path = path
        self.labelled = labelled
        self.on_bad_line = on_bad_line
        self.careful = careful
        self.block_size = block_size
        self.names = ([LABEL_COLUMN] if labelled else []) + DENSE_FEATURES + SPARSE_FEATURES
        self.bad_lines = 0
        self._skipped: list[int] = []  # physical lines dropped by the parser (wrong field count)
        self._first_error: tuple[int, str] | None = None

    def _invalid_row(self, row) -> str:
        msg = f"expected {len(self.names)} tab-separated fields, got {row.actual_columns}"
        if self.on_bad_line == "error" and self._first_error is None:
            self._first_error = (row.number, msg)
        self._skipped.append(row.number)
        return "skip"

    def _raise_parse_error(self) -> None:
        if self._first_error is not None:
            line, msg = self._first_error
            raise DataError(msg, path=self.path, line=line)

    def _arrow_error(self, e: Exception) -> None:
        """Turn Arrow's parse/convert error into a DataError (or a careful-mode restart in skip mode)."""
        self._raise_parse_error()
        m = _CONV_RE.search(str(e))
        if m is None:
            raise DataError(f"cannot parse: {e}", path=self.path) from None
        if self.on_bad_line == "skip":
            raise _NeedCareful() from None
        field = self.names[int(m.group(1))]
        what = "0 or 1" if field == LABEL_COLUMN else "an integer"
        raise DataError(f"expected {what}, got '{m.group(3)}'", path=self.path,
                        line=int(m.group(2)), field=field) from None

    def __iter__(self) -> Iterator[_Block]:
        int_t = pa.binary() if self.careful else pa.int64()
        types = {n: (pa.binary() if n.startswith("C") else int_t) for n in self.names}
        try:
            reader = pa_csv.open_csv(
                str(self.path),
                read_options=pa_csv.ReadOptions(column_names=self.names, use_threads=False,
                                                block_size=self.block_size),
                parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                                  ignore_empty_lines=False,
                                                  invalid_row_handler=self._invalid_row),
                convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                                      check_utf8=False, quoted_strings_can_be_null=False),
            )
        except pa.ArrowInvalid as e:
            self._arrow_error(e)
        next_line = 1
        sk_pos = 0
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as e:
                self._arrow_error(e)
            self._raise_parse_error()
            n = rb.num_rows
            # physical line numbers of this block's rows: skip lines the parser dropped
            while sk_pos < len(self._skipped) and self._skipped[sk_pos] < next_line:
                sk_pos += 1
            pending = self._skipped[sk_pos:]
            if not pending:
                lines = np.arange(next_line, next_line + n, dtype=np.int64)
            else:
                cand = np.arange(next_line, next_line + n + len(pending), dtype=np.int64)
                lines = cand[~np.isin(cand, np.asarray(pending, dtype=np.int64))][:n]
            if n:
                next_line = int(lines[-1]) + 1
            if n == 0:
                continue
            blk = self._convert(rb, lines)
            consumed = sk_pos
            while consumed < len(self._skipped) and self._skipped[consumed] < next_line:
                consumed += 1
            blk.bad_skipped += consumed - sk_pos
            sk_pos = consumed
            yield blk
        rest = len(self._skipped) - sk_pos
        if rest:  # bad lines after the last good row
            z = np.zeros(0, dtype=np.int64)
            yield _Block(z, np.zeros(0, np.float32) if self.labelled else None, [], [], [], rest)

    def _bad(self, mask: np.ndarray, lines: np.ndarray, field: str, what: str, values: pa.Array) -> np.ndarray:
        """Handle rows ``mask`` bad in ``field``: raise (error mode) or return the mask (skip)."""
        if self.on_bad_line == "error":
            i = int(np.flatnonzero(mask)[0])
            got = values[i].as_py()
            got = got.decode("utf-8", "replace") if isinstance(got, bytes) else got
            raise DataError(f"expected {what}, got '{got}'", path=self.path, line=int(lines[i]), field=field)
        return mask

    def _convert(self, rb: pa.RecordBatch, lines: np.ndarray) -> _Block:
        n = rb.num_rows
        drop = np.zeros(n, dtype=bool)
        cols = dict(zip(self.names, rb.columns))

        def ints(name: str) -> np.ndarray:
            col = cols[name]
            if self.careful:
                ok = pc.match_substring_regex(col, r"^-?[0-9]{1,18}$")
                ok_np = ok.to_numpy(zero_copy_only=False)
                empty = pc.equal(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
                badm = ~ok_np & ~empty
                if badm.any():
                    drop[:] |= self._bad(badm, lines, name, "0 or 1" if name == LABEL_COLUMN else "an integer", col)
                col = pc.cast(pc.if_else(ok, col, pa.scalar(b"0", pa.binary())).view(pa.string()), pa.int64())
            else:
                if col.null_count:
                    col = pc.fill_null(col, 0)
            return col.to_numpy(zero_copy_only=False)

        label = None
        if self.labelled:
            lab = ints(LABEL_COLUMN)
            empty = (pc.is_null(cols[LABEL_COLUMN]) if not self.careful else
                     pc.equal(pc.binary_length(cols[LABEL_COLUMN]), 0)).to_numpy(zero_copy_only=False)
            badl = ((lab != 0) & (lab != 1)) | empty
            badl &= ~drop
            if badl.any():
                drop |= self._bad(badl, lines, LABEL_COLUMN, "0 or 1", cols[LABEL_COLUMN])
            label = lab.astype(np.float32)
        dense = [dense_log1p(ints(name)) for name in DENSE_FEATURES]
        hs, pres = [], []
        for name in SPARSE_FEATURES:
            h, present, badc = hex_to_uint32(cols[name])
            if badc is not None:
                badc &= ~drop
                if badc.any():
                    drop |= self._bad(badc, lines, name, "8 hex digits", cols[name])
            hs.append(h)
            pres.append(present)
        nbad = int(drop.sum())
        if nbad:
            keep = ~drop
            lines = lines[keep]
            label = label[keep] if label is not None else None
            dense = [d[keep] for d in dense]
            hs = [h[keep] for h in hs]
            pres = [p[keep] for p in pres]
        return _Block(lines, label, dense, hs, pres, nbad)


# =============================================================================== per-file work
@dataclasses.dataclass
class _FileTask:
    path: str
    part: str  # output part name (the base name)
    role: str  # "ratio" | "train" | "valtest" | "unlabelled"
    labelled: bool
    out_dir: str
    opts: CriteoOptions
    fingerprint: str
    vocab_dir: str | None = None
    table_sizes: list[int] | None = None
    valtest_first: int = 0  # rows of the last day going to val


_PROGRESS_Q = None


def _init_worker(q) -> None:
    global _PROGRESS_Q
    _PROGRESS_Q = q
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def _report(rows: int) -> None:
    if _PROGRESS_Q is not None:
        _PROGRESS_Q.put(rows)


def _split_of_block(task: _FileTask, blk: _Block) -> np.ndarray:
    o = task.opts
    n = len(blk.lines)
    if task.role == "ratio":
        return row_split_codes(blk.lines, task.part, o.seed, o.val_ratio, o.test_ratio)
    if task.role == "train":
        return np.zeros(n, dtype=np.int8)
    if task.role == "unlabelled":
        return np.full(n, 2, dtype=np.int8)
    # valtest: first valtest_first physical lines -> val, the rest -> test
    return np.where(blk.lines <= task.valtest_first, 1, 2).astype(np.int8)


def _read_blocks(task: _FileTask) -> Iterator[_Block]:
    """Blocks of the file; in skip mode falls back to the careful reader on a bad integer."""
    careful = False
    while True:
        r = _BlockReader(Path(task.path), task.labelled, task.opts.on_bad_line, careful, task.opts.block_size)
        try:
            for blk in r:
                yield blk
            return
        except _NeedCareful:
            careful = True
            yield None  # tells the consumer to discard what it has written and restart


class _Vocab:
    """Sorted lookup ``raw hash -> id`` for one feature (ids by descending frequency)."""

    def __init__(self, path: Path) -> None:
        t = ipc.open_file(pa.memory_map(str(path))).read_all()
        values = t.column("value").to_numpy()
        order = np.argsort(values, kind="stable")
        self.sorted_values = values[order].astype(np.uint64)
        self.sorted_ids = order.astype(np.int64)
        self.size = len(values)

    def lookup(self, h: np.ndarray) -> np.ndarray:
        """``[n]`` uint64 raw hashes -> ``[n]`` int64 ids, ``size`` (the OOV id) when absent."""
        if self.size == 0:
            return np.zeros(len(h), dtype=np.int64)
        pos = np.searchsorted(self.sorted_values, h)
        pos_c = np.minimum(pos, self.size - 1)
        hit = self.sorted_values[pos_c] == h
        return np.where(hit, self.sorted_ids[pos_c], self.size)


def _ids_of_block(task: _FileTask, blk: _Block, vocabs: list[_Vocab] | None) -> list[np.ndarray]:
    out = []
    for f in range(NUM_SPARSE):
        h, present = blk.sparse_h[f], blk.sparse_present[f]
        if task.opts.mode == "hash":
            nb = task.opts.num_embeddings[f]
            ids = (h % np.uint64(nb)).astype(np.int64)
            ids[~present] = nb
        else:
            ids = vocabs[f].lookup(h)
            ids[~present] = vocabs[f].size + 1
        out.append(ids)
    return out


def _process_file(task: _FileTask) -> dict:
    """Transform one input file into ``parts/<part>/{train,val,test}.arrow`` + ``done.json``.

    Writes into ``parts/<part>.tmp`` and renames it when complete, so a crash leaves no
    half-finished part that could be taken for a finished one.
    """
    t0 = time.perf_counter()
    o = task.opts
    parts = Path(task.out_dir) / "parts"
    final = parts / task.part
    tmp = parts / (task.part + ".tmp")
    vocabs = None
    if o.mode == "vocab":
        vocabs = [_Vocab(Path(task.vocab_dir) / f"{n}.arrow") for n in SPARSE_FEATURES]
    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    schema = shard_schema(DENSE_FEATURES, SPARSE_FEATURES, [s > 1 for s in mh], labelled=task.labelled)

    def fresh():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return {s: ShardWriter(tmp / f"{s}.arrow", schema) for s in SPLITS}

    writers = fresh()
    stats = _new_stats()
    reported = 0
    try:
        for blk in _read_blocks(task):
            if blk is None:  # restart in careful mode
                for w in writers.values():
                    w.abort()
                writers = fresh()
                stats = _new_stats()
                continue
            stats["bad_lines"] += blk.bad_skipped
            if len(blk.lines) == 0:
                continue
            codes = _split_of_block(task, blk)
            ids = _ids_of_block(task, blk, vocabs)
            for f in range(NUM_SPARSE):
                stats["missing"][f] += int(len(ids[f]) - np.count_nonzero(blk.sparse_present[f]))
            for si, split in enumerate(SPLITS):
                sel = codes == si
                k = int(np.count_nonzero(sel))
                if k == 0:
                    continue
                allsel = k == len(codes)
                pick = (lambda a: a) if allsel else (lambda a: a[sel])
                cols: dict[str, Any] = {}
                if task.labelled:
                    lab = pick(blk.label)
                    cols[LABEL_COLUMN] = lab
                    stats["positives"][split] += int(lab.sum())
                for name, d in zip(DENSE_FEATURES, blk.dense):
                    cols[name] = pick(d)
                for f, name in enumerate(SPARSE_FEATURES):
                    x = pick(ids[f])
                    if mh[f] > 1:
                        vals, _ = multi_hot_expand(x, task.table_sizes[f], mh[f], o.multi_hot_distribution,
                                                   seed=o.seed * 1000 + f)
                        offs = np.arange(0, (k + 1) * mh[f], mh[f], dtype=np.int32)
                        cols[name] = pa.ListArray.from_arrays(pa.array(offs), pa.array(vals))
                    else:
                        cols[name] = x
                writers[split].write(cols)
                stats["rows"][split] += k
            nrows = len(blk.lines)
            reported += nrows
            _report(nrows)
        for w in writers.values():
            w.close()
        stats["seconds"] = time.perf_counter() - t0
        stats["fingerprint"] = task.fingerprint
        stats["input"] = task.path
        write_json_atomic(tmp / "done.json", stats)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        for w in writers.values():
            try:
                w.abort()
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def _new_stats() -> dict:
    return {"rows": {s: 0 for s in SPLITS}, "positives": {s: 0 for s in SPLITS},
            "missing": [0] * NUM_SPARSE, "bad_lines": 0}


# ---------------------------------------------------------------------------- vocabulary pass
def _count_file(task: _FileTask) -> str:
    """Count raw categorical values of the train rows of one file -> ``.counts/<part>.arrow``."""
    out = Path(task.out_dir) / ".counts" / f"{task.part}.arrow"
    done = out.with_suffix(".done")
    if done.is_file() and done.read_text() == task.fingerprint and out.is_file():
        _report(-1)  # nothing to do; tells the progress that one file was skipped
        return str(out)
    acc: list[list[pa.Table]] = [[] for _ in range(NUM_SPARSE)]
    careful_restart = False
    for blk in _read_blocks(task):
        if blk is None:
            acc = [[] for _ in range(NUM_SPARSE)]
            careful_restart = True
            continue
        if len(blk.lines) == 0:
            continue
        codes = _split_of_block(task, blk)
        train = codes == 0
        for f in range(NUM_SPARSE):
            sel = train & blk.sparse_present[f]
            vc = pc.value_counts(pa.array(blk.sparse_h[f][sel].astype(np.int64)))
            acc[f].append(pa.table({"value": vc.field("values"), "count": vc.field("counts")}))
            if len(acc[f]) >= 64:
                acc[f] = [_merge_counts(acc[f])]
        _report(len(blk.lines))
    del careful_restart
    tables = []
    for f in range(NUM_SPARSE):
        t = _merge_counts(acc[f]) if acc[f] else pa.table({"value": pa.array([], pa.int64()),
                                                          "count": pa.array([], pa.int64())})
        tables.append(pa.table({"feature": pa.array(np.full(t.num_rows, f, dtype=np.int32)),
                                "value": t.column("value"), "count": t.column("count")}))
    table = pa.concat_tables(tables)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    os.replace(tmp, out)
    done.write_text(task.fingerprint)
    return str(out)


def _merge_counts(tables: list[pa.Table]) -> pa.Table:
    t = pa.concat_tables(tables).group_by("value").aggregate([("count", "sum")])
    return pa.table({"value": t.column("value"), "count": t.column("count_sum")})


def _build_vocab(count_files: list[str], vocab_dir: Path, threshold: int) -> list[dict]:
    """Merge per-file counts; keep values with count >= threshold; write ``vocab/<C>.arrow``."""
    per_feature: list[list[pa.Table]] = [[] for _ in range(NUM_SPARSE)]
    for cf in count_files:
        t = ipc.open_file(pa.memory_map(cf)).read_all()
        feat = t.column("feature").to_numpy()
        for f in range(NUM_SPARSE):
            m = pa.array(feat == f)
            per_feature[f].append(t.filter(m).select(["value", "count"]))
    vocab_dir.mkdir(parents=True, exist_ok=True)
    info = []
    for f, name in enumerate(SPARSE_FEATURES):
        t = _merge_counts(per_feature[f]) if per_feature[f] else None
        if t is None or t.num_rows == 0:
            values = np.zeros(0, np.int64)
            counts = np.zeros(0, np.int64)
        else:
            values = t.column("value").to_numpy()
            counts = t.column("count").to_numpy()
        distinct = len(values)
        keep = counts >= threshold
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


# =============================================================================== orchestration
class _Progress:
    """Rows/s progress line on stderr (``\\r``-updated on a terminal, one line per 10 s otherwise)."""

    def __init__(self, label: str, total_files: int, enabled: bool) -> None:
        self.label, self.total_files, self.enabled = label, total_files, enabled
        self.rows = 0
        self.files_done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def add(self, rows: int) -> None:
        self.rows += max(rows, 0)
        self.show()

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.5 if self._tty else 10.0):
            return
        self._last = now
        dt = max(now - self.t0, 1e-9)
        msg = (f"{self.label}: {self.rows:,} rows | {self.rows / dt:,.0f} rows/s | "
               f"files {self.files_done}/{self.total_files} | {dt:.1f} s")
        end = "\n" if final or not self._tty else ""
        sys.stderr.write(("\r" if self._tty else "") + msg + end)
        sys.stderr.flush()


def _run_tasks(fn: Callable[[_FileTask], Any], tasks: list[_FileTask], workers: int,
               progress: _Progress) -> list[Any]:
    """Run ``fn`` over tasks, in-process (1 worker) or in a process pool, with progress."""
    if not tasks:
        return []
    if workers == 1 or len(tasks) == 1:
        global _PROGRESS_Q

        class _Q:
            def put(self, r):
                progress.add(r)

        _PROGRESS_Q = _Q()
        try:
            out = []
            for t in tasks:
                out.append(fn(t))
                progress.files_done += 1
            return out
        finally:
            _PROGRESS_Q = None
    import multiprocessing as mp

    # fork where available: workers start in milliseconds with everything already imported
    # (spawn re-imports torch in every worker, seconds each); the parent runs no torch/OpenMP
    # work before this point, so forking is safe.  Elsewhere: spawn.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() and sys.platform == "linux" else "spawn")
    q = ctx.Queue()
    results: dict[int, Any] = {}
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx,
                             initializer=_init_worker, initargs=(q,)) as ex:
        futs = {ex.submit(fn, t): i for i, t in enumerate(tasks)}
        pending = set(futs)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(q, progress)
                for f in done:
                    results[futs[f]] = f.result()  # re-raises a worker's DataError
                    progress.files_done += 1
                progress.show()
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        _drain(q, progress)
    return [results[i] for i in range(len(tasks))]


def _drain(q, progress: _Progress) -> None:
    import queue as _queue

    while True:
        try:
            progress.add(q.get_nowait())
        except _queue.Empty:
            return


@dataclasses.dataclass
class PreprocessReport:
    """What :func:`preprocess_criteo` / the synthetic generator did.

    Attributes:
        out_dir: output directory.
        rows: rows written per split.
        bad_lines: lines skipped (``on_bad_line='skip'``).
        files_processed: input files transformed in this run.
        files_skipped: input files already done by an earlier run (resumed).
        seconds: wall-clock time of the whole run.
        rows_per_s: rows read / ``seconds`` (all passes included).
    """

    out_dir: Path
    rows: dict[str, int]
    bad_lines: int
    files_processed: int
    files_skipped: int
    seconds: float
    rows_per_s: float


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def preprocess_criteo(inputs: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                      options: CriteoOptions | None = None, progress: bool = True) -> PreprocessReport:
    """Preprocess Criteo TSV files into a columnar directory (see the module docstring).

    Args:
        inputs: a file, a directory, a glob, or a list of those (plain / ``.gz`` / ``.bz2``).
        out_dir: output directory (created).  Re-running on the same directory resumes: input
            files whose part is complete (``parts/<name>/done.json`` with the same options and the
            same input size / mtime) are not redone.
        options: :class:`CriteoOptions`.
        progress: print a rows/s progress line on stderr.

    Returns:
        :class:`PreprocessReport`.

    Raises:
        ValueError: inconsistent options (message names the option).
        DataError: unreadable input or a bad line (``path:line: field X: ...``) when
            ``on_bad_line='error'``; mixed 40/39-field inputs; ``split_by_day`` with files not
            named ``day_N``.
    """
    t0 = time.perf_counter()
    o = dataclasses.replace(options) if options is not None else CriteoOptions()
    o.validate()
    files = expand_inputs(inputs)
    nf = {f: _num_fields(f) for f in files}
    kinds = {n for n in nf.values() if n is not None}
    if not kinds:  # nothing to read: say so before anything is written
        raise DataError("empty file: no lines to preprocess" if len(files) == 1 else
                        f"all {len(files)} input files are empty: no lines to preprocess",
                        path=files[0] if len(files) == 1 else str(inputs))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)

    if not kinds <= {39, 40}:
        bad = next(f for f, n in nf.items() if n not in (None, 39, 40))
        raise DataError(f"expected 40 (label, I1-I13, C1-C26) or 39 (no label) tab-separated fields, "
                        f"got {nf[bad]}", path=bad, line=1)
    if kinds == {39, 40}:
        raise DataError("inputs mix labelled (40 fields) and unlabelled (39 fields) files: "
                        + ", ".join(f"{f.name}={n}" for f, n in nf.items()), path=str(inputs))
    labelled = kinds != {39}
    if not labelled and (o.val_ratio or o.test_ratio or o.split_by_day):
        raise ValueError("unlabelled (39-field) input: every row goes to the 'test' split; "
                         "--val-ratio/--test-ratio/--split-by-day do not apply")

    roles: dict[Path, str] = {}
    valtest_first: dict[Path, int] = {}
    if not labelled:
        roles = {f: "unlabelled" for f in files}
    elif o.split_by_day:
        days = {}
        for f in files:
            m = _DAY_RE.match(f.name)
            if not m:
                raise DataError("--split-by-day needs files named day_N (1TB Criteo layout)", path=f)
            days[f] = int(m.group(1))
        if len(days) < 2:
            raise DataError("--split-by-day needs at least two day_N files (train days + the last day)",
                            path=str(inputs))
        last = max(days, key=days.get)
        for f in files:
            roles[f] = "valtest" if f == last else "train"
        n_last = _count_lines(last)
        valtest_first[last] = (n_last + 1) // 2
    else:
        roles = {f: "ratio" for f in files}

    if o.mode == "hash":
        table_sizes = [n + 1 for n in o.num_embeddings]
    else:
        table_sizes = None

    def fp_common() -> dict:
        return {"format_version": FORMAT_VERSION, "seed": o.seed, "val_ratio": o.val_ratio,
                "test_ratio": o.test_ratio, "split_by_day": o.split_by_day, "on_bad_line": o.on_bad_line}

    def file_id(f: Path) -> dict:
        st = f.stat()
        return {"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "role": roles[f], "valtest_first": valtest_first.get(f, 0)}

    rows_read = 0
    vocab_info = None
    vocab_dir = out / "vocab"
    if o.mode == "vocab":
        count_tasks = [_FileTask(str(f), f.name, roles[f], labelled, str(out), o,
                                 _fingerprint({**fp_common(), **file_id(f), "pass": "count"}),
                                 valtest_first=valtest_first.get(f, 0)) for f in files]
        prog = _Progress("criteo vocabulary pass", len(files), progress)
        count_files = _run_tasks(_count_file, count_tasks, o.workers, prog)
        prog.show(final=True)
        rows_read += prog.rows
        vocab_info = _build_vocab(count_files, vocab_dir, o.threshold)
        table_sizes = [v["size"] + 2 for v in vocab_info]
        vocab_fp = _fingerprint([_sha_file(vocab_dir / f"{n}.arrow") for n in SPARSE_FEATURES])
    else:
        vocab_fp = None

    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    tasks, skipped, done_stats = [], [], {}
    for f in files:
        fp = _fingerprint({**fp_common(), **file_id(f), "mode": o.mode, "num_embeddings": o.num_embeddings,
                           "vocab": vocab_fp, "multi_hot": mh, "dist": o.multi_hot_distribution,
                           "table_sizes": table_sizes})
        done = out / "parts" / f.name / "done.json"
        if done.is_file():
            try:
                st = json.loads(done.read_text())
            except json.JSONDecodeError:
                st = {}
            if st.get("fingerprint") == fp:
                skipped.append(f)
                done_stats[f] = st
                continue
        tasks.append(_FileTask(str(f), f.name, roles[f], labelled, str(out), o, fp,
                               vocab_dir=str(vocab_dir) if o.mode == "vocab" else None,
                               table_sizes=table_sizes, valtest_first=valtest_first.get(f, 0)))
    prog = _Progress("criteo", len(tasks), progress)
    results = _run_tasks(_process_file, tasks, o.workers, prog)
    prog.show(final=True)
    rows_read += prog.rows
    for t, st in zip(tasks, results):
        done_stats[Path(t.path)] = st

    # ---- meta
    rows = {s: sum(done_stats[f]["rows"][s] for f in files) for s in SPLITS}
    pos = {s: sum(done_stats[f]["positives"][s] for f in files) for s in SPLITS}
    missing = [sum(done_stats[f]["missing"][i] for f in files) for i in range(NUM_SPARSE)]
    bad_lines = sum(done_stats[f]["bad_lines"] for f in files)
    total = sum(rows.values())
    sparse_meta = []
    for i, name in enumerate(SPARSE_FEATURES):
        entry = {"name": name, "num_embeddings": int(table_sizes[i]), "multi_hot": mh[i] > 1,
                 "mean_pooling_factor": float(mh[i]), "max_pooling_factor": int(mh[i]),
                 "missing_id": int(table_sizes[i] - 1),
                 "missing_fraction": (missing[i] / total) if total else 0.0}
        if vocab_info is not None:
            entry["oov_id"] = int(table_sizes[i] - 2)
            entry["distinct_train_values"] = vocab_info[i]["distinct_train_values"]
        sparse_meta.append(entry)
    transforms = {
        "dense": {"missing": 0, "negative": "clamped to 0", "transform": "log(x+1)", "dtype": "float32",
                  "source": DLRM_LOG_SOURCE},
        "sparse": ({"mode": "hash", "parse": "int(s, 16) of 8 hex digits",
                    "formula": "id = h mod num_embeddings_arg; missing -> num_embeddings_arg",
                    "num_embeddings_arg": o.num_embeddings}
                   if o.mode == "hash" else
                   {"mode": "vocab", "parse": "int(s, 16) of 8 hex digits", "frequency_threshold": o.threshold,
                    "built_on": "train split",
                    "formula": "id = rank by descending train count (ties by value) for count >= T; "
                               "rarer/unseen -> oov_id = V; missing -> V + 1"}),
        "split": ({"mode": "day", "train": "day_N for every N but the last",
                   "val": "first half of the last day", "test": "second half of the last day"}
                  if o.split_by_day else
                  {"mode": "ratio", "val_ratio": o.val_ratio, "test_ratio": o.test_ratio, "seed": o.seed,
                   "rule": "u = splitmix64(blake2b(seed:file) ^ line*0xD1B54A32D192ED03)/2^64; "
                           "val if u < val_ratio, test if u < val_ratio+test_ratio"}
                  if labelled else {"mode": "unlabelled", "test": "all rows"}),
        "multi_hot": ({"sizes": mh, "distribution": o.multi_hot_distribution,
                       "seed": "seed*1000 + feature index", "cache_vectors": MULTI_HOT_CACHE_VECTORS,
                       "source": "MLPerf Training DLRMv2 torchrec_dlrm/multi_hot.py"}
                      if o.multi_hot_sizes else None),
        "on_bad_line": o.on_bad_line,
    }
    elapsed = time.perf_counter() - t0
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": "criteo",
        "dense_features": DENSE_FEATURES,
        "sparse_features": sparse_meta,
        "label": LABEL_COLUMN if labelled else None,
        "splits": {s: {"rows": rows[s], "files": [f"parts/{f.name}/{s}.arrow" for f in files]}
                   for s in SPLITS},
        "ctr": {s: (pos[s] / rows[s] if rows[s] and labelled else None) for s in SPLITS},
        "transforms": transforms,
        "vocab_files": ({n: f"vocab/{n}.arrow" for n in SPARSE_FEATURES} if o.mode == "vocab" else {}),
        "inputs": [str(f) for f in files],
        "bad_lines_skipped": bad_lines,
        "rows_per_s": rows_read / elapsed if elapsed > 0 else None,
    }
    write_meta(out, meta)
    return PreprocessReport(out, rows, bad_lines, len(tasks), len(skipped), elapsed,
                            rows_read / elapsed if elapsed > 0 else 0.0)


def _sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def transform_raw_file(path: str | os.PathLike, meta: dict, data_dir: str | os.PathLike,
                       batch_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Apply a preprocessed directory's Criteo transforms to raw lines (for inference on raw logs).

    Uses exactly the training-time transforms recorded in ``meta["transforms"]`` (hash modulus or the
    vocabulary files ``meta["vocab_files"]``, resolved relative to ``data_dir``), so prediction inputs
    can never drift from training inputs.

    Args:
        path: raw Criteo file, 40 fields (labelled) or 39 (no label); plain / .gz / .bz2.
        meta: the preprocessed ``meta.json`` dict.
        data_dir: directory the vocab paths are relative to.
        batch_rows: max rows per yielded chunk.

    Yields:
        ``(dense [n, 13] float32, ids [n, 26] int64, labels [n] float32 or None)`` in file order.

    Raises:
        DataError: bad line (``path:line: field X: ...``), a multi-hot meta (raw transform gives
            one-hot ids only), or an unknown sparse transform mode.
    """
    path = Path(path)
    sparse = (meta.get("transforms") or {}).get("sparse") or {}
    if any(sf.get("multi_hot") for sf in meta.get("sparse_features") or []):
        raise DataError("raw-line transform gives one-hot ids; this meta has multi-hot features", path=path)
    mode = sparse.get("mode")
    if mode == "hash":
        opts = CriteoOptions(num_embeddings=list(sparse["num_embeddings_arg"]))
        vocabs = None
    elif mode == "vocab":
        opts = CriteoOptions(frequency_threshold=int(sparse.get("frequency_threshold", DEFAULT_FREQUENCY_THRESHOLD)))
        vocabs = [_Vocab(Path(data_dir) / meta["vocab_files"][n]) for n in SPARSE_FEATURES]
    else:
        raise DataError(f"unknown sparse transform mode {mode!r} in meta (expected 'hash' or 'vocab')", path=path)
    nf = _num_fields(path)
    if nf is None:
        return
    if nf not in (39, 40):
        raise DataError(f"expected 40 or 39 tab-separated fields, got {nf}", path=path, line=1)
    task = _FileTask(str(path), path.name, "unlabelled", nf == 40, "", opts, "")
    reader = _BlockReader(path, nf == 40, "error", False, DEFAULT_BLOCK_SIZE)
    for blk in reader:
        n = len(blk.lines)
        if n == 0:
            continue
        dense = np.stack(blk.dense, axis=1)
        ids = np.stack(_ids_of_block(task, blk, vocabs), axis=1)
        for s in range(0, n, batch_rows):
            e = min(n, s + batch_rows)
            yield dense[s:e], ids[s:e], (blk.label[s:e] if blk.label is not None else None)
