"""The awaitables of asynchronous collectives and the small collectives of
:mod:`dlrmctl.distributed.comm` (all-reduce, broadcast, barrier, object collectives, all-gather,
the evaluation's ring shift), and torch's flat all-gather / reduce-scatter under one name each."""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import torch
import torch.distributed as dist



T = TypeVar("T")

# torch 2.13 renamed the flat collectives (``*_into_tensor`` / ``*_tensor`` are deprecated aliases)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Awaitable(Generic[T]):
    """A result that becomes available on :meth:`wait` (TorchRec's name)."""

    def wait(self) -> T:  # pragma: no cover - interface
        raise NotImplementedError


class DoneAwaitable(Awaitable[T]):
    """An already available value."""

    def __init__(self, value: T) -> None:
        self._value = value

    def wait(self) -> T:
        return self._value


class LazyAwaitable(Awaitable[T]):
    """Waits on collective ``works`` then runs ``fn`` once (result cached)."""

    def __init__(self, works: Sequence[object], fn: Callable[[], T]) -> None:
        self._works = [w for w in works if w is not None]
        self._fn = fn
        self._done = False
        self._value: T | None = None

    def wait(self) -> T:
        if not self._done:
            for w in self._works:
                w.wait()  # type: ignore[attr-defined]
            self._value = self._fn()
            self._done = True
            self._fn = None  # type: ignore[assignment]
        return self._value  # type: ignore[return-value]


def world_of(pg: dist.ProcessGroup | None) -> int:
    """0 without a group (every helper is then a no-op), else the group's size (1 runs the real collectives)."""
    return 0 if pg is None else dist.get_world_size(pg)


# --------------------------------------------------------- small collectives
def default_group() -> dist.ProcessGroup | None:
    """The default (world) group when one is initialised, else ``None``."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def all_reduce(t: torch.Tensor, pg: dist.ProcessGroup | None, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``t`` (on the group's device); ``op``: ``sum`` | ``max`` | ``min``.

    Returns the work handle with ``async_op`` (else ``None``)."""
    if pg is None:
        return None
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    return dist.all_reduce(t, op=ops[op], group=pg, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place broadcast of ``t`` from global rank ``src``; returns ``t``."""
    if pg is not None:
        dist.broadcast(t, src=src, group=pg)
    return t


def barrier(pg: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``pg`` (no-op without a group)."""
    if pg is not None:
        dist.barrier(group=pg)


def broadcast_object(obj: T, src: int, pg: dist.ProcessGroup | None) -> T:
    """A picklable object from rank ``src`` to every rank (only ``src``'s ``obj`` is read)."""
    if pg is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=pg)
    return box[0]


def all_gather_object(obj: T, pg: dist.ProcessGroup | None) -> list[T]:
    """Every rank's picklable ``obj``, in rank order (small objects only: file lists, ...)."""
    if pg is None:
        return [obj]
    out: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def group_rank_size(pg: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank in pg, size of pg)``; ``(0, 1)`` without a group."""
    if pg is None:
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def all_gather_tensor(t: torch.Tensor, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``t`` (same shape and dtype on every rank), stacked in rank order.

    Returns:
        ``[W, *t.shape]`` on ``t``'s device (``[1, *t.shape]`` without a group).
    """
    if pg is None:
        return t.unsqueeze(0)
    t = t.contiguous()
    out = t.new_empty((dist.get_world_size(pg), *t.shape))
    all_gather_flat(out.view(-1), t.view(-1), group=pg)
    return out


def ring_shift(t: torch.Tensor, recv_rows: int, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """Send ``t [n, ...]`` to the next rank of the ring and receive the previous rank's rows.

    Rank ``r`` sends to ``(r + 1) mod W`` and receives from ``(r - 1) mod W`` (group ranks),
    point to point (``batch_isend_irecv``: one NCCL group call, no send/recv ordering deadlock).
    ``n`` may differ per rank; the receiver must know the count it gets (``recv_rows``, e.g.
    from an all-gather of the counts).  Empty sends and receives are skipped on both sides.
    ``W - 1`` shifts bring every rank's rows to every rank while each rank holds two buffers.

    Args:
        t: ``[n, *rest]`` on the group's device; recv_rows: rows the previous rank sends.

    Returns:
        ``[recv_rows, *rest]`` (``t`` itself without a group or with one rank).
    """
    if pg is None or dist.get_world_size(pg) == 1:
        return t
    ws, me = dist.get_world_size(pg), dist.get_rank(pg)
    out = t.new_empty((recv_rows, *t.shape[1:]))
    ops = []
    if t.shape[0]:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), group=pg, group_peer=(me + 1) % ws))
    if recv_rows:
        ops.append(dist.P2POp(dist.irecv, out, group=pg, group_peer=(me - 1) % ws))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out
