"""``train.overlap_embedding_backward`` (issue 17): on the CPU the embedding lookup's backward
(FBGEMM's single-threaded TBE backward with its fused optimizer update) runs on a worker thread
while the bottom MLP's backward runs on the intra-op threads.  It must change only *where* the
lookup's backward runs, never what is computed: bit-identical losses, dense parameters and
tables with it on and off (fused and dense kernels, weighted tables, the trainer end to end);
the worker really starts before the bottom MLP's backward ends; the tables are updated when
``backward()`` returns; an error in the worker surfaces from ``backward()``; and it stays out of
the way where it cannot help (one thread, no grad, closed)."""

from __future__ import annotations

import threading

import pytest
import torch

from dlrmctl.config import EmbeddingOptimizerConfig, config_from_dict
from dlrmctl.modules.backward_overlap import EmbeddingBackwardOverlap
from dlrmctl.modules.dlrm import DLRM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor
from dlrmctl.train.loop import RunEnv, Trainer, prepare_run_dir
from dlrmctl.train.optim import embedding_optimizer_for_dense

F, D, B, ROWS = 4, 8, 64, 50


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _model(kernel: str, weighted: bool = False) -> DLRM:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=ROWS, feature_names=[f"f{i}"])
              for i in range(F)]
    ebc = EmbeddingBagCollection(tables=tables, compute_kernel=kernel, is_weighted=weighted,
                                 optimizer=EmbeddingOptimizerConfig(type="exact_rowwise_adagrad", lr=0.1))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[16, D],
                over_arch_layer_sizes=[16, 1], num_sparse_features=F, embedding_dim=D)


def _batches(n: int, weighted: bool = False):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (F * B,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        w = torch.rand(ids.shape, generator=g) if weighted else None
        kjt = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(F)], ids, lengths, weights=w)
        out.append((torch.randn(B, 5, generator=g), kjt, (torch.rand(B, generator=g) < 0.3).float()))
    return out


def _train(kernel: str, overlap: EmbeddingBackwardOverlap | None, weighted: bool = False, steps: int = 4):
    model = _model(kernel, weighted)
    dense_opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if "sparse_arch" not in n], lr=0.05)
    emb_opt = None
    if kernel == "dense":
        emb_opt = embedding_optimizer_for_dense(
            [p for n, p in model.named_parameters() if "sparse_arch" in n], "exact_rowwise_adagrad", lr=0.1,
            eps=1e-8, weight_decay=0.0)
    losses = []
    for dense, kjt, labels in _batches(steps, weighted):
        kt = model.sparse_arch(kjt)
        d = model.dense_arch(dense)  # the wrap comes after the bottom MLP's forward, as in the trainer
        if overlap is not None:
            kt = KeyedTensor(kt.keys(), kt.length_per_key(), overlap.wrap(kt.values()))
        logits = model.over_arch(model.inter_arch(d, kt)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad()
        if emb_opt is not None:
            emb_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if emb_opt is not None:
            emb_opt.step()
        losses.append(loss.detach().clone())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


@pytest.mark.parametrize("kernel,weighted", [("fused", False), ("dense", False), ("fused", True)])
def test_overlap_is_bit_identical(two_threads, kernel, weighted):
    """Same losses, dense parameters and tables, bit for bit, with the lookup's backward on the
    worker as on the calling thread."""
    ref_losses, ref_state = _train(kernel, None, weighted)
    ov = EmbeddingBackwardOverlap()
    losses, state = _train(kernel, ov, weighted)
    ov.close()
    assert ov._pool is None
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``on_backward`` (which thread, and when)."""

    @staticmethod
    def forward(ctx, x, on_backward):  # type: ignore[override]
        ctx.cb = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.cb()
        return g, None


def test_worker_starts_before_the_bottom_mlp_backward_ends(two_threads):
    """The overlap is real: the lookup's backward begins on another thread while the bottom MLP's
    backward is still running (its first layer's weight gradient, the last node of that backward,
    waits for the worker to have started: without the overlap the worker would start only after
    it, and this would time out), and the tables are updated by the time backward() returns."""
    model = _model("fused")
    dense, kjt, labels = _batches(1)[0]
    started = threading.Event()
    where = {}

    def on_lookup_backward():
        where["thread"] = threading.get_ident()
        started.set()

    def bottom_first_layer_hook(grad):
        where["waited"] = started.wait(timeout=30)
        return grad

    before = model.sparse_arch.embedding_bags["t0"].weight.detach().clone()
    kt = model.sparse_arch(kjt)
    values = _Probe.apply(kt.values(), on_lookup_backward)
    d = model.dense_arch(dense)
    first = [m for m in model.dense_arch.modules() if isinstance(m, torch.nn.Linear)][0]
    first.weight.register_hook(bottom_first_layer_hook)
    ov = EmbeddingBackwardOverlap()
    kt = KeyedTensor(kt.keys(), kt.length_per_key(), ov.wrap(values))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model.over_arch(model.inter_arch(d, kt)).squeeze(1), labels)
    loss.backward()
    assert where.get("waited") is True, "the lookup's backward did not start before the bottom MLP's backward ended"
    assert where["thread"] != threading.get_ident()
    assert not torch.equal(model.sparse_arch.embedding_bags["t0"].weight.detach(), before)  # updated on return
    ov.close()


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        raise RuntimeError("boom in the lookup's backward")


def test_an_error_in_the_worker_surfaces_from_backward(two_threads):
    ov = EmbeddingBackwardOverlap()
    x = torch.randn(8, 4, requires_grad=True)
    y = ov.wrap(_Boom.apply(x))
    with pytest.raises(RuntimeError, match="boom in the lookup's backward"):
        (y * 2).sum().backward()
    # the worker is still usable afterwards
    z = ov.wrap(x * 1.0)
    z.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    ov.close()


def test_pass_through_where_it_cannot_help(two_threads):
    """wrap() returns its input unchanged: one intra-op thread, grad mode off, a tensor that needs
    no grad, after close(); and never starts a worker for those."""
    ov = EmbeddingBackwardOverlap()
    x = torch.randn(3, 2, requires_grad=True)
    torch.set_num_threads(1)
    assert ov.wrap(x) is x
    torch.set_num_threads(2)
    with torch.no_grad():
        assert ov.wrap(x) is x
    c = torch.randn(3, 2)
    assert ov.wrap(c) is c
    assert ov._pool is None
    ov.close()
    assert ov.wrap(x) is x


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("tiny_bwd_overlap")
    generate_synthetic(d, rows=3000, seed=3, num_embeddings=[40] * 26)
    return str(d)


def test_trainer_bit_identical_with_and_without(two_threads, tiny, tmp_path):
    """End to end through the Trainer (unsharded, sparse_dist pipeline): every step's loss and
    the final state match bit for bit with train.overlap_embedding_backward on and off."""
    out = {}
    for overlap in (False, True):
        cfg = config_from_dict({
            "name": f"bo_{overlap}",
            "data": {"path": tiny, "batch_size": 256, "eval_batch_size": 8192},
            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [32, 1]},
            "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
            "train": {"epochs": 1, "max_steps": 5, "checkpoint_every": 1000, "log_every": 1000,
                      "run_dir": str(tmp_path), "progress": False, "keep_best": "none",
                      "overlap_embedding_backward": overlap},
        })
        t = Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=False, overwrite=False))
        assert (t._emb_bwd is not None) is overlap
        losses = []
        for step, batch in enumerate(t.train_loader):
            if step == 5:
                break
            losses.append(t.train_step(batch).clone())
        if overlap:
            assert t._emb_bwd._pool is not None  # the worker really ran the lookups' backward
            t._emb_bwd.close()
        out[overlap] = losses, {k: v.detach().clone() for k, v in t.model.state_dict().items() if torch.is_tensor(v)}
    (l0, s0), (l1, s1) = out[False], out[True]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


def test_malloc_tuning_applies_on_glibc_and_is_called_by_the_trainer(tiny, tmp_path, monkeypatch):
    """train.malloc_tuning: the trainer calls tune_glibc_malloc (once per process; True on glibc,
    False elsewhere, never raising) and not when the key is false."""
    import platform

    from dlrmctl.train import loop, malloc_tuning

    r = malloc_tuning.tune_glibc_malloc()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert r is True
        assert malloc_tuning.tune_glibc_malloc() is True  # idempotent
    calls = []
    monkeypatch.setattr(loop, "tune_glibc_malloc", lambda: calls.append(1))
    for on in (True, False):
        cfg = config_from_dict({
            "name": f"mt_{on}", "data": {"path": tiny, "batch_size": 256},
            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [32, 1]},
            "train": {"run_dir": str(tmp_path), "progress": False, "malloc_tuning": on},
        })
        Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=False, overwrite=False))
    assert calls == [1]
