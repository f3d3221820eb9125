"""Test AUC and log loss of three non-DLRM baselines on a preprocessed MovieLens directory.

    dlrmctl preprocess movielens --input ../shared/data/movielens/ml-latest-small --out data/movielens
    python scripts/movielens_baselines.py data/movielens [--test-split test] [--C 0.01,0.1,1]

All see exactly the rows and split of ``dlrmctl preprocess movielens`` (the columnar shards +
meta.json), so their figures sit next to DLRM's ``dlrmctl evaluate runs/movielens --split test``:

* CTR prior: every row scores ``logit(train CTR)`` (AUC 0.5; the log loss to beat).
* item popularity: score = the ``item_popularity`` dense feature (``log(1 + train ratings of
  the item)``); AUC only (a count is not a probability; its log loss is not reported).
* logistic regression: scikit-learn ``LogisticRegression`` (L2, lbfgs) on
  ``[one-hot of every sparse feature (multi-hot bags: one column per id) | standardised dense]``,
  one weight per (feature, id); ``C`` chosen on the validation split by AUC, the test split
  scored once with it.

Prints one line per baseline and split: ``<name>  <split> AUC <a>  logloss <l>  (<n> rows)``.
Needs scikit-learn (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines_common as bc  # noqa: E402
from baselines_common import auc  # noqa: E402,F401  (re-exported: exact AUC with ties 1/2)
from dlrmctl.data.columnar import read_meta  # noqa: E402


def run(data_dir: str, val_split: str = "val", test_split: str = "test", cs=bc.DEFAULT_CS, seed: int = 0,
        out=print, log=None) -> dict:
    """Fit on ``train``, choose C on ``val_split``, score ``val_split`` and ``test_split``.

    Returns:
        ``{"prior": {split: metrics}, "item_popularity": {split: AUC}, "logistic_regression":
        {split: metrics}, "C": float}``.

    Raises:
        dlrmctl.data.columnar.DataError: a split is missing; ValueError: single-class train split,
            or meta.json without the ``item_popularity`` dense feature.
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    meta = read_meta(data_dir)
    if "item_popularity" not in meta["dense_features"]:
        raise ValueError(f"{data_dir}/meta.json: no item_popularity dense feature (not `dlrmctl preprocess movielens` "
                         "output?)")
    pop_col = meta["dense_features"].index("item_popularity")

    def item_popularity(meta, evals):
        return {"item_popularity": {s: bc.auc(d["label"], d["dense"][:, pop_col]) for s, d in evals.items()}}

    def lr_note(meta, x_train):
        return (f"one-hot {', '.join(f['name'] for f in meta['sparse_features'])} + "
                f"{len(meta['dense_features'])} dense")

    return bc.run_baselines(data_dir, val_split, test_split, cs, seed, out, log,
                            score_baselines=item_popularity, lr_note=lr_note)


def main(argv: list[str] | None = None) -> dict:
    """CLI entry: see the module docstring."""
    return bc.cli_main(__doc__.split("\n")[0], "output of `dlrmctl preprocess movielens`", run, argv)

if __name__ == "__main__":
    main()
