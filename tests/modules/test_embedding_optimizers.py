"""The Adam family of embedding optimizers (``adam``, ``partial_rowwise_adam``, ``lamb``,
``partial_rowwise_lamb``): FBGEMM's update rules on the rows in the batch.

* FBGEMM 1.8's CPU TBE refuses them, so the ``fused`` kernel on CPU serves such tables with the
  ``dense`` kernel (``nn.EmbeddingBag(sparse=True)`` + :mod:`dlrmctl.optim`);
* the dense kernel equals an independent float64 reference written from FBGEMM's formulas
  (``fbgemm_gpu/codegen/genscript/optimizers.py``: duplicate ids summed, only rows in the batch
  updated, bias correction with the global step) to 1e-6 over 10 steps with duplicate ids,
  empty bags and a step where a table sees no id at all, with and without weight decay;
* the ``fused`` kernel equals the ``dense`` one over the same 10 steps (on CUDA: FBGEMM's fused
  TBE optimizer against the dense kernel; marked ``cuda``, skipped without a GPU);
* optimizer state round trip, dense gradients, config, planner storage / column rule / advice.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.sparse import KeyedJaggedTensor

TYPES = ["adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"]
TABLES = [
    EmbeddingBagConfig(name="T0", num_embeddings=12, embedding_dim=8, feature_names=["f0", "f1"], pooling="sum"),
    EmbeddingBagConfig(name="T1", num_embeddings=7, embedding_dim=4, feature_names=["f2"], pooling="mean"),
]
LR, BETAS, EPS = 0.01, (0.9, 0.99), 1e-8
STEPS, B = 10, 5


def _batches(seed: int = 0):
    """10 weighted batches of B=5: duplicate ids, empty bags, T1 without any id at step 3,
    T0's row 11 looked up only from step 6 on (its first update uses t = 7)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        lens, vals = [], []
        for t in TABLES:
            for _ in t.feature_names:
                n = torch.randint(0, 4, (B,), generator=g)
                n[step % B] = 0  # an empty bag
                if t.name == "T1" and step == 3:
                    n.zero_()
                hi = t.num_embeddings if (t.name != "T0" or step >= 6) else t.num_embeddings - 1
                v = torch.randint(0, max(1, hi // 2), (int(n.sum()),), generator=g)  # small range: duplicates
                if v.numel() and t.name == "T0" and step >= 6:
                    v[0] = 11
                lens.append(n)
                vals.append(v)
        values = torch.cat(vals)
        w = torch.rand(values.numel(), generator=g) + 0.5
        kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=torch.cat(lens), weights=w)
        gout = torch.randn(B, 8 + 8 + 4, generator=g)
        out.append((kjt, gout))
    return out


def _row_grads(kjt: KeyedJaggedTensor, gout: torch.Tensor) -> dict[str, dict[int, np.ndarray]]:
    """Per table, per row: the float64 gradient summed over every occurrence (explicit bag loop)."""
    grads: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in TABLES}
    col, k = 0, 0
    vals, wts, lens = kjt.values().tolist(), kjt.weights().double().tolist(), kjt.lengths().tolist()
    pos = 0
    for t in TABLES:
        for _ in t.feature_names:
            for b in range(B):
                n = lens[k * B + b]
                go = gout[b, col:col + t.embedding_dim].double().numpy()
                for j in range(pos, pos + n):
                    scale = wts[j] / (n if t.pooling.value == "mean" else 1)
                    r = vals[j]
                    grads[t.name][r] = grads[t.name].get(r, np.zeros(t.embedding_dim)) + scale * go
                pos += n
            col += t.embedding_dim
            k += 1
    return grads


def _reference_step(kind: str, W, M1, M2, grads: dict[int, np.ndarray], t: int, wd: float) -> None:
    """FBGEMM's rules (optimizers.py adam / partial_rowwise_adam / lamb / partial_rowwise_lamb), float64, per row."""
    b1, b2 = BETAS
    for r, g in grads.items():
        M1[r] = b1 * M1[r] + (1 - b1) * g
        if kind.startswith("partial_rowwise"):
            M2[r] = b2 * M2[r] + (1 - b2) * float(np.mean(g * g))
        else:
            M2[r] = b2 * M2[r] + (1 - b2) * g * g
        u = (M1[r] / (1 - b1**t)) / (np.sqrt(M2[r] / (1 - b2**t)) + EPS) + wd * W[r]
        if kind.endswith("lamb"):
            u = u * (np.linalg.norm(W[r]) / np.linalg.norm(u))
        W[r] = W[r] - LR * u


def _ebc(kind: str, kernel: str, device: str, wd: float):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    spec = EmbeddingOptimizerSpec(kind, lr=LR, eps=EPS, weight_decay=wd, betas=BETAS)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True, device=device, compute_kernel=kernel, optimizer=spec, seed=5)
    dense = ebc.lookup.dense_parameters()
    opt = embedding_optimizer_for_dense(dense, kind, LR, EPS, wd, BETAS) if dense else None
    return ebc, opt


def _states(ebc, opt) -> dict[str, list[torch.Tensor]]:
    """Table -> its moments (fused: the TBE's; dense: the torch optimizer's), on the CPU."""
    from types import SimpleNamespace

    from dlrmctl.train.checkpoint import local_embedding_shards

    model = SimpleNamespace(sparse_arch=ebc)  # what the checkpoint code reads of a DLRM
    return {n: [m.detach().cpu() for m in st] for n, _, _, _, st in local_embedding_shards(model, opt)}


def _train(ebc, opt, batches, device: str):
    for kjt, gout in batches:
        out = ebc(kjt.to(device)).values()
        (out * gout.to(device)).sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


# ------------------------------------------------------------------- kernels
@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")
@pytest.mark.parametrize("kind", TYPES)
def test_fbgemm_cpu_tbe_refuses_the_adam_family_so_the_fused_kernel_uses_the_dense_one(kind):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from dlrmctl.modules.embedding_modules import fused_supports_optimizer
    from dlrmctl.optim.registry import embedding_optimizer

    with pytest.raises(AssertionError, match="not supported in CPU mode"):
        SplitTableBatchedEmbeddingBagsCodegen([(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                              optimizer=getattr(EmbOptimType, embedding_optimizer(kind).fbgemm))
    assert not fused_supports_optimizer(kind, "cpu") and fused_supports_optimizer(kind, "cuda")
    assert fused_supports_optimizer("exact_rowwise_adagrad", "cpu")
    ebc, opt = _ebc(kind, "fused", "cpu", 0.0)
    assert len(ebc.lookup.tbes) == 0 and sorted(ebc.lookup.dense_tables) == ["T0", "T1"]


@pytest.mark.parametrize("wd", [0.0, 0.05], ids=["no_wd", "wd"])
@pytest.mark.parametrize("kind", TYPES)
def test_dense_kernel_equals_a_float64_fbgemm_reference_over_10_steps(kind, wd):
    batches = _batches()
    ebc, opt = _ebc(kind, "dense", "cpu", wd)
    W = {n: w.detach().double().numpy().copy() for n, w in ebc.embedding_weights().items()}
    M1 = {t.name: np.zeros((t.num_embeddings, t.embedding_dim)) for t in TABLES}
    rowwise = kind.startswith("partial_rowwise")
    M2 = {t.name: np.zeros(t.num_embeddings if rowwise else (t.num_embeddings, t.embedding_dim)) for t in TABLES}
    touched_11 = []
    for step, (kjt, gout) in enumerate(batches, start=1):
        before = {n: w.detach().clone() for n, w in ebc.embedding_weights().items()}
        _train(ebc, opt, [(kjt, gout)], "cpu")
        grads = _row_grads(kjt, gout)
        for n in W:
            _reference_step(kind, W[n], M1[n], M2[n], grads[n], step, wd)
            got = ebc.embedding_weights()[n].detach()
            np.testing.assert_allclose(got.double().numpy(), W[n], rtol=0, atol=1e-6, err_msg=f"{kind} step {step} {n}")
            untouched = [r for r in range(got.shape[0]) if r not in grads[n]]
            assert torch.equal(got[untouched], before[n][untouched]), f"step {step}: rows not in the batch moved"
        touched_11.append(11 in grads["T0"])
        assert opt.param_groups[0]["step"] == step
    assert touched_11.index(True) == 6 and not any(touched_11[:6])  # first update of row 11 at t = 7
    st = _states(ebc, opt)
    for n in W:
        m1, m2 = st[n]
        np.testing.assert_allclose(m1.double().numpy(), M1[n], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(m2.double().numpy(), M2[n], rtol=1e-5, atol=1e-9)
        assert tuple(m2.shape) == ((m1.shape[0],) if rowwise else tuple(m1.shape))


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FBGEMM, reason="the fused kernel needs fbgemm_gpu")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", TYPES)
def test_fused_kernel_equals_dense_kernel_over_10_steps(kind, device):
    """CUDA: FBGEMM's fused TBE optimizer vs the dense kernel (untested here: no GPU on the dev
    box); CPU: the fused kernel falls back to the dense one (same code, equal bit for bit)."""
    batches = _batches(seed=1)
    fused, f_opt = _ebc(kind, "fused", device, 0.01)
    dense, d_opt = _ebc(kind, "dense", device, 0.01)
    assert (len(fused.lookup.tbes) == 1) == (device == "cuda")
    for step in range(STEPS):
        _train(fused, f_opt, batches[step:step + 1], device)
        _train(dense, d_opt, batches[step:step + 1], device)
        for n, w in dense.embedding_weights().items():
            torch.testing.assert_close(fused.embedding_weights()[n].detach().cpu(), w.detach().cpu(), atol=1e-6, rtol=0,
                                       msg=f"{kind} step {step + 1} {n}")
    fs, ds = _states(fused, f_opt), _states(dense, d_opt)
    for n in ds:
        assert [tuple(m.shape) for m in fs[n]] == [tuple(m.shape) for m in ds[n]]
        for a, b in zip(fs[n], ds[n]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ optimizer
@pytest.mark.parametrize("kind", TYPES)
def test_dense_gradients_update_the_nonzero_rows_like_sparse_ones_and_state_round_trips(kind):
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(9, 4, generator=g)
    grads = []
    for _ in range(4):
        d = torch.zeros(9, 4)
        rows = torch.randint(0, 9, (3,), generator=g)
        d[rows] = torch.randn(3, 4, generator=g)
        grads.append(d)
    ps = [torch.nn.Parameter(w0.clone()) for _ in range(3)]
    opts = [embedding_optimizer_for_dense([p], kind, 0.05, 1e-8, 0.01) for p in ps]
    for i, d in enumerate(grads):
        ps[0].grad = d.clone()
        ps[1].grad = d.to_sparse(1)
        if i == 2:  # the third optimizer is rebuilt from a state_dict half-way
            sd = opts[2].state_dict()
            ps[2] = torch.nn.Parameter(ps[2].detach().clone())
            opts[2] = embedding_optimizer_for_dense([ps[2]], kind, 0.05, 1e-8, 0.01)
            opts[2].load_state_dict(sd)
            assert opts[2].param_groups[0]["step"] == 2
        ps[2].grad = d.to_sparse(1)
        for o in opts:
            o.step()
    assert torch.equal(ps[0].detach(), ps[1].detach()) and torch.equal(ps[1].detach(), ps[2].detach())
    never = [r for r in range(9) if all(not d[r].any() for d in grads)]
    assert never and torch.equal(ps[0].detach()[never], w0[never])


def test_unknown_type_and_bad_betas_are_refused():
    from dlrmctl.config import ConfigError, config_from_dict
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    p = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="partial_rowwise_adam"):
        embedding_optimizer_for_dense([p], "adamw", 0.1, 1e-8, 0.0)
    with pytest.raises(ValueError, match="betas"):
        embedding_optimizer_for_dense([p], "adam", 0.1, 1e-8, 0.0, (0.9, 1.0))
    cfg = config_from_dict({"optimizer": {"embedding": {"type": "partial_rowwise_lamb", "betas": [0.8, 0.95]}}})
    assert cfg.optimizer.embedding.betas == [0.8, 0.95]
    with pytest.raises(ConfigError, match="optimizer.embedding.betas"):
        config_from_dict({"optimizer": {"embedding": {"type": "adam", "betas": [0.9]}}})
    with pytest.raises(ConfigError, match="optimizer.embedding.type: expected one of .*'lamb'"):
        config_from_dict({"optimizer": {"embedding": {"type": "adamw"}}})


# -------------------------------------------------------------------- planner
def test_planner_counts_adam_state_and_leaves_column_kinds_out_for_row_coupled_optimizers():
    from dlrmctl.distributed.types import ShardingType as ST
    from dlrmctl.planner.enumerator import column_shards_change_training, enumerate_options
    from dlrmctl.planner.storage import optimizer_state_bytes
    from dlrmctl.planner.types import TableSpec, Topology

    assert optimizer_state_bytes("adam", 1000, 64) == optimizer_state_bytes("lamb", 1000, 64) == 2 * 1000 * 64 * 4
    assert optimizer_state_bytes("partial_rowwise_adam", 1000, 64) == 1000 * 64 * 4 + 1000 * 4
    assert optimizer_state_bytes("partial_rowwise_lamb", 1000, 64) == 1000 * 64 * 4 + 1000 * 4
    topo = Topology.from_preset("cpu", 2)
    for opt in ["adam", *TYPES[1:], "exact_rowwise_adagrad", "exact_adagrad"]:
        kinds = {o.sharding_type for o in enumerate_options(TableSpec("t", 5000, 64, [1.0], optimizer=opt), topo, 512, int(8e9))[0]}
        coupled = column_shards_change_training(opt)
        assert coupled == (opt not in ("adam", "exact_adagrad")), opt
        assert (ST.COLUMN_WISE in kinds) == (not coupled), (opt, kinds)


def test_infeasibility_advice_suggests_partial_rowwise_adam_where_it_would_fit():
    from dlrmctl.planner.planner import EmbeddingShardingPlanner
    from dlrmctl.planner.types import PlanError, TableSpec, Topology

    big = TableSpec("big", 274_352_000, 192, [1.0], optimizer="adam")
    with pytest.raises(PlanError) as e:  # adam needs ~74 GiB per rank row-wise on 8 x 80 GB
        EmbeddingShardingPlanner(Topology.from_preset("h100", 8), 16384).plan([big])
    msg = str(e.value)
    assert "partial_rowwise_adam (first moment per weight, second moment one fp32 per row) instead of adam" in msg
    assert "exact_rowwise_adagrad (one fp32 per row) instead of adam" in msg
    res = EmbeddingShardingPlanner(Topology.from_preset("h100", 8), 16384).plan(
        [dataclasses.replace(big, optimizer="partial_rowwise_adam")])
    assert sorted({s.rank for s in res.plan.plan["big"].shards}) == list(range(8))
    # and with 4 ranks partial row-wise Adam does not fit either: not suggested
    with pytest.raises(PlanError) as e:
        EmbeddingShardingPlanner(Topology.from_preset("h100", 4), 16384).plan([big])
    assert "partial_rowwise_adam" not in str(e.value).split("what would make it fit")[1]


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd", *TYPES])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sync_free", [True, False], ids=["device_pass", "cpu_compact_pass"])
def test_the_sync_free_row_pass_updates_as_the_coalesced_gradient_does(opt, wd, dtype, sync_free, monkeypatch):
    # the dense kernel's uncoalesced EmbeddingBag gradient goes through a sort-based pass with no
    # host sync (rows padded with repeats of the last one) instead of coalesce() / unique: over 8
    # steps with many duplicate ids, weights and state equal those of the compact pass (each
    # distinct row once, duplicates summed in input order) bit for bit, and coalesce()'s sums
    # (another summation order) to float rounding
    import torch.nn.functional as F

    from dlrmctl.optim import rows as optim
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    monkeypatch.setattr(optim, "SYNC_FREE_ROWS_ON_CPU", sync_free)  # the CUDA path's pass, or the CPU's

    def compact(grad):  # the distinct rows once, duplicates summed in input order, as a coalesced gradient
        idx, vals = grad._indices()[0], grad._values().float()
        if idx.numel() == 0:
            return grad.float().coalesce()
        sidx, perm = torch.sort(idx, stable=True)
        rows, counts = torch.unique_consecutive(sidx, return_counts=True)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        sums = F.embedding_bag(perm, vals, offs, mode="sum", include_last_offset=True)
        return torch.sparse_coo_tensor(rows[None], sums, grad.shape, is_coalesced=True)

    if dtype == torch.float16 and opt in TYPES:
        pytest.skip("fp16 tables train with the Adagrads and SGD only")
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(20, 6, generator=g).to(dtype)
    pa, pb, pc = (torch.nn.Parameter(w0.clone()) for _ in range(3))
    oa, ob, oc = (embedding_optimizer_for_dense([p], opt, 0.05, 1e-8, wd) for p in (pa, pb, pc))
    pb.grad_dtype = None  # the compact reference: fp32 sums (the optimizers sum an fp16 gradient in fp32)
    for step in range(8):
        n = 0 if step == 4 else 40  # a step without any id: no update
        idx = torch.randint(0, 20 if step % 2 else 5, (1, n), generator=g)  # odd steps: few duplicates
        vals = torch.randn(n, 6, generator=g).to(dtype)
        grad = torch.sparse_coo_tensor(idx, vals, (20, 6))
        assert n == 0 or not grad.is_coalesced()
        pa.grad, pb.grad, pc.grad = grad, compact(grad), grad.coalesce()
        for o in (oa, ob, oc):
            o.step()
        assert torch.equal(pa, pb), (step, (pa.float() - pb.float()).abs().max())
        torch.testing.assert_close(pa.float(), pc.float(), rtol=1e-6 if dtype == torch.float32 else 1e-3,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3)
    for k, v in ob.state[pb].items():
        if torch.is_tensor(v):
            assert torch.equal(oa.state[pa][k], v), k
