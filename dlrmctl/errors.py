"""The errors a user can cause, and how the command line reports them (no torch imported here).

Every error that is the user's input or the user's environment subclasses :class:`UserError`
(``ConfigError``, ``PlanError``, ``CheckpointError``, ``TrainError``, ``DataError``,
``DataMismatchError``, ``EmbeddingIdError``, ``RunInUseError``, ``OutputError``, ``FanoutError``,
``ExportError``, ``QuantizationError``, ``ServeError``, ``FbgemmTorchMismatchError``,
``LaunchError``, and :class:`CommandError`, a command's own refusal raised by
``dlrmctl.commands._common.fail``); each keeps its other base (``ValueError``, ``RuntimeError``,
...) so ``except ValueError`` callers keep working.  ``dlrmctl/cli.py`` catches them once
(``report_failure``) and prints one ``error: ...`` line (exit :data:`EXIT_USER`, or a
:class:`CommandError`'s ``exit_code``); nothing else prints ``error:``, except a rank of a
multi-process run, which reports its own failure to the launcher (``dlrmctl.train.worker``).
``SparseInputError`` (an inconsistent KeyedJaggedTensor built by code) and
``LocalRanksError`` (a spawned rank failed: the caller says what it was doing, e.g. a reshard's
``CheckpointError``) are not user errors.  A :class:`ProcessFailure` (a helper process the command
started was killed or stopped, e.g. a loader worker) is not the user's input either, but no bug:
one ``error: ...`` line too, exit :data:`EXIT_FAILED` (what a failed rank of ``--nproc`` gives).

Conditions of the operating system that the user fixes (a full disk, a read-only file system,
a file where a directory is expected, ...) arrive as ``OSError``; :func:`os_error_message` turns
them into the same one line, naming the path and the remedy.  Libraries that wrap them
(``torch.distributed.checkpoint``'s ``CheckpointException``, pyarrow's ``ArrowIOError``) keep
the original in ``__cause__`` / ``__context__`` or in a ``failures`` dict:
:func:`find_in_chain` walks all of them.

A Ctrl-C (``KeyboardInterrupt``) or, inside :func:`interruptible`,
a SIGTERM (:class:`Interrupted`) ends the command with one ``interrupted ...`` line and
exit code 128 + the signal's number (:data:`EXIT_INTERRUPTED` = 130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from typing import Any, Callable, Iterator

#: exit code of a user error (also of a mapped OSError)
EXIT_USER = 2
#: exit code of a helper process's failure (:class:`ProcessFailure`), as of a failed rank
EXIT_FAILED = 1
#: exit code of a Ctrl-C (128 + SIGINT); a SIGTERM exits 143 (128 + SIGTERM)
EXIT_INTERRUPTED = 128 + signal.SIGINT


class UserError(Exception):
    """An error the user can fix: its message is one line naming the file / key / feature, what
    was expected, and the remedy.  Reported as ``error: <message>``, exit code 2, no traceback."""

    #: the exit code the command line ends with
    exit_code: int = EXIT_USER


class CommandError(UserError):
    """A command's own refusal (an option out of range, an input that is not there, points of a
    sweep that failed), with the exit code to end with (2 unless told)."""

    def __init__(self, msg: str, exit_code: int = EXIT_USER) -> None:
        super().__init__(msg)
        self.exit_code = exit_code


class ProcessFailure(RuntimeError):
    """A process the command started and depends on (a loader worker) was killed, exited or was
    stopped: not the user's input and not a bug of the command.  Reported as one ``error: <message>``
    line (the message names the process, its pid and what happened), exit :data:`EXIT_FAILED`."""


class OutputError(RuntimeError, UserError):
    """An output path that must not be replaced (not ours, the working directory, ...) or cannot
    be written (a file where a directory is expected, a read-only or non-writable location); the
    message names the path, the reason and the remedy."""


class Interrupted(KeyboardInterrupt):
    """A SIGINT / SIGTERM turned into an exception by :func:`interruptible` (a ``KeyboardInterrupt``,
    so no ``except Exception`` swallows it and every Ctrl-C path handles it); ``signum`` gives the
    exit code (128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signame(self) -> str:
        """The signal's name, e.g. ``"SIGTERM"``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the signal: 128 + its number (130, 143)."""
        return 128 + self.signum


#: characters of a user's value an error message quotes at most (:func:`quoted`)
QUOTE_LIMIT = 80


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """A value from the user's data (a field, a header, a name in a request) as an error message
    quotes it: ``repr`` of its text (so a line break in it stays ``\\n`` and the message one
    line), cut after ``limit`` characters with ``…`` and the full length, e.g.
    ``'aaaa…' (5,242,880 characters)``: a 5 MB field is not echoed back whole.  Bytes are decoded
    as UTF-8 (undecodable bytes replaced)."""
    text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray, memoryview)) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit] + '…'!r} ({len(text):,} characters)"


def delimiter_hint(line: str, sep: str, fmt: str, schema: str = "the schema") -> str | None:
    """Why a first line ``line`` of a CSV / TSV file (``fmt``, read with the delimiter ``sep``) may
    not split into columns: ``"it looks tab-separated, the schema reads ','-separated CSV"`` when
    another usual delimiter (tab, comma, semicolon, pipe) occurs in it more often than ``sep``;
    else None.  ``schema``: how the message names the schema."""
    other = max(("\t", ",", ";", "|"), key=line.count)
    if line.count(other) <= line.count(sep):
        return None

    def name(d: str) -> str:
        return "tab" if d == "\t" else repr(d)
    return f"it looks {name(other)}-separated, {schema} reads {name(sep)}-separated {fmt.upper()}"


def interrupt_exit_code(e: BaseException) -> int:
    """128 + the signal's number of an interrupt (130 for a plain ``KeyboardInterrupt``)."""
    return 128 + int(getattr(e, "signum", signal.SIGINT))


@contextlib.contextmanager
def interruptible(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
                  keep_ignoring: bool = False) -> Iterator[None]:
    """While inside, each of ``signals`` raises :class:`Interrupted` in the main thread (the path a
    Ctrl-C takes), so a terminated command stops its work, cleans up and reports as an interrupted
    one.  After the first signal further ones are ignored, so the clean-up is not interrupted in
    turn; the previous handlers come back on exit, unless ``keep_ignoring`` (the caller's clean-up
    runs after the block, e.g. cancelling a cluster job, and the process then exits).  No-op off
    the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield
    finally:
        if not (fired and keep_ignoring):
            for s, h in previous.items():
                signal.signal(s, h)


def _children(e: BaseException, implicit: bool = True) -> list[BaseException]:
    """The exceptions ``e`` wraps: ``__cause__``, ``__context__`` (with ``implicit``), and the
    values of a ``failures`` dict (DCP's ``CheckpointException``: rank -> exception or
    (exception, traceback))."""
    out = [x for x in (e.__cause__, e.__context__ if implicit else None) if x is not None]
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for f in failures.values():
            f = f[0] if isinstance(f, tuple) and f else f
            if isinstance(f, BaseException):
                out.append(f)
    out.extend(x for x in getattr(e, "exceptions", ()) or () if isinstance(x, BaseException))  # ExceptionGroup
    return out


def find_in_chain(e: BaseException, match: type | tuple[type, ...] | Callable[[BaseException], bool],
                  implicit: bool = True) -> BaseException | None:
    """The first exception in ``e`` or anything it wraps (breadth first over :func:`_children`;
    ``implicit=False``: not through ``__context__``, only explicit wrapping) that is an instance
    of ``match`` (or for which the predicate ``match`` is true); None if none."""
    pred = match if callable(match) and not isinstance(match, (type, tuple)) else (lambda x: isinstance(x, match))
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if pred(x):
            return x
        todo.extend(_children(x, implicit))
    return None


#: errno -> (the condition in words, the remedy)
OS_CONDITIONS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free space on that file system or write to another one"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or write to another file system"),
    errno.EROFS: ("read-only file system", "write to a writable location"),
    errno.EACCES: ("permission denied", "fix the permissions or write to another location"),
    errno.EPERM: ("operation not permitted", "fix the permissions or write to another location"),
    errno.ENOTDIR: ("a file, expected a directory (or a path under a file)", "remove the file or choose another path"),
    errno.EISDIR: ("a directory, expected a file", "give a file path"),
    errno.EBUSY: ("device or resource busy", "close what uses it and retry"),
    errno.EEXIST: ("already exists", "remove it or choose another path"),
}

#: messages of libraries that raise an OSError without an errno (pyarrow: "IOError: ... No space left on device")
_MESSAGES: tuple[tuple[str, int], ...] = (
    ("no space left on device", errno.ENOSPC),
    ("disk quota exceeded", errno.EDQUOT),
    ("read-only file system", errno.EROFS),
    ("permission denied", errno.EACCES),
    ("not a directory", errno.ENOTDIR),
    ("is a directory", errno.EISDIR),
)


def os_errno(e: BaseException) -> int | None:
    """The errno of an OSError (also of one that lost it, recognised by its message, e.g.
    pyarrow's ``OSError: ... No space left on device``), when it is one of :data:`OS_CONDITIONS`."""
    if not isinstance(e, OSError):
        return None
    if e.errno in OS_CONDITIONS:
        return e.errno
    text = str(e).lower()
    for words, code in _MESSAGES:
        if words in text:
            return code
    return None


def os_error_message(e: BaseException, path: str | os.PathLike | None = None) -> str | None:
    """One line for an OSError that is the user's environment: the path (``e.filename`` /
    ``e.filename2``, else ``path``), the condition in words and the remedy, e.g.
    ``runs/demo/checkpoints: no space left on device; free space on that file system or write to
    another one``.  ``FileNotFoundError`` keeps its own text (``[Errno 2] No such file or
    directory: 'x'``).  None for any other exception (a bug: the caller shows it as it is)."""
    if isinstance(e, FileNotFoundError):
        return str(e)
    code = os_errno(e)
    if code is None:
        return None
    from dlrmctl.console import show_path

    what, remedy = OS_CONDITIONS[code]
    names = [n for n in (getattr(e, "filename", None), getattr(e, "filename2", None)) if n not in (None, "")]
    where = " -> ".join(show_path(os.fsdecode(n)) if isinstance(n, (str, bytes, os.PathLike)) else str(n)
                        for n in names)
    if not where and path is not None:
        where = show_path(path)
    if code in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        what = f"is {what}" if code != errno.EEXIST else what
    return f"{where}: {what}; {remedy}" if where else f"{what}; {remedy}"


#: packages the commands import only where they need them (none is needed to import dlrmctl or train on
#: the dense kernel): top-level module -> how to install it
OPTIONAL_PACKAGES = {
    "torchx": "pip install torchx (a dependency of `pip install dlrmctl`; `launch` and `jobs` run on it)",
    "kubernetes": "pip install -e '.[cluster]'",
    "fastapi": "pip install -e '.[serve]'",
    "uvicorn": "pip install -e '.[serve]'",
    "prometheus_client": "pip install -e '.[serve]'",
    "tritonclient": "pip install -e '.[serve]' (Python 3.11; scripts/bench_serve.py's client)",
    "matplotlib": "pip install -e '.[report]'",
    "sklearn": "pip install -e '.[bench]'",
    "fbgemm_gpu": "pip install -e '.[cpu]' (fbgemm-gpu-cpu) or '.[gpu]' (fbgemm-gpu), or use compute_kernel: dense",
}


def user_error_message(e: BaseException) -> str | None:
    """The one line (without ``error: ``) for a :class:`UserError`, a mapped OSError, a missing
    optional package (:data:`OPTIONAL_PACKAGES`, a ``ModuleNotFoundError`` naming it) or an
    out-of-memory error (``MemoryError``, torch's ``OutOfMemoryError``) that is ``e`` or that ``e``
    explicitly wraps; None when ``e`` is none of them (a bug, shown with its traceback)."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError):
        msg = os_error_message(e)
        if msg is not None:
            return msg
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OPTIONAL_PACKAGES:
        top = (e.name or "").split(".")[0]
        return f"this command needs {top}, which is not installed here: {OPTIONAL_PACKAGES[top]}"
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # numpy's, torch's (CUDA)
        what = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (f"out of memory: {what}; ask for less (rows, table sizes, dimensions, batch size) "
                "or use a machine with more memory")
    # explicit wrapping only (``raise X from e``, DCP's failures): an error raised while handling
    # another one (``__context__``) may be a bug, shown with its traceback
    inner = find_in_chain(e, lambda x: x is not e and (isinstance(x, UserError) or os_errno(x) is not None),
                          implicit=False)
    return None if inner is None else user_error_message(inner)


def interrupted_message(ki: BaseException, command: str | None, out: str | None) -> str:
    """The line of an interrupt a verb did not report itself (it may land anywhere: during the
    imports, in the work, or after the work while the result is printed, so the line claims
    nothing about how far the work got): what stopped and what a re-run does.  Every output is
    written to a temporary path or an unfinished marked directory and put in place / marked
    complete only at its end (``dlrmctl.outputs``), so nothing half-written is taken for done."""
    what = f"`{command}`" if command else "the command"
    where = f" (--out {out})" if out else ""
    return (f"interrupted ({signal.Signals(interrupt_exit_code(ki) - 128).name}): {what}{where} stopped; "
            "an output is put in place or marked complete only when finished, so nothing half-written "
            "is taken for done: run the same command again unless it had printed its result")


def command_of(ctx: Any) -> tuple[str | None, str | None]:
    """``("dlrmctl <verb> [<sub-verb>]", <the --out / -o value or None>)`` of the arguments left
    to the root click group's context ``ctx`` (for :func:`interrupted_message`)."""
    first = getattr(ctx, "_protected_args", None) or ctx.protected_args
    tokens = [*first, *ctx.args]
    words = []
    group = ctx.command
    for t in tokens:
        if t.startswith("-") or not hasattr(group, "commands") or t not in group.commands:
            break
        words.append(t)
        group = group.commands[t]
    return ("dlrmctl " + " ".join(words) if words else None), out_option(tokens)


def out_option(tokens: list[str]) -> str | None:
    """The value of ``--out`` / ``-o`` among a command line's ``tokens`` (the last given), or None."""
    out = None
    for i, t in enumerate(tokens):
        if t in ("--out", "-o") and i + 1 < len(tokens):
            out = tokens[i + 1]
        elif t.startswith("--out="):
            out = t[len("--out="):]
    return out


def is_interrupt(e: BaseException) -> bool:
    """``e`` is, or wraps, a ``KeyboardInterrupt`` (DCP wraps one raised in its writer into a
    ``CheckpointException``)."""
    return find_in_chain(e, KeyboardInterrupt) is not None


def interrupt_of(e: BaseException) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` in ``e`` or what it wraps, or None."""
    x = find_in_chain(e, KeyboardInterrupt)
    return x if isinstance(x, KeyboardInterrupt) else None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes available to this user on the file system holding ``path`` (its nearest existing
    ancestor); None when it cannot be asked."""
    p = os.path.abspath(os.fspath(path))
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """Fail before any work when the output directory ``path`` cannot be written: it is an
    existing file, lies under a file, or its nearest existing ancestor is read-only or not
    writable.  Nothing is created.

    Raises:
        OutputError: naming ``what`` (e.g. ``--out``, ``train.run_dir``), the path, the
            condition and the remedy.
    """
    from dlrmctl.console import show_path

    p = os.path.abspath(os.fspath(path))
    if os.path.exists(p) and not os.path.isdir(p):
        raise OutputError(f"{what} {show_path(p)} is a file, expected a directory; remove it or choose "
                              "another path")
    q = p
    while not os.path.exists(q):
        parent = os.path.dirname(q)
        if parent == q:
            break
        q = parent
    if not os.path.isdir(q):
        raise OutputError(f"{what} {show_path(p)} lies under the file {show_path(q)}, expected a directory; "
                              "choose another path")
    try:
        ro = bool(os.statvfs(q).f_flag & os.ST_RDONLY)
    except OSError:
        ro = False
    if ro:
        raise OutputError(f"{what} {show_path(p)}: {show_path(q)} is on a read-only file system; write to a "
                              "writable location")
    if not os.access(q, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {show_path(p)}: {show_path(q)} is not writable (permission denied); fix "
                              "its permissions or choose another path")


#: the former name of :class:`OutputError` (one class)
OutputPathError = OutputError
