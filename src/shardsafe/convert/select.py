"""Choosing, renaming and casting tensors on their way from one format to another.

Checkpoints from training frameworks rarely use the names an inference stack expects: a
model lives under a prefix (``model.``, ``module.``) and layers are spelled differently.
:class:`SelectedSource` is a view that applies such a mapping lazily, one tensor at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import IncompatibleRequestError, MissingKeyError
from .source import Shape, TensorSource

RenameRules = Sequence[tuple[str | re.Pattern[str], str]] | Callable[[str], str | None]
"""Either ``(regex, replacement)`` pairs applied in order with ``re.sub``, or a function of the
name returning the new name (or None to leave the tensor out). An empty result drops the key."""


def strip_prefix(key: str, prefix: str) -> str | None:
    """``key`` relative to the sub-tree ``prefix``, or None outside it. ``"model"`` and
    ``"model."`` both select ``model.*``; a prefix ending in ``.`` or ``/`` is taken literally."""
    if prefix.endswith((".", "/")):
        return key[len(prefix) :] if key.startswith(prefix) and len(key) > len(prefix) else None
    for sep in (".", "/"):
        if key.startswith(prefix + sep) and len(key) > len(prefix) + 1:
            return key[len(prefix) + 1 :]
    return None


def parse_rename_rules(text_or_file: str | os.PathLike[str]) -> list[tuple[re.Pattern[str], str]]:
    """Rules from text (or a file holding it): one ``regex => replacement`` per line; blank
    lines and lines starting with ``#`` are ignored. Replacements use ``re.sub`` syntax (``\\1``)."""
    text = str(text_or_file)
    if isinstance(text_or_file, os.PathLike) or ("=>" not in text and os.path.isfile(text)):
        text = Path(text_or_file).read_text()
    rules = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pattern, sep, replacement = stripped.partition("=>")
        if not sep or not pattern.strip():
            raise IncompatibleRequestError(
                f"rename rule on line {number} is not 'regex => replacement': {line!r}"
            )
        try:
            compiled = re.compile(pattern.strip())
        except re.error as e:
            raise IncompatibleRequestError(
                f"rename rule on line {number}: bad regex {pattern.strip()!r} ({e})"
            ) from None
        check_replacement(compiled, replacement.strip(), f"rename rule on line {number}")
        rules.append((compiled, replacement.strip()))
    return rules


def check_replacement(pattern: re.Pattern[str], replacement: str, where: str) -> None:
    """Refuse a replacement that names a group the regex lacks (``\\9``, ``\\g<x>``) now,
    not at the first matching key halfway through an export."""
    # the same groups, and a match of the empty string, so expand() checks every reference
    probe = re.compile(f"{pattern.pattern}|", pattern.flags).match("")
    if probe is None:
        return
    try:
        probe.expand(replacement)
    except (re.error, IndexError) as e:
        raise IncompatibleRequestError(
            f"{where}: bad replacement {replacement!r} for {pattern.pattern!r} ({e})"
        ) from None


def rename_function(rename: RenameRules | None) -> Callable[[str], str | None]:
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    compiled = [(re.compile(p) if isinstance(p, str) else p, r) for p, r in rename]
    for pattern, replacement in compiled:
        check_replacement(pattern, replacement, "rename rule")

    def apply(name: str) -> str | None:
        for pattern, replacement in compiled:
            name = pattern.sub(replacement, name)
        return name

    return apply


class SelectedSource:
    """A TensorSource showing part of another: the ``prefix`` sub-tree (prefix removed), names
    passed through ``rename``, floating-point tensors cast to ``dtype``."""

    def __init__(
        self,
        source: TensorSource,
        *,
        prefix: str | None = None,
        rename: RenameRules | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.source = source
        self.dtype = dtype
        renamer = rename_function(rename)
        self._names: dict[str, str] = {}
        keys = source.tensor_keys()
        for key in keys:
            name: str | None = key if prefix is None else strip_prefix(key, prefix)
            if name is None:
                continue
            name = renamer(name)
            if not name:
                continue
            if name in self._names:
                raise IncompatibleRequestError(
                    f"{self._names[name]!r} and {key!r} would both be written as {name!r}; adjust the rename rules"
                )
            self._names[name] = key
        if prefix is not None and keys and not self._names:
            sample = ", ".join(repr(k) for k in keys[:5])
            raise IncompatibleRequestError(
                f"no tensor lies under prefix {prefix!r}; keys look like {sample}"
            )

    def tensor_keys(self) -> list[str]:
        return list(self._names)

    def source_key(self, name: str) -> str:
        try:
            return self._names[name]
        except KeyError:
            raise MissingKeyError(f"no tensor {name!r} in the selection") from None

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        shape, dtype = self.source.tensor_meta(self.source_key(key))
        return shape, self._cast_to(dtype)

    def read_tensor(self, key: str) -> torch.Tensor:
        tensor = self.source.read_tensor(self.source_key(key))
        target = self._cast_to(tensor.dtype)
        return tensor if target == tensor.dtype else tensor.to(target)

    def common(self) -> dict[str, Any]:
        return self.source.common()

    def _cast_to(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype
