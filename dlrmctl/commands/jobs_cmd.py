"""``dlrmctl jobs status|logs|cancel HANDLE``: a cluster job submitted by ``dlrmctl launch``, on torchx's runner API.

HANDLE is what ``launch`` printed (``slurm://dlrmctl/42``); a bare Slurm job id (``42``) means
``slurm://dlrmctl/42``.  Slurm's logs are files in the directory the job was submitted from
(``slurm-<id>-worker-<node>.out|.err``): run ``jobs logs`` there.
"""

from __future__ import annotations

import sys
import threading
from typing import Annotated, Optional

import typer

from dlrmctl.commands.options import check_numbers, number_option

app = typer.Typer(help="Status, logs and cancel of a job `dlrmctl launch` submitted", no_args_is_help=True)


def parse_handle(handle: str) -> str:
    """A torchx app handle from ``HANDLE`` (a bare number is a Slurm job id).

    Raises:
        LaunchError: not ``SCHEDULER://SESSION/ID`` nor a number.
    """
    from torchx.specs import parse_app_handle
    from torchx.specs.api import MalformedAppHandleException

    from dlrmctl.launch import SESSION, LaunchError

    h = handle.strip()
    if h.isdigit():
        return f"slurm://{SESSION}/{h}"
    try:
        parse_app_handle(h)
    except MalformedAppHandleException:
        raise LaunchError(f"job handle {handle!r}: expected SCHEDULER://SESSION/ID as `dlrmctl launch` printed it "
                          "(e.g. slurm://dlrmctl/42) or a Slurm job id") from None
    return h


def _status(runner, handle: str):
    """The job's torchx status; LaunchError when the scheduler does not know it."""
    from dlrmctl.launch import LaunchError, scheduler_client

    try:
        with scheduler_client(handle.split("://", 1)[0]):
            status = runner.status(handle)
    except (ValueError, KeyError) as e:  # an unknown scheduler name in the handle
        raise LaunchError(f"job handle {handle}: {e}") from None
    except ImportError as e:
        raise LaunchError(f"job handle {handle}: the scheduler's client library is missing ({e}); install dlrmctl's "
                          "`cluster` extra: pip install 'dlrmctl[cluster]'") from None
    if status is None:
        raise LaunchError(f"job {handle} is not known to the scheduler: never submitted, or it ended long ago (a "
                          "Slurm cluster without accounting forgets a job MinJobAge seconds after its end)")
    return status


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="jobs")


@app.command("status", short_help="Print the job's state and the scheduler's word on it")
def status(handle: str = typer.Argument(..., help="the job's handle, as `dlrmctl launch` printed it")) -> None:
    """Print the job's state (PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED) and the scheduler's word on it.

    Exit code 0 whatever the state; 2 when the job is unknown or the scheduler cannot be reached."""
    from dlrmctl.launch import get_runner

    h = parse_handle(handle)
    st = _status(get_runner(), h)
    msg = (st.msg or "").strip()
    replicas = sum(len(r.replicas) for r in st.roles)
    detail = [f"scheduler: {msg}"] if msg and msg not in ("<NONE>", str(st.state)) else []
    if replicas:
        detail.append(f"{replicas} node(s)")
    typer.echo(f"{h}: {st.state}" + (f" ({'; '.join(detail)})" if detail else ""))


@app.command("logs", short_help="Print rank N's output of the job")
def logs(
    handle: str = typer.Argument(..., help="the job's handle, as `dlrmctl launch` printed it"),
    rank: int = typer.Option(0, "--rank", min=0, help="global rank whose output to show"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
) -> None:
    """Print rank N's output of the job (its stdout on stdout, its stderr on stderr, the rank prefix removed)."""
    from torchx.schedulers.api import Stream

    from dlrmctl.launch import ROLE, LaunchError, get_runner

    h = parse_handle(handle)
    runner = get_runner()
    st = _status(runner, h)
    nodes = max(1, sum(len(r.replicas) for r in st.roles if r.role == ROLE))
    prefix = f"[{rank}]:"
    seen: set[str] = set()
    failures: list[str] = []
    lock = threading.Lock()

    def copy(k: int, stream, out) -> None:
        try:
            for line in runner.log_lines(h, ROLE, k=k, should_tail=follow, streams=stream):
                text = line.rstrip("\n")
                if text.startswith("[") and "]:" in text[:12]:
                    seen.add(text[1:text.index("]:")])
                if not text.startswith(prefix):
                    continue
                with lock:
                    out.write(text[len(prefix):] + "\n")
                    out.flush()
        except RuntimeError as e:  # torchx: "app ... finished without writing: <file>"
            failures.append(str(e).rsplit(": ", 1)[-1])
        except Exception as e:  # noqa: BLE001 - reported below as one line
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=copy, args=(k, s, o), daemon=True)
               for k in range(nodes) for s, o in ((Stream.STDOUT, sys.stdout), (Stream.STDERR, sys.stderr))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    if failures and len(failures) == len(threads):
        raise LaunchError(f"no log of job {h} here ({failures[0]}): Slurm writes the logs into the directory the "
                          "job was submitted from; run `dlrmctl jobs logs` there")
    if str(rank) not in seen:  # not an error: ranks other than 0 print only their warnings and errors
        ranks = sorted(int(r) for r in seen if r.isdigit())
        typer.echo(f"note: rank {rank} wrote nothing to the logs of {h} (ranks with output: "
                   f"{', '.join(map(str, ranks)) or 'none'})", err=True)


@app.command("cancel", short_help="Cancel the job and wait until it has ended")
def cancel(
    handle: str = typer.Argument(..., help="the job's handle, as `dlrmctl launch` printed it"),
    timeout: Annotated[Optional[float], number_option("--timeout", help="seconds to wait for the job to end",
                                                      what="seconds")] = 60.0,
) -> None:
    """Cancel the job and wait until the scheduler says it ended (its run directory keeps what it wrote)."""
    import time

    from dlrmctl.launch import LaunchError, get_runner, scheduler_client

    check_numbers(cancel, locals())
    h = parse_handle(handle)
    runner = get_runner()
    st = _status(runner, h)
    if st.is_terminal():
        typer.echo(f"{h}: already ended {st.state}; nothing to cancel")
        return
    with scheduler_client(h.split("://", 1)[0]):
        runner.cancel(h)
    deadline = time.monotonic() + float(timeout or 0)
    while not st.is_terminal() and time.monotonic() < deadline:
        time.sleep(1)
        st = runner.status(h) or st
    if not st.is_terminal():
        raise LaunchError(f"job {h} was asked to cancel but is still {st.state} after {timeout:g} s; check "
                          f"`dlrmctl jobs status {h}` (or the scheduler) later")
    typer.echo(f"{h}: cancelled ({st.state})")
