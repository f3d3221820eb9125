"""Exported models on another device than the CPU (issue 25 items 3 and 13), checked without a GPU:
the IntNBit TBE built for CUDA (DEVICE placement, 16-byte rows, construction arguments
recorded), a TorchScript artifact loaded for a device rebuilt through it, the .pt2 program's
buffers moved (meta device), and every output read through :func:`to_host`."""

import pytest
import torch

from dlrmctl import HAS_FBGEMM

from tests.conftest import OnDevice
from tests.inference.test_export_pt2 import example_inputs, example_model

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="the IntNBit TBE needs fbgemm_gpu")


class _Recorder:
    """Stands in for FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen: records its arguments."""

    calls: list = []

    def __init__(self, specs, **kw):
        _Recorder.calls.append((specs, kw))

    def initialize_weights(self):
        pass


@needs_fbgemm
@pytest.mark.parametrize("device, placement, align", [("cuda", "DEVICE", 16), ("cuda:1", "DEVICE", 16),
                                                      ("cpu", "HOST", 1)])
def test_tbe_for_a_device_has_its_placement_and_row_alignment(monkeypatch, device, placement, align):
    import fbgemm_gpu.split_table_batched_embeddings_ops_inference as inf
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    from dlrmctl.inference.intnbit_tbe import empty_intnbit_tbe, tbe_placement

    assert tbe_placement(device) == (placement, align)
    monkeypatch.setattr(inf, "IntNBitTableBatchedEmbeddingBagsCodegen", _Recorder)
    _Recorder.calls = []
    empty_intnbit_tbe([("t0", 10, 8, "int8"), ("t1", 5, 16, "int4")], [0, 0, 1], device)
    (specs, kw), = _Recorder.calls
    assert [s[4] for s in specs] == [getattr(EmbeddingLocation, placement)] * 2
    assert kw["row_alignment"] == align and kw["device"] == torch.device(device)


@needs_fbgemm
@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_torchscript_loaded_for_a_device_rebuilds_its_tbe_there(tmp_path, monkeypatch, dtype):
    """load_exported(device=cuda) loads the CPU module and rebuilds its TBE for the device (the
    device reaches the TBE constructor); the rebuilt tables hold the same bytes (scores equal,
    exercised on the CPU), a feature feeding two tables and padded dims (6, 13) included."""
    import dlrmctl.inference.export as ex
    import dlrmctl.inference.formats.torchscript as ts
    import dlrmctl.inference.intnbit_tbe as qz

    ex.export_model(example_model(), tmp_path / "m", ex.ExportOptions(dtype, artifact="torchscript"))
    m = ex.load_exported(tmp_path / "m")
    dense, values, lengths = example_inputs(33, 7)
    want = m.logits(dense, values, lengths)
    asked = []
    real = qz.intnbit_tbe_for_device

    def rebuild(src, tables, ftm, device):  # as for CUDA, built on the CPU (no GPU here)
        asked.append(torch.device(device))
        return real(src, tables, ftm, "cpu")

    monkeypatch.setattr(qz, "intnbit_tbe_for_device", rebuild)
    rebuilt = ts.torchscript_for_device(m.module, m.manifest, torch.device("cpu"))
    assert asked == [torch.device("cpu")]
    assert rebuilt.tbe is not m.module.tbe and not isinstance(rebuilt, torch.jit.ScriptModule)
    got = ex.ExportedModel(m.model_dir, m.manifest, rebuilt).logits(dense, values, lengths)
    assert torch.equal(got, want)
    # the real entry point: a CUDA request goes through the rebuild (CUDA faked present)
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ts, "torchscript_for_device", lambda mod, man, dev: seen.append(dev) or rebuilt)
    m2 = ex.load_exported(tmp_path / "m", device="cuda")
    assert seen == [torch.device("cuda")] and m2.module is rebuilt and m2.device == torch.device("cuda")


@needs_fbgemm
def test_rebuild_refuses_a_tbe_that_is_not_host_placed():
    from dlrmctl.inference.quantize import QuantizationError
    from dlrmctl.inference.intnbit_tbe import empty_intnbit_tbe, intnbit_tbe_for_device

    src = empty_intnbit_tbe([("t0", 4, 8, "int8")], [0], "cpu")
    src.weights_physical_placements = [0]  # EmbeddingLocation.DEVICE
    with pytest.raises(QuantizationError, match="not all HOST"):
        intnbit_tbe_for_device(src, [("t0", 4, 8, "int8")], [0], "cpu")


def test_pt2_program_loaded_for_a_device_has_its_buffers_there(tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    export_model(example_model(), tmp_path / "m", ExportOptions("int8"))
    m = load_exported(tmp_path / "m", device="meta")
    assert m.device == torch.device("meta")
    state = m.module.state  # GraphRunner: the program's weights and buffers, in signature order
    assert state and all(t.device.type == "meta" for t in state)


def test_to_host_copies_a_device_output_to_the_cpu_first():
    from dlrmctl.inference.export import to_host

    out = to_host(OnDevice(torch.tensor([0.25, 0.5])))
    assert out.tolist() == [0.25, 0.5]
