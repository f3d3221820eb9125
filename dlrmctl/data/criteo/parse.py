"""Criteo line parsing and per-row transforms (dense, categorical hex, splits).

Reads Criteo TSV files (``label \\t I1..I13 \\t C1..C26``, 40 fields, or 39 without the label;
plain, ``.gz`` or ``.bz2``) block by block with ``pyarrow.csv.open_csv`` and turns each block
into vectorised arrays: dense ``log(max(x, 0) + 1)`` float32, categorical 8-hex-digit values
decoded to 32-bit integers, the row's split code, and (given the hashing modulus or the
vocabularies) the categorical ids.  The semantics are described in :mod:`dlrmctl.data.criteo`.
The input files are :mod:`dlrmctl.data.criteo.inputs`', the hex decoding
:mod:`dlrmctl.data.criteo.hex_values`' (their names re-exported here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from dlrmctl.data.columnar import LABEL_COLUMN, DataError, check_split_ratios
from dlrmctl.data.criteo.hex_values import decode_hex8, hex_to_uint32, raw_ids_of_hex  # noqa: F401  (re-exported)
from dlrmctl.data.criteo.inputs import (  # noqa: F401  (re-exported)
    count_lines,
    decode_error,
    expand_inputs,
    num_fields,
    open_text,
    paced_input,
)
from dlrmctl.errors import quoted
from dlrmctl.data.long_lines import long_line_message

if TYPE_CHECKING:
    from dlrmctl.data.criteo.vocab import VocabSet

DENSE_FEATURES = [f"I{i}" for i in range(1, 14)]
SPARSE_FEATURES = [f"C{i}" for i in range(1, 27)]
NUM_DENSE = 13
NUM_SPARSE = 26
DEFAULT_FREQUENCY_THRESHOLD = 3
DEFAULT_BLOCK_SIZE = 4 << 20  # bytes of CSV per block (~16k Criteo lines; cache-friendly, fastest measured)
DLRM_LOG_SOURCE = "Naumov et al. 2019 (arXiv:1906.00091), DLRM reference data_utils.py: X_int[X_int<0]=0; log(X_int+1)"


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


# =============================================================================== options / inputs
@dataclasses.dataclass
class CriteoOptions:
    """Options of :func:`preprocess_criteo` (see the module docstring for the semantics).

    Exactly one of ``num_embeddings`` (hashing), ``frequency_threshold`` (vocabulary) and
    ``raw_ids`` (raw 64-bit ids for managed-collision tables) may be set; with none, a vocabulary
    with threshold :data:`DEFAULT_FREQUENCY_THRESHOLD` is built.
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
    raw_ids: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the option when an option is inconsistent."""
        if self.num_embeddings is not None and self.frequency_threshold is not None:
            raise ValueError("--num-embeddings (hashing) and --frequency-threshold (vocabulary) "
                             "are exclusive; give one")
        if self.raw_ids and (self.num_embeddings is not None or self.frequency_threshold is not None):
            raise ValueError("--raw-ids, --num-embeddings (hashing) and --frequency-threshold (vocabulary) "
                             "are exclusive; give one")
        if self.raw_ids and self.multi_hot_sizes is not None:
            raise ValueError("--raw-ids and --multi-hot-sizes are exclusive (multi-hot bags are drawn "
                             "around an index id)")
        if self.num_embeddings is not None:
            if len(self.num_embeddings) != NUM_SPARSE:
                raise ValueError(f"--num-embeddings: expected 1 or {NUM_SPARSE} values, got "
                                 f"{len(self.num_embeddings)}")
            if min(self.num_embeddings) < 1:
                raise ValueError(f"--num-embeddings: values must be >= 1, got {self.num_embeddings}")
        if self.frequency_threshold is not None and self.frequency_threshold < 1:
            raise ValueError(f"--frequency-threshold must be >= 1, got {self.frequency_threshold}")
        check_split_ratios(self.val_ratio, self.test_ratio)
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
        """``"raw"`` (raw 64-bit ids), ``"hash"`` (modulo) or ``"vocab"`` (vocabulary)."""
        if self.raw_ids:
            return "raw"
        return "hash" if self.num_embeddings is not None else "vocab"

    @property
    def threshold(self) -> int:
        return self.frequency_threshold if self.frequency_threshold is not None else DEFAULT_FREQUENCY_THRESHOLD


# =============================================================================== reading blocks
_CONV_RE = re.compile(r"column #(\d+): Row #(\d+): CSV conversion error to \w+: invalid value '(.*)'", re.S)


def non_finite_hint(missing_ok: bool) -> str:
    """The policy on NaN / inf in a number field, as an error message adds it (one policy for raw
    and columnar data: non-finite values are refused, never read as missing).  ``missing_ok``: an
    empty field is a missing value there (a dense feature); else (a label, a weight) it is refused
    too, and the advice says so."""
    if missing_ok:
        return " (NaN / inf are refused, not read as missing: leave the field empty for a missing value)"
    return " (NaN / inf are refused, and so is an empty field: this field needs a finite value in every row)"


def _non_finite_hint(got: str, field: str) -> str:
    """:func:`non_finite_hint` when ``got`` (of Criteo ``field``) spells NaN or inf, else ``""``."""
    if got.strip().lstrip("+-").lower() in ("nan", "inf", "infinity"):
        return non_finite_hint(field != LABEL_COLUMN)
    return ""


def block_lines(skipped: list[int], pos: int, next_line: int, n: int) -> tuple[np.ndarray, int, int, int]:
    """Physical line numbers of the ``n`` rows of a CSV block, past the lines the parser dropped.

    Args:
        skipped: 1-based physical lines the parser dropped so far (ascending; grows as it reads).
        pos: index in ``skipped`` of the first one not yet accounted for.
        next_line: the physical line of the block's first candidate row.
        n: the block's rows.

    Returns:
        ``(lines [n] int64, next_line after the block, dropped lines accounted to this block, new pos)``.
    """
    while pos < len(skipped) and skipped[pos] < next_line:
        pos += 1
    pending = skipped[pos:]
    if not pending:
        lines = np.arange(next_line, next_line + n, dtype=np.int64)
    else:
        cand = np.arange(next_line, next_line + n + len(pending), dtype=np.int64)
        lines = cand[~np.isin(cand, np.asarray(pending, dtype=np.int64))][:n]
    if n:
        next_line = int(lines[-1]) + 1
    consumed = pos
    while consumed < len(skipped) and skipped[consumed] < next_line:
        consumed += 1
    return lines, next_line, consumed - pos, consumed


class _NeedCareful(Exception):
    """Internal: the fast path met a non-integer dense value in skip mode; redo the file carefully."""


@dataclasses.dataclass
class Block:
    """One parsed block of ``n`` good rows (bad rows already dropped or raised)."""

    lines: np.ndarray  # [n] int64 physical 1-based line numbers
    label: np.ndarray | None  # [n] float32
    dense: list[np.ndarray]  # 13 x [n] float32
    sparse_h: list[np.ndarray]  # 26 x [n] uint64 decoded hashes
    sparse_present: list[np.ndarray]  # 26 x [n] bool
    bad_skipped: int


class BlockReader:
    """Streams one Criteo file as vectorised blocks; validates and reports bad lines.

    Args:
        path: input file.
        labelled: 40 fields (True) or 39 (False).
        on_bad_line: "error" raises :class:`DataError` at the first bad line; "skip" drops it.
        careful: read dense fields as bytes and validate them (needed to *skip* bad integers;
            the default fast path lets Arrow convert them and reports the first error).
        data: the lines themselves (``b"\\n"``-joined, in memory, e.g. a served request); then
            ``path`` only names them in messages.
    """

    def __init__(self, path: Path, labelled: bool, on_bad_line: str, careful: bool, block_size: int,
                 data: bytes | None = None):
        self.path = path
        self.data = data
        self.labelled = labelled
        self.on_bad_line = on_bad_line
        self.careful = careful
        self.block_size = block_size
        self.names = ([LABEL_COLUMN] if labelled else []) + DENSE_FEATURES + SPARSE_FEATURES
        self.bad_lines = 0
        self._skipped: list[int] = []  # physical lines dropped by the parser (wrong field count)
        self._first_error: tuple[int, str] | None = None
        self._long_lines: set[int] = set()  # physical lines too long for a block (read as bad rows)

    def _long_line(self, line: int) -> bytes:
        """What a line too long for a block reaches the parser as: a row of one field too many."""
        self._long_lines.add(line)
        return b"\t" * len(self.names)

    def _invalid_row(self, row) -> str:
        got = row.actual_columns
        if row.number in self._long_lines:
            msg = long_line_message(self.block_size)
        else:
            msg = f"expected {len(self.names)} tab-separated fields, got {got}" + (
                f" (the first missing: {self.names[got]})" if got < len(self.names) else "")
        if self.on_bad_line == "error" and self._first_error is None:
            self._first_error = (row.number, msg)
        self._skipped.append(row.number)
        return "skip"

    def _raise_parse_error(self) -> None:
        if self._first_error is not None:
            line, msg = self._first_error
            raise DataError(msg, path=self.path, line=line)

    def _read_error(self, e: BaseException) -> None:
        """:func:`decode_error` for this reader's file."""
        raise decode_error(self.path, e) from None

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
        raise DataError(f"expected {what}, got {quoted(m.group(3))}{_non_finite_hint(m.group(3), field)}", path=self.path,
                        line=int(m.group(2)), field=field) from None

    def __iter__(self) -> Iterator[Block]:
        int_t = pa.binary() if self.careful else pa.int64()
        types = {n: (pa.binary() if n.startswith("C") else int_t) for n in self.names}
        try:
            reader = pa_csv.open_csv(
                (paced_input(self.path, self.block_size, self._long_line) if self.data is None
                 else pa.BufferReader(self.data)),
                read_options=pa_csv.ReadOptions(column_names=self.names, use_threads=False,
                                                block_size=self.block_size),
                parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                                  ignore_empty_lines=False,
                                                  invalid_row_handler=self._invalid_row),
                # only an empty field is missing: Arrow's default null spellings ("nan", "NaN", "NA",
                # "null", ...) would make `nan` a missing count while `inf` is refused
                convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                                      null_values=[""], check_utf8=False,
                                                      quoted_strings_can_be_null=False),
            )
        except pa.ArrowInvalid as e:
            try:
                empty = not self.data.strip() if self.data is not None else num_fields(self.path) is None
            except (OSError, EOFError) as e2:
                self._read_error(e2)
            if empty:  # a file (or .gz / .bz2 member) with no lines: no blocks
                return
            self._arrow_error(e)
        except (OSError, EOFError) as e:
            self._read_error(e)
        next_line = 1
        sk_pos = 0
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as e:
                self._arrow_error(e)
            except (OSError, EOFError) as e:
                self._read_error(e)
            self._raise_parse_error()
            n = rb.num_rows
            lines, next_line, dropped, sk_pos = block_lines(self._skipped, sk_pos, next_line, n)
            if n == 0:
                continue
            blk = self._convert(rb, lines)
            blk.bad_skipped += dropped
            yield blk
        rest = len(self._skipped) - sk_pos
        if rest:  # bad lines after the last good row
            z = np.zeros(0, dtype=np.int64)
            yield Block(z, np.zeros(0, np.float32) if self.labelled else None, [], [], [], rest)

    def _bad(self, mask: np.ndarray, lines: np.ndarray, field: str, what: str, values: pa.Array) -> np.ndarray:
        """Handle rows ``mask`` bad in ``field``: raise (error mode) or return the mask (skip)."""
        if self.on_bad_line == "error":
            i = int(np.flatnonzero(mask)[0])
            got = values[i].as_py()
            got = got.decode("utf-8", "replace") if isinstance(got, bytes) else got
            shown = "an empty field" if got is None or got == "" else quoted(got)  # (a missing value reads as None)
            raise DataError(f"expected {what}, got {shown}{_non_finite_hint(str(got or ''), field)}", path=self.path,
                            line=int(lines[i]), field=field)
        return mask

    def _convert(self, rb: pa.RecordBatch, lines: np.ndarray) -> Block:
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
        return Block(lines, label, dense, hs, pres, nbad)


# =============================================================================== per-file work
@dataclasses.dataclass
class FileTask:
    """One input file's work in a pass (picklable: sent to the worker pool)."""

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
    decoded_fingerprint: str = ""  # vocabulary pass 2: the pass-1 fingerprint its decoded rows must carry


def split_of_block(task: FileTask, blk: Block) -> np.ndarray:
    """``[n]`` int8 split codes of a block's rows (0 train, 1 val, 2 test) by the file's role."""
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


def read_blocks(task: FileTask) -> Iterator[Block]:
    """Blocks of the file; in skip mode falls back to the careful reader on a bad integer."""
    careful = False
    while True:
        r = BlockReader(Path(task.path), task.labelled, task.opts.on_bad_line, careful, task.opts.block_size)
        try:
            for blk in r:
                yield blk
            return
        except _NeedCareful:
            careful = True
            yield None  # tells the consumer to discard what it has written and restart


def ids_of(opts: CriteoOptions, sparse_h: list[np.ndarray], sparse_present: list[np.ndarray],
           vocabs: "VocabSet | None") -> list[np.ndarray]:
    """Categorical ids of ``n`` rows.

    Args:
        opts: the options (their mode and hashing moduli).
        sparse_h: 26 x ``[n]`` uint64 or uint32 decoded values (< 2^32).
        sparse_present: 26 x ``[n]`` bool, False where the field is empty.
        vocabs: the vocabularies (vocabulary mode; loaded lazily, one feature at a time), else None.

    Returns:
        26 x ``[n]`` int64: hashing ``h mod N`` (missing -> ``N``); vocabulary: the value's id,
        ``V`` for a value outside the vocabulary, ``V + 1`` for a missing value; raw ids:
        :func:`raw_ids_of_hex` (missing -> :data:`~dlrmctl.data.ids.MISSING_RAW_ID`).
    """
    out = []
    for f in range(NUM_SPARSE):
        h, present = sparse_h[f], sparse_present[f]
        if opts.mode == "raw":
            ids = raw_ids_of_hex(h, present)
        elif opts.mode == "hash":
            nb = opts.num_embeddings[f]
            ids = (h % np.uint64(nb)).astype(np.int64)
            ids[~present] = nb
        else:
            v = vocabs[f]
            ids = v.lookup(h)
            ids[~present] = v.size + 1
        out.append(ids)
    return out
