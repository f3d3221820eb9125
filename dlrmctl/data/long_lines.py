"""Lines longer than a text reader's block.

Arrow's CSV and JSON readers cut their input into blocks of ``ReadOptions.block_size`` bytes and
carry a row that crosses a block's end into the next block; a row longer than that fails the
whole file with Arrow's "straddling object straddles two block boundaries (try to increase block
size?)", which names no line and cannot be skipped.  Whether a line of more than one block fails
depends on where it starts.  :class:`LineLimit` sits between the file and the reader and hands on
every line of fewer than ``limit`` bytes unchanged; a longer line (never held whole: memory stays
below ``limit`` whatever the line's length) is replaced by what the caller gives for its line
number, e.g. a row with the wrong number of fields that the CSV reader's invalid-row handler then
reports or skips by its line, or the callback raises the error naming the line.

The rule is therefore exact and independent of the line's position: a line of ``limit`` bytes or
more (without its line break) is refused, every shorter one is read.
"""

from __future__ import annotations

import io
from typing import Callable

__all__ = ["LineLimit", "long_line_message"]


def long_line_message(limit: int) -> str:
    """The one message for a line of ``limit`` bytes or more (``limit``: the reader's block size)."""
    return (f"a line of {limit} bytes or more (the reader's block of {limit / 2**20:g} MiB): not a row of "
            "this format (a corrupt or unsplit file?)")


class FullReads(io.RawIOBase):
    """A readable binary file whose ``readinto`` fills the whole buffer unless the input ends, from
    the pieces :meth:`read_some` hands out: an Arrow CSV / JSON reader given it cuts the same
    blocks however the input arrives, and nothing is read ahead of what it asks."""

    def read_some(self, k: int) -> bytes | memoryview:
        """The next at most ``k`` (>= 1) bytes, or ``b""`` at the end of the input."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = 0
        while n < len(view):
            data = self.read_some(len(view) - n)
            if not data:
                break
            view[n: n + len(data)] = data
            n += len(data)
        return n


class LineLimit(FullReads):
    """A readable binary file of ``open()``'s bytes with every line of ``limit`` bytes or more replaced.

    Args:
        open: returns a fresh binary stream of the (decompressed) input, with ``read(n)`` and
            ``close()``; called once to read, and again only to number a long line (its line
            number is counted when it is met, not while reading: reading costs a search for the
            first and the last line break of each read, nothing per line).
        limit: the longest line that passes is ``limit - 1`` bytes without its line break (with
            it, ``limit``: one whole block of a reader whose ``block_size`` is ``limit``).
        replace: given the 1-based physical line number of a long line, returns the bytes that
            stand for it (without a line break), or raises.

    ``readinto`` fills the whole buffer unless the input ends, as :func:`paced_input`'s reader
    does: the blocks an Arrow reader cuts do not depend on how the file was read, and nothing is
    read ahead.  Memory held: at most one line of fewer than ``limit`` bytes and one read.
    Line numbers count ``\\n`` bytes, as the readers' ``file:line`` do.
    """

    def __init__(self, open: Callable[[], object], limit: int, replace: Callable[[int], bytes]) -> None:
        super().__init__()
        if limit < 2:
            raise ValueError(f"limit must be >= 2 bytes, got {limit}")
        self._open = open
        self._f = open()
        self._limit = limit
        self._replace = replace
        self._pending: list[memoryview] = []  # checked bytes to hand on, in order
        self._held = bytearray()  # the start of a line whose end has not been read (< limit bytes)
        self._held_at = 0  # input offset of the first byte of _held (or of the line being dropped)
        self._dropping = False  # inside a long line: its bytes are dropped up to its line break
        self._offset = 0  # input offset of the next byte read
        self._eof = False
        self._counter = None  # a second stream of the input, to number long lines
        self._counted = (0, 1)  # (offset, line number of that offset) reached by _counter

    def read_some(self, k: int) -> bytes | memoryview:
        """The next at most ``k`` (>= 1) checked bytes, or ``b""`` at the end of the input."""
        while True:
            if self._pending:
                p = self._pending[0]
                if len(p) <= k:
                    self._pending.pop(0)
                    return p
                self._pending[0] = p[k:]
                return p[:k]
            if self._eof:
                return b""
            self._fill(k)

    def _line_of(self, offset: int) -> int:
        """The 1-based line number of the input byte at ``offset`` (counted on a second stream)."""
        at, line = self._counted
        if self._counter is None or offset < at:
            self._counter, at, line = self._open(), 0, 1
        while at < offset:
            b = self._counter.read(min(1 << 20, offset - at))
            if not b:
                break
            line += b.count(b"\n")
            at += len(b)
        self._counted = (at, line)
        return line

    def _long(self, newline: bool) -> None:
        self._pending.append(memoryview(self._replace(self._line_of(self._held_at)) + (b"\n" if newline else b"")))
        self._dropping, self._held = False, bytearray()

    def _fill(self, k: int) -> None:
        # reads of at most `limit` bytes: a line between two line breaks of one read is then shorter
        # than `limit`, so only the line continued from earlier reads (_held) needs measuring
        chunk = self._f.read(min(max(k, 1 << 16), self._limit))
        at = self._offset
        self._offset += len(chunk)
        if not chunk:
            self._eof = True
            if self._dropping:
                self._long(newline=False)
            elif self._held:
                self._pending.append(memoryview(self._held))
                self._held = bytearray()
            return
        mv = memoryview(chunk)
        start = 0
        if self._dropping or self._held:
            first = chunk.find(b"\n")
            if first < 0:
                if not self._dropping and len(self._held) + len(chunk) < self._limit:
                    self._held += chunk
                else:
                    self._dropping, self._held = True, bytearray()
                return
            if self._dropping or len(self._held) + first >= self._limit:
                self._long(newline=True)
            else:
                self._pending.append(memoryview(self._held))
                self._pending.append(mv[:first + 1])
                self._held = bytearray()
            start = first + 1
        last = chunk.rfind(b"\n", start)
        if last >= 0:
            self._pending.append(mv[start:last + 1])
            start = last + 1
        self._held_at = at + start
        if len(chunk) - start >= self._limit:
            self._dropping = True
        elif start < len(chunk):
            self._held = bytearray(mv[start:])

    def close(self) -> None:
        self._f.close()
        if self._counter is not None:
            self._counter.close()
        super().close()
