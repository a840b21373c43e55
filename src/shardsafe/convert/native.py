"""shardsafe's own format as a conversion source and target.

Reading is :class:`shardsafe.CheckpointReader` (it already presents consolidated tensors).
Writing is an ordinary :meth:`shardsafe.Saver.save` by this process alone, whose tensors
stream (:class:`shardsafe.save_write.StreamedTensor`): one tensor is read from the source,
checksummed and appended to the data file before the next is read, so importing a model
needs about one tensor's worth of memory. The result is an ordinary committed checkpoint,
loadable into any layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..checksum import DEFAULT_BLOCK_BYTES
from ..dist import Comm
from ..format import MANIFEST_NAME, Manifest
from ..loading import content_metadata_of
from ..location import locate
from ..reader import CheckpointReader
from ..save_write import StreamedTensor
from ..saver import Saver
from ..sharding import Path, ShardedTensor, SplitStateDict
from .publish import refuse_source_overlap
from .source import (
    Progress,
    TensorSource,
    read_checked,
    tensor_nbytes,
    total_nbytes,
    warn_unexported,
)


def open_shardsafe(path: str | os.PathLike[str], *, trust: bool = False) -> CheckpointReader:
    """A TensorSource over a shardsafe checkpoint (``trust`` is irrelevant: nothing is unpickled)."""
    return CheckpointReader(path)


def export_shardsafe(
    source: TensorSource,
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Manifest:
    """Write every tensor of ``source`` (whole, one piece each), its common state and, from a
    shardsafe checkpoint, its ``content_metadata`` to ``dst`` with a one-process save (lease,
    file check and atomic commit as any save's)."""
    refuse_source_overlap(source, dst)
    warn_unexported(source, "export_shardsafe")
    keys = source.tensor_keys()
    total = total_nbytes(source, keys)
    done = [0]

    def reader(key: str, nbytes: int) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            tensor = read_checked(source, key)
            done[0] += nbytes
            if progress is not None:
                progress(done[0], total, key)
            return tensor

        return read

    tensors: list[tuple[Path, ShardedTensor]] = []
    for key in keys:
        shape, dtype = source.tensor_meta(key)
        read = reader(key, tensor_nbytes(shape, dtype))
        tensors.append(((key,), StreamedTensor.whole(key, shape, dtype, read)))
    state = SplitStateDict(tensors=tensors, common=source.common())
    saver = Saver(Comm(), files_per_rank=1, block_bytes=block_bytes)
    try:
        saver.save(
            state, dst, overwrite=overwrite, content_metadata=source_content_metadata(source)
        )
    finally:
        saver.close()
    loc = locate(dst)
    rel = loc.join(MANIFEST_NAME)
    return Manifest.loads(loc.parent.read_bytes(rel), loc.parent.describe(rel))


def source_content_metadata(source: Any) -> dict[str, Any] | None:
    """The ``content_metadata`` of a shardsafe checkpoint being exported (through wrappers
    such as a key selection), or None."""
    for _ in range(8):
        manifest = getattr(source, "manifest", None)
        if isinstance(manifest, Manifest):
            return content_metadata_of(manifest, f"{getattr(source, 'path', '')}")
        source = getattr(source, "source", None)
        if source is None:
            return None
    return None
