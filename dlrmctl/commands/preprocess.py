"""``dlrmctl preprocess``: raw logs -> columnar shards + meta.json (thin: parse options, call dlrmctl.data).

Mounted by ``dlrmctl/cli.py`` as ``app.add_typer(preprocess.app, name="preprocess")``.
Other datasets (e.g. movielens) register their own command on :data:`app` from their own module.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from dlrmctl.commands._common import fail, show_path
from dlrmctl.commands.options import (DatasetOut, Quiet, ReplaceDataset, TestRatio, ValRatio, Workers,
                                      int_list_option)
from dlrmctl.errors import UserError, check_output_dir

__all__ = ["build_dataset", "build_interruptible", "build_unless_complete", "dataset_target_or_fail", "print_summary",
           "say_already_complete", "stat_inputs"]

app = typer.Typer(help="Preprocess raw datasets into columnar shards (Arrow IPC) + meta.json for training.",
                  no_args_is_help=True)


def dataset_target_or_fail(out: Path, recipe: dict, force: bool):
    """Where to build (:func:`dlrmctl.outputs.dataset_target`), under ``out``'s lock (one preprocess
    writes a dataset at a time, :func:`dlrmctl.outputs.lock_output`; :func:`build_dataset` drops
    it); a refusal is one error line, exit 2."""
    from dlrmctl import outputs

    try:
        outputs.lock_output(out)
        return outputs.dataset_target(out, recipe, force)
    except BaseException as e:
        outputs.unlock_output(out)
        if isinstance(e, OSError):
            fail(f"{e.filename or out}: cannot create the dataset directory ({e.strerror}); --out a writable directory")
        raise


def build_dataset(target, fn):
    """Run ``fn(build_dir)`` for ``target``; commit it when it returns, abort it on any failure."""
    from dlrmctl import outputs

    try:
        try:
            rep = fn(target.build_dir)
        except BaseException:
            target.abort()
            raise
        target.commit()
    finally:
        outputs.unlock_output(target.out)
    return rep


def build_interruptible(target, out: Path, fn):
    """:func:`build_dataset` of a dataset whose preprocess runs worker processes: a bad input is one error
    line; a SIGINT / SIGTERM anywhere in the work (not only while the workers run) ends them and is
    one ``error: interrupted (SIG...): ...`` line (exit 128 + signal) that says a re-run resumes, or,
    when the signal came after the dataset was complete, that it is complete."""
    from dlrmctl.errors import Interrupted, interruptible

    try:  # (a bad input, a DataError, is reported by dlrmctl.cli)
        with interruptible():
            return build_dataset(target, fn)
    except Interrupted as e:
        if _committed(target):  # the signal came after the work had finished
            fail(f"interrupted ({e.signame}) after preprocessing of {show_path(out)} had finished: the dataset "
                 "is complete (a re-run says so)", code=e.exit_code)
        fail(f"interrupted ({e.signame}): preprocessing of {show_path(out)} stopped and its worker "
             "processes ended; run the same command again to resume it", code=e.exit_code)


#: the ``--val-ratio`` / ``--test-ratio`` options of ``preprocess criteo`` and ``logs``: split ->
#: the option's default (what an empty split's warning may advise, :func:`print_summary`)
ZERO_RATIOS = {"val": 0.0, "test": 0.0}
#: those of ``preprocess synthetic``
SYNTHETIC_RATIOS = {"val": 0.1, "test": 0.1}
#: that of ``preprocess synthetic-drift`` (a day has no test split: the next day is its test)
DRIFT_RATIOS = {"val": 0.1}


def build_unless_complete(out: Path, recipe: dict, force: bool, fn, interruptible: bool = False,
                          ratios: dict[str, float] = ZERO_RATIOS):
    """The build of every ``preprocess`` verb: the target directory for ``recipe``
    (:func:`dataset_target_or_fail`); when a dataset made from the same recipe is already complete
    there, :func:`say_already_complete` (with the verb's ``ratios``) and return None; else run
    ``fn(build_dir)`` and commit it (:func:`build_interruptible` with ``interruptible``, for a build
    that runs worker processes; else :func:`build_dataset`) and return what ``fn`` returned (its report).

    Raises:
        CommandError: ``out`` cannot be created or replaced, or (``interruptible``) a signal ended the
            build; whatever ``fn`` raises.
    """
    target = dataset_target_or_fail(out, recipe, force)
    if target.state == "complete":
        say_already_complete(out, ratios)
        return None
    return build_interruptible(target, out, fn) if interruptible else build_dataset(target, fn)


def _committed(target) -> bool:
    """``target``'s build is complete at ``target.out``: its marker says complete with this build's
    recipe and meta.json is there (what a re-run checks before saying ``already complete``)."""
    from dlrmctl.outputs import read_marker

    rec = read_marker(target.out)
    return bool(rec and rec.get("complete") and rec.get("recipe") == target.recipe
                and (target.out / "meta.json").is_file())


def say_already_complete(out: Path, ratios: dict[str, float] = ZERO_RATIOS) -> None:
    """The message of a re-run of the same inputs and options on a finished dataset (and the
    empty-split warning of :func:`print_summary`, ``ratios`` as there)."""
    import json

    from dlrmctl import outputs

    outputs.unlock_output(out)
    meta = json.loads((out / "meta.json").read_text())
    rows = ", ".join(f"{s} {v.get('rows', 0):,}" for s, v in (meta.get("splits") or {}).items())
    typer.echo(f"{out}: already complete ({rows} rows), nothing to do; --force rebuilds it")
    _warn_empty_splits({s: v.get("rows", 0) for s, v in (meta.get("splits") or {}).items()}, out, ratios)


def stat_inputs(input: List[str]) -> list[dict]:
    """The input files of a criteo preprocess (path, size, mtime): its recipe's ``inputs``."""
    from dlrmctl.data.criteo.parse import expand_inputs

    # the input's own error (DataError) comes before any question about --out
    files = expand_inputs(input if len(input) > 1 else input[0])
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": os.path.abspath(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def print_summary(rep, out: Path, ratios: dict[str, float] = ZERO_RATIOS) -> None:
    """The preprocess's last lines: the rows per split written (or found complete), then a
    ``warning:`` line (stderr) when the val or test split is empty, saying how to get one: only a
    split the verb has a ratio option for (``ratios``: split -> the option's default)."""
    if not rep.files_processed and rep.files_skipped:
        rows = ", ".join(f"{s} {n:,}" for s, n in rep.rows.items())
        typer.echo(f"{out}: already complete ({rows} rows), nothing to do"
                   + (f"; {rep.bad_lines:,} bad lines skipped" if rep.bad_lines else ""))
        _warn_empty_splits(rep.rows, out, ratios)
        return
    rows = ", ".join(f"{s} {n:,}" for s, n in rep.rows.items())
    typer.echo(f"wrote {out}: {rows} rows; {rep.rows_per_s:,.0f} rows/s over {rep.seconds:.1f} s"
               + (f"; {rep.bad_lines:,} bad lines skipped" if rep.bad_lines else "")
               + (f"; {rep.files_skipped} input file(s) already done (resumed)" if rep.files_skipped else ""))
    _warn_empty_splits(rep.rows, out, ratios)


def _warn_empty_splits(rows: dict, out: Path, ratios: dict[str, float]) -> None:
    """A ``warning:`` line naming the empty val / test split(s) of ``rows`` (split -> rows) that the
    verb's ratio options make (``ratios``: split -> the option's default): ``train`` evaluates on val."""
    empty = [s for s in ("val", "test") if s in ratios and not rows.get(s)]
    if not empty or not rows.get("train"):
        return
    how = " and ".join(f"--{s}-ratio 0.1" for s in empty)
    zero = len(empty) == 2 and not any(ratios.values())
    typer.echo(f"warning: {out} has no {' or '.join(empty)} split (0 rows"
               + (", the default --val-ratio and --test-ratio are 0" if zero else "") + "): "
               + ("`train` evaluates on the val split and keeps its best checkpoint by it; " if "val" in empty else "")
               + f"preprocess again with {how} (fractions of the rows) to get "
               + ("them" if len(empty) == 2 else "one"), err=True)


@app.command("criteo", short_help="Criteo Kaggle / 1TB click logs -> shards + meta.json")
def criteo(
    input: List[str] = typer.Option(..., "--input", "-i", help="train.txt / day_N file(s), plain or .gz; a file, "
                                    "a directory or a glob (repeatable)"),
    out: DatasetOut = ...,
    num_embeddings: Annotated[Optional[str], int_list_option(
        "--num-embeddings", n=26, help="hashing: id = hex mod N (one N, or 26 comma-separated); tables get N+1 rows "
        "(last = missing). Default: a vocabulary (see --frequency-threshold)")] = None,
    frequency_threshold: Optional[int] = typer.Option(
        None, help="vocabulary: values seen >= T times in train get their own row, rarer ones share one "
        "(default 3 when --num-embeddings is not given; best on small data)"),
    raw_ids: bool = typer.Option(False, "--raw-ids", help="raw 64-bit ids (FNV-1a-64 of each value's 8 hex "
                                 "digits), no vocabulary, no modulo: for managed-collision tables "
                                 "(model.managed_collision)"),
    val_ratio: float = typer.Option(0.0, help="fraction of rows for validation (per-row hash split)"),
    test_ratio: float = typer.Option(0.0, help="fraction of rows for test (per-row hash split)"),
    seed: int = typer.Option(0, help="seed of the ratio split and of the multi-hot offsets"),
    split_by_day: bool = typer.Option(False, "--split-by-day", help="1TB layout: day_0..day_22 train, the last "
                                      "day split into validation (first half) and test (second half)"),
    on_bad_line: str = typer.Option("error", help="'error' (stop, naming file:line and field) or 'skip' (count)"),
    multi_hot_sizes: Annotated[Optional[str], int_list_option(
        "--multi-hot-sizes", n=26, help="26 comma-separated bag sizes: materialise MLPerf-DLRMv2 multi-hot bags")] = None,
    multi_hot_distribution: str = typer.Option("uniform", help="'uniform' or 'pareto' multi-hot offsets"),
    workers: Workers = 1,
    quiet: Quiet = False,
    force: ReplaceDataset = False,
) -> None:
    """Criteo Kaggle / 1TB click logs (40 tab-separated fields) -> columnar shards + meta.json."""
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo
    from dlrmctl.procs import check_local_fanout

    opts = CriteoOptions(
        num_embeddings=num_embeddings,
        frequency_threshold=frequency_threshold, val_ratio=val_ratio, test_ratio=test_ratio, seed=seed,
        split_by_day=split_by_day, on_bad_line=on_bad_line,
        multi_hot_sizes=multi_hot_sizes,
        multi_hot_distribution=multi_hot_distribution, workers=workers, raw_ids=raw_ids,
    )
    try:
        opts.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    check_output_dir(out, "--out")  # a file, under a file, read-only: one line before any work
    check_local_fanout(workers, f"--workers {workers}")
    inputs = stat_inputs(input)
    recipe = {"dataset": "criteo", "inputs": inputs,
              "options": {k: v for k, v in dataclasses.asdict(opts).items() if k != "workers"}}
    recipe["legacy_same"] = _legacy_criteo_same(out, inputs)
    rep = build_unless_complete(out, recipe, force, lambda d: preprocess_criteo(
        input if len(input) > 1 else input[0], d, opts, progress=not quiet), interruptible=True)
    if rep is not None:
        print_summary(rep, out)


def _legacy_criteo_same(out: Path, inputs: list[dict]) -> bool:
    """A criteo dataset of an older dlrmctl (no marker) may be resumed: unfinished, or its meta.json
    lists the same input files (its parts' own fingerprints decide what is redone)."""
    import json

    try:
        meta = json.loads((out / "meta.json").read_text())
    except FileNotFoundError:
        return (out / "parts").is_dir()
    except (OSError, ValueError):
        return False
    return meta.get("dataset") == "criteo" and [os.path.abspath(p) for p in meta.get("inputs", [])] == \
        [i["path"] for i in inputs]


@app.command("synthetic", short_help="Criteo-schema synthetic data with a planted signal")
def synthetic(
    out: Path = typer.Option(..., "--out", "-o", help="output directory"),
    rows: int = typer.Option(300_000, help="rows over all splits"),
    seed: int = typer.Option(0, help="seed of every parameter and row"),
    val_ratio: ValRatio = SYNTHETIC_RATIOS["val"],
    test_ratio: TestRatio = SYNTHETIC_RATIOS["test"],
    num_embeddings: Annotated[Optional[str], int_list_option(
        "--num-embeddings", n=26, help="table sizes: one N or 26 comma-separated (default: 10..10000, signal tables "
        "C1..C8 small)")] = None,
    zipf_alpha: float = typer.Option(1.05, help="Zipf exponent of id frequencies"),
    weighted_features: Optional[str] = typer.Option(
        None, help="comma-separated features (e.g. C1,C2) that get per-id weights U(0.5, 2) in a <feature>__weight "
        "column; their effect on the label is weight * effect (train them with `weighted: true` tables)"),
    interaction_features: Optional[str] = typer.Option(
        None, help="comma-separated features (>= 2, e.g. C1,C2,C3,C4) whose every pair adds <v_a[id_a], v_b[id_b]> "
        "of per-id latent vectors to the label logit: interactions a linear model cannot learn"),
    interaction_dim: int = typer.Option(4, help="width K of the planted latent vectors (with --interaction-features)"),
    interaction_std: float = typer.Option(1.5, help="standard deviation of the planted interaction term of the "
                                          "logit (with --interaction-features)"),
    force: bool = typer.Option(False, "--force", help="replace an existing dataset made with other options "
                               "(built beside it, swapped in when complete)"),
) -> None:
    """Criteo-schema synthetic data with a planted logistic signal (optionally pairwise interactions);
    meta.json has its bayes_auc."""
    from dlrmctl.data.synthetic import generate_synthetic

    check_output_dir(out, "--out")  # a file, under a file, read-only: one line before any work
    cards = num_embeddings  # (a list: int_list_option)
    wf = [f.strip() for f in (weighted_features or "").split(",") if f.strip()]
    inf = [f.strip() for f in (interaction_features or "").split(",") if f.strip()]
    recipe = {"dataset": "synthetic", "rows": rows, "seed": seed, "val_ratio": val_ratio,
              "test_ratio": test_ratio, "num_embeddings": cards, "zipf_alpha": zipf_alpha, "weighted_features": wf}
    if inf:  # only then: a dataset made before the option existed keeps its recipe
        recipe.update(interaction_features=inf, interaction_dim=interaction_dim, interaction_std=interaction_std)
    if inf:  # every argument checked before the output directory is touched
        from dlrmctl.data.synthetic import check_interaction_options

        try:
            check_interaction_options(inf, interaction_dim, interaction_std)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    def generate(d: Path):
        try:
            return generate_synthetic(d, rows=rows, seed=seed, val_ratio=val_ratio, test_ratio=test_ratio,
                                      num_embeddings=cards, zipf_alpha=zipf_alpha, weighted_features=wf,
                                      interaction_features=inf, interaction_dim=interaction_dim,
                                      interaction_std=interaction_std)
        except ValueError as e:
            if isinstance(e, UserError):  # e.g. DataError of a full disk: one line (dlrmctl.cli), not a usage error
                raise
            raise typer.BadParameter(str(e)) from None

    rep = build_unless_complete(out, recipe, force, generate, ratios=SYNTHETIC_RATIOS)
    if rep is None:
        return
    print_summary(rep, out, SYNTHETIC_RATIOS)
    import json

    typer.echo(f"bayes_auc (val) = {json.loads((out / 'meta.json').read_text())['bayes_auc']:.4f}")


@app.command("synthetic-drift", short_help="One day of a drifting click log, as raw ids")
def synthetic_drift(
    out: Path = typer.Option(..., "--out", "-o", help="output directory of this day"),
    day: int = typer.Option(..., "--day", min=0, help="the day K >= 0 (days 0..K-1 are replayed, not written)"),
    rows: int = typer.Option(100_000, help="rows of the day"),
    features: int = typer.Option(8, help="categorical features C1..CF"),
    signal: int = typer.Option(4, help="the first S of them carry per-id effects"),
    dense: int = typer.Option(4, help="dense features I1..ID"),
    alive: int = typer.Option(2000, help="ids alive per feature on a day"),
    churn: float = typer.Option(0.2, help="fraction of the alive ids that retire each day (as many are born)"),
    drift: float = typer.Option(0.5, help="std of the daily step of each id's log-popularity"),
    zipf_alpha: float = typer.Option(1.05, help="Zipf exponent of the popularity"),
    effect_std: float = typer.Option(0.8, help="std of the per-id effects on the logit"),
    val_ratio: float = typer.Option(DRIFT_RATIOS["val"], help="fraction of the day's rows for validation"),
    seed: int = typer.Option(0, help="seed of the whole log (the same for every day)"),
    modulo: Optional[int] = typer.Option(None, help="store raw_id %% N index ids (a modulo-hashing baseline) "
                                         "instead of raw ids"),
    force: bool = typer.Option(False, "--force", help="replace an existing dataset made with other options"),
) -> None:
    """One day of a drifting click log (ids born and retired, shifting Zipf popularity, per-id
    effects) as raw ids; meta.json has the day's bayes_auc."""
    from dlrmctl.data.drifting import DriftOptions, generate_drifting_day

    check_output_dir(out, "--out")
    o = DriftOptions(rows, features, signal, dense, alive, churn, drift, zipf_alpha, effect_std, val_ratio, seed, modulo)
    try:
        o.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    recipe = {"dataset": "synthetic-drift", "day": day, **vars(o)}
    rep = build_unless_complete(out, recipe, force, lambda d: generate_drifting_day(d, day, o, progress=True),
                                ratios=DRIFT_RATIOS)
    if rep is None:
        return
    print_summary(rep, out, DRIFT_RATIOS)
    import json

    m = json.loads((out / "meta.json").read_text())
    typer.echo(f"day {day}: bayes_auc (val) = {m['bayes_auc']:.4f}; ids alive {m['drift']['alive_per_feature']}, "
               f"ever seen {m['drift']['ever_seen_per_feature']} per feature")
