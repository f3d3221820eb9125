"""Managed-collision remapper: zero collisions among held ids, LFU/LRU eviction against a plain
reference, what a newcomer's row is reset to, buckets, the default row, O(N) state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrmctl.modules.managed_collision import EMPTY, ManagedCollisionRemapper, reset_uniform


def reference_remap(state: dict, ids: list[int], size: int, buckets: int, policy: str) -> list[int]:
    """The policy written out plainly, one id at a time (the vectorised remapper must agree)."""
    state["step"] += 1
    step = state["step"]
    rows, count, last = state["rows"], state["count"], state["last"]  # row -> id / count / last step
    held = {v: r for r, v in rows.items()}
    per = size // buckets
    protected = {held[v] for v in set(ids) if v in held}

    def order(b: int) -> list[int]:
        cand = [r for r in range(b * per, (b + 1) * per) if r not in protected]
        free = [r for r in cand if r not in rows]
        used = [r for r in cand if r in rows]
        key = (lambda r: (count[r], last[r], r)) if policy == "lfu" else (lambda r: (last[r], r))
        return free + sorted(used, key=key)

    cands = {b: order(b) for b in range(buckets)}
    for v in sorted(set(ids)):
        n = ids.count(v)
        if v in held:
            r = held[v]
            count[r] += n
        else:
            r = cands[v % buckets].pop(0)
            rows[r] = v
            count[r] = n
            held[v] = r
        last[r] = step
    return [held[v] for v in ids]


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("buckets", [1, 4])
def test_remap_and_eviction_equal_a_plain_per_id_reference_over_a_zipf_stream(policy, buckets):
    size, rng = 16, np.random.default_rng(0)
    m = ManagedCollisionRemapper(size, policy, buckets)
    state = {"step": 0, "rows": {}, "count": {}, "last": {}}
    for _ in range(60):
        ids = (rng.zipf(1.3, size // buckets) * 7919 + rng.integers(0, 3)).tolist()  # fits a bucket
        got, _, _ = m.remap_train(torch.tensor(ids))
        assert got.tolist() == reference_remap(state, ids, size, buckets, policy)
    held = {r: v for r, v in enumerate(m.row_ids[:size].tolist()) if v != EMPTY}
    assert held == state["rows"]
    assert {r: int(m.counts[r]) for r in held} == state["count"]


def test_held_ids_never_share_a_row_and_keep_theirs_while_held():
    rng = np.random.default_rng(1)
    m = ManagedCollisionRemapper(64, "lfu")
    before = {}
    for _ in range(200):
        ids = torch.from_numpy(rng.integers(1, 400, 40))
        rows, _, _ = m.remap_train(ids)
        pairs = set(zip(ids.tolist(), rows.tolist()))
        assert len({r for _, r in pairs}) == len({v for v, _ in pairs})  # distinct ids, distinct rows
        row_ids = m.row_ids[:64].tolist()
        now = {v: r for r, v in enumerate(row_ids) if v != EMPTY}
        assert len(now) == len([v for v in row_ids if v != EMPTY])  # no id held twice
        for v, r in before.items():
            if v in now:
                assert now[v] == r  # an id still held never moved
        before = now
        looked, held = m.lookup(torch.tensor(list(now)))
        assert held.all() and looked.tolist() == list(now.values())


def test_new_ids_report_the_row_they_took_and_an_evicted_row_restarts_from_the_newcomers_values():
    m = ManagedCollisionRemapper(2, "lru")
    m.remap_train(torch.tensor([5, 7]))
    m.remap_train(torch.tensor([7]))
    rows, taken, taken_ids = m.remap_train(torch.tensor([9, 7, 9]))
    assert rows.tolist() == [0, 1, 0]  # 9 evicts 5 (least recently seen); 7 keeps row 1
    assert sorted(zip(taken.tolist(), taken_ids.tolist())) == [(0, 9), (2, 0), (2, 0)]  # 2 = nothing to reset
    a = reset_uniform(torch.tensor([9, 9, 5]), 8, seed=3, low=-0.1, high=0.1)
    assert torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a.abs() <= 0.1).all() and a.dtype == torch.float32
    assert not torch.equal(a, reset_uniform(torch.tensor([9, 9, 5]), 8, seed=4, low=-0.1, high=0.1))


def test_unseen_ids_map_to_the_default_row_and_lookup_changes_nothing():
    m = ManagedCollisionRemapper(4, "lfu")
    m.remap_train(torch.tensor([11, 12]))
    snap = {k: v.clone() for k, v in m.state_dict().items()}
    assert m(torch.tensor([12, 99, 11, 0])).tolist() == [1, 4, 0, 4]
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in snap.items())


def test_a_bucketed_remapper_is_the_union_of_one_remapper_per_bucket():
    """What makes a row_wise-sharded remapper (whole buckets per rank) equal one process."""
    rng = np.random.default_rng(2)
    whole = ManagedCollisionRemapper(12, "lfu", buckets=3)
    parts = [ManagedCollisionRemapper(4, "lfu") for _ in range(3)]
    for _ in range(50):
        ids = torch.from_numpy(rng.integers(1, 60, 4))  # fits one bucket
        rows, _, _ = whole.remap_train(ids)
        for b, p in enumerate(parts):
            sel = ids % 3 == b
            if sel.any():
                r, _, _ = p.remap_train(ids[sel])
                assert torch.equal(rows[sel], r + 4 * b)
            else:
                p.step += 1  # every bucket counts the step
    for b, p in enumerate(parts):
        assert torch.equal(whole.row_ids[4 * b:4 * b + 4], p.row_ids[:4])


def test_state_is_o_of_size_whatever_the_number_of_distinct_ids():
    m = ManagedCollisionRemapper(1000, "lfu")
    nbytes = sum(b.numel() * b.element_size() for b in m.buffers())
    for i in range(50):
        m.remap_train(torch.arange(i * 1000, (i + 1) * 1000) * 104729 + 1)  # 50,000 distinct ids
    assert sum(b.numel() * b.element_size() for b in m.buffers()) == nbytes <= 6 * 8 * 1001
    assert m.held() == 1000


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="size must be >= 1"):
        ManagedCollisionRemapper(0)
    with pytest.raises(ValueError, match="buckets"):
        ManagedCollisionRemapper(10, buckets=3)
    with pytest.raises(ValueError, match="eviction"):
        ManagedCollisionRemapper(10, "fifo")


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_an_evicted_row_restarts_from_the_newcomers_values_with_zero_optimizer_state(kernel):
    """A row trained for one id, then taken by another: its weights become the newcomer's reset
    values and its optimizer state (fused TBE momentum / the dense-kernel optimizer's) zero; the
    rows of held ids keep theirs."""
    from dlrmctl import HAS_FBGEMM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.modules.managed_collision import ManagedCollisionCollection
    from dlrmctl.optim.dense import embedding_optimizer_for_dense, row_state_tensors
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor

    if kernel == "fused" and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    t = EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=4, feature_names=["f"])
    ebc = EmbeddingBagCollection([t], compute_kernel=kernel, optimizer=EmbeddingOptimizerSpec(lr=0.5), check_ids=False)
    mc = ManagedCollisionCollection([t], {"t": (2, "lru", 1)}, seed=7)
    ebc.set_managed_collision(mc)
    opt = None
    if kernel == "dense":
        opt = embedding_optimizer_for_dense(list(ebc.parameters()), "exact_rowwise_adagrad", 0.5, 1e-8, 0.0)
        mc.dense_optimizer = opt

    def step(ids):
        kjt = KeyedJaggedTensor(["f"], torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64))
        ebc(kjt).values().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()

    def state(row):
        w = ebc.embedding_weights()["t"]
        st = ebc.fused_optimizer().momentum()["t"] if kernel == "fused" else row_state_tensors(opt, w)
        return w[row].detach().clone(), [s[row].clone() for s in st]

    step([101, 202])  # rows 0, 1
    step([202])       # 202 seen last: 101 is the least recently seen
    w1, s1 = state(1)
    assert all(bool((s != 0).any()) for s in s1)
    step([303])       # takes row 0 from 101
    w0, s0 = state(0)
    assert mc.remappers["t"](torch.tensor([303, 101])).tolist() == [0, 2]  # 101 gone: the default row
    # reset to the newcomer's values and zero state, then one row-wise Adagrad step on a gradient of
    # ones: G = mean(g^2) = 1, w -= lr * g / sqrt(G) = 0.5 (nothing of 101's row or state is left)
    fresh = mc.reset_values("t", torch.tensor([303]), 4)[0]
    assert (fresh.abs() <= t.get_weight_init_max()).all()
    assert torch.allclose(w0, fresh - 0.5, atol=1e-5), (w0, fresh)
    assert len(s0) == 1 and torch.allclose(s0[0], torch.ones_like(s0[0]), atol=1e-6), s0
    w1b, s1b = state(1)
    assert torch.equal(w1b, w1) and all(torch.equal(a, b) for a, b in zip(s1b, s1))  # 202's row untouched


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("buckets", [1, 4])
def test_topk_eviction_and_merged_lookup_keep_exactly_the_state_of_the_full_sort(policy, buckets):
    """The incremental step (topk candidates, sorted ids merged) equals sorting every row each
    step, buffer for buffer, including after the packed key stops fitting (it falls back)."""
    size, rng = 64, np.random.default_rng(3)
    fast, ref = ManagedCollisionRemapper(size, policy, buckets), ManagedCollisionRemapper(size, policy, buckets)
    ref.incremental = False
    for step in range(80):
        if step == 50:
            fast._count_bound = 1 << 61  # the packed key would overflow: the sort path from here on
        ids = torch.tensor((rng.zipf(1.2, rng.integers(0, size // buckets + 1)) * 7919).tolist(), dtype=torch.int64)
        a, b = fast.remap_train(ids), ref.remap_train(ids)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
        for name, buf in ref.named_buffers():
            assert torch.equal(getattr(fast, name), buf), (step, name)
    assert ref.held() == size


def _optimizer_cases():
    from dlrmctl.optim.registry import EMBEDDING_OPTIMIZERS

    return [(name, kernel) for name, rec in EMBEDDING_OPTIMIZERS.items()
            for kernel in (("dense", "fused") if rec.fused_on_cpu else ("dense",))]


@pytest.mark.parametrize("optimizer, kernel", _optimizer_cases())
def test_under_every_embedding_optimizer_an_evicted_row_trains_as_a_fresh_row(optimizer, kernel):
    """Whatever the optimizer (its state per row or per element, a global step or not), the row a
    newcomer takes after an eviction updates exactly like a row that starts from the newcomer's
    values with no optimizer state, at the same step: nothing of the evicted id's weights or
    state is left.  Reference: a plain collection whose row 0 is never looked up before that step."""
    from dlrmctl import HAS_FBGEMM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.modules.managed_collision import ManagedCollisionCollection
    from dlrmctl.optim.dense import embedding_optimizer_for_dense, row_state_tensors
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor

    if kernel == "fused" and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    t = EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=4, feature_names=["f"])
    spec = EmbeddingOptimizerSpec(optimizer, lr=0.1)

    def collection():
        ebc = EmbeddingBagCollection([t], compute_kernel=kernel, optimizer=spec, check_ids=False)
        opt = None
        if kernel == "dense":
            opt = embedding_optimizer_for_dense(list(ebc.parameters()), optimizer, 0.1, spec.eps, 0.0, spec.betas)
        return ebc, opt

    def step(ebc, opt, ids, grad):
        kjt = KeyedJaggedTensor(["f"], torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64))
        (ebc(kjt).values() * grad).sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()

    def row(ebc, opt, r):
        w = ebc.embedding_weights()["t"]
        st = ebc.fused_optimizer().momentum().get("t", []) if kernel == "fused" else row_state_tensors(opt, w)
        return w[r].detach().clone(), [s[r].clone() for s in st]

    g = torch.tensor([[0.3, -1.0, 2.0, 0.5]])
    ebc, opt = collection()
    mc = ManagedCollisionCollection([t], {"t": (2, "lru", 1)}, seed=7)
    ebc.set_managed_collision(mc)
    mc.dense_optimizer = opt
    step(ebc, opt, [101, 202], g.repeat(2, 1))  # rows 0, 1
    step(ebc, opt, [202], g)
    old_w, old_s = row(ebc, opt, 0)
    step(ebc, opt, [303], -2 * g)  # takes row 0 from 101 (least recently seen)
    got_w, got_s = row(ebc, opt, 0)

    ref, ropt = collection()  # row 1 trains at steps 1 and 2; row 0 starts at step 3 from 303's values
    step(ref, ropt, [1], g)
    step(ref, ropt, [1], g)
    with torch.no_grad():
        ref.embedding_weights()["t"][0] = mc.reset_values("t", torch.tensor([303]), 4)[0]
    step(ref, ropt, [0], -2 * g)
    want_w, want_s = row(ref, ropt, 0)
    assert not torch.allclose(got_w, old_w)
    assert torch.allclose(got_w, want_w, atol=1e-6), (got_w, want_w)
    assert len(got_s) == len(want_s)
    for a, b in zip(got_s, want_s):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    assert not old_s or any(not torch.allclose(a, b) for a, b in zip(old_s, got_s))
