"""Criteo raw-line transform for inference: raw TSV lines -> the ids and dense values of training.

``dlrmctl predict`` on raw logs (:data:`dlrmctl.inference.predict.RAW_TRANSFORMS`) calls
:func:`transform_raw_file`, which applies exactly the transforms a preprocessed directory's
``meta.json`` records, with the same parsing code as the preprocess.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from dlrmctl.data.columnar import DataError
from dlrmctl.data.criteo.parse import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FREQUENCY_THRESHOLD,
    SPARSE_FEATURES,
    BlockReader,
    CriteoOptions,
    ids_of,
    num_fields,
)
from dlrmctl.data.criteo.vocab import VocabSet

__all__ = ["transform_raw_file"]


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
        vocabs = VocabSet([Path(data_dir) / meta["vocab_files"][n] for n in SPARSE_FEATURES])
    else:
        raise DataError(f"unknown sparse transform mode {mode!r} in meta (expected 'hash' or 'vocab')", path=path)
    nf = num_fields(path)
    if nf is None:
        return
    if nf not in (39, 40):
        raise DataError(f"expected 40 or 39 tab-separated fields, got {nf}", path=path, line=1)
    reader = BlockReader(path, nf == 40, "error", False, DEFAULT_BLOCK_SIZE)
    for blk in reader:
        n = len(blk.lines)
        if n == 0:
            continue
        dense = np.stack(blk.dense, axis=1)
        ids = np.stack(ids_of(opts, blk.sparse_h, blk.sparse_present, vocabs), axis=1)
        for s in range(0, n, batch_rows):
            e = min(n, s + batch_rows)
            yield dense[s:e], ids[s:e], (blk.label[s:e] if blk.label is not None else None)
