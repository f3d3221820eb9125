"""``dlrmctl``: the command line.  Thin: each verb parses options, loads the
config and calls one function."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import List, Optional

import typer

app = typer.Typer(
    help="Train, shard, plan and ship DLRM recommendation models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("torchx", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _print_metrics(title: str, m: dict) -> None:
    typer.echo(title)
    for k in ("auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"):
        if k in m:
            v = m[k]
            typer.echo(f"  {k:<12} {v:.6f}" if isinstance(v, float) and not math.isnan(v) else f"  {k:<12} {v}")


# ------------------------------------------------------------------ train
@app.command()
def train(
    config: str = typer.Argument(..., help="experiment YAML (configs/*.yaml)"),
    set_: List[str] = typer.Option([], "--set", help="override a config key: --set model.embedding_dim=32"),
    nproc: int = typer.Option(1, "--nproc", help="processes (ranks) per node; > 1 shards the tables"),
    nnodes: int = typer.Option(1, "--nnodes", help="nodes (torchx dist.ddp -j NNODESxNPROC)"),
    plan: Optional[str] = typer.Option(None, "--plan", help="sharding plan file written by `dlrmctl plan`"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run directory's newest checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the torchx AppDef instead of launching"),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Train (and evaluate) the model of CONFIG; writes runs/<name>/."""
    from dlrmctl.config import ConfigError, load_config

    _setup_logging(verbose)
    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        _fail(str(e))
    if plan:
        set_ = list(set_) + [f"sharding.plan_file={plan}"]
        cfg.sharding.plan_file = plan
    world = nproc * nnodes
    if dry_run:
        from dlrmctl.launch import build_appdef, launch

        raise typer.Exit(launch(build_appdef(config, set_, nproc, nnodes, resume, overwrite), dry_run=True))
    if world > 1:
        from dlrmctl.launch import build_appdef, launch
        from dlrmctl.train.loop import prepare_run_dir

        _check_before_launch(cfg, world, resume, overwrite)
        # the launcher sets up (or clears, for --overwrite) the run directory: the logs go inside it
        run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        app = build_appdef(config, set_, nproc, nnodes, resume, overwrite=False)
        raise typer.Exit(launch(app, log_dir=os.path.join(run_dir, "logs")))
    from dlrmctl.train.worker import run_training

    try:
        run_training(config, set_, resume=resume, overwrite=overwrite)
    except Exception as e:  # user-facing errors: one clear line, no traceback
        from dlrmctl.train.worker import USER_ERRORS

        if isinstance(e, USER_ERRORS):
            _fail(str(e))
        raise


def _check_before_launch(cfg, world: int, resume: bool, overwrite: bool) -> None:
    """Checks of a ``--nproc``/``--nnodes`` launch, run before any rank starts.

    Each failure prints one ``error: ...`` line and exits with code 2 (``typer.Exit``): the run
    directory already holds a run (without ``--resume``/``--overwrite``), ``data.path`` has no
    (valid) meta.json, or the stored sharding plan does not fit the model or the world size.
    """
    from dlrmctl.config import ConfigError, read_data_meta
    from dlrmctl.train.loop import TrainError, check_run_dir

    try:
        check_run_dir(cfg, resume, overwrite)
        meta = read_data_meta(cfg)
    except (TrainError, ConfigError) as e:
        _fail(str(e))
    if meta is None:  # the message the Trainer gives
        _fail(f"data.path {cfg.data.path!r} has no meta.json: run `dlrmctl preprocess ... --out {cfg.data.path}` first")
    if cfg.sharding.plan_file:
        _check_plan_before_launch(cfg, world)


def _check_plan_before_launch(cfg, world: int) -> None:
    """Fail fast, before any process starts, when a stored plan does not fit the model or world size."""
    from dlrmctl.config import ConfigError, read_data_meta, resolve_tables
    from dlrmctl.distributed.types import PlanError, ShardingPlan

    try:
        plan = ShardingPlan.load(cfg.sharding.plan_file)
        plan.validate(resolve_tables(cfg, read_data_meta(cfg)), world, where=cfg.sharding.plan_file)
    except (PlanError, ConfigError) as e:
        _fail(str(e))


# --------------------------------------------------------------- evaluate
@app.command()
def evaluate(
    run_dir: str = typer.Argument(..., help="runs/<name> (a training run) or an exported model directory"),
    split: str = typer.Option("val", "--split", help="val | test | train"),
    data: Optional[str] = typer.Option(None, "--data", help="preprocessed data directory (default: the run's)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    output_json: bool = typer.Option(False, "--json", help="print the metrics as JSON"),
) -> None:
    """Metrics (AUC, logloss, NE, calibration, accuracy) of a trained or exported model."""
    from dlrmctl.train.worker import USER_ERRORS

    _setup_logging()
    try:
        if os.path.exists(os.path.join(run_dir, "manifest.json")):
            from dlrmctl.inference.export import evaluate_exported

            if data is None:
                _fail("an exported model needs --data DIR (the preprocessed data to evaluate on)")
            m = evaluate_exported(run_dir, data, split, batch_size or 8192)
        else:
            from dlrmctl.train.loop import evaluate_run

            m = evaluate_run(run_dir, split, data, batch_size)
    except USER_ERRORS as e:
        _fail(str(e))
    if output_json:
        typer.echo(json.dumps(m))
    else:
        _print_metrics(f"{run_dir} [{split}]", m)


def _register_optional() -> None:
    """Attach the verbs that live in their own modules (preprocess, plan, export, ...)."""
    import importlib
    import importlib.util

    def have(mod: str) -> bool:
        return importlib.util.find_spec(f"dlrmctl.commands.{mod}") is not None

    from dlrmctl.commands import preprocess

    if have("preprocess_movielens"):
        importlib.import_module("dlrmctl.commands.preprocess_movielens").register(preprocess.app)
    app.add_typer(preprocess.app, name="preprocess", help="raw logs -> columnar shards + meta.json")
    for mod in ("plan", "export", "report", "checkpoint_cmd", "launch_cmd"):
        if have(mod):
            importlib.import_module(f"dlrmctl.commands.{mod}").register(app)


_register_optional()


def main() -> None:
    """Console-script entry point (``dlrmctl``)."""
    app()


if __name__ == "__main__":
    main()
