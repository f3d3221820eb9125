"""dlrmctl's own reader of ``.pt2`` archives (``dlrmctl.inference.formats.pt2_reader``) against
``torch.export.load``: the same graph and tensors, the same scores bit for bit, no tracing machinery
imported, and ``torch.export.load`` for what it does not read."""

import json
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.inference.test_export_pt2 import example_inputs, example_model, mixed_inputs, mixed_model, multi_hot_export


def _same_as_torch(path):
    """read_program(path) equals torch.export.load(path): graph (nodes, targets, args, kwargs,
    names), the generated code, the state's names, kinds and tensors (dtype, shape, strides,
    offset, values)."""
    from dlrmctl.inference.formats.pt2 import program_parts
    from dlrmctl.inference.formats.pt2_reader import read_program

    ours, ref = read_program(path), program_parts(torch.export.load(str(path)))
    assert str(ours.graph_module.graph) == str(ref.graph_module.graph)
    assert ours.graph_module.code == ref.graph_module.code
    for a, b in zip(ours.graph_module.graph.nodes, ref.graph_module.graph.nodes):
        assert (a.op, a.name, a.target) == (b.op, b.name, b.target)
        assert repr(a.args) == repr(b.args) and repr(a.kwargs) == repr(b.kwargs), a.format_node()
    assert ours.names == ref.names and ours.parameter == ref.parameter
    for n, x, y in zip(ours.names, ours.tensors, ref.tensors):
        y = y.detach()
        assert (x.dtype, x.shape, x.stride(), x.storage_offset()) == (y.dtype, y.shape, y.stride(), y.storage_offset()), n
        assert torch.equal(x, y), n
    return ours


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_the_reader_gives_torch_export_loads_graph_and_tensors_and_its_scores(tmp_path, dtype):
    """Every precision, mixed widths (two width groups), weighted features, mean pooling: the same
    program as torch.export.load, and load_exported's logits equal ep.module()'s bit for bit."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    export_model(mixed_model(True), tmp_path / "p", ExportOptions(dtype, weighted_features=["f0", "f3"]))
    _same_as_torch(tmp_path / "p" / "model.pt2")
    module = torch.export.load(str(tmp_path / "p" / "model.pt2")).module()
    m = load_exported(tmp_path / "p", artifact="pt2")
    for B, seed in ((1, 3), (64, 4), (1000, 5)):
        dense, values, lengths, w = mixed_inputs(B, seed)
        with torch.no_grad():
            want = module(dense, values, lengths, w)
        assert torch.equal(m.logits(dense, values, lengths, w), want[1])
        assert torch.equal(m.score(dense, values, lengths, w), want[0])


@pytest.mark.parametrize("policy", ["error", "zero"])
def test_the_reader_reads_multi_hot_and_id_policy_programs_as_torch(tmp_path, policy):
    """The in-program multi-hot expansion (its offsets a buffer) and both invalid-id policies."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    multi_hot_export(tmp_path, policy, "mh")
    _same_as_torch(tmp_path / "mh" / "model.pt2")
    model = example_model()
    export_model(model, tmp_path / "plain", ExportOptions("int8", on_invalid_id=policy))
    _same_as_torch(tmp_path / "plain" / "model.pt2")
    module = torch.export.load(str(tmp_path / "mh" / "model.pt2")).module()
    dense, values, lengths = example_inputs(40, 5)
    with torch.no_grad():
        want = module(dense, values, lengths)[1]
    assert torch.equal(load_exported(tmp_path / "mh").logits(dense, values, lengths), want)


def test_load_exported_reads_dlrmctls_archive_without_torch_export_load(tmp_path, monkeypatch):
    """The default load path never calls torch.export.load on dlrmctl's own archive."""
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = example_model()
    export_model(model, tmp_path / "m", ExportOptions("fp32"))
    dense, values, lengths = example_inputs(30, 2)
    want = load_exported(tmp_path / "m").logits(dense, values, lengths)

    def refuse(*a, **k):
        raise AssertionError("torch.export.load called")

    monkeypatch.setattr(torch.export, "load", refuse)
    assert torch.equal(load_exported(tmp_path / "m").logits(dense, values, lengths), want)


def test_a_fresh_process_scores_without_importing_torchs_tracing_machinery(tmp_path):
    """The start-up the reader removes: loading and scoring the program in a new process imports
    neither torch._dynamo nor sympy nor torch.export's deserializer."""
    from dlrmctl.inference.export import ExportOptions, export_model

    export_model(example_model(), tmp_path / "m", ExportOptions("int8"))
    code = ("import sys, torch\n"
            "from dlrmctl.inference.export import load_exported\n"
            f"m = load_exported({str(tmp_path / 'm')!r})\n"
            "z = m.score(torch.zeros(2, 13), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1, 0, 0, 0]))\n"
            "print(z.shape[0], [k for k in ('torch._dynamo', 'sympy', 'torch._export.serde.serialize') "
            "if k in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "[]"], r.stdout


def _rewrite(src, dst, edit):
    """A copy of the archive ``src`` with ``model.json`` passed through ``edit``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("models/model.json"):
                data = json.dumps(edit(json.loads(data))).encode()
            zout.writestr(info, data)


def test_what_the_reader_does_not_read_goes_to_torch_export_load(tmp_path):
    """A program with a buffer mutation (an output that is not a user output), an operator outside
    its subset and a file that is no archive are refused with NotReadable; the format's load then
    runs torch.export.load's program, with the same results."""
    from dlrmctl.inference.formats.pt2 import ProgramFormat
    from dlrmctl.inference.formats.pt2_reader import NotReadable, read_program

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2 + self.calls

    ep = torch.export.export(Counter(), (torch.ones(3),)).run_decompositions({})  # functional: add_ as an output
    torch.export.save(ep, tmp_path / "mut.pt2")
    with pytest.raises(NotReadable, match="buffer mutations"):
        read_program(tmp_path / "mut.pt2")
    loaded = ProgramFormat().load(tmp_path / "mut.pt2", {}, torch.device("cpu"))
    assert torch.equal(loaded(torch.ones(3)), torch.full((3,), 3.0))

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2

    torch.export.save(torch.export.export(Plain(), (torch.ones(3),)), tmp_path / "plain.pt2")
    read_program(tmp_path / "plain.pt2")

    def other_op(prog):
        prog["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.no_such_op.default"
        return prog

    _rewrite(tmp_path / "plain.pt2", tmp_path / "odd.pt2", other_op)
    with pytest.raises(NotReadable, match="no_such_op"):
        read_program(tmp_path / "odd.pt2")
    (tmp_path / "text.pt2").write_text("not a zip")
    with pytest.raises(NotReadable):
        read_program(tmp_path / "text.pt2")
