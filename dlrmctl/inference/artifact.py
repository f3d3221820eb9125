"""What every export directory shares, whatever its format: the file names, the manifest's format
version, the error, and the byte-level helpers (SHA-256, chunked writes, quiet TorchScript).

A leaf of :mod:`dlrmctl.inference`: the formats (:mod:`dlrmctl.inference.formats`), the
orchestration (:mod:`dlrmctl.inference.export`) and the loader (:mod:`dlrmctl.inference.exported`)
all read it, and it reads none of them.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dlrmctl.errors import UserError

__all__ = [
    "AOTI_FILE",
    "ExportError",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "PROGRAM_FILE",
    "quiet_jit",
    "sha256",
    "write_bytes",
]

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.pt"  # TorchScript (--torchscript)
PROGRAM_FILE = "model.pt2"  # torch.export program (default)
AOTI_FILE = "model_aoti.pt2"  # AOTInductor package (--aot)


# why the torch.export program refuses --quantize-dense (checked before torch by `dlrmctl export`)
QUANTIZE_DENSE_NEEDS_TORCHSCRIPT = (
    "--quantize-dense makes the MLPs' nn.Linear dynamic int8 (torch.ao quantize_dynamic), which torch.export "
    "cannot trace (its packed weights are a TorchScript class); add --torchscript for a dynamic-int8 dense part, "
    "or drop --quantize-dense for the torch.export program")


class ExportError(RuntimeError, UserError):
    """Export or artifact loading failed for a reason the user can fix (message says how)."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    return h.hexdigest()


def write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` from Python in 4 MiB chunks (a full disk is an ``OSError`` here,
    not an abort inside the C++ writer), flushed to disk."""
    with open(path, "wb") as f:
        view = memoryview(data)
        for i in range(0, len(view), 1 << 22):
            f.write(view[i:i + (1 << 22)])
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch 2.13's DeprecationWarnings on torch.jit.script / trace / load.

    TorchScript stays available (``--torchscript``): C++ libtorch loads it without a compiler at
    export time, where ``--aot`` compiles the torch.export program to a package with the system
    C++ compiler.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
