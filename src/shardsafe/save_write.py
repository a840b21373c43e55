"""The write step of a save: each rank writes its share of a plan into its data files.

:func:`encode_share` encodes the objects this rank writes (and, on the coordinator, the
common state); :func:`write_share` lays its items out in ``files_per_rank`` data files,
written in parallel, with per-block checksums, optionally read back and compared
(``verify_after_write``). An async save under a staging budget writes in :func:`waves`
whose records :func:`merge_results` joins into one. A :class:`StreamedTensor` is read only
when the writer reaches it (:class:`Deferred`), so a converter holds one tensor at a time.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .codec import encode, tensor_bytes
from .directio import DirectIO
from .engine import DEFAULT_MAX_BUFFER, split_balanced, verify_written, write_data_file
from .errors import CorruptCheckpointError
from .format import Extent
from .save_plan import PlannedSave
from .save_target import check_work_dir, file_name, work_dir
from .sharding import ShardedTensor
from .storage import Storage

log = logging.getLogger("shardsafe")


@dataclass
class ShareItems:
    """Everything one rank writes: (identity, bytes) items plus the encoded objects/common state."""

    items: list[tuple[Any, Any]]
    objects: dict[int, Any]
    common: Any


@dataclass
class StreamedTensor(ShardedTensor):
    """A whole tensor whose bytes ``read()`` gives only when the writer reaches it: a
    converter streams a model through :meth:`shardsafe.saver.Saver.save` one tensor at a
    time. ``data`` is a meta tensor of its shape and dtype (planning needs no more)."""

    read: Callable[[], torch.Tensor] | None = None

    @classmethod
    def whole(
        cls, key: str, shape: Sequence[int], dtype: torch.dtype, read: Callable[[], torch.Tensor]
    ) -> StreamedTensor:
        dims = tuple(int(s) for s in shape)
        meta = torch.empty(dims, dtype=dtype, device="meta")
        return cls(key, meta, dtype, dims, dims, (0,) * len(dims), read=read)

    def item(self) -> Deferred:
        """The write item of this tensor: read and checked against its description when written."""

        def read() -> Any:
            assert self.read is not None
            t = self.read()
            if tuple(t.shape) != self.local_shape or t.dtype != self.dtype:
                raise CorruptCheckpointError(
                    f"{self.key!r}: data is {tuple(t.shape)} {t.dtype} but it was described as "
                    f"{self.local_shape} {self.dtype}; nothing was committed"
                )
            return tensor_bytes(t.detach().cpu())

        return Deferred(self.numel * self.dtype.itemsize, read)


@dataclass
class Deferred:
    """An item whose bytes are produced by ``read()`` when the writer reaches it."""

    nbytes: int
    read: Callable[[], Any]

    def __len__(self) -> int:
        return self.nbytes

    def ready(self) -> Any:
        return self.read()


def encode_share(
    planned: PlannedSave, rank: int, coordinator: bool, copy_blobs: bool
) -> ShareItems:
    """The blobs and encoded nodes of the objects this rank writes (and the common state)."""
    items: list[tuple[Any, Any]] = []
    objects: dict[int, Any] = {}
    for j in planned.assignment.objects:
        enc = encode(planned.split.objects[j][1].data, f"r{rank}.o{j}.")
        objects[j] = enc.node
        items.extend(
            (("b", bid), bytes(data) if copy_blobs else data) for bid, data in enc.blobs.items()
        )
    common = None
    if coordinator:
        enc = encode(planned.split.common, "c.")
        common = enc.node
        items.extend(
            (("b", bid), bytes(data) if copy_blobs else data) for bid, data in enc.blobs.items()
        )
    return ShareItems(items, objects, common)


def _nbytes(data: Any) -> int:
    if isinstance(data, memoryview):
        return data.nbytes
    if hasattr(data, "data") and isinstance(getattr(data, "data", None), memoryview):
        return int(data.data.nbytes)
    return len(data)


def write_share(
    planned: PlannedSave,
    rank: int,
    share: ShareItems,
    files_per_rank: int,
    block_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
    first_file: int = 0,
    verify_after_write: bool = False,
    direct_io: DirectIO | None = None,
) -> dict[str, Any]:
    """Write this rank's items into its data files (in parallel); return the extents for the manifest.

    Files are numbered from ``first_file``, so a save written in waves gets distinct files.
    With ``verify_after_write`` each durable file is read back from the device and compared
    with the checksums of the bytes handed to the write (still held); a file that differs is
    written once more, and fails the save if it differs again. ``direct_io`` is the Saver's
    policy and bounce buffers (``SHARDSAFE_DIRECT_IO`` without it).
    """
    check_work_dir(planned.loc, planned.token, rank)
    work = work_dir(planned.loc, planned.token)
    items = share.items
    groups = split_balanced([_nbytes(d) for _, d in items], files_per_rank) if items else []

    def one(index: int, group: Sequence[int]) -> tuple[str, dict[Any, Extent], int]:
        name = file_name(planned.loc, planned.token, rank, first_file + index)

        def resolve() -> Iterator[tuple[Any, Any]]:
            return ((items[i][0], _resolve(items[i][1])) for i in group)

        # deferred items stream (one in memory at a time); the rest are at hand already
        streamed = any(isinstance(items[i][1], Deferred) for i in group)
        resolved: Iterable[tuple[Any, Any]] = resolve() if streamed else list(resolve())
        storage, rel = planned.loc.parent, f"{work}/{name}"
        ext, size = write_data_file(storage, rel, resolved, block_bytes, on_bytes, direct_io)
        if verify_after_write:
            again = resolve() if streamed else resolved
            ext, size = _verified(storage, rel, again, block_bytes, ext, size, rank, direct_io)
        return (
            name,
            {k: Extent(name, e.byte_offset, e.nbytes, e.checksums) for k, e in ext.items()},
            size,
        )

    if len(groups) > 1:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="shardsafe-write") as pool:
            done = list(pool.map(lambda ig: one(*ig), enumerate(groups)))
    else:
        done = [one(i, g) for i, g in enumerate(groups)]
    extents: dict[Any, Extent] = {}
    files: dict[str, int] = {}
    for name, ext, size in done:
        extents.update(ext)
        files[name] = size
    return {
        "pieces": {str(i): e.to_json() for (kind, i), e in extents.items() if kind == "p"},
        "blobs": {bid: e.to_json() for (kind, bid), e in extents.items() if kind == "b"},
        "objects": {str(j): node for j, node in share.objects.items()},
        "files": files,
        "common": share.common,
    }


def _verified(
    storage: Storage,
    rel: str,
    items: Iterable[tuple[Any, Any]],
    block_bytes: int,
    ext: dict[Any, Extent],
    size: int,
    rank: int,
    direct_io: DirectIO | None = None,
) -> tuple[dict[Any, Extent], int]:
    """``ext, size`` once ``rel`` reads back as written: one rewrite, then an error."""

    def differing() -> list[str]:
        return verify_written(storage, rel, list(ext.values()), block_bytes, DEFAULT_MAX_BUFFER)

    bad = differing()
    if not bad:
        return ext, size
    log.warning(
        "rank %d: %s read back differently from what was written (%d blocks, first at %s); "
        "writing it again",
        rank,
        storage.describe(rel),
        len(bad),
        bad[0],
    )
    storage.remove_tree(rel)
    ext, size = write_data_file(storage, rel, items, block_bytes, direct_io=direct_io)
    bad = differing()
    if bad:
        raise CorruptCheckpointError(
            f"rank {rank} on {socket.gethostname()}: {storage.describe(rel)} read back "
            f"differently from what was written, twice ({len(bad)} blocks, first at "
            f"{bad[0]}); the storage is corrupting data: check the device or save elsewhere"
        )
    return ext, size


def merge_results(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rank's write record from the records of its waves (the last one carries objects/common)."""
    out: dict[str, Any] = {"pieces": {}, "blobs": {}, "objects": {}, "files": {}, "common": None}
    for part in parts:
        for field_name in ("pieces", "blobs", "objects", "files"):
            out[field_name].update(part[field_name])
        if part["common"] is not None:
            out["common"] = part["common"]
    return out


def waves(sizes: Sequence[tuple[int, int]], budget: int | None) -> list[list[int]]:
    """Piece indices grouped in order so each group's bytes fit ``budget`` (a bigger piece goes alone)."""
    if budget is None:
        return [[i for i, _ in sizes]]
    out: list[list[int]] = [[]]
    used = 0
    for index, nbytes in sizes:
        if out[-1] and used + nbytes > budget:
            out.append([])
            used = 0
        out[-1].append(index)
        used += nbytes
    return out


def _resolve(data: Any) -> Any:
    """Staged items wait for their device-to-host copy here, in the writer."""
    ready = getattr(data, "ready", None)
    return ready() if callable(ready) else data
