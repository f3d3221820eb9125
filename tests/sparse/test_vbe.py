"""Variable batch per feature (TorchRec's VBE): a KJT whose keys carry deduplicated bags
(``stride_per_key_per_rank``) plus ``inverse_indices`` gives exactly the pooled output,
gradients and fused-optimizer updates of the same batch expanded to a fixed stride —
unsharded on both kernels, in a DLRM, and sharded on 2 gloo ranks for every sharding type."""

import pytest
import torch

from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.sparse import KeyedJaggedTensor
from tests.dist_utils import run_multiprocess
from tests.distributed.test_sharding import ALL_TYPES, TABLES

ATOL = 1e-5


def vbe_batch(gen: torch.Generator, B: int, weighted: bool, tables=TABLES):
    """``(vbe_kjt, full_kjt)``: key k has ``U_k <= B`` distinct bags (some empty) and each of the
    B samples points at one of them; ``full_kjt`` is the same batch with every bag written out."""
    keys, rows = [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            rows.append(t.num_embeddings)
    v_lens, v_vals, v_w, inv = [], [], [], []
    f_lens, f_vals, f_w = [], [], []
    spk = []
    for n in rows:
        U = int(torch.randint(1, max(B, 1) + 1, (1,), generator=gen)) if B else 0
        lens = torch.randint(0, 4, (U,), generator=gen)
        bags = [torch.randint(0, n, (int(x),), generator=gen) for x in lens]
        wts = [torch.rand(int(x), generator=gen) + 0.5 for x in lens]
        # every distinct bag is used at least once, then samples pick bags at random
        idx = torch.cat([torch.randperm(U, generator=gen)[: min(U, B)],
                         torch.randint(0, max(U, 1), (max(B - U, 0),), generator=gen)])[:B] if B else torch.zeros(0)
        idx = idx.long()
        spk.append(U)
        inv.append(idx)
        v_lens.append(lens)
        v_vals += bags
        v_w += wts
        f_lens.append(lens[idx] if B else lens[:0])
        f_vals += [bags[i] for i in idx.tolist()]
        f_w += [wts[i] for i in idx.tolist()]
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
    vbe = KeyedJaggedTensor(keys, cat(v_vals).long(), cat(v_w) if weighted else None, cat(v_lens).long(),
                            stride_per_key_per_rank=[[u] for u in spk],
                            inverse_indices=(keys, torch.stack(inv) if keys else torch.zeros(0, B, dtype=torch.long)))
    full = KeyedJaggedTensor(keys, cat(f_vals).long(), cat(f_w) if weighted else None, cat(f_lens).long(), stride=B)
    return vbe, full


@pytest.mark.parametrize("kernel", ["fused", "dense"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_vbe_equals_the_expanded_batch_forward_backward_and_update(kernel, weighted):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    spec = EmbeddingOptimizerSpec("exact_rowwise_adagrad", lr=0.1)
    ebcs = [EmbeddingBagCollection(TABLES, is_weighted=weighted, compute_kernel=kernel, optimizer=spec, seed=5)
            for _ in range(2)]
    opts = [embedding_optimizer_for_dense(e.lookup.dense_parameters(), spec.type, 0.1, 1e-8, 0.0)
            if e.lookup.dense_parameters() else None for e in ebcs]
    gen = torch.Generator().manual_seed(0)
    for B in (7, 1, 0, 5):
        vbe, full = vbe_batch(gen, B, weighted)
        a, b = ebcs[0](vbe), ebcs[1](full)
        assert a.keys() == b.keys() and a.values().shape == (B, sum(t.embedding_dim * len(t.feature_names) for t in TABLES))
        assert torch.allclose(a.values(), b.values(), atol=ATOL)
        g = torch.randn(b.values().shape, generator=gen)
        (a.values() * g).sum().backward()
        (b.values() * g).sum().backward()
        for o in opts:
            if o is not None:
                o.step()
                o.zero_grad()
    wa, wb = ebcs[0].embedding_weights(), ebcs[1].embedding_weights()
    for n in wa:
        assert torch.allclose(wa[n], wb[n], atol=ATOL), n


def test_dlrm_forward_expands_vbe_pooled_outputs_to_the_batch():
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
              for i in range(3)]
    torch.manual_seed(0)
    model = DLRM(EmbeddingBagCollection(tables, seed=1), 4, [16, 8], [16, 1], 3, 8)
    gen = torch.Generator().manual_seed(3)
    vbe, full = vbe_batch(gen, 6, False, tables)
    dense = torch.randn(6, 4, generator=gen)
    assert torch.allclose(model(dense, vbe), model(dense, full), atol=ATOL)


def test_vbe_without_inverse_indices_is_refused_by_the_ebc():
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
    from dlrmctl.sparse import SparseInputError

    t = [EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["a", "b"])]
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                            stride_per_key_per_rank=[[1], [2]])
    with pytest.raises(SparseInputError, match="needs inverse_indices"):
        EmbeddingBagCollection(t)(kjt)


def _sharded_vbe_worker(env, types):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    out = {}
    for st in types:
        opt = "exact_adagrad" if "column" in st else "exact_rowwise_adagrad"
        spec = EmbeddingOptimizerSpec(opt, lr=0.1)
        lws = 1 if st in ("table_row_wise", "table_column_wise") else None
        plan = plan_from_types(TABLES, st, env.world_size, lws)
        ebcs = [ShardedEmbeddingBagCollection(TABLES, plan, env, True, spec, seed=3) for _ in range(2)]
        opts = [embedding_optimizer_for_dense(e.embedding_dense_parameters(), opt, 0.1, 1e-8, 0.0)
                if e.embedding_dense_parameters() else None for e in ebcs]
        gen = torch.Generator().manual_seed(100 + env.rank)
        err = None
        for step, B in enumerate([5 + env.rank, 0 if env.rank else 3, 4]):  # uneven, one rank empty
            vbe, full = vbe_batch(gen, B, True)
            a, b = ebcs[0](vbe), ebcs[1](full)
            if a.values().shape != b.values().shape or not torch.allclose(a.values(), b.values(), atol=ATOL):
                err = f"step {step}: pooled outputs differ"
                break
            g = torch.randn(b.values().shape, generator=gen)
            (a.values() * g).sum().backward()
            (b.values() * g).sum().backward()
            for e, o in zip(ebcs, opts):
                e.sync_replicated_grads()
                if o is not None:
                    o.step()
                    o.zero_grad()
        if err is None:
            wa, wb = ebcs[0].gather_full_weights(), ebcs[1].gather_full_weights()
            bad = [n for n in wa if not torch.allclose(wa[n], wb[n], atol=ATOL)]
            err = f"weights differ after 3 steps: {bad}" if bad else None
        out[st] = err
    return out


@pytest.mark.multiprocess
def test_sharded_vbe_matches_the_expanded_batch_on_2_ranks_for_every_sharding_type():
    res = run_multiprocess(_sharded_vbe_worker, 2, ALL_TYPES, timeout_s=240)
    for r, d in enumerate(res):
        assert d == {st: None for st in ALL_TYPES}, f"rank {r}: {d}"


def _ec_tables():
    from dlrmctl.modules.embedding_configs import EmbeddingConfig

    return [EmbeddingConfig(num_embeddings=n, embedding_dim=8, name=f"e{i}", feature_names=[f"s{i}"])
            for i, n in enumerate([9, 23, 5])]


def _check_ec_vbe(ec, vbe, full, inv):
    """EC on a VBE KJT: each key keeps its own bags; expanded by the inverse indices it equals
    the EC on the full batch."""
    a, b = ec(vbe), ec(full)
    for k, f in enumerate(vbe.keys()):
        ja, jb = a[f], b[f]
        assert ja.lengths().tolist() == vbe[f].lengths().tolist()
        rows = torch.split(ja.values(), ja.lengths().tolist())
        want = torch.cat([rows[i] for i in inv[k].tolist()]) if inv.shape[1] else ja.values()[:0]
        assert torch.equal(want, jb.values()), f


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_embedding_collection_keeps_each_keys_own_bags_for_vbe(kernel):
    from dlrmctl.modules.sequence_embeddings import EmbeddingCollection

    tables = _ec_tables()
    ec = EmbeddingCollection(tables, compute_kernel=kernel, seed=2)
    gen = torch.Generator().manual_seed(9)
    for B in (6, 1, 0):
        vbe, full = vbe_batch(gen, B, False, tables)
        _check_ec_vbe(ec, vbe, full, vbe.inverse_indices()[1])


def _sharded_ec_vbe_worker(env):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ec import ShardedEmbeddingCollection

    tables = _ec_tables()
    out = {}
    for st in ("table_wise", "row_wise", "column_wise"):
        ec = ShardedEmbeddingCollection(tables, plan_from_types(tables, st, env.world_size), env, seed=2)
        gen = torch.Generator().manual_seed(50 + env.rank)
        try:
            for B in (5 + env.rank, 0 if env.rank else 2):
                vbe, full = vbe_batch(gen, B, False, tables)
                _check_ec_vbe(ec, vbe, full, vbe.inverse_indices()[1])
            out[st] = None
        except AssertionError as e:
            out[st] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.multiprocess
def test_sharded_embedding_collection_handles_vbe_on_2_ranks():
    for r, d in enumerate(run_multiprocess(_sharded_ec_vbe_worker, 2, timeout_s=180)):
        assert d == {"table_wise": None, "row_wise": None, "column_wise": None}, f"rank {r}: {d}"


def test_small_integer_lengths_and_bad_inverse_dtypes():
    from dlrmctl.sparse import SparseInputError

    # uint8 lengths: their offsets would overflow at 256 (the fused kernel then pooled wrong ids)
    k = KeyedJaggedTensor(["a", "b"], torch.arange(303) % 7, lengths=torch.tensor([200, 100, 1, 2], dtype=torch.uint8))
    assert k.offsets().tolist() == [0, 200, 300, 301, 303]
    with pytest.raises(SparseInputError, match="inverse_indices must be an integer tensor"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), lengths=torch.tensor([1]), stride_per_key_per_rank=[[1]],
                          inverse_indices=(["a"], torch.zeros(1, 2, dtype=torch.bool)))
