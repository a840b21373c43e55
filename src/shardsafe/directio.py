"""Direct I/O for data files: writes that bypass the page cache, reads that use what it holds.

Where the file system's measured behaviour says it pays (:mod:`.io_policy`), async saves write
from the page-aligned staging arena with ``O_DIRECT`` (no copy into cache pages, no page-cache
growth under the training job), and large reads take the cached part of a file normally and
the rest with ``O_DIRECT``, straight into aligned destinations. File systems that refuse
direct I/O fall back to buffered I/O by themselves; on a RAM disk (tmpfs), whose files are
page-cache pages, it is never used, in any mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .codec import array_view
from .errors import ValidationError
from .format import LARGE_ITEM
from .io_policy import DeviceProbe, Policy, in_memory
from .storage.base import ByteWriter, FileReader, Storage

ENV_VAR = "SHARDSAFE_DIRECT_IO"
"""The environment variable that sets the default mode (``auto``, ``always`` or ``never``)."""
MODES = ("auto", "always", "never")
_NEVER = ("0", "never", "off", "false")
_ALWAYS = ("1", "always", "on", "true")


def direct_io_mode(option: str | None = None) -> str:
    """The direct-I/O mode: ``option`` when given, else ``SHARDSAFE_DIRECT_IO`` read now
    (default ``auto``); always ``never`` where the platform has no ``O_DIRECT``.

    ``auto`` uses direct I/O where the file system's measured behaviour says it pays
    (:mod:`.io_policy`: a probe, once per file system, remembered in a cache file). Where a
    direct write is no slower than a buffered one with ``fsync``, a file is written with
    ``O_DIRECT`` when its large items sit in page-aligned memory: the host staging arena of
    an async save. Those bytes then go from the arena to the device without a copy, and the
    background writer neither spends CPU copying them into cache pages nor grows the page
    cache under the training job. A blocking save writes from the tensors themselves through
    the page cache, which keeps the new checkpoint cached for an immediate reload. Where a
    cold direct read is faster than a buffered one, reads take what the page cache holds and
    the rest of a large read with ``O_DIRECT``. ``always`` writes every local data file and
    reads every uncached part direct; ``never`` turns direct I/O off for writes and reads.
    File systems that refuse direct I/O fall back to buffered I/O by themselves.
    """
    raw = os.environ.get(ENV_VAR, "auto") if option is None else option
    value = str(raw).strip().lower()
    if value in _NEVER:
        mode = "never"
    elif value in _ALWAYS:
        mode = "always"
    elif value in ("auto", "") or option is None:  # an unknown value in the environment: auto
        mode = "auto"
    else:
        raise ValidationError(
            f"direct_io={option!r}: expected one of {', '.join(map(repr, MODES))} "
            f"(or leave it unset to use {ENV_VAR}, default auto)"
        )
    return mode if hasattr(os, "O_DIRECT") else "never"


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


def wants_direct(
    storage: Storage, items: Sequence[tuple[Any, memoryview | bytes]], mode: str = "auto"
) -> bool:
    """Whether to write these items with direct I/O in ``mode`` (see :func:`direct_io_mode`)."""
    if mode == "never" or not storage.direct_io:
        return False
    if mode == "always":
        return True
    large = [d for _, d in items if len(memoryview(d).cast("B")) >= LARGE_ITEM]
    return bool(large) and all(_view_address(d) % DIRECT_ALIGN == 0 for d in large)


class BouncePool:
    """Aligned transfer buffers, reused across files (one per concurrent transfer); owned by
    the :class:`DirectIO` of a Saver or a load, and emptied by its ``close``."""

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

    @property
    def held(self) -> int:
        """Buffers kept for reuse."""
        with self._lock:
            return len(self._free)

    def clear(self) -> None:
        """Drop the buffers kept for reuse (their memory is unmapped once unreferenced)."""
        with self._lock:
            self._free.clear()


class DirectIO:
    """The direct-I/O policy of one Saver or load, and the bounce buffers it reuses.

    ``mode`` is ``"auto"``, ``"always"`` or ``"never"``; None reads ``SHARDSAFE_DIRECT_IO``
    now (see :func:`direct_io_mode`). In ``auto``, ``probe`` (a :class:`DeviceProbe` on the
    default cache file unless given) says per file system whether direct writes and reads
    pay. ``close`` frees the buffers; the object stays usable.
    """

    def __init__(self, mode: str | None = None, probe: DeviceProbe | None = None) -> None:
        self.mode = direct_io_mode(mode)
        self.probe = probe if probe is not None else DeviceProbe()
        self.pool = BouncePool()
        self._memory: dict[int, bool] = {}  # device number -> on a RAM disk

    def policy(self, storage: Storage, writing: bool = False) -> Policy:
        """What direct I/O does on ``storage``'s file system in this mode; in ``auto``, only a
        save (``writing``) measures a file system not measured yet."""
        if self.mode == "never" or not storage.direct_io:
            return Policy(False, False)
        root = _existing(storage.path(""))  # type: ignore[attr-defined]
        if self._in_memory(root):
            return Policy(False, False)  # a RAM disk, in every mode: nothing to bypass
        if self.mode == "always":
            return Policy(True, True)
        return self.probe.policy(root, may_measure=writing)

    def _in_memory(self, root: str) -> bool:
        dev = os.stat(root).st_dev
        if dev not in self._memory:
            self._memory[dev] = in_memory(root)
        return self._memory[dev]

    def wants(self, storage: Storage, items: Sequence[tuple[Any, memoryview | bytes]]) -> bool:
        """Whether to write these items with direct I/O."""
        return wants_direct(storage, items, self.mode) and self.policy(storage, True).writes

    def reads(self, storage: Storage) -> bool:
        """Whether reads of ``storage``'s data files may bypass the page cache."""
        return self.policy(storage).reads

    def close(self) -> None:
        self.pool.clear()


def _existing(path: str) -> str:
    """``path``, or its nearest existing ancestor (a save's directory may not exist yet)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


class DirectWriter:
    """Sequential writes to an ``O_DIRECT`` descriptor: aligned sources go to the device as they
    are, everything else through an aligned bounce buffer; the last block is zero-padded and
    the file truncated to its real size. A file system that rejects a direct write gets the
    descriptor switched to buffered I/O, and the same bytes again."""

    def __init__(self, fd: int, pool: BouncePool | None = None) -> None:
        self.fd = fd
        self.size = 0  # bytes accepted
        self._pos = 0  # bytes handed to the kernel (a multiple of DIRECT_ALIGN while direct)
        self._fill = 0  # bytes waiting in the bounce buffer
        self._pool = pool
        self._buf: np.ndarray | None = (
            pool.acquire() if pool is not None else aligned_empty(_BOUNCE_BYTES)
        )
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
        if self._buf is not None and self._pool is not None:
            self._pool.release(self._buf)
        self._buf = None


@contextmanager
def open_data_file(
    storage: Storage, rel: str, direct: bool = False, pool: BouncePool | None = None
) -> Iterator[ByteWriter]:
    """A new data file, with direct I/O if asked and possible, else ``storage.open_write``.

    Same contract as ``open_write``: created exclusively, durable when the block exits
    cleanly, removed when it raises. The bounce buffer comes from ``pool`` (a fresh one
    without it).
    """
    fd = _open_direct(storage, rel) if direct and storage.direct_io else None
    if fd is None:
        with storage.open_write(rel) as f:
            yield f
        return
    path = storage.path(rel)  # type: ignore[attr-defined]
    writer = DirectWriter(fd, pool)
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


class PageResidency:
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

    def resident_pages(self) -> tuple[int, int] | None:
        """(cached pages, pages) of the whole file; None when unknown."""
        if not self.addr:
            return None
        pages = -(-self.length // mmap.PAGESIZE)
        vec = np.empty(pages, dtype=np.uint8)
        if self._libc.mincore(self.addr, pages * mmap.PAGESIZE, address(vec)) != 0:
            return None
        return int((vec & 1).sum()), pages

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

    def __init__(self, inner: FileReader, pool: BouncePool | None = None) -> None:
        self.inner = inner
        self.fd: int = inner.fileno()
        self.path: str = inner.path
        self._pool = pool
        self._dfd: int | None = None
        self._lock = threading.Lock()
        self._direct = True
        self._residency: PageResidency | None = None

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

    def _resident(self) -> PageResidency:
        with self._lock:
            if self._residency is None:
                self._residency = PageResidency(self.fd)
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
                    buf = (
                        self._pool.acquire()
                        if self._pool is not None
                        else aligned_empty(_BOUNCE_BYTES)
                    )
                length = min(-(-(skip + n - done) // DIRECT_ALIGN) * DIRECT_ALIGN, len(buf))
                got = os.preadv(dfd, [array_view(buf[:length])], pos - skip)
                take = min(got - skip, n - done)
                if take <= 0:
                    break
                np.copyto(dst[done : done + take], buf[skip : skip + take])
                done += take
        finally:
            if buf is not None and self._pool is not None:
                self._pool.release(buf)
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
