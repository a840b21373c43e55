"""Where a checkpoint lives: its parent storage and its own name, and the helper names beside it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CheckpointError
from .storage import Storage, is_url, storage_for

TMP_MARK = ".shardsafe-tmp-"
OLD_MARK = ".shardsafe-old-"
LOCK_SUFFIX = ".shardsafe-lock"
DAMAGED_SUFFIX = ".shardsafe-damaged"  # beside a committed checkpoint that failed to load


@dataclass(frozen=True)
class Location:
    """A checkpoint directory ``name`` inside the storage ``parent``."""

    parent: Storage
    name: str
    url: str

    def tmp_name(self, token: str) -> str:
        return f".{self.name}{TMP_MARK}{token}"

    def old_name(self, token: str) -> str:
        return f".{self.name}{OLD_MARK}{token}"

    @property
    def lock_name(self) -> str:
        return f".{self.name}{LOCK_SUFFIX}"

    def join(self, *parts: str) -> str:
        return "/".join((self.name, *parts))


def locate(path: str | os.PathLike[str]) -> Location:
    text = os.fspath(path)
    if not text:
        raise CheckpointError("checkpoint path is empty")
    if is_url(text):
        base, _, name = text.rstrip("/").rpartition("/")
        if not name or base.endswith(":/"):
            raise CheckpointError(
                f"{text}: a checkpoint URL needs a name after the bucket, e.g. s3://bucket/run1/step100"
            )
        return Location(storage_for(base), name, text.rstrip("/"))
    full = os.path.abspath(text)
    parent, name = os.path.split(full.rstrip(os.sep))
    if not name:
        raise CheckpointError(f"{text}: a checkpoint cannot be the file-system root")
    return Location(storage_for(parent), name, full)
