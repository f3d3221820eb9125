"""EmbeddingBagCollection (fused TBE and dense kernels) against torch.nn.EmbeddingBag
and the textbook optimizer updates."""

import math

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingIdError,
    EmbeddingOptimizerSpec,
    init_table_rows,
)
from dlrmctl.sparse import KeyedJaggedTensor
from dlrmctl.optim.adagrad import RowWiseAdagrad

KERNELS = ["dense"] + (["fused"] if HAS_FBGEMM else [])


def _kjt(keys, lengths, values, weights=None):
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64),
        None if weights is None else torch.tensor(weights, dtype=torch.float32),
    )


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dim", [3, 4])
def test_empty_bag_in_the_middle_pools_to_zeros_for_sum_and_mean(kernel, dim):
    for pooling, expected in [
        ("mean", [[1] * dim, [0] * dim, [3] * dim, [0] * dim]),
        ("sum", [[1] * dim, [0] * dim, [6] * dim, [0] * dim]),
    ]:
        cfg = EmbeddingBagConfig(name="t", num_embeddings=5, embedding_dim=dim, feature_names=["f"], pooling=pooling)
        ebc = EmbeddingBagCollection([cfg], compute_kernel=kernel)
        with torch.no_grad():
            ebc.embedding_weights()["t"].copy_(torch.arange(5.0)[:, None].expand(5, dim))
        out = ebc(_kjt(["f"], [1, 0, 2, 0], [1, 2, 4])).values()
        torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("kernel", KERNELS)
def test_id_equal_to_num_embeddings_is_rejected_naming_table_and_feature(kernel):
    cfg = EmbeddingBagConfig(name="t_small", num_embeddings=10, embedding_dim=4, feature_names=["f_small"])
    ebc = EmbeddingBagCollection([cfg], compute_kernel=kernel)
    with pytest.raises(EmbeddingIdError, match=r"table 't_small', feature 'f_small': id 10 .*< num_embeddings = 10"):
        ebc(_kjt(["f_small"], [1, 1], [3, 10]))
    with pytest.raises(EmbeddingIdError, match="id -1"):
        ebc(_kjt(["f_small"], [1, 1], [3, -1]))


def _reference_bags(weights, kjt, tables, weighted):
    """Independent reference: one torch.nn.EmbeddingBag per feature, mode from the table."""
    outs = []
    for t in tables:
        for f in t.feature_names:
            jt = kjt[f]
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), jt.lengths().cumsum(0)[:-1]])
            o = torch.nn.functional.embedding_bag(
                jt.values(), weights[t.name], offs, mode="sum", per_sample_weights=jt.weights() if weighted else None
            )
            if t.pooling == "mean":
                o = o / jt.lengths().clamp(min=1).unsqueeze(1)
            outs.append(o)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_forward_and_rowwise_adagrad_step_match_embeddingbag_and_textbook_update(kernel, weighted):
    torch.manual_seed(1)
    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=20, embedding_dim=8, feature_names=["a", "b"], pooling="sum"),
        EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=4, feature_names=["c"], pooling="mean"),
        EmbeddingBagConfig(name="t2", num_embeddings=11, embedding_dim=12, feature_names=["d"], pooling="sum"),
    ]
    lr, eps = 0.05, 1e-8
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, compute_kernel=kernel,
                                 optimizer=EmbeddingOptimizerSpec("exact_rowwise_adagrad", lr, eps))
    B = 5
    keys = ["a", "b", "c", "d"]
    rows = {"a": 20, "b": 20, "c": 7, "d": 11}
    lengths, values = [], []
    for k in keys:
        ls = torch.randint(0, 4, (B,)).tolist()
        lengths += ls
        values += torch.randint(0, rows[k], (sum(ls),)).tolist()
    values[0:2] = [3, 3] if lengths[0] >= 2 else values[0:2]  # duplicate ids in a bag
    w = torch.rand(len(values)).tolist() if weighted else None
    kjt = _kjt(keys, lengths, values, w)
    w0 = {n: t.detach().clone() for n, t in ebc.embedding_weights().items()}

    out = ebc(kjt)
    ref = _reference_bags(w0, kjt, tables, weighted)
    torch.testing.assert_close(out.values(), ref)
    assert out.keys() == keys and out.length_per_key() == [8, 8, 4, 12]

    # one step: loss = sum(out * R) -> dL/dout = R
    R = torch.randn_like(out.values())
    (out.values() * R).sum().backward()
    if kernel == "dense":
        opt = RowWiseAdagrad(ebc.lookup.dense_parameters(), lr=lr, eps=eps)
        opt.step()
    # textbook: gradient of each table via autograd on the reference, then the row-wise rule
    wref = {n: t.clone().requires_grad_(True) for n, t in w0.items()}
    ref = _reference_bags(wref, kjt, tables, weighted)
    (ref * R).sum().backward()
    for n, w_init in w0.items():
        g = wref[n].grad
        D = g.shape[1]
        touched = torch.zeros(g.shape[0], dtype=torch.bool)
        for t in tables:
            if t.name == n:
                for f in t.feature_names:
                    touched[kjt[f].values()] = True
        G = (g * g).sum(1) / D
        expect = w_init - lr * g / (G.sqrt() + eps).unsqueeze(1)
        expect[~touched] = w_init[~touched]
        torch.testing.assert_close(ebc.embedding_weights()[n].detach(), expect, atol=1e-6, rtol=1e-5)


def test_init_is_independent_of_sharding():
    full = torch.empty(100, 8)
    init_table_rows(full, "t", 100, 0, 0, 8, seed=3)
    part = torch.empty(30, 3)
    init_table_rows(part, "t", 100, 60, 5, 8, seed=3)
    torch.testing.assert_close(part, full[60:90, 5:8])
    assert full.abs().max() <= math.sqrt(1 / 100)


@pytest.mark.parametrize("kernel", ["dense", "fused"])
@pytest.mark.parametrize("B", [0, 3])
def test_all_empty_batches_stay_connected_to_the_weights(kernel, B):
    """Zero-size batches and all-empty bags: backward runs (as torch.nn.EmbeddingBag) and no row changes."""
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    tables = [EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="T0", feature_names=["f0"]),
              EmbeddingBagConfig(num_embeddings=6, embedding_dim=8, name="T1", feature_names=["f1"])]
    ebc = EmbeddingBagCollection(tables, compute_kernel=kernel, optimizer=EmbeddingOptimizerSpec(lr=0.5))
    before = {k: v.detach().clone() for k, v in ebc.embedding_weights().items()}
    z = torch.zeros(0, dtype=torch.int64)
    out = ebc(KeyedJaggedTensor(["f0", "f1"], z, lengths=torch.zeros(2 * B, dtype=torch.int64)))
    assert out.values().shape == (B, 12) and out.values().requires_grad and not out.values().any()
    out.values().sum().backward()
    if ebc.lookup.dense_parameters():
        opt = embedding_optimizer_for_dense(ebc.lookup.dense_parameters(), "exact_rowwise_adagrad", 0.5, 1e-8, 0.0)
        opt.step()
    for k, v in ebc.embedding_weights().items():
        assert torch.equal(v.detach(), before[k]), k


def test_rowwise_adagrad_dense_gradient_leaves_untouched_rows_exact_even_with_eps_0():
    w = torch.nn.Parameter(torch.arange(12.0).view(4, 3))
    opt = RowWiseAdagrad([w], lr=0.1, eps=0.0)
    g = torch.zeros(4, 3)
    g[1] = torch.tensor([1.0, -2.0, 0.5])
    w.grad = g
    before = w.detach().clone()
    opt.step()
    assert torch.isfinite(w).all()
    assert torch.equal(w[[0, 2, 3]].detach(), before[[0, 2, 3]]) and not torch.equal(w[1].detach(), before[1])
