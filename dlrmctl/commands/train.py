"""``dlrmctl train CONFIG``: train (and evaluate) a model; ``--nproc N`` shards it over N ranks.

Thin: loads the config (a configuration error is one line, before torch is imported),
checks what a launch needs, then runs :func:`dlrmctl.train.worker.run_training` in this
process or launches the ranks through torchx (:mod:`dlrmctl.launch`).
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from dlrmctl.commands._common import echo, fail, setup_logging, show_path
from dlrmctl.commands.options import Resume


def train(
    config: str = typer.Argument(..., help="experiment YAML (configs/*.yaml)"),
    set_: List[str] = typer.Option([], "--set", help="override a config key: --set model.embedding_dim=32"),
    nproc: int = typer.Option(1, "--nproc", min=1, help="processes (ranks) per node; > 1 shards the tables"),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="nodes (torchx dist.ddp -j NNODESxNPROC)"),
    plan: Optional[str] = typer.Option(None, "--plan", help="sharding plan file written by `dlrmctl plan`"),
    resume: Resume = False,
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint",
                                             help="with --resume: the checkpoint to continue from, best | last | "
                                                  "<step> | <name> (default last)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run (kept until the new one has "
                                                               "its first complete checkpoint)"),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="start a new run from another run's weights, "
                                            "optimizer state and managed-collision remappers: RUN (its last "
                                            "checkpoint), RUN/best, RUN/<step> or a checkpoint directory"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the torchx AppDef instead of launching"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="dlrmctl's debug log lines on stderr (DEBUG "
                                 "instead of INFO)"),
) -> None:
    """Train (and evaluate) the model of CONFIG; writes runs/<name>/."""
    from dlrmctl.config import load_config

    setup_logging(verbose)
    cfg = load_config(config, set_)
    if checkpoint is not None and not resume:
        fail("--checkpoint selects the checkpoint to resume from: it needs --resume")
    if resume and overwrite:  # (it silently resumed)
        fail("--resume continues the run and --overwrite replaces it: pass one of them")
    if init_from is not None:
        if resume:
            fail("--init-from starts a new run and --resume continues one: pass one of them (a run started "
                 "--init-from resumes with --resume alone)")
        from dlrmctl.train.checkpoint import CheckpointError
        from dlrmctl.train.init_from import resolve_init_from

        spec = init_from
        try:
            init_from = os.path.abspath(resolve_init_from(init_from))
        except CheckpointError as e:
            fail(str(e))
        run_dir = os.path.realpath(os.path.join(cfg.train.run_dir, cfg.name))
        if os.path.realpath(init_from).startswith(run_dir + os.sep):
            fail(f"--init-from {spec} is a checkpoint of {os.path.join(cfg.train.run_dir, cfg.name)}, the run this "
                 f"command {'replaces (--overwrite)' if overwrite else 'writes'}: a new run cannot start from its own "
                 "checkpoint; give it another name (--set name=<new>)")
    if plan:
        set_ = list(set_) + [f"sharding.plan_file={plan}"]
        cfg.sharding.plan_file = plan
    world = nproc * nnodes
    if dry_run:
        from dlrmctl.launch import build_appdef, launch

        raise typer.Exit(launch(build_appdef(config, set_, nproc, nnodes, resume, overwrite, checkpoint=checkpoint,
                                             init_from=init_from),
                                dry_run=True))
    from dlrmctl.procs import check_local_fanout

    # every node of a local launch runs on this machine
    check_local_fanout(world, f"--nproc {nproc}" + (f" x --nnodes {nnodes}" if nnodes > 1 else ""),
                       "or run the job on a cluster (`dlrmctl launch --scheduler slurm|kubernetes`)")
    from dlrmctl import run_lock
    from dlrmctl.errors import check_output_dir

    # train.run_dir/<name> a file, under a file, read-only: one line before the lock creates anything
    check_output_dir(cfg.train.run_dir, "train.run_dir")
    check_output_dir(os.path.join(cfg.train.run_dir, cfg.name), "the run directory")
    # held for the whole run: a second `train` of this run directory is refused before it touches it
    run_lock.acquire(os.path.join(cfg.train.run_dir, cfg.name))
    try:
        _train(config, set_, cfg, nproc, nnodes, world, resume, overwrite, checkpoint, init_from)
    finally:
        run_lock.release(os.path.join(cfg.train.run_dir, cfg.name))


def _train(config, set_, cfg, nproc: int, nnodes: int, world: int, resume: bool, overwrite: bool,
           checkpoint: str | None, init_from: str | None = None) -> None:
    """The run itself, with the run directory's lock held (:mod:`dlrmctl.run_lock`)."""
    from dlrmctl import run_lock

    if world > 1:
        from dlrmctl.launch import build_appdef, launch, omp_threads_per_rank
        from dlrmctl.train.run_dir import clear_unsaved_attempt, finish_replacement, prepare_run_dir

        _check_before_launch(cfg, world, resume, overwrite, checkpoint)
        # the launcher sets up (or clears, for --overwrite) the run directory: the logs go inside it
        run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        app = build_appdef(config, set_, nproc, nnodes, resume, overwrite=False, checkpoint=checkpoint,
                           init_from=init_from)
        app.roles[0].env[run_lock.ENV_HOLDER] = str(os.getpid())  # the ranks run under this process's lock
        # ... in the directory set up here: rank 0 must not set it up again (that would give an
        # --overwrite's set-aside run back and delete the job's logs) nor clear it on failure (done below)
        app.roles[0].env[run_lock.ENV_PREPARED] = os.path.abspath(run_dir)
        threads, why = omp_threads_per_rank(nproc)
        echo(f"{world} ranks ({nnodes} x {nproc}), {threads} OpenMP thread(s) per rank ({why}; OMP_NUM_THREADS "
             "overrides); rank 0's output follows, every rank's log is in " + show_path(os.path.join(run_dir, "logs")))
        try:
            rc = launch(app, log_dir=os.path.join(run_dir, "logs"))
        except BaseException:  # Ctrl-C of the launcher: as a failed launch
            clear_unsaved_attempt(run_dir)
            raise
        if rc != 0:
            # failed before any checkpoint: a retry starts clean (logs/ stay); an --overwrite's old run is back
            clear_unsaved_attempt(run_dir)
        else:
            finish_replacement(run_dir, done=True)
        raise typer.Exit(rc)
    _check_before_launch(cfg, 1, resume, overwrite, checkpoint)  # the same one-line errors, before torch
    import signal

    from dlrmctl.errors import interrupt_exit_code, interrupt_of, interruptible
    from dlrmctl.procs import intra_op_threads
    from dlrmctl.train.worker import run_training

    threads, why = intra_op_threads(1)  # printed once the model is built (an error before it is the only line)

    # user errors (dlrmctl.errors.UserError) are reported by dlrmctl.cli as one line; a SIGTERM
    # takes the Ctrl-C path (the partial checkpoint is removed, the last good one stays)
    try:
        with interruptible((signal.SIGTERM,)):  # Ctrl-C is a KeyboardInterrupt already
            run_training(config, set_, resume=resume, overwrite=overwrite, checkpoint=checkpoint,
                         threads=threads, threads_why=why, init_from=init_from)
    except BaseException as e:  # noqa: BLE001 - only interrupts are handled here
        ki = interrupt_of(e)
        if ki is None:
            raise
        echo("error: " + interrupted_line(config, set_, os.path.join(cfg.train.run_dir, cfg.name),
                                          signal.Signals(interrupt_exit_code(ki) - 128).name), err=True)
        raise typer.Exit(interrupt_exit_code(ki)) from None


def interrupted_line(config: str, overrides: list[str], run_dir: str, signame: str = "SIGINT") -> str:
    """What an interrupted ``train`` prints: the checkpoint the run keeps and how to resume, or
    that nothing was saved (the directory keeps the attempt's config and logs; a plain ``train``
    starts over)."""
    import shlex

    from dlrmctl.train import checkpoint as ckpt

    cmd = " ".join(["dlrmctl train", shlex.quote(config)] + [f"--set {shlex.quote(o)}" for o in overrides])
    try:
        last = ckpt.latest_checkpoint(run_dir)
        step = None if last is None else ckpt.load_checkpoint_meta(last).get("step")
    except ckpt.CheckpointError:
        last, step = None, None
    if last is None:
        kept = "config and logs" if os.path.isdir(os.path.join(run_dir, "logs")) else "config"  # (logs: --nproc runs)
        return (f"interrupted ({signame}) before the first checkpoint: nothing saved ({show_path(run_dir)} keeps this attempt's "
                f"{kept}); start over with {cmd}")
    return (f"interrupted ({signame}): {show_path(run_dir)} kept its last checkpoint (step {step}); resume with "
            f"{cmd} --resume")


def _check_before_launch(cfg, world: int, resume: bool, overwrite: bool, checkpoint: str | None = None) -> None:
    """Checks of a training run before anything is written (before any rank of a ``--nproc`` /
    ``--nnodes`` launch starts; before torch is imported in a single process).

    Each failure raises a :class:`~dlrmctl.errors.UserError` (``dlrmctl.cli`` prints its one
    ``error: ...`` line, exit code 2): the run
    directory already holds a run (without ``--resume``/``--overwrite``), a hand-written table smaller
    than meta.json's ids of its feature (:func:`dlrmctl.config.check_tables_against_meta`; its
    warnings are printed), resuming on other data
    than the run's (fingerprint) or from a checkpoint it does not have, ``data.path`` has no
    (valid) meta.json, the train or validation split is missing or empty, or the stored sharding
    plan does not fit the model or the world size, or (no stored plan) the topology the trainer's
    planner would build (``sharding.topology_file`` or the ``sharding.device`` preset with
    ``hbm_gb`` / ``ddr_gb``) is missing or invalid, or ``train.tensorboard: true`` without TensorBoard.
    """
    from dlrmctl.config import read_data_meta
    from dlrmctl.train.checkpoint import latest_checkpoint, resolve_checkpoint
    from dlrmctl.train.run_dir import check_run_dir, check_train_splits
    from dlrmctl.train.train_log import check_tensorboard

    check_tensorboard(cfg.train.tensorboard)
    run_dir = check_run_dir(cfg, resume, overwrite)
    if resume and checkpoint is not None:
        resolve_checkpoint(run_dir, checkpoint)
    meta = read_data_meta(cfg)
    if meta is not None:
        check_train_splits(cfg, meta)
        from dlrmctl.config import check_managed_collision_sharding, check_tables_against_meta

        # resuming a checkpoint: the run's buckets are fixed (no --set advice)
        trained = resume and os.path.isdir(run_dir) and latest_checkpoint(run_dir) is not None
        check_managed_collision_sharding(cfg, meta, world, trained=trained)
        for line in check_tables_against_meta(cfg, meta):
            echo(f"warning: {line}", err=True)
    if meta is None:  # the message the Trainer gives
        fail(f"data.path {cfg.data.path!r} has no meta.json: run `dlrmctl preprocess ... --out {cfg.data.path}` first")
    if cfg.train.device == "cuda" and torch_build_cuda() is None:  # before any rank starts (each would refuse)
        from importlib.metadata import version

        fail(f"train.device=cuda but this torch build has no CUDA (torch {version('torch')}); install the gpu extra "
             "(pip install 'dlrmctl[gpu]' with a CUDA torch) or use --set train.device=cpu")
    if cfg.data.val_split == cfg.data.train_split:
        echo(f"warning: data.val_split '{cfg.data.val_split}' is the training split: validation metrics (the best "
             "checkpoint, early stopping) then measure rows the model trains on", err=True)
    if cfg.sharding.plan_file and (world > 1 or cfg.sharding.force):
        _check_plan_before_launch(cfg, world)
    elif world > 1 or cfg.sharding.force:  # the trainer's planner builds this topology on rank 0
        from dlrmctl.planner.planner import topology_for_config
        from dlrmctl.planner.types import PlanError

        try:
            topology_for_config(cfg, world)
        except (PlanError, OSError) as e:  # named by its config key
            raise PlanError(f"sharding.{'topology_file' if cfg.sharding.topology_file else 'device'}: {e}") from None


def torch_build_cuda() -> str | None:
    """The CUDA version the installed torch was built with (``torch.version.cuda``), read from
    ``torch/version.py`` without importing torch; None for a CPU build (or no torch found)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    for root in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(root, "version.py")) as f:
                m = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        return m.group(1) if m else None
    return None


def _check_plan_before_launch(cfg, world: int) -> None:
    """Fail fast, before any process starts, when a stored plan does not fit the model or world size."""
    from dlrmctl.config import read_data_meta, resolve_tables
    from dlrmctl.distributed.types import ShardingPlan

    plan = ShardingPlan.load(cfg.sharding.plan_file)
    plan.validate(resolve_tables(cfg, read_data_meta(cfg)), world, where=cfg.sharding.plan_file)


def register(app: typer.Typer) -> None:
    """Add ``train`` to the main ``dlrmctl`` app."""
    app.command("train")(train)
