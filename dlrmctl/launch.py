"""Multi-process / multi-node launch through torchx's ``dist.ddp`` component.

``dlrmctl train CONFIG --nproc N [--nnodes M]`` builds the AppDef that
``torchx run -s local_cwd dist.ddp -j MxN -m dlrmctl.train.worker CONFIG ...``
would, and runs it on torchx's ``local_cwd`` scheduler (torchrun underneath,
c10d rendezvous).  ``dlrmctl launch --scheduler slurm|kubernetes --dry-run``
prints the request those schedulers would receive, so the same job runs on a
cluster through an existing engine.
"""

from __future__ import annotations

import os
import sys
from typing import Any

WORKER_MODULE = "dlrmctl.train.worker"


def build_appdef(
    config: str,
    overrides: list[str],
    nproc: int,
    nnodes: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    image: str | None = None,
    cpu_per_proc: int = 1,
    gpu_per_proc: int = 0,
    mem_mb_per_proc: int = 4096,
    name: str = "dlrmctl-train",
) -> Any:
    """The torchx AppDef of a training job (``torchx.components.dist.ddp``).

    Args:
        config: path of the experiment YAML (as seen from the job's working dir).
        overrides: ``--set`` assignments passed through to every rank.
        nproc: processes per node; nnodes: nodes.
        image: container image for cluster schedulers (ignored by local_cwd).
        cpu_per_proc, gpu_per_proc, mem_mb_per_proc: resources per process
            (the role asks for ``nproc`` times these, in CPUs / GPUs / MB).

    Returns:
        ``torchx.specs.AppDef`` with one role running torchrun -m dlrmctl.train.worker.
    """
    from torchx.components.dist import ddp

    args = [config]
    for ov in overrides:
        args += ["--set", ov]
    if resume:
        args.append("--resume")
    if overwrite:
        args.append("--overwrite")
    env = {"PYTHONUNBUFFERED": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    kw: dict[str, Any] = dict(
        m=WORKER_MODULE,
        j=f"{nnodes}x{nproc}",
        cpu=cpu_per_proc * nproc,
        gpu=gpu_per_proc * nproc,
        memMB=mem_mb_per_proc * nproc,
        name=name,
        env=env,
    )
    if image:
        kw["image"] = image
    return ddp(*args, **kw)


def launch(app: Any, scheduler: str = "local_cwd", scheduler_cfg: dict[str, Any] | None = None,
           dry_run: bool = False) -> int:
    """Run (or, with ``dry_run``, print) the AppDef from :func:`build_appdef` on a torchx scheduler.

    Returns:
        process exit code: 0 when the app SUCCEEDED (or was only printed), 1 otherwise.
    """
    from torchx.runner import get_runner
    from torchx.specs import AppState

    runner = get_runner()
    if dry_run:
        print(format_appdef(app))
        info = runner.dryrun(app, scheduler, cfg=scheduler_cfg or {})
        print(f"\n# {scheduler} request:\n{info}")
        return 0
    handle = runner.run(app, scheduler=scheduler, cfg=scheduler_cfg or {})
    role = app.roles[0].name
    try:
        for line in runner.log_lines(handle, role, k=0, should_tail=True):
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
            sys.stdout.flush()
    except Exception:  # log streaming is best-effort; the status below decides
        pass
    status = runner.wait(handle, wait_interval=1)
    if status is None or status.state != AppState.SUCCEEDED:
        print(f"error: training job {handle} ended {status.state if status else 'UNKNOWN'}", file=sys.stderr)
        if status is not None and status.msg and status.msg.strip() not in ("<NONE>", ""):
            print(status.msg, file=sys.stderr)
        return 1
    return 0


def format_appdef(app: Any) -> str:
    """Human-readable AppDef: roles, entrypoint, args, env, resources."""
    out = [f"AppDef {app.name}"]
    for r in app.roles:
        out += [
            f"  role {r.name}: replicas={r.num_replicas} image={r.image}",
            f"    entrypoint: {r.entrypoint}",
            f"    args: {' '.join(r.args)}",
            f"    env: {r.env}",
            f"    resources: cpu={r.resource.cpu} gpu={r.resource.gpu} memMB={r.resource.memMB}",
            f"    ports: {r.port_map}",
        ]
    return "\n".join(out)
