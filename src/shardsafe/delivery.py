"""Bytes of data files put straight where a load reads them (pure: no I/O).

A restore that fetches a file from another host only to load it would write every byte into a
new file and then read it back. Where one rank alone reads a fetched file, the copy round puts
the bytes that rank's load reads straight into their tensors (:meth:`Deliveries.land`) and
writes only the rest into the file; the load then takes those bytes from memory
(:meth:`Deliveries.fill`) and verifies every block it returns, whichever way its bytes came.

A span is ``(file offset, memory)``: the bytes of the file from that offset on, as long as the
memory, belong in that memory (a region of a tensor the load fills in place). Spans of a file
never overlap: the first one added wins, a later overlapping one is dropped. A file is delivered
whole (:meth:`Deliveries.whole`): the few bytes between its spans (headers, padding, small
items) are kept in buffers of their own, so that no file is written at all; a file whose bytes
mostly go elsewhere is not delivered (it is written and read as usual).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class Deliveries:
    """The spans of data files a restore's copy round delivers into memory, per file."""

    def __init__(self) -> None:
        self._starts: dict[str, list[int]] = {}
        self._spans: dict[str, list[tuple[int, memoryview]]] = {}
        self._sizes: dict[str, int] = {}
        self.kept = 0  # bytes held in buffers of their own (between spans)

    def add(self, file: str, offset: int, memory: memoryview) -> bool:
        """Deliver bytes ``[offset, offset + len(memory))`` of ``file`` into ``memory``;
        False (and nothing added) where they overlap a span already added, or are empty."""
        memory = memory.cast("B")
        n = len(memory)
        if n == 0 or offset < 0:
            return False
        starts = self._starts.setdefault(file, [])
        spans = self._spans.setdefault(file, [])
        i = bisect.bisect_right(starts, offset)
        if i > 0 and spans[i - 1][0] + len(spans[i - 1][1]) > offset:
            return False
        if i < len(starts) and starts[i] < offset + n:
            return False
        starts.insert(i, offset)
        spans.insert(i, (offset, memory))
        return True

    def whole(self, file: str, size: int, max_kept: int) -> bool:
        """Deliver every byte of ``file`` (``size`` bytes): the bytes no span takes go into
        buffers of their own. False, and ``file`` dropped, where those would exceed
        ``max_kept`` bytes or a span ends beyond the file."""
        spans = self._spans.get(file, [])
        gaps, at = [], 0
        for offset, mem in spans:
            if offset > at:
                gaps.append((at, offset))
            at = offset + len(mem)
        if at > size or not spans or sum(b - a for a, b in gaps) + size - at > max_kept:
            self._spans.pop(file, None)
            self._starts.pop(file, None)
            return False
        if at < size:
            gaps.append((at, size))
        for a, b in gaps:
            self.add(file, a, memoryview(bytearray(b - a)))
            self.kept += b - a
        self._sizes[file] = size
        return True

    @property
    def files(self) -> frozenset[str]:
        """The files delivered whole."""
        return frozenset(self._sizes)

    def size(self, file: str) -> int | None:
        """The size of a file delivered whole; None for any other."""
        return self._sizes.get(file)

    @property
    def nbytes(self) -> int:
        """The bytes delivered into tensors (not counting those kept between them)."""
        return sum(len(m) for spans in self._spans.values() for _, m in spans) - self.kept

    def _meets(self, file: str, offset: int, n: int) -> Iterator[tuple[memoryview, int]]:
        """``(part of a span's memory, where it starts in [offset, offset + n))`` for every
        span meeting those bytes of ``file``, in file order."""
        starts = self._starts.get(file)
        if not starts or n <= 0:
            return
        spans = self._spans[file]
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        end = offset + n
        for s_off, mem in spans[i:]:
            if s_off >= end:
                break
            lo, hi = max(offset, s_off), min(end, s_off + len(mem))
            if lo < hi:
                yield mem[lo - s_off : hi - s_off], lo - offset

    @staticmethod
    def _gaps(covered: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        gaps, at = [], 0
        for lo, hi in covered:
            if lo > at:
                gaps.append((at, lo))
            at = hi
        if at < n:
            gaps.append((at, n))
        return gaps

    def land(self, file: str, offset: int, data: memoryview) -> list[tuple[int, int]]:
        """Copy the bytes of ``data`` (``file``'s from ``offset`` on) that spans take into
        them; the ``(start, stop)`` ranges of ``data`` no span takes (to write into the file)."""
        data = data.cast("B")
        covered = []
        for mem, at in self._meets(file, offset, len(data)):
            mem[:] = data[at : at + len(mem)]
            covered.append((at, at + len(mem)))
        return self._gaps(covered, len(data))

    def fill(self, file: str, offset: int, out: memoryview) -> list[tuple[int, int]]:
        """Put into ``out`` the bytes of ``file`` from ``offset`` on that spans hold (nothing
        to copy where ``out`` is that very memory); the ranges of ``out`` they do not hold
        (to read from the file)."""
        out = out.cast("B")
        covered = []
        for mem, at in self._meets(file, offset, len(out)):
            dst = out[at : at + len(mem)]
            if _address(dst) != _address(mem):
                dst[:] = mem
            covered.append((at, at + len(mem)))
        return self._gaps(covered, len(out))
