"""Byte stores: local POSIX files, and fsspec URLs (``s3://...``) with the ``[s3]`` extra."""

from __future__ import annotations

from .base import Storage
from .local import LocalStorage


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def storage_for(location: str) -> Storage:
    """The storage rooted at ``location``: a directory, or an fsspec URL such as ``s3://bucket/prefix``."""
    location = str(location)
    if location.startswith("file://"):
        location = location[len("file://") :]
    if is_url(location):
        from .fsspec import FsspecStorage  # optional extra

        return FsspecStorage(location)
    return LocalStorage(location)


__all__ = ["LocalStorage", "Storage", "is_url", "storage_for"]
