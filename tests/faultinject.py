"""Fault injection on the real save path, for crash and resource tests.

A :class:`FaultyStorage` wraps any storage and lets writes through until a shared
:class:`ByteBudget` runs out, then calls the budget's action: raise ``ENOSPC`` (a full disk)
or ``SIGKILL`` this process (a crash in the middle of a write). The ``patch_*`` helpers put
it where shardsafe writes, inside the process that calls them (a rank), and return a function
that undoes the patch.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import shardsafe.commit
import shardsafe.location
import shardsafe.save_target
import shardsafe.save_write
from shardsafe.format import MANIFEST_NAME

Undo = Callable[[], None]


def kill_self() -> NoReturn:
    """SIGKILL this process: no ``finally``, no ``atexit``, no flush, like an OOM kill."""
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - the signal is delivered at once
        time.sleep(1)


def kill_every_rank(root: str, world: int) -> NoReturn:
    """SIGKILL every rank of a generation at once (each wrote its pid to ``root/pid-<rank>``),
    this one last: the whole job dies together, as when its node allocation is lost."""
    for rank in range(world):
        with open(os.path.join(root, f"pid-{rank}")) as f:
            pid = int(f.read())
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    kill_self()


def no_space() -> NoReturn:
    """What a write into a full file system raises."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class ByteBudget:
    """Bytes that may still be written (shared by every file of a storage); thread-safe."""

    def __init__(self, limit: int, action: Callable[[], Any]) -> None:
        self.left = limit
        self.action = action
        self._lock = threading.Lock()

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` bytes may go through (all of them, or what is left)."""
        with self._lock:
            granted = max(0, min(wanted, self.left))
            self.left -= granted
            return granted


class _LimitedWriter:
    """A write stream that lets bytes through while the budget lasts, then fails as configured."""

    def __init__(self, inner: Any, budget: ByteBudget) -> None:
        self._inner = inner
        self._budget = budget

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        granted = self._budget.take(len(view))
        if granted:
            _write_all(self._inner, view[:granted])
        if granted < len(view):
            self._budget.action()
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _write_all(f: Any, view: memoryview) -> None:
    while len(view):
        n = f.write(view)
        view = view[n if n is not None else len(view) :]


class FaultyStorage:
    """``inner`` with every new file (data files and manifest alike) drawing on ``budget``."""

    direct_io = False  # every write must pass through open_write to draw on the budget

    def __init__(self, inner: Any, budget: ByteBudget) -> None:
        self._inner = inner
        self._budget = budget

    @contextmanager
    def open_write(self, rel: str) -> Iterator[Any]:
        with self._inner.open_write(rel) as f:
            yield _LimitedWriter(f, self._budget)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel) as f:
            f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _replace(module: Any, name: str, value: Any) -> Undo:
    original = getattr(module, name)
    setattr(module, name, value)
    return lambda: setattr(module, name, original)


def patch_data_writes(limit: int, action: Callable[[], Any]) -> Undo:
    """Data files written by this process fail (``action``) once ``limit`` bytes are written."""
    budget = ByteBudget(limit, action)
    original = shardsafe.save_write.write_data_file

    def faulty(storage: Any, rel: str, *args: Any, **kwargs: Any) -> Any:
        return original(FaultyStorage(storage, budget), rel, *args, **kwargs)

    return _replace(shardsafe.save_write, "write_data_file", faulty)


def patch_slow_data_writes(seconds: float) -> Undo:
    """Every data file this process writes takes ``seconds`` longer (to make saves overlap)."""
    original = shardsafe.save_write.write_data_file

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    return _replace(shardsafe.save_write, "write_data_file", slow)


def patch_quota(root: str, limit: int) -> Undo:
    """Saves into directories under ``root`` see a disk with ``limit`` free bytes (ENOSPC after)."""
    budget = ByteBudget(limit, no_space)
    prefix = os.path.abspath(root)
    original = shardsafe.location.storage_for

    def storage_for(location: str) -> Any:
        storage = original(location)
        if os.path.abspath(location).startswith(prefix):
            return FaultyStorage(storage, budget)
        return storage

    return _replace(shardsafe.location, "storage_for", storage_for)


def patch_commit_then_die() -> Undo:
    """The coordinator writes the complete manifest into the work directory, then is SIGKILLed
    before the rename into place (on object stores the manifest is itself the commit, so
    there the kill comes just before it)."""

    def commit(loc: Any, token: str, manifest: Any, overwrite: bool, lease: Any = None) -> None:
        if loc.parent.atomic_rename:
            work = shardsafe.save_target.work_dir(loc, token)
            loc.parent.write_bytes(f"{work}/{MANIFEST_NAME}", manifest.dumps())
            loc.parent.sync_dir(work)
        kill_self()

    return _replace(shardsafe.commit, "commit", commit)


class _FlippingWriter:
    """Flips one bit of the first byte written (a device that corrupts what it stores)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._done = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if not self._done and len(view):
            self._done = True
            first = bytes([view[0] ^ 0x01])
            _write_all(self._inner, memoryview(first))
            _write_all(self._inner, view[1:])
            return len(view)
        _write_all(self._inner, view)
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CorruptingStorage:
    """``inner`` whose next ``times`` new files are stored with one bit flipped."""

    direct_io = False  # every write passes through open_write

    def __init__(self, inner: Any, left: list[int]) -> None:
        self._inner = inner
        self._left = left

    @contextmanager
    def open_write(self, rel: str) -> Iterator[Any]:
        with self._inner.open_write(rel) as f:
            if self._left[0] > 0:
                self._left[0] -= 1
                yield _FlippingWriter(f)
            else:
                yield f

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def patch_corrupting_writes(times: int) -> Undo:
    """The next ``times`` data files this process writes reach the disk with one bit flipped."""
    left = [times]
    original = shardsafe.save_write.write_data_file

    def corrupting(storage: Any, rel: str, *args: Any, **kwargs: Any) -> Any:
        return original(CorruptingStorage(storage, left), rel, *args, **kwargs)

    return _replace(shardsafe.save_write, "write_data_file", corrupting)
