"""Data fingerprints: is this the data a model was trained on?

A model's ids only mean something with the vocabularies (or hashing) they were
made with, and its validation metrics only mean something on rows it did not
train on.  The fingerprint of a preprocessed directory's ``meta.json`` has three
parts, each a short hash of what it covers:

* ``schema``: dataset, format version, dense feature names, label, sparse feature
  names and kinds (multi-hot, weighted);
* ``vocabulary``: each sparse feature's table size, out-of-vocabulary and missing
  ids, the vocabulary lists meta.json carries, and every transform but the split
  (dense transforms, frequency threshold or hashing, ...);
* ``split``: rows and positive rate of every split, the split's own rule
  (ratios, seed, by day), and the shards' SHA-256 meta.json records (``checksums``,
  :mod:`dlrmctl.data.checksums`; compared only when both sides have them).

``evaluate`` (a run or an exported model), ``export`` and ``train --resume``
compare the data they are given with the data the run recorded
(``runs/<name>/data_meta.json``, or the ``data`` entry of an export's
manifest.json) and refuse a mismatch, naming both sources, both fingerprints and
the first differences.  A fingerprint is computed from meta.json alone, in
microseconds; :func:`check_run_data` also verifies the shards' bytes against the
checksums (once per process per file).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Sequence

from dlrmctl.errors import UserError

PARTS = ("schema", "vocabulary", "split")
#: sparse-feature keys that describe the input's kind (schema part)
_KIND_KEYS = ("multi_hot", "weighted", "dtype", "ids")
#: sparse-feature keys that describe its id space (vocabulary part)
_ID_KEYS = ("num_embeddings", "oov_id", "missing_id")


class DataMismatchError(ValueError, UserError):
    """The data given is not the data the model was trained on (message: both sources and what differs)."""


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _parts(meta: dict) -> dict[str, Any]:
    sparse = meta.get("sparse_features") or []
    transforms = dict(meta.get("transforms") or {})
    split_rule = transforms.pop("split", None)
    return {
        "schema": {
            "dataset": meta.get("dataset"),
            "format_version": meta.get("format_version"),
            "dense_features": meta.get("dense_features"),
            "label": meta.get("label"),
            "sparse_features": [{k: f.get(k) for k in ("name", *_KIND_KEYS) if k in f} for f in sparse],
        },
        "vocabulary": {
            # raw ids (``"ids": "raw"``): the id space is the one hash, whatever the day's distinct count
            "sparse_features": {f.get("name"): ({} if f.get("ids") == "raw" else
                                                {k: f.get(k) for k in _ID_KEYS if k in f}) for f in sparse},
            "vocabularies": meta.get("vocabularies"),
            "transforms": transforms,
        },
        "split": {
            "rows": {s: (v or {}).get("rows") for s, v in (meta.get("splits") or {}).items()},
            "ctr": meta.get("ctr"),
            "rule": split_rule,
            # the shards' SHA-256 (datasets made before checksums: absent, and the hash as before)
            **({"content": {f: (c or {}).get("sha256") for f, c in meta["checksums"].items()}}
               if isinstance(meta.get("checksums"), dict) else {}),
        },
    }


def data_fingerprint(meta: dict) -> dict[str, str]:
    """``{"schema", "vocabulary", "split", "all"}`` -> 12-hex-digit hashes of a meta.json dict."""
    parts = _parts(meta)
    fp = {k: _h(v) for k, v in parts.items()}
    fp["all"] = _h([fp[k] for k in PARTS])
    return fp


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 40 else s[:37] + "..."


def _diffs(a: Any, b: Any, path: str = "") -> Iterable[tuple[str, Any, Any]]:
    """Leaves where ``a`` and ``b`` differ, depth first: ``(dotted path, a value, b value)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            p = f"{path}.{k}" if path else str(k)
            if k not in b:
                yield p, a[k], "absent"
            elif k not in a:
                yield p, "absent", b[k]
            else:
                yield from _diffs(a[k], b[k], p)
    elif a != b:
        yield path, a, b


def describe_differences(expected: dict, actual: dict, parts: Sequence[str] = PARTS, limit: int = 3) -> list[str]:
    """Per differing part, ``"<part> differs (first differences)"``, expected value first."""
    pa, pb = _parts(expected), _parts(actual)
    out = []
    for part in parts:
        d = list(_diffs(pa[part], pb[part]))
        if part == "vocabulary":  # one entry per feature: its table size when that differs
            resized = {p.split(".")[1] for p, _, _ in d if p.startswith("sparse_features.") and p.endswith(".num_embeddings")}
            d = [(p, x, y) for p, x, y in d
                 if not (p.startswith("sparse_features.") and p.split(".")[1] in resized and not p.endswith(".num_embeddings"))]
        if not d:
            continue
        shown = []
        for p, x, y in d[:limit]:
            if p.startswith("sparse_features.") and p.endswith(".num_embeddings"):
                p, unit = p.split(".")[1], " rows"
            elif p.startswith("rows."):
                p, unit = p[len("rows."):], " rows"
            else:
                p, unit = p.replace("sparse_features.", "", 1), ""
            shown.append(f"{p}: {_fmt(x)} vs {_fmt(y)}{unit if isinstance(x, int) and isinstance(y, int) else ''}")
        more = f", and {len(d) - limit} more" if len(d) > limit else ""
        out.append(f"{part} differs ({'; '.join(shown)}{more})")
    return out


def check_same_data(expected: dict, expected_src: str, actual: dict, actual_src: str,
                    parts: Sequence[str] = PARTS, hint: str = "") -> dict[str, str]:
    """Refuse ``actual`` (the data given) unless its fingerprint's ``parts`` equal ``expected``'s
    (the data the model was trained on).

    Args:
        expected, expected_src: the recorded meta.json dict and where it was read (printed).
        actual, actual_src: the data's meta.json dict and where it was read (printed).
        parts: the parts that must match (:data:`PARTS`).
        hint: what to do instead, appended to the message.

    Returns:
        ``actual``'s fingerprint.

    Raises:
        DataMismatchError: one line naming both sources, both fingerprints and the first differences.
    """
    if ("checksums" in expected) != ("checksums" in actual):  # one side made before checksums: rows, ctr, rule only
        expected, actual = ({k: v for k, v in m.items() if k != "checksums"} for m in (expected, actual))
    fe, fa = data_fingerprint(expected), data_fingerprint(actual)
    if all(fe[p] == fa[p] for p in parts):
        return fa
    what = "; ".join(describe_differences(expected, actual, parts))
    key = "all" if tuple(parts) == PARTS else "+".join(parts)
    if key != "all":
        fe[key] = "/".join(fe[p] for p in parts)
        fa[key] = "/".join(fa[p] for p in parts)
    raise DataMismatchError(
        f"{actual_src} is not the data the model was trained on: {what} (trained on vs given); data "
        f"fingerprints {fe[key]} ({expected_src}) vs {fa[key]} ({actual_src})" + (f". {hint}" if hint else "")
    )


def read_meta_json(path: str | os.PathLike, what: str = "meta.json") -> dict:
    """A meta.json-like file as a dict (no validation).

    Raises:
        DataMismatchError: missing or not a JSON object (names the file).
    """
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataMismatchError(f"{path}: missing; cannot check the {what}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DataMismatchError(f"{path}: cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise DataMismatchError(f"{path}: not a JSON object")
    return meta


def check_run_data(recorded: str | os.PathLike, data_dir: str | os.PathLike, parts: Sequence[str] = PARTS,
                   hint: str = "") -> dict[str, str]:
    """:func:`check_same_data` of ``data_dir/meta.json`` against a run's recorded ``data_meta.json``.

    With ``"split"`` in ``parts`` the shards' bytes are verified too (:func:`dlrmctl.data.checksums.verify_files`).

    Returns:
        the data's fingerprint.

    Raises:
        DataMismatchError: a file is missing or unreadable, the fingerprints differ, or a shard is
            not the bytes meta.json's checksum records.
    """
    from dlrmctl.data.checksums import verify_files

    rec = os.fspath(recorded)
    cur = os.path.join(os.fspath(data_dir), "meta.json")
    actual = read_meta_json(cur, "data")
    fp = check_same_data(read_meta_json(rec, "data the run was trained on"), rec, actual, cur, parts, hint)
    if "split" in parts:  # the rows themselves: each shard's bytes against the checksum meta.json records
        verify_files(data_dir, actual, [f for i in (actual.get("splits") or {}).values() if isinstance(i, dict)
                                        for f in (i.get("files") or [])], DataMismatchError)
    return fp


def split_rows(meta: dict, data_dir: str | os.PathLike, split: str, role: str = "") -> int:
    """Rows of ``split`` by meta.json; a missing or empty split is a one-line error naming it.

    Args:
        role: what the split is used for, e.g. ``"data.val_split"`` (named in the message).

    Raises:
        DataError: the split is unknown or has 0 rows (names the directory, the split and the
            splits that have rows).
    """
    from dlrmctl.data.columnar import DataError

    splits = meta.get("splits") or {}
    have = ", ".join(f"{s} {int((v or {}).get('rows') or 0):,}" for s, v in splits.items()) or "none"
    who = f"{role} '{split}'" if role else f"split '{split}'"
    where = os.path.join(os.fspath(data_dir), "meta.json")
    if split not in splits:
        raise DataError(f"{who}: no such split (rows per split: {have})", path=where)
    rows = int((splits[split] or {}).get("rows") or 0)
    if rows == 0:
        raise DataError(f"{who} has 0 rows (rows per split: {have}); choose another split or preprocess "
                        "with a ratio that gives it rows", path=where)
    return rows
