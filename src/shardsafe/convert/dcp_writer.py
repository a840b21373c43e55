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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .dcp import METADATA_FILE, is_dcp_checkpoint
from .flatten import describe, drop_emptied, flatten_state, weights_only_tree
from .publish import refuse_source_overlap, staged
from .source import Progress, TensorSource, read_checked, tensor_nbytes, warn_unexported


class _SourcePlanner(DefaultSavePlanner):
    """Resolves the placeholder tensors of the state dict to the source's data, on demand."""

    def __init__(
        self, source: TensorSource, keys: list[str], progress: Progress | None, total: int
    ) -> None:
        super().__init__()
        self._source, self._keys, self._progress = source, set(keys), progress
        self._total, self._done = total, 0
        self.failure: CheckpointError | None = None

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn not in self._keys:
            return super().lookup_object(index)
        try:
            tensor = read_checked(self._source, index.fqn)
        except CheckpointError as e:  # torch wraps it in a CheckpointException with a traceback
            self.failure = e
            raise
        self._done += tensor.nbytes
        if self._progress is not None:
            self._progress(self._done, self._total, index.fqn)
        return tensor


def _is_dcp_file(name: str) -> bool:
    return name == METADATA_FILE or (
        name.startswith("__") and name.endswith((".distcp", ".metadata"))
    )


def save_through(
    state: dict[str, Any], dst: Path, planner: _SourcePlanner, *, single_file_per_rank: bool
) -> None:
    """``torch.distributed.checkpoint.save`` in this process; a source that fails to read
    surfaces as its own CheckpointError, anything else torch raises as one line."""
    writer = FileSystemWriter(dst, single_file_per_rank=single_file_per_rank)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            torch.distributed.checkpoint.save(
                state, storage_writer=writer, planner=planner, no_dist=True
            )
    except (Exception, CheckpointException) as e:  # a BaseException, for all ranks' failures
        if planner.failure is not None:
            raise planner.failure from None
        failures = getattr(e, "failures", None)
        cause: Any = next(iter(failures.values()))[0] if failures else e
        if isinstance(cause, CheckpointError):
            raise cause from None
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CorruptCheckpointError(
            f"torch.distributed.checkpoint could not write the export: {type(cause).__name__}: {first}"
        ) from None


def export_dcp(
    source: TensorSource,
    dst_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` as a single-rank DCP checkpoint: every tensor under its key (unsharded),
    plus the common state flattened to ``a.b.c`` keys (values a weights-only load cannot read
    back are skipped with a warning). One ``.distcp`` file per item keeps memory to one tensor.
    The files appear in ``dst_dir`` only once all are written; a destination that is, holds or
    lies inside the source is refused."""
    dst = Path(dst_dir)
    refuse_source_overlap(source, dst)
    if is_dcp_checkpoint(dst) and not overwrite:
        raise CheckpointExistsError(
            f"{dst} already holds a DCP checkpoint; pass overwrite=True to replace it"
        )

    warn_unexported(source, "export_dcp")
    keys = source.tensor_keys()
    state: dict[str, Any] = {}
    for key in keys:
        shape, dtype = source.tensor_meta(key)
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    # Nested common state stays nested: DCP flattens it itself and records the paths
    # (planner_data), so torch.distributed.checkpoint.load and our reader rebuild the nesting.
    common, unreadable = weights_only_tree(source.common())
    flat, _ = flatten_state(common)
    drop_emptied(flat, keys)
    taken = [k for k in flat if k in state]
    skipped = describe(unreadable) + [f"{k} (name taken by a tensor)" for k in taken]
    if skipped:
        warnings.warn(
            f"export_dcp: {len(skipped)} common entr{'y' if len(skipped) == 1 else 'ies'} not "
            f"exported: {', '.join(skipped)}",
            stacklevel=2,
        )
    for name, value in common.items():
        if name in state:
            continue
        if isinstance(value, dict):
            value = _prune(value, str(name), set(taken), keys)
            if value is None:
                continue
        state[name] = value

    total = sum(tensor_nbytes(*source.tensor_meta(k)) for k in keys)
    planner = _SourcePlanner(source, keys, progress, total)
    # written beside, moved in once complete: a failed export leaves dst as it was
    with staged(dst, _is_dcp_file, METADATA_FILE) as work:
        save_through(state, work, planner, single_file_per_rank=False)
    return dst


def _prune(tree: dict[str, Any], path: str, taken: set[str], tensor_keys: list[str]) -> Any:
    """``tree`` without entries whose dotted name a tensor holds, or emptied by the export."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{path}.{k}"
        if name in taken:
            continue
        if isinstance(v, dict) and v:
            v = _prune(v, name, taken, tensor_keys)
            if v is None:
                continue
        elif isinstance(v, dict) and any(t.startswith(f"{name}.") for t in tensor_keys):
            continue
        out[k] = v
    if not out and (tree or any(t.startswith(f"{path}.") for t in tensor_keys)):
        return None
    return out
