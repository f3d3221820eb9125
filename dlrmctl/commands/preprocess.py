"""``dlrmctl preprocess``: raw logs -> columnar shards + meta.json (thin: parse options, call dlrmctl.data).

Mounted by ``dlrmctl/cli.py`` as ``app.add_typer(preprocess.app, name="preprocess")``.
Other datasets (e.g. movielens) register their own command on :data:`app` from their own module.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from dlrmctl.errors import UserError, check_output_dir

app = typer.Typer(help="Preprocess raw datasets into columnar shards (Arrow IPC) + meta.json for training.",
                  no_args_is_help=True)


def _int_list(value: Optional[str], name: str, n: int) -> Optional[list[int]]:
    """'3' -> [3]*n; '1,2,...' (n ints) -> list; None -> None. Raises typer.BadParameter."""
    if value is None:
        return None
    try:
        xs = [int(x) for x in value.split(",") if x.strip() != ""]
    except ValueError:
        raise typer.BadParameter(f"expected integers separated by commas, got {value!r}", param_hint=name) from None
    if len(xs) == 1:
        xs = xs * n
    if len(xs) != n:
        raise typer.BadParameter(f"expected 1 or {n} comma-separated integers, got {len(xs)}", param_hint=name)
    if min(xs) < 1:
        raise typer.BadParameter(f"values must be >= 1, got {value!r}", param_hint=name)
    return xs


def _summary(rep, out: Path) -> None:
    rows = ", ".join(f"{s} {n:,}" for s, n in rep.rows.items())
    typer.echo(f"wrote {out}: {rows} rows; {rep.rows_per_s:,.0f} rows/s over {rep.seconds:.1f} s"
               + (f"; {rep.bad_lines:,} bad lines skipped" if rep.bad_lines else "")
               + (f"; {rep.files_skipped} input file(s) already done (resumed)" if rep.files_skipped else ""))


@app.command("criteo")
def criteo(
    input: List[str] = typer.Option(..., "--input", "-i", help="train.txt / day_N file(s), plain or .gz; a file, "
                                    "a directory or a glob (repeatable)"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory (re-running it resumes)"),
    num_embeddings: Optional[str] = typer.Option(
        None, help="hashing: id = hex mod N (one N, or 26 comma-separated); tables get N+1 rows "
        "(last = missing). Default: a vocabulary (see --frequency-threshold)"),
    frequency_threshold: Optional[int] = typer.Option(
        None, help="vocabulary: values seen >= T times in train get their own row, rarer ones share one "
        "(default 3 when --num-embeddings is not given; best on small data)"),
    val_ratio: float = typer.Option(0.0, help="fraction of rows for validation (per-row hash split)"),
    test_ratio: float = typer.Option(0.0, help="fraction of rows for test (per-row hash split)"),
    seed: int = typer.Option(0, help="seed of the ratio split and of the multi-hot offsets"),
    split_by_day: bool = typer.Option(False, "--split-by-day", help="1TB layout: day_0..day_22 train, the last "
                                      "day split into validation (first half) and test (second half)"),
    on_bad_line: str = typer.Option("error", help="'error' (stop, naming file:line and field) or 'skip' (count)"),
    multi_hot_sizes: Optional[str] = typer.Option(None, help="26 comma-separated bag sizes: materialise "
                                                  "MLPerf-DLRMv2 multi-hot bags"),
    multi_hot_distribution: str = typer.Option("uniform", help="'uniform' or 'pareto' multi-hot offsets"),
    workers: int = typer.Option(1, help="worker processes (parallel across input files)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress line"),
) -> None:
    """Criteo Kaggle / 1TB click logs (40 tab-separated fields) -> columnar shards + meta.json."""
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    opts = CriteoOptions(
        num_embeddings=_int_list(num_embeddings, "--num-embeddings", 26),
        frequency_threshold=frequency_threshold, val_ratio=val_ratio, test_ratio=test_ratio, seed=seed,
        split_by_day=split_by_day, on_bad_line=on_bad_line,
        multi_hot_sizes=_int_list(multi_hot_sizes, "--multi-hot-sizes", 26),
        multi_hot_distribution=multi_hot_distribution, workers=workers,
    )
    try:
        opts.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    check_output_dir(out, "--out")  # a file, under a file, read-only: one line before any work
    try:
        rep = preprocess_criteo(input if len(input) > 1 else input[0], out, opts, progress=not quiet)
    except DataError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _summary(rep, out)


@app.command("synthetic")
def synthetic(
    out: Path = typer.Option(..., "--out", "-o", help="output directory"),
    rows: int = typer.Option(300_000, help="rows over all splits"),
    seed: int = typer.Option(0, help="seed of every parameter and row"),
    val_ratio: float = typer.Option(0.1, help="fraction of rows for validation"),
    test_ratio: float = typer.Option(0.1, help="fraction of rows for test"),
    num_embeddings: Optional[str] = typer.Option(None, help="table sizes: one N or 26 comma-separated "
                                                 "(default: 10..10000, signal tables C1..C8 small)"),
    zipf_alpha: float = typer.Option(1.05, help="Zipf exponent of id frequencies"),
    weighted_features: Optional[str] = typer.Option(
        None, help="comma-separated features (e.g. C1,C2) that get per-id weights U(0.5, 2) in a <feature>__weight "
        "column; their effect on the label is weight * effect (train them with `weighted: true` tables)"),
) -> None:
    """Criteo-schema synthetic data with a planted logistic signal; meta.json has its bayes_auc."""
    from dlrmctl.data.synthetic import generate_synthetic

    check_output_dir(out, "--out")  # a file, under a file, read-only: one line before any work
    try:
        rep = generate_synthetic(out, rows=rows, seed=seed, val_ratio=val_ratio, test_ratio=test_ratio,
                                 num_embeddings=_int_list(num_embeddings, "--num-embeddings", 26),
                                 zipf_alpha=zipf_alpha,
                                 weighted_features=[f.strip() for f in (weighted_features or "").split(",") if f.strip()])
    except ValueError as e:
        if isinstance(e, UserError):  # e.g. DataError of a full disk: one line (dlrmctl.cli), not a usage error
            raise
        raise typer.BadParameter(str(e)) from None
    _summary(rep, out)
    import json

    typer.echo(f"bayes_auc (val) = {json.loads((out / 'meta.json').read_text())['bayes_auc']:.4f}")
