"""Run-directory checkpoints: written to a temp path, made visible by rename.

Layout::

    runs/<name>/checkpoints/step_00000100/
        rank_00000.pt     one file per rank: its own embedding shards (with their
                          ShardMetadata), fused-optimizer state and hyper-parameters,
                          dense model + optimizer state, scheduler step, data
                          position, RNG states
        meta.json         step, world_size, table shapes, files (written last)
    runs/<name>/checkpoints/LATEST   name of the newest complete checkpoint

A save goes to ``.step_XXXXXXXX.tmp/``; after every rank has written its file
(barrier) rank 0 writes ``meta.json``, renames the directory, then rewrites
``LATEST`` via temp file + ``os.replace``.  A crash (even SIGKILL) at any point
leaves the previous checkpoint and ``LATEST`` intact; ``keep_last`` older
checkpoints are pruned only after the new one is visible.

No rank ever gathers a whole sharded table: each rank writes its shards.
Loading into a different plan / world size reads, for each local shard, the
overlapping parts of the saved shards (:func:`read_table_slice`).
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
from typing import Any, Callable

import numpy as np
import torch

CKPT_DIR = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match the model."""


def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_DIR)


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None if there is none."""
    p = os.path.join(checkpoint_root(run_dir), "LATEST")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    path = os.path.join(checkpoint_root(run_dir), name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{p} points at {name}, which does not exist")
    return path


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str,
    step: int,
    rank_state: dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    keep_last: int = 2,
    extra_meta: dict[str, Any] | None = None,
) -> str:
    """Write this rank's state; rank 0 publishes the checkpoint atomically.

    Args:
        rank_state: everything this rank must restore (tensors, dicts); saved with
            ``torch.save`` to ``rank_{rank:05d}.pt``.
        barrier: called between "all ranks wrote" and "rank 0 publishes" (None
            for a single process).
        keep_last: number of complete checkpoints to keep.

    Returns:
        the final checkpoint directory.
    """
    root = checkpoint_root(run_dir)
    name = f"step_{step:08d}"
    tmp = os.path.join(root, f".{name}.tmp")
    final = os.path.join(root, name)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    if barrier:
        barrier()
    fpath = os.path.join(tmp, f"rank_{rank:05d}.pt")
    torch.save(rank_state, fpath + ".part")
    os.replace(fpath + ".part", fpath)
    if barrier:
        barrier()
    if rank == 0:
        meta = {"step": step, "world_size": world_size, "files": [f"rank_{r:05d}.pt" for r in range(world_size)]}
        meta.update(extra_meta or {})
        _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(os.path.join(root, "LATEST"), name + "\n")
        complete = sorted(d for d in glob.glob(os.path.join(root, "step_*")) if os.path.isdir(d))
        for old in complete[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if barrier:
        barrier()
    return final


def load_checkpoint_meta(ckpt_dir: str) -> dict[str, Any]:
    p = os.path.join(ckpt_dir, "meta.json")
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; {ckpt_dir} is not a complete checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p}: corrupted ({e})") from e


def load_rank_file(ckpt_dir: str, rank: int) -> dict[str, Any]:
    """Load one rank's state file.

    Raises:
        CheckpointError: file missing or unreadable (truncated / corrupted),
            naming the file.
    """
    p = os.path.join(ckpt_dir, f"rank_{rank:05d}.pt")
    if not os.path.exists(p):
        raise CheckpointError(f"{p}: missing (checkpoint written by a different world size?)")
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # zip/pickle errors on truncated files
        raise CheckpointError(f"{p}: cannot be read, the file is truncated or corrupted ({type(e).__name__}: {e})") from e


def read_table_slice(
    rank_states: list[dict[str, Any]], table: str, rows: tuple[int, int], cols: tuple[int, int], key: str = "weight"
) -> torch.Tensor:
    """Assemble rows ``[r0, r1)`` x cols ``[c0, c1)`` of a saved table (or its state) from the saved shards.

    Each rank state has ``embeddings[table] = [{"offsets", "sizes", "weight", "momentum": [...]}]``.
    ``key``: ``weight`` or ``momentum{i}`` (i-th optimizer state tensor; row-wise states are ``[rows]``).

    Raises:
        CheckpointError: the saved shards do not cover the requested block.
    """
    r0, r1 = rows
    c0, c1 = cols
    first = None
    covered = 0
    for st in rank_states:
        for sh in st.get("embeddings", {}).get(table, []):
            (so_r, so_c), (sz_r, sz_c) = sh["offsets"], sh["sizes"]
            ir0, ir1 = max(r0, so_r), min(r1, so_r + sz_r)
            ic0, ic1 = max(c0, so_c), min(c1, so_c + sz_c)
            if ir0 >= ir1:
                continue
            src = sh["weight"] if key == "weight" else sh["momentum"][int(key[len("momentum"):])]
            if src.dim() == 1:  # row-wise state: one value per row, columns irrelevant
                if first is None:
                    first = torch.zeros(r1 - r0, dtype=src.dtype)
                first[ir0 - r0 : ir1 - r0] = src[ir0 - so_r : ir1 - so_r]
                covered += (ir1 - ir0) * (c1 - c0)
                continue
            if ic0 >= ic1:
                continue
            if first is None:
                first = torch.zeros(r1 - r0, c1 - c0, dtype=src.dtype)
            first[ir0 - r0 : ir1 - r0, ic0 - c0 : ic1 - c0] = src[ir0 - so_r : ir1 - so_r, ic0 - so_c : ic1 - so_c]
            covered += (ir1 - ir0) * (ic1 - ic0)
    if first is None or covered < (r1 - r0) * (c1 - c0):
        raise CheckpointError(
            f"table '{table}' {key}: saved shards do not cover rows [{r0},{r1}) x cols [{c0},{c1}) "
            "(checkpoint from a different model?)"
        )
    return first
