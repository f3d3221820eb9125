"""Replace-by-swap of an output directory: a complete replacement built in a marked sibling
temporary (:func:`make_temp_dir`), swapped in by :func:`swap_in`, a killed run's temporaries
reclaimed (:func:`reclaim_stale`); a dataset's build target (:func:`dataset_target`); the run
``train --overwrite`` sets aside.  Part of :mod:`dlrmctl.outputs`, which re-exports every public
name."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from dlrmctl.errors import OutputError
from dlrmctl.fileio import temp_prefix
from dlrmctl.outputs.markers import (
    LEGACY_TEMP_AGE_S,
    MARKER_NAME,
    check_replaceable,
    kind_of,
    not_ours,
    pid_alive,
    read_marker,
    write_marker,
)


def make_temp_dir(out: str | os.PathLike, kind: str, tag: str = "tmp") -> Path:
    """A new sibling ``.<name>.<tag>-XXXX`` of ``out`` (its parent created), with the mode of a
    plain ``mkdir`` and a marker naming this process (``temp: true``, ``pid``, ``host``), so that
    :func:`reclaim_stale` can tell a killed run's leftovers from a live one's.

    Raises:
        OSError: the parent cannot be created or written (ENOSPC, EROFS, EACCES, ...).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out, tag, 8), dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # like mkdir (0755 under umask 022), not mkdtemp's 0700
        write_marker(tmp, kind, temp=True, pid=os.getpid(), host=socket.gethostname())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def finish_marker(directory: str | os.PathLike, kind: str, **extra: Any) -> None:
    """Turn a temporary's marker into the final one (drops ``temp``/``pid``/``host``), recording
    the ``entries`` the build wrote: ``--force`` later refuses to delete anything else found there
    (:func:`foreign_entries`)."""
    entries = sorted(set(os.listdir(directory)) - {MARKER_NAME})
    write_marker(directory, kind, entries=entries, **extra)


def reclaim_stale(out: str | os.PathLike) -> list[Path]:
    """Remove the leftover temporaries of ``out`` (``.<name>.tmp-*`` / ``.<name>.old-*``) of killed
    runs: ours (marked ``temp`` by a process of this host that is gone) or, without a marker (an
    older dlrmctl), untouched for :data:`LEGACY_TEMP_AGE_S` seconds and holding only what an export
    writes.  A temporary of a live process, of another host, or of unknown origin stays.

    Returns:
        The directories removed.
    """
    out = Path(out)
    removed: list[Path] = []
    try:
        names = os.listdir(out.parent)
    except OSError:
        return removed
    host = socket.gethostname()
    prefixes = (f".{out.name}.tmp-", f".{out.name}.old-", temp_prefix(out, "tmp", 8), temp_prefix(out, "old", 8))
    for n in names:
        if not n.startswith(prefixes):
            continue
        p = out.parent / n
        if not p.is_dir() or p.is_symlink():
            continue
        rec = read_marker(p)
        if rec is not None:
            if not rec.get("temp") or rec.get("host") != host or not isinstance(rec.get("pid"), int):
                continue
            if pid_alive(rec["pid"]):
                continue
        else:
            try:
                entries = set(os.listdir(p))
                age = time.time() - p.stat().st_mtime
            except OSError:
                continue
            if not entries <= {"vocab", "model.pt", "manifest.json", "x"} or age < LEGACY_TEMP_AGE_S:
                continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    return removed


def swap_in(new: str | os.PathLike, out: str | os.PathLike) -> None:
    """Put the complete directory ``new`` at ``out``: when ``out`` exists it is renamed aside
    (into a marked ``.<name>.old-XXXX`` sibling), ``new`` renamed in, then the old one deleted.
    A failure before ``new`` is in place puts the old one back; the caller has checked that the
    old one may be replaced (:func:`check_replaceable`).

    Raises:
        OSError: a rename failed (the old ``out`` is in place again).
    """
    new, out = Path(new), Path(out)
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    rec = read_marker(new) or {}
    aside = make_temp_dir(out, rec.get("kind", "dataset"), tag="old")
    os.rename(out, aside / "x")
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside / "x", out)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


#: errno values of a write that failed because of the place, not the data: one line with a remedy
PLACE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted"}


def place_error(e: OSError, path: str | os.PathLike, remedy: str) -> OutputError | None:
    """An :class:`OutputError` naming ``path``, the cause and ``remedy`` when ``e`` is a full disk,
    a read-only file system or a permission problem (:data:`PLACE_ERRNOS`); else None."""
    why = PLACE_ERRNOS.get(e.errno)
    if why is None:
        return None
    where = e.filename if e.filename else path
    return OutputError(f"{where}: cannot write ({why}); {remedy}")


def _normal(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples -> lists, paths -> str), for comparing recipes."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


class DatasetTarget:
    """Where ``preprocess`` builds a dataset for ``out`` (:func:`dataset_target`).

    Attributes:
        out: the dataset directory asked for.
        build_dir: where to write: ``out`` itself (new, or resuming the same recipe) or a marked
            temporary sibling swapped in by :meth:`commit` (replacing another dataset).
        state: ``"new"``, ``"resume"`` (same recipe, unfinished or made by an older dlrmctl),
            ``"complete"`` (same recipe, finished: nothing to do) or ``"replace"``.
        recipe: the inputs and options of the build (recorded in the marker).
    """

    def __init__(self, out: Path, build_dir: Path, state: str, recipe: dict, created: bool = False) -> None:
        self.out, self.build_dir, self.state, self.recipe = out, build_dir, state, recipe
        self._created = created

    def commit(self) -> None:
        """The build succeeded: mark it complete and, for ``"replace"``, swap it in at ``out``."""
        finish_marker(self.build_dir, "dataset", recipe=self.recipe, complete=True)
        if self.build_dir != self.out:
            swap_in(self.build_dir, self.out)

    def abort(self) -> None:
        """The build failed: a replacement's temporary is removed (``out`` untouched); an in-place
        build stays, resumable."""
        if self.build_dir != self.out:
            shutil.rmtree(self.build_dir, ignore_errors=True)
        elif self.state == "new":  # nothing built yet (e.g. bad input): leave no trace
            try:
                if os.listdir(self.out) == [MARKER_NAME]:
                    os.remove(self.out / MARKER_NAME)
                    if self._created:
                        os.rmdir(self.out)
            except OSError:
                pass


def dataset_target(out: str | os.PathLike, recipe: dict, force: bool) -> DatasetTarget:
    """Decide where a dataset made by ``recipe`` goes (see :class:`DatasetTarget`).

    ``out`` absent or empty: built in place.  A dlrmctl dataset of the same recipe (its marker):
    resumed in place, or nothing to do when complete.  A dataset of ours without a marker (an older
    dlrmctl): resumed in place when ``recipe["legacy_same"]`` (the caller's own test) is true.
    An unfinished build of ours with another recipe (it failed or was killed: no meta.json) is
    replaced as with ``force``.  Any other dataset of ours: refused without ``force``.  With ``force`` any dataset of ours (the
    same recipe too: a rebuild) is built in a temporary sibling and swapped in when complete
    (:meth:`DatasetTarget.commit`).

    Raises:
        OutputError: ``out`` holds another dataset (no ``force``), is not a dlrmctl dataset (a file,
            a directory of other files), or is protected (:func:`check_replaceable`).
        OSError: the temporary cannot be created.
    """
    out = Path(out)
    reclaim_stale(out)  # a killed build's temporaries, whatever this one does
    legacy_same = bool(recipe.pop("legacy_same", False))
    recipe = _normal(recipe)
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; --out a new or empty directory")
    if not out.exists() or not any(out.iterdir()):
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        write_marker(out, "dataset", recipe=recipe, complete=False)
        return DatasetTarget(out, out, "new", recipe, created)
    kind = kind_of(out)
    if kind != "dataset":
        raise OutputError(f"{out}: exists and is not a dlrmctl dataset ("
                          + (f"it is a dlrmctl {kind}" if kind else not_ours(out))
                          + "); nothing there is replaced: --out a new or empty directory")
    rec = read_marker(out)
    same = rec.get("recipe") == recipe if rec is not None else legacy_same
    if same and not force:
        if rec is None:
            write_marker(out, "dataset", recipe=recipe, complete=False)  # adopt it (older dlrmctl)
        done = rec is not None and rec.get("complete") and (out / "meta.json").is_file()
        return DatasetTarget(out, out, "complete" if done else "resume", recipe)
    if rec is not None and not rec.get("complete") and not (out / "meta.json").is_file():
        # an unfinished build of ours with other inputs or options (a run that failed on bad input,
        # or was killed): nothing in it is usable, so it is rebuilt without --force
        check_replaceable(out, "dataset", "--force", "--out another directory")
        return DatasetTarget(out, make_temp_dir(out, "dataset"), "replace", recipe)
    made = (rec or {}).get("recipe") or {}
    src = made.get("inputs") or made.get("input")
    how = f"made from {_short(src)} or with other options" if src else "made with other inputs or options"
    if not force:
        raise OutputError(f"{out}: holds another dataset ({how}); pass "
                          "--force to replace it (runs trained on it will then fail their data fingerprint check) "
                          "or --out another directory")
    check_replaceable(out, "dataset", "--force", "--out another directory")
    tmp = make_temp_dir(out, "dataset")
    return DatasetTarget(out, tmp, "replace", recipe)


def _short(x: Any) -> str:
    if isinstance(x, list):
        names = [i.get("path") if isinstance(i, dict) else str(i) for i in x]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return str(x)


#: where ``train --overwrite`` keeps the previous run until the new one has a checkpoint
REPLACED_DIR = ".dlrmctl_replaced"


def set_aside_hint(run_dir: str | os.PathLike) -> str:
    """``"; ..."`` telling that an interrupted ``train --overwrite`` set the previous run of
    ``run_dir`` aside (and how it comes back), or ``""``: appended to the errors of ``evaluate``,
    ``checkpoint inspect``, ``report`` on a run that has no checkpoint or metrics of its own."""
    aside = Path(run_dir) / REPLACED_DIR
    if not aside.is_dir():
        return ""
    return (f"; an interrupted `train --overwrite` set the previous run aside in {aside}: the next `dlrmctl "
            "train` of this run (with or without --resume) puts it back, unless that run saves a checkpoint first")
