"""FBGEMM's Adam family for ``dense``-kernel tables: :class:`EmbeddingAdam` and its variants
:class:`PartialRowWiseAdam`, :class:`EmbeddingLamb`, :class:`PartialRowWiseLamb` (``adam``,
``partial_rowwise_adam``, ``lamb``, ``partial_rowwise_lamb``), over the rows in the batch only
(not ``torch.optim.SparseAdam``, whose bias correction and weight decay differ).
"""

from __future__ import annotations

import math

import torch

from dlrmctl.optim.rows import grad32, once, row_runs, touched_mask

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
                mask = touched_mask(p)
                if mask is not None:
                    self._step_masked(p, st, mask, lr, eps, wd, b1, b2, bc1, bc2)
                    continue
                # the moments are gathered, formed and written back by copy: the repeats of a row
                # (row_runs' padding) carry its sum and write equal values
                rows, g, first = row_runs(p.grad)
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
                    p.index_add_(0, rows, once(m.div_(den), first).to(p.dtype))


    def _step_masked(self, p: torch.Tensor, st: dict, mask: torch.Tensor, lr: float, eps: float, wd: float,
                     b1: float, b2: float, bc1: float, bc2: float) -> None:
        """The step on the rows in ``mask`` (bool ``[rows]``) of a dense gradient, over the whole
        table with no row selection (no host sync: the table is small, ``comm.DENSE_GRAD_MAX_BYTES``);
        per row the same arithmetic as the row path."""
        g = grad32(p)
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
