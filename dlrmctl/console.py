"""What dlrmctl prints while it works: messages, progress bars, periodic progress lines.

One place decides how output reaches the user (no torch here: the CLI imports it
for ``--help`` and configuration errors):

* :func:`echo` prints a message.  While a progress bar is open on the terminal the
  message goes *above* the bar (``tqdm.write``), never into the middle of it.
  Logging records (:func:`setup_logging`) take the same route.
* :func:`stage` names a long step of a verb that has no units to count (tracing, compiling) as
  one line with the seconds since the verb began, ``[export] 3.1 s tracing the program``, while
  :func:`stages` is on (a command turns it on; library calls print nothing).
* :class:`Progress` is a bar on a terminal (tqdm, on stderr) and, without a
  terminal (a log file, a pipe, the ranks of ``--nproc`` runs), one line on
  stdout every ``every_s`` seconds (``train.progress_every_s``) plus a last line
  when the work is done.  Those lines go to stdout like every other message, so
  the order in which they are read is the order in which they were printed.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from typing import Any, Iterator, TextIO

#: tqdm bars open right now (messages must be written above them)
_BARS: list[Any] = []


def echo(msg: str, err: bool = False) -> None:
    """Print one message (stdout, or stderr with ``err``), above any open progress bar."""
    stream = sys.stderr if err else sys.stdout
    if _BARS:
        from tqdm import tqdm

        tqdm.write(msg, file=stream)
        stream.flush()
    else:
        print(msg, file=stream, flush=True)


#: the verb whose stage lines are on and when it began (:func:`stages`)
_STAGES: contextvars.ContextVar[tuple[str, float] | None] = contextvars.ContextVar("dlrmctl_stages", default=None)


@contextlib.contextmanager
def stages(verb: str) -> Iterator[None]:
    """Turn on :func:`stage` lines for ``verb`` (``"export"``) while the block runs; the seconds
    they show are counted from here."""
    token = _STAGES.set((verb, time.monotonic()))
    try:
        yield
    finally:
        _STAGES.reset(token)


def stage(what: str) -> None:
    """Announce a step as it begins: ``[<verb>] <seconds since the verb began> s <what>`` on stdout
    (:func:`echo`), so a step that takes minutes is never silent; nothing unless :func:`stages` is on."""
    cur = _STAGES.get()
    if cur is not None:
        echo(f"[{cur[0]}] {time.monotonic() - cur[1]:.1f} s {what}")


class ConsoleHandler(logging.Handler):
    """Logging handler writing through :func:`echo` (stderr), so log lines do not break a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            echo(self.format(record), err=True)
        except Exception:  # pragma: no cover - logging's own convention
            self.handleError(record)


def show_path(path: "str | os.PathLike") -> str:
    """How dlrmctl prints a path: relative to the working directory when it is below it, else absolute."""
    p = os.path.abspath(os.fspath(path))
    rel = os.path.relpath(p)
    return p if rel == ".." or rel.startswith(".." + os.sep) else rel


def setup_logging(verbose: bool = False) -> None:
    """Logging for the CLI and the training ranks: ``LEVEL name: message`` on stderr via :func:`echo`.

    dlrmctl's own loggers log from INFO (DEBUG with ``verbose``); every other library only
    its warnings (FBGEMM logs every library it loads and every TBE it builds at INFO)."""
    root = logging.getLogger()
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        h = ConsoleHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        for old in [h for h in root.handlers if type(h) is logging.StreamHandler]:
            root.removeHandler(old)
        root.addHandler(h)
    root.setLevel(logging.WARNING)
    logging.getLogger("dlrmctl").setLevel(logging.DEBUG if verbose else logging.INFO)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def is_terminal(stream: TextIO | None = None) -> bool:
    """``stream`` (default stderr, where bars go) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress of ``total`` units of work (steps, batches, rows).

    Args:
        total: units expected (None: unknown, no percentage / ETA).
        desc: what is progressing, e.g. ``"epoch 1/3"`` or ``"eval val"``.
        unit: ``"step"``, ``"batch"``, ``"row"`` ...
        enabled: False: prints nothing.
        every_s: seconds between two lines without a terminal (0: only the last line).
        initial: units already done (a resumed epoch).
        final_line: without a terminal, print a last line on :meth:`close` (when anything was done).
        bar: None: a bar exactly when stderr is a terminal and tqdm is installed; True / False force it.
        leave: keep the finished bar on screen.
    """

    def __init__(self, total: int | None, desc: str, unit: str = "step", enabled: bool = True,
                 every_s: float = 10.0, initial: int = 0, final_line: bool = True, bar: bool | None = None,
                 leave: bool = True) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.enabled = enabled
        self.every_s = every_s
        self.n = initial
        self._initial = initial
        self.final_line = final_line
        self.fields: dict[str, str] = {}
        self._t0 = time.perf_counter()
        self._last = self._t0
        self._closed = False
        self.bar: Any = None
        self.lines = 0
        if not enabled:
            return
        want_bar = is_terminal() if bar is None else bar
        if want_bar:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                                file=sys.stderr, mininterval=0.5, leave=leave)
                _BARS.append(self.bar)

    def update(self, n: int = 1, **fields: str) -> None:
        """``n`` more units done; ``fields``: name -> text shown after the count (e.g. ``loss="0.51 @ step 50"``)."""
        if not self.enabled or self._closed:
            return
        self.n += n
        self.fields.update({k: v for k, v in fields.items() if v is not None})
        if self.bar is not None:
            self.bar.update(n)
            if fields:
                self.bar.set_postfix_str(self._postfix(), refresh=False)
            return
        now = time.perf_counter()
        if self.every_s > 0 and now - self._last >= self.every_s:
            self._last = now
            self._line()

    def _postfix(self) -> str:
        return "  ".join(f"{v} {k}" if k == "samples/s" else f"{k} {v}" for k, v in self.fields.items())

    def line(self) -> str:
        """The text of a progress line: ``desc: unit n/total (p%)  fields  elapsed, ~left``."""
        elapsed = time.perf_counter() - self._t0
        done = self.n - self._initial
        count = f"{self.unit} {self.n:,}" + (f"/{self.total:,}" if self.total else "")
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and done > 0 and self.n < self.total:
            eta = f", ~{_duration(elapsed / done * (self.total - self.n))} left"
        fields = self._postfix()
        return f"{self.desc}: {count}{pct}" + (f"  {fields}" if fields else "") + f"  {_duration(elapsed)} elapsed{eta}"

    def _line(self) -> None:
        self.lines += 1
        echo(self.line())

    def close(self) -> None:
        """Finish: close the bar, or print the last line (without a terminal, when asked and anything was done)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.bar is not None:
            if self.fields:
                self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.close()
            if self.bar in _BARS:
                _BARS.remove(self.bar)
            return
        if self.final_line and self.n > self._initial:
            self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
