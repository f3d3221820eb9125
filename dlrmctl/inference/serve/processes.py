"""Running the server: the listening socket (:func:`bind`), uvicorn with a drain on SIGTERM
(:func:`serve`) and the extra server processes of ``--processes`` (:func:`start_processes`)."""

import os
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable

import torch

from dlrmctl.inference.serve.app import build_app
from dlrmctl.inference.serve.protocol import ServeError

#: restarts of the extra server processes (all together) before a server stops with an error
MAX_RESTARTS = 3
#: seconds a stopping server waits for each extra process to drain and exit before killing it
#: (uvicorn's graceful shutdown gives a request in flight 60 s)
STOP_WAIT_S = 90.0


def http_stack() -> tuple[str, str]:
    """uvicorn's ``(http, loop)`` implementations: ``httptools`` and ``uvloop`` where importable
    (the ``serve`` extra installs both; several times cheaper per request), else ``h11`` and ``asyncio``."""
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    return http, loop


def bind(host: str, port: int, reuse_port: bool = False, join: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one the OS picks) whose accepted
    connections have ``TCP_NODELAY`` set.

    The protocol is given as ``IPPROTO_TCP`` (not 0): asyncio sets ``TCP_NODELAY`` on an accepted
    connection only when its socket says so, and without it an answer written in two segments
    (uvicorn writes the headers, then the body) waits for the client's delayed ACK (about 40 ms
    on Linux) on every request of a kept-alive connection after its first.  ``TCP_NODELAY`` is
    also set on the listening socket (Linux passes it on to accepted connections).

    ``reuse_port``: ``SO_REUSEPORT``, so that the other server processes of ``--processes`` bind the
    same port and the kernel spreads new connections over them.  Unless ``join`` (one of those other
    processes), the port must be free first: ``SO_REUSEPORT`` alone would let this server share a
    port another ``--processes`` server of the same user listens on, each answering some requests.

    Raises:
        ServeError: the address cannot be bound (in use, not local), naming it; ``reuse_port`` where
            the platform has no ``SO_REUSEPORT``.
    """
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ServeError("--processes above 1 needs SO_REUSEPORT, which this platform lacks; use --processes 1")
    if reuse_port and not join and port != 0:  # free? (a plain bind fails where any listener holds it)
        bind(host, port).close()
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                         "(0: any free port) or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def start_processes(count: int, model_dir: str, name: str, host: str, port: int, threads: int,
                    options: dict, first: int = 2, total: int | None = None, device: str = "cpu",
                    artifact: str | None = None) -> list:
    """Start ``count`` more server processes (``multiprocessing`` spawn) on ``host:port``: each loads
    the model from ``model_dir`` onto ``device`` (the format ``artifact``, default the fastest), binds the port with ``SO_REUSEPORT`` (the first one's socket must
    have it too, :func:`bind`), reports back and serves with ``options`` (:func:`serve`'s keyword
    arguments) and ``threads`` intra-op threads.  Returns once every one is listening; each ends when
    the process that started it does (SIGTERM from :func:`serve`, or on its death).  They are numbered
    ``first``, ``first + 1``... of ``total`` (default ``count + 1``) in their names and metrics labels.

    Raises:
        ServeError: a process could not load the model or bind (its message), or did not report
            within 10 minutes; the others are stopped.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        for i in range(count):
            here, there = ctx.Pipe(duplex=False)
            k = first + i
            p = ctx.Process(target=_serve_child, name=f"dlrmctl-serve-process-{k}", daemon=False,
                            args=(there, model_dir, name, host, port, threads, f"{k} of {total or count + 1}", options,
                                  device, artifact))
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        for p, c in zip(procs, conns):
            if not c.poll(600):
                raise ServeError(f"server {p.name} did not start within 10 minutes")
            try:
                msg = c.recv()
            except EOFError:
                msg = f"exited with code {p.join(5) or p.exitcode} while starting"
            if msg:
                raise ServeError(f"server {p.name}: {msg}")
    except BaseException:
        stop_processes(procs)
        raise
    finally:
        for c in conns:
            c.close()
    return procs


def stop_processes(procs: list, sig: int | None = signal.SIGTERM, wait: float = 90.0,
                   killed: list[str] | None = None, notice_s: float = 5.0) -> list[int]:
    """Send ``sig`` (None: none, they were told already) to each live process of :func:`start_processes`,
    wait up to ``wait`` seconds for them (they drain), kill any left; returns their exit codes.

    A process stopped by job control (SIGSTOP / SIGTSTP, :func:`process_state` ``T``) is sent
    SIGCONT after the signal, as systemd does, so it can act on it.  A wait longer than
    ``notice_s`` seconds prints one line saying what it waits for; the names of the processes
    killed after ``wait`` are appended to ``killed`` (their exit code is then -9)."""
    from dlrmctl.console import echo

    for p in procs:
        if sig is not None and p.is_alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
        if p.is_alive() and process_state(p.pid) == "T":
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    end = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, min(notice_s, end - time.monotonic())))
        if p.is_alive() and wait > notice_s:
            echo(f"waiting up to {wait:.0f} s for server {p.name} to stop (it answers the requests it holds)",
                 err=True)
            p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            if killed is not None:
                killed.append(p.name)
    return [p.exitcode for p in procs]


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped by a
    signal, ``t`` stopped by a tracer, ``Z``, ...), or None when it cannot be read (gone, not Linux).
    Source: proc(5), field 3 of ``/proc/[pid]/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 1:].split()
    return rest[0].decode() if rest else None


def _serve_child(conn: Any, model_dir: str, name: str, host: str, port: int, threads: int, process: str,
                 options: dict, device: str = "cpu", artifact: str | None = None) -> None:
    """One extra server process of :func:`start_processes`."""
    try:  # end with the parent, whatever kills it (Linux)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent sends SIGTERM
    # a SIGTERM from now until serve() installs its handlers (loading, binding, importing uvicorn) is
    # noted, not fatal: the process then starts serving and stops at once, draining what it accepted
    requested: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, frame: requested.append(sig))
    torch.set_num_threads(threads)
    try:
        from dlrmctl.inference.export import load_exported

        model = load_exported(model_dir, device, artifact)
        sock = bind(host, port, reuse_port=True, join=True)
    except Exception as e:  # noqa: BLE001 - reported by the parent as one line
        conn.send(str(e) or type(e).__name__)
        conn.close()
        return
    conn.send("")
    conn.close()
    serve(model, name, sock, process=process, child=True, stop_requested=requested, **options)


def accept_queue(sock: socket.socket) -> int | None:
    """Connections waiting in listening socket ``sock``'s accept queue (Linux: ``tcpi_unacked`` of
    ``TCP_INFO``, which a listening socket reports as its accept queue); None where unknown."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        return struct.unpack_from("I", info, 24)[0]
    except (OSError, AttributeError, struct.error):
        return None


async def drain_backlog(sock: socket.socket, limit_s: float = 10.0) -> None:
    """Wait (at most ``limit_s``) until the event loop has accepted every connection waiting in
    ``sock``'s accept queue, then a moment for their requests to be read (each then runs to its
    answer during the shutdown)."""
    import asyncio

    end = time.monotonic() + limit_s
    while (accept_queue(sock) or 0) > 0 and time.monotonic() < end:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)


def exit_description(code: int | None, asked: bool = True) -> str:
    """``"was killed by SIGKILL"`` / ``"exited with code 3"`` for a process's exit code; an exit
    code 0 the server did not ask for (``asked`` False) is a stop by a SIGTERM from outside (a
    server process ends cleanly only on SIGTERM: SIGINT goes to its parent)."""
    if code == 0 and not asked:
        return "was stopped by a SIGTERM from outside the server (it answered its requests and exited)"
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Watches the extra server processes of ``--processes`` from a thread of the first one.

    A process that exits while the server runs, or is stopped by job control (SIGSTOP), is
    reported in one line on stderr, readiness
    (``/v2/health/ready``) answers 503 with the reason until it serves again (continues), and one
    that exited is started again (:func:`start_processes` through ``respawn``), at most ``max_restarts`` times in all; past
    that, or when it cannot start, the server stops (``stop``) and :attr:`error` says why.

    Args:
        procs: the processes (replaced in place by their restarts), process ``i`` numbered ``i + 2``.
        respawn: starts process number ``k`` again and returns it (returns once it listens).
        app: the first process's :class:`~dlrmctl.inference.serve.app.App` (its ``unready``).
        stop: asks the first process's server to stop.
        poll_s: the longest a death goes unnoticed (seconds).
    """

    def __init__(self, procs: list, respawn: Callable[[int], Any], app: Any, stop: Callable[[], None],
                 max_restarts: int = MAX_RESTARTS, poll_s: float = 0.5) -> None:
        self.procs, self._respawn, self._app, self._stop = procs, respawn, app, stop
        self.max_restarts, self._poll_s = max_restarts, poll_s
        self.restarts = 0
        self.error: str | None = None
        self._stopped: dict[str, str] = {}  # name -> why, of processes stopped by job control
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrmctl-serve-supervisor", daemon=True)

    def _check_stopped(self) -> None:
        """A process stopped by job control (SIGSTOP / SIGTSTP: state ``T`` or ``t`` in /proc) answers
        nothing, while the kernel still hands it its share of connections: one warning line, readiness
        503 with the reason until it continues (then one line, readiness back)."""
        from dlrmctl.console import echo

        for p in self.procs:
            if not p.is_alive():
                continue
            state = process_state(p.pid)
            if state in ("T", "t") and p.name not in self._stopped:
                why = (f"server {p.name} (pid {p.pid}) is stopped ("
                       + ("by a tracer" if state == "t" else "SIGSTOP / SIGTSTP") + "): connections the kernel "
                       "gives it are not answered until it continues (SIGCONT)")
                self._stopped[p.name] = why
                self._app.unready = why
                echo(f"warning: {why}", err=True)
            elif state not in ("T", "t", None) and p.name in self._stopped:
                why = self._stopped.pop(p.name)
                if self._app.unready == why:
                    self._app.unready = next(iter(self._stopped.values()), None)
                echo(f"server {p.name} continues and serves again", err=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def quit(self) -> None:
        """Stop watching, without waiting (the server is stopping: its processes are about to exit)."""
        self._done.set()

    def stop(self) -> None:
        """:meth:`quit`, then wait for a restart under way (whose process is then stopped)."""
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        from dlrmctl.console import echo

        while not self._done.is_set():
            wait([p.sentinel for p in self.procs], timeout=self._poll_s)
            if self._done.is_set():
                return
            self._check_stopped()
            for i, p in enumerate(self.procs):
                if p.is_alive() or self._done.is_set():
                    continue
                self._stopped.pop(p.name, None)
                why = f"server {p.name} {exit_description(p.exitcode, asked=False)}"
                self._app.unready = why
                if self.restarts >= self.max_restarts:
                    self.error = f"{why}, after {self.restarts} restart(s) of the server processes; server stopped"
                    self._stop()
                    return
                self.restarts += 1
                echo(f"warning: {why}; starting it again (restart {self.restarts} of at most {self.max_restarts})",
                     err=True)
                try:
                    new = self._respawn(i + 2)
                except ServeError as e:
                    if self._done.is_set():  # the server stopped while it started: not a failure
                        return
                    self.error = f"{why} and could not start again: {e}; server stopped"
                    self._stop()
                    return
                self.procs[i] = new
                if self._done.is_set():  # the server stopped while it started
                    stop_processes([new])
                    return
                self._app.unready = None
                echo(f"server {new.name} serves again", err=True)


def serve(model: Any, name: str, sock: socket.socket, max_batch_rows: int, max_delay_ms: float, max_queue_rows: int,
          workers: int, process: str = "1 of 1", others: list | None = None, child: bool = False,
          max_request_mb: float = 64.0, min_delay_ms: float = 0.0, max_ids_per_row: int = 1024,
          respawn: Callable[[int], Any] | None = None, max_restarts: int = MAX_RESTARTS,
          stop_requested: list[int] | None = None) -> str | None:
    """Run the server on ``sock`` (from :func:`bind`; connections made before this starts wait in its
    backlog) until SIGTERM / SIGINT; every request received is answered first.

    Args:
        process: this process's label (``"1 of 2"``) in ``dlrmctl_serve_process_info``.
        others: the processes of :func:`start_processes` serving the same port: sent SIGTERM as soon as
            this one is asked to stop (each drains its own requests), waited for before returning.
        child: one of ``others`` of another process: SIGINT (Ctrl-C reaches the whole process group)
            does not stop it, its parent sends SIGTERM; a SIGTERM after it stopped is ignored.
        respawn: starts process number ``k`` of ``others`` again (:class:`Supervisor`, at most
            ``max_restarts`` times); None: a process of ``others`` that exits is not watched.
        stop_requested: signals received before this was called (a child's early SIGTERM handler
            appends to it, and may still do so until this installs its own): the server starts,
            answers what it accepted and stops, as if the signal came after it started.

    Returns:
        the name of the signal that stopped it (``SIGTERM``), or None.

    Raises:
        ServeError: one of ``others`` did not exit cleanly (some of its requests may be unanswered),
            or exited while serving more often than ``max_restarts`` allows (the server stopped).
    """
    import uvicorn

    app = build_app(model, name, max_batch_rows, max_delay_ms, max_queue_rows, workers, process, max_request_mb,
                    min_delay_ms, max_ids_per_row)
    http, loop = http_stack()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=http, loop=loop,
                            timeout_graceful_shutdown=60, backlog=2048)
    stopping: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if child and sig == signal.SIGINT:
                return
            if others and not stopping:
                stopping.append(sig)
                if watch is not None:
                    watch.quit()
                for p in others:
                    if p.is_alive():
                        try:
                            os.kill(p.pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list | None = None) -> None:
            # connections the kernel accepted (in the listening socket's backlog) and the requests they
            # sent are taken in and answered first: closing the socket would reset them
            await drain_backlog(sock)
            await super().shutdown(sockets=sockets)

    server = Server(config)
    caught: list[int] = stop_requested if stop_requested is not None else []

    def after(sig, frame):  # uvicorn re-raises the signal it drained on: note it, do not die by it
        if child and sig == signal.SIGINT:
            return
        caught.append(sig)
        server.should_exit = True  # one before uvicorn's own handlers are in: it stops right after starting

    def stop_server() -> None:
        server.should_exit = True

    # the watching thread starts the restarted processes: their PR_SET_PDEATHSIG fires when it ends,
    # which is when the server stops (or gives up), as intended
    watch = Supervisor(others, respawn, app, stop_server, max_restarts).start() if others and respawn else None
    old = {s: signal.signal(s, after) for s in (signal.SIGINT, signal.SIGTERM)}
    if caught:  # asked to stop before the handlers above were in
        server.should_exit = True
    try:
        server.run(sockets=[sock])
    finally:
        if watch is not None:
            watch.stop()
        if child:  # it is stopping: a late SIGTERM (its parent's, or the parent-death signal when the
            # thread that restarted it ends) must not kill it while it exits, and Python puts back the
            # default action for handlers written in Python when the interpreter finalizes
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            for s, h in old.items():
                signal.signal(s, h)
        sock.close()
        killed: list[str] = []
        codes = stop_processes(others, None if stopping else signal.SIGTERM, STOP_WAIT_S, killed) if others else []
    if watch is not None and watch.error:
        raise ServeError(watch.error)
    if killed:
        raise ServeError(f"server {killed[0]} did not stop within {STOP_WAIT_S:.0f} s and was killed; requests "
                         "it held may be unanswered")
    bad = [(p.name, c) for p, c in zip(others or [], codes) if c != 0]
    if bad:
        raise ServeError(f"server {bad[0][0]} exited with code {bad[0][1]}; requests it held may be unanswered")
    return signal.Signals(caught[0]).name if caught else None
