"""Small output files written so that a reader finds the old file or the new one, never half of one.

One helper for every such write (run summaries, checkpoint markers and meta.json, sweep tables,
topology files, preprocess metadata); no heavy imports, so planner and CLI modules can use it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

#: the longest file name most file systems take (``NAME_MAX``), when ``pathconf`` cannot say
_NAME_MAX = 255


def name_max(directory: str | os.PathLike) -> int:
    """The longest file name ``directory``'s file system takes (``NAME_MAX``; 255 when unknown)."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return _NAME_MAX


def temp_prefix(path: str | os.PathLike, tag: str, room: int) -> str:
    """``.<name>.<tag>-``: the start of a hidden temporary sibling of ``path``, with ``room``
    characters left for what follows it within the file system's ``NAME_MAX`` (a legal name of
    250 characters gets a temporary whose name fits too: the name is shortened and made unique
    with 8 hex digits of its SHA-256)."""
    path = Path(path)
    limit = name_max(path.parent if str(path.parent) else ".")
    full = f".{path.name}.{tag}-"
    if len(full.encode()) + room <= limit:
        return full
    digest = hashlib.sha256(path.name.encode()).hexdigest()[:8]
    keep = limit - room - len(f"..{tag}-~{digest}")
    name = path.name.encode()[:max(keep, 0)].decode("utf-8", "ignore")
    return f".{name}~{digest}.{tag}-"


def default_file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open(..., "w")`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, flushed to disk
    (``fsync``) and renamed over ``path``: an existing file is replaced whole or left as it was.
    The directory is created when missing; the file gets :func:`default_file_mode`.

    Raises:
        OSError: the directory cannot be created or written (the temporary file is removed; the
            error's ``filename`` is ``path`` when the failing call named none, e.g. a write to a full disk).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "w", 12), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())  # mkstemp makes 0600; readable like any other output file
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a failed write (full disk) names no file: name ours
            e.filename = str(path)
        raise
