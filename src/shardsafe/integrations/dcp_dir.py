"""``shardsafe.load`` of a directory PyTorch DCP wrote (``dcp.save`` with its
``FileSystemWriter``): found by its ``.metadata`` file, read through the restricted DCP reader of
``convert/`` (imported on first use), into any layout, as Megatron's torch_dist directories are."""

from __future__ import annotations

import os
from typing import Any

from ..format import MANIFEST_NAME
from ..loading import StrictHandling


def is_dcp_dir(path: Any) -> bool:
    """A local directory holding DCP metadata (``.metadata`` or per-rank ``__N.metadata``),
    neither ours (no manifest) nor Megatron-Core's (no ``metadata.json``, loaded by its own)."""
    if not isinstance(path, str | os.PathLike) or "://" in os.fspath(path):
        return False
    root = os.fspath(path)
    if not os.path.isdir(root) or os.path.lexists(os.path.join(root, MANIFEST_NAME)):
        return False
    if os.path.lexists(os.path.join(root, "metadata.json")):
        return False
    if os.path.lexists(os.path.join(root, ".metadata")):
        return True
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(n.startswith("__") and n.endswith(".metadata") and n[2:-9].isdigit() for n in names)


def load_dcp_dir(template: Any, path: Any, strict: StrictHandling) -> Any:
    """``load`` from a DCP directory (never runs pickled code: the restricted reader)."""
    from ..convert.megatron_dist import load_dcp

    return load_dcp(template, path, strict)
