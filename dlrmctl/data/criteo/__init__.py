"""Criteo click logs (Kaggle ``train.txt``, 1TB ``day_N``) -> columnar shards + ``meta.json``.

Input lines: ``label \\t I1..I13 \\t C1..C26`` (40 fields), or 39 fields without the label
(Kaggle ``test.txt``).  Any field may be empty.  Files may be plain, ``.gz`` or ``.bz2``.

Transforms (all recorded in ``meta["transforms"]``):

* dense ``I1..I13``: empty -> 0, negative -> 0, then ``log(x + 1)`` as float32
  (Naumov et al. 2019, DLRM reference ``data_utils.py``: ``X_int[X_int < 0] = 0; log(X_int + 1)``).
  A negative input therefore gives 0.0, never ``-inf`` / NaN.  Only an *empty* field is missing:
  any other non-integer (``nan``, ``inf``, ``NA``, ``1.5``) is a bad line (named ``file:line: field
  I4: ...``; dropped with ``on_bad_line="skip"``), the same policy as columnar data, where a NaN / inf
  dense value is refused (:func:`dlrmctl.data.columnar.check_rows`).
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
  :func:`dlrmctl.data.multi_hot.multi_hot_expand`.

Parsing is streamed with ``pyarrow.csv.open_csv`` (explicit column types, single-threaded per
worker) and every transform is vectorised (hex decode is a SWAR computation on 64-bit words);
nothing is held in memory beyond one CSV block per worker (and, in vocabulary mode, the
vocabularies a worker has looked ids up in, and one feature's counts while merging).  Each
input file is parsed once: in vocabulary mode the counting pass keeps the decoded rows in
``<out>/.decoded/<file>.arrow`` (at most 164.25 bytes per row, all files at once between the
passes) for the id pass, which deletes them.

Modules: :mod:`.parse` (line parsing and per-row transforms), :mod:`.vocab` (counting, the
feature-by-feature merge, hash lookup), :mod:`.decoded` (pass 1's decoded rows),
:mod:`.parallel` (the worker pool and its progress line),
:mod:`.preprocess` (the passes and ``meta.json``), :mod:`.raw_transform` (raw lines for
``predict``).  This package re-exports their public names.
"""

from dlrmctl.data.criteo.parse import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FREQUENCY_THRESHOLD,
    DENSE_FEATURES,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_FEATURES,
    CriteoOptions,
    dense_log1p,
    expand_inputs,
    hex_to_uint32,
    row_split_codes,
)
from dlrmctl.data.criteo.preprocess import PreprocessReport, preprocess_criteo
from dlrmctl.data.criteo.raw_transform import transform_raw_file
from dlrmctl.data.multi_hot import multi_hot_expand

__all__ = [
    "CriteoOptions",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_FREQUENCY_THRESHOLD",
    "DENSE_FEATURES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "PreprocessReport",
    "SPARSE_FEATURES",
    "dense_log1p",
    "expand_inputs",
    "hex_to_uint32",
    "multi_hot_expand",
    "preprocess_criteo",
    "row_split_codes",
    "transform_raw_file",
]
