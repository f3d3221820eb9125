"""Block CRC-32s of the checkpoint files: their text form in meta.json, the verifying range
reader :class:`CheckedFile` and the file-table checks (what
:func:`dlrmctl.train.checkpoint.store.check_integrity`, ``dlrmctl checkpoint inspect``, runs)."""

from __future__ import annotations

import base64
import json
import os
import sys
import zlib
from array import array
from typing import Any, Sequence

import torch

from dlrmctl.train.checkpoint import format as fmt  # (a module: tests patch its sizes)
from dlrmctl.train.checkpoint.codec import b64
from dlrmctl.train.checkpoint.format import BLOCKS_PER_FILE, MIN_BLOCK_BYTES, CheckpointError


# ------------------------------------------------------ checksummed I/O
def _block_count(nbytes: int, block_bytes: int) -> int:
    return (nbytes + block_bytes - 1) // block_bytes


def crcs_to_text(crcs: Sequence[int]) -> str:
    a = array("I", crcs)
    if sys.byteorder != "little":
        a.byteswap()
    return b64(a.tobytes())


def crcs_from_text(text: str) -> array:
    a = array("I")
    a.frombytes(base64.b64decode(text, validate=True))
    if sys.byteorder != "little":
        a.byteswap()
    return a


def block_bytes_for(nbytes: int) -> int:
    """Block size for a file of about ``nbytes`` (see :data:`BLOCKS_PER_FILE`)."""
    want = max(1, -(-nbytes // BLOCKS_PER_FILE))
    return min(fmt.BLOCK_BYTES, max(MIN_BLOCK_BYTES, 1 << (want - 1).bit_length()))


class CheckedFile:
    """Reads byte ranges of one checkpoint file, verifying every block they overlap against the
    block CRC-32s in meta.json; counts the bytes read (``counter["bytes_read"]``)."""

    def __init__(self, ckpt_dir: str, fname: str, meta: dict[str, Any], counter: dict[str, int]) -> None:
        self.path = p = os.path.join(ckpt_dir, fname)
        exp = meta["files"].get(fname)
        if exp is None:
            raise CheckpointError(f"{p}: not listed in {os.path.join(ckpt_dir, 'meta.json')}")
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: missing (meta.json lists it with {exp['bytes']} bytes)")
        self.size = os.path.getsize(p)
        if self.size != exp["bytes"]:
            raise CheckpointError(f"{p}: {self.size} bytes, expected {exp['bytes']}: the file is truncated or corrupted")
        self.block_bytes = int(exp["block_bytes"])
        try:
            self.crcs = crcs_from_text(exp["crc32"])
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: damaged checksums of {fname} ({e})") from e
        if len(self.crcs) != _block_count(self.size, self.block_bytes):
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'meta.json')}: {len(self.crcs)} block checksums for {fname}, "
                                  f"expected {_block_count(self.size, self.block_bytes)}")
        self.tensors: dict[str, int] = exp.get("tensors", {})
        self.counter = counter
        self._f: Any = None

    def __enter__(self) -> "CheckedFile":
        self._f = open(self.path, "rb")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def read(self, start: int, end: int, what: str = "") -> torch.Tensor:
        """Bytes ``[start, end)`` of the file as a 1-D ``uint8`` tensor whose first byte is 64-byte
        aligned (so ``.view(dtype)`` is aligned), after checking the CRC-32 of every block they overlap.

        Raises:
            CheckpointError: the range is outside the file, the file is shorter than recorded, or a
                block's CRC differs (names the file, the byte range of the block and ``what``).
        """
        if start == end:
            return torch.empty(0, dtype=torch.uint8)
        if not 0 <= start < end <= self.size:
            raise CheckpointError(f"{self.path}: {what} at bytes {start}-{end} lies outside the file ({self.size} bytes)")
        B = self.block_bytes
        b0, b1 = start // B, _block_count(end, B)
        lo, hi = b0 * B, min(b1 * B, self.size)
        pad = -(start - lo) % 64
        buf = torch.empty(pad + hi - lo, dtype=torch.uint8)
        mv = memoryview(buf.numpy())[pad:]
        self._f.seek(lo)
        n = self._f.readinto(mv)
        self.counter["bytes_read"] = self.counter.get("bytes_read", 0) + n
        if n != hi - lo:
            raise CheckpointError(f"{self.path}: ended at byte {lo + n}, expected {self.size}: the file is truncated")
        for i in range(b0, b1):
            s, e = (i - b0) * B, min((i - b0 + 1) * B, hi - lo)
            got = zlib.crc32(mv[s:e])
            if got != self.crcs[i]:
                raise CheckpointError(
                    f"{self.path}: bytes {lo + s}-{lo + e} (block {i} of {len(self.crcs)}{', ' + what if what else ''}): "
                    f"CRC-32 {got:#010x}, expected {self.crcs[i]:#010x}: the file is corrupted")
        return buf[pad + start - lo: pad + end - lo]


def files_crc(files: dict[str, Any]) -> int:
    """CRC-32 of meta.json's ``files`` table as canonical JSON: the reader trusts the sizes, block
    checksums and raw data offsets it holds, so they are checked themselves (``files_crc32``)."""
    return zlib.crc32(json.dumps(files, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def check_files_entry(p: str, files: Any) -> None:
    """Check the shape of meta.json's ``files`` (what the verifying reader trusts): a dict of file name ->
    ``{"bytes": int >= 0, "block_bytes": int >= 1, "crc32": str, "tensors"?: {str: int >= 0}}``.

    Raises:
        CheckpointError: naming ``p``, the file entry and the field that is missing or of another type.
    """
    def nat(v: Any, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{p}: corrupted ('files' must map each checkpoint file, .metadata included, "
                              f"to its size and checksums; got {type(files).__name__})")
    for name, e in files.items():
        bad = None
        if not isinstance(e, dict):
            bad = f"a JSON {type(e).__name__}, expected an object"
        elif not nat(e.get("bytes"), 0):
            bad = f"'bytes' is {e.get('bytes')!r}, expected an integer >= 0"
        elif not nat(e.get("block_bytes"), 1):
            bad = f"'block_bytes' is {e.get('block_bytes')!r}, expected an integer >= 1"
        elif not isinstance(e.get("crc32"), str):
            bad = f"'crc32' is a {type(e.get('crc32')).__name__}, expected base64 text"
        elif "tensors" in e and not (isinstance(e["tensors"], dict)
                                     and all(isinstance(k, str) and nat(v, 0) for k, v in e["tensors"].items())):
            bad = "'tensors' must map item offsets (text) to raw data offsets (integers >= 0)"
        if bad:
            raise CheckpointError(f"{p}: corrupted entry for file {name!r}: {bad}")


