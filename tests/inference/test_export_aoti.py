"""The AOTInductor package (``export --aot``): the compile's rewrite of the pairwise dots keeps the
program's scores on a copy sharing the program's tensors, and the compiled package scores as the
``.pt2`` program at every precision."""

import pytest
import torch

from dlrmctl.inference.formats.aoti import copy_sharing_tensors, fused_pair_dots
from tests.inference.test_export_pt2 import QUANT_LOGIT_BOUND, example_inputs, example_model, mixed_inputs, mixed_model


def _program(tmp_path, model, dtype="fp32", wf=None):
    from dlrmctl.inference.export import ExportOptions, export_model

    export_model(model, tmp_path / dtype, ExportOptions(dtype, weighted_features=wf))
    return torch.export.load(str(tmp_path / dtype / "model.pt2"))


def _bmm_of_own_transpose(gm):
    return [n for n in gm.graph.nodes if n.target == torch.ops.aten.bmm.default
            and getattr(n.args[1], "target", None) == torch.ops.aten.transpose.int and n.args[1].args[0] is n.args[0]]


@pytest.mark.parametrize("weighted", [False, True])
def test_the_pair_dots_rewrite_drops_the_square_product_and_keeps_the_scores(tmp_path, weighted):
    """Mixed widths, two width groups, a feature in two tables, mean pooling, the first-order
    term: the rewritten graph has no ``bmm(T, T^T)`` and scores as the saved program (1e-6,
    float32 summation order), at B = 1 and 64; the saved program is left as it was.  The compile's
    copy shares every weight of the program (no table copied), the graph alone is its own."""
    ep = _program(tmp_path, mixed_model(weighted), wf=["f0", "f3"] if weighted else None)
    assert len(_bmm_of_own_transpose(ep.graph_module)) == 1
    rewritten = copy_sharing_tensors(ep)
    assert rewritten.graph_module is not ep.graph_module and rewritten.graph is not ep.graph
    for mine, theirs in ((ep.state_dict, rewritten.state_dict), (ep.constants, rewritten.constants)):
        tensors = {k: v for k, v in mine.items() if isinstance(v, torch.Tensor)}
        assert tensors.keys() == {k for k, v in theirs.items() if isinstance(v, torch.Tensor)}
        assert all(theirs[k].data_ptr() == v.data_ptr() and theirs[k] is v for k, v in tensors.items())
    assert sum(v.numel() for v in ep.state_dict.values()) + sum(
        v.numel() for v in ep.constants.values() if isinstance(v, torch.Tensor)) > 0  # there is something to share
    assert fused_pair_dots(rewritten.graph_module) == 1
    assert _bmm_of_own_transpose(rewritten.graph_module) == [] and len(_bmm_of_own_transpose(ep.graph_module)) == 1
    assert fused_pair_dots(rewritten.graph_module) == 0  # nothing left to rewrite
    for B, seed in ((1, 3), (64, 4)):
        dense, values, lengths, w = mixed_inputs(B, seed)
        args = (dense, values, lengths) + ((w,) if weighted else ())
        with torch.no_grad():
            ref, got = ep.module()(*args), rewritten.module()(*args)
        assert B == 1 or float(ref[1].std()) > 1e-3  # not a constant output
        assert float((got[1] - ref[1]).abs().max()) <= 1e-6
        assert float((got[0] - ref[0]).abs().max()) <= 1e-6


def test_a_graph_without_the_square_product_is_left_alone():
    """A ``bmm`` of two different tensors followed by the same flatten + index_select is no pair
    product: not rewritten."""

    class NotPairs(torch.nn.Module):
        def forward(self, a, b, idx):
            return torch.bmm(a, b.transpose(1, 2)).flatten(1).index_select(1, idx)

    args = (torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.tensor([1, 2, 5]))
    gm = torch.export.export(NotPairs(), args).graph_module
    before = str(gm.graph)
    assert fused_pair_dots(gm) == 0 and str(gm.graph) == before


@pytest.mark.slow  # one AOTInductor compile per case (tens of seconds each)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_the_aoti_package_scores_as_the_program_at_every_precision(tmp_path, dtype):
    """Weighted, mixed widths (4 / 16 / 10 / 16 in two width groups), mean pooling, the first-order
    term: the compiled package (its pair dots rewritten) scores as the ``.pt2`` program within
    1e-6 at fp32 and the quantization bound otherwise, at B = 1 and 257."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = mixed_model(True)
    export_model(model, tmp_path / "m", ExportOptions(dtype, aot=True, weighted_features=["f0", "f3"]))
    p, a = load_exported(tmp_path / "m", artifact="pt2"), load_exported(tmp_path / "m", artifact="aoti")
    assert a.runner == "aoti"
    bound = 1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND
    for B, seed in ((1, 3), (257, 4)):
        dense, values, lengths, w = mixed_inputs(B, seed)
        zp, za = p.logits(dense, values, lengths, w), a.logits(dense, values, lengths, w)
        assert B == 1 or float(zp.std()) > 1e-3
        assert float((za - zp).abs().max()) <= bound


@pytest.mark.slow  # one AOTInductor compile per case
@pytest.mark.parametrize("dims", [(6, 13), (16, 5)])
def test_the_aoti_package_of_odd_and_even_dims_scores_as_the_program_in_int4(tmp_path, dims):
    """int4 with an odd dim (a pad code per row) and a projected dot interaction."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = example_model(dims)
    export_model(model, tmp_path / "m", ExportOptions("int4", aot=True))
    p, a = load_exported(tmp_path / "m", artifact="pt2"), load_exported(tmp_path / "m", artifact="aoti")
    dense, values, lengths = example_inputs(200, 2)
    assert float((a.logits(dense, values, lengths) - p.logits(dense, values, lengths)).abs().max()) <= QUANT_LOGIT_BOUND
