"""The artifact formats an export directory can hold, and which one a command runs.

One :class:`Format` record per format: its file, what loads it, the devices it runs on and its
rank by speed (measured side by side in benchmarks/export.md).  ``dlrmctl export`` writes
``model.pt2`` (the torch.export program, default) and with ``--aot`` also ``model_aoti.pt2`` (its
AOTInductor package, CPU), or with ``--torchscript`` ``model.pt`` instead.

:func:`choose_format` picks what ``predict``, ``evaluate`` and ``serve`` run: the format the
caller names (``--artifact``), else the fastest one the directory holds that runs on the device
(the AOTInductor package on the CPU when present, else the manifest's own artifact).
:func:`dlrmctl.inference.export.load_exported` loads it; ``ExportedModel.description`` says which,
for the first line of those commands.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["FORMATS", "Format", "choose_format", "resolve_device"]


@dataclass(frozen=True)
class Format:
    """One artifact format.

    Attributes:
        name: ``pt2`` | ``aoti`` | ``torchscript`` (``--artifact``).
        file: its file in the export directory.
        title: what it is, for messages and the commands' first line.
        devices: device types it runs on, empty: any (an AOTInductor package runs where it was
            compiled).
        rank: lower is faster (benchmarks/export.md: AOTInductor < torch.export program <
            TorchScript + FBGEMM TBE at the batch sizes predict and serve use).
        loader: ``(path, manifest, device) -> module`` returning ``(scores, logits)`` for ``pt2`` /
            ``aoti``, the scores (``.logits`` the logits) for ``torchscript``.
        export_flag: the ``dlrmctl export`` option that writes it.
    """

    name: str
    file: str
    title: str
    devices: tuple[str, ...]
    rank: int
    loader: Callable[[Path, dict, torch.device], Any]
    export_flag: str

    def present(self, manifest: dict) -> bool:
        """The manifest records this format's file (and so its SHA-256, checked at load)."""
        files = manifest.get("files") or {manifest.get("model_file", "model.pt"): {}}
        return self.file in files

    def runs_on(self, manifest: dict, device: torch.device) -> bool:
        """This format runs on ``device`` (an AOTInductor package: on the device type it was built
        for, ``manifest["aoti_device"]``, CPU when absent)."""
        if self.name == "aoti":
            return device.type == str(manifest.get("aoti_device") or "cpu")
        return not self.devices or device.type in self.devices

    def describe(self, device: torch.device) -> str:
        """``model_aoti.pt2 (AOTInductor package) on cpu``."""
        return f"{self.file} ({self.title}) on {device}"


class _GraphRunner:
    """A loaded ``.pt2`` program called through its flat graph (``ExportedProgram.graph_module``)
    with its weights and buffers passed in signature order: the same operators as
    ``ep.module()``, without that module's per-call attribute lookups of every weight (nested
    module paths) and input/output pytree handling, which cost more than a small batch's lookups.
    ``__call__(dense, values, lengths[, weights]) -> (scores, logits)``."""

    def __init__(self, ep: Any, device: torch.device) -> None:
        from torch.export.graph_signature import InputKind

        tensors = {**ep.state_dict, **ep.constants}
        specs = [s for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
        self.state = [tensors[s.target].detach().to(device) for s in specs]
        self._parameter = [s.kind == InputKind.PARAMETER for s in specs]
        self._names = [s.target for s in specs]
        self.graph = ep.graph_module

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.graph(*self.state, *inputs)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The program's parameters as ``(fully qualified name, tensor)``, like ``nn.Module``'s."""
        return ((n, t) for n, t, p in zip(self._names, self.state, self._parameter) if p)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The program's buffers and tensor constants as ``(name, tensor)`` (the tables' storage
        among them), like ``nn.Module``'s."""
        return ((n, t) for n, t, p in zip(self._names, self.state, self._parameter) if not p)


def _load_pt2(path: Path, manifest: dict, device: torch.device) -> Any:
    """``torch.export.load`` -> a callable of its graph on ``device`` (:class:`_GraphRunner`; a
    program whose graph also returns buffer mutations runs as ``ep.module()``).  Input guards are
    left to :class:`~dlrmctl.inference.export.ExportedModel` (which checks the manifest's input
    contract with clearer messages)."""
    from torch.export.graph_signature import OutputKind

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.load(str(path))
        if all(s.kind == OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs):
            return _GraphRunner(ep, device)
        module = ep.module(check_guards=False)
    module.validate_inputs = False
    return module.to(device) if device.type != "cpu" else module


def _load_aoti(path: Path, manifest: dict, device: torch.device) -> Any:
    """``torch._inductor.aoti_load_package`` (the package's buffers inside; its device fixed at
    export)."""
    import torch._inductor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._inductor.aoti_load_package(str(path))


def _load_torchscript(path: Path, manifest: dict, device: torch.device) -> Any:
    """``torch.jit.load`` on the CPU (FBGEMM's operators loaded), its TBE rebuilt for another device."""
    from dlrmctl.inference.export import _quiet_jit, _torchscript_for_device
    from dlrmctl.inference.quantize import require_fbgemm

    require_fbgemm(f"loading {path}")
    with _quiet_jit():  # the TBE was built on the CPU: loaded there, rebuilt for another device
        module = torch.jit.load(str(path), map_location="cpu")
    module.eval()
    return _torchscript_for_device(module, manifest, device) if device.type != "cpu" else module


#: Every format, fastest first.
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("aoti", "model_aoti.pt2", "AOTInductor package", ("cpu",), 0, _load_aoti, "--aot"),
    Format("pt2", "model.pt2", "torch.export program", (), 1, _load_pt2, "(default)"),
    Format("torchscript", "model.pt", "TorchScript + FBGEMM TBE", ("cpu", "cuda"), 2, _load_torchscript,
           "--torchscript"),
)}


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` | ``cuda[:i]`` | ``auto`` (CUDA when a GPU is visible, else the CPU) as a device.

    Raises:
        ExportError: an unknown device, or CUDA asked for where none is available.
    """
    from dlrmctl.inference.export import ExportError

    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ExportError(f"--device {name!r}: expected cpu, cuda, cuda:<index> or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise ExportError(f"--device {name!r}: expected cpu, cuda, cuda:<index> or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {name}: CUDA is not available here (torch {torch.__version__}); use "
                          "--device cpu or auto")
    return dev


def choose_format(model_dir: str | Path, manifest: dict, device: torch.device, requested: str | None = None) -> Format:
    """The format to run: ``requested`` (``--artifact``), else the fastest the directory holds that
    runs on ``device``.

    Raises:
        ExportError: an unknown name, a format the directory does not hold (naming the export
            option that writes it and what the directory holds), or one that cannot run on ``device``.
    """
    from dlrmctl.inference.export import ExportError

    held = [f for f in FORMATS.values() if f.present(manifest)]
    names = ", ".join(f.name for f in held) or "none"
    if requested is not None:
        if requested not in FORMATS:
            raise ExportError(f"--artifact {requested!r}: expected one of {list(FORMATS)}")
        fmt = FORMATS[requested]
        if fmt not in held:
            raise ExportError(f"--artifact {requested}: {model_dir} holds no {fmt.file} (it holds: {names}); "
                              f"export with {fmt.export_flag} to add it")
        if not fmt.runs_on(manifest, device):
            raise ExportError(f"--artifact {requested}: {fmt.file} runs on "
                              f"{manifest.get('aoti_device') or 'cpu' if fmt.name == 'aoti' else '/'.join(fmt.devices) or 'any device'}"
                              f", not on {device}; pick another --artifact or --device")
        return fmt
    runnable = sorted((f for f in held if f.runs_on(manifest, device)), key=lambda f: f.rank)
    if not runnable:
        raise ExportError(f"{model_dir}: no artifact here runs on {device} (it holds: {names})")
    return runnable[0]
