"""Output directories that dlrmctl owns: the ownership marker, the refusal to replace what is not
ours, the atomic swap of a completed replacement, and the reclaiming of a killed run's temporaries.

Every output directory dlrmctl creates (a dataset of ``preprocess``, a training run, an export
artifact, a sweep) gets a marker file :data:`MARKER_NAME` (``.dlrmctl``), JSON::

    {"kind": "dataset" | "run" | "export" | "sweep", "version": 1, "created": ISO-8601, ...}

(a dataset's marker also records its ``recipe``: the inputs and options it was made from).
``--force`` / ``--overwrite`` replace only a directory of the same kind that is ours: it carries
the marker, or it is a dlrmctl output made before the marker existed (:func:`kind_of` recognises
a dataset by its ``meta.json``, an export by its ``manifest.json``, a run by its ``config.yaml``
with checkpoints or an attempt marker, a sweep by its ``sweep.csv``).  Never the working
directory or one of its parents, ``/`` or the home directory (:func:`check_replaceable`).

A replacement is built complete in a sibling temporary directory (:func:`make_temp_dir`:
``.<name>.tmp-XXXX``, marked with the building process's pid and host) and swapped in by
:func:`swap_in`: old renamed aside, new renamed in, old deleted; a failure at any point leaves the
old one in place.  :func:`reclaim_stale` removes the temporaries of killed runs (ours, and their
process gone) at the next build of the same output.

A finished build's marker lists the ``entries`` it wrote; ``--force`` refuses a directory where
anything else has appeared since (:func:`foreign_entries`).

Single output files (``predict --output``, ``plan --out`` / ``--report``) follow the same rule:
:func:`check_file_replaceable` lets ``--force`` replace only a regular file the command's kind of
writer made (recognised by its content), never a symbolic link, a device, a directory, a file
inside a dlrmctl output, or the command's own input; :func:`atomic_file` writes a hidden
``.<name>.tmp-<host>-<pid>`` sibling (within ``NAME_MAX``) renamed over the output when
complete, and first removes such siblings of killed runs (:func:`reclaim_stale_files`).

Torch-free (imported by the command modules before torch).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from dlrmctl.errors import OutputError
from dlrmctl.fileio import temp_prefix, write_text_atomic

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
    if (d / "config.yaml").is_file() and ((d / "checkpoints").is_dir() or (d / ".dlrmctl_attempt").exists()
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
            if _pid_alive(rec["pid"]):
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


# ----------------------------------------------------------------------------- one writer at a time
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


# ----------------------------------------------------------------------------- single output files
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
            if not stat.S_ISREG(st.st_mode) or legacy_fresh or _pid_alive(int(pid)):
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
