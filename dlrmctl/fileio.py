"""Small output files written so that a reader finds the old file or the new one, never half of one.

One helper for every such write (run summaries, checkpoint markers and meta.json, sweep tables,
topology files, preprocess metadata); no heavy imports, so planner and CLI modules can use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
