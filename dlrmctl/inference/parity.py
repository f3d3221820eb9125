"""Export parity report: the artifact vs the float model it was exported from.

Stored as ``manifest["parity"]`` by ``dlrmctl export`` and printed::

    {"split", "rows",                                  # rows scored (at most max_rows of the split)
     "artifact": {"auc", "logloss"}, "float": {"auc", "logloss"},
     "max_abs_dlogit",                                 # max |logit(artifact) - logit(float)|
     "bytes": {"files": n, "embeddings": m},
     "latency_ms": {"1": {"p50", "p99"}, "64": {...}, "4096": {...}},   # one call per batch, CPU
     "threads": torch.get_num_threads(), "note": "..."}

Latency batches use one id per feature drawn uniformly from its table (synthetic: the
numbers measure the artifact, not the data).  The float model is built only when its tables
fit ``max_float_bytes`` (export itself never holds the whole float model).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["LATENCY_BATCHES", "parity_report", "latency"]

LATENCY_BATCHES = (1, 64, 4096)


def _synthetic(m: Any, B: int, g: torch.Generator) -> tuple:
    rows = {}
    for t in m.manifest["tables"]:
        for f in t["features"]:
            rows[f] = min(rows.get(f, 1 << 62), int(t["num_embeddings"]))
    values = torch.cat([torch.randint(0, rows[f], (B,), generator=g) for f in m.feature_names])
    lengths = torch.ones(len(m.feature_names) * B, dtype=torch.int64)
    w = torch.rand(values.numel(), generator=g) if m.weighted_features else None
    return torch.rand(B, m.num_dense, generator=g), values, lengths, w


@torch.no_grad()
def latency(m: Any, batches=LATENCY_BATCHES, budget_s: float = 1.0,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """p50 / p99 milliseconds of one :meth:`ExportedModel.logits` call per batch size, read on
    ``clock`` (default wall time; ``time.process_time``: this process's CPU time, all its threads,
    which other processes' load on a shared machine does not inflate).

    The time per batch size is bounded by the first (warm-up) call's ``w`` seconds: a fast call
    (``w <= budget_s / 10``) gets 2 more warm-up calls, then timed calls until ``budget_s`` seconds
    have passed (at least 5, at most 200); a slower one (``w <= budget_s``) no more warm-up and 3
    timed calls; one slower than ``budget_s`` a single timed call.  So a batch size takes about
    ``max(budget_s, 4 w)`` seconds at most, however slow the artifact.  Each batch size announces
    itself with a :func:`~dlrmctl.console.stage` line.

    Returns:
        ``{str(B): {"p50", "p99": ms, "calls": timed calls}}``.
    """
    from dlrmctl.console import stage

    g = torch.Generator().manual_seed(0)
    out = {}
    for B in batches:
        stage(f"latency at batch {B:,}")
        args = _synthetic(m, B, g)
        t0 = time.perf_counter()
        m.logits(*args)
        w = time.perf_counter() - t0
        if w <= budget_s / 10:
            for _ in range(2):
                m.logits(*args)
            least, most = 5, 200
        else:
            least = most = 3 if w <= budget_s else 1
        ts: list[float] = []
        t_end = time.perf_counter() + budget_s
        while len(ts) < most and (len(ts) < least or time.perf_counter() < t_end):
            t0 = clock()
            m.logits(*args)
            ts.append((clock() - t0) * 1e3)
        out[str(B)] = {"p50": float(np.percentile(ts, 50)), "p99": float(np.percentile(ts, 99)), "calls": len(ts)}
    return out


@torch.no_grad()
def parity_report(m: Any, reference: Callable[[], torch.nn.Module] | None, data_dir: Any, split: str = "val",
                  multi_hot: dict | None = None, max_rows: int = 16384, batch_size: int = 4096) -> dict:
    """Parity and latency of the loaded artifact ``m`` (:class:`~dlrmctl.inference.export.ExportedModel`).

    Args:
        reference: builds the float (training-code) model, or None (no float comparison).
        data_dir: preprocessed data with ``split`` (labels needed), or None: latency only.
        multi_hot: the training loader's multi-hot arguments (the float model gets expanded bags;
            an artifact that expands in the program gets the one-hot ids).
        max_rows: rows of the split scored.

    Returns:
        the report dict (module doc); ``"note"`` says what was skipped and why.
    """
    from dlrmctl.metrics import compute_metrics_from_logits

    rep: dict[str, Any] = {"threads": torch.get_num_threads(), "note": ""}
    files = sum(int(r.get("bytes") or 0) for r in (m.manifest.get("files") or {}).values())
    rep["bytes"] = {"files": files, "embeddings": int(m.manifest["embedding_bytes"]["stored"])}
    rep["latency_ms"] = latency(m)
    if data_dir is None:
        rep["note"] = "no data: parity not measured"
        return rep
    from dlrmctl.data.fingerprint import read_meta_json
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.inference.export import to_host

    import os

    meta = read_meta_json(os.path.join(str(data_dir), "meta.json"), "data")
    if split not in (meta.get("splits") or {}):
        rep["note"] = f"data has no split '{split}': parity not measured"
        return rep
    mh = dict(multi_hot or {})
    in_prog = "multi_hot" in (m.manifest.get("in_program") or [])

    def loader(expand: bool):
        return BatchLoader(str(data_dir), split, batch_size, shuffle=False, features=m.feature_names,
                           weighted_features=m.weighted_features, num_samples=max_rows,
                           **(mh if expand else {}))

    z_art, labels = [], []
    for b in loader(not in_prog):
        if bool(torch.isnan(b.labels).any()):
            rep["note"] = f"split '{split}' has no labels: parity not measured"
            return rep
        z_art.append(to_host(m.logits_kjt(b.dense_features.float(), b.sparse_features)))
        labels.append(b.labels.numpy())
    if not z_art:
        rep["note"] = f"split '{split}' is empty"
        return rep
    za, y = np.concatenate(z_art), np.concatenate(labels)
    ma = compute_metrics_from_logits(za, y)
    rep.update({"split": split, "rows": int(len(y)), "artifact": {"auc": ma["auc"], "logloss": ma["logloss"]}})
    if reference is None:
        rep["note"] = "float model not built (tables larger than the parity bound): no float comparison"
        return rep
    ref = reference().eval()
    z_ref = [ref(b.dense_features.float(), b.sparse_features).reshape(-1).float().numpy() for b in loader(True)]
    zr = np.concatenate(z_ref)
    mr = compute_metrics_from_logits(zr, y)
    rep["float"] = {"auc": mr["auc"], "logloss": mr["logloss"]}
    rep["max_abs_dlogit"] = float(np.max(np.abs(za.astype(np.float64) - zr.astype(np.float64))))
    return rep
