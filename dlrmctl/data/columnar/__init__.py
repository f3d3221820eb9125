"""Columnar on-disk format shared by every dataset: Arrow IPC shards + ``meta.json``.

Layout of a preprocessed directory::

    DIR/meta.json                        description of everything below (see FORMAT below)
    DIR/parts/<part>/<split>.arrow       Arrow IPC *file* format shards, uncompressed, memory-mappable
    DIR/vocab/<feature>.arrow            optional vocabularies (criteo ``--frequency-threshold``)

Every shard holds one column per feature, no nulls:

* ``label``: float32 ``[rows]`` (0.0 / 1.0); absent for unlabelled data.
* one float32 ``[rows]`` column per dense feature (already transformed, e.g. log(x+1)), finite.

Values are checked where they enter training and evaluation (:func:`check_rows`, called by the
loader on every piece of a shard it reads, vectorised): a label other than 0 or 1 (NaN included)
or a dense value that is NaN or infinite is a :class:`DataError` naming the shard, the split,
the row, the column and the value.  No value is ever silently replaced: missing dense values
are the preprocessor's business (Criteo's empty field -> 0 before ``log(x+1)``).
* one int64 ``[rows]`` column per one-hot sparse feature (ids in ``[0, num_embeddings)``).
* one ``list<int64>`` column per multi-hot sparse feature (bags of ids).
* a *raw-id* sparse feature (meta.json ``"ids": "raw"``, :data:`IDS_KEY` = :data:`IDS_RAW`) holds raw
  64-bit ids from :func:`dlrmctl.data.ids.raw_ids` instead (int64 in ``[0, 2**63)``, 0 = missing),
  not bounded by ``num_embeddings``; its ``num_embeddings`` is the exact number of distinct raw ids
  in the train split (informational).  Only a managed-collision table may read such a feature.
* optional per-id weights of a sparse feature ``F`` (weighted features, see ``model.tables[].weighted``):
  a column ``F__weight`` (:func:`weight_column`), float32 ``[rows]`` for a one-hot feature,
  ``list<float32>`` with the same bag lengths as ``F`` for a multi-hot one; meta.json marks the
  feature ``"weighted": true``.  Criteo and MovieLens write none; ``dlrmctl preprocess synthetic
  --weighted-features`` does.

A shard may hold several record batches (written while streaming).  Readers map the whole
file once and address every column of every record batch inside that one mapping
(:class:`MappedShard`), so a batch gather over many record batches is a handful of numpy
fancy-index operations, not a Python loop over chunks.

FORMAT (``meta.json``, ``format_version`` 1)::

    {
      "format_version": 1,
      "dataset": "criteo" | "synthetic" | ...,
      "dense_features": ["I1", ...],
      "sparse_features": [{"name": "C1", "num_embeddings": N, "multi_hot": false,
                           "mean_pooling_factor": 1.0, "max_pooling_factor": 1,
                           "weighted": false (optional: true when the shards have C1__weight),
                           "ids": "raw" (optional: raw 64-bit ids; absent = index ids), ...}, ...],
      "label": "label" | null,
      "splits": {"train": {"rows": n, "files": ["parts/x/train.arrow", ...]}, "val": ..., "test": ...},
      "ctr": {"train": 0.25, ...},            # mean label per split (null when no rows / no label)
      "transforms": {...},                    # every transform applied, with its source
      "vocab_files": {"C1": "vocab/C1.arrow", ...},   # may be empty
      ...dataset-specific keys (e.g. "bayes_auc" for synthetic)
    }

File paths inside meta are relative to DIR.

The package: :mod:`~dlrmctl.data.columnar.format` (names, :class:`DataError`, the schema,
meta.json), :mod:`~dlrmctl.data.columnar.writer` (:class:`ShardWriter`),
:mod:`~dlrmctl.data.columnar.parts` (a preprocess's per-input-file parts, built and resumed),
:mod:`~dlrmctl.data.columnar.mapped` (:class:`MappedShard`), :mod:`~dlrmctl.data.columnar.split`
(:class:`SplitData`, :func:`open_split`, row checks, dense statistics); every public name is
importable from ``dlrmctl.data.columnar``.
"""

from dlrmctl.data.columnar.format import (
    FORMAT_VERSION,
    IDS_KEY,
    IDS_RAW,
    LABEL_COLUMN,
    META_FILE,
    SPLITS,
    WEIGHT_SUFFIX,
    DataError,
    check_split_ratios,
    is_raw_feature,
    read_meta,
    shard_schema,
    weight_column,
    write_json_atomic,
    write_meta,
)
from dlrmctl.data.columnar.writer import (
    ShardWriter,
    write_split_shard,
)
from dlrmctl.data.columnar.parts import (
    DONE_FILE,
    PartBuild,
    file_identity,
    finished_part,
    fingerprint,
    part_fingerprint,
    parts_meta,
    split_rows,
)
from dlrmctl.data.columnar.mapped import (
    MappedShard,
    jagged_gather,
)
from dlrmctl.data.columnar.split import (
    DENSE_STATS_MAX_ROWS,
    SplitData,
    check_rows,
    dense_column_stats,
    open_split,
)

__all__ = [
    "FORMAT_VERSION",
    "IDS_KEY",
    "IDS_RAW",
    "LABEL_COLUMN",
    "META_FILE",
    "SPLITS",
    "WEIGHT_SUFFIX",
    "DataError",
    "check_split_ratios",
    "is_raw_feature",
    "read_meta",
    "shard_schema",
    "weight_column",
    "write_json_atomic",
    "write_meta",
    "ShardWriter",
    "write_split_shard",
    "DONE_FILE",
    "PartBuild",
    "file_identity",
    "finished_part",
    "fingerprint",
    "part_fingerprint",
    "parts_meta",
    "split_rows",
    "MappedShard",
    "jagged_gather",
    "DENSE_STATS_MAX_ROWS",
    "SplitData",
    "check_rows",
    "dense_column_stats",
    "open_split",
]
