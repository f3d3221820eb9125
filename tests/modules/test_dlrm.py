"""DLRM pieces against explicit formulas; the torch/fbgemm pair check."""

import pytest
import torch

from dlrmctl.modules.dlrm import DLRM, InteractionArch
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor


def test_dot_interaction_matches_an_explicit_loop():
    torch.manual_seed(0)
    B, F, d = 3, 4, 5
    dense = torch.randn(B, d)
    sparse = torch.randn(B, F * d)
    out = InteractionArch(F)(dense, KeyedTensor([f"f{i}" for i in range(F)], [d] * F, sparse))
    for b in range(B):
        vecs = [dense[b]] + [sparse[b, i * d : (i + 1) * d] for i in range(F)]
        pairs = [torch.dot(vecs[i], vecs[j]) for i in range(F + 1) for j in range(i + 1, F + 1)]
        torch.testing.assert_close(out[b], torch.cat([dense[b], torch.stack(pairs)]))
    assert out.shape == (B, d + F * (F + 1) // 2)


def test_dlrm_forward_shapes_and_backward_reaches_every_part():
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=10, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(3)]
    m = DLRM(EmbeddingBagCollection(tables, compute_kernel="dense"), 13, [8, 4], [8, 1], 3, 4)
    B = 5
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.randint(0, 10, (15,)), lengths=torch.ones(15, dtype=torch.int64))
    logits = m(torch.randn(B, 13), kjt)
    assert logits.shape == (B, 1) and logits.dtype == torch.float32
    logits.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_a_model_without_dense_inputs_builds_trains_and_warns_nothing():
    """Data with no dense columns (Avazu): the bottom MLP and the first-order term take a
    ``[B, 0]`` input; building the model raises no warning (torch's "zero-element tensors"
    notice included) and its forward and backward work."""
    import warnings

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=10, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = DLRM(EmbeddingBagCollection(tables, compute_kernel="dense"), 0, [8, 4], [8, 1], 3, 4,
                 first_order_width=12)
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.randint(0, 10, (15,)), lengths=torch.ones(15, dtype=torch.int64))
    logits = m(torch.zeros(5, 0), kjt)
    assert logits.shape == (5, 1) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert m.dense_arch.model.model[0].weight.shape == (8, 0)


def test_broken_fbgemm_install_names_both_versions_and_the_pair(monkeypatch):
    import builtins

    from dlrmctl import _fbgemm

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name.startswith("fbgemm_gpu"):
            raise OSError("fbgemm_gpu_py.so: undefined symbol: _ZN3c104impl")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(_fbgemm.importlib.util, "find_spec", lambda n: object())
    with pytest.raises(_fbgemm.FbgemmTorchMismatchError, match=r"does not load against torch 2\.13.*fbgemm-gpu-cpu==1\.8\.0"):
        _fbgemm.check_torch_fbgemm_pair()
    monkeypatch.setattr(builtins, "__import__", real_import)
    _fbgemm.check_torch_fbgemm_pair()  # restore the module's state


def test_dot_interaction_gradient_matches_autograd_of_the_explicit_formula():
    torch.manual_seed(1)
    B, F, d = 4, 5, 3
    dense = torch.randn(B, d, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(B, F * d, dtype=torch.float64, requires_grad=True)
    arch = InteractionArch(F)
    out = arch(dense, KeyedTensor([f"f{i}" for i in range(F)], [d] * F, sparse))
    w = torch.randn_like(out)
    (out * w).sum().backward()
    got = dense.grad.clone(), sparse.grad.clone()
    dense.grad, sparse.grad = None, None
    x = torch.cat([dense, sparse], 1).view(B, F + 1, d)
    z = torch.bmm(x, x.transpose(1, 2))
    iu = torch.triu_indices(F + 1, F + 1, 1)
    ref = torch.cat([dense, z[:, iu[0], iu[1]]], 1)
    (ref * w).sum().backward()
    torch.testing.assert_close(got[0], dense.grad)
    torch.testing.assert_close(got[1], sparse.grad)


def test_dot_interaction_traces_for_export_and_matches_eager():
    torch.manual_seed(2)
    arch = InteractionArch(3)
    dense, sparse = torch.randn(4, 2), torch.randn(4, 6)
    kt = KeyedTensor(["a", "b", "c"], [2, 2, 2], sparse)

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.arch = arch

        def forward(self, d, s):
            return self.arch(d, KeyedTensor(["a", "b", "c"], [2, 2, 2], s))

    traced = torch.jit.trace(Wrap(), (dense, sparse))
    torch.testing.assert_close(traced(dense, sparse), arch(dense, kt))


@pytest.mark.parametrize("need", ["both", "dense", "sparse"])
def test_dot_interaction_training_node_is_bit_identical_to_the_unfused_formula(need):
    """The fused training node (_DotInteraction) against the ops it replaces, in fp32: forward
    cat -> bmm -> triangle -> cat; backward G_u scattered from the pair gradient, (G_u + G_u^T) T,
    split into the dense and sparse parts, the dense part plus its direct gradient.  Values and
    gradients must match bit for bit (the restructuring only removes copies); the leaf's .grad
    is contiguous (AccumulateGrad's layout; in the model the TBE backward copies the view once)."""
    torch.manual_seed(3)
    B, F, d = 33, 26, 16
    N = F + 1
    dense0, sparse0 = torch.randn(B, d), torch.randn(B, F * d)
    dense = dense0.clone().requires_grad_(need in ("both", "dense"))
    sparse = sparse0.clone().requires_grad_(need in ("both", "sparse"))
    arch = InteractionArch(F)
    out = arch(dense, KeyedTensor([f"f{i}" for i in range(F)], [d] * F, sparse))
    w = torch.randn_like(out)
    out.backward(w)

    iu = torch.triu_indices(N, N, 1)
    flat = iu[0] * N + iu[1]
    t = torch.cat([dense0, sparse0], 1).view(B, N, d)
    ref = torch.cat([dense0, torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, flat)], 1)
    g = torch.zeros(B, N * N)
    g.index_copy_(1, flat, w[:, d:].contiguous())
    g = g.view(B, N, N)
    dt = torch.bmm(g + g.transpose(1, 2), t)
    assert torch.equal(out, ref)
    if dense.requires_grad:
        assert torch.equal(dense.grad, dt[:, 0] + w[:, :d])
    else:
        assert dense.grad is None
    if sparse.requires_grad:
        assert sparse.grad.is_contiguous()
        assert torch.equal(sparse.grad, dt[:, 1:].reshape(B, F * d))
    else:
        assert sparse.grad is None


def test_dot_interaction_training_node_takes_an_empty_batch():
    """B = 0 (a rank whose local batch is empty, e.g. the last partial batch on 2 ranks): the
    fused training node gives [0, d + F(F+1)/2] and zero-row gradients, like the plain ops."""
    F, d = 3, 4
    dense = torch.zeros(0, d, requires_grad=True)
    sparse = torch.zeros(0, F * d, requires_grad=True)
    out = InteractionArch(F)(dense, KeyedTensor([f"f{i}" for i in range(F)], [d] * F, sparse))
    assert out.shape == (0, d + F * (F + 1) // 2)
    out.sum().backward()
    assert dense.grad.shape == (0, d) and sparse.grad.shape == (0, F * d)


#: the development machine's CPU (x86-64 with AVX-512): the padded GEMM gives the same bits there
_SAME_BLAS = "avx512" in torch.backends.cpu.get_cpu_capability().lower()


@pytest.mark.parametrize("F,d,pad", [(26, 16, 1), (26, 16, 5), (12, 8, 3), (12, 8, 0)])
def test_dot_interaction_zero_row_padding_is_bit_identical(F, d, pad, monkeypatch):
    """On the CPU the training node may append zero rows to T before its bmm (a faster GEMM
    shape, chosen once by _dot_row_pad): the pairs and both gradients must stay bit for bit those
    of the unpadded formula, for every pad the tuner can pick (N rounded up to 4 or 8)."""
    from dlrmctl.modules import dlrm as dlrm_mod

    torch.manual_seed(5)
    B, N = dlrm_mod._ROW_PAD_MIN_BATCH + 7, F + 1
    monkeypatch.setitem(dlrm_mod._ROW_PAD, (N, d, torch.float32, torch.get_num_threads()), pad)
    dense0, sparse0 = torch.randn(B, d), torch.randn(B, F * d)
    dense, sparse = dense0.clone().requires_grad_(), sparse0.clone().requires_grad_()
    out = InteractionArch(F)(dense, KeyedTensor([f"f{i}" for i in range(F)], [d] * F, sparse))
    w = torch.randn_like(out)
    out.backward(w)

    iu = torch.triu_indices(N, N, 1)
    flat = iu[0] * N + iu[1]
    t = torch.cat([dense0, sparse0], 1).view(B, N, d)
    g = torch.zeros(B, N * N)
    g.index_copy_(1, flat, w[:, d:].contiguous())
    g = g.view(B, N, N)
    dt = torch.bmm(g + g.transpose(1, 2), t)
    # bit for bit on this machine; another BLAS may pick another kernel for the padded shape and sum
    # the length-d dot products in another order: rounding only (a wrong pad would be far off)
    same = (lambda a, b: torch.equal(a, b)) if _SAME_BLAS else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert same(out, torch.cat([dense0, torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, flat)], 1))
    assert same(dense.grad, dt[:, 0] + w[:, :d])
    assert same(sparse.grad, dt[:, 1:].reshape(B, F * d))


def test_dot_row_pad_is_tuned_once_per_shape_and_only_for_large_cpu_batches(monkeypatch):
    """_dot_row_pad: small batches get 0 without tuning; a large batch tunes once, caches the
    pick (0 or N rounded up to a multiple of 4 or 8) under (N, d, dtype, threads), and reuses it."""
    from dlrmctl.modules import dlrm as dlrm_mod

    monkeypatch.setattr(dlrm_mod, "_ROW_PAD", {})
    d, F = 8, 10
    small = dlrm_mod._dot_row_pad(torch.randn(16, d), torch.randn(16, F * d), torch.float32)
    assert small == 0 and dlrm_mod._ROW_PAD == {}
    B = dlrm_mod._ROW_PAD_MIN_BATCH
    pad = dlrm_mod._dot_row_pad(torch.randn(B, d), torch.randn(B, F * d), torch.float32)
    key = (F + 1, d, torch.float32, torch.get_num_threads())
    assert dlrm_mod._ROW_PAD == {key: pad} and pad in {0, -(F + 1) % 4, -(F + 1) % 8}
    dlrm_mod._ROW_PAD[key] = 7  # the cached value is used as it is
    assert dlrm_mod._dot_row_pad(torch.randn(B, d), torch.randn(B, F * d), torch.float32) == 7


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_mlp_first_layer_weight_grad_only_path_is_bit_identical_to_autograd(dropout):
    """Training on the CPU with an input that needs no gradient, the MLP's first layer runs
    _WeightGradOnlyLinear (dW = (x^T g)^T instead of autograd's g^T x): output, weight and bias
    gradients must equal those of the plain nn.Sequential (F.linear under autograd) (bit for bit on
    this machine; up to the summation order of another BLAS),
    with and without dropout; eval mode and an input that needs a gradient take the plain path."""
    from dlrmctl.modules.mlp import MLP

    torch.manual_seed(7)
    mlp = MLP(13, [64, 32, 8], dropout=dropout).train()
    x = torch.rand(300, 13)
    w = torch.randn(300, 8)

    def grads(fn):
        mlp.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # same dropout masks
        out = fn(x)
        out.backward(w)
        return out.detach(), [p.grad.clone() for p in mlp.parameters()]

    def plain(inp):
        h = inp
        for i, layer in enumerate(mlp.model):
            h = layer(h)
            if dropout and i in mlp._drop_after:
                h = torch.nn.functional.dropout(h, dropout, training=True)
        return h

    out, g = grads(mlp)
    ref_out, ref_g = grads(plain)
    assert torch.equal(out, ref_out)
    # bit-identical on this machine's CPU GEMM; another BLAS may order the length-B sums of dW
    # differently, so the test allows the rounding of that order (and nothing more)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(g, ref_g))
    assert all(a.is_contiguous() for a in g)

    # the node is in the graph only where it applies
    def nodes(y):
        seen, todo = set(), [y.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.extend(f for f, _ in fn.next_functions)
        return {type(f).__name__ for f in seen}

    assert any("_WeightGradOnlyLinear" in n for n in nodes(mlp(x)))
    assert not any("_WeightGradOnlyLinear" in n for n in nodes(mlp(x.clone().requires_grad_())))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not any("_WeightGradOnlyLinear" in n for n in nodes(mlp(x)))
