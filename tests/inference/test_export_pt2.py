"""The torch.export artifact (model.pt2, the default): fresh-process load, parity with the
TorchScript artifact, dynamic batch, every embedding dim, in-program id policy, pytree nodes."""

import subprocess
import sys

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.dlrm import DLRM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor

#: |Δlogit| bound between the pt2 program and the TorchScript artifact of the same quantized
#: tables (same codes, scale and bias; only the float32 summation order differs): docs/export.md
QUANT_LOGIT_BOUND = 1e-5


def example_model(dims=(6, 13), rows=(40, 30)):
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=rows[0], embedding_dim=dims[0], feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="t1", num_embeddings=rows[1], embedding_dim=dims[1], feature_names=["f2"],
                                 pooling="mean")]
    ebc = EmbeddingBagCollection(tables, compute_kernel="dense", seed=3)
    with torch.no_grad():
        for w in ebc.embedding_weights().values():
            w.mul_(10)
    from dlrmctl.modules.dlrm import InteractionArch, ProjectedInteraction

    inter = ProjectedInteraction(InteractionArch(3), ["f0", "f1", "f2"], [dims[0], dims[0], dims[1]], 16)
    return DLRM(ebc, 13, [16, 16], [16, 1], 3, 16, interaction=inter).eval()


def example_inputs(B, seed, rows=(40, 30)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * B,), generator=g)
    n01, n2 = int(lengths[: 2 * B].sum()), int(lengths[2 * B:].sum())
    values = torch.cat([torch.randint(0, rows[0], (n01,), generator=g), torch.randint(0, rows[1], (n2,), generator=g)])
    return torch.randn(B, 13, generator=g), values, lengths


def _eager(model, dense, values, lengths):
    with torch.no_grad():
        return model(dense, KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths)).reshape(-1)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_dims_6_and_13_export_and_score_at_every_precision(tmp_path, dtype):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = example_model()
    export_model(model, tmp_path / "m", ExportOptions(dtype))
    m = load_exported(tmp_path / "m")
    assert m.artifact == "pt2" and (tmp_path / "m" / "model.pt2").is_file()
    dense, values, lengths = example_inputs(50, 1)
    z = m.logits(dense, values, lengths)
    ref = _eager(model, dense, values, lengths)
    tol = {"fp32": 1e-5, "fp16": 0.05, "int8": 0.2, "int4": 2.0}[dtype]
    assert float((z - ref).abs().max()) <= tol
    if HAS_FBGEMM:  # the TorchScript artifact pads the tables to the TBE's alignment and slices back
        export_model(model, tmp_path / "ts", ExportOptions(dtype, artifact="torchscript"))
        zt = load_exported(tmp_path / "ts").logits(dense, values, lengths)
        bound = 1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND
        assert float((z - zt).abs().max()) <= bound


def test_batch_of_1_and_10000_through_one_program_loaded_without_dlrmctl(tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    export_model(example_model(), tmp_path / "m", ExportOptions("int8"))
    m = load_exported(tmp_path / "m")
    for B, seed in ((1, 2), (10_000, 3)):
        d, v, ln = example_inputs(B, seed)
        torch.save((d, v, ln, m.logits(d, v, ln)), tmp_path / f"b{B}.pt")
    code = (
        "import sys, torch\n"
        f"ep = torch.export.load({str(tmp_path / 'm' / 'model.pt2')!r})\n"
        "f = ep.module()\n"
        "for B in (1, 10000):\n"
        f"    d, v, ln, want = torch.load({str(tmp_path)!r} + f'/b{{B}}.pt')\n"
        "    s, z = f(d, v, ln)\n"
        "    assert z.shape == (B,) and torch.equal(z, want), B\n"
        "    assert torch.allclose(s, torch.sigmoid(want))\n"
        "assert not [n for n in sys.modules if n.startswith(('dlrmctl', 'fbgemm_gpu'))]\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_invalid_ids_in_the_program_error_or_zero(tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    model = example_model()
    export_model(model, tmp_path / "e", ExportOptions("fp32"))
    dense, values, lengths = example_inputs(8, 4)
    bad = values.clone()
    bad[-1] = 30  # the last id is f2's (table t1, 30 rows) when f2 has ids
    assert int(lengths[16:].sum()) > 0
    with pytest.raises(ExportError, match=r"table 't1', feature 'f2', sample 7: id 30 is out of range; "
                                          r"expected 0 <= id < 30"):
        load_exported(tmp_path / "e").logits(dense, bad, lengths)
    model.sparse_arch.on_invalid_id = "zero"
    export_model(model, tmp_path / "z", ExportOptions("fp32", on_invalid_id="zero"))
    z = load_exported(tmp_path / "z").logits(dense, bad, lengths)
    # zero: the id is dropped from its (mean-pooled) bag, as the eager model does
    ref = _eager(model, dense, bad, lengths)
    assert float((z - ref).abs().max()) <= 1e-5


def test_every_listed_file_is_hashed_and_checked(tmp_path):
    import json

    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    export_model(example_model(), tmp_path / "m", ExportOptions("int4"))
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert man["artifact"] == "pt2" and list(man["files"]) == ["model.pt2"]
    p = tmp_path / "m" / "model.pt2"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="SHA-256"):
        load_exported(tmp_path / "m")


def test_kjt_and_keyed_tensor_are_pytree_nodes_for_torch_export(tmp_path):
    class Pool(torch.nn.Module):
        def forward(self, kjt):
            n = kjt.lengths().numel()
            bag = torch.repeat_interleave(torch.arange(n), kjt.lengths(), output_size=kjt.values().numel())
            s = torch.zeros(n).index_add_(0, bag, kjt.values().float() * kjt.weights())
            return KeyedTensor(kjt.keys(), [1, 1], s.view(2, -1).t())

    k = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), weights=torch.ones(5), lengths=torch.tensor([1, 2, 1, 1]))
    N, B = torch.export.Dim("N"), torch.export.Dim("B")
    ep = torch.export.export(Pool(), (k,), dynamic_shapes=([{0: N}, {0: N}, {0: 2 * B}, None],))
    torch.export.save(ep, tmp_path / "p.pt2")
    f = torch.export.load(tmp_path / "p.pt2").module()
    k3 = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), weights=torch.tensor([1.0, 2.0, 3.0]),
                           lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    out = f(k3)
    assert isinstance(out, KeyedTensor) and out.keys() == ["a", "b"]
    assert torch.equal(out.values(), torch.tensor([[1.0, 0.0], [0.0, 9.0], [4.0, 0.0]]))


def multi_hot_export(tmp_path, policy, name):
    """Export example_model() with f2 (table t1, 30 rows) expanded in the program into bags of 3
    (multi_hot_sizes, the training loader's seed and distribution); the data meta says f2 has 30 rows."""
    from dlrmctl.inference.export import ExportOptions, export_model

    model = example_model()
    model.sparse_arch.on_invalid_id = policy
    meta = {"dense_features": [f"I{i}" for i in range(13)],
            "sparse_features": [{"name": "f0", "num_embeddings": 40}, {"name": "f1", "num_embeddings": 40},
                                {"name": "f2", "num_embeddings": 30}]}
    mh = {"multi_hot_sizes": {"f2": 3}, "multi_hot_distribution": "uniform", "multi_hot_seed": 7}
    export_model(model, tmp_path / name, ExportOptions("fp32", data_meta=meta, multi_hot=mh, on_invalid_id=policy))
    return model


def _expand_f2(values, lengths, B, drop=()):
    """The loader's expansion of f2's one-hot ids (seed 7 + index 2), ids at positions ``drop``
    (of values) removed with their bag first."""
    import numpy as np

    from dlrmctl.data.multi_hot import multi_hot_expand

    keep = torch.ones(values.numel(), dtype=torch.bool)
    keep[list(drop)] = False
    bag = torch.repeat_interleave(torch.arange(3 * B), lengths)
    lengths = lengths - torch.bincount(bag[~keep], minlength=3 * B)
    values = values[keep]
    n01 = int(lengths[: 2 * B].sum())
    v2, _ = multi_hot_expand(values[n01:].numpy(), 30, 3, "uniform", 7 + 2)
    return torch.cat([values[:n01], torch.from_numpy(np.asarray(v2))]), torch.cat([lengths[: 2 * B], lengths[2 * B:] * 3])


def test_multi_hot_expansion_in_the_program_equals_the_loaders(tmp_path):
    from dlrmctl.inference.export import load_exported

    model = multi_hot_export(tmp_path, "error", "m")
    m = load_exported(tmp_path / "m")
    assert "multi_hot" in m.manifest["in_program"]
    dense, values, lengths = example_inputs(40, 5)
    z = m.logits(dense, values, lengths)  # one-hot ids in, expanded inside
    ve, le = _expand_f2(values, lengths, 40)
    assert int(le[80:].sum()) == 3 * int(lengths[80:].sum()) > 0
    ref = _eager(model, dense, ve, le)
    assert float((z - ref).abs().max()) <= 1e-5
    assert float((z - _eager(model, dense, values, lengths)).abs().max()) > 1e-3  # the expansion matters


@pytest.mark.parametrize("bad_id", [30, -1])
def test_an_out_of_range_one_hot_id_of_a_multi_hot_feature_errors_or_drops_its_whole_bag(tmp_path, bad_id):
    """error: the call fails naming the feature and the expansion's range (the loader raises on it
    too); zero: the id is dropped with its whole expanded bag, the same as leaving it out (no slot
    of an expansion of some other id remains)."""
    from dlrmctl.inference.export import ExportError, load_exported

    multi_hot_export(tmp_path, "error", "e")
    dense, values, lengths = example_inputs(8, 4)
    assert int(lengths[16:].sum()) > 0
    bad = values.clone()
    bad[-1] = bad_id  # the last id is f2's
    with pytest.raises(ExportError, match=r"feature 'f2': a one-hot id is out of range of its multi-hot expansion; "
                                          r"expected 0 <= id < 30"):
        load_exported(tmp_path / "e").logits(dense, bad, lengths)
    model = multi_hot_export(tmp_path, "zero", "z")
    z = load_exported(tmp_path / "z").logits(dense, bad, lengths)
    ve, le = _expand_f2(values, lengths, 8, drop=[values.numel() - 1])
    ref = _eager(model, dense, ve, le)
    assert float((z - ref).abs().max()) <= 1e-5


def test_quantize_dense_with_the_pt2_program_is_refused_with_the_remedy(tmp_path):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model

    with pytest.raises(ExportError, match=r"--quantize-dense.*--torchscript"):
        export_model(example_model(), tmp_path / "m", ExportOptions("int8", quantize_dense=True))
    assert not (tmp_path / "m").exists()


@pytest.mark.skipif(not HAS_FBGEMM, reason="the TorchScript reference needs fbgemm_gpu")
@pytest.mark.parametrize("dims", [(1, 15), (16, 5), (7, 8), (3, 2)])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_fused_lookups_equal_the_torchscript_tbe_for_every_dim_and_dtype(tmp_path, dims, dtype):
    """The program's fused kernels (grouped, padded tables) against FBGEMM's TBE on the same codes:
    1e-6 at fp32, the float32-summation bound otherwise; odd, tiny and wide dims, a mean-pooled
    table, multi-id and empty bags."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = example_model(dims=dims)
    export_model(model, tmp_path / "p", ExportOptions(dtype))
    export_model(model, tmp_path / "t", ExportOptions(dtype, artifact="torchscript"))
    p, t = load_exported(tmp_path / "p"), load_exported(tmp_path / "t")
    for B, seed in ((1, 11), (64, 12)):
        dense, values, lengths = example_inputs(B, seed)
        bound = 1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND
        assert float((p.logits(dense, values, lengths) - t.logits(dense, values, lengths)).abs().max()) <= bound


def test_table_groups_bound_the_padding():
    from dlrmctl.inference.lookups import MAX_PAD_WASTE, row_bytes, group_tables

    rows, dims = [1000, 10, 5000, 3, 800], [32, 128, 8, 16, 30]
    for dtype in ("int8", "int4", "fp16", "fp32"):
        groups = group_tables(rows, dims, dtype)
        assert sorted(t for g in groups for t in g) == list(range(5))
        for g in groups:
            width = max(dims[t] for t in g)
            padded = sum(rows[t] for t in g) * row_bytes(dtype, width)
            assert padded <= (1 + MAX_PAD_WASTE) * sum(rows[t] * row_bytes(dtype, dims[t]) for t in g)
    assert group_tables([100, 100], [32, 30], "int8") == [[0, 1]]  # close widths share one buffer (one call)


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_the_program_creates_no_tensor_on_a_fixed_device_but_the_host_checks(tmp_path, dtype):
    """Nothing the program creates has a device baked in (it follows the inputs to CUDA), except the
    copies of its checks to the host, where they are asserted (a bad request never trips a
    device-side assert)."""
    from dlrmctl.inference.export import ExportOptions, export_model

    export_model(example_model(), tmp_path / "m", ExportOptions(dtype))
    ep = torch.export.load(str(tmp_path / "m" / "model.pt2"))
    fixed = [n for n in ep.graph.nodes if n.op == "call_function" and n.kwargs.get("device") is not None]
    assert fixed and all(n.kwargs["device"] == torch.device("cpu") for n in fixed)
    for n in fixed:  # each host copy feeds an assertion and nothing else
        assert [u.target for u in n.users] == [torch.ops.aten._assert_async.msg], n.format_node()
    asserts = [n for n in ep.graph.nodes if n.target == torch.ops.aten._assert_async.msg]
    assert all(a.args[0] in fixed for a in asserts)


def mixed_model(weighted: bool):
    """Five lookups over four tables of dims 4 / 16 / 10 / 16 and 7..5000 rows (two width
    groups): feature f0 feeds two tables, f1 shares f0's first table, f2 is mean-pooled; the
    projected dot interaction (4 and 10 projected, 16 passed through) and the first-order term."""
    from dlrmctl.modules.dlrm import InteractionArch, ProjectedInteraction

    torch.manual_seed(1)
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=5000, embedding_dim=4, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=16, feature_names=["f2"], pooling="mean"),
              EmbeddingBagConfig(name="t2", num_embeddings=300, embedding_dim=10, feature_names=["f0"]),
              EmbeddingBagConfig(name="t3", num_embeddings=3000, embedding_dim=16, feature_names=["f3"])]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, compute_kernel="dense", seed=5)
    dims = [4, 4, 16, 10, 16]
    inter = ProjectedInteraction(InteractionArch(5), ebc.embedding_names(), dims, 16)
    model = DLRM(ebc, 13, [16, 16], [16, 1], 5, 16, interaction=inter, first_order_width=sum(dims)).eval()
    with torch.no_grad():
        model.first_order.dense.weight.normal_()
        model.first_order.sparse.weight.normal_()
    return model


def mixed_inputs(B, seed, limits=(300, 5000, 7, 3000)):
    """Bags of 0..4 ids per (feature, sample), key-major, each feature's ids below its limit."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (4 * B,), generator=g)
    per_f = lengths.view(4, B).sum(1).tolist()
    values = torch.cat([torch.randint(0, lim, (n,), generator=g) for lim, n in zip(limits, per_f)])
    return torch.randn(B, 13, generator=g), values, lengths, torch.rand(len(values), generator=g) * 2


@pytest.mark.skipif(not HAS_FBGEMM, reason="the TorchScript reference needs fbgemm_gpu")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_head_equals_the_torchscript_artifact_on_mixed_tables(tmp_path, dtype, weighted):
    """Two width groups, a feature in two tables, a shared table, mean pooling, multi-id and empty
    bags, the first-order term, and (weighted) per-id weights on two of the four features: the
    program's blocks + fused head score as the TorchScript TBE + per-table dense part."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = mixed_model(weighted)
    wf = ["f0", "f3"] if weighted else None
    export_model(model, tmp_path / "p", ExportOptions(dtype, weighted_features=wf))
    export_model(model, tmp_path / "t", ExportOptions(dtype, artifact="torchscript", weighted_features=wf))
    p, t = load_exported(tmp_path / "p"), load_exported(tmp_path / "t")
    ep = torch.export.load(str(tmp_path / "p" / "model.pt2"))
    lookups = [n for n in ep.graph.nodes if "embedding_bag" in str(n.target) or n.target == torch.ops.aten.index_add.default]
    assert len(lookups) == 3  # blocks (group 16, slot 0), (16, 1), (4, 0): one kernel call each
    bound = 1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND
    for B, seed in ((1, 3), (64, 4)):
        dense, values, lengths, w = mixed_inputs(B, seed)
        zp = p.logits(dense, values, lengths, w if weighted else None)
        zt = t.logits(dense, values, lengths, w if weighted else None)
        assert float((zp - zt).abs().max()) <= bound
        if dtype == "fp32" and not weighted:
            kjt = KeyedJaggedTensor(["f0", "f1", "f2", "f3"], values, lengths=lengths)
            with torch.no_grad():
                ref = model(dense, kjt).reshape(-1)
            assert float((zp - ref).abs().max()) <= 1e-5


@pytest.mark.skipif(not HAS_FBGEMM, reason="the TorchScript reference needs fbgemm_gpu")
def test_dropped_ids_score_as_the_torchscript_artifact_in_the_fused_head(tmp_path):
    """``zero`` policy: f0's ids past its second table's 300 rows are dropped there only (and
    from the mean-pooled f2's count), in the program as in the TBE."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = mixed_model(False)
    for name, art in (("p", "pt2"), ("t", "torchscript")):
        export_model(model, tmp_path / name, ExportOptions("int8", artifact=art, on_invalid_id="zero"))
    p, t = load_exported(tmp_path / "p"), load_exported(tmp_path / "t")
    dense, values, lengths, _ = mixed_inputs(64, 5, limits=(5000, 5000, 9, 3000))
    assert float((p.logits(dense, values, lengths) - t.logits(dense, values, lengths)).abs().max()) <= QUANT_LOGIT_BOUND


def test_the_program_size_does_not_grow_with_the_number_of_tables(tmp_path):
    """The fused head runs all projections in one op: 3 and 12 projected tables (one width group)
    give graphs of the same number of operators (one Linear per MLP layer, none per table)."""
    from dlrmctl.inference.export import ExportOptions, export_model
    from dlrmctl.modules.dlrm import InteractionArch, ProjectedInteraction

    counts = []
    for n in (3, 12):
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=20 + i, embedding_dim=7 + i % 2,
                                     feature_names=[f"f{i}"]) for i in range(n)]
        ebc = EmbeddingBagCollection(tables, compute_kernel="dense", seed=3)
        inter = ProjectedInteraction(InteractionArch(n), [f"f{i}" for i in range(n)], [7 + i % 2 for i in range(n)], 16)
        export_model(DLRM(ebc, 13, [16, 16], [16, 1], n, 16, interaction=inter).eval(), tmp_path / str(n),
                     ExportOptions("int8"))
        graph = torch.export.load(str(tmp_path / str(n) / "model.pt2")).graph
        ops = [nd for nd in graph.nodes if nd.op == "call_function"]
        assert sum(nd.target == torch.ops.aten.linear.default for nd in ops) == 4
        counts.append(len(ops))
    assert counts[0] == counts[1]


@pytest.mark.skipif(not HAS_FBGEMM, reason="the TorchScript reference needs fbgemm_gpu")
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_the_plain_dot_interaction_of_an_odd_dim_equals_the_torchscript_artifact(tmp_path, dtype):
    """No projections (every table of the interaction's width 5): the head reads the blocks as they
    are, and at int4 (rows stored 6 codes wide) only their first 5 columns."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=5, feature_names=[f"f{i}"])
              for i in range(3)]
    ebc = EmbeddingBagCollection(tables, compute_kernel="dense", seed=3)
    model = DLRM(ebc, 13, [16, 5], [16, 1], 3, 5).eval()
    export_model(model, tmp_path / "p", ExportOptions(dtype))
    export_model(model, tmp_path / "t", ExportOptions(dtype, artifact="torchscript"))
    p, t = load_exported(tmp_path / "p"), load_exported(tmp_path / "t")
    ops = [n.target for n in torch.export.load(str(tmp_path / "p" / "model.pt2")).graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.slice.Tensor in ops) == (dtype == "int4")  # the pad code's column dropped
    assert ops.count(torch.ops.aten.index_select.default) == 1  # the pairs only: no pooled-column gather
    dense, values, lengths = example_inputs(64, 8, rows=(40, 40))
    bound = 1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND
    assert float((p.logits(dense, values, lengths) - t.logits(dense, values, lengths)).abs().max()) <= bound


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_loaded_graph_calls_torch_bindings_and_scores_as_the_exported_module(tmp_path, dtype):
    """``load_exported`` runs the program's graph with its ATen calls rewritten to torch's Python
    bindings (the same kernels, a cheaper call): its logits equal ``ep.module()``'s bit for bit,
    and only operators without such a binding keep their ``torch.ops`` call."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    export_model(mixed_model(True), tmp_path / "p", ExportOptions(dtype, weighted_features=["f0", "f3"]))
    m = load_exported(tmp_path / "p", artifact="pt2")
    module = torch.export.load(str(tmp_path / "p" / "model.pt2")).module()
    for B, seed in ((1, 3), (64, 4)):
        dense, values, lengths, w = mixed_inputs(B, seed)
        with torch.no_grad():
            want = module(dense, values, lengths, w)[1]
        assert torch.equal(m.logits(dense, values, lengths, w), want)
    calls = [n.target for n in m.module.graph.graph.nodes if n.op == "call_function"]
    left = [str(t) for t in calls if isinstance(t, torch._ops.OpOverload)]
    assert len(left) <= len(calls) // 5, sorted(left)
    assert torch.ops.aten.add.Tensor not in calls and torch.add in calls
