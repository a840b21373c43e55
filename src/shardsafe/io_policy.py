"""Whether direct I/O pays on a file system: measured there once, remembered in a cache file.

``O_DIRECT`` is not faster everywhere: on some devices a buffered write with ``fsync`` or a
buffered read (with the kernel's read-ahead) beats it, and a checkpoint written direct is never
in the page cache for an immediate reload. So ``direct_io="auto"`` decides from what the device
does: :func:`measure` writes a probe file of ``probe_bytes`` into the directory a save writes
to, once with ``O_DIRECT`` and once buffered (both made durable with ``fsync``), and reads it
cold both ways, twice, keeping the best of each; :func:`decide` turns the four timings into a
:class:`Policy`. Loads never write a probe (a checkpoint may be read-only or someone else's):
they use the file system's measurement if one exists, and the page cache otherwise. The result is kept per file
system (host, device number, file system type) in a JSON cache file
(``$SHARDSAFE_CACHE_DIR/direct_io.json``, default ``$XDG_CACHE_HOME/shardsafe`` or
``~/.cache/shardsafe``) under an exclusive lock, so the ranks of a host measure once between
them, and later processes not at all; delete the file (or an entry) to measure again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .codec import array_view

log = logging.getLogger("shardsafe")

CACHE_DIR_VAR = "SHARDSAFE_CACHE_DIR"
"""Environment variable naming the directory of the cache file (read when a probe is made)."""
CACHE_FILE = "direct_io.json"
PROBE_BYTES = 64 << 20
"""Bytes written and read by one measurement (each of the four)."""
PROBE_PREFIX = ".shardsafe-io-probe-"
"""Name prefix of the probe file, removed when the measurement ends."""
_ALIGN = 4096


@dataclass(frozen=True)
class Measurement:
    """Seconds to move ``nbytes`` each way on one file system; ``direct`` False where the file
    system refuses ``O_DIRECT`` (then no timing)."""

    nbytes: int
    direct: bool
    write_direct: float = 0.0
    write_buffered: float = 0.0
    read_direct: float = 0.0
    read_buffered: float = 0.0


@dataclass(frozen=True)
class Policy:
    """Whether to write data files with ``O_DIRECT``, and to read their uncached parts so."""

    writes: bool
    reads: bool


def decide(m: Measurement) -> Policy:
    """Pure: direct I/O for the writes (reads) where the direct write (cold read) took no
    longer than the buffered one. A tie goes to direct writes, which also leave the page
    cache to the training job, and to buffered reads, which leave it warm for the next one."""
    if not m.direct:
        return Policy(False, False)
    return Policy(m.write_direct <= m.write_buffered, m.read_direct < m.read_buffered)


MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
"""File systems whose files live in memory (a RAM disk such as ``/dev/shm``): the page cache
is their storage, so ``O_DIRECT`` has nothing to bypass (recent kernels accept it on tmpfs and
copy through the cache anyway) and is never used or measured there."""


def _mount_of(directory: str) -> tuple[int, int, str, str]:
    """``(major, minor, file system type, mount point)`` of the file system holding ``directory``."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    fstype, mount = "?", "?"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[2] == f"{major}:{minor}" and " - " in line:
                mount = fields[4]
                fstype = line.split(" - ", 1)[1].split()[0]
                break
    return major, minor, fstype, mount


def file_system_key(directory: str) -> tuple[str, str]:
    """``(key, mount point)`` of the file system holding ``directory``: the key names the host,
    the device number and the file system type, which is what a measurement describes."""
    major, minor, fstype, mount = _mount_of(directory)
    return f"{socket.gethostname()} {major}:{minor} {fstype}", mount


def in_memory(directory: str) -> bool:
    """Whether ``directory`` lies on a RAM disk (:data:`MEMORY_FILE_SYSTEMS`)."""
    return _mount_of(directory)[2] in MEMORY_FILE_SYSTEMS


def measure(directory: str, nbytes: int = PROBE_BYTES, repeat: int = 2) -> Measurement:
    """Time a durable write and a cold read of ``nbytes`` in ``directory``, with and without
    ``O_DIRECT``, through a probe file that is removed afterwards; the best of ``repeat``."""
    runs = [_measure_once(directory, nbytes) for _ in range(max(1, repeat))]
    if not runs[0].direct:
        return runs[0]
    return Measurement(
        runs[0].nbytes,
        True,
        min(r.write_direct for r in runs),
        min(r.write_buffered for r in runs),
        min(r.read_direct for r in runs),
        min(r.read_buffered for r in runs),
    )


def _measure_once(directory: str, nbytes: int) -> Measurement:
    nbytes = max(_ALIGN, nbytes // _ALIGN * _ALIGN)
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buf[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)  # incompressible
    view = array_view(buf)
    path = os.path.join(directory, f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, create | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return Measurement(nbytes, False)
            raise
        write_direct = _timed_write(fd, view)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        read_direct = _timed_read(fd, view)
        fd = os.open(path, os.O_RDONLY)  # written direct: none of it is cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_buffered = _timed_read(fd, view)
        os.remove(path)
        write_buffered = _timed_write(os.open(path, create, 0o600), view)
        return Measurement(nbytes, True, write_direct, write_buffered, read_direct, read_buffered)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _timed_write(fd: int, view: memoryview) -> float:
    try:
        start = time.perf_counter()
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _timed_read(fd: int, view: memoryview) -> float:
    try:
        start = time.perf_counter()
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], done)
            if got <= 0:
                raise OSError(errno.EIO, "the probe file ended early")
            done += got
        return time.perf_counter() - start
    finally:
        os.close(fd)


def default_cache_dir() -> str:
    """``$SHARDSAFE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardsafe``, else ``~/.cache/shardsafe``."""
    explicit = os.environ.get(CACHE_DIR_VAR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardsafe")


class DeviceProbe:
    """The measured :class:`Policy` of each file system a Saver or load uses.

    Decisions are kept on this object (one look at the cache file per file system) and in the
    cache file ``cache_path`` (default: :func:`default_cache_dir`, read when the probe is made).
    Where the directory cannot take a probe file or the cache file cannot be written, the
    decision is buffered I/O or the measurement is kept here only, and the log says so.
    """

    def __init__(self, cache_path: str | None = None, probe_bytes: int = PROBE_BYTES) -> None:
        self.cache_path = cache_path or os.path.join(default_cache_dir(), CACHE_FILE)
        self.probe_bytes = probe_bytes
        self.measurements = 0  # probes this object ran
        self._known: dict[str, Policy] = {}

    def policy(self, directory: str, may_measure: bool = True) -> Policy:
        """The policy for the file system holding ``directory``: measured there if unknown and
        ``may_measure`` (a save's own directory), else buffered I/O until some save measures."""
        key, mount = file_system_key(directory)
        known = self._known.get(key)
        if known is None:
            found = self._look_up_or_measure(key, mount, directory if may_measure else None)
            if found is None:
                return Policy(False, False)
            known = self._known[key] = found
        return known

    def _look_up_or_measure(self, key: str, mount: str, directory: str | None) -> Policy | None:
        if directory is None:  # look only
            return self._entry(self._read(), key)
        lock = None
        try:
            os.makedirs(os.path.dirname(self.cache_path), exist_ok=True)
            lock = os.open(self.cache_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of a host measure once between them
        except OSError as e:
            log.warning(
                "direct I/O probe: cannot lock %s (%s); measuring anyway", self.cache_path, e
            )
        try:
            entries = self._read()
            known = self._entry(entries, key)
            if known is not None:
                return known
            try:
                m = measure(directory, self.probe_bytes)
            except OSError as e:
                log.warning(
                    "direct I/O probe: cannot measure in %s (%s); using buffered I/O there",
                    directory,
                    e,
                )
                return Policy(False, False)
            self.measurements += 1
            policy = decide(m)
            log.info("direct I/O on %s (%s): %s, measured %s", mount, key, policy, m)
            entries[key] = {"mount": mount, "measurement": asdict(m), "policy": asdict(policy)}
            self._write(entries)
            return policy
        finally:
            if lock is not None:
                os.close(lock)

    def _entry(self, entries: dict[str, Any], key: str) -> Policy | None:
        entry = entries.get(key)
        if entry is None:
            return None
        try:
            m = Measurement(**entry["measurement"])
            timings = (m.write_direct, m.write_buffered, m.read_direct, m.read_buffered)
            if not isinstance(m.direct, bool) or not all(
                type(t) in (int, float) and t >= 0 for t in timings
            ):
                raise ValueError(entry)
            return decide(m)
        except (KeyError, TypeError, ValueError):
            log.warning("direct I/O probe: bad entry for %r in %s; ignored", key, self.cache_path)
            return None

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.cache_path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("direct I/O probe: ignoring unreadable %s (%s)", self.cache_path, e)
            return {}
        return doc if isinstance(doc, dict) else {}

    def _write(self, entries: dict[str, Any]) -> None:
        tmp = f"{self.cache_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.cache_path)
        except OSError as e:
            log.warning(
                "direct I/O probe: cannot write %s (%s); the measurement is kept in this process's "
                "Saver or load only",
                self.cache_path,
                e,
            )
            with contextlib.suppress(OSError):
                os.remove(tmp)
