"""The launcher's watchdog of a local ``train --nproc N`` job: a rank that stops running is named
within a bounded time instead of its peers hanging in a collective until gloo's timeout (30 min).

Every :data:`POLL_S` seconds the watchdog reads ``/proc/<pid>/stat`` of each rank process of the
job (a process whose environment has ``RANK``, except one forked by a rank: a loader worker, which
inherits it; the rank names its own stopped workers, :mod:`dlrmctl.data.loader_workers`): a rank
that has been *stopped* (state ``T``/``t``:
SIGSTOP, a debugger) or blocked in uninterruptible I/O (state ``D``: a hung file system) for
``limit_s`` seconds in a row is stalled.  A peer waiting for it in a collective sleeps (state
``S``) and is never taken for it.  The first stalled rank is reported through ``on_stall`` once.

``limit_s``: ``$DLRMCTL_STALL_TIMEOUT_S`` (default :data:`DEFAULT_LIMIT_S`; 0 turns the watchdog
off).  Linux only (``/proc``); elsewhere it watches nothing.  Torch-free.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from dlrmctl.procs import proc_stat

ENV_LIMIT = "DLRMCTL_STALL_TIMEOUT_S"
DEFAULT_LIMIT_S = 120.0
POLL_S = 1.0
#: /proc states of a process that does not run: stopped, traced, uninterruptible sleep
STALLED_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a debugger",
                  "D": "blocked in uninterruptible I/O (a hung file system or device)"}


def stall_limit_s() -> float:
    """``$DLRMCTL_STALL_TIMEOUT_S`` as seconds (default :data:`DEFAULT_LIMIT_S`; 0: off).

    Raises:
        ValueError: not a number >= 0 (names the variable).
    """
    text = os.environ.get(ENV_LIMIT, "").strip()
    if not text:
        return DEFAULT_LIMIT_S
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise ValueError(f"${ENV_LIMIT}={text!r}: expected seconds >= 0 (0 turns the stalled-rank watchdog off)")
    return v


def rank_of(pid: int) -> int | None:
    """The ``RANK`` in the environment of process ``pid`` (None: not a rank, or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            v = item[5:].decode(errors="replace")
            return int(v) if v.isdigit() else None
    return None


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def forked_by_rank(pid: int, ppid: int) -> bool:
    """Process ``pid`` is a fork of its parent rank ``ppid`` (a loader worker: same ``RANK``,
    same command line, which ``fork`` keeps), not a rank of its own."""
    rank = rank_of(ppid)
    return rank is not None and rank == rank_of(pid) and _cmdline(pid) == _cmdline(ppid) is not None


class StallWatch:
    """Watches the rank processes ``processes()`` lists (pids) in a daemon thread.

    Args:
        processes: the job's processes (pids); re-read every poll (ranks start and restart).
        on_stall: called once with ``(rank, pid, what, seconds)`` for the first stalled rank.
        limit_s: seconds a rank may stay stopped or blocked (:func:`stall_limit_s`); 0: off.
    """

    def __init__(self, processes: Callable[[], list[int]], on_stall: Callable[[int, int, str, float], None],
                 limit_s: float) -> None:
        self.processes, self.on_stall, self.limit_s = processes, on_stall, limit_s
        self._since: dict[int, float] = {}  # pid -> when it was first seen not running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrmctl-stall-watch", daemon=True)
        self.fired = False

    def __enter__(self) -> "StallWatch":
        if self.limit_s > 0 and os.path.isdir("/proc"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self, now: float) -> tuple[int, int, str, float] | None:
        """One poll: the first rank stalled for ``limit_s`` at ``now`` (``(rank, pid, what, seconds)``) or None."""
        seen = set()
        for pid in self.processes():
            st = proc_stat(pid)
            rank = rank_of(pid) if st is not None else None
            if st is None or rank is None or forked_by_rank(pid, int(st[1])):
                continue
            seen.add(pid)
            if st[0] not in STALLED_STATES:
                self._since.pop(pid, None)
                continue
            since = self._since.setdefault(pid, now)
            if now - since >= self.limit_s:
                return rank, pid, STALLED_STATES[st[0]], now - since
        for pid in set(self._since) - seen:
            del self._since[pid]
        return None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                hit = self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - a watchdog never takes the job down by itself
                continue
            if hit is not None:
                self.fired = True
                self.on_stall(*hit)
                return
