"""The gradient collectives of :mod:`dlrmctl.distributed.comm`: replicated dense gradients
summed in one bucket (``sync_dense_grads``) or in DDP-style buckets overlapped with backward
(:class:`GradBucketReducer`), and replicated tables' sparse row gradients all-gathered as
(rows, values), never densified (``sync_sparse_grads``)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dlrmctl.distributed.comm.base import all_gather_flat, world_of
from dlrmctl.optim.rows import TOUCHED_ROWS_ATTR
from dlrmctl.sparse.jagged_tensor import host_to_device


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
        works.append(all_gather_flat(recv[ws * s: ws * (s + kc)], send[s: s + kc], group=pg, async_op=True))
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
    ws = world_of(pg)
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
    all_gather_flat(all_cnt, cnt, group=pg)
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
