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
* :class:`WarmupPolyDecay`: the DLRM reference's ``LRPolicyScheduler``.
"""

from __future__ import annotations

import torch
from torch import nn

from dlrmctl.config import DenseOptimizerConfig, LRScheduleConfig


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (one accumulator per row) for ``[rows, dim]`` parameters.

    Args:
        params: 2-D parameters (embedding tables).
        lr, eps, weight_decay: as in FBGEMM's ``EXACT_ROWWISE_ADAGRAD``.

    State per parameter: ``momentum1 [rows]`` float32 (sum of mean squared grads).
    """

    def __init__(self, params, lr: float = 0.1, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum1" not in st:
                    st["momentum1"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                m = st["momentum1"]
                g = p.grad
                D = p.shape[1]
                if g.is_sparse:
                    g = g.coalesce()
                    rows = g.indices()[0]
                    gv = g.values()
                    if rows.numel() == 0:
                        continue
                    if wd:
                        gv = gv + wd * p[rows]
                    m.index_add_(0, rows, gv.pow(2).sum(1) / D)
                    p.index_add_(0, rows, -lr * gv / (m[rows].sqrt() + eps).unsqueeze(1))
                else:
                    # rows not looked up have a zero gradient: they get +0 (as in TBE), with the
                    # same arithmetic per row as the sparse branch (bit-identical updates)
                    if wd:
                        touched = (g != 0).any(dim=1)
                        g = g + wd * p * touched.unsqueeze(1)
                    m.add_(g.pow(2).sum(1) / D)
                    den = (m.sqrt() + eps).unsqueeze(1)
                    # untouched rows (g = 0) get exactly +0, also when eps = 0 and their m is 0
                    p.add_(torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))


class SparseAdagrad(torch.optim.Optimizer):
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

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "sum" not in st:
                    st["sum"] = torch.zeros_like(p, dtype=torch.float32)
                acc = st["sum"]
                if not p.grad.is_sparse and not wd:  # untouched rows: +0 exactly, no row selection
                    g = p.grad
                    acc.add_(g * g)
                    den = acc.sqrt() + eps
                    p.add_(torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))
                    continue
                rows, g = _touched_rows(p.grad)
                if rows is None:
                    continue
                if wd:
                    g = g + wd * p[rows]
                acc.index_add_(0, rows, g * g)
                den = acc[rows].sqrt() + eps
                p.index_add_(0, rows, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))


class SparseSGD(torch.optim.Optimizer):
    """FBGEMM's ``EXACT_SGD`` for dense-kernel tables: ``w_r -= lr * (g_r + weight_decay * w_r)``
    for each row ``r`` in the batch (duplicate ids summed first); other rows are untouched."""

    def __init__(self, params, lr: float = 0.1, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse and not wd:
                    p.add_(-lr * p.grad)
                    continue
                rows, g = _touched_rows(p.grad)
                if rows is None:
                    continue
                if wd:
                    g = g + wd * p[rows]
                p.index_add_(0, rows, -lr * g)


def _touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, summed gradient rows)`` of a sparse gradient (coalesced), or of a dense one
    (rows with a non-zero gradient); ``(None, _)`` when no row is touched."""
    if grad.is_sparse:
        g = grad.coalesce()
        rows = g.indices()[0]
        return (rows if rows.numel() else None), g.values()
    rows = torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)).reshape(-1)
    return (rows if rows.numel() else None), grad[rows]


def embedding_optimizer_for_dense(params: list[nn.Parameter], type: str, lr: float, eps: float, weight_decay: float):
    """A torch optimizer implementing a fused embedding optimizer for dense-kernel tables, with
    FBGEMM's update rule and L2 weight decay on the rows in the batch (:class:`RowWiseAdagrad`,
    :class:`SparseAdagrad`, :class:`SparseSGD`).

    Raises:
        ValueError: unknown ``type``.
    """
    if type == "exact_rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, eps=eps, weight_decay=weight_decay)
    if type == "exact_adagrad":
        return SparseAdagrad(params, lr=lr, eps=eps, weight_decay=weight_decay)
    if type == "exact_sgd":
        return SparseSGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown embedding optimizer {type!r}; expected exact_rowwise_adagrad | exact_adagrad | exact_sgd")


def dense_optimizer(params: list[nn.Parameter], cfg: DenseOptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of the MLPs (``optimizer.dense``).

    Raises:
        ValueError: unknown ``cfg.type``.
    """
    if cfg.type == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.type == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown dense optimizer {cfg.type!r}; expected adagrad | adam | sgd")


class WarmupPolyDecay:
    """LR factor schedule of the DLRM reference (``LRPolicyScheduler``).

    ``factor(step)``:

    * ``step < warmup_steps``: ``(step + 1) / warmup_steps`` (linear warmup);
    * ``decay_start_step <= step < decay_start_step + decay_steps``:
      ``max(end_lr_factor, ((decay_steps - (step - decay_start_step)) / decay_steps) ** decay_power)``;
    * after the decay window: ``end_lr_factor``;
    * otherwise 1.

    The factor multiplies each optimizer's base lr; :meth:`apply` sets them.
    """

    def __init__(self, cfg: LRScheduleConfig) -> None:
        self.cfg = cfg

    def factor(self, step: int) -> float:
        c = self.cfg
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.decay_steps and step >= c.decay_start_step:
            s = step - c.decay_start_step
            if s >= c.decay_steps:
                return c.end_lr_factor
            return max(c.end_lr_factor, ((c.decay_steps - s) / c.decay_steps) ** c.decay_power)
        return 1.0

    def apply(self, step: int, optimizers: list[tuple[object, float]]) -> float:
        """Set lr = base * factor(step) on each ``(optimizer, base_lr)``; returns the factor.

        ``optimizer`` is a torch optimizer (its param groups) or anything with ``set_lr``.
        """
        f = self.factor(step)
        for opt, base in optimizers:
            if hasattr(opt, "set_lr"):
                opt.set_lr(base * f)  # type: ignore[attr-defined]
            else:
                for g in opt.param_groups:  # type: ignore[attr-defined]
                    g["lr"] = base * f
        return f
