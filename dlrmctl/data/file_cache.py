"""What a process loads from a file (a vocabulary, a joined side table), kept while the file is
unchanged: loaded once per file version, the file's resolved path, size and modification time
(``st_mtime_ns``), so a file written again (a re-run preprocess) is loaded again, never served
stale.  Safe to share between threads (serve's forward threads): each file version is loaded
once, by the first thread that asks; the others wait for it.  Torch-free.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

__all__ = ["FileCache"]

T = TypeVar("T")


class FileCache(Generic[T]):
    """``load(path)`` results by file version (resolved path, size in bytes, ``st_mtime_ns``).

    Args:
        load: reads one file; what it raises reaches the caller of :meth:`get` (nothing is kept).
        limit: entries kept at most; beyond, the oldest loaded is dropped (None: no limit).
        one_dir: keep only files of one directory: loading a file of another directory drops the
            others (a process moves on to another dataset; its vocabularies are not needed any more).
    """

    def __init__(self, load: Callable[[Path], T], limit: int | None = None, one_dir: bool = False) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        self.load, self.limit, self.one_dir = load, limit, one_dir
        self._items: dict[tuple[str, int, int], T] = {}
        self._lock = threading.Lock()  # guards _items and _loading
        self._loading: dict[tuple[str, int, int], threading.Lock] = {}  # per key being loaded: its loader's

    def get(self, path: str | os.PathLike) -> T:
        """The value of ``path``'s current version: kept, or loaded now (and kept).  Threads asking
        for one version together load it once; other versions load meanwhile.

        Raises:
            OSError: ``path`` cannot be stat'ed (missing, ...); whatever ``load`` raises (then a
                thread that waited for that load tries it again itself).
        """
        p = Path(path)
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._items:
                return self._items[key]
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._items:  # (loaded by the thread this one waited for)
                    return self._items[key]
                self._drop_for(key)  # (before the load: the old and the new are never held together)
            try:
                value = self.load(p)
                with self._lock:
                    self._drop_for(key)
                    self._items[key] = value
            finally:
                with self._lock:
                    if self._loading.get(key) is gate:
                        del self._loading[key]
        return value

    def _drop_for(self, key: tuple[str, int, int]) -> None:
        """Make room for ``key`` (``one_dir``: the other directories' files; ``limit``: the oldest);
        called with the lock held."""
        if self.one_dir:
            here = os.path.dirname(key[0])
            for k in [k for k in self._items if os.path.dirname(k[0]) != here]:
                del self._items[k]
        if self.limit is not None:
            while len(self._items) >= self.limit:
                del self._items[next(iter(self._items))]

    def clear(self) -> None:
        """Drop every kept value (each is loaded again on its next :meth:`get`)."""
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
