"""Executes plans: writes byte items into data files with checksums, reads regions back.

Writing: items are laid out sequentially in a data file, each aligned (64 B; 4 KiB for
items of 64 KiB or more), with one xxh3 checksum per block. Reading: every request is
cut into regions that are contiguous in the stored piece; a region goes straight into
the destination tensor when it is contiguous there and block-aligned, otherwise through
a bounded scratch buffer. Every block read is verified against its checksum.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .checksum import block_checksums, digest
from .codec import array_view
from .errors import CheckpointError, CorruptCheckpointError
from .format import Extent, StoredPiece
from .geometry import Box, flat_index, intersect, is_contiguous_in, strides
from .storage.base import ByteWriter, RandomReader, Storage
from .storage.local import LocalStorage

SMALL_ALIGN = 64
LARGE_ALIGN = 4096
LARGE_ITEM = 64 << 10
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
) -> tuple[dict[Any, Extent], int]:
    """Write ``items`` into the new file ``rel``; return each item's extent and the file size.

    ``items`` may be a generator: each item is dropped once written, so streaming writers
    hold one item in memory at a time.
    """
    extents: dict[Any, Extent] = {}
    pos = 0
    # a stream of items (converters) is never held in memory to decide: the page cache
    direct = wants_direct(storage, items) if isinstance(items, Sequence) else DIRECT_IO == "always"
    with open_data_file(storage, rel, direct) as f:
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


# --------------------------------------------------------------------------- direct I/O

_MODE = os.environ.get("SHARDSAFE_DIRECT_IO", "auto").strip().lower()
DIRECT_IO: str = (
    "never"
    if not hasattr(os, "O_DIRECT") or _MODE in ("0", "never", "off", "false")
    else "always"
    if _MODE in ("1", "always", "on", "true")
    else "auto"
)
"""When local data files bypass the page cache (``SHARDSAFE_DIRECT_IO``: auto, always, never).

``auto`` writes a file with ``O_DIRECT`` when its large items sit in page-aligned memory:
the host staging arena of an async save. Those bytes then go from the arena to the device
without a copy, and the background writer neither spends CPU copying them into cache pages
nor grows the page cache under the training job. A blocking save writes from the tensors
themselves through the page cache, which keeps the new checkpoint cached for an immediate
reload. Reads take what the page cache holds from it and the rest of a large read with
``O_DIRECT``, instead of filling cache pages with bytes read once. File systems that
refuse direct I/O fall back to buffered I/O by themselves.
"""
DIRECT_ALIGN = 4096
_BOUNCE_BYTES = 4 << 20
_DIRECT_CHUNK = 64 << 20  # largest single direct transfer
_DIRECT_MIN_READ = 1 << 20  # smaller reads always go through the page cache


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (anonymous mapping), so direct I/O can use it in place."""
    buf = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _view_address(data: memoryview | bytes) -> int:
    view = memoryview(data)
    return address(np.frombuffer(view.cast("B") if view.format != "B" else view, dtype=np.uint8))


def wants_direct(storage: Storage, items: Sequence[tuple[Any, memoryview | bytes]]) -> bool:
    """Whether to write these items with direct I/O (see :data:`DIRECT_IO`)."""
    if DIRECT_IO == "never" or not isinstance(storage, LocalStorage):
        return False
    if DIRECT_IO == "always":
        return True
    large = [d for _, d in items if len(memoryview(d).cast("B")) >= LARGE_ITEM]
    return bool(large) and all(_view_address(d) % DIRECT_ALIGN == 0 for d in large)


class _BouncePool:
    """Aligned transfer buffers, reused across files and saves (one per concurrent transfer)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_empty(_BOUNCE_BYTES)

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)


_BOUNCE = _BouncePool()


class DirectWriter:
    """Sequential writes to an ``O_DIRECT`` descriptor: aligned sources go to the device as they
    are, everything else through an aligned bounce buffer; the last block is zero-padded and
    the file truncated to its real size. A file system that rejects a direct write gets the
    descriptor switched to buffered I/O, and the same bytes again."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0  # bytes accepted
        self._pos = 0  # bytes handed to the kernel (a multiple of DIRECT_ALIGN while direct)
        self._fill = 0  # bytes waiting in the bounce buffer
        self._buf: np.ndarray | None = _BOUNCE.acquire()
        self.direct = True

    def write(self, data: memoryview | bytes, /) -> int:
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        n = len(view)
        if not n:
            return 0
        buf = self._buf
        assert buf is not None, "write after release"
        src = np.frombuffer(view, dtype=np.uint8)
        base = address(src)
        cap = len(buf)
        i = 0
        while i < n:
            if (
                self._fill % DIRECT_ALIGN == 0
                and (base + i) % DIRECT_ALIGN == 0
                and n - i >= DIRECT_ALIGN
            ):
                if self._fill:
                    self._flush()
                k = min((n - i) // DIRECT_ALIGN * DIRECT_ALIGN, _DIRECT_CHUNK)
                self._pwrite(view[i : i + k])
                i += k
                continue
            take = min(cap - self._fill, n - i)
            np.copyto(buf[self._fill : self._fill + take], src[i : i + take])
            self._fill += take
            i += take
            if self._fill == cap:
                self._flush()
        self.size += n
        return n

    def _flush(self) -> None:
        assert self._buf is not None
        fill = self._fill
        if self.direct and fill % DIRECT_ALIGN:
            padded = -(-fill // DIRECT_ALIGN) * DIRECT_ALIGN
            self._buf[fill:padded] = 0
            fill = padded
        self._pwrite(array_view(self._buf[:fill]))
        self._fill = 0

    def _pwrite(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], self._pos + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._buffered()
        self._pos += done

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False

    def finish(self) -> None:
        """Write what is buffered, cut the padding off, fsync."""
        if self._fill:
            self._flush()
        if self._pos != self.size:
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)

    def release(self) -> None:
        if self._buf is not None:
            _BOUNCE.release(self._buf)
            self._buf = None


@contextmanager
def open_data_file(storage: Storage, rel: str, direct: bool = False) -> Iterator[ByteWriter]:
    """A new data file, with direct I/O if asked and possible, else ``storage.open_write``.

    Same contract as ``open_write``: created exclusively, durable when the block exits
    cleanly, removed when it raises.
    """
    fd = _open_direct(storage, rel) if direct and isinstance(storage, LocalStorage) else None
    if fd is None:
        with storage.open_write(rel) as f:
            yield f
        return
    path = storage.path(rel)  # type: ignore[attr-defined]
    writer = DirectWriter(fd)
    try:
        yield writer
        writer.finish()
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)  # never leave a partial file that looks written
        raise
    finally:
        writer.release()
        os.close(fd)


def _open_direct(storage: Storage, rel: str) -> int | None:
    path = storage.path(rel)  # type: ignore[attr-defined]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None  # tmpfs and friends: no direct I/O
        raise


class _Residency:
    """Which pages of one file the page cache holds (``mincore`` on a mapping that is never touched)."""

    _libc: Any = None

    def __init__(self, fd: int) -> None:
        self.addr = 0
        self.length = 0
        size = os.fstat(fd).st_size
        libc = self._load()
        if libc is None or size == 0:
            return
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return
        self.addr, self.length = addr, size

    @classmethod
    def _load(cls) -> Any:
        if cls._libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_long,
                ]
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                cls._libc = libc
            except (OSError, AttributeError):
                cls._libc = False
        return cls._libc or None

    def cached_prefix(self, offset: int, n: int) -> int | None:
        """How many of the bytes ``[offset, offset + n)`` from the start are cached; None: unknown."""
        if not self.addr or offset + n > self.length:
            return None
        page = mmap.PAGESIZE
        first = offset // page
        pages = -(-(offset + n) // page) - first
        vec = np.empty(pages, dtype=np.uint8)
        if self._libc.mincore(self.addr + first * page, pages * page, address(vec)) != 0:
            return None
        missing = np.flatnonzero((vec & 1) == 0)
        if not len(missing):
            return n
        return max(0, (first + int(missing[0])) * page - offset)

    def close(self) -> None:
        if self.addr:
            self._libc.munmap(self.addr, self.length)
            self.addr = 0


class CacheAwareReader:
    """Wraps a local file reader: what the page cache holds is read through it, the rest of
    a large read with ``O_DIRECT`` (a second descriptor of the same open file).

    A checkpoint written with direct I/O, or evicted since, is not cached; reading it
    through the cache would allocate and fill cache pages for bytes read once. Falls back
    to the plain reader wherever the kernel or the file system declines.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fd: int = inner.fd
        self.path: str = inner.path
        self._dfd: int | None = None
        self._lock = threading.Lock()
        self._direct = True
        self._residency: _Residency | None = None

    def read_into(self, offset: int, out: memoryview, /) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if len(out) < _DIRECT_MIN_READ or not self._direct:
            self.inner.read_into(offset, out)
            return
        cached = self._resident().cached_prefix(offset, len(out))
        if cached is None or cached == len(out):
            self.inner.read_into(offset, out)
            return
        if cached:
            self.inner.read_into(offset, out[:cached])
        dfd = self._direct_fd()
        if dfd is not None:
            try:
                self._read_direct(dfd, offset + cached, out[cached:])
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False
        self.inner.read_into(offset + cached, out[cached:])

    def _resident(self) -> _Residency:
        with self._lock:
            if self._residency is None:
                self._residency = _Residency(self.fd)
            return self._residency

    def _direct_fd(self) -> int | None:
        with self._lock:
            if self._dfd is None and self._direct:
                try:  # the same file, not the same path: nothing can be swapped in between
                    self._dfd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    self._direct = False
            return self._dfd

    def _read_direct(self, dfd: int, offset: int, out: memoryview) -> None:
        dst = np.frombuffer(out, dtype=np.uint8)
        base = address(dst)
        n = len(out)
        done = 0
        buf: np.ndarray | None = None
        try:
            while done < n:
                pos = offset + done
                skip = pos % DIRECT_ALIGN
                if not skip and (base + done) % DIRECT_ALIGN == 0 and n - done >= DIRECT_ALIGN:
                    k = min((n - done) // DIRECT_ALIGN * DIRECT_ALIGN, _DIRECT_CHUNK)
                    got = os.preadv(dfd, [out[done : done + k]], pos)
                    if got <= 0:
                        break
                    done += got
                    continue
                if buf is None:
                    buf = _BOUNCE.acquire()
                length = min(-(-(skip + n - done) // DIRECT_ALIGN) * DIRECT_ALIGN, len(buf))
                got = os.preadv(dfd, [array_view(buf[:length])], pos - skip)
                take = min(got - skip, n - done)
                if take <= 0:
                    break
                np.copyto(dst[done : done + take], buf[skip : skip + take])
                done += take
        finally:
            if buf is not None:
                _BOUNCE.release(buf)
        if done < n:
            raise EOFError(
                f"{self.path}: wanted {n} bytes at offset {offset}, file ends after {done}"
            )

    def close(self) -> None:
        with self._lock:
            if self._dfd is not None:
                os.close(self._dfd)
                self._dfd = None
            if self._residency is not None:
                self._residency.close()
                self._residency = None
        self.inner.close()


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


class DataReader:
    """Reads verified regions of a checkpoint's data files; thread-safe."""

    def __init__(
        self, storage: Storage, block_bytes: int, max_buffer: int = DEFAULT_MAX_BUFFER
    ) -> None:
        self.storage = storage
        self.block_bytes = block_bytes
        self.max_buffer = max_buffer
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

    def __enter__(self) -> DataReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reader(self, rel: str, what: str) -> RandomReader:
        with self._lock:
            r = self._readers.get(rel)
            if r is None:
                try:
                    r = self.storage.open_read(rel)
                    if DIRECT_IO != "never" and hasattr(r, "fd") and hasattr(r, "path"):
                        r = CacheAwareReader(r)
                    self._readers[rel] = r
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{what}: {self.storage.describe(rel)} is missing; the checkpoint is incomplete or was "
                        f"partly deleted — {_RESTORE}"
                    ) from None
                except OSError as e:
                    raise CorruptCheckpointError(
                        f"{what}: cannot open {self.storage.describe(rel)}: {e}"
                    ) from None
            return r

    def check_extent(self, extent: Extent, what: str) -> None:
        """Refuse an extent that ends beyond its data file as it really is, before allocating
        or reading anything for it: what a manifest claims cannot make a reader allocate more
        memory than the checkpoint's files hold, nor seek to absurd offsets."""
        with self._lock:
            size = self._sizes.get(extent.file)
        if size is None:
            try:
                size = self.storage.size(extent.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{what}: {self.storage.describe(extent.file)} is missing; the checkpoint is incomplete or was "
                    f"partly deleted — {_RESTORE}"
                ) from None
            except OSError as e:
                raise CorruptCheckpointError(
                    f"{what}: cannot open {self.storage.describe(extent.file)}: {e}"
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
        try:
            self._reader(extent.file, what).read_into(extent.byte_offset + start, out)
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{what}: {e}; the data file is truncated — {_RESTORE}"
            ) from None
        except CheckpointError:
            raise
        except OSError as e:
            raise CorruptCheckpointError(
                f"{what}: cannot read {self.storage.describe(extent.file)}: {e}"
            ) from None
        self.bytes_read += len(out)

    def _verify(self, extent: Extent, start: int, data: memoryview, what: str) -> None:
        """Check every block of ``extent`` that lies wholly in ``data`` (which starts at block-aligned ``start``)."""
        bb = self.block_bytes
        first = start // bb
        for k in range(first, first + math.ceil(len(data) / bb)):
            lo = k * bb - start
            hi = min((k + 1) * bb, extent.nbytes) - start
            if hi > len(data):
                break
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
        itemsize = task.dtype.itemsize
        shape = task.box.shape
        region = task.region
        first = task.position + flat_index(shape, region.offset)
        last = task.position + flat_index(shape, tuple(e - 1 for e in region.end)) + 1
        a, b = first * itemsize, last * itemsize
        extent = task.piece.extent
        bb = self.block_bytes
        what = f"tensor {task.key!r}"
        self.check_extent(extent, what)  # before sizing the scratch buffer from the extent
        target = task.target
        aligned = a % bb == 0 and (b % bb == 0 or b == extent.nbytes)
        if (
            aligned
            and target.dtype == task.dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
            and is_contiguous_in(shape, region)
            and target.numel() == region.numel
        ):
            flat = target.as_strided((target.numel(),), (1,))  # dense, whatever size-1 axes claim
            out = array_view(flat.view(torch.uint8).numpy())
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
