"""The suite's layout (issue 24 item 6): ``tests/`` mirrors the package (``tests/train/`` for
``dlrmctl/train/``, ...; ``tests/commands/`` holds the CLI end-to-end and error-line tests,
``tests/scripts/`` the tests of ``scripts/*.py``), the shared fixtures live in ``tests/conftest.py``,
and no test imports a private name of another module."""

import ast
from pathlib import Path

from tests.conftest import REPO

TESTS = REPO / "tests"
#: folders of tests/ that name no subpackage of dlrmctl/: the tests of scripts/*.py, and the helpers
NOT_A_PACKAGE = {"scripts", "helpers"}
#: private modules that tests may still import: dlrmctl._fbgemm (the torch / fbgemm_gpu pair check,
#: which tests monkeypatch) is imported by that name across the package itself
PRIVATE_MODULES_ALLOWED = {"dlrmctl._fbgemm"}


def private_imports(path: Path) -> list[str]:
    """``"line: what"`` for each import in ``path`` of a private name (``_x``) of a dlrmctl or tests
    module other than ``path``'s own module, or of a private dlrmctl / tests module."""
    own = ".".join(path.relative_to(REPO).with_suffix("").parts)
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod.split(".")[0] not in ("dlrmctl", "tests") or mod == own:
                continue
            for a in node.names:
                full = f"{mod}.{a.name}"
                if full in PRIVATE_MODULES_ALLOWED or mod in PRIVATE_MODULES_ALLOWED:
                    continue
                if a.name.startswith("_") or any(p.startswith("_") for p in mod.split(".")):
                    bad.append(f"{node.lineno}: from {mod} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in ("dlrmctl", "tests") and a.name not in PRIVATE_MODULES_ALLOWED \
                        and any(p.startswith("_") for p in parts):
                    bad.append(f"{node.lineno}: import {a.name}")
    return bad


def test_every_test_folder_mirrors_a_package_folder_and_is_a_package():
    packages = {p.name for p in (REPO / "dlrmctl").iterdir() if (p / "__init__.py").is_file()}
    folders = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert {"train", "distributed", "commands", "scripts"} <= {p.name for p in folders}
    for d in folders:
        assert d.name in packages | NOT_A_PACKAGE, f"tests/{d.name}/ mirrors no dlrmctl/{d.name}/"
        # without __init__.py, two folders' test_x.py would clash as top-level module names
        assert (d / "__init__.py").is_file(), f"tests/{d.name}/ has no __init__.py"
        assert list(d.glob("test_*.py")) or d.name == "helpers", f"tests/{d.name}/ holds no tests"


def test_no_test_imports_a_private_name_across_modules():
    bad = [f"{p.relative_to(REPO)}:{b}" for p in sorted(TESTS.rglob("*.py")) for b in private_imports(p)]
    assert not bad, "\n".join(bad)


def test_the_private_import_check_catches_each_form(tmp_path, monkeypatch):
    import tests.test_layout as layout

    monkeypatch.setattr(layout, "REPO", tmp_path)
    (tmp_path / "tests" / "x").mkdir(parents=True)
    mod = tmp_path / "tests" / "x" / "test_a.py"
    mod.write_text("from dlrmctl.train.metrics import (\n    auc,\n    _labels,\n)\n"
                   "from tests.x.test_a import _self_is_fine\n"
                   "from tests.y.test_b import _helper\n"
                   "import dlrmctl._private_mod\n"
                   "from dlrmctl import _fbgemm\n"
                   "from os import _exit\n")
    assert layout.private_imports(mod) == ["1: from dlrmctl.train.metrics import _labels",
                                           "6: from tests.y.test_b import _helper",
                                           "7: import dlrmctl._private_mod"]
