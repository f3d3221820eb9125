"""``rmsprop`` (one registry record + :class:`dlrmctl.optim.adagrad.RMSprop`) updates an embedding
table as ``torch.optim.RMSprop`` does, from the sparse row gradients of the ``dense`` kernel, on
the rows in the batch only; with no FBGEMM kernel, a ``fused`` lookup serves it densely."""

import pytest
import torch
import torch.nn.functional as F

from dlrmctl.optim.dense import embedding_optimizer_for_dense
from dlrmctl.optim.rows import TOUCHED_ROWS_ATTR

ROWS, DIM = 12, 6


def _steps(weight_decay: float, steps: int = 5, seed: int = 0):
    """(ours, torch's) after ``steps`` steps of bags that look up every row (with duplicates):
    ours from ``nn.EmbeddingBag(sparse=True)``-style sparse gradients, torch's from the dense ones."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(ROWS, DIM, generator=gen)
    ours = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt = embedding_optimizer_for_dense([ours], "rmsprop", lr=0.01, eps=1e-8, weight_decay=weight_decay,
                                        betas=(0.9, 0.99))
    ref_opt = torch.optim.RMSprop([ref], lr=0.01, alpha=0.99, eps=1e-8, weight_decay=weight_decay, foreach=False)
    for _ in range(steps):
        ids = torch.cat([torch.randperm(ROWS, generator=gen), torch.randint(0, ROWS, (7,), generator=gen)])
        offsets = torch.tensor([0, 5, 11])
        target = torch.randn(3, DIM, generator=gen)
        for p, o, sparse in ((ours, opt, True), (ref, ref_opt, False)):
            o.zero_grad()
            F.mse_loss(F.embedding_bag(ids, p, offsets, mode="sum", sparse=sparse), target).backward()
            o.step()
    return ours, opt, ref, ref_opt


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_rmsprop_matches_torch_optim_rmsprop_while_every_row_is_looked_up(weight_decay):
    ours, opt, ref, ref_opt = _steps(weight_decay)
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[ours]["square_avg"], ref_opt.state[ref]["square_avg"], rtol=1e-6, atol=1e-9)
    assert not torch.equal(ours.detach(), _steps(weight_decay, steps=0)[0].detach())  # it did train


def test_rmsprop_leaves_rows_not_looked_up_and_their_average_alone():
    w = torch.nn.Parameter(torch.randn(ROWS, DIM))
    before = w.detach().clone()
    opt = embedding_optimizer_for_dense([w], "rmsprop", lr=0.1, eps=1e-8, weight_decay=0.1)
    ids = torch.tensor([2, 5, 2])
    F.embedding_bag(ids, w, torch.tensor([0]), mode="sum", sparse=True).sum().backward()
    opt.step()
    touched = torch.zeros(ROWS, dtype=torch.bool)
    touched[[2, 5]] = True
    assert torch.equal(w.detach()[~touched], before[~touched]) and (w.detach()[touched] != before[touched]).all()
    v = opt.state[w]["square_avg"]
    assert (v[~touched] == 0).all() and (v[touched] > 0).all()


def test_rmsprop_on_a_synced_dense_gradient_updates_the_marked_rows_as_the_sparse_path_does():
    """A data_parallel table's dense gradient with the rows looked up marked (``track_touched``):
    the same weights and average as the sparse gradient of those rows, also for a row looked up
    whose summed gradient is zero (its average decays)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(ROWS, DIM, generator=gen)
    g = torch.zeros(ROWS, DIM)
    g[[1, 4]] = torch.randn(2, DIM, generator=gen)
    rows = torch.tensor([1, 4, 7])  # row 7: looked up, gradient exactly zero
    results = []
    for dense in (True, False):
        w = torch.nn.Parameter(w0.clone())
        opt = embedding_optimizer_for_dense([w], "rmsprop", lr=0.05, eps=1e-8, weight_decay=0.01)
        opt.ensure_state()
        opt.state[w]["square_avg"].fill_(0.5)
        if dense:
            w.grad = g.clone()
            mask = torch.zeros(ROWS, dtype=torch.bool)
            mask[rows] = True
            setattr(w, TOUCHED_ROWS_ATTR, mask)
        else:
            w.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], (ROWS, DIM)).coalesce()
        opt.step()
        results.append((w.detach().clone(), opt.state[w]["square_avg"].clone()))
    (wd_, vd), (ws, vs) = results
    torch.testing.assert_close(wd_, ws, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(vd, vs, rtol=1e-6, atol=1e-9)
    assert vd[7].lt(0.5).all() and vd[0].eq(0.5).all()


def test_rmsprop_has_no_fused_kernel_so_a_fused_lookup_serves_it_densely():
    from dlrmctl.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec, fused_supports_optimizer

    assert not fused_supports_optimizer("rmsprop", "cpu") and not fused_supports_optimizer("rmsprop", "cuda")
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="T0", embedding_dim=8, num_embeddings=10, feature_names=["f0"])],
                                 optimizer=EmbeddingOptimizerSpec("rmsprop", lr=0.01), compute_kernel="fused")
    assert len(ebc.lookup.tbes) == 0 and sorted(ebc.lookup.dense_tables) == ["T0"]


def test_rmsprop_is_a_config_value_and_fp16_tables_refuse_it():
    from dlrmctl.config import ConfigError, config_from_dict, validate

    cfg = config_from_dict({"name": "x", "data": {"path": "d"}, "optimizer": {"embedding": {"type": "rmsprop"}}})
    validate(cfg)
    cfg.model.embedding_precision = "fp16"
    with pytest.raises(ConfigError, match="fp16 tables train with exact_rowwise_adagrad, exact_adagrad or exact_sgd"):
        validate(cfg)
