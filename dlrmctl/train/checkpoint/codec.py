"""What DCP is given and what comes back without unpickling: :class:`Blocks` (a sharded tensor's
local blocks), the planners over a flat state dict, :func:`pack` / :func:`unpack` (non-tensor
entries as JSON in a ``uint8`` tensor) and the unpickler of DCP's ``.metadata``."""

from __future__ import annotations

import base64
import json
import pickle
from typing import Any, Sequence

import numpy as np
import torch

from dlrmctl.train.checkpoint.format import CheckpointError


# --------------------------------------------------------------- blocks
class Blocks:
    """A tensor of global shape ``size`` of which this process holds some blocks.

    Args:
        size: global shape, e.g. ``[rows, dim]`` of a table or ``[rows]`` of a row-wise moment.
        blocks: ``(offsets, tensor)`` pairs; ``tensor`` is the block at ``offsets`` (same
            number of dims as ``size``).  On save they are read; on load they are filled in
            place (live views of the model's weights load directly into the model).

    Empty blocks are dropped.  DCP uses :meth:`__create_write_items__` /
    :meth:`__create_chunk_list__` (its ``_Checkpointable`` hooks) and the planners below.
    """

    def __init__(self, size: Sequence[int], blocks: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:
        self._size = torch.Size(size)
        self.blocks = [(torch.Size(o), t) for o, t in blocks if t.numel() > 0]
        for o, t in self.blocks:
            if len(o) != len(self._size) or t.dim() != len(self._size) or any(
                a + b > s for a, b, s in zip(o, t.shape, self._size)
            ):
                raise ValueError(f"block {tuple(t.shape)} at {tuple(o)} does not fit in {tuple(self._size)}")

    def size(self) -> torch.Size:
        return self._size

    def __repr__(self) -> str:
        return f"Blocks({list(self._size)}, {[(list(o), list(t.shape)) for o, t in self.blocks]})"

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.blocks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t.detach()),
                    size=self._size,
                ),
            )
            for o, t in self.blocks
        ]

    def block_at(self, offsets: Sequence[int]) -> torch.Tensor:
        o = torch.Size(offsets)
        for bo, t in self.blocks:
            if bo == o:
                return t.detach()
        raise KeyError(f"no block at {list(o)}")


def _find(state: dict[str, Any], index: Any) -> Any:
    obj = state[index.fqn]
    if isinstance(obj, Blocks):
        return obj.block_at(index.offset)
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    return obj


def dcp_planners():
    """``(SavePlanner, LoadPlanner)``: DCP's default planners, made to keep tensors as they are (the
    classes built on first use: torch.distributed.checkpoint imports late)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        """DefaultSavePlanner over a flat state dict that may hold :class:`Blocks`."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index):  # type: ignore[override]
            # row-major bytes: the reader reads a row range of a saved chunk without loading all of it
            obj = _find(self.state_dict, index)
            return obj.contiguous() if isinstance(obj, torch.Tensor) else obj

    class LoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner filling :class:`Blocks` in place."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # type: ignore[override]
            # the default one first runs _init_state_dict, which replaces unknown objects (Blocks) by None;
            # nothing here lives on the meta device, so it has nothing to do
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index):  # type: ignore[override]
            return _find(self.state_dict, index)

        def load_bytes(self, read_item, value):  # type: ignore[override]
            # DCP would torch.load(weights_only=False) it: unpickling, which can run code
            raise CheckpointError(f"entry '{read_item.dest_index.fqn}' is a pickled object; dlrmctl does not unpickle")

    return SavePlanner, LoadPlanner


_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__")


def b64(raw: bytes) -> str:
    """``raw`` as ASCII base64 (the JSON form of tensors, arrays and block checksums)."""
    return base64.b64encode(raw).decode("ascii")


def _encode(obj: Any, where: str) -> Any:
    """``obj`` as plain JSON values; tuples, non-string-keyed dicts, tensors and numeric numpy
    arrays become one-key tagged objects (see :func:`pack`)."""
    if obj is None or isinstance(obj, (bool, str, float)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return _encode(obj.item(), where)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": b64(raw)}}
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        # tobytes() is C order for any layout; obj.shape, not np.ascontiguousarray's (which makes 0-d 1-d)
        return {"__ndarray__": {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": b64(obj.tobytes(order="C"))}}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: _encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__dict__": [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"checkpoint entry {where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored "
                    "(JSON values only: None, bool, int, float, str, list, tuple, dict, tensors, numeric numpy arrays)")


def _decode(x: Any) -> Any:
    """Inverse of :func:`_encode`: builds only JSON values, tuples, dicts, tensors and numpy arrays."""
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, v), = x.items()
        if tag == "__tuple__":
            return tuple(_decode(e) for e in v)
        if tag == "__dict__":
            return {_decode(k): _decode(e) for k, e in v}
        if tag == "__tensor__":
            dtype = getattr(torch, str(v["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown tensor dtype {v['dtype']!r}")
            raw = base64.b64decode(v["data"], validate=True)
            if not raw:
                return torch.empty(v["shape"], dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(v["shape"])
        if tag == "__ndarray__":
            dt = np.dtype(str(v["dtype"]))
            if dt.kind not in "biufc":
                raise ValueError(f"numpy dtype {v['dtype']!r} is not numeric")
            return np.frombuffer(base64.b64decode(v["data"], validate=True), dtype=dt).reshape(v["shape"]).copy()
    return {k: _decode(e) for k, e in x.items()}


def pack(obj: Any, where: str = "object") -> torch.Tensor:
    """A non-tensor entry (trainer state, optimizer hyper-parameters, RNG states, data position) as a
    1-D ``uint8`` tensor of UTF-8 JSON: DCP stores it like any tensor, and loading it never unpickles.

    JSON plus one-key tags: ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (keys that
    are not strings), ``{"__tensor__": {dtype, shape, data}}`` and ``{"__ndarray__": {dtype, shape,
    data}}`` (``data``: base64 of the little-/native-endian bytes).  Floats round-trip exactly
    (``repr``), ``nan`` / ``inf`` included; numpy scalars become Python numbers.

    Raises:
        TypeError: a value of another type (names where in ``obj``, prefixed by ``where``).
    """
    text = json.dumps(_encode(obj, where), separators=(",", ":"), allow_nan=True)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def unpack(t: Any, where: str = "checkpoint entry") -> Any:
    """Inverse of :func:`pack` (``t``: the loaded ``uint8`` tensor).

    Raises:
        CheckpointError: ``t`` is not a packed entry (e.g. pickled bytes of an older format) or
            its JSON is damaged.
    """
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        raise CheckpointError(f"{where}: expected a packed JSON entry (1-D uint8 tensor), got {type(t).__name__}; "
                              "pickled entries (format dcp-v1) are not loaded")
    try:
        return _decode(json.loads(t.numpy().tobytes().decode("utf-8")))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: damaged JSON entry ({type(e).__name__}: {e})") from e

class SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` only: globals are limited to DCP's metadata classes, torch
    dtypes / ``Size`` / layouts and paths, so a crafted file cannot call anything else."""

    ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not one of DCP's metadata classes")


