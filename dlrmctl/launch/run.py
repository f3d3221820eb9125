"""Multi-process / multi-node launch through torchx's ``dist.ddp`` component.

``dlrmctl train CONFIG --nproc N [--nnodes M]`` builds the AppDef that
``torchx run -s local_cwd dist.ddp -j MxN -m dlrmctl.train.worker CONFIG ...``
would, and runs it on torchx's ``local_cwd`` scheduler (torchrun underneath,
c10d rendezvous).  ``dlrmctl launch --scheduler slurm|kubernetes --dry-run``
prints the request those schedulers would receive, so the same job runs on a
cluster through an existing engine.

On ``local_cwd`` torchrun is started as ``sys.executable -m torch.distributed.run``
(so no ``torchrun`` on PATH is needed), every rank's stdout and stderr go to log
files, and only local rank 0's output is copied to the console.  A failing rank
records its error (:func:`record_rank_failure`) in the error file torchrun gives
it; after the job, :func:`first_failure` reads those records back, with torchrun's
report of the ranks that died without one (a signal), and the launcher prints one
line naming the rank that failed first (not the first that noticed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import sys
import threading
import time
from typing import Any, Iterator, TextIO

from dlrmctl.errors import Interrupted, interruptible
from dlrmctl.launch.failures import LaunchError, first_failure
from dlrmctl.procs import proc_stat

WORKER_MODULE = "dlrmctl.train.worker"
LOCAL_SCHEDULER = "local_cwd"
#: torchrun's prefix of the console lines it tees from local rank 0 (role "")
_RANK0_PREFIX = "[0]:"
#: torchx schedulers that run every rank in a container image: they need ``image`` (torchx's
#: default image, ``ghcr.io/pytorch/torchx:<version>``, has no dlrmctl, so its ranks could not start)
CONTAINER_SCHEDULERS = frozenset({"kubernetes", "kubernetes_mcad", "aws_batch", "aws_sagemaker", "gcp_batch",
                                  "local_docker"})


#: torchrun's console-line prefix on a cluster: the GLOBAL rank (``[3]:``), so one node's log tells its ranks apart
_RANK_PREFIX_TEMPLATE = "[${rank}]:"
#: the role's name in dist.ddp AppDefs
ROLE = "worker"
#: the torchx session name of dlrmctl's jobs (handles read ``slurm://dlrmctl/<job id>``)
SESSION = "dlrmctl"


def get_runner() -> Any:
    """torchx's ``Runner`` with dlrmctl's Slurm scheduler (:mod:`dlrmctl.launch.slurm`: one-line refusals,
    status without accounting storage) in place of torchx's; every other scheduler is torchx's."""
    from torchx.runner import Runner
    from torchx.schedulers import get_scheduler_factories

    factories = dict(get_scheduler_factories())
    if "slurm" in factories:
        from dlrmctl.launch import slurm

        factories["slurm"] = slurm.create_scheduler
    return Runner(SESSION, factories)


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


@contextlib.contextmanager
def scheduler_client(scheduler: str) -> Iterator[None]:
    """Inside, a scheduler's command-line client missing from PATH (torchx runs ``bhosts``,
    ``bjobs``, ``sbatch``, ... as subprocesses) is a :class:`LaunchError` naming the scheduler and
    the program, not ``[Errno 2] No such file or directory: 'bhosts'``."""
    try:
        yield
    except FileNotFoundError as e:
        prog = e.filename if isinstance(e.filename, str) else None
        if prog is None or os.sep in prog:
            raise
        raise LaunchError(f"--scheduler {scheduler}: its client program `{prog}` is not installed here (not on "
                          f"PATH); run dlrmctl on a machine of the {scheduler} cluster (a login node), or pick "
                          "another --scheduler") from None


def launch(app: Any, scheduler: str = LOCAL_SCHEDULER, scheduler_cfg: dict[str, Any] | None = None,
           dry_run: bool = False, log_dir: str | None = None, wait: bool = True) -> int:
    """Run (or, with ``dry_run``, print) the AppDef from :func:`build_appdef` on a torchx scheduler.

    On ``local_cwd`` local rank 0's output is copied to this process's stdout / stderr
    while the job runs, and a failed job is reported as one line on stderr naming the
    rank that failed first (see :func:`first_failure`) and where its log is.

    Args:
        app: the AppDef (built for ``scheduler``).
        scheduler: torchx scheduler name.
        scheduler_cfg: the scheduler's run options.
        dry_run: print the AppDef and the scheduler's request instead of running.
        log_dir: ``local_cwd`` only: directory that keeps every rank's and torchrun's logs
            (torchx's ``log_dir``: ``LOG_DIR/<session>/<app id>/...``); default: a
            temporary directory torchx deletes when this process exits.
        wait: cluster schedulers only (``local_cwd`` always waits): False prints the job's handle
            on stdout and returns at once; True prints it, then streams rank 0's output until the
            job ends (:func:`wait_job`).

    A scheduler's refusal (sbatch's message, an unreachable controller) raises :class:`LaunchError`.

    The first SIGINT / SIGTERM while the job runs cancels it (every rank and torchrun end) and
    is reported as one line (:func:`_cancel`).

    Returns:
        process exit code: 0 when the app SUCCEEDED (or was only printed), 1 otherwise;
        128 + the signal's number when a SIGINT / SIGTERM cancelled it (130, 143).
    """
    from torchx.specs import AppState

    runner = get_runner()
    cfg = dict(scheduler_cfg or {})
    if log_dir and scheduler == LOCAL_SCHEDULER:
        cfg["log_dir"] = os.path.abspath(log_dir)
    if dry_run:
        print(format_appdef(app))
        with scheduler_client(scheduler):
            info = runner.dryrun(app, scheduler, cfg=cfg)
        print(f"\n# {scheduler} request:\n{info}")
        return 0
    if scheduler == LOCAL_SCHEDULER:  # the ranks end with this process, even when it is SIGKILLed
        from dlrmctl.procs import LAUNCHER_ENV, process_token

        for r in app.roles:
            r.env[LAUNCHER_ENV] = process_token()
    from dlrmctl.stall_watch import StallWatch, stall_limit_s

    try:  # a local job's watchdog of stalled ranks (before anything starts: a bad value is one line)
        limit_s = stall_limit_s() if scheduler == LOCAL_SCHEDULER else 0.0
    except ValueError as e:
        raise LaunchError(str(e)) from None
    with scheduler_client(scheduler):
        handle = runner.run(app, scheduler=scheduler, cfg=cfg)
    role = app.roles[0].name
    if scheduler != LOCAL_SCHEDULER:
        print(handle, flush=True)
        if not wait:
            print(f"submitted {handle}: `dlrmctl jobs status|logs|cancel {handle}` (logs: add --follow; run them "
                  "in this directory)", file=sys.stderr, flush=True)
            return 0
        return wait_job(runner, handle, role)
    stalled: list[str] = []

    def on_stall(rank: int, pid: int, what: str, seconds: float) -> None:
        # the stalled rank cannot answer a SIGTERM: every process of the job is killed, the wait returns
        stalled.append(f"rank {rank} (pid {pid}) has been {what} for {seconds:.0f} s; the other ranks wait for it "
                       "in a collective: the job was stopped ($DLRMCTL_STALL_TIMEOUT_S sets the limit, 0 "
                       "turns the watchdog off)")
        for p, start in _job_processes(runner, handle):
            if _same_process(p, start):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass

    try:
        # torchx's own handlers raise a SignalException that the log echo would swallow; a second
        # Ctrl-C must not interrupt the cancel that follows (keep_ignoring)
        with interruptible(keep_ignoring=True), StallWatch(lambda: [p for p, _ in _job_processes(runner, handle)],
                                                            on_stall, limit_s):
            _echo_rank0(runner, handle, role)
            status = runner.wait(handle, wait_interval=1)
    except Interrupted as e:
        return _cancel(runner, handle, scheduler, e.signum, log_dir)
    if stalled:
        print(f"error: {stalled[0]}" + (f" (logs: {_show_path(log_dir)})" if log_dir else ""), file=sys.stderr)
        return 1
    if status is not None and status.state == AppState.SUCCEEDED:
        return 0
    if scheduler == LOCAL_SCHEDULER and status is not None and status.ui_url.startswith("file://"):
        app_log_dir = status.ui_url[len("file://"):]
        failure = first_failure(app_log_dir, role)
        where = _show_path(failure[1] if failure and failure[1] else app_log_dir) if log_dir else None
        what = failure[0] if failure else f"training job {handle} ended {status.state}"
        print(f"error: {what}" + (f" (logs: {where})" if where else ""), file=sys.stderr)
        return 1
    print(f"error: training job {handle} ended {status.state if status else 'UNKNOWN'}", file=sys.stderr)
    if status is not None and status.msg and status.msg.strip() not in ("<NONE>", ""):
        print(status.msg, file=sys.stderr)
    return 1


def wait_job(runner: Any, handle: str, role: str = ROLE) -> int:
    """Stream rank 0's stdout / stderr (its ``[0]:`` prefix removed) of a cluster job until it ends.

    A first SIGINT / SIGTERM cancels the job (one line, 128 + the signal's number).  A job that
    did not succeed is one ``error:`` line on stderr: its handle, the scheduler's state (e.g.
    ``FAILED``, ``CANCELLED``) and, when a rank's log says why, that rank's first ``error:`` line.

    Returns:
        0 when the job SUCCEEDED, 1 when it failed or was cancelled, 130 / 143 when interrupted.
    """
    from torchx.specs import AppState

    try:
        with interruptible(keep_ignoring=True):
            _echo_rank0(runner, handle, role)  # up to a failing rank 0's report: the line below says it
            status = runner.wait(handle, wait_interval=2)
    except Interrupted as e:
        return _cancel(runner, handle, "", e.signum, None)
    if status is not None and status.state == AppState.SUCCEEDED:
        return 0
    print(f"error: {job_outcome(runner, handle, status, role)}", file=sys.stderr, flush=True)
    return 1


def job_outcome(runner: Any, handle: str, status: Any, role: str = ROLE) -> str:
    """One line on a cluster job that did not succeed: ``training job H ended FAILED (...): rank 1: <its
    error line>; logs: dlrmctl jobs logs H --rank N`` or ``training job H was cancelled (...)``."""
    from torchx.specs import AppState

    state = status.state if status is not None else AppState.UNKNOWN
    msg = (status.msg or "").strip() if status is not None else ""
    for word in (str(state), "FAILED", "CANCELLED", "COMPLETED"):  # scontrol's "FAILED (NonZeroExitCode)"
        msg = msg[len(word):].strip(" ()") if msg.startswith(word) else msg
    detail = f" ({msg})" if msg and msg != "<NONE>" else ""
    if state == AppState.CANCELLED:
        return f"training job {handle} was cancelled{detail}; its run directory keeps what it wrote (resume with --resume)"
    why = _first_rank_error(runner, handle, role)
    what = f"training job {handle} ended {state}{detail}" + (f": {why}" if why else "")
    return f"{what}; see `dlrmctl jobs logs {handle} --rank N` (run where it was submitted)"


_RANK_LINE = re.compile(r"^\[(\d+)\]:(.*)$")


def _first_rank_error(runner: Any, handle: str, role: str) -> str | None:
    """``rank N: <message>`` of the first rank ``error:`` line (else the last exception line) in a
    finished job's stderr logs, when the scheduler's logs can be read here; else None."""
    from torchx.schedulers.api import Stream

    errors, exceptions = [], []
    for k in range(_replicas(runner, handle, role)):
        try:
            for line in runner.log_lines(handle, role, k=k, streams=Stream.STDERR):
                m = _RANK_LINE.match(line.rstrip("\n"))
                if not m:
                    continue
                text = m.group(2).strip()
                if text.startswith("error: "):
                    errors.append(f"rank {m.group(1)}: {text[len('error: '):]}")
                elif re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", text):
                    exceptions.append(f"rank {m.group(1)} failed: {text}")
        except Exception:  # the logs are best-effort; the state decides
            continue
    return (errors or exceptions[-1:] or [None])[0]


def _replicas(runner: Any, handle: str, role: str) -> int:
    """Replicas (nodes) of ``role`` in a job, from its status (1 when unknown)."""
    try:
        status = runner.status(handle)
        return max(1, sum(len(r.replicas) for r in status.roles if r.role == role)) if status else 1
    except Exception:
        return 1


def _cancel(runner: Any, handle: str, scheduler: str, signum: int, log_dir: str | None) -> int:
    """Cancel the interrupted job: torchx cancels it (local: SIGTERM to torchrun's process group,
    SIGKILL after 10 s), then any of its processes still alive (a rank torchrun left behind: they
    run in their own sessions) is killed.  Prints one line; returns 128 + ``signum``."""
    procs = _job_processes(runner, handle) if scheduler == LOCAL_SCHEDULER else []
    try:
        runner.cancel(handle)
    except Exception as e:  # still kill what is left, and report
        print(f"warning: cancelling {handle}: {e}", file=sys.stderr)
    deadline = time.monotonic() + 10
    for pid, start in procs:
        while _same_process(pid, start) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _same_process(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    name = signal.Signals(signum).name
    where = f"; logs in {_show_path(os.path.abspath(log_dir))}" if log_dir else ""
    print(f"error: interrupted ({name}): the job was cancelled{where}", file=sys.stderr, flush=True)
    return 128 + signum


def _job_processes(runner: Any, handle: str) -> list[tuple[int, str]]:
    """``(pid, start time)`` of a local job's processes: each replica (torchrun) and all its descendants (Linux /proc)."""
    try:
        sched, _, app_id = runner._scheduler_app_id(handle)  # torchx internals: best effort
        local_app = sched._apps[app_id]
        roots = [r.proc.pid for replicas in local_app.role_replicas.values() for r in replicas]
    except Exception:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st:
                children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        st = proc_stat(pid)
        if st:
            out.append((pid, st[19]))
            todo += children.get(pid, [])
    return out


def _same_process(pid: int, start: str) -> bool:
    """``pid`` is still the process that started at ``start`` and has not exited (zombies count as gone)."""
    st = proc_stat(pid)
    return st is not None and st[19] == start and st[0] != "Z"


def _echo_rank0(runner: Any, handle: str, role: str, stop_at_failure: bool = True) -> None:
    """Copy local rank 0's teed stdout / stderr lines (torchrun's ``[0]:`` prefix removed) to ours until the job ends.

    torchrun's own messages (no prefix) stay in the logs only, and so does a failing rank 0's
    report (from its first ``Traceback`` / ``error:`` line on): the launcher summarizes it.
    """
    from torchx.schedulers.api import Stream

    err = threading.Thread(target=_echo, args=(runner, handle, role, Stream.STDERR, sys.stderr),
                           kwargs={"stop_at_failure": stop_at_failure}, daemon=True)
    err.start()
    _echo(runner, handle, role, Stream.STDOUT, sys.stdout, stop_at_failure=stop_at_failure)
    err.join()


def _echo(runner: Any, handle: str, role: str, stream: Any, out: TextIO, prefix: str = _RANK0_PREFIX,
          stop_at_failure: bool = True) -> None:
    """Copy node 0's log ``stream`` of the job to ``out``: lines starting with ``prefix``, the prefix
    removed (with ``stop_at_failure``, up to a failing rank's first ``Traceback`` / ``error:`` line)."""
    try:
        for line in runner.log_lines(handle, role, k=0, should_tail=True, streams=stream):
            if not line.startswith(prefix):
                continue
            line = line[len(prefix):]
            if stop_at_failure and line.startswith(("Traceback (most recent call last)", "error: ")):
                return  # the rank is failing: the rest is in its log, the launcher prints a summary
            out.write(line if line.endswith("\n") else line + "\n")
            out.flush()
    except Exception:  # log streaming is best-effort; the job's status decides
        pass


def _show_path(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# ------------------------------------------------------------- failure records
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
