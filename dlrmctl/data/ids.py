"""Raw 64-bit ids: one stable hash of a categorical value, the same in preprocess, training, export,
predict and serve, on every machine.

A categorical value (a string such as ``"a9f3c2"`` or ``"user_17"``, or an integer) becomes a raw id
without any vocabulary pass:

    raw_id(v) = FNV-1a-64(UTF-8 bytes of the canonical text of v)  &  (2**63 - 1)

- The canonical text of a string is the string itself; of an integer, its decimal form (``17`` and
  ``"17"`` are the same id, so a Parquet integer column and the same column read from CSV agree).
- FNV-1a-64: offset basis ``0xcbf29ce484222325``, prime ``0x100000001b3``; for each byte ``b``:
  ``h = (h XOR b) * prime mod 2**64`` (Fowler, Noll, Vo; IETF draft-eastlake-fnv, section 2).
- The top bit is cleared so every id is a non-negative int64 (``KeyedJaggedTensor`` values are
  int64 and negative ids are invalid there).  A hash that comes out 0 is mapped to 1.
- A missing value (null, or the empty string) is :data:`MISSING_RAW_ID` (0), which no present
  value maps to.

The hash is computed vectorised with numpy over the Arrow string buffers: one pass per byte
position, over the rows that are that long; no Python loop per value.

A table of ``n`` buckets (``hash`` mode) takes ``raw_id % n``; a managed-collision table maps raw
ids to rows itself.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
MISSING_RAW_ID = 0
_MASK63 = np.uint64((1 << 63) - 1)
_SHORT = 32  # values up to this many bytes are hashed as one [n, L] byte matrix


def _as_utf8(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The canonical text of ``values`` as one ``large_string`` array (integers in decimal)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks else pa.array([], pa.large_string())
    t = values.type
    if pa.types.is_dictionary(t):
        values = values.dictionary_decode()
        t = values.type
    if pa.types.is_integer(t):
        values = pc.cast(values, pa.large_string())
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        values = pc.cast(values, pa.large_string())
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        values = pc.cast(values, pa.large_binary()).view(pa.large_string())
    elif pa.types.is_null(t):
        values = pa.nulls(len(values), pa.large_string())
    else:
        raise TypeError(f"raw ids are made from strings or integers, got Arrow type {t}")
    return values


def raw_ids(values: pa.Array | pa.ChunkedArray | np.ndarray | list) -> np.ndarray:
    """Raw 64-bit ids of categorical values (the formula in this module's docstring).

    Args:
        values: ``[n]`` strings or integers: an Arrow (chunked) array of a string, binary, integer
            or dictionary type, a numpy array, or a list; nulls and empty strings are missing.

    Returns:
        ``[n]`` int64 in ``[0, 2**63)``; missing values are :data:`MISSING_RAW_ID` (0), present
        ones are ``>= 1``.

    Raises:
        TypeError: the values are neither strings nor integers (e.g. floats).
    """
    if not isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = pa.array(values)
    arr = _as_utf8(values)
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=arr.offset + n + 1)[arr.offset :]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size else np.zeros(0, np.uint8)
    )
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    h = np.full(n, FNV64_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV64_PRIME)
    short = lengths <= _SHORT
    if short.any():  # the common case: one gather of an [n, L] byte matrix, then L whole-column steps
        rows = np.flatnonzero(short) if not short.all() else None
        st, ln = (starts, lengths) if rows is None else (starts[rows], lengths[rows])
        width = int(ln.max(initial=0))
        if width:
            pos = np.arange(width, dtype=np.int64)
            cols = np.asfortranarray(data[np.minimum(st[:, None] + pos, max(len(data) - 1, 0))]) if len(data) else None
            hs = np.full(len(st), FNV64_OFFSET, dtype=np.uint64)
            same = bool((ln == width).all())  # e.g. fixed-width hex ids: no per-row length mask
            with np.errstate(over="ignore"):
                for j in range(width):
                    stepped = (hs ^ cols[:, j].astype(np.uint64)) * prime
                    hs = stepped if same else np.where(ln > j, stepped, hs)
            if rows is None:
                h = hs
            else:
                h[rows] = hs
    active = np.nonzero(lengths > _SHORT)[0]
    j = 0
    with np.errstate(over="ignore"):
        while active.size:
            b = data[starts[active] + j].astype(np.uint64)
            h[active] = (h[active] ^ b) * prime
            j += 1
            active = active[lengths[active] > j]
    out = (h & _MASK63).astype(np.int64)
    out[out == 0] = 1
    missing = lengths == 0
    if arr.null_count:
        missing |= ~np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    out[missing] = MISSING_RAW_ID
    return out


def raw_id_of(value: str | int | None) -> int:
    """The raw id of one value (:func:`raw_ids` of a one-element list); for docs, tests and debugging."""
    return int(raw_ids([value])[0])


def hash_buckets(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """Bucket of each raw id for a ``hash`` table of ``num_buckets`` rows: ``raw_id % num_buckets``.

    Args:
        ids: ``[n]`` int64 raw ids from :func:`raw_ids` (non-negative).
        num_buckets: rows of the table, ``>= 1``.

    Returns:
        ``[n]`` int64 in ``[0, num_buckets)``.

    Raises:
        ValueError: ``num_buckets < 1``.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    return np.remainder(ids, np.int64(num_buckets))
