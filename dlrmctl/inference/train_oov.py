"""The share of each feature's train ids that the training vocabulary maps to its out-of-vocabulary
row, from what an exported model carries (the manifest's ``preprocessing`` and its vocabulary files).

A vocabulary keeps the train values counted at least ``min_count`` times; the rarer ones and the
unseen ones share the OOV row.  So even the train split itself has an OOV share, large for a
long-tailed feature (an IP address, a device id): ``predict`` compares an input's share with it.

The vocabulary file (``value``, ``count`` int64 per kept value) gives the kept ids ``K`` of the
train split; ``distinct_train_values`` minus the vocabulary's size ``V`` is the number of rare
values, each seen at least once, so ``O >= distinct - V`` rare ids.  The manifest does not record
the train rows ``R``; for one-valued features ``R (1 - missing_fraction) = K + O``, so the largest
``(K + distinct - V) / (1 - missing_fraction)`` over them is a lower bound of ``R`` (exact when a
feature kept every value), and each feature's ``O`` is at least ``R (1 - missing) - K``.  The share
is ``O (1 - missing) / (K + O)``: a lower bound, exact when ``R`` is.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["train_oov_shares"]


def _kept(path: Path) -> tuple[int, int] | None:
    """``(V values, K train ids)`` of a vocabulary file, or None when it has no counts."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with pa.memory_map(str(path)) as src:
            t = ipc.open_file(src).read_all()
    except (OSError, pa.ArrowInvalid):
        return None
    if "count" not in t.column_names:
        return None
    return t.num_rows, int(sum(int(c) for c in t.column("count").to_numpy()))


def train_oov_shares(manifest: dict, model_dir: str | os.PathLike) -> dict[str, float]:
    """Feature -> the share (a fraction in ``[0, 1]``) of its train ids on the out-of-vocabulary
    row, for each feature with a vocabulary file holding counts and ``distinct_train_values`` in
    the manifest (the module docstring gives the bound); features without them are left out.

    Args:
        manifest: an exported model's ``manifest.json`` dict.
        model_dir: the model directory its ``vocab_files`` are relative to.

    Returns:
        ``{feature: share}``; empty when the manifest has no preprocessing.
    """
    pre = manifest.get("preprocessing") if isinstance(manifest, dict) else None
    if not isinstance(pre, dict):
        return {}
    files = pre.get("vocab_files") or {}
    stats = {}
    for sf in pre.get("sparse") or []:
        if not isinstance(sf, dict) or not isinstance(sf.get("oov_id"), int) or sf.get("name") not in files:
            continue
        distinct = sf.get("distinct_train_values")
        kept = _kept(Path(model_dir) / files[sf["name"]]) if isinstance(distinct, int) else None
        if kept is not None:
            miss = min(max(float(sf.get("missing_fraction") or 0.0), 0.0), 0.999999)
            stats[sf["name"]] = (kept[0], kept[1], distinct, miss, bool(sf.get("multi_hot")))
    rows = max([(k + max(d - v, 0)) / (1 - m) for v, k, d, m, multi in stats.values() if not multi], default=0.0)
    out = {}
    for name, (v, k, d, m, multi) in stats.items():
        o = max(d - v, 0, 0 if multi else rows * (1 - m) - k)
        out[name] = min(o * (1 - m) / (k + o), 1.0) if k + o > 0 else 0.0
    return out
