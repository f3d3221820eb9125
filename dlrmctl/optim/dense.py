"""Torch optimizers for what FBGEMM's fused TBE does not train: ``dense``-kernel embedding tables
(:func:`embedding_optimizer_for_dense`, the registry's update rule of the configured optimizer)
and the MLPs (:func:`dense_optimizer`); :func:`row_state_tensors`, a table's state as the
checkpoint stores it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dlrmctl.optim.registry import DENSE_OPTIMIZERS, embedding_optimizer

if TYPE_CHECKING:
    from dlrmctl.config import DenseOptimizerConfig


def embedding_optimizer_for_dense(params: list[nn.Parameter], type: str, lr: float, eps: float, weight_decay: float,
                                  betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """A torch optimizer implementing a fused embedding optimizer for dense-kernel tables, with
    FBGEMM's update rule, on the rows in the batch only: the class the registry names for
    ``type`` (:data:`dlrmctl.optim.registry.EMBEDDING_OPTIMIZERS`; :class:`~dlrmctl.optim.adagrad.RowWiseAdagrad`,
    :class:`~dlrmctl.optim.adagrad.SparseAdagrad`, :class:`~dlrmctl.optim.adagrad.SparseSGD`: L2
    weight decay; :class:`~dlrmctl.optim.adam.EmbeddingAdam` and its variants: FBGEMM's decoupled
    weight decay, ``betas``, bias correction with the global step).  ``eps`` / ``betas`` are
    passed to the rules that read them.

    Raises:
        ValueError: unknown ``type``.
    """
    rec = embedding_optimizer(type)
    module, cls = rec.rule.rsplit(".", 1)
    rule = getattr(importlib.import_module(f"dlrmctl.optim.{module}"), cls)
    kwargs: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay)
    if rec.uses_eps:
        kwargs["eps"] = eps
    if rec.uses_betas:
        kwargs["betas"] = tuple(betas)
    return rule(params, **kwargs)


def row_state_tensors(opt: torch.optim.Optimizer | None, weight: torch.Tensor) -> list[torch.Tensor]:
    """The per-row / per-element state tensors (``[rows]`` or ``[rows, dim]``, in key order) that
    ``opt`` keeps for the table ``weight [rows, dim]``: what a checkpoint stores next to a
    dense-kernel shard (empty before its first step, or without ``opt``)."""
    st = opt.state.get(weight, {}) if opt is not None else {}
    return [v for _, v in sorted(st.items()) if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == weight.shape[0]]


def dense_optimizer(params: list[nn.Parameter], cfg: DenseOptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of the MLPs (``optimizer.dense``): its record's ``torch.optim`` class
    (:data:`dlrmctl.optim.registry.DENSE_OPTIMIZERS`) with the config keys the record reads.

    Always torch's multi-tensor (``foreach``) implementation: torch picks it by default for CUDA
    parameters only, and on the CPU the per-parameter loop it would use instead runs four to six
    element-wise ops per parameter with their temporaries.  ``foreach`` computes the same ops in
    the same order, so updates are bit-identical to the loop (torch's ``fused=True`` CPU kernel is
    not: it rounds differently).

    Raises:
        ValueError: unknown ``cfg.type``.
    """
    rec = DENSE_OPTIMIZERS.get(cfg.type)
    if rec is None:
        raise ValueError(f"unknown dense optimizer {cfg.type!r}; expected {' | '.join(DENSE_OPTIMIZERS)}")
    kwargs = {k: tuple(getattr(cfg, k)) if k == "betas" else getattr(cfg, k) for k in rec.reads}
    return getattr(torch.optim, rec.torch_class)(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True,
                                                 **kwargs)


def ensure_optimizer_state(opt: torch.optim.Optimizer | None) -> None:
    """Create the lazily-made state of a dense-kernel table optimizer (``ensure_state`` of
    :mod:`dlrmctl.optim`'s optimizers: zeros, identical to absent), so every dense-kernel
    shard has its moment tensor to save / load into."""
    if opt is not None and hasattr(opt, "ensure_state"):
        opt.ensure_state()
