"""Run-directory checkpoints in the ``torch.distributed.checkpoint`` (DCP) format.

Layout::

    runs/<name>/checkpoints/step_00000100/
        __0_0.distcp ...  DCP data files: each rank writes its own embedding shards
                          (no rank ever gathers a table) and a share of the
                          replicated tensors (DCP de-duplicates them)
        .metadata         DCP metadata: every key's global shape and saved chunks
        meta.json         step, world_size, table shapes, plan, and the byte size
                          + CRC-32 of every file above (written last)
    runs/<name>/checkpoints/LATEST   name of the newest complete checkpoint
    runs/<name>/checkpoints/BEST     name of the checkpoint with the best validation metric
                                     (``train.keep_best``; never pruned by ``keep_last``)

Keys of the DCP state dict (the format; see ``dlrmctl.train.loop.checkpoint_state``)::

    emb/<table>/weight              [rows, dim]  chunks = the shards of the plan that saved it
    emb/<table>/state<i>            i-th embedding-optimizer moment: [rows] (row-wise
                                    Adagrad; partial row-wise Adam / LAMB's state1) or
                                    [rows, dim] (Adagrad; Adam / LAMB state0, state1;
                                    partial row-wise state0), sharded like the rows
    emb/<table>/state<i>@cols<a>-<b> [rows]  column-wise tables only: the row-wise moment
                                    of the column shard [a, b) (each column shard has its own)
    dense/<name>                    MLP / interaction parameters and buffers (replicated)
    dense_opt/<param>/<key>         dense-optimizer state tensors (replicated)
    meta/<name>                     pickled objects: trainer (step, epoch, best, data
                                    position), fused optimizer hyper-parameters (type,
                                    lr, eps, weight_decay, step), dense and embedding-dense
                                    optimizer param_groups (lr, betas, eps, ...), LR schedule
    rank/<r>                        pickled per-rank objects: RNG states (torch, numpy,
                                    python, cuda), per-shard scalar optimizer state

A tensor that is sharded is given to DCP as :class:`Blocks` (global shape +
this rank's blocks with their offsets); DCP records every chunk in
``.metadata`` and, on load, reads for each requested block exactly the
overlapping parts of the saved chunks — so a checkpoint loads into any world
size or plan, including a single process (``no_dist``); ``dlrmctl checkpoint
reshard`` (:func:`reshard_rank`) rewrites one for a new layout offline.

Optimizer moments across plans: per-element moments and the per-row moments of
row-wise / table-wise / table_row_wise / data_parallel tables are exact under
any resharding.  Row-wise Adagrad keeps one value per row for the whole row,
but each column shard of a column-wise table keeps its own (over its columns):
a column shard loads its own ``@cols`` entry when the column split is unchanged
(exact: resuming with the same plan), else the table's per-row moment (exact at
save time when the source was not column-wise; from a column-wise source it is
the column-0 shard's moment).

Atomicity: a save goes to ``.step_XXXXXXXX.tmp/``; after every rank has written
(DCP's final barrier) each rank checksums its own file, rank 0 writes
``meta.json``, renames the directory and rewrites ``LATEST`` via temp file +
``os.replace``.  A crash (even SIGKILL) at any point leaves the previous
checkpoint and ``LATEST`` intact; ``keep_last`` older checkpoints are pruned
only after the new one is visible (the one ``BEST`` names is always kept), and a
published directory is never rewritten (a second save of a step becomes ``step_XXXXXXXX.1``).  On load every file a rank reads is checked
against its recorded size and CRC first, so a truncated or corrupted file is
refused with its name.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import random
import shutil
import warnings
import zlib
from typing import Any, Sequence

import numpy as np
import torch

CKPT_DIR = "checkpoints"
FORMAT = "dcp-v1"
LATEST = "LATEST"
BEST = "BEST"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match the model."""


# ------------------------------------------------------------------ RNG
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


# --------------------------------------------------------------- blocks
class Blocks:
    """A tensor of global shape ``size`` of which this process holds some blocks.

    Args:
        size: global shape, e.g. ``[rows, dim]`` of a table or ``[rows]`` of a row-wise moment.
        blocks: ``(offsets, tensor)`` pairs; ``tensor`` is the block at ``offsets`` (same
            number of dims as ``size``).  On save they are read; on load they are filled in
            place (live views of the model's weights load directly into the model).

    Empty blocks are dropped.  DCP uses :meth:`__create_write_items__` /
    :meth:`__create_chunk_list__` (its ``_Checkpointable`` hooks) and the planners below.
    """

    def __init__(self, size: Sequence[int], blocks: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:
        self._size = torch.Size(size)
        self.blocks = [(torch.Size(o), t) for o, t in blocks if t.numel() > 0]
        for o, t in self.blocks:
            if len(o) != len(self._size) or t.dim() != len(self._size) or any(
                a + b > s for a, b, s in zip(o, t.shape, self._size)
            ):
                raise ValueError(f"block {tuple(t.shape)} at {tuple(o)} does not fit in {tuple(self._size)}")

    def size(self) -> torch.Size:
        return self._size

    def __repr__(self) -> str:
        return f"Blocks({list(self._size)}, {[(list(o), list(t.shape)) for o, t in self.blocks]})"

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.blocks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t.detach()),
                    size=self._size,
                ),
            )
            for o, t in self.blocks
        ]

    def block_at(self, offsets: Sequence[int]) -> torch.Tensor:
        o = torch.Size(offsets)
        for bo, t in self.blocks:
            if bo == o:
                return t.detach()
        raise KeyError(f"no block at {list(o)}")


def _find(state: dict[str, Any], index: Any) -> Any:
    obj = state[index.fqn]
    if isinstance(obj, Blocks):
        return obj.block_at(index.offset)
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    return obj


def _planners():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        """DefaultSavePlanner over a flat state dict that may hold :class:`Blocks`."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index):  # type: ignore[override]
            return _find(self.state_dict, index)

    class LoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner filling :class:`Blocks` in place."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # type: ignore[override]
            # the default one first runs _init_state_dict, which replaces unknown objects (Blocks) by None;
            # nothing here lives on the meta device, so it has nothing to do
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index):  # type: ignore[override]
            return _find(self.state_dict, index)

    return SavePlanner, LoadPlanner


def pack(obj: Any) -> bytes:
    """A non-tensor entry (stored by DCP as one opaque object)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(b: Any) -> Any:
    return pickle.loads(b)


# ------------------------------------------------------------ run dirs
def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_DIR)


def _marked(run_dir: str, marker: str) -> str | None:
    p = os.path.join(checkpoint_root(run_dir), marker)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    path = os.path.join(checkpoint_root(run_dir), name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{p} points at {name}, which does not exist")
    return path


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None if there is none."""
    return _marked(run_dir, LATEST)


def best_checkpoint(run_dir: str) -> str | None:
    """Path of the checkpoint with the best validation metric (``train.keep_best``), or None."""
    return _marked(run_dir, BEST)


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
    """The checkpoint ``--checkpoint WHICH`` selects: ``best``, ``last`` or a step number (or a
    checkpoint directory, returned as it is).

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
        tags = [f"{s}" + (" (best)" if p == best else "") + (" (last)" if p == last else "") for s, p in have]
        return "it has steps " + ", ".join(tags)

    if which is not None and os.path.isfile(os.path.join(str(which), "meta.json")):  # already resolved
        # only a checkpoint of THIS run: another run's would bypass its config and data checks
        if os.path.realpath(os.path.dirname(str(which))) != os.path.realpath(checkpoint_root(run_dir)):
            raise CheckpointError(f"--checkpoint {which}: not a checkpoint of {run_dir}; expected best, last or a "
                                  f"step number ({available()})")
        return str(which), f"step {step_of(str(which))}"
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
            raise CheckpointError(f"{run_dir}: no checkpoint (checkpoints/{LATEST} is missing)")
        return p, f"last (step {step_of(p)})"
    if not (w.isascii() and w.isdigit()):
        raise CheckpointError(f"--checkpoint {which!r}: expected best, last or a step number ({available()})")
    step = int(w)
    matches = [p for s, p in have if s == step]
    if not matches:
        raise CheckpointError(f"{run_dir}: no checkpoint of step {step}; {available()}")
    # several (a re-save step_X.1, a reshard step_X_wsN): the one LATEST names, else the newest
    last = latest_checkpoint(run_dir)
    return (last if last in matches else matches[-1]), f"step {step}"


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
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


def file_digest(path: str) -> dict[str, int]:
    """``{"bytes", "crc32"}`` of a file (streamed, 8 MiB at a time)."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            crc = zlib.crc32(b, crc)
            n += len(b)
    return {"bytes": n, "crc32": crc}


def _quiet():
    """Silence DCP's notices about single-process use (expected here)."""
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    return cm


def _raise_from_dcp(e: BaseException, where: str) -> None:
    """Re-raise the first CheckpointError inside a DCP exception (they wrap per-rank failures)."""
    failures = getattr(e, "failures", None) or {}
    def inner_of(f: Any) -> Any:
        return f[0] if isinstance(f, tuple) else f

    for f in failures.values():
        inner = inner_of(f)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from e
    if isinstance(e, CheckpointError):
        raise e
    msgs = []
    for r, f in sorted(failures.items()):
        inner = inner_of(f)
        msgs.append(f"rank {r}: {type(inner).__name__}: {inner}")
    raise CheckpointError(f"{where}: {'; '.join(msgs) or f'{type(e).__name__}: {e}'}") from e


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
        state: flat ``key -> Tensor | Blocks | bytes`` (see the module docstring); plain
            tensors with the same key on several ranks are replicated (written once).
        world_size: ranks taking part; > 1 needs an initialised process group.
        keep_last: number of complete checkpoints to keep (0: all), besides the best one.
        name: directory name (default ``step_XXXXXXXX``).
        best: this checkpoint becomes the run's ``BEST`` (see :func:`best_checkpoint`).
        publish_latest: point ``LATEST`` at it (False: an older step written beside newer ones,
            e.g. a reshard of the best checkpoint, must not move ``LATEST`` backwards).

    Returns:
        the final checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp

    from dlrmctl.distributed import comm

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
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in glob.glob(os.path.join(root, ".step_*.tmp")):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    if dist_on:
        comm.barrier(process_group)
    SavePlanner, _ = _planners()
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    cm = _quiet()
    try:
        dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=process_group, no_dist=not dist_on)
    finally:
        cm.__exit__(None, None, None)
    # each rank checksums its own data file (DCP names them __<rank>_<i>.distcp)
    mine = {os.path.basename(p): file_digest(p) for p in sorted(glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")))}
    if dist_on:
        allf: list[Any] = comm.all_gather_object(mine, process_group)
    else:
        allf = [mine]
    if rank == 0:
        files = {k: v for d in allf for k, v in d.items()}
        files[".metadata"] = file_digest(os.path.join(tmp, ".metadata"))
        meta = {"format": FORMAT, "step": step, "world_size": world_size, "files": files}
        meta.update(extra_meta or {})
        _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        if publish_latest:
            _atomic_write_text(os.path.join(root, LATEST), name + "\n")
        if best:
            _atomic_write_text(os.path.join(root, BEST), name + "\n")
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


def mark_best(run_dir: str, ckpt_dir: str, eval_meta: dict[str, Any] | None = None) -> None:
    """Point ``BEST`` at an existing checkpoint of ``run_dir`` (rank 0), recording the evaluation
    that made it the best in its meta.json (``eval``); its data files are not touched."""
    if eval_meta is not None:
        meta = load_checkpoint_meta(ckpt_dir)
        meta["eval"] = eval_meta
        _atomic_write_text(os.path.join(ckpt_dir, "meta.json"), json.dumps(meta, indent=1))
    _atomic_write_text(os.path.join(checkpoint_root(run_dir), BEST), os.path.basename(ckpt_dir) + "\n")


def load_checkpoint_meta(ckpt_dir: str) -> dict[str, Any]:
    p = os.path.join(ckpt_dir, "meta.json")
    try:
        with open(p) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; {ckpt_dir} is not a complete checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p}: corrupted ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{p}: format {meta.get('format', 'per-rank torch.save (pre-DCP)')!r} is not {FORMAT!r}; "
            "this checkpoint was written by an older dlrmctl"
        )
    return meta


def verify_file(ckpt_dir: str, fname: str, meta: dict[str, Any]) -> None:
    """Check one file of a checkpoint against the size and CRC-32 recorded in meta.json.

    Raises:
        CheckpointError: naming the file and what did not match.
    """
    p = os.path.join(ckpt_dir, fname)
    exp = meta["files"].get(fname)
    if exp is None:
        raise CheckpointError(f"{p}: not listed in {os.path.join(ckpt_dir, 'meta.json')}")
    if not os.path.exists(p):
        raise CheckpointError(f"{p}: missing (meta.json lists it with {exp['bytes']} bytes)")
    size = os.path.getsize(p)
    if size != exp["bytes"]:
        raise CheckpointError(f"{p}: {size} bytes, expected {exp['bytes']}: the file is truncated or corrupted")
    got = file_digest(p)["crc32"]
    if got != exp["crc32"]:
        raise CheckpointError(f"{p}: CRC-32 {got:#010x}, expected {exp['crc32']:#010x}: the file is corrupted")


def _reader(ckpt_dir: str, meta: dict[str, Any]):
    import torch.distributed.checkpoint as dcp

    class VerifyingReader(dcp.FileSystemReader):
        """FileSystemReader that checks every file against meta.json before reading it."""

        _checked: set[str] = set()

        def read_metadata(self):  # type: ignore[override]
            verify_file(ckpt_dir, ".metadata", meta)
            try:
                return super().read_metadata()
            except Exception as e:
                raise CheckpointError(f"{os.path.join(ckpt_dir, '.metadata')}: cannot be read ({e})") from e

        def read_data(self, plan, planner):  # type: ignore[override]
            for item in plan.items:
                rel = self.storage_data[item.storage_index].relative_path
                if rel not in self._checked:
                    verify_file(ckpt_dir, rel, meta)
                    self._checked.add(rel)
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{ckpt_dir}: reading the data files failed ({type(e).__name__}: {e})") from e

    r = VerifyingReader(ckpt_dir)
    r._checked = set()
    return r


def read_metadata(ckpt_dir: str, meta: dict[str, Any] | None = None) -> Any:
    """The DCP ``Metadata`` of a checkpoint (``state_dict_metadata``: key -> storage metadata)."""
    meta = meta or load_checkpoint_meta(ckpt_dir)
    return _reader(ckpt_dir, meta).read_metadata()


def saved_size(md: Any, key: str) -> torch.Size | None:
    """Global shape of a saved tensor key (None: absent or not a tensor)."""
    m = md.state_dict_metadata.get(key)
    return getattr(m, "size", None)


def load_checkpoint(ckpt_dir: str, state: dict[str, Any], process_group: Any = None, world_size: int = 1,
                    meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill ``state`` (``key -> Tensor | Blocks | placeholder``) from a checkpoint.  Collective.

    Tensors and :class:`Blocks` are filled in place (each rank reads only the
    saved chunks overlapping its blocks); other values are replaced by the
    saved objects (use :func:`unpack` on ``meta/`` and ``rank/`` entries).

    Raises:
        CheckpointError: a file is missing, truncated or corrupted (named), a key
            is missing, or a saved shape differs from the requested one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    meta = meta or load_checkpoint_meta(ckpt_dir)
    reader = _reader(ckpt_dir, meta)
    md = reader.read_metadata()
    for k, v in state.items():
        sm = md.state_dict_metadata.get(k)
        if sm is None:
            raise CheckpointError(f"{ckpt_dir}: has no entry '{k}' (saved by a different model or dlrmctl version?)")
        if hasattr(v, "size") and callable(v.size) and getattr(sm, "size", None) is not None and tuple(sm.size) != tuple(v.size()):
            raise CheckpointError(
                f"{ckpt_dir}: '{k}' was saved with shape {list(sm.size)}, the model has {list(v.size())}"
            )
    _, LoadPlanner = _planners()
    cm = _quiet()
    try:
        dcp.load(state, storage_reader=reader, planner=LoadPlanner(), process_group=process_group,
                 no_dist=world_size <= 1)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        _raise_from_dcp(e, ckpt_dir)
    finally:
        cm.__exit__(None, None, None)
    return state


def copy_run_files(src_run: str, dst_run: str, names: Sequence[str] = ("config.yaml", "data_meta.json")) -> None:
    """Copy a run's small descriptive files (for a resharded copy of a run)."""
    os.makedirs(dst_run, exist_ok=True)
    for n in names:
        p = os.path.join(src_run, n)
        if os.path.exists(p) and os.path.abspath(p) != os.path.abspath(os.path.join(dst_run, n)):
            shutil.copy2(p, os.path.join(dst_run, n))



# -------------------------------------------------------------- reshard
def reshard_rank(src_ckpt: str, out_run: str, rank: int, world_size: int, plan: Any = None,
                 process_group: Any = None, name: str | None = None, publish_latest: bool = True) -> str:
    """One rank of an offline reshard: read this rank's slices of ``src_ckpt`` under ``plan``
    and write them as a checkpoint of ``world_size`` ranks in ``out_run``.  Collective.

    No model is built: the keys come from the checkpoint.  Each rank allocates
    only its target shards (data_parallel tables and the dense / object entries:
    rank 0 only).  Moments follow :func:`dlrmctl.train.loop.embedding_load_request`'s
    rule (exact per row / element; column shards get their own moment when the
    column split is unchanged, else the row's).  Rank ``r`` keeps the saving job's
    rank-``r`` RNG states (rank 0's for new ranks).

    Args:
        plan: :class:`~dlrmctl.distributed.types.ShardingPlan` for ``world_size`` ranks;
            None: unsharded (every table whole, world size 1).

    Returns:
        the new checkpoint directory.
    """
    from collections import defaultdict

    from dlrmctl.distributed.types import ShardingType

    meta = load_checkpoint_meta(src_ckpt)
    md = read_metadata(src_ckpt, meta)
    saved = md.state_dict_metadata
    tables: dict[str, list[int]] = meta["tables"]

    def alloc(key: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        m = saved[key]
        return torch.empty(tuple(m.size) if shape is None else tuple(shape), dtype=m.properties.dtype)

    load: dict[str, Any] = {}
    save: dict[str, Any] = {}
    lblocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    sblocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    for t, (R, D) in tables.items():
        ps = None if plan is None else plan.plan[t]
        wkey = f"emb/{t}/weight"
        skeys = sorted(k for k in saved if k.startswith(f"emb/{t}/state") and "@" not in k)
        if ps is None or ps.sharding_type == ShardingType.DATA_PARALLEL:
            if rank == 0:
                for k in [wkey, *skeys]:
                    load[k] = save[k] = alloc(k)
            continue
        rows_of: dict[tuple[str, int, int], torch.Tensor] = {}
        for sh in ps.shards or []:
            (r0, c0), (nr, nc) = sh.offsets, sh.sizes
            if sh.rank != rank or nr == 0 or nc == 0:
                continue
            w = alloc(wkey, (nr, nc))
            lblocks[(wkey, (R, D))].append(((r0, c0), w))
            sblocks[(wkey, (R, D))].append(((r0, c0), w))
            for k in skeys:
                if len(saved[k].size) == 2:
                    x = alloc(k, (nr, nc))
                    lblocks[(k, (R, D))].append(((r0, c0), x))
                    sblocks[(k, (R, D))].append(((r0, c0), x))
                    continue
                exact = f"{k}@cols{c0}-{c0 + nc}"

                def rows() -> torch.Tensor:
                    if (k, r0, nr) not in rows_of:
                        rows_of[(k, r0, nr)] = alloc(k, (nr,))
                        lblocks[(k, (R,))].append(((r0,), rows_of[(k, r0, nr)]))
                    return rows_of[(k, r0, nr)]

                if c0 == 0:
                    sblocks[(k, (R,))].append(((r0,), rows()))
                if nc != D:
                    if exact in saved:
                        x = alloc(k, (nr,))
                        lblocks[(exact, (R,))].append(((r0,), x))
                    else:
                        x = rows()
                    sblocks[(exact, (R,))].append(((r0,), x))
    for (k, size), bl in lblocks.items():
        load[k] = Blocks(size, bl)
    for (k, size), bl in sblocks.items():
        save[k] = Blocks(size, bl)
    if rank == 0:
        for k, m in saved.items():
            if k.startswith(("emb/", "rank/")):
                continue
            load[k] = save[k] = alloc(k) if getattr(m, "size", None) is not None else None
    src_rank = rank if rank < int(meta["world_size"]) else 0
    load[f"rank/{src_rank}"] = None
    load_checkpoint(src_ckpt, load, process_group, world_size, meta)
    for k in list(save):
        if save[k] is None:
            save[k] = load[k]
    save[f"rank/{rank}"] = load[f"rank/{src_rank}"]
    extra = {k: v for k, v in meta.items() if k not in ("format", "step", "world_size", "files")}
    extra.update(plan=None if plan is None else plan.to_dict(),
                 resharded_from={"checkpoint": os.path.abspath(src_ckpt), "world_size": meta["world_size"]})
    return save_checkpoint(out_run, int(meta["step"]), save, rank, world_size, process_group, keep_last=0,
                           publish_latest=publish_latest,
                           extra_meta=extra, name=name)
