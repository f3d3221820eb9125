"""Criteo's categorical values: 8 hex digits decoded to 32-bit integers, vectorised (SWAR on one
64-bit word per value), and the raw 64-bit ids of those values (``--raw-ids``).
:mod:`dlrmctl.data.criteo.parse` re-exports :func:`decode_hex8` and :func:`hex_to_uint32`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dlrmctl.data.ids import MISSING_RAW_ID, raw_ids


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)
_U = np.uint64
_HIGH = _U(0x8080808080808080)


def decode_hex8(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``[8k]`` uint8 bytes of ``k`` 8-character hex strings -> (uint64 ``[k]``, bad bool ``[k]``).

    SWAR on one big-endian 64-bit word per string (all steps are per byte, no carries):
    fold upper case to lower (``c |= (c & 0x40) >> 1``), nibble ``n = (c & 0xF) + 9 * (c >> 6 & 1)``,
    validity by re-encoding ``n`` as lowercase ASCII (``'0' + n`` or ``'a' + n - 10``, ``n <= 15``) and
    comparing with the input, then the eight nibbles are packed pairwise into 32 bits.
    Equivalent to ``int(s, 16)`` on ``[0-9a-fA-F]{8}`` (checked exhaustively in the tests).
    """
    v = raw.view(">u8").astype(np.uint64)
    b6 = v & _U(0x4040404040404040)
    v |= b6 >> _U(1)
    n = v & _U(0x0F0F0F0F0F0F0F0F)
    b6 >>= _U(6)
    b6 *= _U(9)
    n += b6
    t = n + _U(0x7676767676767676)
    t &= _HIGH  # n >= 10
    big = (n + _U(0x7070707070707070)) & _HIGH  # n >= 16: not a hex digit
    t >>= _U(7)
    t *= _U(0x27)
    t += n
    t += _U(0x3030303030303030)
    bad = (t != v) | (big != 0)
    x = n
    x |= x >> _U(4)
    x &= _U(0x00FF00FF00FF00FF)
    x |= x >> _U(8)
    x &= _U(0x0000FFFF0000FFFF)
    x |= x >> _U(16)
    x &= _U(0xFFFFFFFF)
    return x, bad


def hex_to_uint32(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Decode a Criteo categorical column.

    Args:
        arr: ``pa.binary()`` (or string) array of ``n`` values, each empty or 8 hex digits.

    Returns:
        ``(h, present, bad)``: ``h`` uint64 ``[n]`` the decoded values (``int(s, 16)``, 0 where
        empty or bad), ``present`` bool ``[n]`` (non-empty), ``bad`` bool ``[n]`` rows whose value
        is not exactly 8 hex digits, or None when there are none.
    """
    n = len(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lens = np.diff(offsets)
    present = lens != 0
    h = np.zeros(n, dtype=np.uint64)
    k = int(np.count_nonzero(present))
    start, end = int(offsets[0]), int(offsets[-1])
    if bool(((lens | 8) == 8).all()):
        raw = data[start:end]
        vals, badv = decode_hex8(raw)
        h[present] = vals
        if not badv.any():
            return h, present, None
        bad = np.zeros(n, dtype=bool)
        bad[present] = badv
        return h, present, bad
    # some values are not 8 characters long: decode the 8-long ones, flag the rest
    ok8 = lens == 8
    bad = present & ~ok8
    if ok8.any():
        idx = offsets[:-1][ok8].astype(np.int64)[:, None] + np.arange(8)
        vals, badv = decode_hex8(np.ascontiguousarray(data[idx]).reshape(-1))
        h[ok8] = vals
        bad[ok8] |= badv
    del k
    return h, present, bad


def raw_ids_of_hex(h: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Raw 64-bit ids of Criteo categorical values (``--raw-ids``).

    The canonical text of a Criteo value is its 8 lowercase hex digits (``f"{int(s, 16):08x}"``,
    so ``68FD1E64`` and ``68fd1e64`` are one value, as in hashing and vocabulary modes); its raw
    id is :func:`dlrmctl.data.ids.raw_ids` of that text (the one FNV-1a-64 hash, no other).  The
    text is rebuilt vectorised as one fixed-width Arrow string buffer (no per-value Python).

    Args:
        h: ``[n]`` uint64/uint32 decoded values (< 2^32).
        present: ``[n]`` bool, False where the field is empty.

    Returns:
        ``[n]`` int64 raw ids; missing fields are :data:`~dlrmctl.data.ids.MISSING_RAW_ID` (0).
    """
    n = len(h)
    nib = (np.asarray(h, dtype=np.uint64)[:, None] >> _NIBBLE_SHIFTS[None, :]) & np.uint64(0xF)
    data = _HEX_DIGITS[nib.astype(np.intp)].reshape(-1)
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int64)
    text = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
    ids = raw_ids(text)
    ids[~np.asarray(present, dtype=bool)] = MISSING_RAW_ID
    return ids
