"""The columnar format's names and its ``meta.json``: constants, :class:`DataError`, the Arrow
schema of a split's shards, and the validated read / atomic write of meta.json.  Part of
:mod:`dlrmctl.data.columnar`, which re-exports every public name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from dlrmctl.errors import UserError
from dlrmctl.fileio import write_text_atomic


FORMAT_VERSION = 1
META_FILE = "meta.json"
LABEL_COLUMN = "label"
#: suffix of a sparse feature's optional per-id weight column (``C1`` -> ``C1__weight``)
WEIGHT_SUFFIX = "__weight"
SPLITS = ("train", "val", "test")
#: key of a ``sparse_features`` entry in meta.json that says how its ids are stored
IDS_KEY = "ids"
#: value of :data:`IDS_KEY` for raw 64-bit ids (:mod:`dlrmctl.data.ids`); absent = index ids
IDS_RAW = "raw"


class DataError(ValueError, UserError):
    """Bad input data or a bad preprocessed directory.

    The message always names the file, and the line and field when known, in the form
    ``path:line: field X: what was wrong``.

    Attributes:
        path: offending file (str) or None.
        line: 1-based physical line number or None.
        field: field / column name or None.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None,
                 line: int | None = None, field: str | None = None) -> None:
        prefix = ""
        if path is not None:
            prefix = f"{path}:{line}: " if line is not None else f"{path}: "
        if field is not None:
            prefix += f"field {field}: "
        super().__init__(prefix + message)
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field


# ---------------------------------------------------------------------------- writing
def is_raw_feature(sparse_feature: Mapping[str, Any]) -> bool:
    """Whether a meta.json ``sparse_features`` entry holds raw 64-bit ids (``"ids": "raw"``)."""
    return sparse_feature.get(IDS_KEY) == IDS_RAW


def weight_column(feature: str) -> str:
    """Name of the per-id weight column of sparse feature ``feature`` (``C1`` -> ``C1__weight``)."""
    return feature + WEIGHT_SUFFIX


def shard_schema(dense_features: Sequence[str], sparse_features: Sequence[str],
                 multi_hot: Sequence[bool] | None = None, labelled: bool = True,
                 weighted: Sequence[bool] | None = None) -> pa.Schema:
    """Arrow schema of a shard.

    Args:
        dense_features: names of the float32 columns, in order.
        sparse_features: names of the id columns, in order.
        multi_hot: per sparse feature, True for a ``list<int64>`` column (bag), False for int64.
        labelled: include the float32 ``label`` column first.
        weighted: per sparse feature, True to add its weight column :func:`weight_column`
            (float32, or ``list<float32>`` for a multi-hot feature); default none.

    Returns:
        ``pa.Schema`` with columns ``[label], dense..., sparse..., weights of weighted sparse...``.
    """
    mh = list(multi_hot) if multi_hot is not None else [False] * len(sparse_features)
    wt = list(weighted) if weighted is not None else [False] * len(sparse_features)
    fields = [pa.field(LABEL_COLUMN, pa.float32(), nullable=False)] if labelled else []
    fields += [pa.field(n, pa.float32(), nullable=False) for n in dense_features]
    fields += [pa.field(n, pa.list_(pa.int64()) if m else pa.int64(), nullable=False)
               for n, m in zip(sparse_features, mh)]
    fields += [pa.field(weight_column(n), pa.list_(pa.float32()) if m else pa.float32(), nullable=False)
               for n, m, w in zip(sparse_features, mh, wt) if w]
    return pa.schema(fields)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` (:func:`dlrmctl.fileio.write_text_atomic`: never
    half-written)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_split_ratios(val_ratio: float, test_ratio: float) -> None:
    """The ``--val-ratio`` / ``--test-ratio`` of every preprocessor: each in [0, 1), their sum < 1
    (rows are left to train on).

    Raises:
        ValueError: naming the option and the value.
    """
    for name, r in (("--val-ratio", val_ratio), ("--test-ratio", test_ratio)):
        if not 0.0 <= r < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {r}")
    if val_ratio + test_ratio >= 1.0:
        raise ValueError(f"--val-ratio + --test-ratio must be < 1, got {val_ratio + test_ratio}")


def write_meta(data_dir: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Validate and write ``DIR/meta.json`` atomically, with the size and SHA-256 of every file it
    names (``checksums``, :mod:`dlrmctl.data.checksums`); returns its path.

    Raises:
        DataError: ``meta`` lacks a required key (see :func:`read_meta`).
    """
    from dlrmctl.data.checksums import CHECKSUMS_KEY, file_checksums, meta_files

    path = Path(data_dir) / META_FILE
    _validate_meta(dict(meta), path)
    meta = {**meta, CHECKSUMS_KEY: file_checksums(data_dir, meta_files(dict(meta)))}
    write_json_atomic(path, meta)
    return path


# ---------------------------------------------------------------------------- reading
_REQUIRED_META = ("format_version", "dataset", "dense_features", "sparse_features", "label", "splits")


def _validate_meta(meta: dict, path: Path) -> None:
    for k in _REQUIRED_META:
        if k not in meta:
            raise DataError(f"meta is missing the key '{k}' (required: {list(_REQUIRED_META)})", path=path)
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"format_version {meta['format_version']!r} is not supported "
                        f"(this dlrmctl reads {FORMAT_VERSION}); re-run preprocessing", path=path)
    from dlrmctl.data.checksums import check_meta_paths

    why = check_meta_paths(meta)
    if why is not None:
        raise DataError(f"corrupt meta.json: {why}", path=path)
    for i, sf in enumerate(meta["sparse_features"]):
        for k in ("name", "num_embeddings", "multi_hot"):
            if k not in sf:
                raise DataError(f"sparse_features[{i}] is missing '{k}'", path=path)
        if IDS_KEY in sf and sf[IDS_KEY] != IDS_RAW:
            raise DataError(f"sparse_features[{i}] ({sf['name']}): '{IDS_KEY}' must be "
                            f"{IDS_RAW!r} or absent, got {sf[IDS_KEY]!r}", path=path)
    for name, s in meta["splits"].items():
        if "rows" not in s or "files" not in s:
            raise DataError(f"splits.{name} needs 'rows' and 'files'", path=path)


def read_meta(data_dir: str | os.PathLike) -> dict:
    """Read and validate ``DIR/meta.json``.

    Returns:
        The meta dict (schema in the module docstring).

    Raises:
        DataError: naming the file, when it is missing, not JSON, of another format version,
            or lacks a required key.
    """
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        hint = " (the directory does not exist)" if not Path(data_dir).exists() else ""
        raise DataError(f"not found{hint}; preprocess the data first "
                        "(`dlrmctl preprocess criteo|synthetic --out DIR`)", path=path)
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt meta.json: {e}", path=path) from None
    if not isinstance(meta, dict):
        raise DataError("corrupt meta.json: top level is not an object", path=path)
    _validate_meta(meta, path)
    return meta
