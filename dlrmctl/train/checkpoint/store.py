"""The checkpoint store of a run directory: ``checkpoints/step_XXXXXXXX/``, the ``LATEST`` / ``BEST``
markers, listing, resolving ``--checkpoint``, reading safely against pruning, meta.json."""

from __future__ import annotations

import collections
import glob
import json
import logging
import os
import shutil
from typing import Any, Callable, Sequence, TypeVar

from dlrmctl.fileio import write_text_atomic
from dlrmctl.train.checkpoint.format import BEST, CKPT_DIR, FORMAT, LATEST, OLD_FORMATS, CheckpointError
from dlrmctl.train.checkpoint.integrity import CheckedFile, check_files_entry, files_crc

log = logging.getLogger("dlrmctl.checkpoint")
T = TypeVar("T")


# ------------------------------------------------------------ run dirs
def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_DIR)


def marked(run_dir: str, marker: str) -> str | None:
    """The checkpoint directory the marker file ``checkpoints/<marker>`` (``LATEST`` / ``BEST``)
    names, or None when there is no marker.

    Raises:
        CheckpointError: the marker is unreadable, not UTF-8 text, not one checkpoint name
            (one printable line without a path separator), or names a checkpoint that does not exist (the message names the file).
    """
    p = os.path.join(checkpoint_root(run_dir), marker)
    if not os.path.exists(p):
        return None
    try:
        with open(p, "rb") as f:
            data = f.read(4096)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if not name or name in (".", "..") or any(c in name for c in "/\\\0\n") or not name.isprintable():
        raise CheckpointError(f"{p}: expected one line naming a checkpoint of {checkpoint_root(run_dir)} "
                              f"(e.g. step_00000080), got {'binary data' if name is None else repr(name[:60])}; "
                              f"restore the file or delete it (then --checkpoint STEP picks a checkpoint)")
    path = os.path.join(checkpoint_root(run_dir), name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{p} points at {name}, which does not exist")
    return path


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None if there is none."""
    return marked(run_dir, LATEST)


def best_checkpoint(run_dir: str) -> str | None:
    """Path of the checkpoint with the best validation metric (``train.keep_best``), or None."""
    return marked(run_dir, BEST)


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of a run as ``(step, path)``, in name order (oldest first)."""
    out = []
    for d in sorted(glob.glob(os.path.join(checkpoint_root(run_dir), "step_*"))):
        try:
            with open(os.path.join(d, "meta.json")) as f:
                out.append((int(json.load(f)["step"]), d))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a complete checkpoint
    return out


def resolve_checkpoint(run_dir: str, which: str | None = None) -> tuple[str, str]:
    """The checkpoint ``--checkpoint WHICH`` selects: ``best``, ``last``, a step number, or a
    checkpoint of this run by name (``step_00000080.1``, ``step_00000050_ws2``: what a step number
    cannot tell apart when a step was saved twice or resharded in place) or by directory path.

    ``None``: ``best`` when the run has one (``train.keep_best``), else ``last``.

    Returns:
        ``(path, label)``; label e.g. ``"best (step 40)"``, ``"last (step 63)"``, ``"step 50"``.

    Raises:
        CheckpointError: no such checkpoint (names the run and what it has).
    """
    def step_of(path: str) -> int:
        return int(load_checkpoint_meta(path)["step"])

    have = list_checkpoints(run_dir)

    def available() -> str:
        if not have:
            return "it has no checkpoint"
        best = best_checkpoint(run_dir)
        last = latest_checkpoint(run_dir)
        counts = collections.Counter(s for s, _ in have)
        tags = []
        for s, p in have:
            marks = [os.path.basename(p)] if counts[s] > 1 else []  # a repeated step: its name selects it
            marks += ["best"] if p == best else []
            marks += ["last"] if p == last else []
            tags.append(f"{s}" + (f" ({', '.join(marks)})" if marks else ""))
        return "it has steps " + ", ".join(tags)

    if which is not None and os.path.isfile(os.path.join(str(which), "meta.json")):  # already resolved
        # only a checkpoint of THIS run: another run's would bypass its config and data checks
        if os.path.realpath(os.path.dirname(str(which))) != os.path.realpath(checkpoint_root(run_dir)):
            raise CheckpointError(f"--checkpoint {which}: not a checkpoint of {run_dir}; expected best, last, a "
                                  f"step number or a checkpoint name ({available()})")
        return str(which), f"step {step_of(str(which))}"
    if which is not None and os.path.basename(str(which)) == str(which) and str(which).startswith("step_"):
        named = os.path.join(checkpoint_root(run_dir), str(which))
        if not os.path.isfile(os.path.join(named, "meta.json")):
            raise CheckpointError(f"--checkpoint {which}: no such checkpoint in {run_dir}; {available()}")
        return named, f"step {step_of(named)} ({which})"
    w = "auto" if which is None else str(which).strip().lower()
    if w in ("auto", "best"):
        p = best_checkpoint(run_dir)
        if p is not None:
            return p, f"best (step {step_of(p)})"
        if w == "best":
            raise CheckpointError(f"{run_dir}: no best checkpoint (checkpoints/{BEST} is missing: the run was "
                                  f"trained with train.keep_best: none, or by an older dlrmctl); {available()}")
        w = "last"
    if w in ("last", "latest"):
        p = latest_checkpoint(run_dir)
        if p is None:
            from dlrmctl.outputs import set_aside_hint

            raise CheckpointError(f"{run_dir}: no checkpoint (checkpoints/{LATEST} is missing){set_aside_hint(run_dir)}")
        return p, f"last (step {step_of(p)})"
    if not (w.isascii() and w.isdigit()):
        raise CheckpointError(f"--checkpoint {which!r}: expected best, last, a step number or a checkpoint name "
                              f"({available()})")
    step = int(w)
    matches = [p for s, p in have if s == step]
    if not matches:
        raise CheckpointError(f"{run_dir}: no checkpoint of step {step}; {available()}")
    # several (a re-save step_X.1, a reshard step_X_wsN): the one LATEST names, else the newest
    last = latest_checkpoint(run_dir)
    return (last if last in matches else matches[-1]), f"step {step}"


#: ``--checkpoint`` choices that name whatever ``LATEST`` / ``BEST`` point at *now* (a training run moves them)
_MOVING = ("auto", "best", "last", "latest")


def _files_of(path: str) -> list[str]:
    """The files of checkpoint ``path`` that exist now (meta.json and those it lists)."""
    try:
        names = ["meta.json", *load_checkpoint_meta(path)["files"]]
    except CheckpointError:
        names = ["meta.json"]
    return [n for n in names if os.path.exists(os.path.join(path, n))]


def _removed(path: str, files: Sequence[str]) -> bool:
    """Checkpoint ``path`` lost its directory or one of ``files`` (which it had) since they were listed."""
    return not os.path.isdir(path) or any(not os.path.exists(os.path.join(path, n)) for n in files)


def read_checkpoint(run_dir: str, which: str | None, read: Callable[[str, str], T]) -> T:
    """``read(path, label)`` of the checkpoint ``which`` selects (:func:`resolve_checkpoint`), safe
    against the pruning of a training run writing to ``run_dir`` meanwhile.

    A run saving with ``train.keep_last_checkpoints`` deletes an older checkpoint right after it has
    published a newer one, so a reader (evaluate, export, checkpoint reshard) may lose the step
    directory it chose while it reads it.  When ``read`` fails and that checkpoint has lost its
    directory or a file it had when chosen, it was pruned: a moving choice (``None``, ``best``,
    ``last``) is resolved again (``LATEST`` / ``BEST`` then name a newer, complete checkpoint) and
    read once more; a fixed one (a step number or name), or a second loss, is reported as
    pruning, not as corruption.  A failure of a checkpoint that kept its files is re-raised as is.
    Nothing is locked: pruning never waits for readers (see the module docstring).

    Args:
        run_dir: the run directory.
        which: as :func:`resolve_checkpoint`.
        read: reads the checkpoint at ``path`` (``label`` e.g. ``"last (step 63)"``); may be called
            twice, so it must leave nothing behind when it fails (write outputs to a temp path).

    Returns:
        what ``read`` returns.

    Raises:
        CheckpointError: no such checkpoint (as :func:`resolve_checkpoint`), or ``checkpoint ...
            was removed by the run's pruning (train.keep_last_checkpoints) while it was being read``.
        Whatever ``read`` raises for a checkpoint that was not removed.
    """
    moving = which is None or str(which).strip().lower() in _MOVING
    for attempt in (0, 1):
        try:
            path, label = resolve_checkpoint(run_dir, which)
        except CheckpointError:
            if attempt == 0 and moving:  # LATEST / BEST moved and the old step went while resolving
                continue
            raise
        files = _files_of(path)
        try:
            return read(path, label)
        except Exception:
            if not _removed(path, files):
                raise
            if attempt == 0 and moving:
                log.warning("checkpoint %s (%s) was removed by the run's pruning while it was being read; "
                            "reading the one %s names now", label, path, LATEST if "last" in label else BEST)
                continue
            how = ("; choose a newer one (--checkpoint last)" if not moving
                   else ": the run is saving checkpoints faster than this read; retry")
            raise CheckpointError(
                f"checkpoint {label} ({path}) was removed by the run's pruning (train.keep_last_checkpoints) "
                f"while it was being read{how}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (its entries' renames made durable); a filesystem that cannot
    is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

def mark_best(run_dir: str, ckpt_dir: str, eval_meta: dict[str, Any] | None = None) -> None:
    """Point ``BEST`` at an existing checkpoint of ``run_dir`` (rank 0), recording the evaluation
    that made it the best in its meta.json (``eval``); its data files are not touched."""
    if eval_meta is not None:
        meta = load_checkpoint_meta(ckpt_dir)
        meta["eval"] = eval_meta
        write_text_atomic(os.path.join(ckpt_dir, "meta.json"), json.dumps(meta, indent=1))
    write_text_atomic(os.path.join(checkpoint_root(run_dir), BEST), os.path.basename(ckpt_dir) + "\n")


def load_checkpoint_meta(ckpt_dir: str) -> dict[str, Any]:
    p = os.path.join(ckpt_dir, "meta.json")
    try:
        with open(p) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; {ckpt_dir} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: corrupted ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: corrupted (a JSON {type(meta).__name__}, expected an object)")
    fmt = meta.get("format", "per-rank torch.save (pre-DCP)")
    if fmt != FORMAT:
        why = OLD_FORMATS.get(fmt, "it was written by an older dlrmctl") if isinstance(fmt, str) else "damaged"
        raise CheckpointError(
            f"{p}: checkpoint format {fmt!r} is older than {FORMAT!r} and is not loaded ({why}); "
            "resume or export it with the dlrmctl version that wrote it, or train again"
        )
    check_files_entry(p, meta.get("files"))
    if "files_crc32" in meta and meta["files_crc32"] != files_crc(meta["files"]):  # absent: written before it
        raise CheckpointError(f"{p}: corrupted: its file table (sizes, block checksums, raw data offsets) does "
                              f"not match its CRC-32 files_crc32 ({meta['files_crc32']!r})")
    return meta


def copy_run_files(src_run: str, dst_run: str, names: Sequence[str] = ("config.yaml", "data_meta.json")) -> None:
    """Copy a run's small descriptive files (for a resharded copy of a run)."""
    os.makedirs(dst_run, exist_ok=True)
    for n in names:
        p = os.path.join(src_run, n)
        if os.path.exists(p) and os.path.abspath(p) != os.path.abspath(os.path.join(dst_run, n)):
            shutil.copy2(p, os.path.join(dst_run, n))


def check_integrity(ckpt_dir: str, verify: bool = False) -> tuple[bool, str]:
    """Integrity of one checkpoint directory, as ``(ok, text)``.

    Always (cheap: meta.json is read and every data file stat'ed, no data is read): meta.json
    parses and its file table matches its own CRC-32, every file it lists is present with the
    recorded size and has one checksum per block.  ``verify``: also reads every file in whole
    checksum blocks and checks each block's CRC-32 (reads the whole checkpoint once).

    Returns:
        ``(True, "ok: ...")`` or ``(False, the CheckpointError's message)`` (names the file,
        the byte range / block and what was expected).
    """
    counter: dict[str, int] = {"bytes_read": 0}
    try:
        meta = load_checkpoint_meta(ckpt_dir)
        blocks = 0
        for fname in sorted(meta["files"]):
            f = CheckedFile(ckpt_dir, fname, meta, counter)
            blocks += len(f.crcs)
            if not verify:
                continue
            step = max(1, (64 << 20) // f.block_bytes) * f.block_bytes  # whole blocks: nothing read twice
            with f:
                for start in range(0, f.size, step):
                    f.read(start, min(start + step, f.size), fname)
    except CheckpointError as e:
        return False, str(e)
    n = len(meta["files"])
    if verify:
        return True, f"ok: all {blocks:,} checksum blocks of {n} files verified ({counter['bytes_read']:,} bytes read)"
    return True, f"ok: {n} files present with the sizes meta.json records (blocks not read; --verify checks them)"
