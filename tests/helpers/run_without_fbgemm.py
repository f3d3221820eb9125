"""Run the dlrmctl CLI as if fbgemm_gpu were not installed (a GPU box without the wheel)."""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fbgemm_gpu" or name.startswith("fbgemm_gpu."):
            raise ModuleNotFoundError(f"No module named '{name}' (blocked)")
        return None
sys.meta_path.insert(0, Block())
import importlib.util
_orig = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a, **k: None if n.split(".")[0] == "fbgemm_gpu" else _orig(n, *a, **k)
import dlrmctl
print("HAS_FBGEMM", dlrmctl.HAS_FBGEMM)
from dlrmctl.cli import main
sys.argv = ["dlrmctl"] + sys.argv[1:]
main()
