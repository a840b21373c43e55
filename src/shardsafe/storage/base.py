"""The byte-store interface: paths and bytes, never tensors.

A storage is rooted at a location (a local directory, an ``s3://bucket/prefix``); every
path handed to it is relative to that root, uses ``/`` and never leaves the root.
Backends declare what they can do (``atomic_rename``) so the commit protocol can pick
rename-into-place or marker-written-last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, Protocol


class RefusedFileError(PermissionError):
    """A reader refusing what it will not read (a link in place of a file, a FIFO, a sparse
    file, a path leaving the root): about the checkpoint's structure, unlike an ``EACCES``
    from the operating system."""

    refused = True


class ByteWriter(Protocol):
    def write(self, data: memoryview | bytes, /) -> int: ...


class RandomReader(Protocol):
    def read_into(self, offset: int, out: memoryview, /) -> None: ...
    def close(self) -> None: ...


class FileReader(RandomReader, Protocol):
    """A reader of one local file that also gives its open descriptor, for readers that
    bypass the page cache (``Storage.open_file``, where ``Storage.direct_io``)."""

    path: str

    def fileno(self) -> int: ...


class _DelegatingReader:
    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel = storage, rel

    def read_into(self, offset: int, out: memoryview, /) -> None:
        self.storage.read_into(self.rel, offset, out)

    def close(self) -> None:
        pass


class Storage(ABC):
    """A root plus the few operations a checkpoint needs."""

    #: True when ``rename`` of a directory is atomic (POSIX); object stores commit by a marker.
    atomic_rename: bool = False
    #: True when data files may be written and read with ``O_DIRECT`` at ``self.path(rel)``
    #: and ``open_file`` gives their descriptors (local file systems); the direct-I/O code
    #: asks this instead of the backend's type.
    direct_io: bool = False

    def __init__(self, root: str) -> None:
        self.root = root

    def describe(self, rel: str = "") -> str:
        """A human-readable location for messages."""
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def is_dir(self, rel: str) -> bool: ...

    @abstractmethod
    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""

    @abstractmethod
    def size(self, rel: str) -> int: ...

    @abstractmethod
    def read_bytes(self, rel: str) -> bytes: ...

    @abstractmethod
    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``[offset, offset + len(out))``; a short read raises EOFError."""

    def open_read(self, rel: str) -> RandomReader:
        """A handle for many ranged reads of one file (backends may keep it open)."""
        return _DelegatingReader(self, rel)

    def open_file(self, rel: str) -> FileReader:
        """Like ``open_read``, with the file's descriptor; only where ``direct_io``."""
        raise NotImplementedError(f"{type(self).__name__} has no direct I/O (direct_io is False)")

    @abstractmethod
    @contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        """A new file written sequentially; durable (fsync'd or uploaded) when the block exits cleanly."""
        yield  # type: ignore[misc]

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel) as f:
            f.write(data)

    @abstractmethod
    def make_dir(self, rel: str) -> None: ...

    @abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Remove a file or directory tree; missing is fine."""

    def modified(self, rel: str) -> float | None:
        """When the file ``rel`` was last written (unix seconds, the storage's own clock), or
        None when absent or unknown; compared only with other files of the same storage."""
        return None

    def is_link(self, rel: str) -> bool:
        """True when ``rel`` is a symbolic link (never on object stores): housekeeping removes
        the link itself and never acts on what it points to."""
        return False

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rename")

    def exchange(self, a: str, b: str) -> bool:
        """Swap two directories in one atomic step; False where the backend cannot.

        Overwriting a checkpoint uses it so that a reader finds the old or the new one at
        every instant; without it the commit falls back to two renames.
        """
        return False

    @contextmanager
    def fence(self, rel: str, timeout: float) -> Iterator[None]:
        """Hold the publish fence of directory ``rel`` for the block: one publish (a lease check
        and the renames after it) at a time among processes that take it. Raises
        ``TimeoutError`` after ``timeout`` seconds of waiting. Object stores have none (their
        commit is one PUT, see FORMAT.md "Leases")."""
        yield

    def evict(self, rel: str) -> None:  # noqa: B027 - a no-op is the right default
        """Drop cached copies of the durable file ``rel``, so that the next read comes from the
        device and not from memory (no-op where the backend keeps no cache)."""

    def sync_dir(self, rel: str) -> None:  # noqa: B027 - a no-op is the right default
        """Make a directory's entries durable (no-op where meaningless)."""

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` only if absent; True if this call created it."""
        if self.exists(rel):
            return False
        self.write_bytes(rel, data)
        return True
