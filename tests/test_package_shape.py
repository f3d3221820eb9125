"""The package keeps its shape: no module-level import cycle, no module importing its own
package's ``__init__``, and no file under ``dlrmctl/`` over 500 lines (but the few listed below,
each with the reason it is still long)."""

import ast
from pathlib import Path

from tests.conftest import REPO

PKG = REPO / "dlrmctl"
MAX_LINES = 500
#: files still over MAX_LINES, each with why; the list only shrinks (a test fails when a listed
#: file is short again, so it is taken off)
LONG_FILES: dict[str, str] = {}


def module_name(path: Path, root: Path = PKG) -> str:
    """``dlrmctl/a/b.py`` -> ``dlrmctl.a.b``; ``dlrmctl/a/__init__.py`` -> ``dlrmctl.a`` (``root``: the
    package's directory)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its body (``try``, ``if``, ``with`` and class
    bodies included), not function bodies nor ``if TYPE_CHECKING:`` blocks."""
    out: list = []

    def visit(nodes) -> None:
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.append(n)
                continue
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                visit(n.orelse)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(n, field, None)
                if isinstance(sub, list):
                    visit(sub)

    visit(tree.body)
    return out


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package modules it imports at import time: ``import a.b`` -> ``a.b``;
    ``from a.b import c`` -> ``a.b.c`` when that is a module, else ``a.b`` (relative imports
    resolved)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    top = root.name
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges: set[str] = set()
        for node in _import_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges |= {n for n in names if n.split(".")[0] == top and n in files and n != mod}
        graph[mod] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_level_import_cycle_in_the_package():
    cycles = import_cycles(import_graph())
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_its_own_packages_init():
    bad = [f"{m} imports {m.rsplit('.', 1)[0]}" for m, edges in import_graph().items()
           if not (PKG / Path(*m.split(".")[1:]) / "__init__.py").is_file()  # m is a module, not a package
           and m.count(".") > 1 and m.rsplit(".", 1)[0] in edges]
    assert not bad, "\n".join(bad)


def test_the_import_walk_finds_a_cycle_through_a_package_init_and_skips_function_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "dlrmctl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from dlrmctl.a.x import f\n")
    (pkg / "a" / "x.py").write_text("from dlrmctl.b import g\n\ndef f():\n    from dlrmctl import c\n")
    (pkg / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import dlrmctl.c\ntry:\n"
                              "    from dlrmctl import a\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg)
    assert graph["dlrmctl.a.x"] == {"dlrmctl.b"} and graph["dlrmctl.c"] == {"dlrmctl.b"}
    assert import_cycles(graph) == [["dlrmctl.a", "dlrmctl.a.x", "dlrmctl.b"]]


def test_no_file_under_dlrmctl_is_over_500_lines_but_the_listed_ones():
    lengths = {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines()) for p in sorted(PKG.rglob("*.py"))}
    long = sorted(f"{p}: {n} lines" for p, n in lengths.items() if n > MAX_LINES and p not in LONG_FILES)
    assert not long, f"over {MAX_LINES} lines (split them):\n" + "\n".join(long)
    short_again = sorted(p for p in LONG_FILES if lengths.get(p, 0) <= MAX_LINES)
    assert not short_again, f"take these off LONG_FILES (gone or at most {MAX_LINES} lines now): {short_again}"
