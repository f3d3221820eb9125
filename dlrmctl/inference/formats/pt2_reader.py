"""A direct reader of the ``.pt2`` archives ``dlrmctl export`` writes: the program's flat graph and
its weights, without ``torch.export.load``.

``torch.export.load`` imports its whole deserializer first (``torch._export.serde.serialize``,
which imports ``torch._dynamo``, sympy and the decompositions: about 4 s of ``predict``'s start-up
on the 2-core development VM, more than TorchScript's whole load) and rebuilds every node's
symbolic shape; running the graph needs neither.  :func:`read_program` reads the same archive
(a standard ``torch.export.save`` file: ``archive/models/model.json``, the weights' raw bytes and
their ``model_weights_config.json``) into the same FX graph, node for node (the names, targets,
positional and keyword arguments that ``torch.export.load``'s ``GraphModuleDeserializer`` gives),
and the same tensors (dtype, shape, strides, storage offset, bytes).

It reads only what dlrmctl's programs use: ATen / ``quantized`` operator calls with one tensor,
int or no output; tensors, scalars, lists, devices and dtypes as arguments; raw (unpickled) CPU
weights and tensor constants; inputs that are parameters, buffers, tensor constants or user
inputs; outputs that are user outputs.  Anything else (an archive of another schema major or of
a newer minor than the one tested, a node or tensor record with a key it does not know, a
higher-order operator, a pickled tensor, a buffer mutation, entries of two dtypes in one stored
file, ...) raises :class:`NotReadable`, as does any error while reading (a damaged archive), and
the caller falls back to ``torch.export.load``.  ``tests/inference/test_pt2_reader.py`` checks the
graph and tensors against ``torch.export.load``'s, and the scores bit for bit.
"""

from __future__ import annotations

import json
import keyword
import operator
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["NotReadable", "ProgramParts", "read_program"]

#: The ``torch.export`` serialization schema major this reader follows (``model.json``'s
#: ``schema_version.major``; torch 2.13 writes 8.20).  Another major is read by torch.
SCHEMA_MAJOR = 8
#: The newest minor of :data:`SCHEMA_MAJOR` the reader was tested against (torch 2.13's).  A newer
#: minor may add a field with a meaning: read by torch.  Older minors are read (their records hold
#: a subset of these keys; an unknown key is refused wherever it appears below).
SCHEMA_MINOR = 20
#: The keys of a graph node, a weights-config entry and its ``tensor_meta`` at minor 20: any other
#: key is a field this reader does not know the meaning of.
_NODE_KEYS = frozenset({"target", "inputs", "outputs", "metadata", "is_hop_single_tensor_return", "name"})
_ENTRY_KEYS = frozenset({"path_name", "is_param", "use_pickle", "tensor_meta"})
_TENSOR_META_KEYS = frozenset({"dtype", "sizes", "requires_grad", "device", "strides", "storage_offset", "layout"})

#: ``ScalarType`` codes of ``torch._export.serde.schema`` -> dtype (the serde schema's own
#: enumeration, which is not c10's ``ScalarType`` numbering: 7 is FLOAT there, 6 in c10).
_DTYPES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
           7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16}
#: ``Layout`` and ``MemoryFormat`` codes of the same schema that dlrmctl's programs can hold.
_LAYOUTS = {7: torch.strided}
_MEMORY_FORMATS = {1: torch.contiguous_format, 4: torch.preserve_format}
#: Python operators on sizes (``_operator.mul`` ...): called with positional arguments.
_SYM_OPS = {"mul", "add", "sub", "floordiv", "mod", "eq", "ne", "le", "ge", "lt", "gt", "neg"}


class NotReadable(Exception):
    """The archive uses a part of the ``.pt2`` format :func:`read_program` does not read (the
    message says which); ``torch.export.load`` reads it instead."""


@dataclass
class ProgramParts:
    """A program as :class:`~dlrmctl.inference.formats.pt2.GraphRunner` runs it.

    Attributes:
        graph_module: the flat graph; its placeholders are the state inputs, then the user inputs.
        names: per state input (signature order) its parameter / buffer / constant name.
        tensors: per state input its tensor (CPU, detached).
        parameter: per state input, True for a parameter.
    """

    graph_module: torch.fx.GraphModule
    names: list[str]
    tensors: list[torch.Tensor]
    parameter: list[bool]


def read_program(path: str | Path) -> ProgramParts:
    """The program of a ``.pt2`` archive holding one exported program (``torch.export.save``).

    Raises:
        NotReadable: the archive holds something this reader does not read (then load it with
            ``torch.export.load``), is not such an archive at all, or reading it failed in any way
            (``zlib.error``, ``EOFError``, ``OSError``, ``RuntimeError`` of torch refusing a view,
            ...: every ``Exception``, with its type in the message), so that ``torch.export.load``
            decides what the file is and which error to give.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            return _read(zf)
    except NotReadable:
        raise
    except Exception as e:
        raise NotReadable(f"{type(e).__name__}: {e}") from None


def _read(zf: zipfile.ZipFile) -> ProgramParts:
    names = zf.namelist()
    root = names[0].split("/", 1)[0] + "/" if names else ""
    if zf.read(root + "archive_format").strip() != b"pt2" or zf.read(root + "byteorder").strip() != b"little":
        raise NotReadable("not a little-endian pt2 archive")
    models = [n for n in names if n.startswith(root + "models/") and n.endswith(".json")]
    if models != [root + "models/model.json"]:
        raise NotReadable(f"models {models}: one program named 'model' expected")
    prog = json.loads(zf.read(models[0]))
    version = prog["schema_version"]
    if int(version["major"]) != SCHEMA_MAJOR or int(version["minor"]) > SCHEMA_MINOR:
        raise NotReadable(f"schema {version['major']}.{version['minor']} (read: {SCHEMA_MAJOR}.0 to "
                          f"{SCHEMA_MAJOR}.{SCHEMA_MINOR})")
    weights = _payloads(zf, root + "data/weights/", "model_weights_config.json")
    constants = _payloads(zf, root + "data/constants/", "model_constants_config.json")
    gm = prog["graph_module"]
    state_names, parameter = [], []
    for spec in gm["signature"]["input_specs"]:
        ((kind, v),) = spec.items()
        if kind == "parameter":
            state_names.append(v["parameter_name"])
        elif kind == "buffer":
            state_names.append(v["buffer_name"])
        elif kind == "tensor_constant":
            state_names.append(v["tensor_constant_name"])
        elif kind != "user_input":
            raise NotReadable(f"input kind {kind}")
        if kind != "user_input":
            parameter.append(kind == "parameter")
    if any(set(spec) != {"user_output"} for spec in gm["signature"]["output_specs"]):
        raise NotReadable("outputs other than user outputs (buffer mutations)")
    tensors = {**weights, **constants}
    graph = _graph(gm["graph"])
    return ProgramParts(torch.fx.GraphModule(torch.nn.Module(), graph), state_names,
                        [tensors[n] for n in state_names], parameter)


def _payloads(zf: zipfile.ZipFile, folder: str, config: str) -> dict[str, torch.Tensor]:
    """``torch.export.save``'s tensor payloads: each stored file read once into a flat tensor of
    its dtype, each entry a view of one (``as_strided``: aliasing kept, as ``torch.export.load``)."""
    entries = json.loads(zf.read(folder + config))["config"]
    flat: dict[str, torch.Tensor] = {}
    out = {}
    for fqn, meta in entries.items():
        tm = meta["tensor_meta"]
        _known_keys(meta, _ENTRY_KEYS, f"{fqn}: entry")
        _known_keys(tm, _TENSOR_META_KEYS, f"{fqn}: tensor_meta")
        if meta["use_pickle"] or tm["device"]["type"] != "cpu" or tm.get("layout", 7) != 7:
            raise NotReadable(f"{fqn}: a pickled, non-CPU or non-strided tensor")
        dtype = _DTYPES.get(tm["dtype"])
        if dtype is None:
            raise NotReadable(f"{fqn}: dtype code {tm['dtype']}")
        sizes = [_int(s) for s in tm["sizes"]]
        if meta["path_name"] not in flat:
            nbytes = zf.getinfo(folder + meta["path_name"]).file_size
            if nbytes == 0:
                base = torch.zeros(sizes, dtype=dtype)
            else:  # read straight into the tensor's memory (one copy, as torch's own reader)
                base = torch.empty(nbytes, dtype=torch.uint8)
                _read_into(zf, folder + meta["path_name"], memoryview(base.numpy()))
                base = base.view(dtype)
            flat[meta["path_name"]] = base
        base = flat[meta["path_name"]]
        if base.dtype != dtype:  # torch.export.load reads each entry with its own dtype: not a view of one base
            raise NotReadable(f"{fqn}: {dtype} in {meta['path_name']}, stored by another entry as {base.dtype}")
        out[fqn] = torch.as_strided(base, sizes, [_int(s) for s in tm["strides"]], _int(tm["storage_offset"]))
    return out


def _known_keys(record: dict, known: frozenset, what: str) -> None:
    """Refuse a record of ``model.json`` or a weights config with a key outside ``known``."""
    unknown = set(record) - known
    if unknown:
        raise NotReadable(f"{what} has keys {sorted(unknown)} this reader does not know")


def _read_into(zf: zipfile.ZipFile, name: str, dest: memoryview, chunk: int = 1 << 24) -> None:
    """The record ``name`` copied into ``dest`` (its size) 16 MiB at a time: a table is held once."""
    with zf.open(name) as f:
        at = 0
        while at < len(dest):
            data = f.read(min(chunk, len(dest) - at))
            if not data:
                raise NotReadable(f"{name}: record shorter than its size")
            dest[at:at + len(data)] = data
            at += len(data)


def _int(sym: dict) -> int:
    """A size, stride or offset stored as ``{"as_int": n}``."""
    if set(sym) != {"as_int"}:
        raise NotReadable(f"symbolic size {sym}")
    return int(sym["as_int"])


class _Builder:
    """One FX graph from ``model.json``'s ``graph`` (the deserializer's naming and argument placement)."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self.nodes: dict[str, torch.fx.Node] = {}

    def value(self, arg: dict) -> Any:
        """One serialized argument as the deserializer's ``deserialize_input`` gives it."""
        ((kind, v),) = arg.items()
        if kind == "as_none":
            return None
        if kind == "as_tensor":
            return self.nodes[v["name"]]
        if kind in ("as_int", "as_bool", "as_string"):
            return v
        if kind == "as_float":
            return float(v)  # "Infinity", "-Infinity" and "NaN" are stored as strings
        if kind in ("as_ints", "as_bools", "as_strings"):
            return list(v)
        if kind == "as_floats":
            return [float(x) for x in v]
        if kind == "as_tensors":
            return [self.nodes[t["name"]] for t in v]
        if kind == "as_optional_tensors":
            return [None if "as_none" in t else self.nodes[t["as_tensor"]["name"]] for t in v]
        if kind in ("as_sym_int", "as_sym_bool"):
            return self.sym(v)
        if kind in ("as_sym_ints", "as_sym_bools"):
            return [self.sym(x) for x in v]
        if kind == "as_device":
            return torch.device(v["type"]) if v.get("index") is None else torch.device(v["type"], v["index"])
        table = {"as_scalar_type": _DTYPES, "as_layout": _LAYOUTS, "as_memory_format": _MEMORY_FORMATS}.get(kind)
        if table is not None and v in table:
            return table[v]
        raise NotReadable(f"argument kind {kind} ({v})")

    def sym(self, v: dict) -> Any:
        ((kind, x),) = v.items()
        if kind == "as_name":
            return self.nodes[x]
        if kind in ("as_int", "as_bool"):
            return x
        raise NotReadable(f"symbolic argument {v}")

    def node(self, n: dict) -> None:
        """A ``call_function`` node of an ATen / quantized overload or a size operator."""
        _known_keys(n, _NODE_KEYS, f"node {n.get('name')!r}")
        if n.get("is_hop_single_tensor_return"):
            raise NotReadable(f"node {n.get('name')!r}: a higher-order operator's return")
        target_name, outputs = n["target"], n["outputs"]
        if target_name.startswith("_operator.") and target_name.split(".", 1)[1] in _SYM_OPS:
            target: Any = getattr(operator, target_name.split(".", 1)[1])
            name = n.get("name") or outputs[0]["as_sym_int"]["as_name"]
            args, kwargs = tuple(self.value(i["arg"]) for i in n["inputs"]), {}
        elif target_name.startswith("torch.ops."):
            target = torch.ops
            for part in target_name.split(".")[2:]:
                target = getattr(target, part, None)
            if not isinstance(target, torch._ops.OpOverload):
                raise NotReadable(f"target {target_name}")
            args, kwargs = self.placed(target, n["inputs"])
            single = len(target._schema.returns) == 1 and isinstance(target._schema.returns[0].real_type,
                                                                     torch.TensorType)
            name = n.get("name") or (outputs[0]["as_tensor"]["name"] if single else None)
        else:
            raise NotReadable(f"target {target_name}")
        node = self.graph.create_node("call_function", target, args, kwargs, name)
        self.outputs(node, target_name, outputs)

    def outputs(self, node: torch.fx.Node, target_name: str, outputs: list) -> None:
        """Name the node's results as the deserializer does: one tensor or size is the node itself;
        several (``embedding_bag``'s four) are one ``getitem`` node each, named after the result
        (a lone ``None`` result, which the deserializer renames, is not read here)."""
        if len(outputs) == 1:
            ((kind, v),) = outputs[0].items()
            if kind == "as_tensor":
                self.nodes[v["name"]] = node
                return
            if kind in ("as_sym_int", "as_sym_bool") and "as_name" in v:
                self.nodes[v["as_name"]] = node
                return
            if kind == "as_tensors":
                outputs = [{"as_tensor": t} for t in v]
        for idx, out in enumerate(outputs):
            ((kind, v),) = out.items()
            if kind not in ("as_tensor", "as_sym_int") or (kind == "as_sym_int" and "as_name" not in v):
                raise NotReadable(f"{target_name}: output {idx} of kind {kind}")
            name = v["name"] if kind == "as_tensor" else v["as_name"]
            self.nodes[name] = self.graph.create_node("call_function", operator.getitem, (node, idx), name=name)
        self.nodes[node.name] = node

    def placed(self, target: Any, inputs: list) -> tuple[tuple, dict]:
        """Arguments in the schema's order: those stored as positional in ``args``, as keyword in
        ``kwargs`` (``ArgumentKind`` 1 / 2; an argument stored without its kind is not read here)."""
        given = {i["name"]: i for i in inputs}
        if len(given) != len(inputs):
            raise NotReadable(f"{target}: an argument given twice")
        args: list = []
        kwargs: dict = {}
        for a in target._schema.arguments:
            i = given.pop(a.name, None)
            if i is None:
                continue
            if i.get("kind") == 1:
                args.append(self.value(i["arg"]))
            elif i.get("kind") == 2 and not keyword.iskeyword(a.name):
                kwargs[a.name] = self.value(i["arg"])
            else:
                raise NotReadable(f"{target}: argument {a.name} of kind {i.get('kind')}")
        if given:
            raise NotReadable(f"{target}: arguments {sorted(given)} not in its schema")
        return tuple(args), kwargs


def _graph(g: dict) -> torch.fx.Graph:
    """The FX graph of ``model.json``'s ``graph_module.graph``."""
    if g.get("custom_obj_values"):
        raise NotReadable("custom objects")
    b = _Builder()
    for inp in g["inputs"]:
        ((kind, v),) = inp.items()
        if kind != "as_tensor":
            raise NotReadable(f"graph input kind {kind}")
        node = b.graph.placeholder(v["name"])
        node.name = v["name"]
        b.nodes[v["name"]] = node
    for n in g["nodes"]:
        b.node(n)
    outs = [b.value(o) for o in g["outputs"]]
    if g.get("is_single_tensor_return"):
        if len(outs) != 1:
            raise NotReadable("a single-tensor return with several outputs")
        b.graph.output(outs[0])
    else:
        b.graph.output(tuple(outs))
    return b.graph

