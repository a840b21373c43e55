"""Where an export may write, and how its files appear there.

Two promises every file-system writer keeps. An export never writes where it reads: a
destination that is, contains or lies inside the source is refused before anything is
touched (replacing files while later tensors are still read from them destroys the source, or
worse, writes wrong tensors without a word). And an export that fails leaves nothing
half-written: the files are written into a hidden sibling directory and moved into place only
once every one of them is complete.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import IncompatibleRequestError
from ..location import TMP_MARK
from ..storage import is_url


def canonical(path: str | os.PathLike[str]) -> str:
    """``path`` with symlinks, ``.`` and ``..`` resolved (a URL: its key normalised), so two
    spellings of one place compare equal."""
    text = os.fspath(path)
    if is_url(text):
        scheme, _, rest = text.partition("://")
        bucket, _, key = rest.partition("/")
        key = posixpath.normpath("/" + key).lstrip("/")
        return f"{scheme.lower()}://{bucket}/{key}".rstrip("/")
    return os.path.realpath(text)


def overlap(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str | None:
    """How ``dst`` overlaps ``src`` (``"is"``, ``"lies inside"``, ``"contains"``), or None."""
    a, b = canonical(src), canonical(dst)
    if is_url(a) != is_url(b):
        return None
    sep = "/" if is_url(a) else os.sep
    if a == b:
        return "is"
    if b.startswith(a.rstrip(sep) + sep):
        return "lies inside"
    if a.startswith(b.rstrip(sep) + sep):
        return "contains"
    return None


def refuse_overlap(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Raise when writing ``dst`` would replace or disturb the files of ``src``."""
    how = overlap(src, dst)
    if how is not None:
        raise IncompatibleRequestError(
            f"the destination {os.fspath(dst)} {how} the source {os.fspath(src)}: an export "
            "never writes where it reads; write to a new path, check it, then move it over the "
            "old one yourself"
        )


def source_path(source: Any) -> str | None:
    """The path a TensorSource reads from (through selection views), when it says."""
    while True:
        path = getattr(source, "path", None)
        if path is not None:
            return os.fspath(path)
        if not hasattr(source, "source"):
            return None
        source = source.source


def refuse_source_overlap(source: Any, dst: str | os.PathLike[str]) -> None:
    path = source_path(source)
    if path is not None:
        refuse_overlap(path, dst)


@contextmanager
def staged(dst: Path, own: Callable[[str], bool], last: str | None) -> Iterator[Path]:
    """A fresh hidden sibling of ``dst`` to write an export into; on success its files replace
    ``dst``'s (the whole directory when ``dst`` is new or empty, else the files ``own`` claims,
    ``last`` — the format's commit marker — moved last and removed first); on failure it is
    deleted and ``dst`` is as it was."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = dst.parent / f".{dst.name}{TMP_MARK}{uuid.uuid4().hex[:16]}"
    work.mkdir()
    try:
        yield work
        _publish(work, dst, own, last)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(work: Path, dst: Path, own: Callable[[str], bool], last: str | None) -> None:
    if not os.path.lexists(dst) or (
        dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
    ):
        os.replace(work, dst)  # an empty directory is replaced in one rename
        return
    new = sorted(p.name for p in work.iterdir())
    if last is not None and (dst / last).exists():
        (dst / last).unlink()  # the old export stops being one before any file changes
    for path in dst.iterdir():
        if path.is_file() and own(path.name) and path.name not in new:
            path.unlink()
    for name in sorted(new, key=lambda n: n == last):
        os.replace(work / name, dst / name)
