"""The datasets dlrmctl preprocesses, one record each: the one place a new dataset is added.

A :class:`Dataset` names what the rest of the tool looks up by ``meta["dataset"]``:

* its ``preprocess`` verb: the module whose ``register(preprocess_app)`` adds
  ``dlrmctl preprocess <name>`` (``dlrmctl/cli.py`` mounts every one), or None when the verb is
  defined in :mod:`dlrmctl.commands.preprocess` itself;
* its raw-row transform (``"module:Class"``): ``Class(meta, data_dir, source=...)`` applies the
  training transforms recorded in a ``meta.json`` (or an exported model's manifest) to raw rows:
  ``.file(path, batch_rows)`` yields and ``.lines(list of bytes, name)`` returns
  ``(dense [n, D] float32, ids, labels [n] float32 or None)``, ``ids`` ``[n, S]`` int64 or
  :class:`~dlrmctl.data.raw_rows.Bags` (multi-valued / weighted features); ``predict``, ``serve``
  and the C++ input writer score raw rows through it (:func:`raw_transform_class`).  None: the dataset has no raw format to
  score (its rows exist only preprocessed).

Nothing here imports a dataset's code; modules are imported when used.
"""

from __future__ import annotations

import dataclasses
import importlib

__all__ = ["DATASETS", "Dataset", "raw_transform_class", "raw_transforms"]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One dataset (see the module docstring)."""

    name: str
    summary: str
    command_module: str | None = None
    raw_transform: str | None = None


DATASETS: dict[str, Dataset] = {d.name: d for d in (
    Dataset("criteo", "Criteo Kaggle / 1TB click logs (40 tab-separated fields)", None,
            "dlrmctl.data.criteo.raw_transform:RawTransformer"),
    Dataset("logs", "any CSV / TSV / Parquet / JSON-lines click log described by a schema",
            "dlrmctl.commands.preprocess_logs", "dlrmctl.data.logs.raw_transform:RawTransformer"),
    Dataset("movielens", "MovieLens ratings (ml-100k ... ml-25m)", "dlrmctl.commands.preprocess_movielens"),
    Dataset("synthetic", "Criteo-shaped synthetic data with a planted signal"),
)}


def raw_transforms() -> dict[str, str]:
    """``{dataset: "module:Class"}`` of the datasets whose raw rows can be scored."""
    return {n: d.raw_transform for n, d in DATASETS.items() if d.raw_transform}


def raw_transform_class(dataset: str | None) -> type | None:
    """The raw-row transform class of ``dataset`` (imported now), or None when it has none.

    Raises:
        ImportError / AttributeError: the registered class is not in this dlrmctl.
    """
    d = DATASETS.get(dataset or "")
    if d is None or d.raw_transform is None:
        return None
    mod, cls = d.raw_transform.split(":")
    return getattr(importlib.import_module(mod), cls)
