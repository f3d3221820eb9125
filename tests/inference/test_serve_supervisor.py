"""The watch over ``serve --processes``'s extra processes (``dlrmctl.inference.serve.processes``),
on plain processes standing in for server processes (no model, no HTTP): a process stopped by
job control is reported and makes readiness 503 until it continues; a clean exit nobody asked
for is a SIGTERM from outside; a process that does not stop in time is killed and said so."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import types

import pytest

from dlrmctl.inference.serve.processes import Supervisor, process_state, stop_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and job-control signals")

NAME = "dlrmctl-serve-process-2"
DEADLINE_S = 120  # generous: a loaded 2-core machine; never a timing assert


def _until(pred, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.05)


def _serve_like(ready, ignore_term: bool) -> None:
    """Stands in for a server process: a SIGTERM ends it cleanly (exit 0), or is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else (lambda *a: sys.exit(0)))
    ready.set()
    while True:
        time.sleep(0.1)


def _start(ignore_term: bool = False) -> mp.Process:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_serve_like, args=(ready, ignore_term), name=NAME, daemon=True)
    p.start()
    assert ready.wait(DEADLINE_S)
    return p


def test_a_stopped_server_process_is_reported_and_unready_until_it_continues(capsys):
    p = _start()
    app = types.SimpleNamespace(unready=None)
    watch = Supervisor([p], lambda k: None, app, lambda: None, poll_s=0.05).start()
    try:
        os.kill(p.pid, signal.SIGSTOP)
        _until(lambda: app.unready is not None, "readiness says the process is stopped")
        assert app.unready.startswith(f"server {NAME} (pid {p.pid}) is stopped (SIGSTOP / SIGTSTP)"), app.unready
        os.kill(p.pid, signal.SIGCONT)
        _until(lambda: app.unready is None, "readiness back once it continues")
    finally:
        watch.stop()
        stop_processes([p], wait=DEADLINE_S)
    err = capsys.readouterr().err.splitlines()
    assert [x for x in err if "stopped" in x or "continues" in x] == [
        f"warning: server {NAME} (pid {p.pid}) is stopped (SIGSTOP / SIGTSTP): "
        "connections the kernel gives it are not answered until it continues (SIGCONT)",
        f"server {NAME} continues and serves again"], err


def test_a_clean_exit_the_server_did_not_ask_for_is_named_a_sigterm_from_outside():
    p = _start()
    app = types.SimpleNamespace(unready=None)
    stopped = []
    watch = Supervisor([p], lambda k: None, app, lambda: stopped.append(1), max_restarts=0, poll_s=0.05).start()
    os.kill(p.pid, signal.SIGTERM)
    _until(lambda: stopped, "the server told to stop")
    watch.stop()
    assert watch.error == (f"server {NAME} was stopped by a SIGTERM from outside the server (it answered its "
                           "requests and exited), after 0 restart(s) of the server processes; server stopped")


def test_stopping_continues_a_stopped_process_so_it_drains_and_exits_cleanly():
    p = _start()
    os.kill(p.pid, signal.SIGSTOP)
    _until(lambda: process_state(p.pid) == "T", "the process stopped")
    killed: list[str] = []
    assert stop_processes([p], signal.SIGTERM, wait=DEADLINE_S, killed=killed) == [0]
    assert killed == []


def test_a_process_that_does_not_stop_within_the_wait_is_killed_and_named(capsys):
    p = _start(ignore_term=True)
    killed: list[str] = []
    assert stop_processes([p], signal.SIGTERM, wait=2.0, killed=killed, notice_s=0.1) == [-signal.SIGKILL]
    assert killed == [NAME]
    assert f"waiting up to 2 s for server {NAME} to stop (it answers the requests it holds)" in capsys.readouterr().err
