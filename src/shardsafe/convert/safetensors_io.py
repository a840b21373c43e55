"""The safetensors file format, written and read one tensor at a time.

The format is small enough to own: an 8-byte little-endian header length, a JSON header
mapping each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative
to the end of the header, which is padded with spaces to a multiple of 8), then the raw
little-endian bytes. Writing it here lets a shard of any size be produced while holding a
single tensor, and reading it needs no optional dependency.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..storage.local import open_in, open_regular
from .source import Shape, tensor_bytes, tensor_nbytes

_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _torch_name, _st_name in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if isinstance(getattr(torch, _torch_name, None), torch.dtype):
        _TO_NAME[getattr(torch, _torch_name)] = _st_name
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}

_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The format's name for ``dtype``, or None where it has none (e.g. complex128)."""
    return _TO_NAME.get(dtype)


def write_safetensors(
    path: str | os.PathLike[str],
    entries: Sequence[tuple[str, Shape, torch.dtype]],
    read: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
) -> int:
    """Write ``entries`` (name, shape, dtype) to ``path``, fetching each tensor with ``read(name)``
    only when its turn comes. Returns the number of data bytes written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    begin = 0
    for name, shape, dtype in entries:
        st = safetensors_dtype(dtype)
        if st is None:
            raise TypeError(f"{name!r}: safetensors has no {dtype} element type")
        end = begin + tensor_nbytes(shape, dtype)
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [begin, end]}
        begin = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in entries:
            tensor = read(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CorruptCheckpointError(
                    f"{name!r}: got {tuple(tensor.shape)} {tensor.dtype}, planned {tuple(shape)} {dtype}"
                )
            data = tensor_bytes(tensor)
            f.write(data)
            del tensor
            if on_tensor is not None:
                on_tensor(name, data.nbytes)
            del data
    return begin


class SafetensorsFile:
    """The header of one safetensors file, and its tensors on request."""

    def __init__(
        self, path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None
    ) -> None:
        """``path`` is a file the user named, or, with ``root``, a name read from a folder
        there, opened only through the checked opener (regular, inside, no link)."""
        self.path = Path(path) if root is None else Path(root) / os.fspath(path)
        self._root: str | None = None if root is None else os.fspath(root)
        self._name = "" if root is None else os.fspath(path)
        try:
            with self._open() as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise CorruptCheckpointError(f"{self.path}: truncated: no safetensors header")
                (length,) = struct.unpack("<Q", head)
                if length > min(_MAX_HEADER, size - 8):
                    raise CorruptCheckpointError(
                        f"{self.path}: header length {length} does not fit a {size}-byte file"
                    )
                header = json.loads(f.read(length))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.path}: file missing") from None
        except (OSError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{self.path}: unreadable safetensors header ({str(e)[:200]})"
            ) from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{self.path}: safetensors header is not an object")
        self.data_start = 8 + length
        self.file_size = size
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(f"{self.path}: __metadata__ is not an object")
        self.metadata: dict[str, str] = metadata
        self.entries: dict[str, tuple[Shape, torch.dtype, int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _FROM_NAME[info["dtype"]]
                shape = tuple(_natural(s) for s in info["shape"])
                begin, end = (_natural(x) for x in info["data_offsets"])
                if len(shape) > 64:
                    raise ValueError(f"{len(shape)} dimensions")
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(
                    f"{self.path}: bad header entry for {name!r} ({e!r})"
                ) from None
            if end - begin != tensor_nbytes(shape, dtype) or begin < 0:
                raise CorruptCheckpointError(
                    f"{self.path}: {name!r} spans bytes [{begin}, {end}) but is {shape} {dtype}"
                )
            self.entries[name] = (shape, dtype, begin, end)
        # File order, which is also the order that reads the file front to back.
        self.entries = dict(sorted(self.entries.items(), key=lambda kv: kv[1][2]))

    def read(self, name: str) -> torch.Tensor:
        shape, dtype, begin, end = self.entries[name]
        if self.data_start + end > self.file_size:
            raise CorruptCheckpointError(
                f"{self.path}: truncated: {name!r} needs bytes up to {self.data_start + end} of a {self.file_size}-byte file"
            )
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        buffer = bytearray(end - begin)
        try:
            f = self._open()
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path}: unreadable ({e})") from None
        with f:
            if self.data_start + end > os.fstat(f.fileno()).st_size:
                raise CorruptCheckpointError(f"{self.path}: truncated before {name!r}")
            f.seek(self.data_start + begin)
            if f.readinto(buffer) != len(buffer):
                raise CorruptCheckpointError(f"{self.path}: short read for {name!r}")
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)

    def _open(self) -> io.BufferedReader:
        if self._root is None:
            return open_regular(self.path)
        return open_in(self._root, self._name)


def _natural(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise ValueError(f"{str(value)[:40]} is not a non-negative integer")
    return value
