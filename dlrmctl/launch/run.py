"""Multi-process / multi-node launch through torchx's ``dist.ddp`` component.

``dlrmctl train CONFIG --nproc N [--nnodes M]`` runs the AppDef of
:func:`dlrmctl.launch.appdef.build_appdef` on torchx's ``local_cwd`` scheduler (torchrun
underneath, c10d rendezvous).  ``dlrmctl launch --scheduler slurm|kubernetes --dry-run``
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
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Iterator, TextIO

from dlrmctl.errors import Interrupted, interruptible
from dlrmctl.launch.appdef import LOCAL_SCHEDULER, ROLE, format_appdef
from dlrmctl.launch.failures import LaunchError, first_failure
from dlrmctl.procs import proc_stat

#: torchrun's prefix of the console lines it tees from local rank 0 (role "")
_RANK0_PREFIX = "[0]:"
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
