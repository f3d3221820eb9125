"""Pre-flight check of a multi-node run: every rank sees the directory checkpoints are written to.

A save (:func:`~dlrmctl.train.checkpoint.save.save_checkpoint`) has rank 0 create
``checkpoints/.step_X.tmp/`` and every rank write its own shard files into it, then rank 0
renames it.  On several nodes that works only when ``train.run_dir`` is on a filesystem every
node mounts at the same path (NFS, Lustre, a shared volume); on a node-local disk the other
nodes' ranks would fail at the first save, after the training time was spent.
:func:`check_shared_checkpoint_dir` finds out at start: rank 0 writes a token file, every rank
reads it back and creates a file of its own beside it, and every rank learns who could not.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from dlrmctl.train.checkpoint.format import CheckpointError
from dlrmctl.train.checkpoint.store import checkpoint_root

#: prefix of the check's files (removed again by the check)
CHECK_PREFIX = ".dlrmctl_shared_check."


def check_dir(run_dir: str) -> str:
    """Where the check writes: the checkpoint root when it exists (a resumed run), else the run
    directory that will hold it (``checkpoints/`` is not created early: its presence marks a run
    that has saved, see :mod:`dlrmctl.train.run_dir`)."""
    root = checkpoint_root(run_dir)
    return root if os.path.isdir(root) else run_dir


def _own_view(where: str, token: str, rank: int) -> str | None:
    """What is wrong with this rank's view of ``where``: None when it reads rank 0's token and can
    create a file there, else why not (a short phrase)."""
    path = os.path.join(where, CHECK_PREFIX + token)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read().strip() != token:
                return f"{path} holds another run's token"
    except FileNotFoundError:
        return "it cannot see the check file rank 0 wrote there"
    except OSError as e:
        return f"it cannot read the check file rank 0 wrote there ({e.strerror or e})"
    mine = f"{path}.rank{rank}"
    try:
        with open(mine, "w", encoding="utf-8") as f:
            f.write(token)
        os.remove(mine)
    except OSError as e:
        return f"it cannot create a file there ({e.strerror or e})"
    return None


def check_shared_checkpoint_dir(run_dir: str, rank: int, world_size: int, local_world_size: int,
                                pg: Any) -> None:
    """On a run over several nodes, make sure every rank sees and can write rank 0's checkpoint directory.

    Collective over ``pg`` (every rank calls it, before the first training step): rank 0 writes
    ``<dir>/.dlrmctl_shared_check.<token>`` (``dir``: :func:`check_dir`), broadcasts the token,
    every rank reads the file back and creates one of its own beside it; the outcomes are
    all-gathered and rank 0 removes its file.  One host (``world_size <= local_world_size``):
    nothing is written and no collective is issued.

    Args:
        run_dir: this rank's ``train.run_dir/<name>`` (created by rank 0).
        rank / world_size / local_world_size: this rank and the job's shape.
        pg: the process group of all ranks.

    Raises:
        CheckpointError: on every rank alike when any rank cannot see or write the directory:
            names rank 0's directory, each rank and host that cannot, why, and the remedy.
    """
    if world_size <= local_world_size:
        return
    from dlrmctl.distributed import comm

    where = os.path.abspath(check_dir(run_dir))
    host = socket.gethostname()
    token = path = None
    if rank == 0:
        token = uuid.uuid4().hex
        path = os.path.join(where, CHECK_PREFIX + token)
        try:
            os.makedirs(where, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(token + "\n")
        except OSError as e:
            token = {"error": f"rank 0 on host {host} cannot write {path} ({e.strerror or e})"}
    token = comm.broadcast_object(token, 0, pg)
    try:
        if isinstance(token, dict):
            raise CheckpointError(f"{token['error']}: checkpoints cannot be written; make train.run_dir writable")
        problem = None if rank == 0 else _own_view(where, token, rank)
        views = comm.all_gather_object((host, where, problem), pg)
    finally:
        if path is not None:
            try:
                os.remove(path)
            except OSError:
                pass
    bad = [(r, h, w, p) for r, (h, w, p) in enumerate(views) if p is not None]
    if not bad:
        return
    dir0 = views[0][1]
    who = "; ".join(f"rank {r} on host {h}" + (f" (its path {w})" if w != dir0 else "") + f": {p}"
                    for r, h, w, p in bad[:4])
    more = f"; and {len(bad) - 4} more rank(s)" if len(bad) > 4 else ""
    raise CheckpointError(
        f"train.run_dir is not shared by all nodes: {dir0} (rank 0 on host {views[0][0]}) is where every rank "
        f"writes its checkpoint shards, but {who}{more}; put train.run_dir on a filesystem every node mounts "
        f"at the same path (NFS, Lustre, a shared volume)")
