"""Writing a DCP checkpoint that ``torch.distributed.checkpoint.load`` reads, in one process.

``torch.distributed.checkpoint.save`` plans from the state dict and asks its planner for each
item's data only when it writes that item. Handing it ``meta`` tensors (shapes, no data) and a
planner that reads each tensor from the source on request keeps one tensor in memory, provided
every item goes to its own file: torch's writer holds all tensors of a file until it closes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CheckpointExistsError
from .dcp import METADATA_FILE, is_dcp_checkpoint
from .flatten import describe, flatten_state
from .source import Progress, TensorSource, read_checked, tensor_nbytes


class _SourcePlanner(DefaultSavePlanner):
    """Resolves the placeholder tensors of the state dict to the source's data, on demand."""

    def __init__(
        self, source: TensorSource, keys: list[str], progress: Progress | None, total: int
    ) -> None:
        super().__init__()
        self._source, self._keys, self._progress = source, set(keys), progress
        self._total, self._done = total, 0

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn not in self._keys:
            return super().lookup_object(index)
        tensor = read_checked(self._source, index.fqn)
        self._done += tensor.nbytes
        if self._progress is not None:
            self._progress(self._done, self._total, index.fqn)
        return tensor


def _clear(dst: Path) -> None:
    for path in dst.iterdir():
        if path.name == METADATA_FILE or (
            path.name.startswith("__") and path.name.endswith((".distcp", ".metadata"))
        ):
            path.unlink()


def export_dcp(
    source: TensorSource,
    dst_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` as a single-rank DCP checkpoint: every tensor under its key (unsharded),
    plus the common state flattened to ``a.b.c`` keys (values a weights-only load cannot read
    back are skipped with a warning). One ``.distcp`` file per item keeps memory to one tensor."""
    dst = Path(dst_dir)
    if is_dcp_checkpoint(dst):
        if not overwrite:
            raise CheckpointExistsError(
                f"{dst} already holds a DCP checkpoint; pass overwrite=True to replace it"
            )
        _clear(dst)
    dst.mkdir(parents=True, exist_ok=True)

    keys = source.tensor_keys()
    state: dict[str, Any] = {}
    for key in keys:
        shape, dtype = source.tensor_meta(key)
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    flat, unreadable = flatten_state(source.common())
    skipped = describe(unreadable) + [f"{k} (name taken by a tensor)" for k in flat if k in state]
    if skipped:
        warnings.warn(
            f"export_dcp: {len(skipped)} common entr{'y' if len(skipped) == 1 else 'ies'} skipped, not "
            f"readable with torch.load(weights_only=True): {', '.join(skipped)}",
            stacklevel=2,
        )
    state.update({k: v for k, v in flat.items() if k not in state})

    total = sum(tensor_nbytes(*source.tensor_meta(k)) for k in keys)
    planner = _SourcePlanner(source, keys, progress, total)
    writer = FileSystemWriter(dst, single_file_per_rank=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        torch.distributed.checkpoint.save(
            state, storage_writer=writer, planner=planner, no_dist=True
        )
    return dst
