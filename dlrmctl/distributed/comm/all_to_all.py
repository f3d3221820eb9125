"""The all-to-alls of :mod:`dlrmctl.distributed.comm`: ids and lengths (``all_to_all_ints``),
a differentiable flat all-to-all (``all_to_all_single``) and the pooled embeddings' output dist of
several groups in one (``pooled_all_to_all``, asynchronous halves for the overlap), with the
quantized wire formats of ``sharding.comm_precision``."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from dlrmctl.distributed.comm.base import Awaitable, LazyAwaitable



# --------------------------------------------------------------- all-to-all
def all_to_all_ints(
    send: torch.Tensor,
    in_splits: Sequence[int],
    out_splits: Sequence[int],
    pg: dist.ProcessGroup | None,
    async_op: bool = False,
) -> tuple[torch.Tensor, object | None]:
    """Flat all-to-all of a 1-D tensor (no autograd).

    Args:
        send: ``[sum(in_splits)]`` tensor, chunk ``i`` goes to rank ``i``.
        in_splits / out_splits: element counts sent to / received from each rank.
        async_op: return the work handle instead of waiting.

    Returns:
        ``(recv [sum(out_splits)], work or None)``; with ``async_op`` the
        receive buffer is valid only after ``work.wait()``.
    """
    if pg is None:
        return send, None
    recv = send.new_empty(int(sum(out_splits)))
    work = dist.all_to_all_single(
        recv, send.contiguous(), list(map(int, out_splits)), list(map(int, in_splits)), group=pg, async_op=async_op
    )
    return recv, work


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, in_splits: list[int], out_splits: list[int], pg) -> torch.Tensor:  # type: ignore[override]
        ctx.in_splits, ctx.out_splits, ctx.pg = in_splits, out_splits, pg
        out = inp.new_empty(sum(out_splits))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        g = grad.new_empty(sum(ctx.in_splits))
        dist.all_to_all_single(g, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.pg)
        return g, None, None, None


def all_to_all_single(
    inp: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], pg: dist.ProcessGroup | None
) -> torch.Tensor:
    """Differentiable flat all-to-all.

    Args:
        inp: ``[sum(in_splits)]`` float; chunk ``i`` goes to rank ``i``.
        in_splits / out_splits: element counts per rank.

    Returns:
        ``[sum(out_splits)]``; chunk ``i`` came from rank ``i``.  Backward sends
        the gradient chunks back the way they came.
    """
    if pg is None:
        return inp
    return _AllToAllSingle.apply(inp, [int(x) for x in in_splits], [int(x) for x in out_splits], pg)


#: ``sharding.comm_precision`` -> the dtype pooled embeddings and their gradients travel in (None: as they are)
COMM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def comm_dtype(precision: str) -> torch.dtype | None:
    """``sharding.comm_precision`` (``fp32`` | ``bf16`` | ``fp16``) -> the wire dtype (None for fp32).

    Raises:
        ValueError: any other name.
    """
    if precision not in COMM_DTYPES:
        raise ValueError(f"sharding.comm_precision must be one of {list(COMM_DTYPES)}, got {precision!r}")
    return COMM_DTYPES[precision]


#: the largest finite float16 (IEEE 754 binary16): fp16 wire values saturate here instead of becoming inf
FP16_MAX = 65504.0


def to_wire(t: torch.Tensor, qdtype: torch.dtype | None, scale: float = 1.0) -> torch.Tensor:
    """``t`` encoded for the wire (TorchRec qcomm's codec ``encode``: a cast to ``qdtype``).

    fp16 (TorchRec's ``_fp32_to_fp16_with_clamp``): ``t * scale`` clamped to ``±FP16_MAX`` before
    the cast, so a value beyond the fp16 range saturates instead of arriving as inf; ``scale`` (a
    power of two, so exact) lifts small gradients out of fp16's subnormal range (see
    :func:`grad_wire_scale`).  bf16 has fp32's exponent range: a plain cast."""
    if qdtype is None or (t.dtype == qdtype and scale == 1.0):
        return t
    if qdtype == torch.float16:  # also an fp16 ``t``: the receiver divides by ``scale`` whatever came in
        return (t * scale if scale != 1.0 else t).clamp(-FP16_MAX, FP16_MAX).to(qdtype)
    return t.to(qdtype)


def grad_wire_scale(qdtype: torch.dtype | None, global_batch: int) -> float:
    """The power of two the gradients of pooled embeddings are multiplied by on an fp16 wire.

    The loss is a mean over the global batch, so a pooled-embedding gradient is about
    1/global_batch of a per-sample one: at a batch of 65,536 it sits near 1e-7, inside fp16's
    subnormal range (below 2^-14 ~ 6.1e-5, spacing 2^-24) where it keeps only a few bits.
    Multiplying by 2^round(log2(global_batch)) before the cast and dividing after (exact: a
    power of two) restores fp16's 11-bit precision for per-sample gradients up to ~65504 / 1
    (TorchRec's qcomm offers a fixed ``backward_loss_scale`` for the same reason).
    1.0 for fp32 and bf16 wires."""
    if qdtype != torch.float16 or global_batch <= 1:
        return 1.0
    return float(2.0 ** round(math.log2(global_batch)))


class _PooledRequest:
    """What the two autograd halves of one pooled all-to-all share (TorchRec's ``Request``):
    the split sizes, the buffers in flight (kept alive until their work is waited on) and the
    work handles, forward and backward."""

    __slots__ = ("meta", "dtype", "in_splits", "out_splits", "send", "recv", "work", "grad_send", "grad_recv",
                 "grad_work")

    def __init__(self, meta) -> None:
        self.meta = meta
        self.dtype: torch.dtype | None = None
        self.in_splits: list[int] = []
        self.out_splits: list[int] = []
        self.send = self.recv = self.work = None
        self.grad_send = self.grad_recv = self.grad_work = None


class _PooledAllToAllStart(torch.autograd.Function):
    """Forward: encodes this rank's lookup outputs into one send buffer and launches the
    all-to-all (``async_op=True``); returns an empty dummy that links :class:`_PooledAllToAllWait`
    to it in the graph.  Backward: waits for the gradient all-to-all the wait node launched,
    decodes it and hands each input its rows."""

    @staticmethod
    def forward(ctx, req: _PooledRequest, *inputs: torch.Tensor):  # type: ignore[override]
        bs, widths, me, pg, qdtype = req.meta
        ctx.req = req
        req.dtype = inputs[0].dtype
        W, G = len(bs), len(inputs)
        if G == 1:
            send = to_wire(inputs[0].contiguous().view(-1), qdtype)
        else:
            row_off = [0]
            for b in bs:
                row_off.append(row_off[-1] + b)
            send = to_wire(torch.cat([inputs[g][row_off[s] : row_off[s + 1]].reshape(-1)
                                    for s in range(W) for g in range(G)]), qdtype)
        req.in_splits = [bs[s] * sum(widths[me]) for s in range(W)]
        req.out_splits = [bs[me] * sum(widths[d]) for d in range(W)]
        req.send = send
        req.recv = send.new_empty(sum(req.out_splits))
        req.work = dist.all_to_all_single(req.recv, send, req.out_splits, req.in_splits, group=pg, async_op=True)
        return inputs[0].new_empty(0)

    @staticmethod
    def backward(ctx, _dummy: torch.Tensor):  # type: ignore[override]
        req = ctx.req
        bs, widths, me, pg, qdtype = req.meta
        W, G = len(bs), len(widths[me])
        req.grad_work.wait()
        back = req.grad_recv.to(req.dtype)
        req.grad_send = req.grad_recv = req.grad_work = None
        gscale = grad_wire_scale(qdtype, sum(bs))
        if gscale != 1.0:
            back.mul_(1.0 / gscale)  # exact: a power of two
        if G == 1:
            return (None, back.view(sum(bs), widths[me][0]))
        segs, off = {}, 0
        for s in range(W):
            for g in range(G):
                n = bs[s] * widths[me][g]
                segs[s, g] = back[off : off + n].view(bs[s], widths[me][g])
                off += n
        return (None, *[torch.cat([segs[s, g] for s in range(W)]) for g in range(G)])


class _PooledAllToAllWait(torch.autograd.Function):
    """Forward: waits for the all-to-all :class:`_PooledAllToAllStart` launched, decodes the
    receive buffer (one cast) and splits it per (source rank, group).  Backward: encodes the
    gradients into one send buffer and launches their all-to-all (``async_op=True``); the start
    node waits for it.  Autograd runs ready nodes by decreasing sequence number, so whatever was
    recorded between the start and this node (the dense arch, when the wait is deferred) runs its
    backward while the gradients travel."""

    @staticmethod
    def forward(ctx, req: _PooledRequest, _dummy: torch.Tensor):  # type: ignore[override]
        bs, widths, me, pg, qdtype = req.meta
        ctx.req = req
        W, G = len(bs), len(widths[me])
        req.work.wait()
        recv = req.recv.to(req.dtype)  # decode: one cast of the whole receive buffer (no-op at full precision)
        req.send = req.recv = req.work = None
        outs, off = [], 0
        for d in range(W):
            for g in range(G):
                n = bs[me] * widths[d][g]
                outs.append(recv[off : off + n].view(bs[me], widths[d][g]))
                off += n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        req = ctx.req
        bs, widths, me, pg, qdtype = req.meta
        # one copy of each (often strided: a slice of the next layer's grad) block into the send
        # buffer, encoded for the wire by the same copy
        flat = grads[0].new_empty(sum(req.out_splits), dtype=qdtype or req.dtype)
        gscale = grad_wire_scale(qdtype, sum(bs))
        off = 0
        for g in grads:
            n = g.numel()
            flat[off : off + n].view(g.shape).copy_(g if gscale == 1.0 and qdtype != torch.float16
                                                    else to_wire(g, qdtype, gscale))
            off += n
        req.grad_send = flat
        req.grad_recv = flat.new_empty(sum(req.in_splits))
        req.grad_work = dist.all_to_all_single(req.grad_recv, flat, req.in_splits, req.out_splits, group=pg,
                                               async_op=True)
        return (None, grads[0].new_empty(0))


def pooled_all_to_all_async(
    inputs: Sequence[torch.Tensor], batch_sizes: Sequence[int], widths: Sequence[Sequence[int]], pg: dist.ProcessGroup,
    qdtype: torch.dtype | None = None,
) -> Awaitable[list[list[torch.Tensor]]]:
    """:func:`pooled_all_to_all`, launched now and received on ``.wait()`` (TorchRec's
    ``LazyAwaitable`` output dist): compute recorded between the call and the wait overlaps the
    forward all-to-all, and its backward overlaps the gradient all-to-all (see
    :class:`_PooledAllToAllWait`).  Same arguments, same result, bit for bit; call ``wait()``
    exactly once per call, on every rank, before issuing the next collective that needs its
    result.  On CUDA the wait makes the current stream wait for the collective."""
    me = dist.get_rank(pg)
    meta = ([int(b) for b in batch_sizes], [list(map(int, w)) for w in widths], me, pg, qdtype)
    req = _PooledRequest(meta)
    dummy = _PooledAllToAllStart.apply(req, *inputs)
    G = len(inputs)
    W = len(meta[0])

    def finish() -> list[list[torch.Tensor]]:
        flat = _PooledAllToAllWait.apply(req, dummy)
        return [list(flat[d * G : (d + 1) * G]) for d in range(W)]

    return LazyAwaitable([], finish)


def pooled_all_to_all(
    inputs: Sequence[torch.Tensor], batch_sizes: Sequence[int], widths: Sequence[Sequence[int]], pg: dist.ProcessGroup,
    qdtype: torch.dtype | None = None,
) -> list[list[torch.Tensor]]:
    """Differentiable output dist of pooled embeddings for several groups at once.

    Args:
        inputs: per group ``g``, this rank's lookup output ``[sum(batch_sizes), widths[rank][g]]``
            (rows: every source rank's samples, in rank order), one float dtype.
        batch_sizes: every rank's local batch size.
        widths: ``widths[d][g]``: columns rank ``d`` holds for group ``g``.
        qdtype: quantized communication (TorchRec's qcomm codecs, ``sharding.comm_precision``):
            the forward embeddings and the backward gradients are cast to ``qdtype``
            (``torch.bfloat16`` / ``torch.float16``) for the all-to-all and back to the
            inputs' dtype on arrival — half the bytes, each value rounded once per
            direction (relative error <= 2^-8 for bf16, 2^-11 for fp16 within its range).
            fp16 saturates at ``±FP16_MAX`` (never inf) and sends gradients multiplied by
            :func:`grad_wire_scale` (about the global batch), so mean-loss gradients stay
            out of fp16's subnormal range.  None: sent as they are.

    Returns:
        ``out[d][g]``: ``[batch_sizes[rank], widths[d][g]]``, rank ``d``'s pooled
        columns of group ``g`` for this rank's samples.  One all-to-all forward,
        one backward (gradients go back to the owners, one flat copy each way).
        :func:`pooled_all_to_all_async` with an immediate ``wait()``.
    """
    return pooled_all_to_all_async(inputs, batch_sizes, widths, pg, qdtype).wait()
