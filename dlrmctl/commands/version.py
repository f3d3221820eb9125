"""``dlrmctl --version``: dlrmctl's version and the versions of the libraries it runs on.

The library versions come from the installed distributions' metadata
(:mod:`importlib.metadata`): nothing is imported, so ``--version`` answers as fast as
``--help`` (no torch).
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Optional

import typer

#: (label, distribution names to try in order): the first one installed is shown
_LIBRARIES = (
    ("torch", ("torch",)),
    ("fbgemm_gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-genai", "fbgemm-gpu-nightly",
                    "fbgemm-gpu-nightly-cpu")),
    ("torchx", ("torchx",)),
)


def _installed(names: tuple[str, ...]) -> str | None:
    """``"<distribution> <version>"`` of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            v = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        dist = metadata.metadata(name).get("Name", name)
        return v if dist.lower().replace("_", "-") == names[0] else f"{v} ({dist})"
    return None


def version_text() -> str:
    """One line: ``dlrmctl X.Y.Z (python A.B.C; torch ..., fbgemm_gpu ... | not installed, torchx ...)``.

    dlrmctl's own version is that of the code running (``dlrmctl.__version__``), which an
    editable install of another checkout would not report through the metadata.
    """
    from dlrmctl import __version__

    libs = [f"{label} {_installed(names) or 'not installed'}" for label, names in _LIBRARIES]
    return f"dlrmctl {__version__} (python {platform.python_version()}; {', '.join(libs)})"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit(0)


def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version_callback, is_eager=True,
        help="print the versions of dlrmctl, Python, torch, fbgemm_gpu and torchx, and exit"),
) -> None:
    """Train, shard, plan and ship DLRM recommendation models."""


def register(root: typer.Typer) -> None:
    root.callback()(_root)
