"""Every ``torch.distributed`` collective dlrmctl issues, with autograd where gradients flow.

Rule (checked by ``tests/distributed/test_comm_rule.py``, an AST scan of the package): no
other module calls ``torch.distributed`` collectives; process-group creation and
teardown live in :mod:`dlrmctl.distributed.env`, and the checkpoint's DCP
save/load calls are DCP's own.

Devices: **every tensor handed to a collective is on the device its process
group serves** — ``env.device``: CPU tensors on a ``gloo`` group, CUDA tensors
(of the rank's ``cuda:<local_rank>``) on an ``nccl`` group.  The groups are
single-backend on purpose (no ``cpu:gloo,cuda:nccl`` fallback that would hide a
CPU tensor on the GPU path as a slow host round trip).  Callers pass
``device=`` (``env.device``) where they build tensors.  Pickled-object
collectives (:func:`broadcast_object`, :func:`all_gather_object`: the plan, the
checkpoint's file lists) use torch's object collectives, which put their byte
buffers on the current CUDA device for NCCL and on the CPU for gloo.

* :func:`all_to_all_single` — flat ``all_to_all_single`` with explicit split
  sizes whose backward is the reverse all-to-all (pooled embeddings out,
  gradients back); :func:`pooled_all_to_all` does several groups in one.
* both take ``qdtype`` (``sharding.comm_precision``): quantized communication of the
  pooled embeddings and their gradients (TorchRec's qcomm codecs: cast to bf16 / fp16
  for the wire, back on arrival).
* :func:`reduce_scatter_v` — sum rows over ranks and keep each rank's own rows
  (row-wise output dist).  On NCCL the real ``reduce_scatter``; elsewhere (gloo)
  an all-to-all of the row blocks followed by a local sum.  Backward is the
  matching all-gather.
* :func:`hierarchical_reduce_all_to_all` — table_row_wise across hosts: partial sums are
  added inside each host first (an all-to-all with intra-host splits only), then one summed
  block per destination crosses hosts (``1/L`` of the flat scheme's inter-host bytes).
* :func:`all_to_all_ints` — the (non-differentiable) exchange of ids / lengths,
  optionally asynchronous.
* :class:`GradBucketReducer` — DDP-style bucketed SUM all-reduce of replicated
  dense gradients, each bucket launched asynchronously as soon as backward has
  produced all of its gradients (overlapping the rest of backward);
  :func:`sync_dense_grads` is the one-bucket, after-backward variant.
* :func:`sync_sparse_grads` — SUM of replicated tables' sparse (row) gradients,
  all-gathered as (rows, values), never densified.
* small helpers: :func:`all_reduce`, :func:`broadcast`, :func:`barrier`,
  :func:`broadcast_object`, :func:`all_gather_object`, :func:`all_gather_tensor`,
  :func:`group_rank_size`.
* :func:`ring_shift` — point-to-point shift of rows to the next rank of a ring (the
  evaluation's distributed AUC, :mod:`dlrmctl.metrics`).

Every function takes the process group explicitly and is a no-op (identity)
when it is ``None``.  A group of ONE rank runs the real collectives (so one GPU
exercises every collective of the multi-GPU path: ``sharding.enabled: true``).
"""

from __future__ import annotations

import math
from typing import Callable, Generic, Sequence, TypeVar

import torch
import torch.distributed as dist

from dlrmctl.optim.rows import TOUCHED_ROWS_ATTR
from dlrmctl.sparse.jagged_tensor import host_to_device

T = TypeVar("T")

# torch 2.13 renamed the flat collectives (``*_into_tensor`` / ``*_tensor`` are deprecated aliases)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _world(pg: dist.ProcessGroup | None) -> int:
    """0 without a group (every helper is then a no-op), else the group's size (1 runs the real collectives)."""
    return 0 if pg is None else dist.get_world_size(pg)


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


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, batch_sizes: list[int], pg, use_collective: bool,  # type: ignore[override]
                qdtype: torch.dtype | None) -> torch.Tensor:
        rank, ws = dist.get_rank(pg), dist.get_world_size(pg)
        ctx.batch_sizes, ctx.pg, ctx.use_collective = batch_sizes, pg, use_collective
        ctx.qdtype, ctx.dtype = qdtype, inp.dtype
        D = inp.shape[1]
        mine = batch_sizes[rank]
        send = to_wire(inp.contiguous(), qdtype)
        if use_collective:  # the sum runs in the wire dtype (as NCCL's reduce_scatter does for TorchRec's qcomm)
            out = send.new_empty(mine, D)
            if len(set(batch_sizes)) == 1:
                _reduce_scatter_flat(out, send, group=pg)
            else:
                dist.reduce_scatter(out, list(torch.split(send, batch_sizes)), group=pg)
            return out.to(ctx.dtype)
        in_splits = [b * D for b in batch_sizes]
        recv = send.new_empty(ws * mine * D)
        dist.all_to_all_single(recv, send.view(-1), [mine * D] * ws, in_splits, group=pg)
        return recv.view(ws, mine, D).to(ctx.dtype).sum(0)  # decoded, then summed at full precision

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        bs, pg = ctx.batch_sizes, ctx.pg
        ws, rank = len(bs), dist.get_rank(pg)
        gscale = grad_wire_scale(ctx.qdtype, sum(bs))
        grad = to_wire(grad.contiguous(), ctx.qdtype, gscale)
        D = grad.shape[1]

        def decode(t: torch.Tensor) -> torch.Tensor:
            t = t.to(ctx.dtype)
            return t.mul_(1.0 / gscale) if gscale != 1.0 else t  # exact: a power of two

        if ctx.use_collective:
            if len(set(bs)) == 1:
                out = grad.new_empty(sum(bs), D)
                _all_gather_flat(out, grad, group=pg)
                return decode(out), None, None, None, None
            parts = [grad.new_empty(b, D) for b in bs]
            dist.all_gather(parts, grad, group=pg)
            return decode(torch.cat(parts)), None, None, None, None
        # all-gather with uneven sizes as an all-to-all of the same block to every rank
        send = grad.view(1, -1).expand(ws, -1).reshape(-1)
        out = grad.new_empty(sum(bs) * D)
        dist.all_to_all_single(out, send, [b * D for b in bs], [bs[rank] * D] * ws, group=pg)
        return decode(out.view(sum(bs), D)), None, None, None, None


def reduce_scatter_v(
    inp: torch.Tensor, batch_sizes: Sequence[int], pg: dist.ProcessGroup | None, use_collective: bool | None = None,
    qdtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Differentiable reduce-scatter of row blocks of different heights.

    Args:
        inp: ``[sum(batch_sizes), D]`` float: rows of rank ``i``'s samples are
            block ``i`` (in rank order).
        batch_sizes: rows per rank (each rank's local batch size).
        use_collective: use ``reduce_scatter`` (default: on NCCL only; gloo
            lacks the uneven variant) instead of all-to-all + local sum.

        qdtype: quantized communication (``sharding.comm_precision``, as :func:`pooled_all_to_all`):
            blocks and gradients travel as ``qdtype``; the all-to-all path sums the decoded
            blocks in the input dtype, ``reduce_scatter`` sums in ``qdtype`` (bf16 only: an fp16
            wire always takes the all-to-all path, so a sum beyond fp16's range stays finite).

    Returns:
        ``[batch_sizes[rank], D]``: the sum over ranks of this rank's block (``inp``'s dtype).
    """
    if pg is None:
        return inp
    if use_collective is None:
        use_collective = dist.get_backend(pg) == "nccl"
    if qdtype == torch.float16:
        # a reduce_scatter would sum in fp16 and overflow to inf above 65504 even though each
        # partial saturates below it: fp16 partial sums travel by all-to-all and are summed in fp32
        use_collective = False
    return _ReduceScatterV.apply(inp, [int(b) for b in batch_sizes], pg, bool(use_collective), qdtype)


def _served(local_rank: int, local_world_size: int, world_size: int) -> list[int]:
    """Global ranks served by the owner of local rank ``local_rank`` in the hierarchical
    output dist: ``r`` with ``r mod L == local_rank`` (one per host, ascending)."""
    return list(range(local_rank, world_size, local_world_size))


def _block_permutation(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: rows ``starts[0] .. starts[0]+lengths[0]-1``, then block 1's, ...
    built on ``device`` from two small host lists (one copy each, no host sync)."""
    n = int(sum(lengths))
    lens = host_to_device(lengths, torch.int64, device)
    first = host_to_device(starts, torch.int64, device)
    within = torch.arange(n, device=device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens, output_size=n)
    return within + torch.repeat_interleave(first, lens, output_size=n)


class _HierarchicalReduceAllToAll(torch.autograd.Function):
    """Forward / backward of :func:`hierarchical_reduce_all_to_all` (plan in its docstring)."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, bs: list[int], L: int, peer_cols: list[torch.Tensor],  # type: ignore[override]
                host_widths: list[int], pg, qdtype: torch.dtype | None) -> torch.Tensor:
        W, me = len(bs), dist.get_rank(pg)
        h, l = divmod(me, L)
        w_me = inp.shape[1]
        D_h = host_widths[h]
        peer_w = [int(c.numel()) for c in peer_cols]
        row_off = [0]
        for b in bs:
            row_off.append(row_off[-1] + b)
        mine = _served(l, L, W)
        n_mine = sum(bs[r] for r in mine)
        # step 1 (inside the host): rows of the destinations each local peer serves, peer by peer
        order = [r for lp in range(L) for r in _served(lp, L, W)]
        perm = _block_permutation([row_off[r] for r in order], [bs[r] for r in order], inp.device)
        in1, out1 = [0] * W, [0] * W
        for lp in range(L):
            p = h * L + lp
            in1[p] = sum(bs[r] for r in _served(lp, L, W)) * w_me
            out1[p] = n_mine * peer_w[lp]
        send1 = to_wire(inp.index_select(0, perm), qdtype).reshape(-1)
        recv1 = send1.new_empty(sum(out1))
        dist.all_to_all_single(recv1, send1, out1, in1, group=pg)
        recv1 = recv1.to(inp.dtype)  # decoded: the partial sums are added at full precision
        summed = inp.new_zeros(n_mine, D_h)
        off = 0
        for lp in range(L):
            n = n_mine * peer_w[lp]
            if n:
                summed.index_add_(1, peer_cols[lp], recv1[off : off + n].view(n_mine, peer_w[lp]))
            off += n
        # step 2 (across hosts, one block per destination): the summed rows to the ranks served
        in2, out2 = [0] * W, [0] * W
        for r in mine:
            in2[r] = bs[r] * D_h
        for hp, D in enumerate(host_widths):
            out2[hp * L + l] = bs[me] * D
        send2 = to_wire(summed, qdtype).reshape(-1)
        recv2 = send2.new_empty(sum(out2))
        dist.all_to_all_single(recv2, send2, out2, in2, group=pg)
        recv2 = recv2.to(inp.dtype)
        ctx.save_for_backward(perm)
        ctx.meta = (bs, L, peer_cols, host_widths, pg, qdtype, inp.dtype, in1, out1, in2, out2, n_mine, w_me)
        per_host = torch.split(recv2, [out2[hp * L + l] for hp in range(len(host_widths))])
        return torch.cat([blk.view(bs[me], D) for blk, D in zip(per_host, host_widths)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (perm,) = ctx.saved_tensors
        bs, L, peer_cols, host_widths, pg, qdtype, dtype, in1, out1, in2, out2, n_mine, w_me = ctx.meta
        me = dist.get_rank(pg)
        h = me // L
        gscale = grad_wire_scale(qdtype, sum(bs))
        g = to_wire(grad.contiguous(), qdtype, gscale)  # encoded once; forwarded as it is
        # reverse step 2: each host's columns back to the owner that served this rank
        send2 = torch.cat([blk.reshape(-1) for blk in torch.split(g, host_widths, dim=1)])
        recv2 = send2.new_empty(sum(in2))
        dist.all_to_all_single(recv2, send2, in2, out2, group=pg)
        d_summed = recv2.view(n_mine, host_widths[h])
        # reverse step 1: the gradient of a sum is the same block for every addend (its columns)
        send1 = torch.cat([d_summed.index_select(1, c).reshape(-1) for c in peer_cols])
        recv1 = send1.new_empty(sum(in1))
        dist.all_to_all_single(recv1, send1, in1, out1, group=pg)
        back = recv1.to(dtype)
        if gscale != 1.0:
            back.mul_(1.0 / gscale)  # exact: a power of two
        out = back.new_empty(sum(bs), w_me)
        out.index_copy_(0, perm, back.view(sum(bs), w_me))
        return out, None, None, None, None, None, None


def hierarchical_reduce_all_to_all(
    inp: torch.Tensor, batch_sizes: Sequence[int], local_world_size: int, peer_cols: Sequence[torch.Tensor],
    host_widths: Sequence[int], pg: dist.ProcessGroup | None, qdtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Differentiable two-level output dist of row-sharded partial sums (table_row_wise across
    hosts; TorchRec's intra-host reduce-scatter + cross-host all-to-all).

    The ``L = local_world_size`` ranks of a host each hold a row shard of the host's tables and
    partial sums of their columns for every source's samples.  Destination rank ``r`` is served
    by the owner of local rank ``r mod L`` of each host:

    1. inside the host: every owner sends each local peer the rows of the destinations that peer
       serves (an all-to-all whose splits are zero outside the host); the peer adds the ``L``
       blocks into the host's column space;
    2. across hosts: every owner sends each destination it serves its summed block (a non-zero
       split only to the ``W / L`` ranks of its local rank, one of them itself).

    Bytes leaving a host are ``1/L`` of the flat all-to-all of partial sums.  Backward is the
    reverse (the summed block's gradient, selected per peer's columns, goes back through step 1).
    Both steps use the collective's own group (``pg``) with zero splits, so no extra process
    group is created.

    Args:
        inp: ``[sum(batch_sizes), w]`` float, this rank's partial sums (rows: every source's
            samples in rank order, columns: its own ``w`` host columns).
        batch_sizes: every rank's local batch size.
        local_world_size: ``L``, ranks per host (contiguous blocks of ranks).
        peer_cols: per local rank ``l`` of this rank's host, int64 ``[w_l]`` on ``inp``'s device:
            the position of each of its columns in the host's column space (``host_widths[h]``);
            ``peer_cols[this local rank].numel() == w``.
        host_widths: ``D_h`` per host: the width of host ``h``'s column space.
        qdtype: wire dtype (``sharding.comm_precision``, see :func:`pooled_all_to_all`): partial
            sums are decoded and added at full precision and the sum encoded again (one rounding
            per step forward); the gradient is encoded once (fp16: times
            :func:`grad_wire_scale`) and decoded at the owners.

    Returns:
        ``[batch_sizes[rank], sum(host_widths)]`` in ``inp``'s dtype: host 0's summed columns
        (in its column space order), then host 1's, ...

    Raises:
        ValueError: ``local_world_size`` does not divide the group size.
    """
    if pg is None:
        return inp
    W = dist.get_world_size(pg)
    L = int(local_world_size)
    if L <= 0 or W % L:
        raise ValueError(f"local_world_size {L} must divide the group size {W}")
    return _HierarchicalReduceAllToAll.apply(inp, [int(b) for b in batch_sizes], L, list(peer_cols),
                                             [int(x) for x in host_widths], pg, qdtype)


# ------------------------------------------------------- gradient all-reduce
@torch.no_grad()
def sync_dense_grads(params: Sequence[torch.nn.Parameter], pg: dist.ProcessGroup | None) -> None:
    """SUM-all-reduce the dense gradients of ``params`` in one flat bucket per dtype and device,
    in place.

    The gradients become views of that bucket (gradient as bucket view): when they already are
    consecutive views of one buffer (the previous call's, kept by an in-place ``zero_grad``)
    the all-reduce runs on it with no copy at all; otherwise one buffer is allocated, each
    gradient is copied into its slice once and ``p.grad`` re-pointed there (no copy back).
    A missing gradient counts as zeros (and becomes a zeroed view), so every rank takes part
    in the same collectives.  :class:`GradBucketReducer` keeps its buffers between steps.
    """
    if pg is None or not params:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), ps in groups.items():
        flat = _grads_as_one_buffer(ps)
        if flat is None:
            flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=device)
            off = 0
            for p in ps:
                view = flat[off: off + p.numel()].view(p.shape)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
                off += p.numel()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)


def _grads_as_one_buffer(ps: Sequence[torch.nn.Parameter]) -> torch.Tensor | None:
    """The flat buffer ``[sum numel]`` whose consecutive contiguous slices the gradients of ``ps``
    are (in order), or ``None`` when they are not (a gradient missing, elsewhere, strided)."""
    g0 = ps[0].grad
    if g0 is None:
        return None
    base = g0._base if g0._base is not None else g0
    n = sum(p.numel() for p in ps)
    if base.dim() != 1 or base.numel() != n or base.data_ptr() != g0.data_ptr():
        return None
    ptr, size = base.data_ptr(), base.element_size()
    for p in ps:
        g = p.grad
        if g is None or g.dtype != base.dtype or not g.is_contiguous() or g.data_ptr() != ptr \
                or (g._base is not None and g._base is not base):
            return None
        ptr += g.numel() * size
    return base


#: replicated tables up to this size (bytes of fp32 weights) have their gradients
#: densified and all-reduced (no host sync); larger ones are all-gathered as rows
DENSE_GRAD_MAX_BYTES = 8 << 20

#: gloo all-gathers of the sparse rows are split into collectives of at most this many bytes
#: per rank, all in flight at once.  Measured on the 2-core dev VM (2 gloo ranks, loopback):
#: one 17 MiB ``all_gather_into_tensor`` took 155 ms (median of 9; min 80 ms), the same bytes
#: as 4 MiB pieces issued asynchronously 58 ms (min 16 ms).  NCCL gathers in one piece.
GLOO_GATHER_CHUNK_BYTES = 4 << 20


def _workspace(ws: dict | None, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat ``[numel]`` buffer, kept in ``ws`` between steps (grow-only) so that the large
    send / receive buffers are not allocated (and page-faulted in) again every step."""
    if ws is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = ws.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        ws[key] = buf
    return buf[:numel]


def _chunk_rows(num_rows: int, row_bytes: int, chunk_bytes: int | None) -> int:
    """Rows per all-gather piece (``num_rows``: one piece)."""
    if not chunk_bytes or num_rows == 0:
        return max(num_rows, 1)
    return max(1, min(num_rows, chunk_bytes // max(row_bytes, 1)))


def _all_gather_rows(send: torch.Tensor, recv: torch.Tensor, k: int, pg: dist.ProcessGroup) -> list:
    """Asynchronous all-gather of ``send [M, ...]`` in pieces of ``k`` rows into ``recv [W*M, ...]``.

    Piece ``c`` (rows ``s = c*k`` .. ``s + k_c``, ``k_c = min(k, M - s)``) lands in
    ``recv[W*s : W*(s + k_c)]`` as ``[W, k_c, ...]``; :func:`_gathered_pos` maps a (rank, row)
    to its row of ``recv``.  Returns the work handles."""
    M, ws = send.shape[0], dist.get_world_size(pg)
    works = []
    for s in range(0, M, k):
        kc = min(k, M - s)
        works.append(_all_gather_flat(recv[ws * s: ws * (s + kc)], send[s: s + kc], group=pg, async_op=True))
    return works


def _gathered_pos(rank: torch.Tensor, row: torch.Tensor, M: int, k: int, ws: int) -> torch.Tensor:
    """Row of :func:`_all_gather_rows`'s ``recv`` holding row ``row`` of rank ``rank``'s ``send``
    (int64 tensors of the same shape)."""
    s = torch.div(row, k, rounding_mode="floor") * k
    kc = torch.clamp(M - s, max=k)
    return ws * s + rank * kc + (row - s)


@torch.no_grad()
def sync_sparse_grads(params: Sequence[torch.nn.Parameter], pg: dist.ProcessGroup | None,
                      dense_max_bytes: int = DENSE_GRAD_MAX_BYTES, workspace: dict | None = None,
                      chunk_bytes: int | None = None, track_touched: bool = False) -> None:
    """SUM the sparse (row) gradients of replicated 2-D ``params`` over ranks.

    * Tables of at most ``dense_max_bytes`` (the small tables the planner makes
      data_parallel): the gradient is scattered straight into one flat zero buffer
      (``index_add_`` of its rows, duplicates summed) and SUM-all-reduced, as DDP does for
      TorchRec's data_parallel tables; no host sync.  Rows nobody looked up stay exactly
      zero, and the embedding optimizers update only rows with a non-zero gradient
      (:class:`dlrmctl.optim.adagrad.RowWiseAdagrad`).  ``p.grad`` becomes a dense view.
    * Larger tables: each rank contributes its ``(rows, values)`` — the ``EmbeddingBag``
      gradient as it is, one row per id, not coalesced.  Tables of the same dim and dtype
      share one ``[rows, dim]`` send buffer (each table padded to the most rows any rank
      has for it); one all-gather of the int64 row ids and one of the values per group
      (on gloo in pieces of ``chunk_bytes``, all in flight together), after one all-gather
      of the per-table counts (reading them is the one host sync, for all tables together).
      ``p.grad`` becomes an uncoalesced sparse ``[rows, dim]`` tensor: one entry per gathered
      id, in (rank, position) order — the order of the single-process global batch.  The
      duplicates are summed by the embedding optimizer (``dlrmctl.train.optim``: a stable sort
      and ``embedding_bag(mode="sum")`` in that order, with no host sync on CUDA); summing them
      here would cost a ``unique`` per table, whose output size the host must read.

    Args:
        params: replicated ``[rows, dim]`` parameters, identical on every rank; their
            ``grad`` sparse (``nn.EmbeddingBag(sparse=True)``), dense, or ``None`` (counts
            as empty / zeros).
        pg: the process group (``None``: no-op).
        dense_max_bytes: fp32 bytes up to which a table's gradient is densified.
        workspace: a dict kept by the caller between steps; the send / receive buffers of
            the row all-gather live there (grow-only) instead of being allocated each step.
        chunk_bytes: bytes per rank per all-gather piece (default: ``GLOO_GATHER_CHUNK_BYTES``
            on gloo, one piece on other backends).
        track_touched: densified tables also all-reduce, in the same buffer, how many times each
            row was looked up; ``p.<TOUCHED_ROWS_ATTR>`` becomes a bool ``[rows]`` mask of the rows
            looked up on any rank, which the embedding optimizers use instead of "gradient != 0"
            (the Adam family and weight decay: a looked-up row whose gradient sums to zero is
            still updated).  No host sync either way.
    """
    if pg is None or not params:
        return
    small = [p for p in params if p.numel() * 4 <= dense_max_bytes]
    if small:
        dev = small[0].device
        dt = torch.promote_types(small[0].dtype, torch.float32) if len({p.dtype for p in small}) > 1 else small[0].dtype
        extra = [p.shape[0] if track_touched else 0 for p in small]  # lookup counts per row
        flat = torch.zeros(sum(p.numel() + e for p, e in zip(small, extra)), dtype=dt, device=dev)
        off = 0
        for p, e in zip(small, extra):
            n = p.numel()
            view = flat[off: off + n].view(p.shape)
            seen = flat[off + n: off + n + e]
            g = p.grad
            if g is not None:
                if g.is_sparse:
                    if g.sparse_dim() == 1 and g.dense_dim() == 1:
                        view.index_add_(0, g._indices()[0], g._values().to(dt))
                        if e:
                            seen.index_add_(0, g._indices()[0], torch.ones_like(g._indices()[0], dtype=dt))
                    else:
                        view.copy_(g.to_dense())
                        if e:
                            seen.copy_(view.ne(0).any(dim=1))
                else:
                    view.copy_(g)
                    if e:
                        seen.copy_(view.ne(0).any(dim=1))
            off += n + e
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
        off = 0
        for p, e in zip(small, extra):
            n = p.numel()
            p.grad = flat[off: off + n].view_as(p).to(p.dtype)
            if e:
                setattr(p, TOUCHED_ROWS_ATTR, flat[off + n: off + n + e] > 0)
            else:
                p.__dict__.pop(TOUCHED_ROWS_ATTR, None)
            off += n + e
    params = [p for p in params if p.numel() * 4 > dense_max_bytes]
    if not params:
        return
    ws = _world(pg)
    dev = params[0].device
    if chunk_bytes is None:
        chunk_bytes = GLOO_GATHER_CHUNK_BYTES if dist.get_backend(pg) == "gloo" else 0
    idx_parts: list[torch.Tensor] = []
    val_parts: list[torch.Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            idx_parts.append(torch.zeros(0, dtype=torch.int64, device=dev))
            val_parts.append(torch.zeros(0, p.shape[1], dtype=p.dtype, device=dev))
            continue
        if not g.is_sparse:
            g = g.to_sparse(1)
        # uncoalesced is fine (duplicates are summed after the gather)
        idx_parts.append(g._indices()[0])
        val_parts.append(g._values().reshape(-1, p.shape[1]))
    cnt = host_to_device([t.numel() for t in idx_parts], torch.int64, dev)  # pinned, non-blocking
    all_cnt = cnt.new_empty(ws * len(params))
    _all_gather_flat(all_cnt, cnt, group=pg)
    all_cnt_dev = all_cnt.view(ws, len(params))
    all_cnt_l = all_cnt_dev.tolist()  # the one host sync
    max_cnt = [max(all_cnt_l[r][j] for r in range(ws)) for j in range(len(params))]
    # groups of tables with the same (dim, dtype); table j at rows row_off[j] of its group
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for j, p in enumerate(params):
        groups.setdefault((p.shape[1], val_parts[j].dtype), []).append(j)
    row_off = [0] * len(params)
    id_off: dict[tuple, int] = {}
    n_ids = 0
    for key, js in groups.items():
        id_off[key] = n_ids
        for j in js:
            row_off[j] = n_ids - id_off[key]
            n_ids += max_cnt[j]
    # ids of every group in one buffer (group after group), padding never read
    ids_send = _workspace(workspace, "ids_send", n_ids, torch.int64, dev)
    for key, js in groups.items():
        for j in js:
            o = id_off[key] + row_off[j]
            ids_send[o: o + idx_parts[j].numel()].copy_(idx_parts[j])
    ids_recv = _workspace(workspace, "ids_recv", ws * n_ids, torch.int64, dev)
    k_ids = _chunk_rows(n_ids, 8, chunk_bytes)
    works = _all_gather_rows(ids_send, ids_recv, k_ids, pg)
    recv_bufs: dict[tuple, tuple[torch.Tensor, int, int]] = {}
    for gi, (key, js) in enumerate(groups.items()):
        d, dtype = key
        M = sum(max_cnt[j] for j in js)
        send = _workspace(workspace, f"val_send{gi}", M * d, dtype, dev).view(M, d)
        for j in js:
            send[row_off[j]: row_off[j] + val_parts[j].shape[0]].copy_(val_parts[j])
        recv = _workspace(workspace, f"val_recv{gi}", ws * M * d, dtype, dev).view(ws * M, d)
        k = _chunk_rows(M, d * send.element_size(), chunk_bytes)
        works += _all_gather_rows(send, recv, k, pg)
        recv_bufs[key] = (recv, M, k)
    del idx_parts, val_parts
    for w in works:
        w.wait()
    for key, js in groups.items():
        recv, M, k = recv_bufs[key]
        for j in js:
            p = params[j]
            counts = [all_cnt_l[r][j] for r in range(ws)]
            total = sum(counts)
            if total == 0:
                p.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64, device=dev),
                                                 recv.new_zeros(0, key[0]), p.shape)
                continue
            counts_t = all_cnt_dev[:, j]  # the same counts, already on the device (no host->device copy)
            rank = torch.repeat_interleave(torch.arange(ws, device=dev), counts_t, output_size=total)
            starts = counts_t.cumsum(0) - counts_t
            row = torch.arange(total, device=dev) - torch.repeat_interleave(starts, counts_t,
                                                                            output_size=total) + row_off[j]
            ids = ids_recv.index_select(0, _gathered_pos(rank, row + id_off[key], n_ids, k_ids, ws))
            vals = recv.index_select(0, _gathered_pos(rank, row, M, k, ws))
            # uncoalesced: summing the duplicates here (sort + unique_consecutive) would size its output on
            # the host, one device sync per table per step; the embedding optimizers sum them sync-free
            p.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), vals, p.shape, check_invariants=False)


class GradBucketReducer:
    """DDP-style SUM all-reduce of replicated gradients, overlapped with backward, with the
    gradients as views of the buckets (DDP's ``gradient_as_bucket_view=True``).

    Parameters are put into buckets of at most ``bucket_cap_mb`` MiB, in reverse
    registration order (the order backward produces their gradients, as in
    ``torch.nn.parallel.DistributedDataParallel``); a bucket holds one dtype on one device.
    Each bucket's flat buffer (:attr:`flats`) is allocated once, here, and every
    parameter's ``.grad`` is a view of its slice: backward accumulates into the bucket and
    the ``all_reduce`` runs on it in place (no ``torch.cat`` into a send buffer, no copy back).

    A hook on each parameter (``register_post_accumulate_grad_hook``) marks it ready; when
    every gradient of bucket ``k`` is ready and buckets ``0..k-1`` are launched, bucket ``k``'s
    ``all_reduce`` is launched asynchronously, while backward goes on.  :meth:`finish` (queued
    by the caller at the end of backward) launches the buckets still pending, waits for all
    of them and leaves the sums in ``p.grad`` (the views).

    Gradients that are not views when a bucket is launched are made views again: ``None``
    (``zero_grad(set_to_none=True)``, a parameter that got no gradient this step) becomes a
    zeroed view — so every rank issues the same collectives in the same order — and any
    other tensor (assigned by someone else) is copied into the view first.  :meth:`arm`
    (the start of a backward) re-points and zeroes ``None`` gradients *before* backward
    accumulates, so the optimizer's ``zero_grad(set_to_none=True)`` costs one ``zero_()`` per
    bucket and no copy.  Code that reads or updates ``p.grad`` in place (optimizers, AMP's
    unscale, gradient clipping) works on the bucket directly.

    The result equals :func:`sync_dense_grads` (each element is the same sum over
    ranks); only the moment of the communication differs.

    Args:
        params: replicated parameters (dense layers), identical on every rank.
        pg: the process group (``None``: everything is a no-op, no buffers).
        bucket_cap_mb: bucket size in MiB (DDP's default: 25).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], pg: dist.ProcessGroup | None,
                 bucket_cap_mb: float = 25.0) -> None:
        self.pg = pg
        ps = [p for p in params if p.requires_grad]
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[list[torch.nn.Parameter]] = []
        cur: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(ps):
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > cap or p.dtype != cur[0].dtype or p.device != cur[0].device):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            self.buckets.append(cur)
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        #: per bucket, its flat gradient buffer ``[sum numel]`` (the parameters' dtype and device)
        self.flats: list[torch.Tensor] = []
        #: per bucket, per parameter, the ``p.shape`` view of the flat buffer that ``p.grad`` is
        self.views: list[list[torch.Tensor]] = []
        self._handles = []
        #: buckets the last backward launched from its hooks, i.e. before its end (overlapped)
        self.launched_during_backward = 0
        self._reset()
        if pg is not None:
            with torch.no_grad():
                for b in self.buckets:
                    flat = torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                    views, off = [], 0
                    for p in b:
                        views.append(flat[off: off + p.numel()].view(p.shape))
                        off += p.numel()
                    self.flats.append(flat)
                    self.views.append(views)
                for k in range(len(self.buckets)):
                    self._point_grads(k)  # an existing gradient (e.g. a resumed step) is kept
            for p in ps:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    @torch.no_grad()
    def _point_grads(self, k: int, zero_missing_first: bool = False) -> None:
        """Make every ``p.grad`` of bucket ``k`` its view: ``None`` -> zeros, a foreign tensor is
        copied in.  ``zero_missing_first``: when no gradient of the bucket is set (after
        ``zero_grad(set_to_none=True)``), one ``zero_()`` of the whole buffer."""
        b, views = self.buckets[k], self.views[k]
        if zero_missing_first and all(p.grad is None for p in b):
            self.flats[k].zero_()
            for p, v in zip(b, views):
                p.grad = v
            return
        for p, v in zip(b, views):
            g = p.grad
            if g is None:
                v.zero_()
                p.grad = v
            elif g.data_ptr() != v.data_ptr() or g.stride() != v.stride():
                v.copy_(g)
                p.grad = v

    def arm(self) -> None:
        """Let the hooks launch buckets during the backward that has just started (the
        caller queues :meth:`finish` for its end); unarmed, gradients are only counted.
        Re-points gradients that were set to ``None`` at their (zeroed) bucket views first,
        so that backward accumulates straight into the buckets."""
        if self.pg is not None:
            for k in range(len(self.buckets)):
                self._point_grads(k, zero_missing_first=True)
        self._armed = True

    def _reset(self) -> None:
        self._armed = False
        self._launched_early = 0
        self._pending = [len(b) for b in self.buckets]
        self._ready: set[int] = set()
        self._next = 0
        self._works: list[object] = []

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if id(p) in self._ready:  # accumulated twice in one backward: still one contribution
            return
        self._ready.add(id(p))
        self._pending[self._bucket_of[id(p)]] -= 1
        if self._armed:
            self._launch_ready()
            self._launched_early = self._next

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self._pending[self._next] == 0):
            k = self._next
            self._point_grads(k)
            self._works.append(dist.all_reduce(self.flats[k], op=dist.ReduceOp.SUM, group=self.pg, async_op=True))
            self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is pending and wait for every bucket: ``p.grad`` (views of the buckets)
        then hold the sums over ranks."""
        if self.pg is None:
            return
        self.launched_during_backward = self._launched_early
        self._launch_ready(force=True)
        for work in self._works:
            work.wait()  # type: ignore[attr-defined]
        self._reset()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


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
    _all_gather_flat(out.view(-1), t.view(-1), group=pg)
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
