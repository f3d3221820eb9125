"""The Adagrads and SGD for ``dense``-kernel tables, with FBGEMM's update rules.

* :class:`RowWiseAdagrad`: FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` as a torch optimizer for
  dense-kernel tables (sparse or dense gradients), so that the ``dense`` and ``fused`` kernels
  train identically.  Update per touched row ``r`` with (duplicate-summed) gradient ``g_r [D]``
  (FBGEMM ``embedding_backward_split_template``, rowwise_adagrad)::

      g_r += weight_decay * w_r                  (L2 mode, if weight_decay > 0)
      G_r += sum(g_r ** 2) / D
      w_r -= lr * g_r / (sqrt(G_r) + eps)

* :class:`SparseAdagrad` (``exact_adagrad``, per element) and :class:`SparseSGD`
  (``exact_sgd``): the same formulas as FBGEMM; weight decay (L2) reaches only
  the rows in the batch, with sparse gradients too (``torch.optim.Adagrad`` refuses
  that combination and ``torch.optim.SGD`` would decay every row).
* :class:`RMSprop` (``rmsprop``): Adagrad's sum of squares as a moving average
  (``torch.optim.RMSprop``) on the rows in the batch; no FBGEMM kernel, so the ``dense``
  kernel on every device.

The Adagrads and SGD also update fp16 tables (``model.embedding_precision: fp16``): the gradient, the update
and the new weight are computed in fp32 and the weight is rounded once to fp16; their state
stays fp32.
"""

from __future__ import annotations

import torch

from dlrmctl.optim.rows import add_all, add_rows, grad32, once, row_runs, rows32, touched_mask, touched_rows


class RowUpdateOptimizer(torch.optim.Optimizer):
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
                self.update(p, grad32(p), st, group)


class RowWiseAdagrad(RowUpdateOptimizer):
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
            rows, gv, first = row_runs(g)
            if rows is None:
                return
            if wd:
                gv = gv + wd * rows32(p, rows)
            m.index_add_(0, rows, once(gv.pow(2).sum(1) / D, first))
            add_rows(p, rows, -lr * gv / (m[rows].sqrt() + eps).unsqueeze(1), first)
        else:
            # rows not looked up have a zero gradient: they get +0 (as in TBE), with the
            # same arithmetic per row as the sparse branch (bit-identical updates)
            if wd:
                touched = touched_mask(p)
                if touched is None:
                    touched = (g != 0).any(dim=1)
                g = g + wd * p.float() * touched.unsqueeze(1)
            m.add_(g.pow(2).sum(1) / D)
            den = (m.sqrt() + eps).unsqueeze(1)
            # untouched rows (g = 0) get exactly +0, also when eps = 0 and their m is 0
            add_all(p, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))


class SparseAdagrad(RowUpdateOptimizer):
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
        mask = touched_mask(p)
        if not grad.is_sparse and (not wd or mask is not None):  # untouched rows: +0 exactly, no row selection
            g = grad if not wd else grad + wd * p.float() * mask.unsqueeze(1)
            acc.add_(g * g)
            den = acc.sqrt() + eps
            add_all(p, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)))
            return
        rows, g, first = touched_rows(grad, p, wd)
        if rows is None:
            return
        acc.index_add_(0, rows, once(g * g, first))
        den = acc[rows].sqrt() + eps
        add_rows(p, rows, torch.where(den > 0, -lr * g / den, torch.zeros((), dtype=g.dtype, device=g.device)), first)


class SparseSGD(RowUpdateOptimizer):
    """FBGEMM's ``EXACT_SGD`` for dense-kernel tables: ``w_r -= lr * (g_r + weight_decay * w_r)``
    for each row ``r`` in the batch (duplicate ids summed first); other rows are untouched."""

    def __init__(self, params, lr: float = 0.1, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, st: dict, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        mask = touched_mask(p)
        if not grad.is_sparse and (not wd or mask is not None):
            add_all(p, -lr * (grad if not wd else grad + wd * p.float() * mask.unsqueeze(1)))
            return
        rows, g, first = touched_rows(grad, p, wd)
        if rows is None:
            return
        add_rows(p, rows, -lr * g, first)


class RMSprop(RowUpdateOptimizer):
    """``rmsprop``: ``torch.optim.RMSprop`` (Tieleman & Hinton 2012; ``centered=False``,
    ``momentum=0``) on the rows in the batch only.

    Per touched row ``r`` with (duplicate-summed) gradient ``g_r [D]``, the formulas and their
    order of ``torch/optim/rmsprop.py`` (``_single_tensor_rmsprop``)::

        g_r += weight_decay * w_r                  (L2, if weight_decay > 0)
        v_r = alpha * v_r + (1 - alpha) * g_r ** 2
        w_r -= lr * g_r / (sqrt(v_r) + eps)

    ``alpha`` is ``betas[1]`` (the decay of the squared-gradient average, Adam's ``beta2``;
    ``betas[0]`` is unused).  Rows not looked up keep their weights and their ``v``
    (``torch.optim.RMSprop`` decays every row's ``v`` each step: the two agree while every row
    is looked up each step); a row looked up with a summed gradient of zero decays its ``v``
    (the registry's ``sparse_grads``).  State: ``square_avg [rows, dim]`` float32; fp32 tables.

    Raises:
        ValueError: ``betas[1]`` outside ``[0, 1)``.
    """

    def __init__(self, params, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        alpha = float(betas[1])
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"RMSprop's alpha (betas[1]) must be in [0, 1), got {alpha}")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay))

    def new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"square_avg": torch.zeros_like(p, dtype=torch.float32)}

    def update(self, p: torch.Tensor, grad: torch.Tensor, st: dict, group: dict) -> None:
        lr, alpha, eps, wd = group["lr"], group["alpha"], group["eps"], group["weight_decay"]
        v = st["square_avg"]
        mask = touched_mask(p)
        if mask is not None:  # a data_parallel table's dense gradient with the rows looked up marked
            mk = mask.unsqueeze(1)
            g = grad + wd * p.float() * mk if wd else grad
            v.copy_(torch.where(mk, v.mul(alpha).addcmul_(g, g, value=1 - alpha), v))
            delta = g / (v.sqrt() + eps) * -lr
            add_all(p, torch.where(mk, delta, torch.zeros((), dtype=delta.dtype, device=delta.device)))
            return
        rows, g, first = touched_rows(grad, p, wd)
        if rows is None:
            return
        # gathered, formed and written back by copy: the repeats of a row carry its sum and write equal values
        vr = v.index_select(0, rows).mul_(alpha).addcmul_(g, g, value=1 - alpha)
        v.index_copy_(0, rows, vr)
        add_rows(p, rows, g / (vr.sqrt() + eps) * -lr, first)
