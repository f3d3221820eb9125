"""Run-directory checkpoints in the ``torch.distributed.checkpoint`` (DCP) format.

Layout::

    runs/<name>/checkpoints/step_00000100/
        __0_0.distcp ...  DCP data files: each rank writes its own embedding shards
                          (no rank ever gathers a table) and a share of the
                          replicated tensors (DCP de-duplicates them); every
                          chunk is a torch.save record (stored zip, row-major)
        .metadata         DCP metadata (pickled by DCP): every key's global shape
                          and saved chunks, and where each chunk lies in the files
        meta.json         format, step, world_size, table shapes, plan, byteorder and,
                          per file above: bytes, block_bytes, the CRC-32 of every
                          block (base64 of little-endian uint32) and, per chunk,
                          the offset of its raw tensor bytes; ``files_crc32``: the
                          CRC-32 of that file table as canonical JSON (written last)
    runs/<name>/checkpoints/LATEST   name of the newest complete checkpoint
    runs/<name>/checkpoints/BEST     name of the checkpoint with the best validation metric
                                     (``train.keep_best``; never pruned by ``keep_last``)

Keys of the DCP state dict (the format; see ``dlrmctl.train.checkpoint_state.checkpoint_state``)::

    emb/<table>/weight              [rows, dim]  chunks = the shards of the plan that saved it
    emb/<table>/state<i>            i-th embedding-optimizer moment: [rows] (row-wise
                                    Adagrad; partial row-wise Adam / LAMB's state1) or
                                    [rows, dim] (Adagrad; Adam / LAMB state0, state1;
                                    partial row-wise state0), sharded like the rows
    emb/<table>/state<i>@cols<a>-<b> [rows]  column-wise tables only: the row-wise moment
                                    of the column shard [a, b) (each column shard has its own)
    dense/<name>                    MLP / interaction parameters and buffers (replicated)
    dense_opt/<param>/<key>         dense-optimizer state tensors (replicated)
    meta/<name>                     JSON (uint8 tensor, see :func:`pack`): trainer (step,
                                    epoch, best, data position), fused optimizer hyper-
                                    parameters (type, lr, eps, weight_decay, step), dense and
                                    embedding-dense optimizer param_groups (lr, betas, eps,
                                    ...), LR schedule
    rank/<r>                        JSON per-rank entries: RNG states (torch, numpy, python,
                                    cuda), per-shard scalar optimizer state

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

Atomicity: a save goes to ``.step_XXXXXXXX.tmp/``; each rank's file is checksummed
while DCP writes it (never read back); after every rank has written (DCP's final
barrier) rank 0 gathers the checksums, writes ``meta.json``, renames the
directory and rewrites ``LATEST`` via temp file + ``os.replace``.  A crash (even SIGKILL) at any point leaves the previous
checkpoint and ``LATEST`` intact; ``keep_last`` older checkpoints are pruned
only after the new one is visible (the one ``BEST`` names is always kept), and a
published directory is never rewritten (a second save of a step becomes ``step_XXXXXXXX.1``).

Readers and pruning: nothing is locked (a reader's lock file would outlive a killed reader and
block pruning, and no process can tell whether a reader on another host of a shared file system
still lives).  Instead readers go through :func:`read_checkpoint`: a checkpoint pruned while it
is read is noticed by its missing files, ``best`` / ``last`` are resolved again (pruning only
ever follows the publication of a newer complete checkpoint, so they then name one) and read
once more, and a fixed step that went is reported as pruned, not as corrupt.

Integrity without extra reads: a loading rank checks the sizes of the files it
opens, reads of each saved chunk only the rows its blocks overlap (rounded out to
whole checksum blocks, ~1/4096 of a file) and verifies exactly those blocks, so a
truncated file or a damaged block is refused naming the file, the byte range and
the entry, and a reshard reads about the checkpoint once in total, not W times.

Nothing is unpickled: non-tensor entries are JSON, DCP's pickled (``BYTE_IO``)
entries are refused, and ``.metadata`` is read with an unpickler that resolves only
DCP's metadata classes.  Format ``dcp-v1`` (pickled entries, whole-file CRCs) is
refused with its version named.
"""

from __future__ import annotations

import base64
import collections
import errno
import bisect
import glob
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import sys
import warnings
import zlib
from array import array
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from dlrmctl.errors import OS_CONDITIONS, UserError, find_in_chain, free_bytes, interrupt_of, os_errno
from dlrmctl.fileio import write_text_atomic

log = logging.getLogger("dlrmctl.checkpoint")
T = TypeVar("T")

CKPT_DIR = "checkpoints"
FORMAT = "dcp-v2"
#: formats this dlrmctl refuses, with what changed (shown in the error)
OLD_FORMATS = {
    "dcp-v1": "its trainer / optimizer / RNG entries are pickled objects (unpickling a file can run code) and its "
              "checksums cover whole files only",
}
#: checksummed blocks: a read verifies (so reads) every block it overlaps.  A data file gets blocks
#: of ~1/BLOCKS_PER_FILE of its size (a power of two in [MIN_BLOCK_BYTES, BLOCK_BYTES]), so a range
#: read over-reads at most two such blocks and meta.json holds at most ~BLOCKS_PER_FILE CRCs a file
#: (4 bytes each, base64) below BLOCK_BYTES x BLOCKS_PER_FILE = 4 GiB files
BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 4096
BLOCKS_PER_FILE = 4096
LATEST = "LATEST"
BEST = "BEST"


class CheckpointError(RuntimeError, UserError):
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
            # row-major bytes: the reader reads a row range of a saved chunk without loading all of it
            obj = _find(self.state_dict, index)
            return obj.contiguous() if isinstance(obj, torch.Tensor) else obj

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

        def load_bytes(self, read_item, value):  # type: ignore[override]
            # DCP would torch.load(weights_only=False) it: unpickling, which can run code
            raise CheckpointError(f"entry '{read_item.dest_index.fqn}' is a pickled object; dlrmctl does not unpickle")

    return SavePlanner, LoadPlanner


_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _encode(obj: Any, where: str) -> Any:
    """``obj`` as plain JSON values; tuples, non-string-keyed dicts, tensors and numeric numpy
    arrays become one-key tagged objects (see :func:`pack`)."""
    if obj is None or isinstance(obj, (bool, str, float)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return _encode(obj.item(), where)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": _b64(raw)}}
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        # tobytes() is C order for any layout; obj.shape, not np.ascontiguousarray's (which makes 0-d 1-d)
        return {"__ndarray__": {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": _b64(obj.tobytes(order="C"))}}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: _encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__dict__": [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"checkpoint entry {where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored "
                    "(JSON values only: None, bool, int, float, str, list, tuple, dict, tensors, numeric numpy arrays)")


def _decode(x: Any) -> Any:
    """Inverse of :func:`_encode`: builds only JSON values, tuples, dicts, tensors and numpy arrays."""
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, v), = x.items()
        if tag == "__tuple__":
            return tuple(_decode(e) for e in v)
        if tag == "__dict__":
            return {_decode(k): _decode(e) for k, e in v}
        if tag == "__tensor__":
            dtype = getattr(torch, str(v["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown tensor dtype {v['dtype']!r}")
            raw = base64.b64decode(v["data"], validate=True)
            if not raw:
                return torch.empty(v["shape"], dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(v["shape"])
        if tag == "__ndarray__":
            dt = np.dtype(str(v["dtype"]))
            if dt.kind not in "biufc":
                raise ValueError(f"numpy dtype {v['dtype']!r} is not numeric")
            return np.frombuffer(base64.b64decode(v["data"], validate=True), dtype=dt).reshape(v["shape"]).copy()
    return {k: _decode(e) for k, e in x.items()}


def pack(obj: Any, where: str = "object") -> torch.Tensor:
    """A non-tensor entry (trainer state, optimizer hyper-parameters, RNG states, data position) as a
    1-D ``uint8`` tensor of UTF-8 JSON: DCP stores it like any tensor, and loading it never unpickles.

    JSON plus one-key tags: ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (keys that
    are not strings), ``{"__tensor__": {dtype, shape, data}}`` and ``{"__ndarray__": {dtype, shape,
    data}}`` (``data``: base64 of the little-/native-endian bytes).  Floats round-trip exactly
    (``repr``), ``nan`` / ``inf`` included; numpy scalars become Python numbers.

    Raises:
        TypeError: a value of another type (names where in ``obj``, prefixed by ``where``).
    """
    text = json.dumps(_encode(obj, where), separators=(",", ":"), allow_nan=True)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def unpack(t: Any, where: str = "checkpoint entry") -> Any:
    """Inverse of :func:`pack` (``t``: the loaded ``uint8`` tensor).

    Raises:
        CheckpointError: ``t`` is not a packed entry (e.g. pickled bytes of an older format) or
            its JSON is damaged.
    """
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        raise CheckpointError(f"{where}: expected a packed JSON entry (1-D uint8 tensor), got {type(t).__name__}; "
                              "pickled entries (format dcp-v1) are not loaded")
    try:
        return _decode(json.loads(t.numpy().tobytes().decode("utf-8")))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: damaged JSON entry ({type(e).__name__}: {e})") from e


# ------------------------------------------------------------ run dirs
def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_DIR)


def _marked(run_dir: str, marker: str) -> str | None:
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
            raise CheckpointError(f"{run_dir}: no checkpoint (checkpoints/{LATEST} is missing)")
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
                            "reading the one %s names now", label, path, "LATEST" if "last" in label else "BEST")
                continue
            how = ("; choose a newer one (--checkpoint last)" if not moving
                   else ": the run is saving checkpoints faster than this read; retry")
            raise CheckpointError(
                f"checkpoint {label} ({path}) was removed by the run's pruning (train.keep_last_checkpoints) "
                f"while it was being read{how}") from None
    raise AssertionError("unreachable")  # pragma: no cover


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


# ------------------------------------------------------ checksummed I/O
def _block_count(nbytes: int, block_bytes: int) -> int:
    return (nbytes + block_bytes - 1) // block_bytes


def _crcs_to_text(crcs: Sequence[int]) -> str:
    a = array("I", crcs)
    if sys.byteorder != "little":
        a.byteswap()
    return _b64(a.tobytes())


def _crcs_from_text(text: str) -> array:
    a = array("I")
    a.frombytes(base64.b64decode(text, validate=True))
    if sys.byteorder != "little":
        a.byteswap()
    return a


def _zip_name_len(h: bytes | bytearray) -> int:
    """File-name length of a zip local file header."""
    return int.from_bytes(h[26:28], "little")


class _ChecksumStream:
    """Write-side wrapper of a DCP output file: CRC-32 of every ``block_bytes`` block of what is
    written (from the bytes in memory: the file is never read back) and, for each tensor DCP
    serialises with ``torch.save``, where its raw bytes lie in the file.

    ``torch.save`` writes a zip archive with stored (uncompressed) records, each as a local
    header (30 bytes), the name, an extra field, the data and a data descriptor, in separate
    writes; the record ``<archive>/data/0`` holds the tensor's storage (row-major: the planner
    saves contiguous tensors).  ``tensor_data`` lists ``(start, end)`` file offsets of each such
    record's data whose descriptor confirms its length; anything else is left out (its item is
    then read whole).
    """

    def __init__(self, raw: Any, block_bytes: int) -> None:
        self.raw, self.block_bytes = raw, block_bytes
        self.pos = 0
        self.crcs: list[int] = []
        self._crc, self._fill = 0, 0
        self.tensor_data: list[tuple[int, int]] = []
        self._hdr: bytearray | None = None
        self._hdr_at = 0
        self._data_at: int | None = None
        self.finished = False

    # zip record tracking (see the class docstring)
    def _track(self, mv: memoryview) -> None:
        n = len(mv)
        if self._data_at is not None and n in (16, 24) and mv[:4] == b"PK\x07\x08":
            if n == 16:
                comp, size = int.from_bytes(mv[8:12], "little"), int.from_bytes(mv[12:16], "little")
            else:
                comp, size = int.from_bytes(mv[8:16], "little"), int.from_bytes(mv[16:24], "little")
            if comp == size == self.pos - self._data_at:
                self.tensor_data.append((self._data_at, self.pos))
            self._data_at = None
            return
        if n >= 4 and mv[:4] == b"PK\x03\x04":
            self._hdr, self._hdr_at, self._data_at = bytearray(), self.pos, None
        if self._hdr is None:
            return

        def name_len() -> int:
            return _zip_name_len(self._hdr)

        # the header and the name, over one or several writes
        take = mv[: max(0, (30 if len(self._hdr) < 30 else 30 + name_len()) - len(self._hdr))]
        self._hdr += take
        if len(self._hdr) == 30 and len(take) < n:
            self._hdr += mv[len(take): len(take) + name_len()]
        if len(self._hdr) >= 30 and len(self._hdr) == 30 + name_len():
            h, self._hdr = self._hdr, None
            nl, extra_len, method = _zip_name_len(h), int.from_bytes(h[28:30], "little"), int.from_bytes(h[8:10], "little")
            if method == 0 and bytes(h[30:30 + nl]).endswith(b"/data/0"):
                self._data_at = self._hdr_at + 30 + nl + extra_len

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._track(mv)
        self.raw.write(mv)
        i, B = 0, self.block_bytes
        while i < n:
            take = min(B - self._fill, n - i)
            self._crc = zlib.crc32(mv[i:i + take], self._crc)
            self._fill += take
            i += take
            if self._fill == B:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        self.raw.flush()  # DCP fsyncs fileno(): the buffered bytes must be in the file first
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            if self._fill:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.raw.close()

    def digest(self) -> dict[str, Any]:
        """``{"bytes", "block_bytes", "crc32"}``: size, block size and the blocks' CRC-32s (base64 of
        little-endian uint32)."""
        return {"bytes": self.pos, "block_bytes": self.block_bytes, "crc32": _crcs_to_text(self.crcs)}


def _block_bytes_for(nbytes: int) -> int:
    """Block size for a file of about ``nbytes`` (see :data:`BLOCKS_PER_FILE`)."""
    want = max(1, -(-nbytes // BLOCKS_PER_FILE))
    return min(BLOCK_BYTES, max(MIN_BLOCK_BYTES, 1 << (want - 1).bit_length()))


def _writer(path: str):
    """A DCP ``FileSystemWriter`` (one file per rank, fsynced) whose files are checksummed while they
    are written; after ``dcp.save``, ``writer.files`` holds this rank's ``{file: digest}`` (the
    coordinator's includes ``.metadata``), each data file's digest with ``tensors``: ``{item offset:
    offset of the tensor's raw bytes within the item}``."""
    import contextlib
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.planner import WriteItemType

    def _nbytes(item: Any) -> int:
        td = item.tensor_data
        return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)

    class ChecksumFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.streams: dict[str, _ChecksumStream] = {}
            self.block_bytes = BLOCK_BYTES

        @contextlib.contextmanager
        def create_stream(self, path, mode):  # type: ignore[override]
            if "w" not in mode:
                with super().create_stream(path, mode) as f:
                    yield f
                return
            name = Path(path).name
            with open(path, mode) as f:
                st = _ChecksumStream(f, self.block_bytes)
                self.streams[name.removesuffix(".tmp")] = st  # .metadata is written as .metadata.tmp, then renamed
                try:
                    yield st
                finally:
                    st.close()

    class ChecksumWriter(dcp.FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = ChecksumFileSystem()
            self.path = self.fs.init_path(path)
            self.files: dict[str, dict[str, Any]] = {}

        def write_data(self, plan, planner):  # type: ignore[override]
            # one file per rank: its size is about the items' bytes (+ ~1 KiB of torch.save framing each)
            est = sum(_nbytes(it) + 1024 for it in plan.items if it.tensor_data is not None)
            self.fs.block_bytes = _block_bytes_for(est)
            fut = super().write_data(plan, planner)
            items = {it.index: it for it in plan.items}
            for wr in fut.wait():
                sd = wr.storage_data
                st = self.fs.streams[sd.relative_path]
                d = self.files.setdefault(sd.relative_path, {**st.digest(), "tensors": {}})
                item = items.get(wr.index)
                if item is None or item.type == WriteItemType.BYTE_IO or sd.transform_descriptors:
                    continue
                # the first tensor record starting inside this item (records are in file order)
                i = bisect.bisect_left(st.tensor_data, (sd.offset, -1))
                if i < len(st.tensor_data):
                    a, e = st.tensor_data[i]
                    if e <= sd.offset + sd.length and e - a == _nbytes(item):
                        d["tensors"][str(sd.offset)] = a - sd.offset
            return fut

        def finish(self, metadata, results) -> None:  # type: ignore[override]
            self.fs.block_bytes = BLOCK_BYTES  # .metadata is always read whole
            super().finish(metadata, results)
            self.files[".metadata"] = self.fs.streams[".metadata"].digest()

    return ChecksumWriter()


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` only: globals are limited to DCP's metadata classes, torch
    dtypes / ``Size`` / layouts and paths, so a crafted file cannot call anything else."""

    ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not one of DCP's metadata classes")


#: the largest piece of a saved chunk read at once (bytes): rows are read, verified and copied into
#: their target slab by slab, so loading a table never holds a second copy of it
READ_SLAB_BYTES = 64 << 20


class _CheckedFile:
    """Reads byte ranges of one checkpoint file, verifying every block they overlap against the
    block CRC-32s in meta.json; counts the bytes read (``counter["bytes_read"]``)."""

    def __init__(self, ckpt_dir: str, fname: str, meta: dict[str, Any], counter: dict[str, int]) -> None:
        self.path = p = os.path.join(ckpt_dir, fname)
        exp = meta["files"].get(fname)
        if exp is None:
            raise CheckpointError(f"{p}: not listed in {os.path.join(ckpt_dir, 'meta.json')}")
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: missing (meta.json lists it with {exp['bytes']} bytes)")
        self.size = os.path.getsize(p)
        if self.size != exp["bytes"]:
            raise CheckpointError(f"{p}: {self.size} bytes, expected {exp['bytes']}: the file is truncated or corrupted")
        self.block_bytes = int(exp["block_bytes"])
        try:
            self.crcs = _crcs_from_text(exp["crc32"])
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: damaged checksums of {fname} ({e})") from e
        if len(self.crcs) != _block_count(self.size, self.block_bytes):
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: {len(self.crcs)} block checksums for {fname}, "
                                  f"expected {_block_count(self.size, self.block_bytes)}")
        self.tensors: dict[str, int] = exp.get("tensors", {})
        self.counter = counter
        self._f: Any = None

    def __enter__(self) -> "_CheckedFile":
        self._f = open(self.path, "rb")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def read(self, start: int, end: int, what: str = "") -> torch.Tensor:
        """Bytes ``[start, end)`` of the file as a 1-D ``uint8`` tensor whose first byte is 64-byte
        aligned (so ``.view(dtype)`` is aligned), after checking the CRC-32 of every block they overlap.

        Raises:
            CheckpointError: the range is outside the file, the file is shorter than recorded, or a
                block's CRC differs (names the file, the byte range of the block and ``what``).
        """
        if start == end:
            return torch.empty(0, dtype=torch.uint8)
        if not 0 <= start < end <= self.size:
            raise CheckpointError(f"{self.path}: {what} at bytes {start}-{end} lies outside the file ({self.size} bytes)")
        B = self.block_bytes
        b0, b1 = start // B, _block_count(end, B)
        lo, hi = b0 * B, min(b1 * B, self.size)
        pad = -(start - lo) % 64
        buf = torch.empty(pad + hi - lo, dtype=torch.uint8)
        mv = memoryview(buf.numpy())[pad:]
        self._f.seek(lo)
        n = self._f.readinto(mv)
        self.counter["bytes_read"] = self.counter.get("bytes_read", 0) + n
        if n != hi - lo:
            raise CheckpointError(f"{self.path}: ended at byte {lo + n}, expected {self.size}: the file is truncated")
        for i in range(b0, b1):
            s, e = (i - b0) * B, min((i - b0 + 1) * B, hi - lo)
            got = zlib.crc32(mv[s:e])
            if got != self.crcs[i]:
                raise CheckpointError(
                    f"{self.path}: bytes {lo + s}-{lo + e} (block {i} of {len(self.crcs)}{', ' + what if what else ''}): "
                    f"CRC-32 {got:#010x}, expected {self.crcs[i]:#010x}: the file is corrupted")
        return buf[pad + start - lo: pad + end - lo]


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
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in glob.glob(os.path.join(root, ".step_*.tmp")):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    if dist_on:
        comm.barrier(process_group)
    SavePlanner, _ = _planners()
    writer = _writer(tmp)
    try:  # until the rename, a failure (full disk, Ctrl-C) removes the partial directory: LATEST and the
        # last complete checkpoint are untouched (see _save_failed)
        cm = _quiet()
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
            meta.update(files=files, files_crc32=_files_crc(files))
            write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
            _fsync_dir(tmp)
            os.replace(tmp, final)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _save_failed(e, run_dir, tmp, final, rank, _state_nbytes(state))
    if rank == 0:
        _fsync_dir(root)
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
    _check_files_entry(p, meta.get("files"))
    if "files_crc32" in meta and meta["files_crc32"] != _files_crc(meta["files"]):  # absent: written before it
        raise CheckpointError(f"{p}: corrupted: its file table (sizes, block checksums, raw data offsets) does "
                              f"not match its CRC-32 files_crc32 ({meta['files_crc32']!r})")
    return meta


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
            f = _CheckedFile(ckpt_dir, fname, meta, counter)
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


def _files_crc(files: dict[str, Any]) -> int:
    """CRC-32 of meta.json's ``files`` table as canonical JSON: the reader trusts the sizes, block
    checksums and raw data offsets it holds, so they are checked themselves (``files_crc32``)."""
    return zlib.crc32(json.dumps(files, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _check_files_entry(p: str, files: Any) -> None:
    """Check the shape of meta.json's ``files`` (what the verifying reader trusts): a dict of file name ->
    ``{"bytes": int >= 0, "block_bytes": int >= 1, "crc32": str, "tensors"?: {str: int >= 0}}``.

    Raises:
        CheckpointError: naming ``p``, the file entry and the field that is missing or of another type.
    """
    def nat(v: Any, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{p}: corrupted ('files' must map each checkpoint file, .metadata included, "
                              f"to its size and checksums; got {type(files).__name__})")
    for name, e in files.items():
        bad = None
        if not isinstance(e, dict):
            bad = f"a JSON {type(e).__name__}, expected an object"
        elif not nat(e.get("bytes"), 0):
            bad = f"'bytes' is {e.get('bytes')!r}, expected an integer >= 0"
        elif not nat(e.get("block_bytes"), 1):
            bad = f"'block_bytes' is {e.get('block_bytes')!r}, expected an integer >= 1"
        elif not isinstance(e.get("crc32"), str):
            bad = f"'crc32' is a {type(e.get('crc32')).__name__}, expected base64 text"
        elif "tensors" in e and not (isinstance(e["tensors"], dict)
                                     and all(isinstance(k, str) and nat(v, 0) for k, v in e["tensors"].items())):
            bad = "'tensors' must map item offsets (text) to raw data offsets (integers >= 0)"
        if bad:
            raise CheckpointError(f"{p}: corrupted entry for file {name!r}: {bad}")


def _reader(ckpt_dir: str, meta: dict[str, Any], counter: dict[str, int] | None = None, metadata: Any = None):
    """A DCP ``FileSystemReader`` that verifies exactly what it reads and never unpickles data.

    ``.metadata``: read once, checked against its block CRCs, loaded with :class:`_SafeUnpickler`.
    Data: for each ``ReadItem`` (the part of one saved chunk that overlaps a requested block) it
    reads only the rows ``[storage_offsets[0], + lengths[0])`` of the chunk's raw bytes (the
    ``tensors`` offsets in meta.json), rounded out to whole ``block_bytes`` blocks, checks those
    blocks' CRC-32s, and copies the overlap into the target; a tensor whose raw offset is unknown
    is read whole and loaded with ``torch.load(weights_only=True)``.  Pickled (``BYTE_IO``) items
    are refused.  ``counter["bytes_read"]`` adds up the bytes read from the checkpoint's files.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    counter = {} if counter is None else counter
    if meta.get("byteorder", "little") != sys.byteorder:
        raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: written on a {meta.get('byteorder')}-endian "
                              f"machine; this one is {sys.byteorder}-endian")

    class VerifyingReader(dcp.FileSystemReader):
        def __init__(self) -> None:
            super().__init__(ckpt_dir)
            self.counter = counter
            self._md: Any = metadata

        def read_metadata(self, *args: Any, **kwargs: Any):  # type: ignore[override]
            if self._md is None:
                with _CheckedFile(ckpt_dir, ".metadata", meta, counter) as f:
                    raw = f.read(0, f.size, "DCP metadata")
                p = os.path.join(ckpt_dir, ".metadata")
                try:
                    md = _SafeUnpickler(io.BytesIO(raw.numpy().tobytes())).load()
                except Exception as e:
                    raise CheckpointError(f"{p}: cannot be read ({type(e).__name__}: {e})") from e
                if not isinstance(md, Metadata):
                    raise CheckpointError(f"{p}: holds a {type(md).__name__}, not DCP Metadata")
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                self._md = md
            self._md.storage_meta.load_id = self.load_id
            return self._md

        def read_data(self, plan, planner):  # type: ignore[override]
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            try:
                for rel, reqs in per_file.items():
                    reqs.sort(key=lambda r: (self.storage_data[r.storage_index].offset, tuple(r.storage_offsets)))
                    with _CheckedFile(ckpt_dir, rel, meta, counter) as f:
                        for req in reqs:
                            self._read_item(f, req, planner, LoadItemType)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{ckpt_dir}: reading the data files failed ({type(e).__name__}: {e})") from e
            fut: Any = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _read_item(self, f: _CheckedFile, req: Any, planner: Any, LoadItemType: Any) -> None:
            fqn = req.storage_index.fqn
            sinfo = self.storage_data[req.storage_index]
            what = f"'{fqn}' chunk at {list(req.storage_index.offset or [])}"
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{f.path}: {what} is a pickled object; dlrmctl does not unpickle checkpoint data")
            if sinfo.transform_descriptors:
                raise CheckpointError(f"{f.path}: {what} uses DCP stream transforms {sinfo.transform_descriptors}")
            tmd = self.read_metadata().state_dict_metadata[fqn]
            off = tuple(req.storage_index.offset or ())
            chunk = next((c for c in tmd.chunks if tuple(c.offsets) == off), None)
            data_at = f.tensors.get(str(sinfo.offset))
            if chunk is None or data_at is None:  # read the item whole (weights_only: no code runs)
                raw = f.read(sinfo.offset, sinfo.offset + sinfo.length, what)
                t = torch.load(io.BytesIO(raw.numpy().tobytes()), map_location="cpu", weights_only=True)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    t = t.narrow(d, o, n)
            else:
                shape, dtype = list(chunk.sizes), tmd.properties.dtype
                if not shape:
                    r0, nr, row = 0, 1, torch._utils._element_size(dtype)
                else:
                    r0, nr = int(req.storage_offsets[0]), int(req.lengths[0])
                    row = math.prod(shape[1:]) * torch._utils._element_size(dtype)
                full = math.prod(shape) * torch._utils._element_size(dtype)
                if data_at + full > sinfo.length:  # meta.json's raw offset points past the item: damaged
                    raise CheckpointError(
                        f"{f.path}: {what}: meta.json puts its {full} raw bytes at offset {data_at} of an item of "
                        f"{sinfo.length} bytes: {os.path.join(os.path.dirname(f.path), 'meta.json')} is corrupted")
                base = sinfo.offset + data_at
                target = planner.resolve_tensor(req).detach()
                want = [nr, *(int(n) for n in req.lengths[1:])] if shape else []
                if list(target.size()) != want:
                    raise CheckpointError(f"{f.path}: {what}: reads {want}, expected {list(target.size())}")
                # row slabs of <= READ_SLAB_BYTES: a table is never held twice (read buffer + target)
                slab = max(1, READ_SLAB_BYTES // max(row, 1)) if shape else 1
                for s in range(0, nr, slab):
                    k = min(slab, nr - s)
                    raw = f.read(base + (r0 + s) * row, base + (r0 + s + k) * row, what)
                    t = raw.view(dtype).reshape([k, *shape[1:]] if shape else [])
                    for d in range(1, len(shape)):
                        t = t.narrow(d, int(req.storage_offsets[d]), int(req.lengths[d]))
                    (target.narrow(0, s, k) if shape else target).copy_(t)
                planner.commit_tensor(req, target)
                return
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise CheckpointError(f"{f.path}: {what}: read {list(t.size())}, expected {list(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)

    return VerifyingReader()


def read_metadata(ckpt_dir: str, meta: dict[str, Any] | None = None, counter: dict[str, int] | None = None) -> Any:
    """The DCP ``Metadata`` of a checkpoint (``state_dict_metadata``: key -> storage metadata),
    verified and unpickled with DCP's metadata classes only (see :class:`_SafeUnpickler`).

    Raises:
        CheckpointError: ``.metadata`` missing, truncated, corrupted or holding other objects.
    """
    meta = meta or load_checkpoint_meta(ckpt_dir)
    return _reader(ckpt_dir, meta, counter).read_metadata()


def saved_size(md: Any, key: str) -> torch.Size | None:
    """Global shape of a saved tensor key (None: absent or not a tensor)."""
    m = md.state_dict_metadata.get(key)
    return getattr(m, "size", None)


def load_checkpoint(ckpt_dir: str, state: dict[str, Any], process_group: Any = None, world_size: int = 1,
                    meta: dict[str, Any] | None = None, counter: dict[str, int] | None = None,
                    metadata: Any = None) -> dict[str, Any]:
    """Fill ``state`` (``key -> Tensor | Blocks | None``) from a checkpoint.  Collective.

    Tensors and :class:`Blocks` are filled in place: each rank reads, and verifies, only the rows
    of the saved chunks that overlap its blocks (whole ``BLOCK_BYTES`` blocks at the ends).
    ``None`` placeholders are replaced by the saved tensor (``meta/`` and ``rank/`` entries: pass
    them to :func:`unpack`).  ``counter["bytes_read"]`` (when given) adds up the bytes this rank
    read from the checkpoint's files.  ``metadata``: this checkpoint's DCP ``Metadata`` from
    :func:`read_metadata` (not read again).

    Raises:
        CheckpointError: a file is missing, truncated or corrupted (named, with the damaged byte
            range), a key is missing, a saved shape differs from the requested one, or an entry
            is a pickled object (not loaded).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    meta = meta or load_checkpoint_meta(ckpt_dir)
    reader = _reader(ckpt_dir, meta, counter, metadata)
    md = reader.read_metadata()
    for k, v in list(state.items()):
        sm = md.state_dict_metadata.get(k)
        if sm is None:
            raise CheckpointError(f"{ckpt_dir}: has no entry '{k}' (saved by a different model or dlrmctl version?)")
        if getattr(sm, "size", None) is None:
            raise CheckpointError(f"{ckpt_dir}: entry '{k}' is a pickled object; dlrmctl does not unpickle checkpoint data")
        if v is None:
            state[k] = torch.empty(tuple(sm.size), dtype=sm.properties.dtype)
        elif hasattr(v, "size") and callable(v.size) and tuple(sm.size) != tuple(v.size()):
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



# ------------------------------------------------------ column-wise key rule
class RowMomentKeys(NamedTuple):
    """Where a per-row moment of one shard goes: ``save``, the keys it is written under;
    ``load``, the key it is read from."""

    save: tuple[str, ...]
    load: str


def row_moment_keys(key: str, col: int, cols: int, dim: int, saved: Any = ()) -> RowMomentKeys:
    """THE column-wise rule for a per-row moment ``key`` (``emb/<t>/state<i>``, ``[rows]``) of a
    shard at column ``col``, ``cols`` wide, of a ``dim``-wide table; used by save, load and
    reshard alike.

    A row-wise moment is one value per row for the whole row; under column-wise sharding each
    column shard keeps its own.  Saved: the shard at column 0 gives ``key`` (the table's
    per-row moment) and every column shard ``[a, b)`` narrower than the table also gives
    ``key@cols<a>-<b>``.  Loaded: ``key@cols<a>-<b>`` when ``saved`` (the checkpoint's keys)
    has it (same column split: exact), else ``key`` (copied into each column shard).
    """
    own = f"{key}@cols{col}-{col + cols}" if cols != dim else None
    save = ((key,) if col == 0 else ()) + ((own,) if own is not None else ())
    return RowMomentKeys(save, own if own is not None and own in saved else key)


# -------------------------------------------------------------- reshard
def reshard_rank(src_ckpt: str, out_run: str, rank: int, world_size: int, plan: Any = None,
                 process_group: Any = None, name: str | None = None, publish_latest: bool = True) -> str:
    """One rank of an offline reshard: read this rank's slices of ``src_ckpt`` under ``plan``
    and write them as a checkpoint of ``world_size`` ranks in ``out_run``.  Collective.

    No model is built: the keys come from the checkpoint.  Each rank allocates
    only its target shards (data_parallel tables and the dense / object entries:
    rank 0 only).  Moments follow :func:`row_moment_keys`, as
    :func:`dlrmctl.train.checkpoint_state.embedding_load_request` does (exact per row / element; column shards get their own moment when the
    column split is unchanged, else the row's).  Rank ``r`` keeps the saving job's
    rank-``r`` RNG states (rank 0's for new ranks).

    I/O: the new checkpoint's meta.json records, under ``resharded_from``, the source's size
    (``bytes``, all files) and the bytes every rank read from it (``bytes_read``, summed, and
    ``bytes_read_per_rank``): each rank reads ``.metadata`` once plus the rows of the saved chunks
    its target blocks overlap, rounded out to whole checksum blocks (:data:`BLOCK_BYTES`).

    Args:
        plan: :class:`~dlrmctl.distributed.types.ShardingPlan` for ``world_size`` ranks;
            None: unsharded (every table whole, world size 1).

    Returns:
        the new checkpoint directory.
    """
    from collections import defaultdict

    from dlrmctl.distributed.types import ShardingType

    from dlrmctl.distributed import comm

    meta = load_checkpoint_meta(src_ckpt)
    counter: dict[str, int] = {"bytes_read": 0}
    md = read_metadata(src_ckpt, meta, counter)
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
                keys = row_moment_keys(k, c0, nc, D, saved)

                def rows() -> torch.Tensor:
                    if (k, r0, nr) not in rows_of:
                        rows_of[(k, r0, nr)] = alloc(k, (nr,))
                        lblocks[(k, (R,))].append(((r0,), rows_of[(k, r0, nr)]))
                    return rows_of[(k, r0, nr)]

                for sk in keys.save:
                    if sk == k:  # the table's per-row moment: the row block this rank reads
                        sblocks[(k, (R,))].append(((r0,), rows()))
                    elif keys.load == sk:  # the shard's own moment, read as saved
                        x = alloc(k, (nr,))
                        lblocks[(sk, (R,))].append(((r0,), x))
                        sblocks[(sk, (R,))].append(((r0,), x))
                    else:  # a new column split: the row's moment
                        sblocks[(sk, (R,))].append(((r0,), rows()))
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
    load_checkpoint(src_ckpt, load, process_group, world_size, meta, counter, md)
    read = [counter["bytes_read"]]
    if world_size > 1:
        read = comm.all_gather_object(counter["bytes_read"], process_group or comm.default_group())
    for k in list(save):
        if save[k] is None:
            save[k] = load[k]
    save[f"rank/{rank}"] = load[f"rank/{src_rank}"]
    extra = {k: v for k, v in meta.items() if k not in ("format", "step", "world_size", "files", "files_crc32")}
    extra.update(plan=None if plan is None else plan.to_dict(),
                 resharded_from={"checkpoint": os.path.abspath(src_ckpt), "world_size": meta["world_size"],
                                 "bytes": sum(int(f["bytes"]) for f in meta["files"].values()),
                                 "bytes_read": int(sum(read)), "bytes_read_per_rank": [int(b) for b in read]})
    return save_checkpoint(out_run, int(meta["step"]), save, rank, world_size, process_group, keep_last=0,
                           publish_latest=publish_latest,
                           extra_meta=extra, name=name)
