"""The Criteo preprocess's parallel driver: a process pool over input files, and its progress line.

Each task is one input file (:class:`~dlrmctl.data.criteo.parse.FileTask`).  Workers report the
rows they have read through a queue (:func:`report_rows`); the parent prints rows/s on stderr.
With one worker (or one file) the tasks run in the calling process.

The workers end with the parent, even when it is SIGKILLed (:func:`dlrmctl.procs.die_with_parent`);
a SIGINT / SIGTERM of the parent stops them at once and raises :class:`dlrmctl.errors.Interrupted`.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable

import pyarrow as pa

__all__ = ["Progress", "report_rows", "run_tasks"]

_PROGRESS_Q = None


def init_worker(q, parent: int | None = None) -> None:
    """Pool initializer: end with the parent process ``parent`` (its pid), leave SIGINT to it (it stops
    the pool), route :func:`report_rows` to the queue ``q``; one Arrow thread per worker."""
    import signal

    from dlrmctl.procs import die_with_parent

    global _PROGRESS_Q
    die_with_parent(signal.SIGKILL, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _PROGRESS_Q = q
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def report_rows(rows: int) -> None:
    """Tell the parent's progress line that ``rows`` more rows were read (-1: a file was skipped)."""
    if _PROGRESS_Q is not None:
        _PROGRESS_Q.put(rows)


class Progress:
    """Rows/s progress line on stderr: ``\\r``-updated every 0.5 s on a terminal, else one line per
    10 s; the first one only once a pass has run that long, so a short pass prints just its final
    line (:meth:`show` with ``final=True``)."""

    def __init__(self, label: str, total_files: int, enabled: bool) -> None:
        self.label, self.total_files, self.enabled = label, total_files, enabled
        self.rows = 0
        self.files_done = 0
        self.t0 = time.perf_counter()
        self._last = self.t0  # no line at the start: the first after one interval
        self._tty = sys.stderr.isatty()

    def add(self, rows: int) -> None:
        self.rows += max(rows, 0)
        self.show()

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.5 if self._tty else 10.0):
            return
        self._last = now
        dt = max(now - self.t0, 1e-9)
        msg = (f"{self.label}: {self.rows:,} rows | {self.rows / dt:,.0f} rows/s | "
               f"files {self.files_done}/{self.total_files} | {dt:.1f} s")
        end = "\n" if final or not self._tty else ""
        sys.stderr.write(("\r" if self._tty else "") + msg + end)
        sys.stderr.flush()


def run_tasks(fn: Callable[[Any], Any], tasks: list[Any], workers: int,
               progress: Progress) -> list[Any]:
    """Run ``fn`` over tasks, in-process (1 worker) or in a process pool, with progress.

    Raises:
        dlrmctl.errors.Interrupted: SIGINT / SIGTERM of this process (the workers were killed first).
        Whatever ``fn`` raised in a worker (e.g. DataError); the other tasks are cancelled.
    """
    if not tasks:
        return []
    if workers == 1 or len(tasks) == 1:
        global _PROGRESS_Q

        class _Q:
            def put(self, r):
                progress.add(r)

        _PROGRESS_Q = _Q()
        try:
            out = []
            for t in tasks:
                out.append(fn(t))
                progress.files_done += 1
            return out
        finally:
            _PROGRESS_Q = None
    import multiprocessing as mp
    import os

    from dlrmctl.errors import Interrupted, interruptible

    # fork where available: workers start in milliseconds with everything already imported
    # (spawn re-imports torch in every worker, seconds each); the parent runs no torch/OpenMP
    # work before this point, so forking is safe.  Elsewhere: spawn.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() and sys.platform == "linux" else "spawn")
    q = ctx.Queue()
    results: dict[int, Any] = {}
    ex = ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx,
                             initializer=init_worker, initargs=(q, os.getpid()))
    try:
        with interruptible():
            futs = {ex.submit(fn, t): i for i, t in enumerate(tasks)}
            pending = set(futs)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(q, progress)
                for f in done:
                    results[futs[f]] = f.result()  # re-raises a worker's DataError
                    progress.files_done += 1
                progress.show()
            _drain(q, progress)
    except Interrupted:
        _stop(ex)
        raise
    except BaseException:  # a task failed: cancel the rest, let the running ones finish cleanly
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return [results[i] for i in range(len(tasks))]


def _stop(ex: ProcessPoolExecutor) -> None:
    """Cancel what has not started and kill the pool's workers now (their tasks write to temporary
    paths that a re-run clears: no half-written output), then reap them."""
    procs = list((getattr(ex, "_processes", None) or {}).values())  # concurrent.futures internals
    for p in procs:
        if p.is_alive():
            p.kill()
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(timeout=10)


def _drain(q, progress: Progress) -> None:
    import queue as _queue

    while True:
        try:
            progress.add(q.get_nowait())
        except _queue.Empty:
            return

