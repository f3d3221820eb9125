"""Validation AUC of two non-DLRM baselines on a preprocessed MovieLens directory.

    python scripts/movielens_baselines.py data/movielens [--split val] [--epochs 8]

Both see exactly the rows and split of ``dlrmctl preprocess movielens`` (the columnar
shards + meta.json), so their AUCs sit next to the DLRM figure of ``configs/movielens.yaml``:

* item popularity: score = the item's number of train ratings (the ``item_popularity``
  dense feature, ``log(1 + count)``, a monotone map of it).
* logistic regression: ``sigmoid(b + sum_f w_f[id_f] + w_dense . dense)`` where each sparse
  feature contributes one weight per id (one-hot ids; multi-hot bags sum their ids' weights),
  trained with Adam on the train split (L2 on the id weights, ``--l2``), ``--epochs`` epochs (the
  AUC after the last epoch is the figure; no model selection on the evaluation split).

Prints one line per baseline: ``<name>  AUC <value>  (<rows> <split> rows)``.  AUC is the
exact rank statistic with ties counted 1/2 (Mann-Whitney U / (P N)).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrmctl.data.columnar import open_split, read_meta  # noqa: E402


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of ``scores [n]`` for binary ``labels [n]``; ties count 1/2.

    Returns NaN when one class is absent.
    """
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    bounds = np.flatnonzero(np.r_[True, s[1:] != s[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        ranks[a:b] = (a + b + 1) / 2.0  # average 1-based rank of the tie group
    r = np.empty_like(ranks)
    r[order] = ranks
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def load(data_dir: str, split: str, meta: dict) -> dict:
    """All columns of a split: label ``[n]`` f32, dense ``[n, D]`` f32, per sparse feature
    ``(values [nnz] int64, lengths [n] int64)``."""
    s = open_split(data_dir, split)
    labels, dense, sparse = [], [], {f["name"]: ([], []) for f in meta["sparse_features"]}
    for sh in s.shards:
        loc = sh.locate(np.arange(sh.rows, dtype=np.int64))
        labels.append(sh.take("label", loc))
        dense.append(np.stack([sh.take(n, loc) for n in meta["dense_features"]], axis=1)
                     if meta["dense_features"] else np.zeros((sh.rows, 0), np.float32))
        for f in meta["sparse_features"]:
            if f["multi_hot"]:
                v, ln = sh.take_list(f["name"], loc)
            else:
                v, ln = sh.take(f["name"], loc), np.ones(sh.rows, dtype=np.int64)
            sparse[f["name"]][0].append(v)
            sparse[f["name"]][1].append(ln)
    return {
        "label": np.concatenate(labels),
        "dense": np.concatenate(dense).astype(np.float32),
        "sparse": {k: (np.concatenate(v), np.concatenate(ln)) for k, (v, ln) in sparse.items()},
    }


class LogisticRegression(torch.nn.Module):
    """``logit = b + sum_f EmbeddingBag_f(ids, dim 1, sum) + Linear(dense)``.

    Args:
        cards: rows per sparse feature (one weight per id).
        num_dense: dense features ``D``.

    Forward: ``dense [B, D]`` f32, per feature ``(values, offsets)`` -> logits ``[B]`` f32.
    """

    def __init__(self, cards: dict[str, int], num_dense: int) -> None:
        super().__init__()
        self.names = list(cards)
        self.w = torch.nn.ModuleDict({n: torch.nn.EmbeddingBag(c, 1, mode="sum") for n, c in cards.items()})
        for e in self.w.values():
            torch.nn.init.zeros_(e.weight)
        self.dense = torch.nn.Linear(num_dense, 1)

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        out = self.dense(dense).squeeze(1)
        for n in self.names:
            v, off = sparse[n]
            out = out + self.w[n](v, off).squeeze(1)
        return out


def _batch(d: dict, idx: np.ndarray, starts: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
    sp = {}
    for n, (v, ln) in d["sparse"].items():
        st, l = starts[n][idx], ln[idx]
        total = int(l.sum())
        off = np.zeros(len(idx), dtype=np.int64)
        np.cumsum(l[:-1], out=off[1:])
        gi = np.repeat(st - off, l) + np.arange(total, dtype=np.int64)
        sp[n] = (torch.from_numpy(v[gi]), torch.from_numpy(off))
    return torch.from_numpy(d["dense"][idx]), sp, torch.from_numpy(d["label"][idx])


def _starts(d: dict) -> dict:
    return {n: np.r_[0, np.cumsum(ln)[:-1]].astype(np.int64) for n, (_v, ln) in d["sparse"].items()}


def logistic_regression(train: dict, evald: dict, meta: dict, epochs: int, lr: float, l2: float,
                        batch_size: int, seed: int) -> tuple[float, float, int]:
    """Train LR on ``train`` for ``epochs`` epochs.

    Returns:
        (eval AUC after the last epoch, best eval AUC over epochs, that epoch); the headline
        figure is the first (no model selection on the evaluation split).
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cards = {f["name"]: int(f["num_embeddings"]) for f in meta["sparse_features"]}
    model = LogisticRegression(cards, train["dense"].shape[1])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ts, es = _starts(train), _starts(evald)
    n = len(train["label"])
    all_eval = np.arange(len(evald["label"]))
    best, best_ep = float("nan"), 0
    for ep in range(1, epochs + 1):
        model.train()
        perm = rng.permutation(n)
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            dense, sp, y = _batch(train, idx, ts)
            logit = model(dense, sp)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
            reg = sum((e.weight ** 2).sum() for e in model.w.values()) * (l2 / n)
            opt.zero_grad()
            (loss + reg).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            dense, sp, y = _batch(evald, all_eval, es)
            a = auc(evald["label"], model(dense, sp).numpy())
        print(f"  logistic regression epoch {ep}: AUC {a:.4f}", file=sys.stderr)
        if not best >= a:
            best, best_ep = a, ep
    return a, best, best_ep


def main(argv: list[str] | None = None) -> None:
    """CLI entry: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data_dir", help="output of `dlrmctl preprocess movielens`")
    p.add_argument("--split", default="val", help="evaluation split (default val)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--l2", type=float, default=1.0, help="L2 on id weights, per train row")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.perf_counter()
    meta = read_meta(a.data_dir)
    train, evald = load(a.data_dir, "train", meta), load(a.data_dir, a.split, meta)
    n_eval = len(evald["label"])
    pop_col = meta["dense_features"].index("item_popularity")
    pop = auc(evald["label"], evald["dense"][:, pop_col])
    print(f"item popularity      AUC {pop:.4f}  ({n_eval} {a.split} rows)")
    last, best, ep = logistic_regression(train, evald, meta, a.epochs, a.lr, a.l2, a.batch_size, a.seed)
    print(f"logistic regression  AUC {last:.4f}  ({n_eval} {a.split} rows; after {a.epochs} epochs, best epoch {ep}: "
          f"{best:.4f}; one-hot {', '.join(f['name'] for f in meta['sparse_features'])} "
          f"+ {len(meta['dense_features'])} dense)")
    print(f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
