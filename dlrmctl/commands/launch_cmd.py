"""``dlrmctl launch``: submit (or print) a training job on a cluster scheduler through torchx."""

from __future__ import annotations

import os
from typing import Annotated, List, Optional

import typer

from dlrmctl.commands.options import Resume, check_numbers, number_option


def _parse_scheduler_cfg(items: list[str]) -> dict[str, str]:
    """``--scheduler-arg KEY=VALUE`` items as a dict (one ``error:`` line, exit 2, for an item without ``=``)."""
    from dlrmctl.commands._common import fail

    out = {}
    for it in items:
        if "=" not in it:
            fail(f"--scheduler-arg {it!r}: expected KEY=VALUE, e.g. queue=default")
        k, _, v = it.partition("=")
        out[k.strip()] = v.strip()
    return out


def check_scheduler(scheduler: str) -> None:
    """``--scheduler`` names a torchx scheduler this installation has (torchx's
    ``get_scheduler_factories``); else one ``error:`` line listing them, exit 2."""
    from dlrmctl.commands._common import fail

    try:
        from torchx.schedulers import get_scheduler_factories
    except ImportError as e:
        fail(f"cannot launch on {scheduler}: torchx is not installed ({e}); install dlrmctl's dependencies")
    names = sorted(get_scheduler_factories())
    if scheduler not in names:
        fail(f"--scheduler {scheduler!r}: unknown torchx scheduler; expected one of {', '.join(names)}")


def default_gpus_per_proc(config: str, overrides: list[str]) -> tuple[int, str]:
    """GPUs per process when ``--gpus-per-proc`` is not given: 1 unless the config trains on the CPU
    (``train.device: cpu``); ``auto`` runs on CUDA wherever the node has it, so the job asks for it.

    Returns:
        ``(gpus, reason)``; a config that cannot be read here (a path only the job sees) gives 0.
    """
    from dlrmctl.config import ConfigError, load_config

    try:
        dev = load_config(config, overrides).train.device
    except ConfigError as e:
        return 0, f"the config cannot be read here ({e}); pass --gpus-per-proc"
    if dev == "cpu":
        return 0, f"train.device is cpu in {config}"
    return 1, (f"train.device is {dev} in {config}" + (" (CUDA wherever the node has it)" if dev == "auto" else "")
               + "; --gpus-per-proc 0 for CPU-only nodes")


def shared_run_dir_note(config: str, overrides: list[str], nnodes: int) -> str | None:
    """The pre-launch line of a job over several nodes: ``train.run_dir`` must be on a filesystem
    every node mounts at the same path (every rank writes its checkpoint shards into the directory
    rank 0 creates; the run checks it at start).  None for one node."""
    if nnodes <= 1:
        return None
    from dlrmctl.config import ConfigError, load_config

    try:
        where = f"train.run_dir ({load_config(config, overrides).train.run_dir})"
    except ConfigError:
        where = "train.run_dir"
    return (f"note: {nnodes} nodes: {where} must be on a filesystem every node mounts at the same path "
            "(every rank writes its checkpoint shards there; the run checks it before the first step)")


def register(app: typer.Typer) -> None:
    @app.command(short_help="Run `dlrmctl train` as a torchx job on SCHEDULER")
    def launch(
        config: str = typer.Argument(..., help="experiment YAML (path as seen by the job)"),
        scheduler: str = typer.Option("local_cwd", "--scheduler", "-s",
                                      help="torchx scheduler: local_cwd | slurm | kubernetes | aws_batch | ..."),
        nproc: int = typer.Option(1, "--nproc", min=1, help="processes per node"),
        nnodes: Annotated[int, number_option("--nnodes", min=1, help="nodes", what="nodes", int_limit="ranks")] = 1,
        gpus_per_proc: Annotated[Optional[int], number_option(
            "--gpus-per-proc", help="GPUs per process (default: 1 unless train.device is cpu)", what="GPUs per process",
            positive=False, maximum=64)] = None,
        cpus_per_proc: Annotated[int, number_option(
            "--cpus-per-proc", help="CPUs per process (OMP_NUM_THREADS of each rank)", what="CPUs per process",
            maximum=4096)] = 1,
        mem: Optional[str] = typer.Option(None, "--mem", help="memory per process, MB or with a unit (e.g. 4000, 6G); "
                                          "default: none asked on slurm (the partition's default), 4096 MB on "
                                          "container schedulers"),
        image: Optional[str] = typer.Option(None, "--image", help="container image with dlrmctl installed (required "
                                            "by kubernetes, aws_batch and the other container schedulers)"),
        scheduler_arg: List[str] = typer.Option([], "--scheduler-arg", help="scheduler run option KEY=VALUE, e.g. queue=default"),
        set_: List[str] = typer.Option([], "--set", help="config override passed to every rank"),
        resume: Resume = False,
        dry_run: bool = typer.Option(False, "--dry-run", help="print the AppDef and the scheduler's request; submit nothing"),
        wait: bool = typer.Option(False, "--wait", help="cluster schedulers: stream rank 0's output until the job "
                                  "ends (exit 0 only when it succeeded); default: print the job's handle and return"),
    ) -> None:
        """Run `dlrmctl train` as a torchx dist.ddp job on SCHEDULER (prints the job spec with --dry-run).

        On a cluster scheduler the job's handle (e.g. slurm://dlrmctl/42) is printed on stdout; follow
        it with `dlrmctl jobs status|logs|cancel HANDLE`."""
        check_numbers(launch, locals())
        from dlrmctl.commands._common import fail
        from dlrmctl.console import echo
        from dlrmctl.launch import build_appdef, check_image, launch as submit, parse_mem

        mem_mb = parse_mem(mem) if mem is not None else None
        check_scheduler(scheduler)
        if dry_run or os.path.exists(config):
            # read and validated as `train` does (one error line, exit 2); without --dry-run a config
            # that does not exist here may still be a path only the job's nodes see
            from dlrmctl.config import load_config

            load_config(config, set_)
        if scheduler == "local_cwd" and not dry_run:  # the ranks are processes of this machine: as `train --nproc`
            from dlrmctl.procs import check_local_fanout

            check_local_fanout(nproc * nnodes, f"--nproc {nproc} x --nnodes {nnodes}", "or launch on a cluster scheduler")
        try:
            check_image(scheduler, image)  # before anything is printed: the one line of the error
        except ValueError as e:
            fail(f"cannot launch on {scheduler}: {e}")
        if gpus_per_proc is None:
            gpus_per_proc, why = default_gpus_per_proc(config, set_)
            echo(f"GPUs per process: {gpus_per_proc} ({why})", err=True)
        note = shared_run_dir_note(config, set_, nnodes) if scheduler != "local_cwd" else None
        if note:  # local_cwd: every "node" is this machine
            echo(note, err=True)
        cfg = _parse_scheduler_cfg(scheduler_arg)
        if scheduler == "kubernetes":
            cfg.setdefault("queue", "default")
        try:
            app = build_appdef(config, set_, nproc, nnodes, resume=resume, image=image, gpu_per_proc=gpus_per_proc,
                               cpu_per_proc=cpus_per_proc, mem_mb_per_proc=mem_mb, scheduler=scheduler)
            rc = submit(app, scheduler=scheduler, scheduler_cfg=cfg, dry_run=dry_run, wait=wait)
        except ImportError as e:  # a torchx scheduler whose client library (an extra) is not installed
            fail(f"cannot launch on {scheduler}: its client library is missing ({e}); install "
                 "dlrmctl's `cluster` extra: pip install 'dlrmctl[cluster]'")
        except ValueError as e:
            fail(f"cannot launch on {scheduler}: {e}")
        raise typer.Exit(rc)
