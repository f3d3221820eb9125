"""``dlrmctl train CONFIG``: train (and evaluate) a model; ``--nproc N`` shards it over N ranks.

Thin: loads the config (a configuration error is one line, before torch is imported),
checks what a launch needs, then runs :func:`dlrmctl.train.worker.run_training` in this
process or launches the ranks through torchx (:mod:`dlrmctl.launch`).
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from dlrmctl.commands._common import fail, setup_logging


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

    setup_logging(verbose)
    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        fail(str(e))
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
    from dlrmctl.commands._common import user_errors
    from dlrmctl.train.worker import run_training

    try:
        run_training(config, set_, resume=resume, overwrite=overwrite)
    except Exception as e:  # user-facing errors: one clear line, no traceback
        if isinstance(e, user_errors()):
            fail(str(e))
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
        fail(str(e))
    if meta is None:  # the message the Trainer gives
        fail(f"data.path {cfg.data.path!r} has no meta.json: run `dlrmctl preprocess ... --out {cfg.data.path}` first")
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
        fail(str(e))


def register(app: typer.Typer) -> None:
    """Add ``train`` to the main ``dlrmctl`` app."""
    app.command("train")(train)
