"""Test AUC and log loss of two non-DLRM baselines on a preprocessed Criteo directory (or any dataset
whose ids are table rows, e.g. one of ``dlrmctl preprocess logs``: Avazu).

    dlrmctl preprocess criteo --input ../shared/data/criteo/criteo_kaggle_sample_10k.tsv \\
        --out data/criteo_sample --val-ratio 0.15 --test-ratio 0.15
    python scripts/criteo_baselines.py data/criteo_sample [--test-split test] [--C 0.01,0.1,1]

Both see exactly the rows, split and ids of ``dlrmctl preprocess criteo`` (the columnar
shards + meta.json), so their figures sit next to DLRM's ``dlrmctl evaluate runs/<name> --split test``:

* CTR prior: every row scores ``logit(train CTR)`` (AUC 0.5; the log loss any model must beat).
* logistic regression: scikit-learn ``LogisticRegression`` (L2, lbfgs) on
  ``[one-hot C1..C26 | standardised I1..I13]``: one weight per (feature, id) of the
  preprocessed vocabulary or hash buckets (so it sees the same ids DLRM's embedding rows do);
  the dense columns are the stored ``log(1 + x)`` standardised with the train split's mean/std.
  ``C`` (inverse L2 strength) is chosen on the validation split by AUC; the test split is
  scored once, with that C.

Prints one line per baseline and split: ``<name>  <split> AUC <a>  logloss <l>  (<n> rows)``.
Needs scikit-learn (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines_common as bc  # noqa: E402


def run(data_dir: str, val_split: str = "val", test_split: str = "test", cs=bc.DEFAULT_CS, seed: int = 0,
        out=print, log=None) -> dict:
    """Fit the baselines on ``train``, choose C on ``val_split``, score ``test_split``.

    Returns:
        ``{"prior": {split: metrics}, "logistic_regression": {split: metrics}, "C": float}``
        (metrics as :func:`dlrmctl.metrics.compute_metrics_from_logits`).

    Raises:
        dlrmctl.data.columnar.DataError: a split is missing (names the directory and split).
        ValueError: the train split has one class only.
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    return bc.run_baselines(data_dir, val_split, test_split, cs, seed, out, log)


def main(argv: list[str] | None = None) -> dict:
    """CLI entry: see the module docstring."""
    return bc.cli_main(__doc__.split("\n")[0], "output of `dlrmctl preprocess criteo` with --val-ratio and --test-ratio", run, argv)

if __name__ == "__main__":
    main()
