"""``meta.json`` of a ``preprocess logs`` dataset: the features, table sizes, split and transforms
of :func:`dlrmctl.data.logs.preprocess.preprocess_logs`, from its parts' statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrmctl.data.columnar import IDS_KEY, IDS_RAW
from dlrmctl.data.columnar.parts import parts_meta, split_rows
from dlrmctl.data.logs.derived import count_paths
from dlrmctl.data.logs.options import LogOptions
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.vocab_rules import describe

__all__ = ["dataset_meta"]


def dataset_meta(schema: LogSchema, o: LogOptions, files: list[Path], st: dict, sizes: list[int], vocab_info: dict,
                 dense_stats: dict, cutoffs) -> dict:
    """The dataset's meta.json dict (``bad_lines_skipped``, ``sparse_features``, ``transforms``, ...).

    Args:
        schema: the schema as recorded (side tables relative to the data directory).
        o: the options of the run.
        files: the input files; ``st``: per file its part's statistics (``done.json``).
        sizes: per categorical its ``num_embeddings``; ``vocab_info``: per counted categorical
            ``{"size", "distinct_train_values"}``.
        dense_stats: ``{name: (mean, std)}`` of ``standardize`` columns; ``cutoffs``: the time
            split's ``(val_from, test_from)`` or ``(None, None)``.
    """
    rows = split_rows(files, st)
    total = sum(rows.values())
    labelled = schema.label is not None
    sparse, tr_sparse = [], {}
    for i, c in enumerate(schema.categorical):
        missing = sum(st[f]["missing"][i] for f in files)
        e: dict[str, Any] = {"name": c.name, "num_embeddings": int(sizes[i]), "multi_hot": c.multi}
        if c.multi:
            tv = sum(st[f]["train_values"][i] for f in files)
            e["mean_pooling_factor"] = tv / rows["train"] if rows["train"] else 0.0
            e["max_pooling_factor"] = max(st[f]["max_len"][i] for f in files)
        else:
            e["mean_pooling_factor"], e["max_pooling_factor"] = 1.0, 1
        if c.mode == "vocab" and c.oov == "error":
            pass  # no out-of-vocabulary or missing row
        elif c.mode == "vocab":
            e["missing_id"] = int(sizes[i] - 1)
        elif not c.multi:
            e["missing_id"] = 0
        e["missing_fraction"] = missing / total if total else 0.0
        if c.mode == "vocab" and c.oov != "error":
            e["oov_id"] = int(sizes[i] - 2)
        if c.mode in ("vocab", "raw"):
            e["distinct_train_values"] = vocab_info[i]["distinct_train_values"]
        if c.mode == "raw":
            e[IDS_KEY] = IDS_RAW
        if c.weights:
            e["weighted"] = True
        sparse.append(e)
        tr_sparse[c.name] = {
            "vocab": describe(c) if c.mode == "vocab" else {},
            "hash": {"mode": "hash", "buckets": c.buckets, "formula": "id = raw_id mod buckets (missing -> 0)"},
            "raw": {"mode": "raw", "formula": "id = raw_id (missing -> 0)"},
        }[c.mode] | {"key": "int(s, 16) of 8 hex digits" if c.parse == "hex" else
                     "raw_id = FNV-1a-64 of the UTF-8 text & (2^63 - 1) (dlrmctl.data.ids)"}
    split = ({"mode": "unlabelled", "test": "all rows"} if not labelled else
             {"mode": "time", "column": schema.time, "val_ratio": o.val_ratio, "test_ratio": o.test_ratio,
              "val_from": cutoffs[0], "test_from": cutoffs[1],
              "rule": "test if time >= test_from, else val if time >= val_from, else train"}
             if o.split_by == "time" else
             {"mode": "ratio", "val_ratio": o.val_ratio, "test_ratio": o.test_ratio, "seed": o.seed,
              "rule": "u = splitmix64(blake2b(seed:file) ^ line*0xD1B54A32D192ED03)/2^64; "
                      "val if u < val_ratio, test if u < val_ratio+test_ratio"})
    head = {"dataset": "logs", "schema_name": schema.name, "schema": schema.to_dict(),
            "dense_features": [d.name for d in schema.dense], "sparse_features": sparse}
    return parts_meta(files, st, labelled, head, {
        "transforms": {
            "label": schema.label.describe() if labelled else None,
            "dense": {d.name: {"transform": d.transform, "fill": d.fill, "dtype": "float32",
                               **({"mean": dense_stats[d.name][0], "std": dense_stats[d.name][1]}
                                  if d.name in dense_stats else {}), **_derived(d)} for d in schema.dense},
            "sparse": tr_sparse,
            "split": split,
            "on_bad_line": o.on_bad_line,
        },
        "vocab_files": {**{c.name: f"vocab/{c.name}.arrow" for c in schema.categorical if c.mode == "vocab"},
                        **{f"count:{n}": p for n, p in count_paths(schema).items()}},
    })



def _derived(d) -> dict[str, Any]:
    """meta.json's words for a derived dense feature (:mod:`dlrmctl.data.logs.derived`)."""
    if d.count_of:
        return {"formula": f"number of train rows with this row's {d.count_of} (0 for none)", "computed_on": "train",
                "table": f"vocab/count_{d.name}.arrow"}
    if d.extract:
        return {"formula": f"the number of the first group of {d.extract[1]!r} in {d.extract[0]}; no match: missing"}
    if d.years_since:
        return {"formula": f"UTC year of the time minus {d.years_since} (after its fill, before standardize)"}
    return {}
