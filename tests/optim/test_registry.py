"""The embedding-optimizer registry tells the truth about each rule: its state (what the planner
and the checkpoint count) is what the rule's torch optimizer creates, its FBGEMM type is what
FBGEMM's TBE runs (on the CPU exactly where the record says), and every reader takes its names
from it."""

import typing

import pytest
import torch

from dlrmctl._fbgemm import HAS_FBGEMM
from dlrmctl.optim.dense import embedding_optimizer_for_dense, row_state_tensors
from dlrmctl.optim.registry import (
    ADAM_FAMILY,
    EMBEDDING_OPTIMIZERS,
    FP16_EMBEDDING_OPTIMIZERS,
    OPTIMIZER_ALIASES,
    embedding_optimizer,
    find_embedding_optimizer,
)

NAMES = list(EMBEDDING_OPTIMIZERS)


@pytest.mark.parametrize("name", NAMES)
def test_the_records_state_counts_are_the_state_its_rule_creates(name):
    rec = EMBEDDING_OPTIMIZERS[name]
    rows, dim = 7, 5
    w = torch.nn.Parameter(torch.zeros(rows, dim))
    opt = embedding_optimizer_for_dense([w], name, lr=0.1, eps=1e-8, weight_decay=0.0)
    opt.ensure_state()
    states = row_state_tensors(opt, w)
    assert sum(t.shape == (rows, dim) for t in states) == rec.state_per_weight
    assert sum(t.shape == (rows,) for t in states) == rec.state_per_row
    assert all(t.dtype == torch.float32 for t in states)
    assert rec.state_bytes(rows, dim) == sum(t.numel() * 4 for t in states)


@pytest.mark.parametrize("name", NAMES)
def test_a_rule_updates_only_the_rows_looked_up(name):
    w = torch.nn.Parameter(torch.randn(6, 4))
    before = w.detach().clone()
    opt = embedding_optimizer_for_dense([w], name, lr=0.1, eps=1e-8, weight_decay=0.01)
    w.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.randn(3, 4), (6, 4))
    opt.step()
    changed = (w.detach() != before).any(dim=1)
    assert changed.tolist() == [False, True, False, True, False, False]


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_the_fbgemm_type_exists_and_the_cpu_tbe_runs_it_exactly_where_the_record_says(name):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    rec = EMBEDDING_OPTIMIZERS[name]
    if rec.fbgemm is None:
        assert not rec.fused_on_cpu and not rec.fused_weight_decay
        return
    kind = getattr(EmbOptimType, rec.fbgemm)

    def build():
        return SplitTableBatchedEmbeddingBagsCodegen([(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=kind)

    if rec.fused_on_cpu:
        build()
    else:
        with pytest.raises(AssertionError, match="not supported in CPU mode"):
            build()


def test_names_aliases_and_families_come_from_the_records():
    assert ADAM_FAMILY == ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
    assert FP16_EMBEDDING_OPTIMIZERS == ("exact_rowwise_adagrad", "exact_adagrad", "exact_sgd")
    assert OPTIMIZER_ALIASES["rowwise_adagrad"] == "exact_rowwise_adagrad"
    assert embedding_optimizer("sgd") is EMBEDDING_OPTIMIZERS["exact_sgd"]
    assert find_embedding_optimizer("nope") is None
    with pytest.raises(ValueError, match="unknown embedding optimizer 'nope'; expected exact_rowwise_adagrad"):
        embedding_optimizer("nope")
    for rec in EMBEDDING_OPTIMIZERS.values():
        if rec.row_wise_variant is not None:  # the lighter variant: the same rule, less state
            lighter = EMBEDDING_OPTIMIZERS[rec.row_wise_variant]
            assert lighter.state_bytes(100, 16) < rec.state_bytes(100, 16)


def test_config_and_planner_accept_exactly_the_registered_names():
    from dlrmctl.config import EmbeddingOptimizerConfig
    from dlrmctl.planner.types import PlanError, optimizer_name

    assert typing.get_args(typing.get_type_hints(EmbeddingOptimizerConfig)["type"]) == tuple(NAMES)
    assert {optimizer_name(a) for a in OPTIMIZER_ALIASES} == set(NAMES)
    with pytest.raises(PlanError):
        optimizer_name("nope")


def test_each_dense_optimizer_is_its_torch_class_with_the_keys_its_record_reads():
    from dlrmctl.config import DenseOptimizerConfig
    from dlrmctl.optim.dense import dense_optimizer
    from dlrmctl.optim.registry import DENSE_OPTIMIZERS
    from dlrmctl.planner.storage import dense_model_bytes

    assert typing.get_args(typing.get_type_hints(DenseOptimizerConfig)["type"]) == tuple(DENSE_OPTIMIZERS)
    for name, rec in DENSE_OPTIMIZERS.items():
        cfg = DenseOptimizerConfig(type=name, lr=0.5, eps=1e-3, betas=[0.8, 0.9], momentum=0.25, weight_decay=0.1)
        p = torch.nn.Parameter(torch.ones(4, 3))
        opt = dense_optimizer([p], cfg)
        assert type(opt) is getattr(torch.optim, rec.torch_class)
        d = opt.defaults
        assert (d["lr"], d["weight_decay"], d["foreach"]) == (0.5, 0.1, True)
        for key in rec.reads:
            assert d[key] == (tuple(cfg.betas) if key == "betas" else getattr(cfg, key)), (name, key)
        p.grad = torch.full_like(p, 0.5)
        opt.step()  # the planner's count is the state the optimizer keeps (sgd: momentum buffer aside)
        tensors = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape]
        assert len(tensors) == rec.state_per_param + (1 if name == "sgd" and cfg.momentum else 0), name
        assert dense_model_bytes(10, name) == 10 * 4 * (2 + rec.state_per_param)
    with pytest.raises(ValueError, match=r"unknown dense optimizer 'rmsprop'; expected adagrad \| adam \| sgd"):
        dense_optimizer([torch.nn.Parameter(torch.ones(1))], DenseOptimizerConfig(type="rmsprop"))
