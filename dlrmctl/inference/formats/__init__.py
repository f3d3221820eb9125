"""The artifact formats an export directory can hold: one :class:`~dlrmctl.inference.formats.base.Format`
each (how it is written, loaded, described and run), and which one a command runs.

================  =================  =============================================================
``--artifact``    file               module
================  =================  =============================================================
``pt2``           ``model.pt2``      :mod:`dlrmctl.inference.formats.pt2` (the default)
``aoti``          ``model_aoti.pt2`` :mod:`dlrmctl.inference.formats.aoti` (``--aot``, beside pt2)
``torchscript``   ``model.pt``       :mod:`dlrmctl.inference.formats.torchscript` (``--torchscript``)
================  =================  =============================================================

:func:`choose_format` picks what ``predict``, ``evaluate`` and ``serve`` run: the format the
caller names (``--artifact``), else the fastest one the directory holds that runs on the device for
the command's work (measured side by side in benchmarks/export.md):

- ``serve`` (requests of 1 to a few hundred rows, one load for hours): the AOTInductor package on
  the CPU when present (1.2-1.9x the program at B = 1 and 64), else ``model.pt2``, else
  ``model.pt`` (:attr:`Format.rank`);
- ``predict`` and ``evaluate`` (a whole file in batches of thousands of rows, one load per run,
  ``bulk``): ``model.pt2``, else the package, else ``model.pt`` (:data:`BULK_ORDER`): the package
  loads through Inductor (seconds of imports) and is not faster at such batches.  :func:`dlrmctl.inference.exported.load_exported` loads it;
``ExportedModel.description`` says which, for the first line of those commands.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dlrmctl.inference.artifact import ExportError
from dlrmctl.inference.formats.aoti import AotiFormat
from dlrmctl.inference.formats.base import Format
from dlrmctl.inference.formats.pt2 import ProgramFormat
from dlrmctl.inference.formats.torchscript import TorchScriptFormat

__all__ = ["ARTIFACTS", "BULK_ORDER", "FORMATS", "Format", "choose_format", "resolve_device"]

#: Every format, fastest first.
FORMATS: dict[str, Format] = {f.name: f for f in (AotiFormat(), ProgramFormat(), TorchScriptFormat())}
#: Fastest first for whole-file scoring (``predict``, ``evaluate``: one load, batches of thousands).
BULK_ORDER: tuple[str, ...] = ("pt2", "aoti", "torchscript")
#: The formats ``dlrmctl export`` writes on its own (``manifest["artifact"]``).
ARTIFACTS: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.standalone)


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` | ``cuda[:i]`` | ``auto`` (CUDA when a GPU is visible, else the CPU) as a device.

    Raises:
        ExportError: an unknown device, or CUDA asked for where none is available.
    """
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


def choose_format(model_dir: str | Path, manifest: dict, device: torch.device, requested: str | None = None,
                  bulk: bool = False) -> Format:
    """The format to run: ``requested`` (``--artifact``), else the fastest the directory holds that
    runs on ``device``: per request (:attr:`Format.rank`), or with ``bulk`` for whole-file scoring
    (:data:`BULK_ORDER`).

    Raises:
        ExportError: an unknown name, a format the directory does not hold (naming the export
            option that writes it and what the directory holds), or one that cannot run on ``device``.
    """
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
            raise ExportError(f"--artifact {requested}: {fmt.file} runs on {fmt.runs_where(manifest)}, not on "
                              f"{device}; pick another --artifact or --device")
        return fmt
    order = (lambda f: BULK_ORDER.index(f.name)) if bulk else (lambda f: f.rank)
    runnable = sorted((f for f in held if f.runs_on(manifest, device)), key=order)
    if not runnable:
        raise ExportError(f"{model_dir}: no artifact here runs on {device} (it holds: {names})")
    return runnable[0]
