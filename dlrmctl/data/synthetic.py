"""Synthetic Criteo-schema click data with a planted, learnable logistic signal.

Schema: 13 dense features ``I1..I13`` (stored as ``log(x+1)`` of non-negative counts, like the
Criteo transform), 26 one-hot categorical features ``C1..C26`` with power-law (Zipf) id
frequencies, a binary label.  Output is the same columnar format as ``dlrmctl preprocess criteo``
(:mod:`dlrmctl.data.columnar`), so everything downstream is identical.

Generative model (all parameters drawn from ``seed``):

* categorical: table ``t`` has ``N_t`` rows; rank ``k`` has probability ``∝ (k+1)^-alpha``
  (truncated Zipf, default ``alpha=1.05``); ranks map to ids through a fixed random permutation.
* dense: raw count ``x_j = floor(exp(Normal(mu_j, 1)))`` and the stored value ``d_j = log(x_j+1)``.
* logit ``= b + sum_{j in I1..I6} w_j (d_j - mu_j) + sum_{t in C1..C8} e_t[id_t]`` with
  ``w_j ~ ±U(0.3, 0.6)`` and per-id random effects ``e_t[i] ~ Normal(0, 0.5)``; the other
  features are pure noise.  The signal lives on the dense features and on the first 8 tables
  (the default gives them 20..1000 rows), a first-order structure a DLRM learns from a few
  hundred thousand rows.
* optional planted pairwise interactions (``interaction_features`` / ``--interaction-features
  C1,C2,C3,C4``, ``--interaction-dim K``, ``--interaction-std S``): each id ``i`` of such a
  feature ``t`` gets a latent vector ``v_t[i] = c (z_t[i] - sum_j P_t(j) z_t[j])``,
  ``z_t[i] ~ Normal(0, I_K)``, centred under the feature's id distribution ``P_t`` (the Zipf
  draw), and the logit gains ``sum_{a<b} <v_a[id_a], v_b[id_b]>`` over every pair of the listed
  features.  The features are independent, so each pair term has mean 0 and zero mean over
  either of its features alone, and the terms are uncorrelated: the scale ``c`` is solved from
  ``Var = sum_{a<b} tr(C_a C_b)`` (``C_t = E[v_t v_t^T]``, exact over ``P_t``) so that the
  interaction term has standard deviation exactly ``S``.  No function additive in the features
  (a logistic regression on one-hot ids) can use it; a factorisation model (DLRM's dot
  interaction, DCN-v2's cross layers) can.  The vectors come from their own random
  stream: without interaction features the output is unchanged.
* ``label ~ Bernoulli(sigmoid(logit))``; ``b`` is set so the CTR is about 25 % (Criteo-like).
* optional weighted features (``weighted_features`` / ``--weighted-features C1,C2``): each id of
  such a feature gets a weight ``w ~ U(0.5, 2.0)`` (stored in the ``<feature>__weight`` column,
  meta ``"weighted": true``) and its random effect enters the logit as ``w * e_t[id]``, so a
  model with ``weighted: true`` tables can use it.  The weights come from their own random
  stream: without weighted features the output is unchanged.

``meta.json`` carries ``bayes_auc``: the ROC AUC of the true probabilities (the planted logits,
interactions included) against the drawn labels of the validation split (test split if there is
no validation split), the best AUC any model can reach there; it is computed exactly from the
planted logits, not estimated by a model.  With interactions, ``bayes_auc_no_interactions`` is the
same AUC of the planted logit without its interaction term (a diagnostic: what is left when the
interactions are ignored).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from dlrmctl.data.columnar import (
    FORMAT_VERSION,
    LABEL_COLUMN,
    SPLITS,
    ShardWriter,
    check_split_ratios,
    shard_schema,
    weight_column,
    write_meta,
)
from dlrmctl.data.criteo.parse import DENSE_FEATURES, SPARSE_FEATURES, row_split_codes
from dlrmctl.data.criteo.preprocess import PreprocessReport

# default table sizes: modest signal tables first (C1..C8), larger noise tables after
DEFAULT_SYNTHETIC_CARDINALITIES = [
    100, 500, 1000, 200, 50, 1000, 300, 20,
    2000, 5000, 10000, 1000, 3000, 100, 8000, 500, 10, 4000, 10000, 700, 2500, 30, 6000, 400, 1200, 90,
]
SIGNAL_TABLES = 8
SIGNAL_DENSE = 6
EFFECT_STD = 0.5
BLOCK_ROWS = 1 << 18
#: ``--interaction-dim`` and ``--interaction-std`` defaults (used when interaction features are given)
DEFAULT_INTERACTION_DIM = 4
DEFAULT_INTERACTION_STD = 1.5

__all__ = ["DEFAULT_SYNTHETIC_CARDINALITIES", "generate_synthetic", "planted_model", "roc_auc"]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank statistic, ties get average ranks.

    Args:
        scores: ``[n]`` float predictions.
        labels: ``[n]`` 0/1.

    Returns:
        ``P(score_pos > score_neg) + 0.5 P(tie)``; NaN if one class is absent.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    npos = int(labels.sum())
    nneg = len(labels) - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based start rank of each tie group
    avg_rank = first + (counts + 1) / 2.0  # 1-based average rank
    ranks = avg_rank[inv]
    rank_pos = ranks[labels[order]].sum()
    return float((rank_pos - npos * (npos + 1) / 2.0) / (npos * nneg))


class _Model:
    """The planted generative model (parameters only; rows are drawn per block)."""

    def __init__(self, seed: int, cards: Sequence[int], alpha: float, interaction_tables: Sequence[int] = (),
                 interaction_dim: int = DEFAULT_INTERACTION_DIM,
                 interaction_std: float = DEFAULT_INTERACTION_STD) -> None:
        rng = np.random.default_rng([seed, 0x5EED])
        self.cards = list(cards)
        self.cdfs = []
        self.perms = []
        for n in self.cards:
            p = (np.arange(1, n + 1, dtype=np.float64)) ** -alpha
            cdf = np.cumsum(p)
            self.cdfs.append(cdf / cdf[-1])
            self.perms.append(rng.permutation(n).astype(np.int64))
        self.mu = rng.uniform(0.5, 3.0, size=13)
        sign = rng.choice([-1.0, 1.0], size=SIGNAL_DENSE)
        self.w = np.zeros(13)
        self.w[:SIGNAL_DENSE] = sign * rng.uniform(0.3, 0.6, size=SIGNAL_DENSE)
        self.effects = [rng.normal(0.0, EFFECT_STD, size=n) if t < SIGNAL_TABLES else None
                        for t, n in enumerate(self.cards)]
        # bias: CTR ~ 25 % given the logit spread (probit approximation of E[sigmoid])
        var = float((self.w ** 2).sum()) + sum(EFFECT_STD ** 2 for e in self.effects if e is not None)
        # planted pairwise interactions: their own stream, so the parameters above never move
        self.interaction_tables = sorted(interaction_tables)
        self.latent: dict[int, np.ndarray] = {}
        self.latent_std = 0.0
        pairs = len(self.interaction_tables) * (len(self.interaction_tables) - 1) // 2
        if pairs:
            irng = np.random.default_rng([seed, 0x1A7E])
            cov = {}
            for t in self.interaction_tables:
                v = irng.normal(0.0, 1.0, size=(self.cards[t], interaction_dim))
                p_id = np.empty(self.cards[t])
                p_id[self.perms[t]] = np.diff(self.cdfs[t], prepend=0.0)  # P(id) under the Zipf draw
                v -= p_id @ v  # centred: E_id[v_t[id]] = 0, so no additive part hides in the interaction
                self.latent[t] = v
                cov[t] = (v * p_id[:, None]).T @ v  # E_id[v v^T], [K, K]
            # the pair terms are uncorrelated with mean 0: Var = sum_{a<b} tr(C_a C_b); one scale c
            # (Var ~ c^4) makes the interaction term's standard deviation exactly interaction_std
            it = self.interaction_tables
            raw_var = sum(float(np.trace(cov[a] @ cov[b])) for k, a in enumerate(it) for b in it[k + 1:])
            c = (interaction_std ** 2 / raw_var) ** 0.25
            for t in it:
                self.latent[t] *= c
            self.latent_std = float(c)
            var += interaction_std ** 2
        self.bias = float(np.log(0.25 / 0.75) * np.sqrt(1.0 + np.pi * var / 8.0))

    def interaction_logit(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """The planted interaction term ``sum_{a<b} <v_a[id_a], v_b[id_b]>`` of rows with the 26
        id columns ``ids`` (each ``[n]`` int64) -> ``[n]`` float64 (zeros without interactions);
        computed as ``(|sum_t v_t|^2 - sum_t |v_t|^2) / 2``."""
        n = len(ids[0])
        if not self.latent:
            return np.zeros(n)
        vs = [self.latent[t][ids[t]] for t in self.interaction_tables]
        tot = np.sum(vs, axis=0)
        return 0.5 * ((tot * tot).sum(axis=1) - sum((v * v).sum(axis=1) for v in vs))

    def block(self, seed: int, b: int, n: int, weighted: Sequence[int] = ()):
        """Rows of block ``b``: (label f32 [n], dense 13x[n] f32, ids 26x[n] i64, prob f64 [n],
        weights {table index: f32 [n]} of the ``weighted`` tables, interaction term f64 [n])."""
        rng = np.random.default_rng([seed, b])
        wrng = np.random.default_rng([seed, b, 0x3E16]) if weighted else None
        weights: dict[int, np.ndarray] = {}
        dense, logit = [], np.full(n, self.bias)
        for j in range(13):
            raw = np.floor(np.exp(rng.normal(self.mu[j], 1.0, size=n)))
            d = np.log1p(raw)
            dense.append(d.astype(np.float32))
            if self.w[j]:
                logit += self.w[j] * (d - self.mu[j])
        ids = []
        for t, cdf in enumerate(self.cdfs):
            rank = np.searchsorted(cdf, rng.random(n), side="right")
            rank = np.minimum(rank, len(cdf) - 1)
            i = self.perms[t][rank]
            ids.append(i)
            if t in weighted:
                weights[t] = wrng.uniform(0.5, 2.0, size=n).astype(np.float32)
            if self.effects[t] is not None:
                if t in weights:
                    logit += weights[t] * self.effects[t][i]
                else:
                    logit += self.effects[t][i]
        inter = self.interaction_logit(ids)
        prob = 1.0 / (1.0 + np.exp(-(logit + inter)))
        label = (rng.random(n) < prob).astype(np.float32)
        return label, dense, ids, prob, weights, inter


#: the largest ``--interaction-std``: a logit term of standard deviation 100 already makes the labels
#: all but deterministic (Bayes AUC ~1); beyond it the planted scale's fourth root overflows float64
MAX_INTERACTION_STD = 100.0
#: the largest ``--interaction-dim`` (the latent vectors take rows x dim x 8 bytes per table)
MAX_INTERACTION_DIM = 1024


def check_interaction_options(features: Sequence[str] | None, dim: int, std: float) -> list[int]:
    """The tables of ``--interaction-features`` (indices into C1..C26), with ``--interaction-dim`` and
    ``--interaction-std`` checked when there are any.

    Raises:
        ValueError: an unknown feature or only one, ``dim`` not in [1, :data:`MAX_INTERACTION_DIM`],
            ``std`` not a finite number in (0, :data:`MAX_INTERACTION_STD`]; naming the option.
    """
    itables = _interaction_tables(features or ())
    if len(itables) == 1:
        raise ValueError(f"--interaction-features: a pairwise interaction needs at least 2 features, got "
                         f"{SPARSE_FEATURES[itables[0]]}")
    if itables:
        if not 1 <= dim <= MAX_INTERACTION_DIM:
            raise ValueError(f"--interaction-dim must be in [1, {MAX_INTERACTION_DIM}], got {dim}")
        if not (np.isfinite(std) and 0 < std <= MAX_INTERACTION_STD):
            raise ValueError(f"--interaction-std must be a finite number in (0, {MAX_INTERACTION_STD:g}], got {std}")
    return itables


def planted_model(seed: int = 0, num_embeddings: Sequence[int] | None = None, zipf_alpha: float = 1.05,
                  interaction_features: Sequence[str] = (), interaction_dim: int = DEFAULT_INTERACTION_DIM,
                  interaction_std: float = DEFAULT_INTERACTION_STD) -> _Model:
    """The planted generative model of :func:`generate_synthetic` with these arguments (its
    parameters: ``bias``, ``mu`` / ``w`` [13], ``effects`` per table, ``latent`` {table index:
    ``[N_t, K]`` float64}, :meth:`_Model.interaction_logit`), e.g. to recompute a dataset's logits.

    Raises:
        ValueError: an unknown interaction feature.
    """
    cards = list(num_embeddings or DEFAULT_SYNTHETIC_CARDINALITIES)
    return _Model(seed, cards, zipf_alpha, _interaction_tables(interaction_features), interaction_dim,
                  interaction_std)


def _interaction_tables(features: Sequence[str]) -> list[int]:
    """Table indices of the interaction features (deduplicated, sorted)."""
    feats = list(dict.fromkeys(features or ()))
    unknown = [f for f in feats if f not in SPARSE_FEATURES]
    if unknown:
        raise ValueError(f"--interaction-features: unknown feature(s) {unknown}; expected some of C1..C26")
    return sorted(SPARSE_FEATURES.index(f) for f in feats)


def generate_synthetic(out_dir: str | Path, rows: int = 300_000, seed: int = 0, val_ratio: float = 0.1,
                       test_ratio: float = 0.1, num_embeddings: Sequence[int] | int | None = None,
                       zipf_alpha: float = 1.05, weighted_features: Sequence[str] | None = None,
                       interaction_features: Sequence[str] | None = None,
                       interaction_dim: int = DEFAULT_INTERACTION_DIM,
                       interaction_std: float = DEFAULT_INTERACTION_STD) -> PreprocessReport:
    """Generate the synthetic dataset into ``out_dir`` (columnar shards + ``meta.json``).

    Args:
        out_dir: output directory (created; an existing synthetic part is overwritten).
        rows: total rows over all splits.
        seed: seeds every parameter and row; same seed -> byte-identical output.
        val_ratio, test_ratio: split fractions (per-row hash of the row index, as in criteo).
        num_embeddings: one int (all tables) or 26 ints; default
            :data:`DEFAULT_SYNTHETIC_CARDINALITIES`.
        zipf_alpha: Zipf exponent of the id frequencies (> 0).
        weighted_features: sparse features (``C1``..``C26``) that get per-id weights
            (``<feature>__weight`` columns; see the module docstring).
        interaction_features: sparse features whose every pair gets a planted interaction
            (at least 2; none: no interactions; see the module docstring).
        interaction_dim: ``K``, the latent vectors' width (>= 1).
        interaction_std: ``S``, the standard deviation of the interaction term of the logit (> 0).

    Returns:
        :class:`~dlrmctl.data.criteo.preprocess.PreprocessReport`.

    Raises:
        ValueError: ``rows < 1``, bad ratios, wrong number of table sizes, ``zipf_alpha <= 0``,
            an unknown weighted feature, an unknown or single interaction feature,
            ``interaction_dim < 1``, ``interaction_std`` not finite > 0.
    """
    t0 = time.perf_counter()
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    check_split_ratios(val_ratio, test_ratio)
    if not zipf_alpha > 0 or zipf_alpha == float("inf"):  # nan and inf too
        raise ValueError(f"--zipf-alpha must be a finite number > 0, got {zipf_alpha}")
    if num_embeddings is None:
        cards = list(DEFAULT_SYNTHETIC_CARDINALITIES)
    elif isinstance(num_embeddings, int):
        cards = [num_embeddings] * 26
    else:
        cards = [int(x) for x in num_embeddings]
        if len(cards) == 1:
            cards = cards * 26
    if len(cards) != 26 or min(cards) < 1:
        raise ValueError(f"--num-embeddings: expected 1 or 26 integers >= 1, got {cards}")
    wfeats = list(dict.fromkeys(weighted_features or ()))
    unknown = [f for f in wfeats if f not in SPARSE_FEATURES]
    if unknown:
        raise ValueError(f"--weighted-features: unknown feature(s) {unknown}; expected some of C1..C26")
    wtables = sorted(SPARSE_FEATURES.index(f) for f in wfeats)
    itables = check_interaction_options(interaction_features, interaction_dim, interaction_std)
    model = _Model(seed, cards, zipf_alpha, itables, interaction_dim, interaction_std)
    out = Path(out_dir)
    part = out / "parts" / "synthetic"
    schema = shard_schema(DENSE_FEATURES, SPARSE_FEATURES, weighted=[f in wfeats for f in SPARSE_FEATURES])
    writers: dict[str, ShardWriter] = {}
    counts = {s: 0 for s in SPLITS}
    pos = {s: 0 for s in SPLITS}
    eval_split = "val" if val_ratio > 0 else ("test" if test_ratio > 0 else "train")
    eval_p, eval_y, eval_q = [], [], []
    try:  # (the writers are opened in here: a Ctrl-C while the later ones open removes the earlier temps)
        for s in SPLITS:
            writers[s] = ShardWriter(part / f"{s}.arrow", schema)
        for b, start in enumerate(range(0, rows, BLOCK_ROWS)):
            n = min(BLOCK_ROWS, rows - start)
            label, dense, ids, prob, wts, inter = model.block(seed, b, n, wtables)
            codes = row_split_codes(np.arange(start + 1, start + n + 1, dtype=np.int64), "synthetic",
                                    seed, val_ratio, test_ratio)
            for si, s in enumerate(SPLITS):
                sel = codes == si
                k = int(sel.sum())
                if not k:
                    continue
                cols = {LABEL_COLUMN: label[sel]}
                cols.update({nm: d[sel] for nm, d in zip(DENSE_FEATURES, dense)})
                cols.update({nm: i[sel] for nm, i in zip(SPARSE_FEATURES, ids)})
                cols.update({weight_column(SPARSE_FEATURES[t]): w[sel] for t, w in wts.items()})
                writers[s].write(cols)
                counts[s] += k
                pos[s] += int(label[sel].sum())
                if s == eval_split:
                    eval_p.append(prob[sel])
                    eval_y.append(label[sel])
                    if itables:  # the planted logit without its interaction term (same ranks as its sigmoid)
                        eval_q.append(np.log(prob[sel]) - np.log1p(-prob[sel]) - inter[sel])
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    bayes = roc_auc(np.concatenate(eval_p), np.concatenate(eval_y)) if eval_p else float("nan")
    interactions = {}
    if itables:
        pairs = [[SPARSE_FEATURES[a], SPARSE_FEATURES[b]] for k, a in enumerate(itables) for b in itables[k + 1:]]
        interactions = {
            "features": [SPARSE_FEATURES[t] for t in itables], "pairs": len(pairs), "dim": interaction_dim,
            "std": interaction_std, "latent_std": model.latent_std,
            "logit": "sum over pairs (a, b) of <v_a[id_a], v_b[id_b]>; v_t[i] = latent_std * (z_t[i] - "
                     "sum_j P_t(j) z_t[j]), z_t[i] ~ Normal(0, I_dim), P_t the id distribution; latent_std solves "
                     "std^2 = sum_{a<b} tr(C_a C_b), C_t = E[v_t v_t^T]",
            "seed_stream": "numpy default_rng([seed, 0x1A7E]), one [num_embeddings, dim] draw per feature in order",
        }
    sparse_meta = [{"name": nm, "num_embeddings": int(c), "multi_hot": False, "mean_pooling_factor": 1.0,
                    "max_pooling_factor": 1, "signal": t < SIGNAL_TABLES, **({"weighted": True} if t in wtables else {})}
                   for t, (nm, c) in enumerate(zip(SPARSE_FEATURES, cards))]
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": "synthetic",
        "dense_features": DENSE_FEATURES,
        "sparse_features": sparse_meta,
        "label": LABEL_COLUMN,
        "splits": {s: {"rows": counts[s], "files": [f"parts/synthetic/{s}.arrow"]} for s in SPLITS},
        "ctr": {s: (pos[s] / counts[s] if counts[s] else None) for s in SPLITS},
        "bayes_auc": bayes,
        "bayes_auc_split": eval_split,
        **({"bayes_auc_no_interactions": roc_auc(np.concatenate(eval_q), np.concatenate(eval_y)) if eval_q
            else float("nan")} if itables else {}),
        "transforms": {
            "dense": {"raw": "floor(exp(Normal(mu_j, 1)))", "transform": "log(x+1)", "dtype": "float32"},
            "sparse": {"mode": "synthetic", "distribution": f"truncated Zipf, alpha={zipf_alpha}, "
                       "ranks permuted to ids"},
            "label": {"model": "Bernoulli(sigmoid(b + sum_j w_j (d_j - mu_j) + sum_t e_t[id_t]"
                      + (" + sum_{a<b} <v_a[id_a], v_b[id_b]>" if itables else "") + "))",
                      "signal_dense": DENSE_FEATURES[:SIGNAL_DENSE],
                      "signal_sparse": SPARSE_FEATURES[:SIGNAL_TABLES], "effect_std": EFFECT_STD,
                      "bias": model.bias, "dense_weights": model.w.tolist(),
                      **({"interactions": interactions} if itables else {})},
            **({"weights": {"features": [SPARSE_FEATURES[t] for t in wtables], "distribution": "U(0.5, 2.0)",
                            "logit": "w * e_t[id_t] for a weighted signal feature",
                            "columns": {SPARSE_FEATURES[t]: weight_column(SPARSE_FEATURES[t]) for t in wtables}}}
               if wtables else {}),
            "split": {"mode": "ratio", "val_ratio": val_ratio, "test_ratio": test_ratio, "seed": seed,
                      "rule": "row_split_codes(row index + 1, 'synthetic', seed, ...)"},
        },
        "vocab_files": {},
        "seed": seed,
        "rows": rows,
    }
    write_meta(out, meta)
    elapsed = time.perf_counter() - t0
    return PreprocessReport(out, counts, 0, 1, 0, elapsed, rows / elapsed if elapsed > 0 else 0.0)
