"""A vocabulary's keys -> ids for ``preprocess logs``, ``predict`` and ``serve``: an open-addressing
hash table over any int64 keys (raw ids, hex integers)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import DataError

__all__ = ["VocabLookup"]


class VocabLookup:
    """A vocabulary (keys in id order) -> ids, by an open-addressing hash table with linear probing.

    The table has ``2^k >= 2 V`` slots (load factor <= 1/2), a key array and an ``id + 1`` array
    (0: an empty slot); the home slot of key ``v`` is the top ``k`` bits of ``v * 0x9E3779B97F4A7C15
    mod 2^64`` (Fibonacci hashing), as :class:`dlrmctl.data.criteo.vocab.HashLookup` (32-bit keys;
    these are any int64).  About 1.5 probes per present key, 2.5 per absent one (Knuth, TAOCP 6.4).

    Args:
        values: ``[V]`` int64 distinct keys; ``values[i]`` has id ``i``.

    Raises:
        ValueError: a duplicate key.
    """

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        self.size = v = len(values)
        bits = max(4, int(np.ceil(np.log2(2 * v)))) if v else 4
        self._shift = np.uint64(64 - bits)
        self._mask = (1 << bits) - 1
        self._keys = np.zeros(1 << bits, np.int64)
        self._ids = np.zeros(1 << bits, np.int64)  # id + 1; 0 = empty
        slot = self._home(values)
        pending = np.arange(v)
        while len(pending):
            s = slot[pending]
            free = self._ids[s] == 0
            blocked = pending[~free]
            if (self._keys[s[~free]] == values[blocked]).any():
                raise ValueError("duplicate vocabulary value")
            cand, cs = pending[free], s[free]
            self._ids[cs] = cand + 1  # several candidates for one slot: exactly one of them lands
            won = self._ids[cs] == cand + 1
            self._keys[cs[won]] = values[cand[won]]
            lost = cand[~won]  # a candidate that lost its slot to the same key is a duplicate too
            if (self._keys[cs[~won]] == values[lost]).any():
                raise ValueError("duplicate vocabulary value")
            pending = np.concatenate([blocked, lost])
            slot[pending] = (slot[pending] + 1) & self._mask

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> self._shift).astype(np.intp)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """``[m]`` int64 keys -> ``[m]`` int64 ids; ``size`` (the out-of-vocabulary id) when absent."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.full(len(keys), self.size, dtype=np.int64)
        if self.size == 0 or len(keys) == 0:
            return out
        slot = self._home(keys)
        idx = None  # all rows on the first probe
        while True:
            e = self._ids[slot]
            k = keys if idx is None else keys[idx]
            hit = (e != 0) & (self._keys[slot] == k)
            if idx is None:
                np.copyto(out, e - 1, where=hit)
                go = np.flatnonzero((e != 0) & ~hit)
                idx, slot = go, slot[go]
            else:
                out[idx[hit]] = e[hit] - 1
                go = (e != 0) & ~hit
                idx, slot = idx[go], slot[go]
            if not len(idx):
                return out
            slot = (slot + 1) & self._mask

    @classmethod
    def read(cls, path: str | os.PathLike) -> "VocabLookup":
        """A ``vocab/<feature>.arrow`` file (``value`` int64 in id order).

        Raises:
            DataError: not such a file.
        """
        import pyarrow.ipc as ipc

        try:
            values = ipc.open_file(pa.memory_map(os.fspath(path))).read_all().column("value").to_numpy()
        except (OSError, pa.ArrowInvalid, KeyError) as e:
            raise DataError(f"cannot read vocabulary (expected an Arrow file with an int64 'value' column): {e}",
                            path=path) from None
        return cls(values)
