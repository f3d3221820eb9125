"""The parts of a dataset being preprocessed: one ``parts/<part>/`` directory per input file.

A part is built in ``parts/<part>.tmp`` (one :class:`~dlrmctl.data.columnar.writer.ShardWriter`
per split) and renamed into place with its ``done.json`` (the part's statistics and the
fingerprint of what made it) only when complete (:class:`PartBuild`), so a crash or a Ctrl-C
leaves no half-written part that could be taken for a finished one.  A re-run skips a part whose
``done.json`` carries the fingerprint it would write (:func:`finished_part`: resume).  Used by
``preprocess criteo`` and ``preprocess logs``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from dlrmctl.data.columnar.format import FORMAT_VERSION, LABEL_COLUMN, SPLITS, write_json_atomic
from dlrmctl.data.columnar.writer import ShardWriter

__all__ = ["DONE_FILE", "PartBuild", "file_identity", "finished_part", "fingerprint", "part_fingerprint", "parts_meta",
           "split_rows"]

#: a finished part's statistics and fingerprint, ``parts/<part>/done.json``
DONE_FILE = "done.json"


def fingerprint(obj: Any) -> str:
    """16 hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys; a value JSON cannot
    write is written as its ``str``): what a resumed preprocess compares to reuse an output."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_identity(path: Path) -> dict:
    """What identifies an input file's version in a fingerprint: ``{"name", "size" (bytes),
    "mtime_ns"}``.

    Raises:
        OSError: ``path`` cannot be stat'ed.
    """
    st = path.stat()
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def part_fingerprint(path: Path, fields: Mapping[str, Any]) -> str:
    """The :func:`fingerprint` of a pass's output made from the input file ``path``: the columnar
    ``format_version``, the file's :func:`file_identity` and ``fields`` (the options and whatever
    else the output depends on).

    Raises:
        OSError: ``path`` cannot be stat'ed.
    """
    return fingerprint({"format_version": FORMAT_VERSION, **file_identity(path), **fields})


def finished_part(out_dir: str | os.PathLike, part: str, fp: str) -> dict | None:
    """The statistics (``done.json``) of ``parts/<part>`` under ``out_dir`` when that part is
    complete and was made with fingerprint ``fp``; None when it is missing, unreadable JSON or made
    otherwise (then it is built again)."""
    done = Path(out_dir) / "parts" / part / DONE_FILE
    if not done.is_file():
        return None
    try:
        st = json.loads(done.read_text())
    except json.JSONDecodeError:
        return None
    return st if isinstance(st, dict) and st.get("fingerprint") == fp else None


class PartBuild:
    """Build ``parts/<part>`` of ``out_dir``: a context manager whose :attr:`writers` (split name ->
    :class:`~dlrmctl.data.columnar.writer.ShardWriter` of ``schema``) write into
    ``parts/<part>.tmp``; :meth:`commit` closes them, writes ``done.json`` and renames the directory
    into place (replacing an older part).  Leaving the block by an exception (a Ctrl-C included)
    before :meth:`commit` removes the temp directory and its files.

    Args:
        out_dir: the dataset directory.
        part: the part's name (its input file's name).
        schema: the shards' schema (:func:`~dlrmctl.data.columnar.format.shard_schema`).
    """

    def __init__(self, out_dir: str | os.PathLike, part: str, schema: pa.Schema) -> None:
        parts = Path(out_dir) / "parts"
        self.final, self.tmp, self.schema = parts / part, parts / (part + ".tmp"), schema
        self.writers: dict[str, ShardWriter] = {}

    def __enter__(self) -> PartBuild:
        try:
            self.restart()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self

    def restart(self) -> None:
        """Drop what was written so far and start the part's shards again (empty)."""
        self._abort_writers()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.writers = {s: ShardWriter(self.tmp / f"{s}.arrow", self.schema) for s in SPLITS}

    def commit(self, stats: dict) -> None:
        """Close the shards, write ``stats`` as ``done.json`` and move the part into place.

        Raises:
            DataError: the file system refused a write (named with the path).
            OSError: the rename failed.
        """
        for w in self.writers.values():
            w.close()
        write_json_atomic(self.tmp / DONE_FILE, stats)
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.tmp, self.final)
        self.writers = {}

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None or self.writers:  # left before commit: nothing of it stays
            self._abort_writers()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _abort_writers(self) -> None:
        for w in self.writers.values():
            try:
                w.abort()
            except Exception:  # noqa: BLE001 - the error that ended the part is the one to report
                pass
        self.writers = {}


def split_rows(files: Sequence[Path], stats: Mapping[Path, dict], key: str = "rows") -> dict[str, int]:
    """``{split: total}`` of the parts of ``files``: their ``done.json`` (``stats``, by input file)
    counts ``key`` per split (``rows``, or ``positives``: rows labelled 1)."""
    return {s: sum(stats[f][key][s] for f in files) for s in SPLITS}


def parts_meta(files: Sequence[Path], stats: Mapping[Path, dict], labelled: bool, head: Mapping[str, Any],
               tail: Mapping[str, Any]) -> dict:
    """``meta.json`` of a dataset built as one part per input file, in this order: ``format_version``;
    ``head`` (``dataset``, the features); what the parts' ``done.json`` (``stats``, by input file)
    add up to: ``label``, ``splits`` (rows and the shard files ``parts/<part>/<split>.arrow``),
    ``ctr`` (positives / rows, None without a label or rows); ``tail`` (``transforms``,
    ``vocab_files``); ``inputs`` (the files) and ``bad_lines_skipped``.  Formats:
    :mod:`dlrmctl.data.columnar.format`."""
    rows, pos = split_rows(files, stats), split_rows(files, stats, "positives")
    return {
        "format_version": FORMAT_VERSION,
        **head,
        "label": LABEL_COLUMN if labelled else None,
        "splits": {s: {"rows": rows[s], "files": [f"parts/{f.name}/{s}.arrow" for f in files]} for s in SPLITS},
        "ctr": {s: (pos[s] / rows[s] if rows[s] and labelled else None) for s in SPLITS},
        **tail,
        "inputs": [str(f) for f in files],
        "bad_lines_skipped": sum(stats[f]["bad_lines"] for f in files),
    }
