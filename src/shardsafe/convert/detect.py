"""Telling checkpoint formats apart by what is on disk, without unpickling anything."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointNotFoundError
from ..storage.local import open_regular, read_checked
from .dcp import MEGATRON_CONFIG_FILE, DcpSource, is_dcp_checkpoint
from .errors import UnsupportedFormatError
from .hf import HfSource
from .source import TensorSource
from .torch_file import TorchFileSource

FORMATS = ("dcp", "hf", "torch", "shardsafe")
SHARDSAFE_MANIFEST = "manifest.json"
_PICKLE_PROTOCOL_OPCODE = 0x80


def _is_torch_file(path: Path) -> bool:
    """A ``torch.save`` zip archive (it holds a ``data.pkl``), or a legacy pickle stream."""
    try:
        with open_regular(path) as f:
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as zf:
                    return any(name.endswith("data.pkl") for name in zf.namelist())
            f.seek(0)
            head = f.read(2)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise UnsupportedFormatError(f"{path}: unreadable ({str(e)[:200]})") from None
    return len(head) == 2 and head[0] == _PICKLE_PROTOCOL_OPCODE and 2 <= head[1] <= 5


def _is_megatron_dir(path: Path) -> bool:
    """Megatron-Core's ``metadata.json`` names the backend; DcpSource explains ones it cannot read."""
    try:
        config = json.loads(read_checked(str(path), MEGATRON_CONFIG_FILE, 1 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "sharded_backend" in config


def detect_format(path: str | os.PathLike[str]) -> str:
    """One of ``"dcp"``, ``"hf"``, ``"torch"`` or ``"shardsafe"``.

    Directories: ``manifest.json`` means shardsafe, a ``.metadata`` file DCP (Megatron-Core's
    ``torch_dist`` included), safetensors files Hugging Face. Files: ``.safetensors`` is
    Hugging Face, a ``torch.save`` archive or pickle is torch.
    """
    from ..storage import is_url

    if is_url(os.fspath(path)):
        from ..location import locate

        loc = locate(path)
        if loc.parent.exists(loc.join(SHARDSAFE_MANIFEST)):
            return "shardsafe"
        raise UnsupportedFormatError(
            f"{path}: no {SHARDSAFE_MANIFEST}; only shardsafe checkpoints are read from URLs"
        )
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / SHARDSAFE_MANIFEST).is_file():
            return "shardsafe"
        if is_dcp_checkpoint(p) or _is_megatron_dir(p):
            return "dcp"
        if any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json")):
            return "hf"
        raise UnsupportedFormatError(
            f"{p}: not a checkpoint directory this tool reads: expected {SHARDSAFE_MANIFEST} (shardsafe), "
            ".metadata (PyTorch DCP / Megatron torch_dist) or *.safetensors (Hugging Face)"
        )
    if p.name.endswith((".safetensors", ".safetensors.index.json")):
        return "hf"
    if _is_torch_file(p):
        return "torch"
    raise UnsupportedFormatError(f"{p}: not a .safetensors file nor a torch.save file")


Opener = Callable[..., TensorSource]
_OPENERS: dict[str, Opener] = {
    "dcp": lambda path, trust=False: DcpSource(path, trust=trust),
    "hf": lambda path, trust=False: HfSource(
        Path(path).parent if str(path).endswith(".index.json") else path
    ),
    "torch": lambda path, trust=False: TorchFileSource(path, trust=trust),
    "shardsafe": lambda path, trust=False: _open_shardsafe(path),
}


def _open_shardsafe(path: str | os.PathLike[str]) -> TensorSource:
    from .native import open_shardsafe  # the core reader; imported late to keep layers apart

    return open_shardsafe(path)


def register_source(fmt: str, opener: Opener) -> None:
    """Make :func:`open_source` read ``fmt`` with ``opener(path, trust=...)``."""
    _OPENERS[fmt] = opener


def open_source(
    path: str | os.PathLike[str], *, trust: bool = False, fmt: str | None = None
) -> TensorSource:
    """The TensorSource for ``path``, its format detected unless ``fmt`` is given."""
    fmt = fmt or detect_format(path)
    if fmt not in _OPENERS:
        raise UnsupportedFormatError(f"{path}: no reader registered for format {fmt!r}")
    return _OPENERS[fmt](path, trust=trust)
