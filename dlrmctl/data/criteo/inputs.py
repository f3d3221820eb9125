"""Criteo's input files: ``--input`` resolved to files (``day_N`` in day order, no file twice),
plain / ``.gz`` / ``.bz2`` opened by suffix, a paced Arrow input that reads nothing ahead (memory
independent of a file's size), and the error of a file that cannot be decoded.
:mod:`dlrmctl.data.criteo.parse` re-exports every public name."""

from __future__ import annotations

import bz2
import glob
import gzip
import os
import re
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa

from dlrmctl.data.columnar import DataError
from dlrmctl.data.long_lines import FullReads, LineLimit


#: a file of the Criteo 1TB log, ``day_N`` (with any suffixes: ``day_0.gz``); group 1 is ``N``
DAY_RE = re.compile(r"^day_(\d+)(?:\.[A-Za-z0-9]+)*$")


def expand_inputs(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve ``--input``: a file, a directory (all non-hidden regular files in it), or a glob.

    Returns:
        Sorted list of files (``day_N`` files sorted by N).

    Raises:
        DataError: nothing matches, two inputs share a base name (their outputs would collide), or
            two names (links) of one file are listed (its rows would be read twice).  One path spelled
            several ways (relative, absolute) counts once.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    files: list[Path] = []
    for s in specs:
        p = Path(s)
        if p.is_dir():
            files += [f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")]
        elif p.is_file():
            files.append(p)
        else:
            matched = [Path(m) for m in glob.glob(str(s)) if Path(m).is_file()]
            if not matched:
                raise DataError("no such file, directory or glob match", path=s)
            files += matched

    def key(f: Path):
        m = DAY_RE.match(f.name)
        return (0, int(m.group(1)), f.name) if m else (1, 0, f.name)

    # one file spelled several ways (relative / absolute / with ..) is one input; symlinks keep their
    # own name (a day_N link into a store of other names), so paths are made absolute, not resolved
    files = sorted({Path(os.path.abspath(f)) for f in files}, key=key)
    if not files:
        raise DataError("no input files found", path=str(spec))
    seen: dict[tuple[int, int], Path] = {}
    for f in files:
        st = f.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), f)
        if first != f:  # a link or a second name of a file already listed: its rows would count twice
            raise DataError(f"{first} and {f} are the same file (a link or another name); "
                            "its rows would be read twice: list it once", path=str(spec))
    names = [f.name for f in files]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DataError(f"several inputs share the base name(s) {sorted(dup)}; outputs are keyed by "
                        "base name, rename them", path=str(spec))
    return files


def open_text(path: Path):
    """Open a plain, ``.gz`` or ``.bz2`` file for binary reading (by its name's suffix)."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


class _Paced(FullReads):
    """A readable file that hands Arrow's CSV / JSON readers exactly the bytes they ask for, when
    they ask.  Given a path, those readers read ahead on their I/O thread as fast as the disk
    allows: a file read faster than it is transformed ended up in memory whole (peak RSS grew with
    the file's size).  Through this synchronous reader nothing is read ahead.

    Each call fills the whole request (one CSV block, ``ReadOptions.block_size``) unless the input
    ends: a short read would make Arrow cut a smaller block, and the shards' record batches (which
    the loader's shuffle sees) would then depend on how the input was read."""

    def __init__(self, f) -> None:
        self._f = f

    def read_some(self, k: int) -> bytes:
        return self._f.read(k)

    def close(self) -> None:
        self._f.close()
        super().close()


def paced_input(path: str | os.PathLike, block_size: int | None = None,
                long_line: "Callable[[int], bytes] | None" = None) -> pa.NativeFile:
    """A text input for Arrow's CSV / JSON readers (decompressed by its name's suffix: ``.gz``,
    ``.bz2``, ``.zst``, ``.lz4``), read one block at a time as the parser asks (:class:`_Paced`):
    memory does not grow with the file's size, and the blocks are those of reading the path.

    Given the reader's ``block_size`` and ``long_line``, a line of ``block_size`` bytes or more
    (one Arrow cannot hold in a block) reaches the reader as ``long_line(line_number)``
    (:class:`dlrmctl.data.long_lines.LineLimit`)."""
    def open_input():
        return pa.input_stream(os.fspath(path), compression="detect")

    if block_size is not None and long_line is not None:
        return pa.PythonFile(LineLimit(open_input, block_size, long_line), mode="r")
    return pa.PythonFile(_Paced(open_input()), mode="r")


def decode_error(path: Path, e: BaseException) -> "DataError":
    """A file that cannot be decoded (a truncated ``.gz``, a plain file named ``.gz``: an OSError
    without an errno, EOFError) as the DataError naming it; an OS condition (errno) is re-raised."""
    if isinstance(e, OSError) and e.errno is not None:
        raise e
    kind = "gzip" if str(path).endswith(".gz") else "bz2" if str(path).endswith(".bz2") else "text"
    return DataError(f"cannot be read as a {kind} file ({e}); is it complete and of the kind its name says?",
                     path=path)


def num_fields(path: Path) -> int | None:
    """Field count of the first line (None for an empty file).

    Raises:
        DataError: the file cannot be decoded (:func:`decode_error`)."""
    try:
        with open_text(path) as f:
            first = f.readline()
    except (OSError, EOFError) as e:
        raise decode_error(path, e) from None
    if not first:
        return None
    return first.rstrip(b"\r\n").count(b"\t") + 1


def count_lines(path: Path) -> int:
    """Number of lines (a last line without a newline counts)."""
    n = 0
    last = b"\n"
    with open_text(path) as f:
        while True:
            b = f.read(16 << 20)
            if not b:
                break
            n += b.count(b"\n")
            last = b[-1:]
    return n + (last != b"\n")
