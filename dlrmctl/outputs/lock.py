"""One writer per output at a time: an ``fcntl.flock`` on a sibling lock file
(:func:`lock_output`, :func:`unlock_output`).  Part of :mod:`dlrmctl.outputs`, which re-exports
both functions."""

from __future__ import annotations

import os
from pathlib import Path

from dlrmctl.errors import OutputError
from dlrmctl.fileio import temp_prefix

#: outputs locked by this process (real path -> the lock file's descriptor and path)
_locks: dict[str, tuple[int, Path]] = {}


def lock_output(out: str | os.PathLike) -> None:
    """Take the exclusive lock of the output ``out`` for this process: an ``fcntl.flock`` on the
    sibling ``.<name>.lock`` (beside it, so a swap of ``out`` keeps it; the holder's pid in it).
    The kernel drops it when the process ends; :func:`unlock_output` drops it earlier.

    Raises:
        OutputError: another live process holds it (names its pid); the parent cannot be created.
    """
    import fcntl

    out = Path(out)
    key = os.path.realpath(out)
    if key in _locks:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / (temp_prefix(out, "lock", 0)[:-1])
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise OutputError(f"{out}: in use by a running dlrmctl (pid {text or 'unknown'}) writing it; wait for "
                              "it to finish, or --out another directory") from None
        try:  # the holder removed the file between our open and flock: retry on the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:  # a full disk: name the lock file
                os.close(fd)
                e.filename = e.filename or str(path)
                raise
            _locks[key] = (fd, path)
            return
        os.close(fd)
    raise OutputError(f"{out}: its lock file {path} keeps being replaced; --out another directory")


def unlock_output(out: str | os.PathLike) -> None:
    """Drop this process's lock of ``out`` (:func:`lock_output`), removing its lock file."""
    held = _locks.pop(os.path.realpath(out), None)
    if held is None:
        return
    fd, path = held
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.remove(path)  # still locked: a waiter that opened it retries on a new file
    except OSError:
        pass
    finally:
        os.close(fd)
