"""Names of tensor element types as they appear in the manifest."""

from __future__ import annotations

import torch

from .errors import CorruptCheckpointError

_SUPPORTED: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        getattr(torch, name, None)
        for name in (
            "float64",
            "float32",
            "float16",
            "bfloat16",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "complex64",
            "complex128",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "bool",
        )
    )
    if isinstance(d, torch.dtype)
)
_BY_NAME = {str(d).removeprefix("torch."): d for d in _SUPPORTED}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses element types the format does not define."""
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise TypeError(
            f"tensors of dtype {dtype} cannot be checkpointed; supported: {sorted(_BY_NAME)}"
        )
    return name


def dtype_from_name(name: str, where: str = "manifest") -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(
            f"{where}: unknown dtype {name!r}; this version of shardsafe knows {sorted(_BY_NAME)}"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return _SUPPORTED
