"""Reading a checkpoint: :func:`read_metadata` (DCP ``Metadata``, verified, safely unpickled) and
:func:`load_checkpoint` (fills tensors / :class:`Blocks` in place, each rank reading its rows only)."""

from __future__ import annotations

from typing import Any

import torch

from dlrmctl.train.checkpoint.codec import dcp_planners
from dlrmctl.train.checkpoint.format import CheckpointError
from dlrmctl.train.checkpoint.save import quiet_dcp
from dlrmctl.train.checkpoint.storage import dcp_reader
from dlrmctl.train.checkpoint.store import load_checkpoint_meta


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


def read_metadata(ckpt_dir: str, meta: dict[str, Any] | None = None, counter: dict[str, int] | None = None) -> Any:
    """The DCP ``Metadata`` of a checkpoint (``state_dict_metadata``: key -> storage metadata),
    verified and unpickled with DCP's metadata classes only (see :class:`SafeUnpickler`).

    Raises:
        CheckpointError: ``.metadata`` missing, truncated, corrupted or holding other objects.
    """
    meta = meta or load_checkpoint_meta(ckpt_dir)
    return dcp_reader(ckpt_dir, meta, counter).read_metadata()


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
    reader = dcp_reader(ckpt_dir, meta, counter, metadata)
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
    _, LoadPlanner = dcp_planners()
    cm = quiet_dcp()
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


