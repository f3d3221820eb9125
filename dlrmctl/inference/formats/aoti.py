"""The AOTInductor package format (``model_aoti.pt2``, ``dlrmctl export --aot``).

Compiled from the ``torch.export`` program beside ``model.pt2`` (never written on its own), with the
system C++ compiler; C++ loads it with ``torch::inductor::AOTIModelPackageLoader``
(scripts/cpp_inference), Python with ``torch._inductor.aoti_load_package``.  It runs on the device
type it was compiled for (``manifest["aoti_device"]``, CPU when absent) and, like the program,
returns ``(scores, logits)``: the program's input contract applies unchanged.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from dlrmctl.inference.artifact import AOTI_FILE, ExportError
from dlrmctl.inference.formats.base import Format
from dlrmctl.inference.formats.pt2 import ProgramFormat

__all__ = ["AotiFormat"]


class AotiFormat(ProgramFormat):
    """``model_aoti.pt2``: the program's AOTInductor package (CPU)."""

    name = "aoti"
    file = AOTI_FILE
    title = "AOTInductor package"
    devices = ("cpu",)
    rank = 0
    export_flag = "--aot"
    loads_with = "torch._inductor.aoti_load_package"
    standalone = False
    build = Format.build  # compiled from the program's (:meth:`compile`), never built on its own

    def runs_on(self, manifest: dict, device: torch.device) -> bool:
        """On the device type it was built for, ``manifest["aoti_device"]`` (CPU when absent)."""
        return device.type == self.runs_where(manifest)

    def runs_where(self, manifest: dict) -> str:
        return str(manifest.get("aoti_device") or "cpu")

    def compile(self, program: Any, path: Path) -> None:
        """The AOTInductor package of the exported ``program`` at ``path`` (CPU; the program's
        buffers inside).

        Raises:
            ExportError: no C++ compiler, or Inductor failed (its first line).
        """
        if shutil.which("c++") is None and shutil.which("g++") is None:
            raise ExportError("--aot compiles C++ with the system compiler; none found (install g++), or export "
                              "without --aot")
        import torch._inductor

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        except OSError:
            raise
        except Exception as e:
            raise ExportError(f"AOTInductor failed to compile the program ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None

    def load(self, path: Path, manifest: dict, device: torch.device) -> Any:
        """``torch._inductor.aoti_load_package`` (the package's buffers inside; its device fixed at
        export)."""
        import torch._inductor

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch._inductor.aoti_load_package(str(path))
