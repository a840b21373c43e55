"""Object storage through fsspec: ``s3://bucket/prefix``, ``gcs://...``, ``memory://...``.

Object stores have no atomic rename, so this backend declares ``atomic_rename = False`` and
the core commits by writing a marker object last. What this module guarantees in exchange:

* an ``open_write`` block that raises leaves no object behind (a multipart upload in
  flight is aborted, anything already visible is deleted), so only clean writes look complete;
* metadata is never served from fsspec's listing cache, because other ranks write
  concurrently and a stale listing would hide their objects;
* transient failures (connection errors, timeouts, 5xx, throttling) are retried with
  exponential backoff on top of the backend's own per-request retries; missing objects
  and permission errors fail at once;
* the filesystem object is rebuilt after ``fork`` and dropped when pickled, since an
  async client bound to the parent's event loop and sockets is unusable in a child.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any, BinaryIO, TypeVar, cast

from .base import Storage
from .retry import RetryPolicy, call_with_retries, http_error, is_transient

_INSTALL_HINT = "pip install 'shardsafe[s3]'"

try:
    import fsspec
    from fsspec.spec import AbstractBufferedFile
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"object-storage URLs need fsspec (and s3fs for s3://): {_INSTALL_HINT}"
    ) from _e

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Protocols whose endpoint may come from SHARDSAFE_S3_ENDPOINT_URL / AWS_ENDPOINT_URL.
S3_PROTOCOLS = frozenset({"s3", "s3a"})
#: Protocols with a listing cache that must be off (other processes write under us).
_LISTING_CACHE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
ENDPOINT_ENV_VARS = ("SHARDSAFE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")

DEFAULT_READ_CHUNK = 64 << 20


def _storage_options(protocol: str, given: dict[str, Any] | None) -> dict[str, Any]:
    opts = dict(given or {})
    if protocol in S3_PROTOCOLS and "endpoint_url" not in opts:
        client_kwargs = opts.get("client_kwargs") or {}
        if "endpoint_url" not in client_kwargs:
            for name in ENDPOINT_ENV_VARS:
                if os.environ.get(name):
                    opts["endpoint_url"] = os.environ[name]
                    break
    if protocol in _LISTING_CACHE_PROTOCOLS:
        opts.setdefault("use_listings_cache", False)
    return opts


class FsspecStorage(Storage):
    """A :class:`Storage` over any fsspec URL; S3 via s3fs (``pip install 'shardsafe[s3]'``).

    ``storage_options`` go to the filesystem (``endpoint_url``, ``key``, ``secret``, ...); for
    S3 without an explicit endpoint, ``SHARDSAFE_S3_ENDPOINT_URL`` then ``AWS_ENDPOINT_URL``
    are used. ``retries``/``backoff`` set the retry policy, ``read_chunk_size`` the largest
    single ranged GET in :meth:`read_into` (bounds the temporary copy and the retried unit).
    """

    atomic_rename = False

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 10.0,
        read_chunk_size: int = DEFAULT_READ_CHUNK,
    ) -> None:
        super().__init__(str(url))
        if read_chunk_size <= 0:
            raise ValueError("read_chunk_size must be positive")
        self.protocol = fsspec.core.split_protocol(self.root)[0] or "file"
        self.storage_options = _storage_options(self.protocol, storage_options)
        self.retry = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max_backoff)
        self.read_chunk_size = read_chunk_size
        self._fs: Any = None
        self._fs_pid = -1
        self._root_path = ""
        self._conditional_put: bool | None = None  # None: not tried yet
        _ = self.fs  # fail now, with the install hint, if the backend is missing

    # -- filesystem handle -------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, rebuilt in a forked child (the parent's client is unusable there).

        fsspec caches instances per process and options, so storages with the same options
        share one client and its connection pool; a new client costs a few hundred ms.
        """
        pid = os.getpid()
        if self._fs is None or self._fs_pid != pid:
            try:
                fs, root_path = fsspec.core.url_to_fs(self.root, **self.storage_options)
            except ImportError as e:
                raise ImportError(f"{e} (for S3: {_INSTALL_HINT})") from e
            self._fs, self._root_path, self._fs_pid = fs, str(root_path).rstrip("/"), pid
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_fs_pid"] = -1
        return state

    def path(self, rel: str) -> str:
        """The backend path (no protocol) of ``rel``."""
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"storage path must be relative and stay under the root: {rel!r}")
        rel = rel.strip("/")
        if not rel:
            return self._root_path
        return posixpath.join(self._root_path, rel) if self._root_path else rel

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return call_with_retries(fn, self.retry, what)

    def _info(self, rel: str) -> dict[str, Any] | None:
        path = self.path(rel)
        try:
            return cast(
                dict[str, Any], self._call(f"stat {self.describe(rel)}", lambda: self.fs.info(path))
            )
        except FileNotFoundError:
            return None

    # -- queries -------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        # fsspec's generic exists() swallows every error; a transient one must not read as "absent".
        return self._info(rel) is not None

    def is_dir(self, rel: str) -> bool:
        """True when objects exist under the prefix ``rel/`` (object stores have no empty dirs)."""
        info = self._info(rel)
        return info is not None and info.get("type") == "directory"

    def modified(self, rel: str) -> float | None:
        info = self._info(rel)
        when = None if info is None else info.get("LastModified", info.get("mtime"))
        if isinstance(when, datetime):
            return when.timestamp()
        return float(when) if isinstance(when, (int, float)) else None

    def list_dir(self, rel: str) -> list[str]:
        path = self.path(rel)
        try:
            entries = self._call(
                f"list {self.describe(rel)}", lambda: self.fs.ls(path, detail=True)
            )
        except (FileNotFoundError, NotADirectoryError):
            return []
        own = self.fs._strip_protocol(path).rstrip("/")
        names = set()
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name == own:  # ls of an object lists the object itself
                continue
            names.add(posixpath.basename(name))
        names.discard("")
        return sorted(names)

    def size(self, rel: str) -> int:
        info = self._info(rel)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.describe(rel))
        return int(info["size"])

    # -- reads ---------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes:
        path = self.path(rel)
        return cast(bytes, self._call(f"read {self.describe(rel)}", lambda: self.fs.cat_file(path)))

    def _read_range(self, rel: str, path: str, start: int, end: int) -> bytes:
        return cast(
            bytes,
            self._call(
                f"read {self.describe(rel)}[{start}:{end}]",
                lambda: self.fs.cat_file(path, start=start, end=end),
            ),
        )

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """Ranged GETs of at most ``read_chunk_size`` bytes each, copied into ``out``."""
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        total = len(out)
        path = self.path(rel)
        done = 0
        while done < total:
            want = min(self.read_chunk_size, total - done)
            start = offset + done
            try:
                data = self._read_range(rel, path, start, start + want)
            except OSError as e:
                if http_error(e)[0] != 416:  # range starts past the end of the object
                    raise
                data = b""
            got = min(len(data), want)
            out[done : done + got] = data[:got]
            done += got
            if got < want:
                raise EOFError(
                    f"{self.describe(rel)}: wanted {total} bytes at offset {offset}, "
                    f"object ends after {done}"
                )

    # -- writes --------------------------------------------------------------------------

    @contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryIO]:
        """Stream an object; it appears only when the block exits cleanly.

        Parts are uploaded as the buffer fills (each request retried by the backend); the
        object is committed on exit. If the block raises, the upload is aborted and any
        object already visible under ``rel`` (an older one included) is deleted, so nothing
        that looks complete is left. An existing object is overwritten.
        """
        path = self.path(rel)
        f = self._call(f"open {self.describe(rel)}", lambda: self.fs.open(path, "wb"))
        try:
            yield cast(BinaryIO, f)
        except BaseException:
            self._abandon(f, rel)
            raise
        try:
            f.close()
        except BaseException:
            with suppress(Exception):
                f.discard()  # abort a multipart upload whose completion failed
            raise

    def _abandon(self, f: Any, rel: str) -> None:
        """Throw away a half-written file without committing it."""
        with suppress(Exception):
            f.discard()
        if isinstance(f, AbstractBufferedFile):
            f.closed = True  # close() would commit what was buffered
        else:
            with suppress(Exception):
                f.close()  # e.g. memory files are already in place; removed below
        try:
            self._remove_object(rel)
        except Exception as e:
            log.warning("could not remove partial %s: %s", self.describe(rel), e)

    def _remove_object(self, rel: str) -> None:
        path = self.path(rel)
        with suppress(FileNotFoundError):
            self._call(f"delete {self.describe(rel)}", lambda: self.fs.rm_file(path))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """One request (or a backend-managed multipart upload), retried as a whole."""
        path = self.path(rel)
        payload = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self._call(f"write {self.describe(rel)}", lambda: self.fs.pipe_file(path, payload))

    def make_dir(self, rel: str) -> None:
        """Nothing to do: prefixes exist while objects do."""

    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        if path == self._root_path:
            # Never hand the root to rm: for s3://bucket that would try to delete the bucket.
            for name in self.list_dir(rel):
                self.remove_tree(posixpath.join(rel, name) if rel else name)
            return
        with suppress(FileNotFoundError):
            self._call(f"remove {self.describe(rel)}", lambda: self.fs.rm(path, recursive=True))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` only if absent; True if this call created it.

        Uses a conditional put (``If-None-Match: *`` on S3, ``mode="create"`` in fsspec), which
        is race-free where the server honours it (AWS S3 and moto do). Where the backend
        rejects it as unsupported, falls back to check-then-write, which two writers can both
        win. An existence check comes first in every case, so a server that silently ignores
        the condition still degrades only to check-then-write. If a retried attempt finds the
        object present with exactly ``data`` in it, an earlier attempt whose reply was lost
        created it, and this returns True.
        """
        if self.exists(rel):
            return False
        path = self.path(rel)
        payload = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        if self._conditional_put is False:
            self.write_bytes(rel, payload)
            return True
        attempts = 0

        def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                self.fs.pipe_file(path, payload, mode="create")
                return True
            except Exception as e:
                status, code = http_error(e)
                taken = (
                    isinstance(e, FileExistsError) or status == 412 or code == "PreconditionFailed"
                )
                if not taken:
                    raise
            return attempts > 1 and self._content_is(rel, payload)

        try:
            created = self._call(f"create {self.describe(rel)}", attempt)
        except (TypeError, NotImplementedError) as e:
            return self._no_conditional_put(rel, payload, e)
        except OSError as e:
            status, code = http_error(e)
            if status == 501 or code == "NotImplemented" or e.errno == errno.ENOSYS:
                return self._no_conditional_put(rel, payload, e)
            raise
        self._conditional_put = True
        return created

    def _no_conditional_put(self, rel: str, data: bytes, why: BaseException) -> bool:
        log.warning(
            "%s: conditional put unsupported (%s); create_exclusive falls back to "
            "check-then-write, which is racy",
            self.describe(),
            why,
        )
        self._conditional_put = False
        if self.exists(rel):
            return False
        self.write_bytes(rel, data)
        return True

    def _content_is(self, rel: str, data: bytes) -> bool:
        try:
            return self.read_bytes(rel) == data
        except FileNotFoundError:
            return False


__all__ = ["FsspecStorage", "RetryPolicy", "call_with_retries", "http_error", "is_transient"]
