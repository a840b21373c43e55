"""``shardsafe convert SRC DST --to megatron``: a directory Megatron-Core's own ``load`` reads.

The escape hatch that makes trying shardsafe safe: any checkpoint we read becomes a
Megatron-Core ``torch_dist`` checkpoint (the layout of megatron-core 0.16: ``.metadata``,
``__0_*.distcp``, ``common.pt``, ``metadata.json``), which
``megatron.core.dist_checkpointing.load`` loads into any TP/PP layout. Tensors are stored whole
under their ``ShardedTensor`` keys (Megatron reads any box of them), ShardedObjects under their
unique keys (``key/shard_<offset>_<shape>``), the common state (with the checkpoint's
``content_metadata``, where Megatron keeps it) in ``common.pt``, which megatron-core 0.19
still reads first.
``metadata.json``, Megatron's commit marker, is written last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointExistsError, ValidationError
from .dcp import MEGATRON_COMMON_FILE, MEGATRON_CONFIG_FILE
from .dcp_writer import _SourcePlanner, save_through
from .native import source_content_metadata
from .publish import refuse_source_overlap, staged
from .source import Progress, TensorSource, tensor_nbytes

CONTENT_METADATA_KEY = "content_metadata"

MEGATRON_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def export_megatron(
    source: TensorSource,
    dst_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` as a Megatron-Core ``torch_dist`` checkpoint directory (one writer rank).
    The files appear in ``dst_dir`` only once all are written (``metadata.json`` last)."""
    dst = Path(dst_dir)
    refuse_source_overlap(source, dst)
    if (
        dst.exists()
        and any(dst.iterdir())
        and (not overwrite or not (dst / MEGATRON_CONFIG_FILE).is_file())
    ):
        raise CheckpointExistsError(
            f"{dst} is not empty"
            + (
                "; pass --overwrite to replace the Megatron checkpoint there"
                if (dst / MEGATRON_CONFIG_FILE).is_file()
                else "; only an existing Megatron checkpoint is ever replaced: choose an empty or new directory"
            )
        )

    keys = source.tensor_keys()
    state: dict[str, Any] = {}
    for key in keys:
        shape, dtype = source.tensor_meta(key)
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    object_keys: list[str] = getattr(source, "object_keys", list)()
    read_object = getattr(source, "read_object", None)
    for ukey in object_keys:
        if ukey in state:
            raise ValidationError(f"{ukey!r} names both a tensor and an object")
        assert read_object is not None
        # Megatron stores each ShardedObject as a one-element list; torch's writer saves a
        # non-tensor item with torch.save, which is what Megatron's reader loads
        state[ukey] = [read_object(ukey)]
    common = source.common()
    planner = _SourcePlanner(
        source, keys, progress, sum(tensor_nbytes(*source.tensor_meta(k)) for k in keys)
    )
    # one item per key, as Megatron writes: a ShardedObject's list must not be flattened into
    # "key.0.field" items
    planner.flatten_state_dict = False
    common = _without_sharded_places(
        dict(common) if isinstance(common, dict) else {"common": common}
    )
    content = source_content_metadata(source)
    if content is not None:  # Megatron keeps it in the common state, where its load returns it
        common.setdefault(CONTENT_METADATA_KEY, content)
    with staged(dst, _is_megatron_file, MEGATRON_CONFIG_FILE) as work:
        save_through(state, work, planner, single_file_per_rank=True)
        torch.save(common, work / MEGATRON_COMMON_FILE)
        (work / MEGATRON_CONFIG_FILE).write_text(json.dumps(MEGATRON_CONFIG))
    return dst


def _is_megatron_file(name: str) -> bool:
    return name in (".metadata", MEGATRON_COMMON_FILE, MEGATRON_CONFIG_FILE) or name.endswith(
        ".distcp"
    )


def _without_sharded_places(tree: Any) -> Any:
    """The common tree as Megatron keeps it: no lists holding only the ``None`` placeholders of
    sharded entries (a factory's list of pieces) and no dicts emptied by removing them.

    Megatron merges ``common.pt`` into the loaded tensors and refuses a value where a tensor goes.
    """
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            pruned = _without_sharded_places(v)
            if (isinstance(v, dict | list) and v) and not pruned:
                continue
            out[k] = pruned
        return out
    if isinstance(tree, list):
        if tree and all(v is None for v in tree):
            return []
        return [_without_sharded_places(v) for v in tree]
    return tree
