"""The ``torch.export`` program format (``model.pt2``, ``dlrmctl export``'s default).

Written from :class:`~dlrmctl.inference.program.InferenceProgram` (the tables quantized row-wise
one at a time, every dim; the multi-hot expansion and a managed-collision remap inside), loaded
with ``torch.export.load`` by any Python with torch (no dlrmctl, no fbgemm_gpu).  The loaded
module returns ``(scores [B], logits [B])`` float32; its input contract is checked here with the
TorchScript module's messages (the program's own guards are terser), and an id out of range is
located (table, feature, sample) from the inputs, as the program asserts all ids at once.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from dlrmctl.console import stage
from dlrmctl.inference.artifact import PROGRAM_FILE, QUANTIZE_DENSE_NEEDS_TORCHSCRIPT, ExportError
from dlrmctl.inference.formats.base import Built, ExportPlan, Format
from dlrmctl.inference.formats.pt2_reader import NotReadable, ProgramParts, read_program
from dlrmctl.inference.raw_id_remap import raw_id_remap

__all__ = ["GraphRunner", "ProgramFormat", "multi_hot_tables", "native_binding", "native_graph", "program_parts",
           "qtable_bytes"]

log = logging.getLogger("dlrmctl.export")


class GraphRunner:
    """A loaded ``.pt2`` program called through its flat graph (``ExportedProgram.graph_module``)
    with its weights and buffers passed in signature order: the same operators as
    ``ep.module()``, without that module's per-call attribute lookups of every weight (nested
    module paths) and input/output pytree handling, which cost more than a small batch's lookups.
    The graph's ATen operators are called through torch's own Python bindings (``torch.add`` for
    ``aten.add.Tensor``: :func:`native_graph`), the same kernels with a cheaper argument parse.
    ``__call__(dense, values, lengths[, weights]) -> (scores, logits)``."""

    def __init__(self, parts: ProgramParts, device: torch.device) -> None:
        self.state = [t.detach().to(device) for t in parts.tensors]
        self._parameter = list(parts.parameter)
        self._names = list(parts.names)
        self.graph = native_graph(parts.graph_module)
        self._forward = self.graph.forward

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self._forward(*self.state, *inputs)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The program's parameters as ``(fully qualified name, tensor)``, like ``nn.Module``'s."""
        return ((n, t) for n, t, p in zip(self._names, self.state, self._parameter) if p)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The program's buffers and tensor constants as ``(name, tensor)`` (the tables' storage
        among them), like ``nn.Module``'s."""
        return ((n, t) for n, t, p in zip(self._names, self.state, self._parameter) if not p)


def program_parts(ep: Any) -> ProgramParts:
    """The parts :class:`GraphRunner` runs of a ``torch.export.ExportedProgram``: its graph module,
    and its parameters, buffers and tensor constants in signature order."""
    from torch.export.graph_signature import InputKind

    tensors = {**ep.state_dict, **ep.constants}
    specs = [s for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
    return ProgramParts(ep.graph_module, [s.target for s in specs], [tensors[s.target] for s in specs],
                        [s.kind == InputKind.PARAMETER for s in specs])


#: ATen overloads -> torch's Python binding of the same operator with the same arguments (positional
#: and keyword names are the schema's in both); the rest keep their ``torch.ops`` call
_NATIVE_NAMES = {
    "torch": {"add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "eq.Scalar", "eq.Tensor", "ne.Scalar",
              "ge.Scalar", "ge.Tensor", "gt.Scalar", "lt.Scalar", "lt.Tensor", "le.Scalar", "all.default",
              "any.default", "sum.default", "sum.dim_IntList", "cumsum.default", "repeat_interleave.self_Tensor",
              "repeat_interleave.Tensor", "relu.default", "relu_.default", "sigmoid.default", "unsqueeze.default",
              "transpose.int", "bmm.default", "mm.default", "addmm.default", "cat.default", "flatten.using_ints",
              "index_select.default", "reshape.default", "where.self", "clamp_min.default", "_assert_async.msg",
              "index_add.default", "squeeze.dim"},
    "torch._C._nn": {"linear.default"},
    "torch.Tensor": {"view.default", "__and__.Tensor", "__or__.Tensor", "expand.default"},
}


def _to_copy(x: torch.Tensor, dtype: Any = None, device: Any = None, non_blocking: bool = False) -> torch.Tensor:
    """``aten._to_copy`` with only a dtype / device (a new tensor, as ``_to_copy`` makes)."""
    return x.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=True)


def native_binding(op: Any) -> Any:
    """The Python binding that runs ``op`` (an ATen ``OpOverload`` of :data:`_NATIVE_NAMES`, or
    ``sym_size.int`` / ``_to_copy`` with a dtype and device only) with the same arguments, or None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op._schema.name.split("::", 1)[1]
    key = f"{name}.{op._overloadname}"
    if key == "sym_size.int":
        return torch.Tensor.size
    if key == "_to_copy.default":
        return _to_copy
    for where, names in _NATIVE_NAMES.items():
        if key in names:
            ns = {"torch": torch, "torch._C._nn": torch._C._nn, "torch.Tensor": torch.Tensor}[where]
            return getattr(ns, name)
    return None


def native_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ATen calls go through torch's Python bindings (:func:`native_binding`):
    ``torch.ops.aten.add.Tensor(a, b)`` parses its arguments against the operator's schema in
    Python-visible steps (about 3 µs a call here), ``torch.add(a, b)`` in generated C++ (about
    1.7 µs), the same kernel either way.  ``_to_copy`` runs as ``Tensor.to`` (a copy, unless only
    an assertion reads it: then no copy of a flag already on its device)."""
    import copy

    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fn = native_binding(node.target)
        if fn is _to_copy:
            if not set(node.kwargs) <= {"dtype", "device", "non_blocking"}:
                fn = None
            elif all(u.target == torch.ops.aten._assert_async.msg for u in node.users):  # (users come later)
                fn = torch.Tensor.to  # read only by an assertion: no copy needed where it already is
        if fn is not None:
            node.target = fn
    return torch.fx.GraphModule(gm, graph)


class ProgramFormat(Format):
    """``model.pt2``: the torch.export program (runs on any device its buffers are moved to)."""

    name = "pt2"
    file = PROGRAM_FILE
    title = "torch.export program"
    devices = ()
    rank = 1
    export_flag = "(default)"
    loads_with = "torch.export.load"

    # ------------------------------------------------------------------ write
    def check_export(self, quantize_dense: bool, aot: bool) -> None:
        """``quantize_dense`` is refused: torch.export cannot trace the dynamic-int8 Linear's packed
        params (a TorchScript class)."""
        if quantize_dense:
            raise ExportError(QUANTIZE_DENSE_NEEDS_TORCHSCRIPT)

    def build(self, plan: ExportPlan) -> Built:
        """Quantize each table (int4 of odd dim: one pad code per row), build the program, trace it
        with ``torch.export`` (dynamic batch and id count).

        Raises:
            ExportError: torch.export cannot trace the dense part (its first line).
        """
        from dlrmctl.inference.program import InferenceProgram, export_program
        from dlrmctl.inference.quantize import pad_columns, padded_dim, quantize_table

        dtype = plan.embedding_dtype
        qtables = []
        for t in plan.tables:  # one table at a time: load, quantize (int4 odd dims: one pad code), drop
            w = plan.table_weight(t)
            pd = padded_dim(t.embedding_dim, 2) if dtype == "int4" else t.embedding_dim
            q = quantize_table(pad_columns(w.detach().cpu(), pd), dtype, t.name)
            q.embedding_dim = t.embedding_dim  # the program reads only the real columns
            qtables.append(q)
            del w
        mc = plan.managed_collision
        program = InferenceProgram(
            qtables, plan.lookup_table, plan.lookup_src, plan.lookup_mean,
            list(zip(plan.lookup_tables, plan.lookup_features)), plan.dense_part, plan.feature_names,
            plan.num_dense, plan.on_invalid_id, plan.feature_weighted,
            multi_hot_tables(plan.multi_hot, plan.data_meta, plan.feature_names),
            remap=None if mc is None else raw_id_remap(mc, plan.feature_names))
        stage("tracing the program (torch.export)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                saved: Any = export_program(program, plan.num_dense)
        except Exception as e:  # torch.export refusing the dense part (e.g. an untraceable custom interaction)
            raise ExportError(
                f"torch.export cannot trace this model ({type(e).__name__}: {str(e).strip().splitlines()[0]}); "
                "export it as TorchScript with --torchscript") from None
        kernel = ("torch.export program; lookups by fused embedding-bag kernels of torch (quantized:: "
                  "row-wise int8/int4, embedding_bag fp32, float32 gather-add fp16; dlrmctl.inference.lookups)")
        return Built(saved, sum(qtable_bytes(q) for q in qtables), 1, kernel)

    def stored_dim(self, dim: int, dtype: str) -> int:
        """The real dim (int4: rounded up to even, two codes a byte)."""
        from dlrmctl.inference.quantize import padded_dim

        return padded_dim(dim, 2 if dtype == "int4" else 1)

    def row_bytes(self, stored_dim: int, dtype: str, row_alignment: int) -> int:
        """Codes plus scale and bias: fp16 for int4, float32 for int8 (:func:`qtable_bytes`)."""
        rb = super().row_bytes(stored_dim, dtype, row_alignment)
        return rb + 4 if dtype == "int8" else rb  # float32 scale + bias (the fp16 values, widened)

    def manifest_fields(self) -> dict:
        return {
            "model_file": self.file,
            "output": {"shape": [["B"], ["B"]], "dtype": "float32", "meaning": "(scores = sigmoid(logit), logits)"},
            "dynamic": {"batch": [1, 1 << 24], "ids": [0, 1 << 31]},
            "in_program": ["dense_standardize", "on_invalid_id", "multi_hot"],
            "scale_bias": "per row after the row codes: int8 float32 scale and bias (the fp16 values widened, "
                          "8 bytes), int4 fp16 scale and bias (4 bytes)",
        }

    def save(self, saved: Any, buf: io.BytesIO) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.save(saved, buf)

    # ------------------------------------------------------------------ load and run
    def load(self, path: Path, manifest: dict, device: torch.device) -> Any:
        """The program as a callable of its graph on ``device`` (:class:`GraphRunner`): read by
        :func:`~dlrmctl.inference.formats.pt2_reader.read_program` (dlrmctl's own archives: the
        same graph and tensors without ``torch.export.load``'s start-up), else by
        ``torch.export.load`` (a program whose graph also returns buffer mutations then runs as
        ``ep.module()``, moved to ``device``).  Input guards are left to :meth:`check_inputs`
        (clearer messages): the module's own guard hooks cost more than a small batch's lookups."""
        from torch.export.graph_signature import OutputKind

        try:
            return GraphRunner(read_program(path), device)
        except NotReadable as e:
            log.debug("%s: read with torch.export.load (%s)", path, e)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.load(str(path))
            if all(s.kind == OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs):
                return GraphRunner(program_parts(ep), device)
            module = ep.module(check_guards=False)
        module.validate_inputs = False
        return module.to(device) if device.type != "cpu" else module

    def run(self, module: Any, args: tuple, logits: bool) -> torch.Tensor:
        return module(*args)[1 if logits else 0]

    def check_inputs(self, model: Any, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     weights: torch.Tensor | None) -> None:
        """The program's input contract, with messages like the TorchScript module's."""
        where = f"{model.model_dir}: bad model input"
        F = len(model.feature_names)
        if dense.dim() != 2 or dense.size(1) != model.num_dense or dense.dtype != torch.float32:
            raise ExportError(f"{where}: dense must be [B, {model.num_dense}] float32, got "
                              f"shape {list(dense.shape)} {dense.dtype}")
        if values.dtype != torch.int64 or lengths.dtype != torch.int64 or values.dim() != 1 or lengths.dim() != 1:
            raise ExportError(f"{where}: values and lengths must be 1-d int64")
        B = dense.size(0)
        if B < 1:
            raise ExportError(f"{where}: the batch is empty (B = 0)")
        if lengths.numel() != F * B:
            raise ExportError(f"{where}: lengths must have num_features * B = {F} * {B} "
                              f"entries (key-major), got {lengths.numel()}")
        if weights is None and model.weighted_features:
            raise ExportError(f"{where}: this model has weighted features "
                              f"{model.weighted_features}: pass weights [N] float32, one per id aligned with values")
        if weights is not None:
            if not model.weighted_features:
                raise ExportError(f"{where}: this model has no weighted features (it was "
                                  "trained without per-id weights); it takes no weights, they would be ignored")
            if weights.dtype != torch.float32 or weights.dim() != 1 or weights.numel() != values.numel():
                raise ExportError(f"{where}: weights must be [N] float32 with N = "
                                  f"len(values) = {values.numel()}, got shape {list(weights.shape)} {weights.dtype}")

    def message_line(self, lines: list[str]) -> str:
        """``aten._assert_async``: the message is on the first line."""
        return next((ln for ln in lines if "out of range" in ln or "lengths" in ln), lines[0])

    def input_message(self, model: Any, err: BaseException, values: torch.Tensor, lengths: torch.Tensor,
                      batch: int) -> str:
        """The program's range message (every lookup's valid range; the program checks all ids with
        one assertion and carries no values) made as precise as the TorchScript module's:
        ``table 'T', feature 'f', sample s: id v is out of range; expected 0 <= id < R``, the first
        such id in lookup order.  Unchanged when it is another message or no input id is out of
        range (e.g. an expanded multi-hot id)."""
        msg = super().input_message(model, err, values, lengths, batch)
        if not msg.startswith("an id is out of range; expected 0 <= id < rows of its table"):
            return msg
        rows = {t["name"]: int(t["num_embeddings"]) for t in model.manifest["tables"]}
        names = model.feature_names
        ln = lengths.detach().cpu()
        vals = values.detach().cpu()
        ends = torch.cumsum(ln.view(len(names), batch).sum(1), 0)
        for lk in model.manifest["lookups"]:
            f, table = names.index(lk["feature"]), lk["table"]
            start = int(ends[f - 1]) if f else 0
            seg = vals[start: int(ends[f])]
            bad = torch.nonzero((seg < 0) | (seg >= rows[table]))
            if bad.numel():
                i = int(bad[0])
                sample = int(torch.searchsorted(torch.cumsum(ln[f * batch:(f + 1) * batch], 0), torch.tensor([i]),
                                                right=True)[0])
                return (f"table '{table}', feature '{lk['feature']}', sample {sample}: id {int(seg[i])} is out of "
                        f"range; expected 0 <= id < {rows[table]}")
        return msg


def qtable_bytes(q: Any) -> int:
    """Bytes a quantized table (:class:`~dlrmctl.inference.quantize.QuantizedTable`) takes in the
    program, unpadded (codes + scale/bias: float32 for int8, fp16 for int4)."""
    n = q.data.numel() * q.data.element_size()
    return n + q.num_embeddings * {"int8": 8, "int4": 4}.get(q.dtype, 0)


def multi_hot_tables(multi_hot: dict | None, data_meta: dict | None,
                     feature_names: Sequence[str]) -> list | None:
    """Per input feature ``(rows, offsets [1024, size-1])`` of the loader's multi-hot expansion
    (same rows, seed and distribution as :class:`dlrmctl.data.loader.BatchLoader`), or None.

    Raises:
        ExportError: a multi-hot feature missing from the data meta's sparse features.
    """
    sizes = (multi_hot or {}).get("multi_hot_sizes") or {}
    if not any(int(v) > 1 for v in sizes.values()):
        return None
    from dlrmctl.data.multi_hot import multi_hot_offsets

    sparse = list((data_meta or {}).get("sparse_features") or [])
    names = [f["name"] for f in sparse]
    out: list = []
    for f in feature_names:
        size = int(sizes.get(f, 1))
        if size <= 1:
            out.append(None)
            continue
        if f not in names:
            raise ExportError(f"multi-hot feature '{f}' is not in the data meta's sparse features {names}")
        rows = int(sparse[names.index(f)]["num_embeddings"])
        seed = int(multi_hot.get("multi_hot_seed", 0)) + names.index(f)
        off = multi_hot_offsets(rows, size, multi_hot.get("multi_hot_distribution", "uniform"), seed)
        out.append((rows, torch.from_numpy(off)))
    return out
