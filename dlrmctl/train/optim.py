"""Optimizers and the learning-rate schedule.

* :class:`RowWiseAdagrad`: FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` as a torch
  optimizer for dense-kernel tables (sparse or dense gradients), so that the
  ``dense`` and ``fused`` kernels train identically.  Update per touched row
  ``r`` with (duplicate-summed) gradient ``g_r [D]`` (FBGEMM
  ``embedding_backward_split_template``, rowwise_adagrad)::

      g_r += weight_decay * w_r                  (L2 mode, if weight_decay > 0)
      G_r += sum(g_r ** 2) / D
      w_r -= lr * g_r / (sqrt(G_r) + eps)

* :class:`SparseAdagrad` (``exact_adagrad``, per element) and :class:`SparseSGD`
  (``exact_sgd``): the same formulas as FBGEMM; weight decay (L2) reaches only
  the rows in the batch, with sparse gradients too (``torch.optim.Adagrad`` refuses
  that combination and ``torch.optim.SGD`` would decay every row).
* :class:`EmbeddingAdam` and its variants :class:`PartialRowWiseAdam`, :class:`Lamb`,
  :class:`PartialRowWiseLamb` (``adam``, ``partial_rowwise_adam``, ``lamb``,
  ``partial_rowwise_lamb``): FBGEMM's Adam family over the rows in the batch only (not
  ``torch.optim.SparseAdam``, whose bias correction and weight decay differ).
* :class:`WarmupPolyDecay`: the DLRM reference's ``LRPolicyScheduler``.

The Adagrads and SGD also update fp16 tables (``model.embedding_precision: fp16``): the
gradient, the update and the new weight are computed in fp32 and the weight is rounded
once to fp16; their state stays fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dlrmctl.config import DenseOptimizerConfig
from dlrmctl.distributed.comm import TOUCHED_ROWS_ATTR


class _RowUpdateOptimizer(torch.optim.Optimizer):
    """Base of the dense-kernel table optimizers below: :meth:`step` visits every parameter that
    has a gradient, with its group's hyper-parameters and its state (created by :meth:`new_state`
    on first use, or up front by :meth:`ensure_state`), and applies :meth:`update`."""

    def new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The zero state of parameter ``p`` (identical to absent state)."""
        return {}

    def ensure_state(self) -> None:
        """Create every parameter's state now (so a checkpoint has each moment tensor to save / load into)."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                for k, v in self.new_state(p).items():
                    st.setdefault(k, v)

    def update(self, p: torch.Tensor, grad: torch.Tensor, st: dict, group: dict) -> None:
        """Apply one step to ``p`` from ``grad`` (float32, dense or sparse COO)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(self.new_state(p))
                self.update(p, _grad32(p), st, group)


class RowWiseAdagrad(_RowUpdateOptimizer):
    """Row-wise Adagrad (one accumulator per row) for ``[rows, dim]`` parameters.

    Args:
        params: 2-D parameters (embedding tables).
        lr, eps, weight_decay: as in FBGEMM's ``EXACT_ROWWISE_ADAGRAD``.

    State per parameter: ``momentum1 [rows]`` float32 (sum of mean squared grads).
    """

    def __init__(self, params, lr: float = 0.1, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    def new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum1": torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)}

    def update(self, p: torch.Tensor, g: torch.Tensor, st: dict, group: dict) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        m = st["momentum1"]
        D = p.shape[1]
        if g.is_sparse:
            rows, gv, first = _row_runs(g)
            if rows is None:
                return
            if wd:
                gv = gv + wd * _rows32(p, rows)
            m.index_add_(0, rows, _once(gv.pow(2).sum(1) / D, first))
            _add_rows(p, rows, -lr * gv / (m[rows].sqrt() + eps).unsqueeze(1), first)
        else:
            # rows not looked up have a zero gradient: they get +0 (as in TBE), with the
            # same arithmetic per row as the sparse branch (bit-identical updates)
            if wd:
                touched = _touched_mask(p)
                if touched is None:
                    touched = (g != 0).any(dim=1)
                g = g + wd * p.float() * touched.unsqueeze(1)
            m.add_(g.pow(2).sum(1) / D)
            den = (m.sqrt() + eps).unsqueeze(1)
            # untouched rows (g = 0) get exactly +0, also when eps = 0 and their m is 0
            _add_all(p, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))


class SparseAdagrad(_RowUpdateOptimizer):
    """FBGEMM's ``EXACT_ADAGRAD`` for dense-kernel tables (per-element accumulator).

    Per touched row ``r`` with (duplicate-summed) gradient ``g_r [D]`` (FBGEMM
    ``embedding_backward_split_template``, adagrad; L2 weight decay on the rows in the batch)::

        g_r += weight_decay * w_r                  (if weight_decay > 0)
        G_r += g_r ** 2
        w_r -= lr * g_r / (sqrt(G_r) + eps)

    Unlike ``torch.optim.Adagrad``, weight decay works with sparse gradients and reaches only
    the rows looked up.  State: ``sum [rows, dim]`` float32.  Dense gradients: rows whose
    gradient is all zero count as not looked up.
    """

    def __init__(self, params, lr: float = 0.1, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    def new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": torch.zeros_like(p, dtype=torch.float32)}

    def update(self, p: torch.Tensor, grad: torch.Tensor, st: dict, group: dict) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        acc = st["sum"]
        mask = _touched_mask(p)
        if not grad.is_sparse and (not wd or mask is not None):  # untouched rows: +0 exactly, no row selection
            g = grad if not wd else grad + wd * p.float() * mask.unsqueeze(1)
            acc.add_(g * g)
            den = acc.sqrt() + eps
            _add_all(p, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))
            return
        rows, g, first = _touched_rows(grad, p, wd)
        if rows is None:
            return
        acc.index_add_(0, rows, _once(g * g, first))
        den = acc[rows].sqrt() + eps
        _add_rows(p, rows, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)), first)


class SparseSGD(_RowUpdateOptimizer):
    """FBGEMM's ``EXACT_SGD`` for dense-kernel tables: ``w_r -= lr * (g_r + weight_decay * w_r)``
    for each row ``r`` in the batch (duplicate ids summed first); other rows are untouched."""

    def __init__(self, params, lr: float = 0.1, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, st: dict, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        mask = _touched_mask(p)
        if not grad.is_sparse and (not wd or mask is not None):
            _add_all(p, -lr * (grad if not wd else grad + wd * p.float() * mask.unsqueeze(1)))
            return
        rows, g, first = _touched_rows(grad, p, wd)
        if rows is None:
            return
        _add_rows(p, rows, -lr * g, first)


#: the Adam family: one step counter for bias correction (FBGEMM's ``iter``), two moments
ADAM_FAMILY = ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")


class EmbeddingAdam(torch.optim.Optimizer):
    """FBGEMM's ``ADAM`` for dense-kernel tables: only the rows in the batch are updated.

    Source: FBGEMM ``fbgemm_gpu/codegen/genscript/optimizers.py``, ``adam()`` (and
    ``partial_rowwise_adam()``, ``lamb()``, ``partial_rowwise_lamb()`` for the subclasses),
    the ``split_weight_update`` of the CUDA TBE backward.  Per touched row ``r`` with
    gradient ``g_r [D]`` (duplicate ids of the batch summed first, as TBE's backward
    does), at global step ``t`` (1 at the first :meth:`step`; counts every step whether
    the row is touched or not, as TBE's ``iter``)::

        m_r = b1 * m_r + (1 - b1) * g_r
        v_r = b2 * v_r + (1 - b2) * g_r ** 2
        w_r -= lr * ( (m_r / (1 - b1 ** t)) / (sqrt(v_r / (1 - b2 ** t)) + eps)
                      + weight_decay * w_r )

    Weight decay is FBGEMM's: decoupled (AdamW-like, inside the ``lr *``), on the rows
    in the batch only.  Rows not in the batch keep their weights and moments exactly
    (their moments do not decay).  ``torch.optim.SparseAdam`` differs: no weight decay,
    ``eps`` added to ``sqrt(v)`` before the bias correction (``lr * sqrt(1 - b2 ** t) /
    (1 - b1 ** t) * m / (sqrt(v) + eps)``) and a step counter per parameter that skips
    steps without a gradient.

    "Touched": for a sparse gradient (``nn.EmbeddingBag(sparse=True)``), every row
    looked up, also one whose summed gradient is exactly zero (TBE updates it too);
    for a dense gradient, the rows with a non-zero gradient.

    Args:
        params: 2-D ``[rows, dim]`` parameters (embedding tables).
        lr, betas, eps, weight_decay: as FBGEMM's ``learning_rate``, ``beta1``/``beta2``,
            ``eps``, ``weight_decay``.

    State per parameter (fp32): ``momentum1 [rows, dim]``, ``momentum2 [rows, dim]``
    (FBGEMM's ``split_optimizer_states()`` order).  The step ``t`` is ``param_groups[i]["step"]``
    (saved by ``state_dict()``; :meth:`set_step` sets it on a resume).
    """

    _ROWWISE_V = False  # second moment: one value per row (mean of g_r ** 2 over the row)
    _LAMB = False  # LAMB's per-row trust ratio

    def __init__(self, params, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        super().__init__(params, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, step=0))
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(f"{type(self).__name__} takes 2-D [rows, dim] tables, got shape {tuple(p.shape)}")

    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if "momentum1" not in st:
            st["momentum1"] = torch.zeros_like(p, dtype=torch.float32)
            st["momentum2"] = (torch.zeros(p.shape[0], dtype=torch.float32, device=p.device) if self._ROWWISE_V
                               else torch.zeros_like(p, dtype=torch.float32))
        return st

    def ensure_state(self) -> None:
        """Create every parameter's (zero) moments now, so a checkpoint has tensors to save / load into."""
        for g in self.param_groups:
            for p in g["params"]:
                self._init_state(p)

    def set_step(self, step: int) -> None:
        """Set the global step ``t`` (the number of steps taken), e.g. the trainer's on a resume."""
        for g in self.param_groups:
            g["step"] = int(step)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            group["step"] += 1
            t = group["step"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            b1, b2 = group["betas"]
            bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
            sb2 = math.sqrt(bc2)
            for p in group["params"]:
                st = self._init_state(p)
                if p.grad is None:
                    continue
                mask = _touched_mask(p)
                if mask is not None:
                    self._step_masked(p, st, mask, lr, eps, wd, b1, b2, bc1, bc2)
                    continue
                # the moments are gathered, formed and written back by copy: the repeats of a row
                # (_row_runs' padding) carry its sum and write equal values
                rows, g, first = _row_runs(p.grad)
                if rows is None:
                    continue
                g = g.float()
                m1, m2 = st["momentum1"], st["momentum2"]
                # b * m + (1 - b) * x as one lerp pass (the same value up to rounding); the gathered
                # rows are reused in place once written back (every pass over the touched rows costs)
                m = m1.index_select(0, rows).lerp_(g, 1.0 - b1)
                m1.index_copy_(0, rows, m)
                gg = (g * g).mean(dim=1) if self._ROWWISE_V else g * g
                v = m2.index_select(0, rows).lerp_(gg, 1.0 - b2)
                m2.index_copy_(0, rows, v)
                if self._ROWWISE_V:
                    v = v.unsqueeze(1)
                if self._LAMB:
                    w = p.index_select(0, rows)
                    r = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
                    if wd:
                        r.add_(w, alpha=wd)
                    wn, rn = w.norm(dim=1), r.norm(dim=1)
                    # FBGEMM divides by ||r|| unguarded (0/0 -> NaN for a zero row with r = 0): such
                    # a row is left unchanged here
                    ratio = torch.where(rn > 0, wn / rn, torch.zeros((), dtype=wn.dtype, device=wn.device))
                    p.index_copy_(0, rows, w.sub_(r.mul_((lr * ratio).unsqueeze(1))).to(p.dtype))
                    continue
                if lr == 0:
                    continue
                # (m / bc1) / (sqrt(v / bc2) + eps) == (sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2)):
                # the update in three passes over the touched rows (as torch.optim.Adam rewrites it)
                den = v.sqrt_().add_(eps * sb2).mul_(-bc1 / (lr * sb2))
                if wd:  # w - lr * (u + wd * w) = (1 - lr * wd) * w - lr * u
                    w = p.index_select(0, rows).mul_(1.0 - lr * wd).add_(m.div_(den))
                    p.index_copy_(0, rows, w.to(p.dtype))
                else:
                    p.index_add_(0, rows, _once(m.div_(den), first).to(p.dtype))


    def _step_masked(self, p: torch.Tensor, st: dict, mask: torch.Tensor, lr: float, eps: float, wd: float,
                     b1: float, b2: float, bc1: float, bc2: float) -> None:
        """The step on the rows in ``mask`` (bool ``[rows]``) of a dense gradient, over the whole
        table with no row selection (no host sync: the table is small, ``comm.DENSE_GRAD_MAX_BYTES``);
        per row the same arithmetic as the row path."""
        g = _grad32(p)
        mk = mask.unsqueeze(1)
        m1, m2 = st["momentum1"], st["momentum2"]
        m = torch.where(mk, m1.lerp(g, 1.0 - b1), m1)
        m1.copy_(m)
        gg = (g * g).mean(dim=1) if self._ROWWISE_V else g * g
        v = torch.where(mask if self._ROWWISE_V else mk, m2.lerp(gg, 1.0 - b2), m2)
        m2.copy_(v)
        if self._ROWWISE_V:
            v = v.unsqueeze(1)
        w = p.float()
        if self._LAMB:
            r = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
            if wd:
                r.add_(w, alpha=wd)
            wn, rn = w.norm(dim=1), r.norm(dim=1)
            ratio = torch.where(rn > 0, wn / rn, torch.zeros((), dtype=wn.dtype, device=wn.device))
            new = w - r * (lr * ratio).unsqueeze(1)
        elif lr == 0:
            return
        else:
            sb2 = math.sqrt(bc2)
            den = v.sqrt().add_(eps * sb2).mul_(-bc1 / (lr * sb2))
            new = (w * (1.0 - lr * wd)).add_(m / den) if wd else w + m / den
        p.copy_(torch.where(mk, new.to(p.dtype), p))


class PartialRowWiseAdam(EmbeddingAdam):
    """FBGEMM's ``PARTIAL_ROWWISE_ADAM``: Adam's first moment per weight, ONE second moment per
    row (FBGEMM ``optimizers.py: partial_rowwise_adam()``).  Per touched row ``r``::

        m_r = b1 * m_r + (1 - b1) * g_r                       [D]
        v_r = b2 * v_r + (1 - b2) * mean(g_r ** 2)            scalar (mean over the row's D columns)
        w_r -= lr * ( (m_r / (1 - b1 ** t)) / (sqrt(v_r / (1 - b2 ** t)) + eps) + weight_decay * w_r )

    State: ``momentum1 [rows, dim]``, ``momentum2 [rows]`` — weights + 1 float per row
    of optimizer memory beyond Adam's first moment.  Everything else as :class:`EmbeddingAdam`.
    """

    _ROWWISE_V = True


class EmbeddingLamb(EmbeddingAdam):
    """FBGEMM's ``LAMB`` (FBGEMM ``optimizers.py: lamb()``; You et al. 2019) on the rows in the
    batch.  Per touched row ``r``, with Adam's moments updated as in :class:`EmbeddingAdam`::

        u_r = (m_r / (1 - b1 ** t)) / (sqrt(v_r / (1 - b2 ** t)) + eps) + weight_decay * w_r
        w_r -= lr * (||w_r|| / ||u_r||) * u_r                 (norms over the row)

    State: ``momentum1``, ``momentum2`` ``[rows, dim]``.  A row with ``u_r = 0`` is left
    unchanged (FBGEMM's kernel would divide 0 by 0).
    """

    _LAMB = True


class PartialRowWiseLamb(EmbeddingAdam):
    """FBGEMM's ``PARTIAL_ROWWISE_LAMB`` (``optimizers.py: partial_rowwise_lamb()``): LAMB's
    trust ratio with :class:`PartialRowWiseAdam`'s moments (``v_r`` one value per row)::

        u_r = (m_r / (1 - b1 ** t)) / (sqrt(v_r / (1 - b2 ** t)) + eps) + weight_decay * w_r
        w_r -= lr * (||w_r|| / ||u_r||) * u_r

    State: ``momentum1 [rows, dim]``, ``momentum2 [rows]``.
    """

    _ROWWISE_V = True
    _LAMB = True


_ADAM_CLASSES = {"adam": EmbeddingAdam, "partial_rowwise_adam": PartialRowWiseAdam, "lamb": EmbeddingLamb,
                 "partial_rowwise_lamb": PartialRowWiseLamb}


def _touched_mask(p: torch.Tensor) -> torch.Tensor | None:
    """Bool ``[rows]``: the rows of a data_parallel table looked up on any rank this step, when
    its gradient sync tracked them (:data:`dlrmctl.distributed.comm.TOUCHED_ROWS_ATTR`, with a dense
    ``p.grad``), else ``None`` (a row is then "touched" when its gradient is non-zero)."""
    m = getattr(p, TOUCHED_ROWS_ATTR, None)
    return m if m is not None and p.grad is not None and not p.grad.is_sparse else None


def _grad32(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` (dense or sparse) in float32: the update math of an fp16 table
    (``model.embedding_precision: fp16``) runs in fp32, as FBGEMM's TBE does."""
    g = p.grad
    return g if g.dtype == torch.float32 else g.float()


def _rows32(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``p`` as float32 ``[len(rows), D]`` (a copy when ``p`` is fp16)."""
    return p[rows] if p.dtype == torch.float32 else p[rows].float()


def _once(x: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    """``x [K, ...]`` with the rows where ``first [K]`` (bool) is False set to +0: what an
    ``index_add_`` over :func:`_row_runs`' rows may add (each distinct row once; its repeats add
    zero).  ``first`` None (distinct rows): ``x``."""
    if first is None:
        return x
    return torch.where(first.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _add_rows(p: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, first: torch.Tensor | None = None) -> None:
    """``p[rows] += delta`` (``delta`` float32 ``[len(rows), D]``) for :func:`_row_runs`' rows
    (``first``: the one entry of each distinct row; its repeats carry the same delta).  fp32
    tables: one ``index_add_`` of the first entries' deltas (repeats add +0).  fp16 tables: the
    sum is formed in fp32 and rounded once to fp16 (round to nearest, FBGEMM's TBE without
    stochastic rounding), written back by copy (the repeats write equal values)."""
    if p.dtype == delta.dtype:
        p.index_add_(0, rows, _once(delta, first))
    else:
        p.index_copy_(0, rows, (p[rows].float() + delta).to(p.dtype))


def _add_all(p: torch.Tensor, delta: torch.Tensor) -> None:
    """``p += delta`` (float32 ``delta`` of ``p``'s shape), summed in fp32 for an fp16 ``p``."""
    if p.dtype == delta.dtype:
        p.add_(delta)
    else:
        p.copy_(p.float() + delta)


#: take :func:`_row_runs`' sync-free pass on the CPU too (tests of the CUDA path's sync count run on the CPU)
SYNC_FREE_ROWS_ON_CPU = False


def _row_runs(grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(rows int64 [K], summed gradient rows [K, D], first)`` of a sparse ``[R, D]`` gradient without
    a host sync (no ``coalesce()``, ``unique`` or ``nonzero``, whose output sizes the host must read
    on CUDA), so a dense-kernel table costs no device round trip in the optimizer step.

    An uncoalesced gradient (``nn.EmbeddingBag(sparse=True)``: one row per id, ``N`` ids): one
    stable sort of the ids; the duplicates of each run of equal ids summed by ``embedding_bag``
    (sum mode, in input order) over the values; ``K = N``: the ``U`` distinct rows first (sorted),
    then ``N - U`` repeats of the last distinct row with its sum (the row count stays a host
    shape); ``first`` bool ``[K]``: True on the ``U`` distinct entries.  Every row's sum is the one
    a compact pass would give.  An update either adds only the first entries (``index_add_`` of
    :func:`_once`) or writes each row back by copy from gathered values (``index_copy_``: the
    repeats write equal values); either way the result is the compact update's.  A coalesced
    gradient (the data_parallel sync's) gives its own rows and values (``K = U``, ``first``
    None); a dense one, :func:`_touched_rows`.  ``(None, _, None)``: no id at all.

    On the CPU (no device to wait on; unless :data:`SYNC_FREE_ROWS_ON_CPU`) the uncoalesced case is
    the compact pass instead (``K = U``, ``first`` None: ``unique_consecutive`` of the sorted ids,
    the same sums in the same order), 15-28% faster per dense-kernel step there.
    """
    if grad.is_sparse and grad.sparse_dim() == 1 and grad.dense_dim() == 1:
        if grad.is_coalesced():
            rows = grad.indices()[0]
            return (rows if rows.numel() else None), grad.values(), None
        idx, vals = grad._indices()[0], grad._values()
        n = idx.numel()
        if n == 0:
            return None, vals, None
        sorted_idx, perm = torch.sort(idx, stable=True)
        if idx.device.type == "cpu" and not SYNC_FREE_ROWS_ON_CPU:
            rows, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
            if rows.numel() == n:
                return rows, vals.index_select(0, perm), None
            offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=idx.device)
            torch.cumsum(counts, 0, out=offsets[1:])
            return rows, F.embedding_bag(perm, vals, offsets, mode="sum", include_last_offset=True), None
        new_run = torch.ones(n, dtype=torch.bool, device=idx.device)
        torch.ne(sorted_idx[1:], sorted_idx[:-1], out=new_run[1:])
        run = torch.cumsum(new_run, 0) - 1  # run of each sorted position: 0 .. U - 1
        pos = torch.arange(n, device=idx.device)
        # run j's first sorted position; the runs past the last (j >= U) start at n: empty bags
        starts = torch.full((n + 1,), n, dtype=torch.int64, device=idx.device)
        starts.scatter_reduce_(0, run, pos, reduce="amin")
        sums = F.embedding_bag(perm, vals, starts, mode="sum", include_last_offset=True)  # [n, D]: run j, then 0
        last = run[-1]
        j = torch.minimum(pos, last)  # positions past the last run repeat the last run
        return sorted_idx.index_select(0, starts.index_select(0, j)), sums.index_select(0, j), pos <= last
    if grad.is_sparse:  # not an embedding's [rows, D] row gradient
        g = grad.coalesce()
        rows = g.indices()[0]
        return (rows if rows.numel() else None), g.values(), None
    return _touched_rows(grad)


def _touched_rows(grad: torch.Tensor, p: torch.Tensor | None = None,
                  weight_decay: float = 0.0) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(rows, summed gradient rows, first)`` of a sparse gradient (:func:`_row_runs`: no host
    sync, repeats of the last row as padding), or of a dense one (rows with a non-zero gradient,
    distinct, ``first`` None; a ``nonzero``: one host sync); ``(None, _, None)`` when no row is touched.  With
    ``weight_decay``, ``weight_decay * p[rows]`` (float32) is added to the gradient rows (L2 decay
    of the rows in the batch only)."""
    if grad.is_sparse:
        rows, g, first = _row_runs(grad)
    else:
        rows = torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)).reshape(-1)
        rows, g, first = (rows if rows.numel() else None), grad[rows], None
    if rows is not None and weight_decay:
        g = g + weight_decay * _rows32(p, rows)
    return rows, g, first


def embedding_optimizer_for_dense(params: list[nn.Parameter], type: str, lr: float, eps: float, weight_decay: float,
                                  betas: tuple[float, float] = (0.9, 0.999)):
    """A torch optimizer implementing a fused embedding optimizer for dense-kernel tables, with
    FBGEMM's update rule, on the rows in the batch only (:class:`RowWiseAdagrad`,
    :class:`SparseAdagrad`, :class:`SparseSGD`: L2 weight decay; :class:`EmbeddingAdam`,
    :class:`PartialRowWiseAdam`, :class:`EmbeddingLamb`, :class:`PartialRowWiseLamb`:
    FBGEMM's decoupled weight decay, ``betas``, bias correction with the global step).

    Raises:
        ValueError: unknown ``type``.
    """
    if type in _ADAM_CLASSES:
        return _ADAM_CLASSES[type](params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if type == "exact_rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, eps=eps, weight_decay=weight_decay)
    if type == "exact_adagrad":
        return SparseAdagrad(params, lr=lr, eps=eps, weight_decay=weight_decay)
    if type == "exact_sgd":
        return SparseSGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown embedding optimizer {type!r}; expected exact_rowwise_adagrad | exact_adagrad | exact_sgd | "
                     f"{' | '.join(ADAM_FAMILY)}")


def dense_optimizer(params: list[nn.Parameter], cfg: DenseOptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of the MLPs (``optimizer.dense``).

    Always torch's multi-tensor (``foreach``) implementation: torch picks it by default for CUDA
    parameters only, and on the CPU the per-parameter loop it would use instead runs four to six
    element-wise ops per parameter with their temporaries.  ``foreach`` computes the same ops in
    the same order, so updates are bit-identical to the loop (torch's ``fused=True`` CPU kernel is
    not: it rounds differently).

    Raises:
        ValueError: unknown ``cfg.type``.
    """
    if cfg.type == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True)
    if cfg.type == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                foreach=True)
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True)
    raise ValueError(f"unknown dense optimizer {cfg.type!r}; expected adagrad | adam | sgd")
