"""Block checksums (xxh3-64) of stored bytes.

Each stored piece carries one checksum per ``block_bytes`` block, so a load that reads only
part of a piece (resharding) still verifies everything it reads by reading whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import xxhash

ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_BYTES = 4 << 20


def digest(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def block_checksums(data: memoryview | bytes, block_bytes: int) -> list[str]:
    """One hex digest per ``block_bytes`` block of ``data`` (the last block may be short)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    return [digest(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


class BlockRun(Protocol):
    """A run of bytes in a file with one checksum per block (:class:`shardsafe.format.Extent`)."""

    @property
    def byte_offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def checksums(self) -> Sequence[str]: ...


class _Run:
    """One extent being checked: the block it is in and the hash of that block so far."""

    __slots__ = ("block", "end", "filled", "hasher", "start", "sums")

    def __init__(self, start: int, nbytes: int, sums: Sequence[str]) -> None:
        self.start, self.end, self.sums = start, start + nbytes, sums
        self.block = 0  # index of the block being hashed
        self.filled = 0  # its bytes hashed so far
        self.hasher = xxhash.xxh3_64()


class StreamCheck:
    """Checks a file's bytes against the block checksums of its extents while they stream by,
    so that a copy is verified as it arrives instead of being read back afterwards.

    Pure: :meth:`feed` takes ``(file offset, bytes)`` in file order, each chunk starting where
    the last ended; a block cut by a chunk boundary is carried over as the running hash of its
    first part (one per extent, no bytes kept). :meth:`finish` returns one line per block that
    differed or never arrived (the stream ended early), and per extent whose checksums do not
    match its length; empty when every extent held what its checksums say. Bytes outside the
    extents (headers, padding) are not checked here.
    """

    def __init__(self, extents: Iterable[BlockRun], block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.position = 0  # the file offset the next chunk starts at
        self.bad: list[str] = []
        self._waiting: list[_Run] = []  # not reached yet, by start (popped from the end)
        self._active: list[_Run] = []  # reached, not complete
        for e in extents:
            try:
                run = _Run(int(e.byte_offset), int(e.nbytes), tuple(e.checksums))
            except (TypeError, ValueError) as err:  # a peer's offer is checked, not trusted
                self.bad.append(f"an extent is not readable ({err})")
                continue
            if len(run.sums) != block_count(run.end - run.start, block_bytes) or run.start < 0:
                self.bad.append(
                    f"an extent at {run.start} of {run.end - run.start} bytes has "
                    f"{len(run.sums)} block checksums"
                )
            elif run.end > run.start:
                self._waiting.append(run)
        self._waiting.sort(key=lambda r: r.start, reverse=True)

    def feed(self, offset: int, data: memoryview | bytes) -> None:
        """The file's bytes ``[offset, offset + len(data))``; ``offset`` is where the last ended."""
        if offset != self.position:
            raise ValueError(f"bytes at {offset} fed after bytes up to {self.position}")
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        stop = offset + len(view)
        self.position = stop
        while self._waiting and self._waiting[-1].start < stop:
            self._active.append(self._waiting.pop())
        for run in self._active:
            self._take(run, view, offset, stop)
        self._active = [r for r in self._active if r.block < len(r.sums)]

    def _take(self, run: _Run, view: memoryview, offset: int, stop: int) -> None:
        b = self.block_bytes
        at = max(run.start, offset)  # file offset of the next byte of this run in this chunk
        end = min(run.end, stop)
        while at < end:
            block_start = run.start + run.block * b
            block_end = min(block_start + b, run.end)
            upto = min(block_end, end)
            part = view[at - offset : upto - offset]
            if run.filled == 0 and upto == block_end:
                got = digest(part)  # the whole block is in this chunk
            else:
                run.hasher.update(part)
                got = run.hasher.hexdigest() if upto == block_end else ""
            run.filled += upto - at
            at = upto
            if upto == block_end:
                if got != run.sums[run.block]:
                    self.bad.append(
                        f"bytes {block_start} (block {run.block} of an extent at {run.start})"
                    )
                run.block += 1
                run.filled = 0
                run.hasher.reset()

    def finish(self) -> list[str]:
        """What differed, and every block not (completely) fed: the stream ended early."""
        for run in [*self._active, *reversed(self._waiting)]:
            at = run.start + run.block * self.block_bytes
            self.bad.append(
                f"bytes {at} to {run.end} (from block {run.block} of an extent at {run.start}) "
                f"never arrived: the stream ended at {self.position}"
            )
        self._active, self._waiting = [], []
        return list(self.bad)
