"""Collectives used by the sharded embeddings, with autograd where gradients flow.

* :func:`all_to_all_single` — flat ``all_to_all_single`` with explicit split
  sizes whose backward is the reverse all-to-all (pooled embeddings out,
  gradients back).
* :func:`reduce_scatter_v` — sum rows over ranks and keep each rank's own rows
  (row-wise output dist).  On NCCL the real ``reduce_scatter``; elsewhere (gloo)
  an all-to-all of the row blocks followed by a local sum.  Backward is the
  matching all-gather.
* :func:`all_to_all_ints` — the (non-differentiable) exchange of ids / lengths,
  optionally asynchronous (:class:`Awaitable`).
* :func:`sync_dense_grads` / :func:`sync_sparse_grads` — SUM all-reduce of
  replicated parameters' gradients (one bucket for dense grads; sparse
  embedding grads are all-gathered as (rows, values) and summed, never
  densified).

Every function takes the process group explicitly and is a no-op (identity)
when it is ``None`` or has one rank.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import torch
import torch.distributed as dist

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
    return 1 if pg is None else dist.get_world_size(pg)


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
    if _world(pg) == 1:
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
    if _world(pg) == 1:
        return inp
    return _AllToAllSingle.apply(inp, [int(x) for x in in_splits], [int(x) for x in out_splits], pg)


class _PooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, *inputs: torch.Tensor):  # type: ignore[override]
        bs, widths, me, pg = meta
        ctx.meta = meta
        W, G = len(bs), len(inputs)
        if G == 1:
            send = inputs[0].contiguous().view(-1)
        else:
            row_off = [0]
            for b in bs:
                row_off.append(row_off[-1] + b)
            send = torch.cat([inputs[g][row_off[s] : row_off[s + 1]].reshape(-1) for s in range(W) for g in range(G)])
        ctx.in_splits = [bs[s] * sum(widths[me]) for s in range(W)]
        ctx.out_splits = [bs[me] * sum(widths[d]) for d in range(W)]
        recv = send.new_empty(sum(ctx.out_splits))
        dist.all_to_all_single(recv, send, ctx.out_splits, ctx.in_splits, group=pg)
        outs, off = [], 0
        for d in range(W):
            for g in range(G):
                n = bs[me] * widths[d][g]
                outs.append(recv[off : off + n].view(bs[me], widths[d][g]))
                off += n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        bs, widths, me, pg = ctx.meta
        W, G = len(bs), len(widths[me])
        # one copy of each (often strided: a slice of the next layer's grad) block into the send buffer
        flat = grads[0].new_empty(sum(ctx.out_splits))
        off = 0
        for g in grads:
            n = g.numel()
            flat[off : off + n].view(g.shape).copy_(g)
            off += n
        back = flat.new_empty(sum(ctx.in_splits))
        dist.all_to_all_single(back, flat, ctx.in_splits, ctx.out_splits, group=pg)
        if G == 1:
            return (None, back.view(sum(bs), widths[me][0]))
        segs, off = {}, 0
        for s in range(W):
            for g in range(G):
                n = bs[s] * widths[me][g]
                segs[s, g] = back[off : off + n].view(bs[s], widths[me][g])
                off += n
        return (None, *[torch.cat([segs[s, g] for s in range(W)]) for g in range(G)])


def pooled_all_to_all(
    inputs: Sequence[torch.Tensor], batch_sizes: Sequence[int], widths: Sequence[Sequence[int]], pg: dist.ProcessGroup
) -> list[list[torch.Tensor]]:
    """Differentiable output dist of pooled embeddings for several groups at once.

    Args:
        inputs: per group ``g``, this rank's lookup output ``[sum(batch_sizes), widths[rank][g]]``
            (rows: every source rank's samples, in rank order).
        batch_sizes: every rank's local batch size.
        widths: ``widths[d][g]``: columns rank ``d`` holds for group ``g``.

    Returns:
        ``out[d][g]``: ``[batch_sizes[rank], widths[d][g]]``, rank ``d``'s pooled
        columns of group ``g`` for this rank's samples.  One all-to-all forward,
        one backward (gradients go back to the owners, one flat copy each way).
    """
    me = dist.get_rank(pg)
    meta = ([int(b) for b in batch_sizes], [list(map(int, w)) for w in widths], me, pg)
    flat = _PooledAllToAll.apply(meta, *inputs)
    G = len(inputs)
    return [list(flat[d * G : (d + 1) * G]) for d in range(len(batch_sizes))]


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, batch_sizes: list[int], pg, use_collective: bool) -> torch.Tensor:  # type: ignore[override]
        rank, ws = dist.get_rank(pg), dist.get_world_size(pg)
        ctx.batch_sizes, ctx.pg, ctx.use_collective = batch_sizes, pg, use_collective
        D = inp.shape[1]
        mine = batch_sizes[rank]
        if use_collective:
            out = inp.new_empty(mine, D)
            if len(set(batch_sizes)) == 1:
                _reduce_scatter_flat(out, inp.contiguous(), group=pg)
            else:
                dist.reduce_scatter(out, list(torch.split(inp.contiguous(), batch_sizes)), group=pg)
            return out
        in_splits = [b * D for b in batch_sizes]
        recv = inp.new_empty(ws * mine * D)
        dist.all_to_all_single(recv, inp.contiguous().view(-1), [mine * D] * ws, in_splits, group=pg)
        return recv.view(ws, mine, D).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        bs, pg = ctx.batch_sizes, ctx.pg
        ws, rank = len(bs), dist.get_rank(pg)
        grad = grad.contiguous()
        D = grad.shape[1]
        if ctx.use_collective:
            if len(set(bs)) == 1:
                out = grad.new_empty(sum(bs), D)
                _all_gather_flat(out, grad, group=pg)
                return out, None, None, None
            parts = [grad.new_empty(b, D) for b in bs]
            dist.all_gather(parts, grad, group=pg)
            return torch.cat(parts), None, None, None
        # all-gather with uneven sizes as an all-to-all of the same block to every rank
        send = grad.view(1, -1).expand(ws, -1).reshape(-1)
        out = grad.new_empty(sum(bs) * D)
        dist.all_to_all_single(out, send, [b * D for b in bs], [bs[rank] * D] * ws, group=pg)
        return out.view(sum(bs), D), None, None, None


def reduce_scatter_v(
    inp: torch.Tensor, batch_sizes: Sequence[int], pg: dist.ProcessGroup | None, use_collective: bool | None = None
) -> torch.Tensor:
    """Differentiable reduce-scatter of row blocks of different heights.

    Args:
        inp: ``[sum(batch_sizes), D]`` float: rows of rank ``i``'s samples are
            block ``i`` (in rank order).
        batch_sizes: rows per rank (each rank's local batch size).
        use_collective: use ``reduce_scatter`` (default: on NCCL only; gloo
            lacks the uneven variant) instead of all-to-all + local sum.

    Returns:
        ``[batch_sizes[rank], D]``: the sum over ranks of this rank's block.
    """
    if _world(pg) == 1:
        return inp
    if use_collective is None:
        use_collective = dist.get_backend(pg) == "nccl"
    return _ReduceScatterV.apply(inp, [int(b) for b in batch_sizes], pg, bool(use_collective))


# ------------------------------------------------------- gradient all-reduce
@torch.no_grad()
def sync_dense_grads(params: Sequence[torch.nn.Parameter], pg: dist.ProcessGroup | None) -> None:
    """SUM-all-reduce the dense gradients of ``params`` in one flat bucket.

    A missing gradient counts as zeros (and becomes a zeros tensor), so every
    rank takes part in the same collective.
    """
    if _world(pg) == 1 or not params:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n


@torch.no_grad()
def sync_sparse_grads(params: Sequence[torch.nn.Parameter], pg: dist.ProcessGroup | None) -> None:
    """SUM the sparse (row) gradients of replicated 2-D ``params`` over ranks.

    Each rank contributes its coalesced ``(rows, values)``; they are
    all-gathered (three collectives for all ``params`` together: counts, rows,
    values) and summed into a coalesced sparse gradient — the table is never
    densified.  A missing gradient counts as empty.
    """
    ws = _world(pg)
    if ws == 1 or not params:
        return
    dev = params[0].device
    idx_parts, val_parts, counts = [], [], []
    for p in params:
        g = p.grad
        if g is None:
            idx_parts.append(torch.zeros(0, dtype=torch.int64, device=dev))
            val_parts.append(torch.zeros(0, dtype=p.dtype, device=dev))
            counts.append(0)
            continue
        if not g.is_sparse:
            g = g.to_sparse(1)
        # uncoalesced is fine (duplicates are summed by the one coalesce after the gather)
        rows = g._indices()[0]
        idx_parts.append(rows)
        val_parts.append(g._values().reshape(-1))
        counts.append(rows.numel())
    cnt = torch.tensor(counts, dtype=torch.int64, device=dev)
    all_cnt = cnt.new_empty(ws * len(params))
    _all_gather_flat(all_cnt, cnt, group=pg)
    all_cnt_l = all_cnt.view(ws, len(params)).tolist()
    dims = [p.shape[1] for p in params]
    n_idx = [sum(c) for c in all_cnt_l]
    n_val = [sum(c * d for c, d in zip(row, dims)) for row in all_cnt_l]
    mi, mv = max(n_idx), max(n_val)
    idx = torch.cat(idx_parts)
    val = torch.cat(val_parts)
    idx_pad = torch.zeros(mi, dtype=torch.int64, device=dev)
    idx_pad[: idx.numel()] = idx
    val_pad = torch.zeros(mv, dtype=val.dtype, device=dev)
    val_pad[: val.numel()] = val
    all_idx = idx_pad.new_empty(ws * mi)
    all_val = val_pad.new_empty(ws * mv)
    w1 = _all_gather_flat(all_idx, idx_pad, group=pg, async_op=True)
    w2 = _all_gather_flat(all_val, val_pad, group=pg, async_op=True)
    w1.wait()
    w2.wait()
    per_param_idx: list[list[torch.Tensor]] = [[] for _ in params]
    per_param_val: list[list[torch.Tensor]] = [[] for _ in params]
    for r in range(ws):
        io, vo = r * mi, r * mv
        for j, c in enumerate(all_cnt_l[r]):
            per_param_idx[j].append(all_idx[io : io + c])
            per_param_val[j].append(all_val[vo : vo + c * dims[j]].view(c, dims[j]))
            io += c
            vo += c * dims[j]
    for j, p in enumerate(params):
        rows = torch.cat(per_param_idx[j])
        vals = torch.cat(per_param_val[j])
        p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), vals, p.shape, check_invariants=False).coalesce()
