"""The exclusive lock of a run directory (``runs/<name>/.lock``).

A training run holds an ``fcntl.flock`` on ``<run_dir>/.lock`` (the holder's pid written in it)
for its whole life: the single training process, or for ``--nproc`` the launcher (its ranks are
told the holder's pid through :data:`ENV_HOLDER` and do not lock again).  A second ``dlrmctl
train`` of the same run directory — with or without ``--resume`` / ``--overwrite`` — is refused
(:class:`RunInUseError`) before it touches anything.  The kernel drops the lock when the holder
exits, so a ``.lock`` file left by a dead process does not block: only the lock is tested, never
the file's existence.  Torch-free (the CLI checks it before importing torch).
"""

from __future__ import annotations

import fcntl
import os

from dlrmctl.errors import UserError

LOCK_NAME = ".lock"
#: environment variable naming the pid that holds the lock on behalf of this process (a rank of ``--nproc``)
ENV_HOLDER = "DLRMCTL_RUN_LOCK_HOLDER"
#: set by the ``--nproc`` launcher for its ranks to the run directory it has set up (and will clear or
#: settle after the job: :mod:`dlrmctl.commands.train`); rank 0 then leaves that directory's set-up
#: and clean-up (``--overwrite``'s set-aside run included) to the launcher
ENV_PREPARED = "DLRMCTL_RUN_DIR_PREPARED"

#: run directories (real paths) locked by this process -> (the lock file's descriptor, the directories
#: acquire created, innermost first: release removes those left empty)
_held: dict[str, tuple[int, list[str]]] = {}


class RunInUseError(RuntimeError, UserError):
    """The run directory is locked by another running dlrmctl."""


def _key(run_dir: str) -> str:
    return os.path.realpath(run_dir)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def _in_use(run_dir: str, pid: int | None) -> RunInUseError:
    who = f"pid {pid}" if pid else "pid unknown"
    return RunInUseError(f"{run_dir} is in use by a running dlrmctl ({who}); wait for it or --set name=<other>")


def _inherited(pid: int | None) -> bool:
    """The lock is held by the process that launched this one (``--nproc``'s launcher)."""
    holder = os.environ.get(ENV_HOLDER, "")
    return pid is not None and holder.isdigit() and int(holder) == pid


def holds(run_dir: str) -> bool:
    """This process holds the lock of ``run_dir``."""
    return _key(run_dir) in _held


def check_not_in_use(run_dir: str) -> None:
    """Raise :class:`RunInUseError` when another live process holds ``run_dir``'s lock; writes nothing.

    Not an error: this process holds it, or the launcher of this rank (:data:`ENV_HOLDER`) does.
    """
    if holds(run_dir):
        return
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY)
    except OSError:  # no lock file (or no directory): free
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            if not _inherited(pid):
                raise _in_use(run_dir, pid) from None
    finally:
        os.close(fd)  # also drops the shared lock taken for the test


def acquire(run_dir: str) -> bool:
    """Take ``run_dir``'s exclusive lock for this process (creates the directory and ``.lock``).

    Returns:
        True when this call took the lock; False when this process already holds it or the
        launcher of this rank does (:data:`ENV_HOLDER`).

    Raises:
        RunInUseError: another live process holds it.
    """
    if holds(run_dir):
        return False
    created, d = [], os.path.abspath(run_dir)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            if _inherited(pid):
                return False
            raise _in_use(run_dir, pid) from None
        try:  # the holder may have removed the file (release) between our open and flock: retry on the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk: the error names the lock file (a failed write names none)
            os.close(fd)
            e.filename = e.filename or path
            for leftover in (path, *created):  # nothing of this attempt stays
                try:
                    (os.remove if leftover == path else os.rmdir)(leftover)
                except OSError:
                    break
            raise
        _held[_key(run_dir)] = (fd, created)
        return True
    raise _in_use(run_dir, None)  # pragma: no cover - the file keeps being replaced


def release(run_dir: str) -> None:
    """Drop this process's lock of ``run_dir`` (if held); removes ``.lock``, and the directories
    :func:`acquire` created when nothing else is in them."""
    held = _held.pop(_key(run_dir), None)
    if held is None:
        return
    fd, created = held
    try:
        path = os.path.join(run_dir, LOCK_NAME)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.remove(path)  # while still locked: a waiter that opened it retries (acquire)
        except OSError:
            pass
        for d in [os.path.abspath(run_dir)] + [c for c in created if c != os.path.abspath(run_dir)]:
            try:
                if d == os.path.abspath(run_dir) or d in created:
                    os.rmdir(d)  # only when empty
            except OSError:
                break
    finally:
        os.close(fd)
