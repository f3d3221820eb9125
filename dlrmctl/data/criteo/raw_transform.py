"""Criteo raw-line transform for inference: raw TSV lines -> the ids and dense values of training.

``dlrmctl predict`` on raw logs and ``dlrmctl serve`` on raw lines in a request
(:data:`dlrmctl.inference.predict.RAW_TRANSFORMS`) use :class:`RawTransformer`, which applies
exactly the transforms a preprocessed directory's ``meta.json`` records, with the same parsing
code as the preprocess (:func:`transform_raw_file` is the one-file shorthand).
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

__all__ = ["RawTransformer", "transform_raw_file"]


class RawTransformer:
    """A preprocessed directory's Criteo transforms, built once (vocabularies opened once, each
    loaded on first use) and applied to raw lines from a file (:meth:`file`) or from memory
    (:meth:`lines`, e.g. a served request).

    Args:
        meta: the preprocessed ``meta.json`` dict.
        data_dir: directory the vocab paths (``meta["vocab_files"]``) are relative to.
        source: what the meta came from, for messages.

    Raises:
        DataError: a multi-hot meta (raw transform gives one-hot ids only), or an unknown sparse
            transform mode.
    """

    def __init__(self, meta: dict, data_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
        sparse = (meta.get("transforms") or {}).get("sparse") or {}
        if any(sf.get("multi_hot") for sf in meta.get("sparse_features") or []):
            raise DataError("raw-line transform gives one-hot ids; this meta has multi-hot features", path=source)
        mode = sparse.get("mode")
        if mode == "raw":
            self.opts = CriteoOptions(raw_ids=True)
            self.vocabs = None
        elif mode == "hash":
            self.opts = CriteoOptions(num_embeddings=list(sparse["num_embeddings_arg"]))
            self.vocabs = None
        elif mode == "vocab":
            self.opts = CriteoOptions(frequency_threshold=int(sparse.get("frequency_threshold", DEFAULT_FREQUENCY_THRESHOLD)))
            self.vocabs = VocabSet([Path(data_dir) / meta["vocab_files"][n] for n in SPARSE_FEATURES])
        else:
            raise DataError(f"unknown sparse transform mode {mode!r} in meta (expected 'hash', 'vocab' or 'raw')", path=source)

    def _blocks(self, reader: BlockReader, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        for blk in reader:
            n = len(blk.lines)
            if n == 0:
                continue
            dense = np.stack(blk.dense, axis=1)
            ids = np.stack(ids_of(self.opts, blk.sparse_h, blk.sparse_present, self.vocabs), axis=1)
            for s in range(0, n, batch_rows):
                e = min(n, s + batch_rows)
                yield dense[s:e], ids[s:e], (blk.label[s:e] if blk.label is not None else None)

    def file(self, path: str | os.PathLike, batch_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Raw file (40 fields labelled, or 39; plain / .gz / .bz2) -> chunks of at most ``batch_rows``:
        ``(dense [n, 13] float32, ids [n, 26] int64, labels [n] float32 or None)`` in file order.

        Raises:
            DataError: bad line (``path:line: field X: ...``).
        """
        path = Path(path)
        nf = num_fields(path)
        if nf is None:
            return
        if nf not in (39, 40):
            raise DataError(f"expected 40 or 39 tab-separated fields, got {nf}", path=path, line=1)
        yield from self._blocks(BlockReader(path, nf == 40, "error", False, DEFAULT_BLOCK_SIZE), batch_rows)

    def lines(self, lines: list[bytes], name: str = "<lines>") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Raw lines in memory (each 40 tab-separated fields, label first, or 39; no newline inside)
        -> ``(dense [n, 13] float32, ids [n, 26] int64, labels [n] float32 or None)``, ``n = len(lines)``.

        Raises:
            DataError: an empty list, a line with a newline inside, or a bad line (``name:line: field X: ...``,
                ``line`` counted from 1 in ``lines``).
        """
        if not lines:
            raise DataError("no lines", path=name)
        for i, ln in enumerate(lines):
            if b"\n" in ln.rstrip(b"\r\n") or b"\r" in ln.rstrip(b"\r\n"):
                raise DataError("one raw line per element: this one holds a line break", path=name, line=i + 1)
        body = b"\n".join(ln.rstrip(b"\r\n") for ln in lines) + b"\n"
        nf = lines[0].rstrip(b"\r\n").count(b"\t") + 1
        if nf not in (39, 40):
            raise DataError(f"expected 40 or 39 tab-separated fields, got {nf}", path=name, line=1)
        parts = list(self._blocks(BlockReader(Path(name), nf == 40, "error", False, max(len(body) + 1, 1 << 16),
                                              data=body), len(lines)))
        got = sum(len(p[0]) for p in parts)
        if got != len(lines):  # pragma: no cover - the reader raises on a bad line first
            raise DataError(f"parsed {got} of {len(lines)} lines", path=name)
        if len(parts) == 1:
            return parts[0]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                None if parts[0][2] is None else np.concatenate([p[2] for p in parts]))


def transform_raw_file(path: str | os.PathLike, meta: dict, data_dir: str | os.PathLike,
                       batch_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Apply a preprocessed directory's Criteo transforms to raw lines (for inference on raw logs).

    Uses exactly the training-time transforms recorded in ``meta["transforms"]`` (hash modulus or the
    vocabulary files ``meta["vocab_files"]``, resolved relative to ``data_dir``), so prediction inputs
    can never drift from training inputs (:class:`RawTransformer`).

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
    yield from RawTransformer(meta, data_dir, source=path).file(path, batch_rows)
