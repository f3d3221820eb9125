"""The torchx AppDef of a ``dlrmctl train`` job: what ``torchx run dist.ddp`` would build, made to
run this interpreter's torchrun, with dlrmctl's per-rank environment and resource requests.

``dlrmctl train CONFIG --nproc N [--nnodes M]`` builds the AppDef that
``torchx run -s local_cwd dist.ddp -j MxN -m dlrmctl.train.worker CONFIG ...`` would
(:func:`build_appdef`); :mod:`dlrmctl.launch.run` runs it.  On ``local_cwd`` torchrun is started
as ``sys.executable -m torch.distributed.run`` (no ``torchrun`` on PATH needed), every rank's
stdout and stderr go to log files and local rank 0's are teed to the console; on a cluster the
console lines carry the global rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from typing import Any

from dlrmctl.launch.failures import LaunchError

__all__ = [
    "CONTAINER_SCHEDULERS",
    "LOCAL_SCHEDULER",
    "ROLE",
    "WORKER_MODULE",
    "build_appdef",
    "check_image",
    "default_mem_mb_per_proc",
    "format_appdef",
    "omp_threads_per_rank",
    "parse_mem",
]

WORKER_MODULE = "dlrmctl.train.worker"
LOCAL_SCHEDULER = "local_cwd"
#: torchx schedulers that run every rank in a container image: they need ``image`` (torchx's
#: default image, ``ghcr.io/pytorch/torchx:<version>``, has no dlrmctl, so its ranks could not start)
CONTAINER_SCHEDULERS = frozenset({"kubernetes", "kubernetes_mcad", "aws_batch", "aws_sagemaker", "gcp_batch",
                                  "local_docker"})
#: torchrun's console-line prefix on a cluster: the GLOBAL rank (``[3]:``), so one node's log tells its ranks apart
_RANK_PREFIX_TEMPLATE = "[${rank}]:"
#: the role's name in dist.ddp AppDefs
ROLE = "worker"


def default_mem_mb_per_proc(scheduler: str) -> int:
    """Memory (MB) asked per process when ``--mem`` is not given: none on Slurm (0: no ``--mem``, the
    partition's ``DefMemPerCPU`` / whole-node default applies, which every partition accepts); 4096
    on the container schedulers (a pod needs a request)."""
    return 4096 if scheduler in CONTAINER_SCHEDULERS else 0


def parse_mem(text: str) -> int:
    """``--mem`` as MB: a number of MB, or with a K/M/G/T suffix (sbatch's units, powers of 1024), e.g. ``6G``.

    Raises:
        LaunchError: not such a size, or not positive.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.I)
    mb = float(m.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m.group(2).upper()] if m else 0
    if mb < 1:
        raise LaunchError(f"--mem {text!r}: expected the memory per process in MB or with a unit (e.g. 4000, 6G), "
                          "at least 1M")
    return int(mb)


def check_image(scheduler: str, image: str | None) -> None:
    """A container scheduler (:data:`CONTAINER_SCHEDULERS`) needs an image with dlrmctl installed.

    Raises:
        ValueError: ``scheduler`` runs containers and ``image`` is empty (names the scheduler,
            torchx's default image and the remedy).
    """
    if scheduler in CONTAINER_SCHEDULERS and not (image and image.strip()):
        raise ValueError(f"--scheduler {scheduler} runs every rank in a container image and torchx's default "
                         "(ghcr.io/pytorch/torchx) has no dlrmctl installed: pass --image IMAGE, an image with "
                         "dlrmctl and its dependencies (e.g. a torch image + `pip install .` of this checkout) "
                         "where the config path is readable")


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
    mem_mb_per_proc: int | None = None,
    name: str = "dlrmctl-train",
    scheduler: str = LOCAL_SCHEDULER,
    checkpoint: str | None = None,
    init_from: str | None = None,
) -> Any:
    """The torchx AppDef of a training job (``torchx.components.dist.ddp``).

    Args:
        config: path of the experiment YAML (as seen from the job's working dir).
        overrides: ``--set`` assignments passed through to every rank.
        nproc: processes per node; nnodes: nodes.
        resume, overwrite: passed through to every rank as ``--resume`` / ``--overwrite``.
        checkpoint: with ``resume``, passed as ``--checkpoint`` (best | last | step).
        init_from: passed as ``--init-from`` (a checkpoint directory a new run starts from).
        image: container image for cluster schedulers (ignored by local_cwd); required by the
            container schedulers (:func:`check_image`: ValueError without it).
        cpu_per_proc, gpu_per_proc, mem_mb_per_proc: resources per process
            (the role asks for ``nproc`` times these, in CPUs / GPUs / MB; memory 0: none asked;
            None: :func:`default_mem_mb_per_proc`).
        name: job name.
        scheduler: the torchx scheduler the AppDef is for.  On ``local_cwd`` the role
            runs ``sys.executable -m torch.distributed.run`` directly (no ``torchrun``
            on PATH needed), writes every rank's output to log files and tees local
            rank 0's to the console; on Slurm and the other schedulers that run on the nodes' own
            environment ddp's ``bash -c "torchrun ..."`` runs ``<this interpreter> -m
            torch.distributed.run ...`` instead (the same path must exist on the nodes: a shared
            filesystem or the same install), and every console line is prefixed with the
            GLOBAL rank (``[3]:``); container schedulers keep the image's ``torchrun``.

    Returns:
        ``torchx.specs.AppDef`` with one role running torchrun -m dlrmctl.train.worker.
    """
    from torchx.components.dist import ddp

    check_image(scheduler, image)
    args = [config]
    for ov in overrides:
        args += ["--set", ov]
    if resume:
        args.append("--resume")
        if checkpoint is not None:
            args += ["--checkpoint", str(checkpoint)]
    if overwrite:
        args.append("--overwrite")
    if init_from is not None:
        args += ["--init-from", str(init_from)]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(omp_threads_per_rank(nproc, scheduler, cpu_per_proc)[0])}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if mem_mb_per_proc is None:
        mem_mb_per_proc = default_mem_mb_per_proc(scheduler)
    node_env = scheduler != LOCAL_SCHEDULER and scheduler not in CONTAINER_SCHEDULERS
    if node_env:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = _RANK_PREFIX_TEMPLATE
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
    app = ddp(*args, **kw)
    if mem_mb_per_proc == 0:  # torchx turns 0 into its 1024 MB default: ask for none
        for r in app.roles:
            r.resource = dataclasses.replace(r.resource, memMB=0)
    if scheduler == LOCAL_SCHEDULER:
        _run_torchrun_through_this_interpreter(app.roles[0], nnodes)
    elif node_env:
        _torchrun_of_this_interpreter_in_bash(app.roles[0])
    return app


def _torchrun_of_this_interpreter_in_bash(role: Any) -> None:
    """In ddp's ``bash -c "torchrun ..."`` (kept: its rendezvous endpoint is a shell expansion of
    the first node's name), run ``<sys.executable> -m torch.distributed.run`` instead of whatever
    ``torchrun`` the node's PATH has."""
    cmd = role.args[-1]
    if role.entrypoint != "bash" or not cmd.startswith("torchrun "):
        raise ValueError(f"unexpected dist.ddp command: {role.entrypoint} {role.args}")
    role.args[-1] = f"{shlex.quote(sys.executable)} -m torch.distributed.run " + cmd[len("torchrun "):]


def omp_threads_per_rank(nproc: int, scheduler: str = LOCAL_SCHEDULER, cpu_per_proc: int = 1) -> tuple[int, str]:
    """OpenMP threads of each rank (``OMP_NUM_THREADS`` in the job's environment), and why.

    ``OMP_NUM_THREADS`` set in this environment wins; else on this machine the idle CPUs this
    process may use divided among the ``nproc`` local ranks (:func:`dlrmctl.procs.intra_op_threads`,
    at least 1), and on a cluster the CPUs each process asks for (``cpu_per_proc``).  Set
    deliberately, torchrun does not print its ``Setting OMP_NUM_THREADS ... to be 1`` banner.
    """
    from dlrmctl.procs import intra_op_threads

    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if scheduler != LOCAL_SCHEDULER and not (env.isdigit() and int(env) > 0):
        return max(1, cpu_per_proc), f"{cpu_per_proc} CPU(s) requested per process"
    return intra_op_threads(nproc)


def _run_torchrun_through_this_interpreter(role: Any, nnodes: int) -> None:
    """Rewrite ddp's ``bash -c "torchrun OPTIONS -m MODULE ARGS"`` into ``sys.executable -m torch.distributed.run ...``.

    Also: every rank's stdout/stderr are redirected to torchrun's log dir (``--redirects 3``)
    and local rank 0's are teed to the console (``--tee 0:3``); with several (local) nodes
    the rendezvous endpoint is ``localhost:<c10d port>`` (ddp's is a bash expansion).
    """
    argv = shlex.split(role.args[-1])
    if role.entrypoint != "bash" or argv[0] != "torchrun":
        raise ValueError(f"unexpected dist.ddp command: {role.entrypoint} {role.args}")
    opts = argv[1:]
    opts[opts.index("--tee") + 1] = "0:3"
    opts[opts.index("--tee"):opts.index("--tee")] = ["--redirects", "3"]
    if nnodes > 1:
        opts[opts.index("--rdzv_endpoint") + 1] = f"localhost:{role.port_map['c10d']}"
    role.entrypoint = sys.executable
    role.args = ["-m", "torch.distributed.run", *opts]


def format_appdef(app: Any) -> str:
    """Human-readable AppDef: roles, entrypoint, args, env, resources."""
    out = [f"AppDef {app.name}"]
    for r in app.roles:
        out += [
            f"  role {r.name}: replicas={r.num_replicas} image={r.image}",
            f"    entrypoint: {r.entrypoint}",
            "    args: " + " ".join(a or "''" for a in r.args),
            f"    env: {r.env}",
            f"    resources: cpu={r.resource.cpu} gpu={r.resource.gpu} memMB={r.resource.memMB}",
            f"    ports: {r.port_map}",
        ]
    return "\n".join(out)
