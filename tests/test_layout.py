"""The suite's layout (issue 24 item 6): ``tests/`` mirrors the package (``tests/train/`` for
``dlrmctl/train/``, ...; ``tests/commands/`` holds the CLI end-to-end and error-line tests,
``tests/scripts/`` the tests of ``scripts/*.py``), the shared fixtures live in ``tests/conftest.py``,
and no test imports a private name of another module."""

import ast
import re
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


#: private names that tests still reach by attribute, each to be made public (or the test to use
#: the public interface); the list only shrinks
PRIVATE_ATTRIBUTES_ALLOWED = {
    # the overlap tests wrap the pooled all-to-all's halves
    "dlrmctl.distributed.comm.all_to_all._PooledAllToAllStart", "dlrmctl.distributed.comm.all_to_all._PooledAllToAllWait",
    "dlrmctl.modules.dlrm._ROW_PAD", "dlrmctl.modules.dlrm._ROW_PAD_MIN_BATCH", "dlrmctl.modules.dlrm._dot_row_pad",
    "dlrmctl.run_lock._held",
}


def _is_module(dotted: str) -> bool:
    p = REPO.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def private_attributes(path: Path) -> list[str]:
    """``"line: module._name"`` for each attribute access in ``path`` of a private name (``_x``, not
    dunder) of a dlrmctl / tests module other than ``path``'s own, through a name an import bound to
    that module (``import dlrmctl.a as m``, ``from dlrmctl.a import m``: ``m._x``, ``m.sub._x``)."""
    own = ".".join(path.relative_to(REPO).with_suffix("").parts)
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("dlrmctl", "tests"):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in ("dlrmctl", "tests"):
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        chain, v = [], node.value
        while isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        if isinstance(v, ast.Name) and v.id in bound:
            mod = ".".join([bound[v.id], *reversed(chain)])
            if mod != own and _is_module(mod) and f"{mod}.{node.attr}" not in PRIVATE_ATTRIBUTES_ALLOWED:
                bad.append(f"{node.lineno}: {mod}.{node.attr}")
    return sorted(set(bad))


def test_no_test_reaches_a_private_name_of_another_module_by_attribute():
    bad = [f"{p.relative_to(REPO)}:{b}" for p in sorted(TESTS.rglob("*.py")) for b in private_attributes(p)]
    assert not bad, "\n".join(bad)


def test_the_private_attribute_check_catches_module_aliases(tmp_path, monkeypatch):
    import tests.test_layout as layout

    monkeypatch.setattr(layout, "REPO", tmp_path)
    for f in ("dlrmctl/__init__.py", "dlrmctl/train/__init__.py", "dlrmctl/train/checkpoint/__init__.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    (tmp_path / "tests" / "x").mkdir(parents=True)
    mod = tmp_path / "tests" / "x" / "test_a.py"
    mod.write_text("import dlrmctl.train as tr\nfrom dlrmctl.train import checkpoint as ckpt\n"
                   "from dlrmctl.train import checkpoint\n"
                   "ckpt._CheckedFile\ncheckpoint.__name__\ntr.checkpoint._crc\nckpt.public._x\nobj._y\n")
    assert layout.private_attributes(mod) == ["4: dlrmctl.train.checkpoint._CheckedFile",
                                              "6: dlrmctl.train.checkpoint._crc"]


def test_the_private_import_check_catches_each_form(tmp_path, monkeypatch):
    import tests.test_layout as layout

    monkeypatch.setattr(layout, "REPO", tmp_path)
    (tmp_path / "tests" / "x").mkdir(parents=True)
    mod = tmp_path / "tests" / "x" / "test_a.py"
    mod.write_text("from dlrmctl.metrics import (\n    auc,\n    _labels,\n)\n"
                   "from tests.x.test_a import _self_is_fine\n"
                   "from tests.y.test_b import _helper\n"
                   "import dlrmctl._private_mod\n"
                   "from dlrmctl import _fbgemm\n"
                   "from os import _exit\n")
    assert layout.private_imports(mod) == ["1: from dlrmctl.metrics import _labels",
                                           "6: from tests.y.test_b import _helper",
                                           "7: import dlrmctl._private_mod"]


def layout_rows(text: str) -> dict[str, str]:
    """docs/layout.md's table: first cell (a path, without backticks) -> the row's text."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def unnamed_modules(text: str, root: Path) -> list[str]:
    """The modules under ``root`` (a package directory) that docs/layout.md's ``text`` does not
    name: each ``x.py`` needs its own row, or is named as ``x.py`` (after ``sub/`` for a module of
    a subpackage ``sub`` without a row) in the row of its nearest directory that has one; a
    package's ``__init__.py`` is named by its directory's row or that ``sub/``."""
    rows = layout_rows(text)
    base = root.parent
    missing = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(base).as_posix()
        if rel in rows or (p.name == "__init__.py" and rel[: -len("__init__.py")] in rows):
            continue
        parts = p.relative_to(base).parts
        for i in range(len(parts) - 1, 0, -1):
            row = rows.get("/".join(parts[:i]) + "/")
            if row is None:
                continue
            inner = parts[i:]
            need = [f"{d}/" for d in inner[:-1]] + ([inner[-1]] if inner[-1] != "__init__.py" else [])
            if not all(re.search(rf"(?<![\w/.]){re.escape(n)}(?![\w])", row) for n in need):
                missing.append(rel)
            break
        else:
            missing.append(rel)
    return missing


def test_docs_layout_names_every_module_of_the_package():
    missing = unnamed_modules((REPO / "docs" / "layout.md").read_text(), REPO / "dlrmctl")
    assert not missing, f"docs/layout.md does not name: {missing}"


def named_but_missing(text: str, root: Path) -> list[str]:
    """``"row: name"`` for each module docs/layout.md's ``text`` names that is not there: a row
    ``dlrmctl/...`` whose path does not exist, or a ``x.py`` (``sub/x.py``) in the row of a
    directory with no such file in it or in its subpackages."""
    base = root.parent
    bad = []
    for head, row in layout_rows(text).items():
        if not head.startswith(root.name + "/"):
            continue
        d = base / head
        if not d.exists():
            bad.append(f"{head}: the row's own path")
            continue
        for name in re.findall(r"`([\w./]+\.py)`", row) if d.is_dir() else []:
            if not ((d / name).is_file() or (base / name).is_file() or any(d.rglob(name.split("/")[-1]))):
                bad.append(f"{head}: {name}")
    return bad


def test_docs_layout_names_no_module_that_is_not_there():
    bad = named_but_missing((REPO / "docs" / "layout.md").read_text(), REPO / "dlrmctl")
    assert not bad, f"docs/layout.md names modules that do not exist: {bad}"


def tiny_package(root: Path, files: tuple[str, ...]) -> Path:
    """``root/dlrmctl`` holding the empty ``files`` (paths relative to it)."""
    pkg = root / "dlrmctl"
    for f in files:
        (pkg / f).parent.mkdir(parents=True, exist_ok=True)
        (pkg / f).write_text("")
    return pkg


def test_the_layout_check_finds_a_listed_module_that_is_not_there(tmp_path):
    pkg = tiny_package(tmp_path, ("__init__.py", "x.py", "a/__init__.py", "a/one.py", "a/sub/__init__.py",
                                  "a/sub/deep.py", "b.py"))
    text = ("| `dlrmctl/x.py` | x |\n| `dlrmctl/gone.py` | g |\n"
            "| `dlrmctl/a/` | `one.py` one; `b.py` elsewhere; `sub/` (`deep.py`, `sub/deep.py`, `shallow.py`) |\n")
    assert named_but_missing(text, pkg) == ["dlrmctl/gone.py: the row's own path", "dlrmctl/a/: b.py",
                                            "dlrmctl/a/: shallow.py"]


def test_docs_layout_names_every_verb():
    import typer.main

    from dlrmctl import cli

    def leaves(cmd, prefix=""):
        subs = getattr(cmd, "commands", None)
        if not subs:
            return [prefix.strip()]
        return [leaf for name, sub in subs.items() for leaf in leaves(sub, f"{prefix} {name}")]

    row = layout_rows((REPO / "docs" / "layout.md").read_text())["dlrmctl/commands/"]
    verbs = leaves(typer.main.get_command(cli.app))
    assert len(verbs) > 10
    missing = [v for v in verbs if f"`{v}`" not in row]
    assert not missing, f"docs/layout.md's dlrmctl/commands/ row does not name the verbs {missing}"


def test_the_layout_check_finds_a_module_missing_from_its_row(tmp_path):
    pkg = tiny_package(tmp_path, ("__init__.py", "x.py", "a/__init__.py", "a/one.py", "a/two.py", "a/sub/__init__.py",
                                  "a/sub/deep.py"))
    text = ("| `dlrmctl/x.py` | x |\n| `dlrmctl/a/` | `one.py` one; two, not as a file; `sub/` (`deep.py`) |\n")
    assert unnamed_modules(text, pkg) == ["dlrmctl/__init__.py", "dlrmctl/a/two.py"]
