"""Device checks (``pytest -m cuda``): the same computation on the accelerator and on the CPU.

Every test is parametrized over the device.  The ``cuda`` variants skip when CUDA is not
available; the ``cpu`` variants run everywhere, so ``pytest -m cuda`` on a CPU-only machine
runs the same checks on CPU / gloo (and ``scripts/gpu_check.sh`` runs them on a GPU box).

* dense-kernel EmbeddingBagCollection (sum, mean, weighted, empty bags and a feature whose
  whole batch is empty, a table with a dim that is not a multiple of 4): forward values,
  gradients and one step of each embedding optimizer against an explicit float64 CPU
  reference (a loop over bags, no ``nn.EmbeddingBag``);
* a DLRM built by :func:`dlrmctl.train.factory.build_model`: three training steps
  (forward, backward, dense + embedding optimizer steps) on the device equal the same
  steps on CPU to 1e-5 (losses, logits, every parameter).  The dense optimizer is SGD:
  the first Adagrad / Adam step is ``lr * sign(g)``, which makes a cross-device parity
  check ill-conditioned for gradient entries near zero;
* the sharded EmbeddingBagCollection on a ONE-rank process group (nccl on CUDA, gloo on
  CPU, in-process store: ``init_distributed(single_rank_group=True)``) for all six
  sharding types, weighted and not: the real collectives run (all-to-all, all-gather,
  ...).  Outputs over three steps and the weights after the fused / dense embedding
  optimizer updates equal the unsharded CPU EmbeddingBagCollection's (the case runner of
  ``tests/distributed/test_sharding.py``, atol 1e-5); and a batch of 0 samples / of only empty bags
  goes through every collective, pools to zeros and leaves the group usable;
* an fp16 export artifact of a briefly trained DLRM loads and scores (needs fbgemm_gpu;
  the CUDA variant needs an export / load API that takes a device).

Each test takes well under a few seconds; every one carries a timeout and every process
group a collective timeout, so a hang fails instead of blocking the run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from dlrmctl.sparse import KeyedJaggedTensor

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA is not available")),
]
ATOL = 1e-5


# ------------------------------------------------------------------------ helpers
def _batch(tables, B: int, weighted: bool, seed: int, all_empty: tuple[str, ...] = ()) -> KeyedJaggedTensor:
    """A KJT over every feature of ``tables``: bag lengths 0..4 (each feature has an empty bag
    at a different sample, repeated ids are likely), features in ``all_empty`` have no ids at all."""
    g = torch.Generator().manual_seed(seed)
    keys, vals, lens = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(0, 5, (B,), generator=g)
            n[len(keys) % B] = 0
            if f in all_empty:
                n.zero_()
            keys.append(f)
            lens.append(n)
            vals.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=g))
    values = torch.cat(vals)
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys, values, lengths=torch.cat(lens), weights=weights)


def _reference_pool(weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor, tables, weighted: bool) -> torch.Tensor:
    """Explicit pooling on CPU, one bag at a time: ``sum_i w_i e_{id_i}``, divided by the bag
    length for mean pooling; an empty bag is zeros.  Output ``[B, sum of feature dims]``."""
    B = kjt.stride()
    cols = []
    for t in tables:
        W = weights[t.name]
        for f in t.feature_names:
            jt = kjt[f]
            lens, ids = jt.lengths().tolist(), jt.values().tolist()
            ws = jt.weights().tolist() if weighted else [1.0] * len(ids)
            bags, p = [], 0
            for b in range(B):
                acc = torch.zeros(t.embedding_dim, dtype=W.dtype)
                for k in range(p, p + lens[b]):
                    acc = acc + ws[k] * W[ids[k]]
                if t.pooling == PoolingType.MEAN and lens[b]:
                    acc = acc / lens[b]
                bags.append(acc)
                p += lens[b]
            cols.append(torch.stack(bags))
    return torch.cat(cols, dim=1)


def _reference_step(w: torch.Tensor, g: torch.Tensor, opt: str, lr: float, eps: float) -> torch.Tensor:
    """One textbook embedding-optimizer step (FBGEMM's update rules) from zero state."""
    if opt == "exact_rowwise_adagrad":
        G = g.pow(2).sum(1) / w.shape[1]
        return w - lr * g / (G.sqrt() + eps).unsqueeze(1)
    if opt == "exact_adagrad":
        return w - lr * g / (g.pow(2).sqrt() + eps)
    assert opt == "exact_sgd"
    return w - lr * g


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(got.detach().cpu().to(want.dtype), want.detach().cpu(), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------- dense-kernel EmbeddingBagCollection
EBC_TABLES = [
    # two features share a table
    EmbeddingBagConfig(num_embeddings=13, embedding_dim=8, name="t_sum", feature_names=["f_a", "f_b"], pooling="sum"),
    EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t_mean", feature_names=["f_c"], pooling="mean"),
    # dim not a multiple of 4
    EmbeddingBagConfig(num_embeddings=5, embedding_dim=6, name="t_odd", feature_names=["f_d"], pooling="sum"),
    # its feature has no id in the batch
    EmbeddingBagConfig(num_embeddings=4, embedding_dim=4, name="t_quiet", feature_names=["f_e"], pooling="mean"),
]


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("device", DEVICES)
def test_dense_kernel_ebc_matches_explicit_cpu_reference(device, weighted, opt):
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    lr, eps, B = 0.1, 1e-8, 6
    ebc = EmbeddingBagCollection(EBC_TABLES, is_weighted=weighted, device=device, compute_kernel="dense", seed=5)
    cpu = EmbeddingBagCollection(EBC_TABLES, is_weighted=weighted, device="cpu", compute_kernel="dense", seed=5)
    assert ebc.compute_kernel == "dense"
    w0 = {k: v.detach().cpu().clone() for k, v in ebc.embedding_weights().items()}
    for k, v in cpu.embedding_weights().items():  # sharding/device-independent init
        assert torch.equal(w0[k], v.detach()), f"initial weights of {k} differ between {device} and cpu"
        assert w0[k].device.type == "cpu" and ebc.embedding_weights()[k].device.type == torch.device(device).type

    kjt = _batch(EBC_TABLES, B, weighted, seed=11, all_empty=("f_e",))
    ref_w = {k: v.double().requires_grad_(True) for k, v in w0.items()}
    ref_out = _reference_pool(ref_w, kjt, EBC_TABLES, weighted)
    out = ebc(kjt.to(device)).values()
    assert out.device.type == torch.device(device).type and out.dtype == torch.float32
    assert out.shape == ref_out.shape == (B, 8 + 8 + 4 + 6 + 4)
    _close(out, ref_out, "pooled output")
    _close(cpu(kjt).values(), ref_out, "pooled output of the cpu EBC")

    up = torch.randn(B, out.shape[1], generator=torch.Generator().manual_seed(12))
    (out * up.to(device)).sum().backward()
    (ref_out * up.double()).sum().backward()
    params = dict(zip([t.name for t in EBC_TABLES], ebc.lookup.dense_parameters()))
    # no id looked up: the table stays in the graph (backward always runs) with an empty gradient
    g = params["t_quiet"].grad
    assert g is not None and g.is_sparse and g._nnz() == 0
    for name, p in params.items():
        if name == "t_quiet":
            continue
        assert p.grad is not None and p.grad.is_sparse, f"{name}: expected a sparse gradient"
        _close(p.grad.to_dense(), ref_w[name].grad, f"gradient of {name}")
        nz = ref_w[name].grad[ref_w[name].grad != 0].abs()
        # the first Adagrad step is lr * sign(g): make sure no entry is within rounding of 0
        assert nz.numel() == 0 or float(nz.min()) > 1e-4, f"{name}: a gradient entry is too close to 0"

    emb_opt = embedding_optimizer_for_dense(list(params.values()), opt, lr, eps, 0.0)
    emb_opt.step()
    for name, p in params.items():
        if name == "t_quiet":
            continue
        want = _reference_step(ref_w[name].detach(), ref_w[name].grad, opt, lr, eps)
        _close(p, want, f"{name} after one {opt} step")
    assert torch.equal(params["t_quiet"].detach().cpu(), w0["t_quiet"]), "an untouched table changed"


# ---------------------------------------------------------------------------- DLRM step
def _dlrm_cfg():
    from dlrmctl.config import config_from_dict

    return config_from_dict({
        "name": "cuda_check",
        "model": {
            "embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1],
            "tables": [
                {"name": "t0", "num_embeddings": 40, "feature_names": ["s0", "s1"]},
                {"name": "t1", "num_embeddings": 17, "pooling": "mean"},
                {"name": "t2", "num_embeddings": 11},
                {"name": "t3", "num_embeddings": 25},
            ],
        },
        "optimizer": {"embedding": {"type": "exact_rowwise_adagrad", "lr": 0.05}, "dense": {"type": "sgd", "lr": 0.1}},
        "train": {"seed": 3},
    })


def _dlrm_run(device: str, kernel: str, batch_sizes=(32, 17, 1)):
    """Three steps as the trainer runs them (unsharded path); returns per-step (loss, logits)
    and the final dense parameters and tables, all on CPU."""
    from dlrmctl.config import resolve_tables
    from dlrmctl.train.factory import build_model
    from dlrmctl.optim.dense import dense_optimizer, embedding_optimizer_for_dense

    cfg = _dlrm_cfg()
    tables = resolve_tables(cfg, None)
    model = build_model(cfg, tables, 5, device=device, compute_kernel=kernel)
    assert model.sparse_arch.compute_kernel == kernel
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    dense_opt = dense_optimizer(dense_params, cfg.optimizer.dense)
    e = cfg.optimizer.embedding
    emb_dense = model.sparse_arch.lookup.dense_parameters()
    emb_opt = embedding_optimizer_for_dense(emb_dense, e.type, e.lr, e.eps, e.weight_decay) if emb_dense else None
    g = torch.Generator().manual_seed(7)
    steps = []
    for i, B in enumerate(batch_sizes):
        kjt = _batch(tables, B, weighted=False, seed=100 + i)
        dense = torch.randn(B, 5, generator=g)
        labels = torch.randint(0, 2, (B,), generator=g).float()
        logits = model(dense.to(device), kjt.to(device)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device), reduction="sum") / B
        dense_opt.zero_grad(set_to_none=True)
        if emb_opt is not None:
            emb_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        if emb_opt is not None:
            emb_opt.step()
        steps.append((loss.item(), logits.detach().cpu()))
    dense_state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if not n.startswith("sparse_arch.")}
    tables_state = {k: v.detach().cpu().clone() for k, v in model.sparse_arch.embedding_weights().items()}
    return steps, dense_state, tables_state


@pytest.mark.parametrize("kernel", ["dense", pytest.param("fused", marks=pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed"))])
@pytest.mark.parametrize("device", DEVICES)
def test_dlrm_training_steps_on_device_equal_cpu(device, kernel):
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 matmuls: fp32 parity with the CPU
    try:
        ref_steps, ref_dense, ref_tables = _dlrm_run("cpu", "dense")
        steps, dense_state, tables_state = _dlrm_run(device, kernel)
    finally:
        torch.set_float32_matmul_precision(precision)
    for i, ((loss, logits), (ref_loss, ref_logits)) in enumerate(zip(steps, ref_steps)):
        assert abs(loss - ref_loss) <= ATOL, f"step {i}: loss {loss} vs cpu {ref_loss}"
        _close(logits, ref_logits, f"step {i}: logits")
    for n, p in ref_dense.items():
        _close(dense_state[n], p, f"dense parameter {n} after {len(steps)} steps")
    for n, w in ref_tables.items():
        _close(tables_state[n], w, f"table {n} after {len(steps)} steps")


# ------------------------------------------------------------ sharded EBC on a one-rank group
def _one_rank_cases():
    from tests.distributed.test_sharding import ALL_TYPES, cases

    return [c for c in cases(1) if c.types in ALL_TYPES]


@pytest.fixture
def one_rank_group(request, monkeypatch):
    """A real process group of one rank on ``device`` (nccl for cuda, gloo for cpu), torn down after."""
    import torch.distributed as dist

    from dlrmctl.distributed.env import destroy_distributed, init_distributed

    device = request.node.callspec.params["device"]
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized(), "a default process group already exists"
    env = init_distributed(single_rank_group=True, device=device, timeout_s=90)
    try:
        assert env.pg is not None and env.world_size == 1
        assert env.backend == ("nccl" if device == "cuda" else "gloo")
        yield env
    finally:
        destroy_distributed()


@pytest.mark.parametrize("case", _one_rank_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_ebc_on_one_rank_group_matches_unsharded_cpu_ebc(device, case, one_rank_group):
    from tests.distributed.test_sharding import run_case

    assert one_rank_group.device.type == device
    # no empty global batch here: without fbgemm the reference is the dense kernel, whose
    # output for a batch without any id has no grad_fn (its backward raises); empty batches
    # of the sharded module are checked below
    case = dataclasses.replace(case, batch_sizes=[5, 2, 1])
    err = run_case(one_rank_group, case)
    assert err is None, f"{case.name} on {one_rank_group.backend}: {err}"


@pytest.mark.parametrize("sharding_type", ["data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise",
                                           "table_column_wise"])
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_ebc_on_one_rank_group_handles_empty_batches(device, sharding_type, one_rank_group):
    """A batch of 0 samples and a batch whose bags are all empty go through every collective
    (zero-sized all-to-alls included) and pool to zeros; the group stays usable afterwards."""
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from tests.distributed.test_sharding import TABLES

    spec = EmbeddingOptimizerSpec("exact_adagrad", lr=0.1)
    plan = plan_from_types(TABLES, sharding_type, 1)
    sebc = ShardedEmbeddingBagCollection(TABLES, plan, one_rank_group, True, spec, seed=3)
    ref = EmbeddingBagCollection(TABLES, is_weighted=True, compute_kernel="dense", optimizer=spec, seed=3)
    keys = [f for t in TABLES for f in t.feature_names]
    D = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
    for B in (0, 3):
        kjt = KeyedJaggedTensor(keys, torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(len(keys) * B, dtype=torch.int64),
                                weights=torch.zeros(0), stride=B)
        out = sebc(kjt.to(device)).values()
        assert out.shape == (B, D) and out.device.type == device, f"B={B}: {tuple(out.shape)} on {out.device}"
        assert bool((out == 0).all()), f"B={B}: an empty bag did not pool to zeros"
        if out.requires_grad:
            out.sum().backward()
        sebc.sync_replicated_grads()
    kjt = _batch(TABLES, 4, weighted=True, seed=21)
    _close(sebc(kjt.to(device)).values(), ref(kjt).values(), "pooled output after the empty batches")


# ------------------------------------------------------------------------ fp16 export
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_export_scores_on_device(device, tmp_path):
    if not HAS_FBGEMM:
        pytest.skip("export needs fbgemm_gpu (IntNBitTableBatchedEmbeddingBagsCodegen), which is not installed")
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(num_embeddings=50, embedding_dim=8, name="t_a", feature_names=["a", "b"]),
              EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name="t_c", feature_names=["c"], pooling="mean")]
    torch.manual_seed(0)
    model = DLRM(EmbeddingBagCollection(tables, compute_kernel="dense", seed=1), 13, [16, 8], [16, 1], 3, 8)
    sparse = [p for n, p in model.named_parameters() if n.startswith("sparse_arch")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch")]
    opt_s, opt_d = torch.optim.SGD(sparse, lr=0.5), torch.optim.Adam(rest, lr=0.01)
    g = torch.Generator().manual_seed(0)
    for i in range(10):  # a tiny training run
        kjt = _batch(tables, 64, False, seed=200 + i)
        dense = torch.rand(64, 13, generator=g) * 3
        y = (dense[:, 0] > 1.5).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), y)
        opt_s.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_s.step()
        opt_d.step()
    model.eval()
    res = export_model(model, tmp_path / "fp16", ExportOptions("fp16"))
    assert res.manifest["quantization"]["embeddings"] == "fp16"
    kjt = _batch(tables, 100, False, seed=300)
    dense = torch.rand(100, 13, generator=g) * 3
    with torch.no_grad():
        want = torch.sigmoid(model(dense, kjt).squeeze(1))
    m = load_exported(tmp_path / "fp16", device=device)
    got = m.score(dense, kjt.values(), kjt.lengths())  # inputs move to the model's device
    assert got.device.type == torch.device(device).type
    got = got.cpu()
    assert got.shape == (100,) and got.dtype == torch.float32
    _close(got, want, "fp16 artifact scores vs the fp32 eager model", atol=1e-3)
