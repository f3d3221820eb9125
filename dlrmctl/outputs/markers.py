"""The ``.dlrmctl`` ownership marker of the output directories dlrmctl owns, how an unmarked
directory of an older dlrmctl is recognised (:func:`kind_of`), and the refusal to replace or adopt
a directory that is not ours (:func:`check_replaceable`, :func:`check_adoptable`).  Part of
:mod:`dlrmctl.outputs`, which re-exports every public name."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from dlrmctl.errors import OutputError
from dlrmctl.fileio import write_text_atomic
from dlrmctl.train.checkpoint_names import CKPT_DIR


MARKER_NAME = ".dlrmctl"
MARKER_VERSION = 1
KINDS = ("dataset", "run", "export", "sweep")
#: a temporary without a marker (made by a dlrmctl older than the marker) is reclaimed only when untouched this long
LEGACY_TEMP_AGE_S = 3600.0


def write_marker(directory: str | os.PathLike, kind: str, **extra: Any) -> None:
    """Write ``directory/.dlrmctl`` (atomically): ``{"kind", "version", "created", **extra}``.

    Raises:
        ValueError: unknown ``kind``.
        OSError: the directory cannot be written.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r} (one of {KINDS})")
    rec = {"kind": kind, "version": MARKER_VERSION,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
    write_text_atomic(Path(directory) / MARKER_NAME, json.dumps(rec, indent=1, sort_keys=True, default=str) + "\n")


def read_marker(directory: str | os.PathLike) -> dict | None:
    """The marker of ``directory`` as a dict, or None (no marker, unreadable, or not ours)."""
    try:
        rec = json.loads((Path(directory) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("kind") in KINDS else None


def _json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def kind_of(directory: str | os.PathLike) -> str | None:
    """What dlrmctl output ``directory`` is (``"dataset"``, ``"run"``, ``"export"``, ``"sweep"``),
    from its marker or, for outputs of an older dlrmctl, from the files only dlrmctl writes; None
    when it is not ours (or does not exist)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    rec = read_marker(d)
    if rec is not None:
        return rec["kind"]
    m = _json(d / "manifest.json")
    if m is not None and "format_version" in m and "model_file" in m:
        return "export"
    m = _json(d / "meta.json")
    if m is not None and "format_version" in m and "splits" in m and "dataset" in m:
        return "dataset"
    if (d / "parts").is_dir() and set(os.listdir(d)) <= {"parts", "vocab", ".counts", ".decoded", "meta.json"}:
        return "dataset"  # an unfinished criteo preprocess of an older dlrmctl
    if (d / "config.yaml").is_file() and ((d / CKPT_DIR).is_dir() or (d / ".dlrmctl_attempt").exists()
                                          or (d / "summary.json").is_file()):
        return "run"
    if (d / "sweep.csv").is_file() and (d / "logs").is_dir():
        try:  # the header `dlrmctl sweep` writes, not any table called sweep.csv
            with open(d / "sweep.csv", encoding="utf-8", errors="replace") as f:
                if f.read(11) == "rank,point,":
                    return "sweep"
        except OSError:
            pass
    return None


def _protected(path: Path) -> str | None:
    """Why ``path`` may never be replaced (None when it may)."""
    p = os.path.realpath(path)
    if p == os.path.realpath(os.sep):
        return "it is the root directory"
    if p == os.path.realpath(os.path.expanduser("~")):
        return "it is the home directory"
    cwd = os.path.realpath(os.getcwd())
    if p == cwd:
        return "it is the working directory"
    if cwd.startswith(p.rstrip(os.sep) + os.sep):
        return "it holds the working directory"
    return None


def check_replaceable(path: str | os.PathLike, kind: str, what: str, remedy: str) -> None:
    """Raise unless ``path`` (existing) may be replaced by a new ``kind`` output.

    Args:
        path: the existing directory (or file) to be replaced.
        kind: the kind of output replacing it (:data:`KINDS`).
        what: the option that asked for it, for the message (``"--force"``).
        remedy: what the user can do instead, ending the message (``"--out another directory"``).

    Raises:
        OutputError: ``path`` is the working directory or holds it, ``/``, the home directory, not
            a directory, or not a dlrmctl output of ``kind``.
    """
    p = Path(path)
    why = _protected(p)
    if why is None:
        if not p.is_dir() or p.is_symlink():
            why = "it is not a directory dlrmctl made"
        else:
            k = kind_of(p)
            if k is None:
                why = f"it is not a dlrmctl {kind}: {not_ours(p)}, and {what} replaces only what dlrmctl made"
            elif k != kind:
                why = f"it is a dlrmctl {k}, not a {kind}"
            else:
                foreign = foreign_entries(p)
                if foreign:
                    why = (f"it holds {', '.join(foreign[:3])}{' and more' if len(foreign) > 3 else ''}, "
                           f"which dlrmctl did not write (move them out first)")
    if why is not None:
        raise OutputError(f"{p}: refusing to replace it ({what}): {why}; {remedy}")


def not_ours(directory: str | os.PathLike) -> str:
    """What a directory dlrmctl did not make holds, for a refusal: ``"it holds a.txt, meta.json (not
    a meta.json dlrmctl wrote) and 3 more, which dlrmctl did not write (no .dlrmctl marker)"``."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    if not names:
        return "it is empty"
    shown = [n + (" (not a meta.json dlrmctl wrote)" if n == "meta.json" else "") for n in names[:3]]
    if "meta.json" in names[3:]:
        shown.append("meta.json (not a meta.json dlrmctl wrote)")
    more = len(names) - len(shown)
    return (f"it holds {', '.join(shown)}{f' and {more} more' if more > 0 else ''}, which dlrmctl did not write "
            f"(no {MARKER_NAME} marker)")


def foreign_entries(directory: str | os.PathLike) -> list[str]:
    """The names in ``directory`` that its dlrmctl build did not write (the ``entries`` its marker
    recorded when it was finished, :func:`finish_marker`); [] when the marker recorded none (an
    output of an older dlrmctl, or a run, whose ``--overwrite`` keeps such files)."""
    rec = read_marker(directory) or {}
    known = rec.get("entries")
    if not isinstance(known, list):
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(set(names) - set(known) - {MARKER_NAME})


def check_adoptable(directory: str | os.PathLike, kind: str, remedy: str) -> None:
    """Raise unless a ``kind`` output may be written into ``directory``: absent, empty, or a dlrmctl
    ``kind`` output already (a sweep run again), and not the working directory, one above it, ``/``
    or the home directory.

    Raises:
        OutputError: naming the directory, what it is, and ``remedy``.
    """
    d = Path(directory)
    why = _protected(d)
    if why is None and os.path.lexists(d):
        if not d.is_dir() or d.is_symlink():
            why = "it is not a directory"
        elif any(d.iterdir()):
            k = kind_of(d)
            if k is None:
                why = not_ours(d)
            elif k != kind:
                why = f"it is a dlrmctl {k}, not a {kind}"
    if why is not None:
        raise OutputError(f"{d}: refusing to write a {kind} there: {why}; {remedy}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
