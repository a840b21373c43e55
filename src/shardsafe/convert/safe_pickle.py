"""Loading the pickles found in foreign checkpoints without running code from them.

Two kinds of pickle occur:

* DCP's ``.metadata``: a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``.
  :class:`MetadataUnpickler` admits exactly the classes DCP (and Megatron-Core on top of it)
  writes there, by module and name; anything else is refused before it is looked up, so a
  ``__reduce__`` payload never runs.
* ``torch.save`` records (DCP object items, Megatron's ``common.pt``): loaded with
  ``torch.load(weights_only=True)``, torch's own restricted unpickler.

``trust=True`` switches both to the ordinary machinery, for files the user vouches for.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pathlib
import pickle
import re
from typing import IO, Any

import torch

from ..codec import check_loaded_tree, check_torch_archive, scan_pickle
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.local import open_regular
from .errors import UnsafePickleError


class MegatronMetadataStandIn:
    """Takes the place of Megatron-Core's ``MCoreMetadata`` / ``MCoreSavePlan``.

    Megatron defines these as empty marker classes (subclasses of DCP's ``Metadata`` and
    ``SavePlan`` in older releases); only their attributes matter, which pickle restores into
    ``__dict__`` without calling any method.
    """


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    # Megatron-Core stores every rank's save plan in the metadata (``all_local_plans``).
    "torch.distributed.checkpoint.planner": frozenset(
        {
            "SavePlan",
            "LoadPlan",
            "WriteItem",
            "ReadItem",
            "WriteItemType",
            "LoadItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        }
    ),
    # Where TensorProperties lived in torch <= 2.1.
    "torch.distributed._shard.sharded_tensor.metadata": frozenset(
        {"TensorProperties", "MEM_FORMAT_ENCODING"}
    ),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles
    "collections": frozenset({"OrderedDict"}),
}

# Paths are recorded as ``storage_meta.checkpoint_id``; the pure variants carry the same
# value without any file-system behaviour.
_PATHS: dict[str, type] = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}

_MEGATRON_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
_MEGATRON_STAND_INS = frozenset({"MCoreMetadata", "MCoreSavePlan"})


class MetadataUnpickler(pickle.Unpickler):
    """A pickle.Unpickler that resolves only DCP's metadata classes and plain data.

    The admitted globals are the ones ``.metadata`` files written by PyTorch and Megatron-Core
    refer to (see docs/dcp_layout.md); plain containers and scalars need no global at all.
    """

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED and name in _ALLOWED[module]:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _PATHS[name]
        if module == _MEGATRON_MODULE and name in _MEGATRON_STAND_INS:
            return MegatronMetadataStandIn
        raise UnsafePickleError(self._where, f"{module}.{name}", "DCP checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(self._where, f"persistent id {pid!r}", "DCP checkpoint metadata")


def load_metadata_pickle(data: bytes, where: str, *, trust: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` file's bytes, refusing anything but metadata classes."""
    try:
        if trust:
            return pickle.loads(data)  # the caller vouched for the file
        scan_pickle(data, where)
        return MetadataUnpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as e:  # a damaged pickle can fail in many ways; all mean the same here
        raise CorruptCheckpointError(
            f"{where}: not a readable metadata pickle ({type(e).__name__}: {e})"
        ) from e


# Harmless extras for payload pickles: Megatron keeps its argparse arguments in common.pt.
_PAYLOAD_EXTRAS: list[Any] = [argparse.Namespace]
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_torch_payload(
    file: IO[bytes] | str, where: str, *, trust: bool = False, mmap: bool = False
) -> Any:
    """``torch.load`` a record written by ``torch.save``, restricted to weights-only content.

    ``mmap`` (``file`` must then be a path) maps the storages instead of reading them, so a
    large file costs page cache rather than process memory.
    """
    try:
        if trust:
            return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)
        if isinstance(file, str):
            with open_regular(file) as f:
                sizes = check_torch_archive(
                    f, os.fstat(f.fileno()).st_size, where, allow_legacy=True
                )
        else:
            size = file.seek(0, os.SEEK_END)
            file.seek(0)
            sizes = check_torch_archive(file, size, where, allow_legacy=True)
        with torch.serialization.safe_globals(_PAYLOAD_EXTRAS):
            value = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        check_loaded_tree(value, sizes, where)  # shared references, repeated bytes
        return value
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        match = _REFUSED_GLOBAL.search(str(e))
        refused = match.group(1) if match else "content outside the weights-only subset"
        raise UnsafePickleError(where, refused, "a weights-only torch.save record") from None
    except Exception as e:
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save record ({type(e).__name__}: {e})"
        ) from e


_SCALARS: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, bytearray)


def is_weights_only_value(value: Any) -> bool:
    """True for what ``torch.load(weights_only=True)`` accepts back: tensors, numbers, strings,
    dtypes, and lists/tuples/dicts of those."""
    if type(value) in _SCALARS or isinstance(value, torch.dtype) or type(value) is torch.Size:
        return True
    if isinstance(value, torch.Tensor):
        return type(value) in (torch.Tensor, torch.nn.Parameter)
    if type(value) in (list, tuple, set):
        return all(is_weights_only_value(v) for v in value)
    if type(value) in (dict, collections.OrderedDict):
        return all(type(k) in (str, int) and is_weights_only_value(v) for k, v in value.items())
    return False
