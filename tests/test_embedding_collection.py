"""EmbeddingCollection (unpooled lookups) and ShardedEmbeddingCollection.

* unsharded: ``fused`` (FBGEMM sequence TBE) == ``dense`` (nn.Embedding) forward and
  updates over three steps, every embedding optimizer, duplicate ids and empty bags;
  rows == ``weight[ids]``; TorchRec's API (names, signature, ``embeddings.<t>.weight``,
  ``need_indices``); refusals.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from dlrmctl.modules.embedding_modules import EmbeddingIdError, EmbeddingOptimizerSpec
from dlrmctl.modules.sequence_embeddings import EmbeddingCollection
from dlrmctl.sparse import KeyedJaggedTensor
from dlrmctl.train.optim import embedding_optimizer_for_dense

KERNELS = ["dense"] + (["fused"] if HAS_FBGEMM else [])
OPTIMIZERS = ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"]
ATOL = 1e-6


def _tables(dim: int = 8) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(num_embeddings=10, embedding_dim=dim, name="t_a", feature_names=["f_a", "f_b"]),
        EmbeddingConfig(num_embeddings=23, embedding_dim=dim, name="t_b", feature_names=["f_c"]),
        EmbeddingConfig(num_embeddings=2, embedding_dim=dim, name="t_tiny", feature_names=["f_d"]),
    ]


def _global_batch(gen: torch.Generator, B: int, tables) -> KeyedJaggedTensor:
    """Random bags (0-3 ids) with forced duplicates and empty bags."""
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 4, (len(keys), B), generator=gen)
    if B:
        lengths[0, 0] = 3  # f_a bag 0: a duplicate id
        lengths[1, B // 2] = 0  # an empty bag
    vals = []
    for i, n in enumerate(rows):
        v = torch.randint(0, n, (int(lengths[i].sum()),), generator=gen)
        if i == 0 and B:
            v[:3] = torch.tensor([7, 7, 9])
        if i == 2 and v.numel() >= 3:
            v[:3] = torch.tensor([0, 11, 22])  # one id in every row shard
        vals.append(v)
    return KeyedJaggedTensor(keys, torch.cat(vals), lengths=lengths.reshape(-1))


def _loss(out: dict, grads: dict) -> torch.Tensor:
    return sum((out[k].values() * grads[k]).sum() for k in out)


def _grads(gen: torch.Generator, out: dict) -> dict:
    return {k: torch.randn(jt.values().shape, generator=gen) for k, jt in out.items()}


# ------------------------------------------------------------------- unsharded
def test_embedding_config_has_torchrecs_fields_in_torchrecs_order():
    names = list(inspect.signature(EmbeddingConfig).parameters)
    assert names == ["num_embeddings", "embedding_dim", "name", "data_type", "feature_names", "weight_init_max",
                     "weight_init_min", "num_embeddings_post_pruning", "init_fn", "need_pos"]
    c = EmbeddingConfig(100, 8, "t0")
    assert c.feature_names == ["t0"] and c.pooling == PoolingType.NONE
    with pytest.raises(ValueError, match="embedding_dim must be an int > 0"):
        EmbeddingConfig(10, 0, "t")
    sig = list(inspect.signature(EmbeddingCollection).parameters)
    assert sig[:3] == ["tables", "device", "need_indices"]


def test_torchrec_import_names():
    import dlrmctl
    import dlrmctl.modules
    from dlrmctl.modules import embedding_configs, embedding_modules

    assert dlrmctl.EmbeddingCollection is EmbeddingCollection is dlrmctl.modules.EmbeddingCollection
    assert embedding_modules.EmbeddingCollection is EmbeddingCollection
    assert dlrmctl.EmbeddingConfig is EmbeddingConfig is embedding_configs.EmbeddingConfig


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_are_the_table_rows_of_each_id_with_input_lengths_and_indices(kernel):
    ec = EmbeddingCollection(_tables(), need_indices=True, compute_kernel=kernel)
    kjt = _global_batch(torch.Generator().manual_seed(0), 5, _tables())
    out = ec(kjt)
    assert list(out) == ["f_a", "f_b", "f_c", "f_d"]
    w = ec.embedding_weights()
    for t in _tables():
        assert ec.embeddings[t.name].weight.shape == (t.num_embeddings, 8)
        for f in t.feature_names:
            jt = out[f]
            assert jt.values().dtype == torch.float32
            torch.testing.assert_close(jt.values(), w[t.name][kjt[f].values()], atol=0, rtol=0)
            assert torch.equal(jt.lengths(), kjt[f].lengths())
            assert torch.equal(jt.weights(), kjt[f].values())
    assert sorted(ec.state_dict()) == ["embeddings.t_a.weight", "embeddings.t_b.weight", "embeddings.t_tiny.weight"]
    assert ec.embedding_configs()[0].name == "t_a" and ec.need_indices() and ec.embedding_dim() == 8
    assert EmbeddingCollection(_tables(), compute_kernel=kernel)(kjt)["f_a"].weights_or_none() is None


@pytest.mark.skipif(not HAS_FBGEMM, reason="needs the fused kernel")
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("dim", [8, 6])
def test_fused_and_dense_kernels_match_forward_and_updates_over_three_steps(opt, dim):
    spec = EmbeddingOptimizerSpec(opt, lr=0.1, eps=1e-8)
    fused = EmbeddingCollection(_tables(dim), compute_kernel="fused", optimizer=spec, seed=5)
    dense = EmbeddingCollection(_tables(dim), compute_kernel="dense", optimizer=spec, seed=5)
    assert (len(fused.lookup.tbes) == 1) == (dim % 4 == 0)  # dim 6: TBE needs multiples of 4 -> dense
    d_opt = embedding_optimizer_for_dense(dense.embedding_dense_parameters(), opt, 0.1, 1e-8, 0.0)
    f_dense = fused.embedding_dense_parameters()
    f_opt = embedding_optimizer_for_dense(f_dense, opt, 0.1, 1e-8, 0.0) if f_dense else None
    for name, w in fused.embedding_weights().items():
        assert torch.equal(w, dense.embedding_weights()[name]), "same deterministic init on both kernels"
    gen = torch.Generator().manual_seed(11)
    for B in (7, 4, 1):
        kjt = _global_batch(gen, B, _tables(dim))
        of, od = fused(kjt), dense(kjt)
        for k in of:
            torch.testing.assert_close(of[k].values(), od[k].values(), atol=ATOL, rtol=0)
        g = _grads(gen, of)
        _loss(of, g).backward()
        _loss(od, g).backward()
        for o in (d_opt, f_opt):
            if o is not None:
                o.step()
                o.zero_grad()
    for name, w in fused.embedding_weights().items():
        torch.testing.assert_close(w.detach(), dense.embedding_weights()[name].detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sgd_step_is_the_textbook_update_with_duplicate_ids_summed(kernel):
    t = [EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])]
    ec = EmbeddingCollection(t, compute_kernel=kernel, optimizer=EmbeddingOptimizerSpec("exact_sgd", lr=0.5))
    opt = embedding_optimizer_for_dense(ec.embedding_dense_parameters(), "exact_sgd", 0.5, 0, 0) if kernel == "dense" else None
    w0 = ec.embedding_weights()["t"].detach().clone()
    kjt = KeyedJaggedTensor(["f"], torch.tensor([3, 3, 1]), lengths=torch.tensor([2, 0, 1]))
    ec(kjt)["f"].values().sum().backward()
    if opt:
        opt.step()
    expect = w0.clone()
    expect[3] -= 0.5 * 2
    expect[1] -= 0.5
    torch.testing.assert_close(ec.embedding_weights()["t"].detach(), expect)


def test_state_dict_round_trip_and_fused_optimizer_lr():
    ec = EmbeddingCollection(_tables(), compute_kernel=KERNELS[-1])
    other = EmbeddingCollection(_tables(), compute_kernel=KERNELS[-1], seed=9)
    other.load_state_dict(ec.state_dict())
    for n, w in ec.embedding_weights().items():
        assert torch.equal(other.embedding_weights()[n], w)
    fo = ec.fused_optimizer()
    fo.set_lr(0.01)
    assert fo.lr == 0.01


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="same embedding dimension.*'t1' has embedding_dim 4 != 8"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0"), EmbeddingConfig(5, 4, "t1")])
    with pytest.raises(ValueError, match="EmbeddingBagConfig"):
        EmbeddingCollection([EmbeddingBagConfig(5, 8, "t0")])
    with pytest.raises(ValueError, match="feature 'f' is looked up in tables 't0' and 't1'"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0", feature_names=["f"]), EmbeddingConfig(5, 8, "t1", feature_names=["f"])])
    with pytest.raises(ValueError, match="duplicate table name"):
        EmbeddingCollection([EmbeddingConfig(5, 8, "t0"), EmbeddingConfig(5, 8, "t0", feature_names=["g"])])
    ec = EmbeddingCollection([EmbeddingConfig(5, 8, "t0", feature_names=["f"])])
    with pytest.raises(EmbeddingIdError, match="table 't0', feature 'f': id 5"):
        ec(KeyedJaggedTensor(["f"], torch.tensor([1, 5]), lengths=torch.tensor([1, 1])))
