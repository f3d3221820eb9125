"""``optimizer.dense``: the MLPs' torch optimizer runs its multi-tensor (``foreach``) form on the
CPU too (torch's default there is the per-parameter loop), and its updates are bit for bit those
of the loop, for every type and its options."""

from __future__ import annotations

import pytest
import torch

from dlrmctl.config import DenseOptimizerConfig
from dlrmctl.optim.dense import dense_optimizer

_LOOP = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@pytest.mark.parametrize("kind,extra", [("adagrad", {}), ("adagrad", {"weight_decay": 0.01}), ("adam", {}),
                                        ("adam", {"weight_decay": 0.01}), ("sgd", {}), ("sgd", {"momentum": 0.9})])
def test_dense_optimizer_is_foreach_and_bit_identical_to_the_loop(kind, extra):
    cfg = DenseOptimizerConfig(type=kind, lr=0.05, **extra)
    torch.manual_seed(0)
    shapes = [(64, 13), (64,), (32, 64), (32,), (1, 32), (1,)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = dense_optimizer(a, cfg)
    assert opt.defaults["foreach"] is True
    kw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "foreach": False}
    if kind != "sgd":
        kw["eps"] = cfg.eps
    if kind == "adam":
        kw["betas"] = tuple(cfg.betas)
    if kind == "sgd":
        kw["momentum"] = cfg.momentum
    ref = _LOOP[kind](b, **kw)
    for _ in range(5):
        for p, q in zip(a, b):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
