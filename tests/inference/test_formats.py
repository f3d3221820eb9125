"""Which artifact a command runs (dlrmctl.inference.formats): the fastest the export holds for the
device, or the one named; clear errors for one it does not hold or that cannot run there."""

import pytest
import torch

from dlrmctl.inference.export import ExportError
from dlrmctl.inference.formats import BULK_ORDER, FORMATS, choose_format, resolve_device


def _manifest(*files, aoti_device=None):
    m = {"artifact": "torchscript" if "model.pt" in files else "pt2", "files": {f: {"sha256": "x"} for f in files}}
    if aoti_device:
        m["aoti_device"] = aoti_device
    return m


def test_the_aoti_package_runs_on_the_cpu_when_the_export_holds_it():
    m = _manifest("model.pt2", "model_aoti.pt2")
    assert choose_format("d", m, torch.device("cpu")).name == "aoti"
    assert choose_format("d", _manifest("model.pt2"), torch.device("cpu")).name == "pt2"
    assert choose_format("d", _manifest("model.pt"), torch.device("cpu")).name == "torchscript"


def test_a_cpu_aoti_package_is_passed_over_on_cuda_and_refused_when_named():
    m = _manifest("model.pt2", "model_aoti.pt2")
    assert choose_format("d", m, torch.device("cuda")).name == "pt2"
    with pytest.raises(ExportError, match=r"--artifact aoti: model_aoti.pt2 runs on cpu, not on cuda"):
        choose_format("d", m, torch.device("cuda"), "aoti")
    assert choose_format("d", _manifest("model.pt2", "model_aoti.pt2", aoti_device="cuda"),
                         torch.device("cuda")).name == "aoti"


def test_a_named_artifact_wins_and_one_not_held_names_the_export_option():
    m = _manifest("model.pt2", "model_aoti.pt2")
    assert choose_format("d", m, torch.device("cpu"), "pt2").name == "pt2"
    with pytest.raises(ExportError, match=r"--artifact aoti: d holds no model_aoti.pt2 \(it holds: pt2\); "
                                          r"export with --aot"):
        choose_format("d", _manifest("model.pt2"), torch.device("cpu"), "aoti")
    with pytest.raises(ExportError, match=r"--artifact torchscript: d holds no model.pt .*--torchscript"):
        choose_format("d", m, torch.device("cpu"), "torchscript")
    with pytest.raises(ExportError, match=r"--artifact 'onnx': expected one of \['aoti', 'pt2', 'torchscript'\]"):
        choose_format("d", m, torch.device("cpu"), "onnx")


def test_whole_file_scoring_runs_the_program_first_and_serving_the_package():
    """predict / evaluate (bulk) run model.pt2 ahead of the AOTInductor package (its load imports
    Inductor; not faster at thousands of rows a batch), serve runs the package first; TorchScript
    comes last in both; --artifact still wins, and a device the package cannot run on passes it over."""
    every = _manifest("model.pt2", "model_aoti.pt2", "model.pt")
    cpu = torch.device("cpu")
    assert choose_format("d", every, cpu).name == "aoti"
    assert choose_format("d", every, cpu, bulk=True).name == "pt2"
    assert choose_format("d", every, cpu, "aoti", bulk=True).name == "aoti"
    assert choose_format("d", every, cpu, "torchscript", bulk=True).name == "torchscript"
    assert choose_format("d", _manifest("model_aoti.pt2", "model.pt"), cpu, bulk=True).name == "aoti"
    assert choose_format("d", _manifest("model.pt"), cpu, bulk=True).name == "torchscript"
    assert choose_format("d", _manifest("model_aoti.pt2", "model.pt"), torch.device("cuda"), bulk=True).name \
        == "torchscript"
    assert sorted(BULK_ORDER) == sorted(FORMATS)


def test_formats_are_ranked_fastest_first():
    assert [f.name for f in sorted(FORMATS.values(), key=lambda f: f.rank)] == ["aoti", "pt2", "torchscript"]


def test_device_auto_is_cuda_only_when_visible(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ExportError, match=r"--device cuda: CUDA is not available here"):
        resolve_device("cuda")
    with pytest.raises(ExportError, match=r"--device 'tpu': expected cpu, cuda, cuda:<index> or auto"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda:1")
