"""The one interface every converter reads from: a flat set of named, global tensors.

Readers (DCP, Hugging Face, ``torch.save`` files, shardsafe) present whatever layout they
hold on disk as consolidated global tensors, one at a time, so that writers can stream:
no converter ever needs more than one tensor in memory at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import CorruptCheckpointError, MissingKeyError

Shape = tuple[int, ...]
Progress = Callable[[int, int, str], None]
"""Called after each tensor with ``(bytes_done, bytes_total, key)``."""


@runtime_checkable
class TensorSource(Protocol):
    def tensor_keys(self) -> list[str]:
        """Names of all tensors, in the order a writer should emit them."""
        ...

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        """Global shape and dtype of ``key`` without reading its data."""
        ...

    def read_tensor(self, key: str) -> torch.Tensor:
        """The full, consolidated global tensor ``key``, on CPU."""
        ...

    def common(self) -> dict[str, Any]:
        """Non-tensor state (step counters, configs, ...); may be empty."""
        ...


def tensor_nbytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def total_nbytes(source: TensorSource, keys: list[str] | None = None) -> int:
    return sum(
        tensor_nbytes(*source.tensor_meta(k))
        for k in (source.tensor_keys() if keys is None else keys)
    )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (no copy when it is contiguous), whatever its dtype."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def read_checked(source: TensorSource, key: str) -> torch.Tensor:
    """``read_tensor`` plus a check that it matches ``tensor_meta``: writers lay files out from the
    metadata before reading the data, so a mismatch would corrupt the output silently."""
    shape, dtype = source.tensor_meta(key)
    tensor = source.read_tensor(key)
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise CorruptCheckpointError(
            f"{key!r}: data is {tuple(tensor.shape)} {tensor.dtype} but the metadata says {shape} {dtype}"
        )
    return tensor.detach().cpu()


class DictSource:
    """A TensorSource over tensors held in memory (or produced on demand by callables).

    A value may be a tensor or a zero-argument callable returning one together with its
    ``(shape, dtype)``; the latter lets a test or a caller describe a model far larger than
    memory and have it materialised one tensor at a time.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor | tuple[Shape, torch.dtype, Callable[[], torch.Tensor]]],
        common: Mapping[str, Any] | None = None,
    ) -> None:
        self._tensors = dict(tensors)
        self._common = dict(common or {})

    def tensor_keys(self) -> list[str]:
        return list(self._tensors)

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        value = self._get(key)
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype
        return tuple(value[0]), value[1]

    def read_tensor(self, key: str) -> torch.Tensor:
        value = self._get(key)
        return value if isinstance(value, torch.Tensor) else value[2]()

    def common(self) -> dict[str, Any]:
        return dict(self._common)

    def _get(
        self, key: str
    ) -> torch.Tensor | tuple[Shape, torch.dtype, Callable[[], torch.Tensor]]:
        try:
            return self._tensors[key]
        except KeyError:
            raise MissingKeyError(f"no tensor {key!r} in this source") from None


def warn_unexported(source: TensorSource, what: str) -> None:
    """Warn, naming them, about the per-rank objects (ShardedObjects) an export leaves out:
    they have no place in a single-process format."""
    import warnings

    inner: Any = source
    while hasattr(inner, "source"):
        inner = inner.source
    manifest = getattr(inner, "manifest", None)
    keys = sorted(getattr(manifest, "objects", None) or ())
    if keys:
        shown = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
        warnings.warn(
            f"{what}: {len(keys)} per-rank object{'s' if len(keys) != 1 else ''} (ShardedObject) "
            f"not exported: {shown}; read them with CheckpointReader.read_object",
            stacklevel=3,
        )
