"""What the non-DLRM baselines of ``scripts/criteo_baselines.py`` and
``scripts/movielens_baselines.py`` share: reading a preprocessed split, one-hot design
matrices, the CTR prior, and a scikit-learn logistic regression whose C is chosen on val.

Needs scikit-learn and scipy (``pip install -e '.[bench]'``).  Every metric comes from
:func:`dlrmctl.metrics.compute_metrics_from_logits`, the function ``dlrmctl train`` /
``dlrmctl evaluate`` report DLRM with, so the figures sit side by side.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrmctl.data.columnar import open_split  # noqa: E402
from dlrmctl.metrics import compute_metrics_from_logits  # noqa: E402

#: inverse L2 strengths tried for the logistic regression (scikit-learn's ``C``); the one with
#: the best validation AUC is kept
DEFAULT_CS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


def cli_main(description: str, data_help: str, run, argv=None) -> dict:
    """The baselines scripts' ``main``: parse ``argv`` (``data_dir``, ``--val-split``,
    ``--test-split``, ``--C``, ``--seed``), call ``run(data_dir, val_split, test_split, cs, seed)``,
    print the elapsed seconds on stderr and return ``run``'s result.  ``data_help`` describes
    ``data_dir`` (which preprocess output the script reads).

    A bad ``--C`` (not numbers, none, a value not finite and > 0), ``--test-split`` equal to
    ``--val-split`` (the split C is chosen on would be reported as the held-out result), a missing
    directory or split, or a single-class train split end the program with the usage line and a
    one-line message (exit status 2), not a traceback.
    """
    import argparse
    import sys
    import time

    from dlrmctl.data.columnar import DataError

    p = argparse.ArgumentParser(description=description)
    p.add_argument("data_dir", help=data_help)
    p.add_argument("--val-split", default="val", help="split C is chosen on (default val)")
    p.add_argument("--test-split", default="test", help="split reported once (default test)")
    p.add_argument("--C", default=",".join(f"{c:g}" for c in DEFAULT_CS),
                   help="comma-separated inverse L2 strengths to try")
    p.add_argument("--seed", type=int, default=0)
    t0 = time.perf_counter()
    a = p.parse_args(argv)
    try:
        cs = parse_cs(a.C)
    except ValueError as e:
        p.error(str(e))
    if a.val_split == a.test_split:
        p.error(f"--test-split {a.test_split!r} is the split C is chosen on (--val-split): the test result "
                "must come from rows no choice was made on")
    try:
        res = run(a.data_dir, a.val_split, a.test_split, cs, a.seed)
    except (DataError, ValueError) as e:
        p.error(str(e))
    print(f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return res


def check_cs(cs) -> tuple[float, ...]:
    """The LR's candidate C values (inverse L2 strengths) as a tuple.

    Raises:
        ValueError: none, or a value not finite and > 0.
    """
    cs = tuple(cs)
    if not cs or not all(math.isfinite(c) and c > 0 for c in cs):
        raise ValueError(f"--C: expected finite numbers > 0 (inverse L2 strengths), got {list(cs)}")
    return cs


def parse_cs(text: str) -> tuple[float, ...]:
    """``--C`` as given on a command line (comma-separated) -> :func:`check_cs`.

    Raises:
        ValueError: not numbers, or as :func:`check_cs`.
    """
    try:
        cs = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--C: expected comma-separated numbers, got {text!r}") from None
    return check_cs(cs)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of ``scores [n]`` (any real scores) for binary ``labels [n]``; ties count 1/2.

    Returns NaN when one class is absent (not the 0.5 convention of the trainer: a
    baseline on one class says nothing).
    """
    labels = np.asarray(labels, dtype=np.float64)
    if labels.size == 0 or labels.min() == labels.max():
        return float("nan")
    from dlrmctl.metrics import auc as _auc

    return float(_auc(np.asarray(scores, dtype=np.float64), labels))


def load(data_dir: str, split: str, meta: dict) -> dict:
    """All columns of a split of ``dlrmctl preprocess`` output.

    Returns:
        ``{"label": [n] f32, "dense": [n, D] f32, "sparse": {feature: (values [nnz] int64,
        lengths [n] int64)}}`` (one-hot features have every length 1).

    Raises:
        dlrmctl.data.columnar.DataError: the split is missing or unreadable (names the path).
    """
    s = open_split(data_dir, split)
    labels, dense, sparse = [], [], {f["name"]: ([], []) for f in meta["sparse_features"]}
    for sh in s.shards:
        loc = sh.locate(np.arange(sh.rows, dtype=np.int64))
        labels.append(sh.take("label", loc))
        dense.append(np.stack([sh.take(n, loc) for n in meta["dense_features"]], axis=1)
                     if meta["dense_features"] else np.zeros((sh.rows, 0), np.float32))
        for f in meta["sparse_features"]:
            if f.get("multi_hot"):
                v, ln = sh.take_list(f["name"], loc)
            else:
                v, ln = sh.take(f["name"], loc), np.ones(sh.rows, dtype=np.int64)
            sparse[f["name"]][0].append(np.asarray(v, dtype=np.int64))
            sparse[f["name"]][1].append(np.asarray(ln, dtype=np.int64))
    return {
        "label": np.concatenate(labels).astype(np.float32),
        "dense": np.concatenate(dense).astype(np.float32),
        "sparse": {k: (np.concatenate(v), np.concatenate(ln)) for k, (v, ln) in sparse.items()},
    }


def design_matrix(d: dict, meta: dict, dense_mean: np.ndarray, dense_std: np.ndarray):
    """``[one-hot of every sparse feature | standardised dense]`` as a scipy CSR matrix, float64.

    Column ``offset_f + id`` is 1 for each id of feature ``f`` in the row (a multi-hot bag
    sets one column per id; an id repeated in a bag counts its repeats); ``offset_f`` is the
    sum of the ``num_embeddings`` of the features before ``f`` in meta.json, so every
    (feature, id) has its own weight (no hashing collisions).  The dense columns are
    ``(x - dense_mean) / dense_std`` with the train split's statistics (the stored values are
    already ``log(1 + x)`` for Criteo).

    Returns:
        ``scipy.sparse.csr_matrix [n, sum(num_embeddings) + D]``.

    Raises:
        ValueError: an id outside ``[0, num_embeddings)`` of its feature (names the feature).
    """
    import scipy.sparse as sp

    n = len(d["label"])
    rows, cols = [], []
    off = 0
    for f in meta["sparse_features"]:
        v, ln = d["sparse"][f["name"]]
        rows_f = int(f["num_embeddings"])
        if v.size and (v.min() < 0 or v.max() >= rows_f):
            raise ValueError(f"feature {f['name']}: ids must be in [0, {rows_f}) (meta.json num_embeddings), "
                             f"got [{v.min()}, {v.max()}]")
        rows.append(np.repeat(np.arange(n, dtype=np.int64), ln))
        cols.append(v + off)
        off += rows_f
    r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    c = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    onehot = sp.csr_matrix((np.ones(len(r)), (r, c)), shape=(n, off))
    dense = (d["dense"].astype(np.float64) - dense_mean) / dense_std
    return sp.hstack([onehot, sp.csr_matrix(dense)], format="csr")


def dense_stats(train: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std ``[D]`` float64 of the train split's dense features (std 1 where 0)."""
    x = train["dense"].astype(np.float64)
    if x.shape[0] == 0:
        return np.zeros(x.shape[1]), np.ones(x.shape[1])
    std = x.std(axis=0)
    return x.mean(axis=0), np.where(std > 0, std, 1.0)


def prior_logits(train_labels: np.ndarray, n: int) -> np.ndarray:
    """The CTR prior: ``logit(train CTR)`` for every one of ``n`` rows, ``[n]`` float64.

    Its AUC is 0.5 (all ties) and its log loss the entropy of the labels under the train CTR.

    Raises:
        ValueError: the train labels are a single class (the logit would be infinite).
    """
    p = float(np.mean(train_labels))
    if not 0.0 < p < 1.0:
        raise ValueError(f"the train split has a single class (CTR {p}): no prior logit")
    return np.full(n, math.log(p / (1.0 - p)))


def fit_logistic_regression(x_train, y_train: np.ndarray, x_val, y_val: np.ndarray,
                            cs: tuple[float, ...] = DEFAULT_CS, seed: int = 0, log=print):
    """scikit-learn ``LogisticRegression`` (L2, lbfgs) for each ``C`` in ``cs``; keeps the best
    validation AUC (ties: the smaller C, i.e. the stronger regularisation).

    Args:
        x_train, x_val: design matrices (:func:`design_matrix`).
        y_train, y_val: labels ``[n]`` in {0, 1}.
        log: called with one line per C (C, val AUC, val log loss).

    Returns:
        ``(model, C, [(C, val metrics dict), ...])``.

    Raises:
        ValueError: ``cs`` empty or not all > 0.
    """
    from sklearn.linear_model import LogisticRegression

    if not cs or min(cs) <= 0:
        raise ValueError(f"C values must be > 0, got {list(cs)}")
    best = None
    table = []
    for c in sorted(cs):
        m = LogisticRegression(C=c, max_iter=5000, tol=1e-6, random_state=seed)
        m.fit(x_train, y_train)
        mv = compute_metrics_from_logits(m.decision_function(x_val), y_val)
        table.append((c, mv))
        log(f"  logistic regression C={c:g}: val AUC {mv['auc']:.4f}  logloss {mv['logloss']:.4f}")
        if best is None or mv["auc"] > best[2]["auc"]:
            best = (m, c, mv)
    return best[0], best[1], table


def metrics(logits: np.ndarray, labels: np.ndarray) -> dict:
    """:func:`dlrmctl.metrics.compute_metrics_from_logits` of ``logits [n]`` (float64)."""
    return compute_metrics_from_logits(np.asarray(logits, dtype=np.float64), np.asarray(labels, dtype=np.float64))


def result_line(name: str, split: str, m: dict, note: str = "") -> str:
    """``<name>  <split> AUC <a>  logloss <l>  (<n> rows[; note])`` — the line both scripts print."""
    return (f"{name:<20} {split} AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
            f"({m['num_samples']} rows{'; ' + note if note else ''})")


def run_baselines(data_dir: str, val_split: str, test_split: str, cs, seed: int, out, log, *,
                  score_baselines=None, lr_note=None, keep_logits: bool = False) -> dict:
    """The shared flow of both baseline scripts: load ``train``, ``val_split`` and ``test_split``,
    score the CTR prior, fit the logistic regression with C chosen on ``val_split``, score it on both
    splits, print one line per baseline and split (via ``out``).

    Args:
        score_baselines: optional ``(meta, evals) -> {name: {split: AUC}}`` of extra score-only
            baselines (e.g. MovieLens' item popularity), printed between the prior and the LR.
        lr_note: optional ``(meta, x_train) -> str`` for the LR lines (default: the column count).
        keep_logits: also return the LR's logits and the labels of both splits (e.g. to pool the
            test rows of several splits, ``scripts/criteo_cv.py``).

    Returns:
        ``{"prior": {split: metrics}, <extra names>: {split: AUC}, "logistic_regression":
        {split: metrics}, "C": float}`` (metrics as ``compute_metrics_from_logits``); with
        ``keep_logits`` also ``"logits": {split: (LR logits [n] float64, labels [n] float32)}``.

    Raises:
        dlrmctl.data.columnar.DataError: a split is missing; ValueError: single-class train split.
    """
    from dlrmctl.data.columnar import read_meta

    meta = read_meta(data_dir)
    train = load(data_dir, "train", meta)
    evals = {s: load(data_dir, s, meta) for s in (val_split, test_split)}
    mean, std = dense_stats(train)
    x = {s: design_matrix(d, meta, mean, std) for s, d in [("train", train), *evals.items()]}
    res: dict = {"prior": {s: metrics(prior_logits(train["label"], len(d["label"])), d["label"])
                           for s, d in evals.items()}}
    extra = score_baselines(meta, evals) if score_baselines else {}
    res.update(extra)
    model, c, _ = fit_logistic_regression(x["train"], train["label"], x[val_split], evals[val_split]["label"],
                                          cs=cs, seed=seed, log=log)
    lr_logits = {s: model.decision_function(x[s]) for s in evals}
    res["logistic_regression"] = {s: metrics(lr_logits[s], d["label"]) for s, d in evals.items()}
    if keep_logits:
        res["logits"] = {s: (lr_logits[s], d["label"]) for s, d in evals.items()}
    res["C"] = c
    for s in (val_split, test_split):
        out(result_line("CTR prior", s, res["prior"][s], f"train CTR {float(train['label'].mean()):.4f}"))
    for name, by_split in extra.items():
        for s in (val_split, test_split):
            out(f"{name.replace('_', ' '):<20} {s} AUC {by_split[s]:.4f}  ({len(evals[s]['label'])} rows)")
    note = lr_note(meta, x["train"]) if lr_note else f"{x['train'].shape[1]} columns"
    for s in (val_split, test_split):
        out(result_line("logistic regression", s, res["logistic_regression"][s], f"C={c:g} chosen on {val_split}; {note}"))
    return res
