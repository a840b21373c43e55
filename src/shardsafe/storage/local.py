"""POSIX file-system storage: pread/pwrite, fsync, atomic directory rename."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from .base import Storage


class LocalStorage(Storage):
    atomic_rename = True
    direct_io = True

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
        return os.stat(self.path(rel)).st_size

    def open_fd(self, rel: str) -> int:
        """A read-only descriptor of the regular file ``rel``, which must resolve inside the root.

        A symbolic link planted in a checkpoint cannot make a reader open a file elsewhere,
        and a FIFO or device in place of a file cannot block it or feed it endless bytes.
        """
        path = self.path(rel)
        root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise PermissionError(
                errno.EACCES,
                f"refusing to follow a symbolic link that leads outside {root} to {real}",
                path,
            )
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(mode):
                raise PermissionError(
                    errno.EACCES, "refusing to read what is not a regular file", path
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, rel: str) -> bytes:
        with os.fdopen(self.open_fd(rel), "rb") as f:
            return f.read()

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        fd = self.open_fd(rel)
        try:
            read_fd_into(fd, offset, out, self.path(rel))
        finally:
            os.close(fd)

    def open_read(self, rel: str) -> _FdReader:
        return _FdReader(self.path(rel), self.open_fd(rel))

    @contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, "xb", buffering=0) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # never leave a partial file that looks written
            raise

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
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
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


class _FdReader:
    """One open file descriptor for many preads (thread-safe: pread has no shared offset)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def read_into(self, offset: int, out: memoryview, /) -> None:
        read_fd_into(self.fd, offset, out, self.path)

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
