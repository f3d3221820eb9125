"""Import one of the repository's ``scripts/*.py`` (not a package) as a module, for tests."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.conftest import REPO


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` executed as a fresh module named ``name``.

    Raises:
        FileNotFoundError: no such script.
    """
    path = REPO / "scripts" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such script")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
