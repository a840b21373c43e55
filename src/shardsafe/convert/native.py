"""shardsafe's own format as a conversion source and target.

Reading is :class:`shardsafe.CheckpointReader` (it already presents consolidated tensors).
Writing streams: one tensor is read from the source, checksummed and appended to the data
file before the next is read, so importing a model needs about one tensor's worth of memory.
The result is an ordinary committed checkpoint, loadable into any layout.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from .._version import __version__
from ..checksum import DEFAULT_BLOCK_BYTES
from ..codec import encode, tensor_bytes
from ..commit import commit
from ..dtypes import dtype_name
from ..engine import write_data_file
from ..format import Extent, FileEntry, Manifest, StoredPiece, TensorEntry
from ..location import locate
from ..reader import CheckpointReader
from ..save_target import abort, begin, file_name, work_dir
from .publish import refuse_source_overlap
from .source import Progress, TensorSource, read_checked, total_nbytes, warn_unexported


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
    """Write every tensor of ``source`` (whole, one piece each) and its common state to ``dst``."""
    refuse_source_overlap(source, dst)
    loc = locate(dst)
    token = uuid.uuid4().hex[:16]
    lease = begin(loc, token, overwrite)
    warn_unexported(source, "export_shardsafe")
    try:
        keys = source.tensor_keys()
        metas = {k: source.tensor_meta(k) for k in keys}
        total = total_nbytes(source, keys)
        common = encode(source.common(), "c.")

        def items() -> Iterator[tuple[Any, Any]]:
            done = 0
            for key in keys:
                tensor = read_checked(source, key)
                yield ("p", key), tensor_bytes(tensor)
                done += tensor.numel() * tensor.element_size()
                if progress is not None:
                    progress(done, total, key)
            for blob_id, data in common.blobs.items():
                yield ("b", blob_id), data

        name = file_name(loc, token, 0, 0)
        extents, size = write_data_file(
            loc.parent, f"{work_dir(loc, token)}/{name}", items(), block_bytes
        )
        extents = {
            k: Extent(name, e.byte_offset, e.nbytes, e.checksums) for k, e in extents.items()
        }
        tensors = {}
        for key in keys:
            shape, dtype = metas[key]
            piece = StoredPiece((0,) * len(shape), tuple(shape), None, extents[("p", key)])
            tensors[key] = TensorEntry(dtype_name(dtype), tuple(shape), (piece,))
        manifest = Manifest(
            world_size=1,
            block_bytes=block_bytes,
            files={name: FileEntry(size, 0)},
            tensors=tensors,
            objects={},
            blobs={bid: e for (kind, bid), e in extents.items() if kind == "b"},
            common=common.node,
            created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            library_version=__version__,
        )
        lease.check()
        commit(loc, token, manifest, overwrite)
    except BaseException:
        abort(loc, token, lease)
        raise
    lease.release()
    return manifest
