"""POSIX file-system storage: pread/pwrite, fsync, atomic directory rename."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import io
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from .base import RefusedFileError, Storage


class LocalStorage(Storage):
    atomic_rename = True
    direct_io = True
    sync_writes = True  # open_write fsyncs each file it closes (False: the caller syncs later)

    def __init__(self, root: str) -> None:
        super().__init__(os.path.abspath(os.fspath(root)))

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def list_dir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, rel: str) -> int:
        """The size of the regular file ``rel``, read from its descriptor (see :func:`open_checked`)."""
        fd, size = open_checked(self.root, rel)
        os.close(fd)
        return size

    def open_fd(self, rel: str) -> int:
        """A read-only descriptor of the regular file ``rel`` (see :func:`open_checked`)."""
        return open_checked(self.root, rel)[0]

    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        return read_checked(self.root, rel, limit)

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        fd = self.open_fd(rel)
        try:
            read_fd_into(fd, offset, out, self.path(rel))
        finally:
            os.close(fd)

    def open_read(self, rel: str) -> _FdReader:
        return _FdReader(self.path(rel), self.open_fd(rel))

    def open_file(self, rel: str) -> _FdReader:
        return self.open_read(rel)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, "xb", buffering=0) as f:
                yield f
                if self.sync_writes:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # never leave a partial file that looks written
            raise

    def modified(self, rel: str) -> float | None:
        try:
            return os.lstat(self.path(rel)).st_mtime_ns / 1e9
        except OSError:
            return None

    def is_link(self, rel: str) -> bool:
        return os.path.islink(self.path(rel))

    def make_dir(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> bool:
        """``renameat2(RENAME_EXCHANGE)``: both names stay valid throughout (Linux 3.15+, most
        local file systems); False where the kernel or file system does not support it."""
        fn = _renameat2()
        if fn is None:
            return False
        rc = fn(_AT_FDCWD, os.fsencode(self.path(a)), _AT_FDCWD, os.fsencode(self.path(b)), 2)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err), self.path(b))

    @contextmanager
    def fence(self, rel: str, timeout: float) -> Iterator[None]:
        """``flock`` on the directory itself (no file of its own to leave behind), polled until
        ``timeout``. Where the file system has no ``flock`` on directories the block runs
        unfenced, with a warning (see FORMAT.md "Leases")."""
        fd = os.open(self.path(rel), os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            deadline = time.monotonic() + timeout
            locked = False
            while not locked:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"{self.path(rel)}: another process has been publishing a checkpoint "
                            f"here for over {timeout:.0f} s"
                        ) from None
                    time.sleep(0.02)
                except OSError as e:
                    if e.errno not in _NO_FLOCK:
                        raise
                    log.warning(
                        "%s: no flock on this file system (%s); publishing without the fence",
                        self.path(rel),
                        e,
                    )
                    break
            yield
        finally:
            os.close(fd)  # releases the flock

    def evict(self, rel: str) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: fsync'd
        finally:
            os.close(fd)

    def sync_dir(self, rel: str) -> None:
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        except OSError as e:  # some file systems refuse fsync on directories
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
        finally:
            os.close(fd)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Written whole under a name of its own, then hard-linked at ``rel`` (``link`` fails
        where anything exists): a process killed midway leaves no empty or partial file at
        ``rel`` (a lease name that holds one would refuse every later save of that step).
        File systems without hard links: ``O_EXCL`` create, then write."""
        path = self.path(rel)
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        staged = os.path.join(directory, f".{name}.{os.getpid()}-{os.urandom(4).hex()}.new")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(staged, path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
                    raise
                return self._create_exclusive_in_place(path, data)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(staged)

    @staticmethod
    def _create_exclusive_in_place(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True


_AT_FDCWD = -100
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF})
log = logging.getLogger("shardsafe")


@functools.cache
def _renameat2() -> Any:
    """libc's renameat2, or None (not Linux, or a libc without it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


SPARSE_SLACK = 1 << 20
"""A file may hold this many bytes more than a quarter of it allocated (see :func:`open_checked`)."""


def open_checked(root: str, rel: str, *, dense: bool = True) -> tuple[int, int]:
    """``(descriptor, size)`` of the regular file ``rel`` under ``root``: the one way readers open.

    - ``rel`` is relative, without ``..``; its directory must resolve inside ``root``
      (``root`` itself may be a symbolic link) and the file itself must not be a link:
      a link planted in a checkpoint cannot make a reader open, or even stat, a file
      elsewhere.
    - A FIFO, device, socket or directory is refused without blocking (``O_NONBLOCK``):
      it could hang a reader or feed it endless bytes.
    - The size comes from the opened descriptor, so what is checked is what is read.
    - With ``dense``, a sparse file (fewer than a quarter of its bytes allocated, beyond
      :data:`SPARSE_SLACK`) is refused: its holes would read as data that costs nothing
      on disk, so a reader's memory stays bounded by bytes really stored.
    """
    path = os.path.join(root, rel) if rel else root
    if os.path.isabs(rel) or ".." in rel.split("/") or "\0" in rel:
        raise RefusedFileError(errno.EACCES, "refusing a path that leaves the directory", path)
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.dirname(path))
    if parent != real_root and not parent.startswith(real_root.rstrip(os.sep) + os.sep):
        raise RefusedFileError(
            errno.EACCES,
            f"refusing to follow a symbolic link that leads outside {real_root} to {parent}",
            path,
        )
    if os.path.islink(path):  # lstat only: the link's target is neither opened nor stat'ed
        raise RefusedFileError(
            errno.EACCES,
            "refusing to follow a symbolic link in place of a file (it may lead outside)",
            path,
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RefusedFileError(
                errno.EACCES, "refusing to follow a symbolic link in place of a file", path
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFileError(
                errno.EACCES, "refusing to read what is not a regular file", path
            )
        if dense and st.st_size > SPARSE_SLACK + 4 * st.st_blocks * 512:
            raise RefusedFileError(
                errno.EACCES,
                f"refusing a sparse file ({st.st_size} bytes, {st.st_blocks * 512} allocated)",
                path,
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_checked(root: str, rel: str, limit: int | None = None) -> bytes:
    """The whole of ``rel`` (opened by :func:`open_checked`), refusing more than ``limit`` bytes.

    Read in bounded chunks up to the size the descriptor reports, so a file that grows
    while being read cannot make this allocate more.
    """
    fd, size = open_checked(root, rel)
    try:
        if limit is not None and size > limit:
            raise RefusedFileError(
                errno.EFBIG,
                f"refusing a file of {size} bytes (the limit is {limit})",
                os.path.join(root, rel),
            )
        out = bytearray(size)
        read_fd_into(fd, 0, memoryview(out), os.path.join(root, rel))
        return bytes(out)
    finally:
        os.close(fd)


def open_in(root: str | os.PathLike[str], rel: str) -> io.BufferedReader:
    """A buffered binary file over :func:`open_checked`'s descriptor."""
    return os.fdopen(open_checked(os.fspath(root), rel)[0], "rb")


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """A file the user named (a link they give is followed), refused unless it is regular:
    a FIFO or device in its place cannot block the reader or feed it endless bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RefusedFileError(
                errno.EACCES, "refusing to read what is not a regular file", os.fspath(path)
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


class _FdReader:
    """One open file descriptor for many preads (thread-safe: pread has no shared offset)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def read_into(self, offset: int, out: memoryview, /) -> None:
        read_fd_into(self.fd, offset, out, self.path)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_fd_into(fd: int, offset: int, out: memoryview, name: str) -> None:
    """pread until ``out`` is full; a short file raises EOFError naming it."""
    out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    done = 0
    total = len(out)
    while done < total:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise EOFError(
                f"{name}: wanted {total} bytes at offset {offset}, file ends after {done}"
            )
        done += n
