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


def _rewrite_json(src, dst, suffix, edit):
    """A copy of the archive ``src`` with its JSON record ending in ``suffix`` passed through ``edit``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith(suffix):
                data = json.dumps(edit(json.loads(data))).encode()
            zout.writestr(info, data)


class _TwoStates(torch.nn.Module):
    """A float32 parameter and an int32 buffer of the same byte size (two stored files)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(4096, dtype=torch.float32) / 7)
        self.register_buffer("n", torch.arange(4096, dtype=torch.int32))

    def forward(self, x):
        return x * self.w + self.n


def test_newer_schema_minors_unknown_keys_and_mixed_dtypes_in_one_file_are_left_to_torch(tmp_path):
    """(a) a schema minor newer than the tested one, and a node, weights entry or tensor_meta with
    a key the reader does not know: NotReadable; an older minor is read.  (b) two entries stored in
    one file with different dtypes (torch.export.load reads each with its own dtype; a view of one
    base would reinterpret the bytes): NotReadable, and the format's load gives torch's tensors."""
    from dlrmctl.inference.formats.pt2 import ProgramFormat
    from dlrmctl.inference.formats.pt2_reader import SCHEMA_MINOR, NotReadable, read_program

    x = torch.ones(4096)
    torch.export.save(torch.export.export(_TwoStates(), (x,)), tmp_path / "m.pt2")
    want = _TwoStates()(x).detach()
    assert torch.equal(GraphRunnerOf(read_program(tmp_path / "m.pt2"))(x), want)

    def minor(m):
        return lambda p: {**p, "schema_version": {"major": p["schema_version"]["major"], "minor": m}}

    _rewrite_json(tmp_path / "m.pt2", tmp_path / "new.pt2", "models/model.json", minor(SCHEMA_MINOR + 1))
    with pytest.raises(NotReadable, match=rf"schema 8\.{SCHEMA_MINOR + 1} \(read: 8\.0 to 8\.{SCHEMA_MINOR}\)"):
        read_program(tmp_path / "new.pt2")
    _rewrite_json(tmp_path / "m.pt2", tmp_path / "old.pt2", "models/model.json", minor(SCHEMA_MINOR - 1))
    assert torch.equal(GraphRunnerOf(read_program(tmp_path / "old.pt2"))(x), want)

    def node_key(p):
        p["graph_module"]["graph"]["nodes"][0]["new_field"] = 1
        return p

    _rewrite_json(tmp_path / "m.pt2", tmp_path / "node.pt2", "models/model.json", node_key)
    with pytest.raises(NotReadable, match=r"keys \['new_field'\] this reader does not know"):
        read_program(tmp_path / "node.pt2")
    for where in ("entry", "tensor_meta"):
        def entry_key(c, where=where):
            e = c["config"]["w"]
            (e if where == "entry" else e["tensor_meta"])["new_field"] = 1
            return c

        _rewrite_json(tmp_path / "m.pt2", tmp_path / f"{where}.pt2", "model_weights_config.json", entry_key)
        with pytest.raises(NotReadable, match=rf"w: {where} has keys \['new_field'\]"):
            read_program(tmp_path / f"{where}.pt2")
        assert torch.equal(ProgramFormat().load(tmp_path / f"{where}.pt2", {}, torch.device("cpu"))(x)[0], want)

    def one_file(c):  # n's entry points at w's stored file: same size, another dtype
        c["config"]["n"]["path_name"] = c["config"]["w"]["path_name"]
        return c

    _rewrite_json(tmp_path / "m.pt2", tmp_path / "shared.pt2", "model_weights_config.json", one_file)
    with pytest.raises(NotReadable, match=r"n: torch.int32 in weight_\d+, stored by another entry as torch.float32"):
        read_program(tmp_path / "shared.pt2")
    ep = torch.export.load(str(tmp_path / "shared.pt2"))
    assert torch.equal(ProgramFormat().load(tmp_path / "shared.pt2", {}, torch.device("cpu"))(x)[0], ep.module()(x))


def GraphRunnerOf(parts):
    """The read program as a callable of one input giving its one output."""
    from dlrmctl.inference.formats.pt2 import GraphRunner

    runner = GraphRunner(parts, torch.device("cpu"))
    return lambda x: runner(x)[0]


def _offsets(path, name):
    """Where the bytes of record ``name`` start in the zip file ``path`` (after its local header),
    and where its central directory header starts."""
    import struct

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    n, m = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    central = raw.index(b"PK\x01\x02")
    while raw[central + 46:central + 46 + len(name)] != name.encode():
        central = raw.index(b"PK\x01\x02", central + 4)
    return info.header_offset + 30 + n + m, central


def test_any_error_while_reading_is_not_readable_and_left_to_torch(tmp_path):
    """(c) A damaged deflated weight (zlib.error) and a record of a compression method zipfile does
    not know (NotImplementedError) are NotReadable with the error's type, not the raw error, so the
    format's load hands the file to torch.export.load: its error, or the program it gives (torch
    2.13 reads the damaged deflated record as stored: its values are not compared)."""
    from dlrmctl.inference.formats.pt2 import ProgramFormat
    from dlrmctl.inference.formats.pt2_reader import NotReadable, read_program

    torch.export.save(torch.export.export(_TwoStates(), (torch.ones(4096),)), tmp_path / "m.pt2")
    with zipfile.ZipFile(tmp_path / "m.pt2") as zin, zipfile.ZipFile(tmp_path / "z.pt2", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename),
                          zipfile.ZIP_DEFLATED if "/data/weights/weight_" in info.filename else zipfile.ZIP_STORED)
        name = next(n for n in zin.namelist() if "/data/weights/weight_" in n)
    read_program(tmp_path / "z.pt2")  # deflated records are read
    raw = bytearray((tmp_path / "z.pt2").read_bytes())
    at, central = _offsets(tmp_path / "z.pt2", name)
    bad = bytearray(raw)
    bad[at] = 0x07  # a final deflate block of the reserved type 3
    (tmp_path / "bad.pt2").write_bytes(bad)
    with pytest.raises(NotReadable, match=r"^error: .*invalid block type"):
        read_program(tmp_path / "bad.pt2")
    odd = bytearray(raw)
    odd[central + 10:central + 12] = (99).to_bytes(2, "little")  # compression method 99 (AES: not supported)
    (tmp_path / "odd.pt2").write_bytes(odd)
    with pytest.raises(NotReadable, match=r"^NotImplementedError: "):
        read_program(tmp_path / "odd.pt2")
    x = torch.ones(4096)
    for path in ("bad.pt2", "odd.pt2"):  # torch.export.load decides: its program, or its error
        try:
            torch.export.load(str(tmp_path / path))
        except Exception as e:
            with pytest.raises(type(e)):
                ProgramFormat().load(tmp_path / path, {}, torch.device("cpu"))
        else:
            assert ProgramFormat().load(tmp_path / path, {}, torch.device("cpu"))(x)[0].shape == (4096,)
