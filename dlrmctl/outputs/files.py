"""Single output files (``predict --output``, ``plan --out`` / ``--report``): which existing
file ``--force`` may replace (:func:`check_file_replaceable`) and the write through a temporary
sibling renamed when complete (:func:`atomic_file`).  Part of :mod:`dlrmctl.outputs`, which
re-exports every public name."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from dlrmctl.errors import OutputError
from dlrmctl.fileio import temp_prefix
from dlrmctl.outputs.markers import LEGACY_TEMP_AGE_S, kind_of, pid_alive


def _host_tag() -> str:
    """6 hex digits naming this host in a temporary file's name (a shared directory's other hosts'
    temporaries are never taken for this host's)."""
    import hashlib

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def temp_file(out: str | os.PathLike) -> Path:
    """The hidden temporary sibling a single output file is written to before its rename:
    ``.<name>.tmp-<host>-<pid>`` (shortened to fit ``NAME_MAX``, :func:`dlrmctl.fileio.temp_prefix`)."""
    out = Path(out)
    return out.with_name(f"{temp_prefix(out, 'tmp', 20)}{_host_tag()}-{os.getpid()}")


def reclaim_stale_files(out: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of ``out`` (:func:`temp_file`) left by killed runs of this host
    whose process is gone, and those of an older dlrmctl (``.<name>.tmp-<pid>``) untouched for
    :data:`LEGACY_TEMP_AGE_S` seconds whose pid is gone.  Returns the files removed."""
    out = Path(out)
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    removed, host = [], _host_tag()
    for n in names:
        for prefix in {temp_prefix(out, "tmp", 20), f".{out.name}.tmp-"}:
            rest = n[len(prefix):] if n.startswith(prefix) else ""
            tag, _, pid = rest.rpartition("-")
            if not pid.isdigit() or (tag and tag != host):
                continue
            p = out.parent / n
            try:
                st = os.lstat(p)
            except OSError:
                continue
            legacy_fresh = not tag and time.time() - st.st_mtime < LEGACY_TEMP_AGE_S
            if not stat.S_ISREG(st.st_mode) or legacy_fresh or pid_alive(int(pid)):
                continue
            p.unlink(missing_ok=True)
            removed.append(p)
            break
    return removed


#: the header lines of ``predict``'s scores CSV (unlabelled, labelled input)
SCORES_HEADERS = (b"row,score\n", b"row,label,score\n")


def is_scores_csv(path: str | os.PathLike) -> bool:
    """``path`` (a regular file) starts as a scores CSV ``dlrmctl predict`` writes."""
    try:
        with open(path, "rb") as f:
            return f.read(32).startswith(SCORES_HEADERS)
    except OSError:
        return False


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _not_ours(path: Path, kind: str, recognise: Callable[[Path], bool]) -> str | None:
    """Why the existing ``path`` is not a ``kind`` file dlrmctl wrote (None when it is)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        what = ("a directory" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
        return f"is {what}"
    holder = kind_of(path.parent)
    if holder is not None:
        return f"is inside a dlrmctl {holder} ({path.parent})"
    if not recognise(path):
        return f"is not a {kind} dlrmctl wrote (its content differs)"
    return None


def check_file_replaceable(path: str | os.PathLike, kind: str, recognise: Callable[[Path], bool], *,
                           force: bool, option: str, inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Raise unless a new ``kind`` file (a scores CSV, a plan, a report, ...) may be written at ``path``.

    An absent ``path`` may be written.  An existing one is replaced only with ``force`` and only
    when it is a regular file (not a symbolic link, a device such as ``/dev/null``, a FIFO or a
    directory), not inside a dlrmctl run / dataset / export, and ``recognise`` (given the regular
    file's path; it reads a bounded head) says dlrmctl wrote it.  Never one of ``inputs`` (the command's own input files).

    Args:
        path: the output file asked for.
        kind: what the command writes, for the messages (``"scores CSV"``).
        recognise: True when the file is a ``kind`` file dlrmctl wrote.
        force: the command's ``--force``.
        option: the option naming ``path`` (``"--output"``), for the messages.
        inputs: the files the command reads (None entries are skipped).

    Raises:
        OutputError: one line naming ``path``, why it is not replaced, and the remedy.
    """
    p = Path(path)
    for i in inputs:
        if i is not None and os.path.lexists(p) and _same_file(p, i):
            raise OutputError(f"{option} {p}: is an input of this command ({i}); {option} another file")
    if not os.path.lexists(p):
        return
    why = _not_ours(p, kind, recognise)
    if why is not None:
        raise OutputError(f"{option} {p}: exists and {why}; --force replaces only a {kind} dlrmctl wrote: "
                          f"{option} another file")
    if not force:
        raise OutputError(f"{option} {p}: exists; pass --force to replace it (a {kind} dlrmctl wrote), "
                          f"or {option} another file")


@contextlib.contextmanager
def atomic_file(out: str | os.PathLike, mode: str = "w", recheck: Callable[[], None] | None = None,
                **open_kw: Any) -> Iterator[IO]:
    """Open a temporary sibling of ``out`` (:func:`temp_file`) for writing; when the block ends
    without an exception it is closed and renamed to ``out`` (``recheck`` first, e.g.
    :func:`check_file_replaceable` again), else removed.  Stale temporaries of killed runs are
    reclaimed first (:func:`reclaim_stale_files`); the parent directory is created.

    Raises:
        OSError: the temporary cannot be created or written (its ``filename`` names it).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reclaim_stale_files(out)
    tmp = temp_file(out)
    f = open(tmp, mode, **open_kw)
    try:
        yield f
        f.close()
        if recheck is not None:
            recheck()
        os.replace(tmp, out)
    except BaseException as e:
        f.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a write to a full disk names no file: name the output
            e.filename = str(out)
        raise
