"""Executes plans: writes byte items into data files with checksums, reads regions back.

Writing: items are laid out sequentially in a data file, each aligned (64 B; 4 KiB for
items of 64 KiB or more), with one xxh3 checksum per block. Reading: every request is
cut into regions that are contiguous in the stored piece; a region goes straight into
the destination tensor when it is contiguous there and block-aligned, otherwise through
a bounded scratch buffer. Every block read is verified against its checksum.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .checksum import block_checksums, digest
from .codec import array_view
from .delivery import Deliveries
from .directio import CacheAwareReader, DirectIO, aligned_empty, open_data_file
from .errors import CheckpointError, CorruptCheckpointError, read_failure
from .format import LARGE_ALIGN, LARGE_ITEM, SMALL_ALIGN, Extent, StoredPiece
from .geometry import Box, flat_index, intersect, is_contiguous_in, strides
from .storage.base import RandomReader, Storage

DEFAULT_MAX_BUFFER = 16 << 20  # per reader thread; bounds the extra memory of a resharding load
_ZEROS = bytes(LARGE_ALIGN)
_RESTORE = "restore this checkpoint from a copy or load an earlier one"


def _align(nbytes: int) -> int:
    return LARGE_ALIGN if nbytes >= LARGE_ITEM else SMALL_ALIGN


def _write_all(f: Any, data: memoryview | bytes) -> None:
    view = (
        memoryview(data).cast("B")
        if isinstance(data, memoryview) and data.format != "B"
        else memoryview(data)
    )
    while len(view):
        n = f.write(view)
        if n is None:  # non-blocking streams; not expected for files
            n = 0
        view = view[n:]


def write_data_file(
    storage: Storage,
    rel: str,
    items: Iterable[tuple[Any, memoryview | bytes]],
    block_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
    direct_io: DirectIO | None = None,
) -> tuple[dict[Any, Extent], int]:
    """Write ``items`` into the new file ``rel``; return each item's extent and the file size.

    ``items`` may be a generator: each item is dropped once written, so streaming writers
    hold one item in memory at a time. ``direct_io`` is the caller's policy and bounce
    buffers (a Saver's); without it ``SHARDSAFE_DIRECT_IO`` decides and nothing is kept.
    """
    extents: dict[Any, Extent] = {}
    pos = 0
    dio = direct_io if direct_io is not None else DirectIO()
    # a stream of items (converters) is never held in memory to decide: the page cache
    direct = (
        dio.wants(storage, items)
        if isinstance(items, Sequence)
        else dio.mode == "always" and dio.policy(storage, True).writes
    )
    with open_data_file(storage, rel, direct, dio.pool) as f:
        for ident, data in items:
            nbytes = len(memoryview(data).cast("B")) if isinstance(data, memoryview) else len(data)
            pad = (-pos) % _align(nbytes)
            if pad:
                _write_all(f, _ZEROS[:pad])
                pos += pad
            sums = block_checksums(data, block_bytes)
            _write_all(f, data)
            extents[ident] = Extent(rel, pos, nbytes, tuple(sums))
            pos += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
    return extents, pos


def verify_written(
    storage: Storage,
    rel: str,
    extents: Sequence[Extent],
    block_bytes: int,
    max_buffer: int,
    evict: bool = True,
) -> list[str]:
    """Read the durable file ``rel`` back from the device and compare every block of
    ``extents`` with the checksums computed from the bytes handed to the write; return one
    line per block that differs (empty when the file holds what was written). ``evict``
    drops the file's cached pages first, so the device itself is read."""
    if evict:
        storage.evict(rel)
    step = max(1, max_buffer // block_bytes) * block_bytes
    buffer = bytearray(min(step, max((e.nbytes for e in extents), default=0)))
    bad: list[str] = []
    reader = storage.open_read(rel)
    try:
        for extent in extents:
            for start in range(0, extent.nbytes, step):
                n = min(step, extent.nbytes - start)
                view = memoryview(buffer)[:n]
                reader.read_into(extent.byte_offset + start, view)
                first = start // block_bytes
                for k, got in enumerate(block_checksums(view, block_bytes)):
                    if got != extent.checksums[first + k]:
                        bad.append(
                            f"bytes {extent.byte_offset + start + k * block_bytes} "
                            f"(block {first + k} of an extent at {extent.byte_offset})"
                        )
    finally:
        reader.close()
    return bad


def split_balanced(sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Indices split into ``bins`` groups of similar total size (biggest first, into the lightest)."""
    bins = max(1, min(bins, len(sizes)))
    groups: list[list[int]] = [[] for _ in range(bins)]
    totals = [0] * bins
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = min(range(bins), key=lambda b: (totals[b], b))
        groups[b].append(i)
        totals[b] += sizes[i]
    return [sorted(g) for g in groups if g]


# --------------------------------------------------------------------------- reading


@dataclass
class ReadTask:
    """Copy the stored region ``region`` (coordinates relative to ``box``) into ``target``."""

    key: str
    piece: StoredPiece
    position: int  # element position of ``box`` within the piece's bytes
    box: Box  # global box of this contiguous part of the piece
    region: Box  # relative to box
    target: torch.Tensor
    dtype: torch.dtype  # stored element type (the target's may differ: copy_ converts)


def span_of(task: ReadTask) -> tuple[int, int]:
    """Bytes ``[a, b)`` of the task's extent that its region spans."""
    itemsize = task.dtype.itemsize
    shape = task.box.shape
    region = task.region
    first = task.position + flat_index(shape, region.offset)
    last = task.position + flat_index(shape, tuple(e - 1 for e in region.end)) + 1
    return first * itemsize, last * itemsize


def in_place(task: ReadTask, block_bytes: int) -> memoryview | None:
    """The target's bytes where the stored bytes the task spans are exactly them (whole
    checksum blocks, the same dtype, dense on both sides, in host memory): the read goes
    straight into them. None where the task reads through a buffer."""
    a, b = span_of(task)
    target = task.target
    aligned = a % block_bytes == 0 and (b % block_bytes == 0 or b == task.piece.extent.nbytes)
    if not (
        aligned
        and target.dtype == task.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and is_contiguous_in(task.box.shape, task.region)
        and target.numel() == task.region.numel
    ):
        return None
    flat = target.as_strided((target.numel(),), (1,))  # dense, whatever size-1 axes claim
    return array_view(flat.view(torch.uint8).numpy())


class DataReader:
    """Reads verified regions of a checkpoint's data files; thread-safe."""

    def __init__(
        self,
        storage: Storage,
        block_bytes: int,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        direct_io: str | None = None,
        delivered: Deliveries | None = None,
    ) -> None:
        self.storage = storage
        self.block_bytes = block_bytes
        # bytes a restore's copy round already put in memory: taken from there, not the file
        self.delivered = delivered
        self.max_buffer = max_buffer
        # "auto", "always" or "never"; None: SHARDSAFE_DIRECT_IO, read now. Its bounce
        # buffers live as long as this reader.
        self.direct_io = DirectIO(direct_io)
        self._readers: dict[str, RandomReader] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.bytes_read = 0

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()
        self.direct_io.close()

    def __enter__(self) -> DataReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reader(self, rel: str, what: str) -> RandomReader:
        with self._lock:
            r = self._readers.get(rel)
            if r is None:
                try:
                    if self.direct_io.reads(self.storage):
                        r = CacheAwareReader(self.storage.open_file(rel), self.direct_io.pool)
                    else:
                        r = self.storage.open_read(rel)
                    self._readers[rel] = r
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{what}: {self.storage.describe(rel)} is missing; the checkpoint is incomplete or was "
                        f"partly deleted — {_RESTORE}"
                    ) from None
                except OSError as e:
                    raise read_failure(
                        f"{what}: cannot open {self.storage.describe(rel)}: {e}", e
                    ) from None
            return r

    def check_extent(self, extent: Extent, what: str) -> None:
        """Refuse an extent that ends beyond its data file as it really is, before allocating
        or reading anything for it: what a manifest claims cannot make a reader allocate more
        memory than the checkpoint's files hold, nor seek to absurd offsets."""
        with self._lock:
            size = self._sizes.get(extent.file)
        if size is None and self.delivered is not None:
            size = self.delivered.size(extent.file)  # in memory: no file holds it
        if size is None:
            try:
                size = self.storage.size(extent.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{what}: {self.storage.describe(extent.file)} is missing; the checkpoint is incomplete or was "
                    f"partly deleted — {_RESTORE}"
                ) from None
            except OSError as e:
                raise read_failure(
                    f"{what}: cannot open {self.storage.describe(extent.file)}: {e}", e
                ) from None
            with self._lock:
                self._sizes[extent.file] = size
        end = extent.byte_offset + extent.nbytes
        if end > size:
            raise CorruptCheckpointError(
                f"{what}: {self.storage.describe(extent.file)} holds {size} bytes, but the manifest places "
                f"{extent.nbytes} bytes at offset {extent.byte_offset}; the data file is truncated — {_RESTORE}"
            )

    def _scratch(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(max(nbytes, 1 << 16))  # aligned: direct reads land in place
            self._local.buf = buf
        return buf[:nbytes]

    def _read(self, extent: Extent, start: int, out: memoryview, what: str) -> None:
        """Read bytes ``[start, start + len(out))`` of ``extent`` into ``out``."""
        self.check_extent(extent, what)
        at = extent.byte_offset + start
        try:
            if self.delivered is None:
                self._reader(extent.file, what).read_into(at, out)
            else:
                for lo, hi in self.delivered.fill(extent.file, at, out):
                    self._reader(extent.file, what).read_into(at + lo, out[lo:hi])
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{what}: {e}; the data file is truncated — {_RESTORE}"
            ) from None
        except CheckpointError:
            raise
        except OSError as e:
            raise read_failure(
                f"{what}: cannot read {self.storage.describe(extent.file)}: {e}", e
            ) from None
        self.bytes_read += len(out)

    def _verify(self, extent: Extent, start: int, data: memoryview, what: str) -> None:
        """Check every block of ``extent`` that ``data`` (bytes from ``start`` on) spans.

        ``data`` must start and end on block boundaries (or at the extent's end): no byte
        reaches a caller without the one checksum that covers it having been compared.
        """
        bb = self.block_bytes
        end = start + len(data)
        if start % bb or (end % bb and end != extent.nbytes) or end > extent.nbytes:
            raise CorruptCheckpointError(
                f"{what}: bytes [{start}, {end}) of {extent.file} are not whole checksum blocks "
                f"of {bb} bytes; refusing to return bytes no checksum covers"
            )
        first = start // bb
        if len(extent.checksums) != -(-extent.nbytes // bb):
            raise CorruptCheckpointError(
                f"{what}: {extent.file} has {len(extent.checksums)} block checksums for "
                f"{extent.nbytes} bytes in blocks of {bb}; the manifest is corrupt"
            )
        for k in range(first, -(-end // bb)):
            lo = k * bb - start
            hi = min((k + 1) * bb, extent.nbytes) - start
            if digest(data[lo:hi]) != extent.checksums[k]:
                raise CorruptCheckpointError(
                    f"{what}: checksum mismatch in {extent.file} block {k} (bytes {extent.byte_offset + k * bb}"
                    f"..{extent.byte_offset + min((k + 1) * bb, extent.nbytes)}); the file is corrupt — {_RESTORE}"
                )

    def read_extent(self, extent: Extent, what: str) -> bytes:
        """A whole extent (blobs), verified."""
        self.check_extent(extent, what)
        out = bytearray(extent.nbytes)
        view = memoryview(out)
        if extent.nbytes:
            self._read(extent, 0, view, what)
            self._verify(extent, 0, view, what)
        return bytes(out)

    def run(self, task: ReadTask) -> None:
        """Copy one region, verifying the blocks it touches."""
        a, b = span_of(task)
        shape = task.box.shape
        region = task.region
        extent = task.piece.extent
        bb = self.block_bytes
        what = f"tensor {task.key!r}"
        self.check_extent(extent, what)  # before sizing the scratch buffer from the extent
        target = task.target
        out = in_place(task, bb)
        if out is not None:
            self._read(extent, a, out, what)
            self._verify(extent, a, out, what)
            return
        lo = (a // bb) * bb
        hi = min(-(-b // bb) * bb, extent.nbytes)
        buf = self._scratch(hi - lo)
        view = array_view(buf)
        self._read(extent, lo, view, what)
        self._verify(extent, lo, view, what)
        src = torch.from_numpy(buf[a - lo : b - lo]).view(task.dtype)
        if not is_contiguous_in(shape, region):
            src = torch.as_strided(src, region.shape, strides(shape))
        else:
            src = src.view(region.shape)
        target.copy_(src.view(target.shape) if src.shape != target.shape else src)


def region_slices(region: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(
        slice(o - b, o - b + s) for o, s, b in zip(region.offset, region.shape, origin, strict=True)
    )


def split_region(shape: Sequence[int], region: Box, max_elems: int) -> Iterator[Box]:
    """Cut ``region`` of a C-order array of ``shape`` into parts whose byte span fits ``max_elems``."""
    st = strides(shape)

    def span(r: Box) -> int:
        if r.numel == 0:
            return 0
        return flat_index(shape, tuple(e - 1 for e in r.end)) - flat_index(shape, r.offset) + 1

    def rec(r: Box) -> Iterator[Box]:
        if span(r) <= max_elems or r.numel <= 1:
            yield r
            return
        axis = next(i for i, s in enumerate(r.shape) if s > 1)
        per = max(1, max_elems // max(1, st[axis] if axis < len(st) - 1 else 1))
        for start in range(0, r.shape[axis], per):
            n = min(per, r.shape[axis] - start)
            off = list(r.offset)
            shp = list(r.shape)
            off[axis] += start
            shp[axis] = n
            sub = Box(tuple(off), tuple(shp))
            if n == 1 and span(sub) > max_elems and axis < len(shape) - 1:
                yield from rec(sub)
            else:
                yield sub

    yield from rec(region)


def plan_reads(
    key: str,
    pieces: Iterable[StoredPiece],
    targets: Sequence[tuple[Box, torch.Tensor]],
    dtype: torch.dtype,
    max_elems: int,
) -> tuple[list[ReadTask], int]:
    """Read tasks filling each ``(global box, tensor view of that box)`` target from the pieces.

    Returns the tasks and the number of target elements they cover.
    """
    tasks: list[ReadTask] = []
    covered = 0
    for piece in pieces:
        for position, pbox in piece.boxes():
            for dbox, view in targets:
                inter = intersect(pbox, dbox)
                if inter is None:
                    continue
                covered += inter.numel
                rel = inter.relative_to(pbox.offset)
                for part in split_region(pbox.shape, rel, max_elems):
                    glob = part.shifted(pbox.offset)
                    tasks.append(
                        ReadTask(
                            key,
                            piece,
                            position,
                            pbox,
                            part,
                            view[region_slices(glob, dbox.offset)],
                            dtype,
                        )
                    )
    return tasks, covered


def run_tasks(
    reader: DataReader,
    tasks: Sequence[ReadTask],
    threads: int,
    on_done: Callable[[int], None] | None = None,
) -> None:
    """Execute read tasks on a small thread pool (reads and copies release the GIL)."""
    if not tasks:
        return
    threads = max(1, min(threads, len(tasks)))
    if threads == 1:
        for task in tasks:
            reader.run(task)
            if on_done:
                on_done(task.region.numel * task.dtype.itemsize)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="shardsafe-read") as pool:
        futures = [pool.submit(reader.run, task) for task in tasks]
        for fut, task in zip(futures, tasks, strict=True):
            fut.result()
            if on_done:
                on_done(task.region.numel * task.dtype.itemsize)


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))
