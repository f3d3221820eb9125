"""The reducing output dists of :mod:`dlrmctl.distributed.comm`: ``reduce_scatter_v`` (row-wise:
sum rows over ranks, keep one's own; NCCL's reduce-scatter, else an all-to-all and a local sum)
and ``hierarchical_reduce_all_to_all`` (table_row_wise across hosts: summed within a host first)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dlrmctl.distributed.comm.all_to_all import grad_wire_scale, to_wire
from dlrmctl.distributed.comm.base import all_gather_flat, reduce_scatter_flat
from dlrmctl.sparse.jagged_tensor import host_to_device


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
                reduce_scatter_flat(out, send, group=pg)
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
                all_gather_flat(out, grad, group=pg)
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
