"""The DCP storage writer and reader of the ``dcp-v2`` files: the writer checksums each rank's
file while DCP writes it (and finds each tensor's raw bytes in torch.save's zip records); the
reader verifies exactly the blocks it reads and never unpickles data."""

from __future__ import annotations

import bisect
import io
import math
import os
import sys
import zlib
from typing import Any

import torch

from dlrmctl.train.checkpoint import format as fmt  # (a module: tests patch its sizes)
from dlrmctl.train.checkpoint.codec import SafeUnpickler
from dlrmctl.train.checkpoint.format import CheckpointError
from dlrmctl.train.checkpoint.integrity import block_bytes_for, CheckedFile, crcs_to_text


def _zip_name_len(h: bytes | bytearray) -> int:
    """File-name length of a zip local file header."""
    return int.from_bytes(h[26:28], "little")


class _ChecksumStream:
    """Write-side wrapper of a DCP output file: CRC-32 of every ``block_bytes`` block of what is
    written (from the bytes in memory: the file is never read back) and, for each tensor DCP
    serialises with ``torch.save``, where its raw bytes lie in the file.

    ``torch.save`` writes a zip archive with stored (uncompressed) records, each as a local
    header (30 bytes), the name, an extra field, the data and a data descriptor, in separate
    writes; the record ``<archive>/data/0`` holds the tensor's storage (row-major: the planner
    saves contiguous tensors).  ``tensor_data`` lists ``(start, end)`` file offsets of each such
    record's data whose descriptor confirms its length; anything else is left out (its item is
    then read whole).
    """

    def __init__(self, raw: Any, block_bytes: int) -> None:
        self.raw, self.block_bytes = raw, block_bytes
        self.pos = 0
        self.crcs: list[int] = []
        self._crc, self._fill = 0, 0
        self.tensor_data: list[tuple[int, int]] = []
        self._hdr: bytearray | None = None
        self._hdr_at = 0
        self._data_at: int | None = None
        self.finished = False

    # zip record tracking (see the class docstring)
    def _track(self, mv: memoryview) -> None:
        n = len(mv)
        if self._data_at is not None and n in (16, 24) and mv[:4] == b"PK\x07\x08":
            if n == 16:
                comp, size = int.from_bytes(mv[8:12], "little"), int.from_bytes(mv[12:16], "little")
            else:
                comp, size = int.from_bytes(mv[8:16], "little"), int.from_bytes(mv[16:24], "little")
            if comp == size == self.pos - self._data_at:
                self.tensor_data.append((self._data_at, self.pos))
            self._data_at = None
            return
        if n >= 4 and mv[:4] == b"PK\x03\x04":
            self._hdr, self._hdr_at, self._data_at = bytearray(), self.pos, None
        if self._hdr is None:
            return

        def name_len() -> int:
            return _zip_name_len(self._hdr)

        # the header and the name, over one or several writes
        take = mv[: max(0, (30 if len(self._hdr) < 30 else 30 + name_len()) - len(self._hdr))]
        self._hdr += take
        if len(self._hdr) == 30 and len(take) < n:
            self._hdr += mv[len(take): len(take) + name_len()]
        if len(self._hdr) >= 30 and len(self._hdr) == 30 + name_len():
            h, self._hdr = self._hdr, None
            nl, extra_len, method = _zip_name_len(h), int.from_bytes(h[28:30], "little"), int.from_bytes(h[8:10], "little")
            if method == 0 and bytes(h[30:30 + nl]).endswith(b"/data/0"):
                self._data_at = self._hdr_at + 30 + nl + extra_len

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._track(mv)
        self.raw.write(mv)
        i, B = 0, self.block_bytes
        while i < n:
            take = min(B - self._fill, n - i)
            self._crc = zlib.crc32(mv[i:i + take], self._crc)
            self._fill += take
            i += take
            if self._fill == B:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        self.raw.flush()  # DCP fsyncs fileno(): the buffered bytes must be in the file first
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            if self._fill:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.raw.close()

    def digest(self) -> dict[str, Any]:
        """``{"bytes", "block_bytes", "crc32"}``: size, block size and the blocks' CRC-32s (base64 of
        little-endian uint32)."""
        return {"bytes": self.pos, "block_bytes": self.block_bytes, "crc32": crcs_to_text(self.crcs)}


def dcp_writer(path: str):
    """A DCP ``FileSystemWriter`` (one file per rank, fsynced) whose files are checksummed while they
    are written; after ``dcp.save``, ``writer.files`` holds this rank's ``{file: digest}`` (the
    coordinator's includes ``.metadata``), each data file's digest with ``tensors``: ``{item offset:
    offset of the tensor's raw bytes within the item}``."""
    import contextlib
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.planner import WriteItemType

    def _nbytes(item: Any) -> int:
        td = item.tensor_data
        return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)

    class ChecksumFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.streams: dict[str, _ChecksumStream] = {}
            self.block_bytes = fmt.BLOCK_BYTES

        @contextlib.contextmanager
        def create_stream(self, path, mode):  # type: ignore[override]
            if "w" not in mode:
                with super().create_stream(path, mode) as f:
                    yield f
                return
            name = Path(path).name
            with open(path, mode) as f:
                st = _ChecksumStream(f, self.block_bytes)
                self.streams[name.removesuffix(".tmp")] = st  # .metadata is written as .metadata.tmp, then renamed
                try:
                    yield st
                finally:
                    st.close()

    class ChecksumWriter(dcp.FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = ChecksumFileSystem()
            self.path = self.fs.init_path(path)
            self.files: dict[str, dict[str, Any]] = {}

        def write_data(self, plan, planner):  # type: ignore[override]
            # one file per rank: its size is about the items' bytes (+ ~1 KiB of torch.save framing each)
            est = sum(_nbytes(it) + 1024 for it in plan.items if it.tensor_data is not None)
            self.fs.block_bytes = block_bytes_for(est)
            fut = super().write_data(plan, planner)
            items = {it.index: it for it in plan.items}
            for wr in fut.wait():
                sd = wr.storage_data
                st = self.fs.streams[sd.relative_path]
                d = self.files.setdefault(sd.relative_path, {**st.digest(), "tensors": {}})
                item = items.get(wr.index)
                if item is None or item.type == WriteItemType.BYTE_IO or sd.transform_descriptors:
                    continue
                # the first tensor record starting inside this item (records are in file order)
                i = bisect.bisect_left(st.tensor_data, (sd.offset, -1))
                if i < len(st.tensor_data):
                    a, e = st.tensor_data[i]
                    if e <= sd.offset + sd.length and e - a == _nbytes(item):
                        d["tensors"][str(sd.offset)] = a - sd.offset
            return fut

        def finish(self, metadata, results) -> None:  # type: ignore[override]
            self.fs.block_bytes = fmt.BLOCK_BYTES  # .metadata is always read whole
            super().finish(metadata, results)
            self.files[".metadata"] = self.fs.streams[".metadata"].digest()

    return ChecksumWriter()


def dcp_reader(ckpt_dir: str, meta: dict[str, Any], counter: dict[str, int] | None = None, metadata: Any = None):
    """A DCP ``FileSystemReader`` that verifies exactly what it reads and never unpickles data.

    ``.metadata``: read once, checked against its block CRCs, loaded with :class:`SafeUnpickler`.
    Data: for each ``ReadItem`` (the part of one saved chunk that overlaps a requested block) it
    reads only the rows ``[storage_offsets[0], + lengths[0])`` of the chunk's raw bytes (the
    ``tensors`` offsets in meta.json), rounded out to whole ``block_bytes`` blocks, checks those
    blocks' CRC-32s, and copies the overlap into the target; a tensor whose raw offset is unknown
    is read whole and loaded with ``torch.load(weights_only=True)``.  Pickled (``BYTE_IO``) items
    are refused.  ``counter["bytes_read"]`` adds up the bytes read from the checkpoint's files.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    counter = {} if counter is None else counter
    if meta.get("byteorder", "little") != sys.byteorder:
        raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: written on a {meta.get('byteorder')}-endian "
                              f"machine; this one is {sys.byteorder}-endian")

    class VerifyingReader(dcp.FileSystemReader):
        def __init__(self) -> None:
            super().__init__(ckpt_dir)
            self.counter = counter
            self._md: Any = metadata

        def read_metadata(self, *args: Any, **kwargs: Any):  # type: ignore[override]
            if self._md is None:
                with CheckedFile(ckpt_dir, ".metadata", meta, counter) as f:
                    raw = f.read(0, f.size, "DCP metadata")
                p = os.path.join(ckpt_dir, ".metadata")
                try:
                    md = SafeUnpickler(io.BytesIO(raw.numpy().tobytes())).load()
                except Exception as e:
                    raise CheckpointError(f"{p}: cannot be read ({type(e).__name__}: {e})") from e
                if not isinstance(md, Metadata):
                    raise CheckpointError(f"{p}: holds a {type(md).__name__}, not DCP Metadata")
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                self._md = md
            self._md.storage_meta.load_id = self.load_id
            return self._md

        def read_data(self, plan, planner):  # type: ignore[override]
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            try:
                for rel, reqs in per_file.items():
                    reqs.sort(key=lambda r: (self.storage_data[r.storage_index].offset, tuple(r.storage_offsets)))
                    with CheckedFile(ckpt_dir, rel, meta, counter) as f:
                        for req in reqs:
                            self._read_item(f, req, planner, LoadItemType)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{ckpt_dir}: reading the data files failed ({type(e).__name__}: {e})") from e
            fut: Any = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _read_item(self, f: CheckedFile, req: Any, planner: Any, LoadItemType: Any) -> None:
            fqn = req.storage_index.fqn
            sinfo = self.storage_data[req.storage_index]
            what = f"'{fqn}' chunk at {list(req.storage_index.offset or [])}"
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{f.path}: {what} is a pickled object; dlrmctl does not unpickle checkpoint data")
            if sinfo.transform_descriptors:
                raise CheckpointError(f"{f.path}: {what} uses DCP stream transforms {sinfo.transform_descriptors}")
            tmd = self.read_metadata().state_dict_metadata[fqn]
            off = tuple(req.storage_index.offset or ())
            chunk = next((c for c in tmd.chunks if tuple(c.offsets) == off), None)
            data_at = f.tensors.get(str(sinfo.offset))
            if chunk is None or data_at is None:  # read the item whole (weights_only: no code runs)
                raw = f.read(sinfo.offset, sinfo.offset + sinfo.length, what)
                t = torch.load(io.BytesIO(raw.numpy().tobytes()), map_location="cpu", weights_only=True)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    t = t.narrow(d, o, n)
            else:
                shape, dtype = list(chunk.sizes), tmd.properties.dtype
                if not shape:
                    r0, nr, row = 0, 1, torch._utils._element_size(dtype)
                else:
                    r0, nr = int(req.storage_offsets[0]), int(req.lengths[0])
                    row = math.prod(shape[1:]) * torch._utils._element_size(dtype)
                full = math.prod(shape) * torch._utils._element_size(dtype)
                if data_at + full > sinfo.length:  # meta.json's raw offset points past the item: damaged
                    raise CheckpointError(
                        f"{f.path}: {what}: meta.json puts its {full} raw bytes at offset {data_at} of an item of "
                        f"{sinfo.length} bytes: {os.path.join(os.path.dirname(f.path), 'meta.json')} is corrupted")
                base = sinfo.offset + data_at
                target = planner.resolve_tensor(req).detach()
                want = [nr, *(int(n) for n in req.lengths[1:])] if shape else []
                if list(target.size()) != want:
                    raise CheckpointError(f"{f.path}: {what}: reads {want}, expected {list(target.size())}")
                # row slabs of <= READ_SLAB_BYTES: a table is never held twice (read buffer + target)
                slab = max(1, fmt.READ_SLAB_BYTES // max(row, 1)) if shape else 1
                for s in range(0, nr, slab):
                    k = min(slab, nr - s)
                    raw = f.read(base + (r0 + s) * row, base + (r0 + s + k) * row, what)
                    t = raw.view(dtype).reshape([k, *shape[1:]] if shape else [])
                    for d in range(1, len(shape)):
                        t = t.narrow(d, int(req.storage_offsets[d]), int(req.lengths[d]))
                    (target.narrow(0, s, k) if shape else target).copy_(t)
                planner.commit_tensor(req, target)
                return
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise CheckpointError(f"{f.path}: {what}: read {list(t.size())}, expected {list(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)

    return VerifyingReader()


