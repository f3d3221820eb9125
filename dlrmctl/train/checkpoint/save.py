"""Writing a checkpoint: :func:`save_checkpoint` (atomic publication, ``LATEST`` / ``BEST``,
pruning) and the translation of its failures (full disk, read-only target, Ctrl-C)."""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import sys
import warnings
from typing import Any

import torch

from dlrmctl.errors import OS_CONDITIONS, find_in_chain, free_bytes, interrupt_of, os_errno
from dlrmctl.fileio import write_text_atomic
from dlrmctl.train.checkpoint.codec import Blocks, dcp_planners
from dlrmctl.train.checkpoint.format import BEST, FORMAT, LATEST, CheckpointError
from dlrmctl.train.checkpoint.integrity import files_crc
from dlrmctl.train.checkpoint.storage import dcp_writer
from dlrmctl.train.checkpoint.store import best_checkpoint, checkpoint_root, fsync_dir, latest_checkpoint


def quiet_dcp():
    """Silence DCP's notices about single-process use (expected here)."""
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    return cm


def _state_nbytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a checkpoint state (plain tensors and :class:`Blocks`)."""
    n = 0
    for v in state.values():
        for t in ([b for _, b in v.blocks] if isinstance(v, Blocks) else [v]):
            n += t.numel() * t.element_size()
    return n


def _save_failed(e: BaseException, run_dir: str, tmp: str, final: str, rank: int, needed: int) -> None:
    """A checkpoint save failed before its rename: remove the partial directory (rank 0), then
    raise what it was, found in whatever DCP wrapped it in (a ``CheckpointException`` holds each
    rank's exception; see :func:`dlrmctl.errors.find_in_chain`):

    - an interrupt (Ctrl-C, SIGTERM): the ``KeyboardInterrupt`` itself;
    - a :class:`CheckpointError`: re-raised;
    - an OS condition of the target (errno ENOSPC, EDQUOT, EROFS, EACCES, ...), or a write that
      lost its errno (torch's zip writer: ``unexpected pos 704 vs 598``) while the file system
      has less free space than this rank's ``needed`` bytes (statvfs, after the partial
      directory is gone): a :class:`CheckpointError` naming the checkpoint, the condition, the
      remedy and the last good checkpoint;
    - anything else: ``e`` as it is (a bug).
    """
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    ki = interrupt_of(e)
    if ki is not None:
        raise ki
    inner = find_in_chain(e, CheckpointError)
    if inner is not None:
        raise CheckpointError(str(inner)) from None
    oserr = find_in_chain(e, lambda x: os_errno(x) is not None)
    code = None if oserr is None else os_errno(oserr)
    free = free_bytes(checkpoint_root(run_dir))
    space = ""
    if code is None and free is not None and free < needed:  # the zip writer's failure on a full disk
        code = errno.ENOSPC
    if code in (errno.ENOSPC, errno.EDQUOT) and free is not None:
        space = f" ({needed:,} bytes to write, {free:,} free)"
    if code is None:
        raise e
    try:
        last = latest_checkpoint(run_dir)
    except CheckpointError:
        last = None
    kept = (f"the last good checkpoint {os.path.basename(last)} is intact" if last
            else "no earlier checkpoint of this run")
    what, remedy = OS_CONDITIONS[code]
    raise CheckpointError(f"{final}: cannot write the checkpoint: {what}{space}; {remedy} (then --resume); "
                          f"{kept}") from None


def save_checkpoint(
    run_dir: str,
    step: int,
    state: dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
    process_group: Any = None,
    keep_last: int = 2,
    extra_meta: dict[str, Any] | None = None,
    name: str | None = None,
    best: bool = False,
    publish_latest: bool = True,
) -> str:
    """Write this rank's part of a DCP checkpoint; rank 0 publishes it atomically.  Collective.

    Args:
        state: flat ``key -> Tensor | Blocks`` (see the module docstring; non-tensor entries go
            through :func:`pack`); plain tensors with the same key on several ranks are replicated
            (written once).
        world_size: ranks taking part; > 1 needs an initialised process group.
        keep_last: number of complete checkpoints to keep (0: all), besides the best one.
        name: directory name (default ``step_XXXXXXXX``).
        best: this checkpoint becomes the run's ``BEST`` (see :func:`best_checkpoint`).
        publish_latest: point ``LATEST`` at it (False: an older step written beside newer ones,
            e.g. a reshard of the best checkpoint, must not move ``LATEST`` backwards).

    Returns:
        the final checkpoint directory.

    Raises:
        TypeError: a value that is neither a tensor nor :class:`Blocks` (DCP would pickle it).
        CheckpointError: the target is full, read-only, not writable, ... (named, with the last
            good checkpoint, which stays intact as ``LATEST`` does; the partial directory is removed).
        KeyboardInterrupt: interrupted while writing (also when DCP wrapped the interrupt); the
            partial directory is removed.
    """
    import torch.distributed.checkpoint as dcp

    from dlrmctl.distributed import comm

    for k, v in state.items():
        if not isinstance(v, (torch.Tensor, Blocks)):
            raise TypeError(f"checkpoint entry '{k}': a {type(v).__name__} would be pickled by DCP; store tensors, "
                            "Blocks or pack(obj)")
    dist_on = world_size > 1
    if dist_on and process_group is None:
        process_group = comm.default_group()
    root = checkpoint_root(run_dir)
    name = name or f"step_{step:08d}"
    # never replace a published checkpoint in place (LATEST may point at it): a second save
    # of the same step gets the next free name step_X.1, step_X.2, ... (sorted after step_X)
    base, k = name, 0
    while os.path.exists(os.path.join(root, name)):
        k += 1
        name = f"{base}.{k}"
    if dist_on:  # rank 0's view decides
        name = comm.broadcast_object(name, 0, process_group)
    tmp = os.path.join(root, f".{name}.tmp")
    final = os.path.join(root, name)
    # from the partial directory's creation to its rename, a failure (full disk, Ctrl-C: also one
    # arriving before DCP starts writing) removes it: LATEST and the last complete checkpoint are
    # untouched (see _save_failed)
    try:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            for stale in glob.glob(os.path.join(root, ".step_*.tmp")):  # left by a killed save
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
        if dist_on:
            comm.barrier(process_group)
        SavePlanner, _ = dcp_planners()
        writer = dcp_writer(tmp)
        cm = quiet_dcp()
        try:
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                     no_dist=not dist_on)
        finally:
            cm.__exit__(None, None, None)
        # each rank's files were checksummed while DCP wrote them (block CRCs; nothing is read back)
        if dist_on:
            allf: list[Any] = comm.all_gather_object(writer.files, process_group)
        else:
            allf = [writer.files]
        if rank == 0:
            files = {k: v for d in allf for k, v in sorted(d.items())}
            meta = {"format": FORMAT, "step": step, "world_size": world_size, "byteorder": sys.byteorder}
            meta.update(extra_meta or {})  # (a reshard passes the source's meta: its own file table is replaced)
            meta.update(files=files, files_crc32=files_crc(files))
            write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
            fsync_dir(tmp)
            os.replace(tmp, final)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _save_failed(e, run_dir, tmp, final, rank, _state_nbytes(state))
    if rank == 0:
        fsync_dir(root)
        if publish_latest:
            write_text_atomic(os.path.join(root, LATEST), name + "\n")
        if best:
            write_text_atomic(os.path.join(root, BEST), name + "\n")
        complete = sorted(d for d in glob.glob(os.path.join(root, "step_*")) if os.path.isdir(d))
        keep = {os.path.abspath(final)}
        try:
            b = best_checkpoint(run_dir)
        except CheckpointError:
            b = None
        if b is not None:
            keep.add(os.path.abspath(b))  # the best checkpoint is never pruned
        for old in complete[:-keep_last] if keep_last > 0 else []:
            if os.path.abspath(old) not in keep:
                shutil.rmtree(old, ignore_errors=True)
    if dist_on:
        comm.barrier(process_group)
    return final


