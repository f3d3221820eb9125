"""A drifting click log, one day at a time (``dlrmctl preprocess synthetic-drift --day K``): ids
that are born and retire, popularity that shifts from day to day, per-id effects, and the Bayes
AUC of each day.  It shows what a vocabulary built once, modulo hashing and managed-collision
tables (docs/training.md, "Ids that change every day") do over days.

Generative model (everything drawn from ``seed``; day ``K`` replays the id pools of days
``0..K-1`` without drawing their rows, so each day is generated alone and is the same whichever
other days were generated):

* ``F`` categorical features ``C1..CF``.  Each keeps a pool of ``A`` alive ids (integers counted
  per feature from 1; stored as raw 64-bit ids, :func:`dlrmctl.data.ids.raw_ids` of the decimal
  text, or with ``modulo`` as ``raw % modulo`` index ids).  An id has a popularity score ``s``;
  on a day, ids are drawn with probability ``∝ exp(s)``.  Day 0: ``s = -alpha log(rank + 1)``
  over a random order (Zipf, exponent ``alpha``).
* Between days: every score takes a step ``s += Normal(0, drift)``; a fraction ``churn`` of the
  pool, chosen at random, retires for good and as many new ids are born, each with the score of a
  random Zipf rank (``-alpha log(U A + 1)``, ``U ~ U(0, 1)``): a new id may be popular at once.
* Per-id effects: an id of a signal feature (the first ``S``) carries ``e ~ Normal(0, effect_std)``
  for its whole life.  ``D`` dense features ``d_j ~ Normal(0, 1)`` with weights ``w_j ~ ±U(0.3, 0.6)``.
* ``label ~ Bernoulli(sigmoid(b + sum_j w_j d_j + sum_{f < S} e_f[id_f]))``, ``b = -1.4``.
* Each day's rows are split into train and val (``val_ratio``, uniform per row); meta.json holds
  ``bayes_auc`` (the planted probabilities' AUC on the day's val rows) and ``drift`` (ids alive,
  born, retired, ever seen up to this day).

The ids alive on a day (``A`` per feature) fit a table of ``A`` rows while the ids ever seen
(``A + K churn A``) do not: what a managed-collision table of ``N >= A`` rows keeps up with.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dlrmctl.data.columnar import FORMAT_VERSION, IDS_KEY, IDS_RAW, LABEL_COLUMN, ShardWriter, shard_schema, write_meta
from dlrmctl.data.criteo.preprocess import PreprocessReport
from dlrmctl.data.ids import hash_buckets, raw_ids
from dlrmctl.data.synthetic import roc_auc

if TYPE_CHECKING:
    from dlrmctl.console import Progress

__all__ = ["DriftOptions", "generate_drifting_day"]

BIAS = -1.4


class DriftOptions:
    """The drifting log's parameters (module docstring); :meth:`check` names a bad one.

    Attributes: ``rows`` (per day), ``features`` (``F``), ``signal`` (``S``), ``dense`` (``D``),
    ``alive`` (``A``), ``churn``, ``drift``, ``alpha``, ``effect_std``, ``val_ratio``, ``seed``,
    ``modulo`` (None: raw ids).
    """

    def __init__(self, rows: int = 100_000, features: int = 8, signal: int = 4, dense: int = 4, alive: int = 2000,
                 churn: float = 0.2, drift: float = 0.5, alpha: float = 1.05, effect_std: float = 0.8,
                 val_ratio: float = 0.1, seed: int = 0, modulo: int | None = None) -> None:
        self.rows, self.features, self.signal, self.dense, self.alive = rows, features, signal, dense, alive
        self.churn, self.drift, self.alpha, self.effect_std = churn, drift, alpha, effect_std
        self.val_ratio, self.seed, self.modulo = val_ratio, seed, modulo

    def check(self) -> None:
        """Raises ValueError naming the option (``--rows`` ...) that is out of range."""
        for name, v, lo in (("--rows", self.rows, 1), ("--features", self.features, 1), ("--dense", self.dense, 1),
                            ("--alive", self.alive, 1)):
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if not 0 <= self.signal <= self.features:
            raise ValueError(f"--signal must be in [0, --features ({self.features})], got {self.signal}")
        if not 0.0 <= self.churn < 1.0:
            raise ValueError(f"--churn must be in [0, 1), got {self.churn}")
        for name, v in (("--drift", self.drift), ("--effect-std", self.effect_std)):
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not (np.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--zipf-alpha must be a finite number > 0, got {self.alpha}")
        if not 0.0 <= self.val_ratio < 1.0:
            raise ValueError(f"--val-ratio must be in [0, 1), got {self.val_ratio}")
        if self.modulo is not None and self.modulo < 1:
            raise ValueError(f"--modulo must be >= 1, got {self.modulo}")


class _Pool:
    """One feature's alive ids: integer ids, scores, effects; ``born`` counts every id ever made."""

    def __init__(self, o: DriftOptions, rng: np.random.Generator, signal: bool) -> None:
        self.o, self.signal = o, signal
        self.ids = np.arange(1, o.alive + 1, dtype=np.int64)
        self.score = -o.alpha * np.log(rng.permutation(o.alive) + 1.0)
        self.effect = rng.normal(0.0, o.effect_std, o.alive) if signal else np.zeros(o.alive)
        self.born = o.alive
        self.last_born = self.last_retired = 0

    def next_day(self, rng: np.random.Generator) -> None:
        o = self.o
        self.score = self.score + rng.normal(0.0, o.drift, self.ids.size)
        k = int(round(o.churn * o.alive))
        out = rng.choice(self.ids.size, k, replace=False)
        self.ids[out] = np.arange(self.born + 1, self.born + k + 1, dtype=np.int64)
        self.score[out] = -o.alpha * np.log(rng.random(k) * o.alive + 1.0)
        eff = rng.normal(0.0, o.effect_std, k)
        if self.signal:
            self.effect[out] = eff
        self.born += k
        self.last_born = self.last_retired = k

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = np.exp(self.score - self.score.max())
        idx = rng.choice(self.ids.size, n, p=p / p.sum())
        return self.ids[idx], self.effect[idx]


def _pools(o: DriftOptions, day: int, progress: "Progress | None" = None) -> list[_Pool]:
    """The pools on ``day`` (days ``0..day-1`` replayed without their rows; ``progress``: a day each)."""
    rng = np.random.default_rng([o.seed, 0xD21F7])
    pools = [_Pool(o, rng, f < o.signal) for f in range(o.features)]
    for _ in range(day):
        for p in pools:
            p.next_day(rng)
        if progress is not None:
            progress.update()
    return pools


def generate_drifting_day(out_dir: str | Path, day: int, options: DriftOptions | None = None,
                          progress: bool = False, progress_every_s: float = 10.0) -> PreprocessReport:
    """Write day ``day`` of the drifting log into ``out_dir`` (columnar shards + meta.json).

    Args:
        out_dir: the day's dataset directory.
        day: ``K >= 0``.
        options: :class:`DriftOptions` (the same for every day of one log).
        progress: report the replay of days ``0..K-1`` and the drawing of each feature (a bar on a
            terminal, else a line every ``progress_every_s`` seconds: a large day or ``--rows``
            takes minutes).

    Returns:
        :class:`~dlrmctl.data.criteo.preprocess.PreprocessReport`.

    Raises:
        ValueError: ``day < 0`` or an option out of range (naming it).
    """
    t0 = time.perf_counter()
    o = options or DriftOptions()
    o.check()
    if day < 0:
        raise ValueError(f"--day must be >= 0, got {day}")
    from dlrmctl.console import Progress

    with Progress(day, f"synthetic-drift: replaying days 0-{day - 1}", "day", enabled=progress and day > 0,
                  every_s=progress_every_s, final_line=False) as prog:
        pools = _pools(o, day, prog)
    rng = np.random.default_rng([o.seed, 0xDA7, day])
    wrng = np.random.default_rng([o.seed, 0x3E1])
    w = wrng.uniform(0.3, 0.6, o.dense) * wrng.choice([-1.0, 1.0], o.dense)
    dense = rng.normal(0.0, 1.0, (o.dense, o.rows)).astype(np.float32)
    logit = BIAS + w @ dense.astype(np.float64)
    cols: dict[str, np.ndarray] = {}
    dense_names = [f"I{j + 1}" for j in range(o.dense)]
    sparse_names = [f"C{f + 1}" for f in range(o.features)]
    with Progress(o.features, f"synthetic-drift: drawing {o.rows:,} rows of day {day}", "feature",
                  enabled=progress, every_s=progress_every_s, final_line=False) as prog:
        for f, p in enumerate(pools):
            ids, eff = p.draw(rng, o.rows)
            logit += eff
            raw = raw_ids(ids)
            cols[sparse_names[f]] = raw if o.modulo is None else hash_buckets(raw, o.modulo)
            prog.update()
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(o.rows) < prob).astype(np.float32)
    is_val = rng.random(o.rows) < o.val_ratio
    out = Path(out_dir)
    schema = shard_schema(dense_names, sparse_names)
    counts, pos = {}, {}
    for split, sel in (("train", ~is_val), ("val", is_val), ("test", np.zeros(o.rows, bool))):
        wr = ShardWriter(out / "parts" / f"day_{day}" / f"{split}.arrow", schema)
        try:
            if sel.any():
                wr.write({LABEL_COLUMN: label[sel], **{n: d[sel] for n, d in zip(dense_names, dense)},
                          **{n: c[sel] for n, c in cols.items()}})
            wr.close()
        except BaseException:
            wr.abort()
            raise
        counts[split], pos[split] = int(sel.sum()), float(label[sel].sum())
    sparse_meta = []
    for f, n in enumerate(sparse_names):
        entry = {"name": n, "multi_hot": False, "mean_pooling_factor": 1.0, "max_pooling_factor": 1,
                 "signal": f < o.signal}
        if o.modulo is None:
            entry.update({"num_embeddings": int(np.unique(cols[n][~is_val]).size), IDS_KEY: IDS_RAW})
        else:
            entry["num_embeddings"] = int(o.modulo)
        sparse_meta.append(entry)
    meta = {
        "format_version": FORMAT_VERSION, "dataset": "synthetic-drift", "dense_features": dense_names,
        "sparse_features": sparse_meta, "label": LABEL_COLUMN,
        "splits": {s: {"rows": counts[s], "files": [f"parts/day_{day}/{s}.arrow"]} for s in counts},
        "ctr": {s: (pos[s] / counts[s] if counts[s] else None) for s in counts},
        "bayes_auc": roc_auc(prob[is_val], label[is_val]) if is_val.any() else float("nan"),
        "bayes_auc_split": "val", "day": day,
        "drift": {"alive_per_feature": o.alive, "born_today": pools[0].last_born if day else o.alive,
                  "retired_today": pools[0].last_retired, "ever_seen_per_feature": pools[0].born},
        "transforms": {
            "sparse": ({"mode": "raw", "formula": "raw_ids(decimal text of the id) (dlrmctl.data.ids)"}
                       if o.modulo is None else
                       {"mode": "hash", "formula": f"raw_ids(decimal text of the id) % {o.modulo}"}),
            "label": {"model": "Bernoulli(sigmoid(b + sum_j w_j d_j + sum_{f<S} e_f[id_f]))", "bias": BIAS,
                      "dense_weights": w.tolist(), "signal_sparse": sparse_names[:o.signal],
                      "effect_std": o.effect_std},
            "drift": {"churn": o.churn, "score_step_std": o.drift, "zipf_alpha": o.alpha, "seed": o.seed},
        },
        "vocab_files": {}, "seed": o.seed, "rows": o.rows,
    }
    write_meta(out, meta)
    elapsed = time.perf_counter() - t0
    return PreprocessReport(out, counts, 0, 1, 0, elapsed, o.rows / elapsed if elapsed > 0 else 0.0)
