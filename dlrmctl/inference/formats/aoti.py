"""The AOTInductor package format (``model_aoti.pt2``, ``dlrmctl export --aot``).

Compiled from the ``torch.export`` program beside ``model.pt2`` (never written on its own), with the
system C++ compiler; C++ loads it with ``torch::inductor::AOTIModelPackageLoader``
(scripts/cpp_inference), Python with ``torch._inductor.aoti_load_package``.  It runs on the device
type it was compiled for (``manifest["aoti_device"]``, CPU when absent) and, like the program,
returns ``(scores, logits)``: the program's input contract applies unchanged.

What the compile changes against the program (:data:`INDUCTOR_CONFIG`, :func:`fused_pair_dots`), each
measured in ``benchmarks/export.md``:

* the pairwise dots of the dot interaction, ``bmm(T, T^T)`` ``[B, n, n]`` then the strict upper
  triangle's ``index_select`` (the program's form: two fast ATen kernels), become one generated
  loop of dot products over the selected pairs only (``T[:, I] * T[:, J]`` summed over the width):
  about half the multiply-adds, no ``[B, n, n]`` buffer, and none of Inductor's element-by-element
  gather, which made the program's form slower compiled than run by ATen;
* the generated loops use the thread count of the process that runs them
  (``torch.set_num_threads``), not the exporting process's (``cpp.dynamic_threads``).
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

__all__ = ["AotiFormat", "INDUCTOR_CONFIG", "fused_pair_dots"]

#: Inductor options of the compile (module doc)
#: (the bounds checks of indirect loads stay on: nothing orders a generated gather of user ids, e.g. the fp16
#: lookup, after the program's own id assertion)
INDUCTOR_CONFIG = {"cpp.dynamic_threads": True}


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
                program = copy_sharing_tensors(program)  # the caller's graph stays as saved; no weight copied
                fused_pair_dots(program.graph_module)
                torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                         inductor_configs=dict(INDUCTOR_CONFIG))
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


def copy_sharing_tensors(program: Any) -> Any:
    """A deep copy of the ExportedProgram ``program`` whose graph can be rewritten without touching
    ``program``'s, sharing its tensors: every tensor of ``state_dict`` and ``constants`` and every
    parameter, buffer or tensor attribute of its ``graph_module`` is the same object in the copy
    (same storage; a plain ``copy.deepcopy`` duplicates each table, doubling an export's peak
    memory).  The copy must not write to them; the compile only reads them."""
    import copy

    gm = program.graph_module
    shared = [*program.state_dict.values(), *program.constants.values(), *gm.parameters(), *gm.buffers(),
              *(v for v in vars(gm).values() if isinstance(v, torch.Tensor))]
    memo = {id(v): v for v in shared}
    return copy.deepcopy(program, memo)


def fused_pair_dots(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, each ``index_select(flatten(bmm(t, t.transpose(1, 2)), 1), 1, flat)`` of
    ``gm`` (ATen graph; ``t`` ``[B, n, d]`` float, ``n`` static, ``flat`` ``[P]`` int64 positions in
    the row-major ``[n, n]`` products) as ``(t[:, I] * t[:, J]).sum(-1)`` with ``I = flat // n``,
    ``J = flat % n``: the same ``[B, P]`` dot products, each summed over ``d`` in another order
    (float32 rounding), without the ``[B, n, n]`` product.  Compiled by Inductor into one loop over
    ``(b, p)``; run eagerly it would materialise two ``[B, P, d]`` gathers, so the saved program
    keeps its own form.  Returns the number of rewrites."""
    aten = torch.ops.aten
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.index_select.default or node.args[1] != 1:
            continue
        flat_node, positions = node.args[0], node.args[2]
        if (not isinstance(flat_node, torch.fx.Node) or flat_node.target != aten.flatten.using_ints
                or tuple(flat_node.args[1:]) not in ((1,), (1, -1), (1, 2)) or len(flat_node.users) != 1):
            continue
        prod = flat_node.args[0]
        if not isinstance(prod, torch.fx.Node) or prod.target != aten.bmm.default or len(prod.users) != 1:
            continue
        t, tt = prod.args
        if (not isinstance(tt, torch.fx.Node) or tt.target != aten.transpose.int or tt.args[0] is not t
                or sorted(int(a) % 3 for a in tt.args[1:]) != [1, 2]):
            continue
        val = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
        if val is None or val.dim() != 3 or not isinstance(val.shape[1], int):
            continue
        n = int(val.shape[1])
        with graph.inserting_before(node):
            rows = graph.call_function(aten.div.Scalar_mode, (positions, n), {"rounding_mode": "floor"})
            cols = graph.call_function(aten.remainder.Scalar, (positions, n))
            left = graph.call_function(aten.index_select.default, (t, 1, rows))
            right = graph.call_function(aten.index_select.default, (t, 1, cols))
            dots = graph.call_function(aten.sum.dim_IntList, (graph.call_function(aten.mul.Tensor, (left, right)), [-1]))
        node.replace_all_uses_with(dots)
        for dead in (node, flat_node, prod):
            graph.erase_node(dead)
        if not tt.users:
            graph.erase_node(tt)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
