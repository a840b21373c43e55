"""Hugging Face checkpoint folders: ``model.safetensors``, or shards plus an index.

The layout matches what ``transformers``' ``save_pretrained`` writes, so that
``from_pretrained`` loads the result directly: a single ``model.safetensors``, or
``model-0000K-of-0000N.safetensors`` files with ``model.safetensors.index.json`` mapping every
tensor name to its file. Shards are written one tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleRequestError,
    MissingKeyError,
)
from ..storage.local import read_checked as read_file
from .errors import UnsupportedFormatError
from .flatten import common_leaves
from .publish import refuse_source_overlap, staged
from .safetensors_io import SafetensorsFile, safetensors_dtype, write_safetensors
from .select import RenameRules, SelectedSource, parse_rename_rules, strip_prefix
from .source import Progress, Shape, TensorSource, read_checked, tensor_nbytes, warn_unexported

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: the files an export writes (and an overwrite replaces); others in the directory stay
OWN_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
MAX_SHARD_SIZE = 2**60
"""Larger shard sizes are refused as typos (an exabyte file)."""
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

__all__ = ["HfSource", "export_hf", "parse_rename_rules", "parse_size"]


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``1024`` -> 1024 (as transformers reads them)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
        if match is None or len(match.group(1)) > 24:  # no arithmetic on 400 digits
            shown = size if len(size) <= 40 else f"{size[:37]}..."
            raise IncompatibleRequestError(
                f"cannot read {shown!r} as a size; use e.g. 5GB, 500MB or 2GiB"
            )
        value = int(Fraction(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise IncompatibleRequestError(f"a shard size must be positive, not {size!r}")
    if value > MAX_SHARD_SIZE:
        shown = str(size) if len(str(size)) <= 40 else f"{str(size)[:37]}..."
        raise IncompatibleRequestError(
            f"a shard size of {shown!r} is beyond any disk; use e.g. 5GB, 500MB or 2GiB"
        )
    return value


def _plan_shards(
    entries: list[tuple[str, Shape, torch.dtype]], limit: int
) -> list[list[tuple[str, Shape, torch.dtype]]]:
    """Consecutive runs of at most ``limit`` bytes; a tensor larger than that gets a shard of its own."""
    shards: list[list[tuple[str, Shape, torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = tensor_nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def export_hf(
    source: TensorSource,
    dst_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
    rename: RenameRules | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the tensors of ``source`` as a Hugging Face safetensors folder; returns the files written.

    ``prefix`` selects a sub-tree (removing the prefix), ``rename`` maps names (regex rules or
    a function), ``dtype`` casts floating-point tensors. Existing ``model*.safetensors`` files
    in ``dst_dir`` are replaced only with ``overwrite``; other files (``config.json``, tokenizer)
    are left alone. Memory stays within about one tensor. The new files replace the old ones
    only once all are written; the common (non-tensor) state has no place in safetensors and
    is named in a warning.
    """
    refuse_source_overlap(source, dst_dir)
    view = SelectedSource(source, prefix=prefix, rename=rename, dtype=dtype)
    entries = [(name, *view.tensor_meta(name)) for name in view.tensor_keys()]
    unsupported = [f"{n} ({d})" for n, _, d in entries if safetensors_dtype(d) is None]
    if unsupported:
        raise IncompatibleRequestError(
            f"safetensors cannot hold: {', '.join(unsupported)}; pass dtype= to cast"
        )
    limit = parse_size(max_shard_size)

    dst = Path(dst_dir)
    if dst.exists() and not dst.is_dir():
        raise CheckpointExistsError(f"{dst} is a file, not a folder; pick another path")
    stale = sorted(p for p in dst.iterdir() if OWN_FILES.fullmatch(p.name)) if dst.is_dir() else []
    if stale and not overwrite:
        raise CheckpointExistsError(
            f"{dst} already holds {', '.join(p.name for p in stale)}; pass overwrite=True to replace them"
        )
    _warn_common_dropped(source, prefix)
    warn_unexported(source, "export_hf")
    shards = _plan_shards(entries, limit)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(tensor_nbytes(s, d) for _, s, d in entries)
    done = 0

    def advance(name: str, nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total, name)

    with staged(
        dst,
        lambda n: OWN_FILES.fullmatch(n) is not None,
        INDEX_FILE if len(shards) > 1 else SINGLE_FILE,
    ) as work:
        for file_name, shard in zip(names, shards, strict=True):
            # Within a file, wider elements first keeps every tensor aligned to its element size.
            ordered = sorted(shard, key=lambda e: -e[2].itemsize)
            write_safetensors(
                work / file_name, ordered, lambda n: read_checked(view, n), on_tensor=advance
            )
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {
                    name: file
                    for file, shard in zip(names, shards, strict=True)
                    for name, _, _ in shard
                },
            }
            (work / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [dst / n for n in names] + ([dst / INDEX_FILE] if len(shards) > 1 else [])


def _warn_common_dropped(source: TensorSource, prefix: str | None) -> None:
    """Name the common-state entries a safetensors folder cannot hold (never drop silently);
    with a ``prefix``, those of the selected sub-tree."""
    try:
        leaves = common_leaves(source.common(), source.tensor_keys())
    except RecursionError:
        leaves = {("(common state)",): None}
    # named down to the first list index: optim.param_groups, not each of its fields
    short = {
        ".".join(path[: next((i for i, c in enumerate(path) if c.isdigit()), None)]) or "(root)"
        for path in leaves
    }
    names = sorted(n for n in short if prefix is None or strip_prefix(n, prefix) is not None)
    if names:
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        warnings.warn(
            f"export_hf: {len(names)} common (non-tensor) entr{'y' if len(names) == 1 else 'ies'} "
            f"not exported, safetensors holds tensors only: {shown}",
            stacklevel=3,
        )


MAX_INDEX_BYTES = 256 << 20
"""A ``model.safetensors.index.json`` larger than this is refused unread."""


def _find_index(path: Path) -> Path | None:
    if os.path.lexists(path / INDEX_FILE):
        return path / INDEX_FILE
    indexes = sorted(path.glob("*.safetensors.index.json"))
    return indexes[0] if len(indexes) == 1 else None


class HfSource:
    """A TensorSource over a Hugging Face folder (an index and its shards, or safetensors files),
    or over a single ``.safetensors`` file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.path}: no such file or directory")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if self.path.is_file():
            self._files[""] = shard = SafetensorsFile(self.path)
            self._where = dict.fromkeys(shard.entries, "")
            return
        index = _find_index(self.path)
        if index is not None:
            self._read_index(index)
            return
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UnsupportedFormatError(f"{self.path}: no *.safetensors files or index")
        for file in files:
            for name in self._file(file.name).entries:
                self._add(name, file.name)

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(read_file(str(self.path), index.name, MAX_INDEX_BYTES))[
                "weight_map"
            ]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{index}: unreadable index ({str(e)[:200]})") from None
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str):
                raise CorruptCheckpointError(f"{index}: {name!r} names no file ({file_name!r:.80})")
            shard = self._file(file_name)
            if name not in shard.entries:
                raise CorruptCheckpointError(
                    f"{shard.path}: lacks {name!r}, which {index.name} places there"
                )
            self._add(name, str(file_name))

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            if "\0" in name or "/" in name or name in ("", ".", ".."):
                raise CorruptCheckpointError(
                    f"{self.path}: the index points outside the folder or at no file ({name[:80]!r})"
                )
            self._files[name] = SafetensorsFile(name, root=self.path)
        return self._files[name]

    def _add(self, name: str, file_name: str) -> None:
        if self._where.setdefault(name, file_name) != file_name:
            raise CorruptCheckpointError(
                f"{self.path}: {name!r} appears in both {self._where[name]} and {file_name}"
            )

    def tensor_keys(self) -> list[str]:
        return list(self._where)

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        shape, dtype, _, _ = self._shard(key).entries[key]
        return shape, dtype

    def read_tensor(self, key: str) -> torch.Tensor:
        return self._shard(key).read(key)

    def common(self) -> dict[str, Any]:
        return {}

    def _shard(self, key: str) -> SafetensorsFile:
        try:
            return self._files[self._where[key]]
        except KeyError:
            raise MissingKeyError(f"{self.path}: no tensor {key!r}") from None
