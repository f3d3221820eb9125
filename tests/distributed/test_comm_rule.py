"""The communication rule (ARCHITECTURE.md, ``dlrmctl/distributed/comm/``): every
``torch.distributed`` collective lives in ``distributed/comm/`` and process-group
creation / teardown in ``distributed/env.py``.  An AST scan of the package fails on
any other call into ``torch.distributed`` other than read-only queries (the
checkpoint's DCP calls are ``torch.distributed.checkpoint``'s, not collectives)."""

import ast
import pathlib

from tests.conftest import REPO

PKG = REPO / "dlrmctl"
ALLOWED_FILES = {*(PKG / "distributed" / "comm").glob("*.py"), PKG / "distributed" / "env.py"}
#: read-only queries any module may call
QUERIES = {"get_rank", "get_world_size", "is_initialized", "is_available", "get_backend", "get_global_rank",
           "get_process_group_ranks", "is_nccl_available", "is_gloo_available"}


def _dist_calls(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of a ``torch.distributed`` function in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: set[str] = set()  # names bound to the torch.distributed module
    direct: dict[str, str] = {}  # name -> torch.distributed function imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                for a in node.names:
                    if a.name == "distributed":
                        aliases.add(a.asname or "distributed")
            elif node.module == "torch.distributed":
                for a in node.names:
                    direct[a.asname or a.name] = a.name

    def dotted(n: ast.AST) -> str | None:
        if isinstance(n, ast.Name):
            return n.id
        if isinstance(n, ast.Attribute):
            base = dotted(n.value)
            return None if base is None else f"{base}.{n.attr}"
        return None

    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name is None:
            continue
        fn = None
        if name in direct:
            fn = direct[name]
        else:
            for a in aliases | {"torch.distributed"}:
                if name.startswith(a + ".") and "." not in name[len(a) + 1:]:
                    fn = name[len(a) + 1:]
        if fn is not None and fn not in QUERIES and not fn[0].isupper():
            out.append((node.lineno, fn))
    return sorted(out)


def test_no_collective_outside_comm_and_env():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path in ALLOWED_FILES:
            continue
        for line, fn in _dist_calls(path):
            bad.append(f"{path.relative_to(PKG.parent)}:{line}: torch.distributed.{fn}")
    assert not bad, "collectives outside distributed/comm/ and env.py:\n" + "\n".join(bad)


def test_the_scan_finds_collectives_written_every_way(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
        "from torch import distributed\n"
        "dist.all_reduce(x)\ntorch.distributed.barrier()\nar(x)\ndistributed.broadcast(x, 0)\n"
        "dist.get_rank()\ndist.ReduceOp.SUM\nimport torch.distributed.checkpoint as dcp\ndcp.save(s)\n"
    )
    assert [fn for _, fn in _dist_calls(src)] == ["all_reduce", "barrier", "all_reduce", "broadcast"]
