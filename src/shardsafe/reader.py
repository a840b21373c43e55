"""Single-process access to a checkpoint: metadata, whole tensors, objects, common state, verify.

Used by tools (inspect, verify, convert) and by users outside a training job; needs no
process group.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checksum import block_count
from .codec import decode
from .dtypes import dtype_from_name
from .engine import DEFAULT_MAX_BUFFER, DataReader, default_threads, plan_reads, run_tasks
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleRequestError,
    MissingKeyError,
)
from .format import MANIFEST_NAME, Manifest
from .geometry import Box, LayoutTooFragmentedError, find_overlap, first_uncovered, full_box
from .loading import read_manifest
from .sharding import ShardedObject, ShardedTensor, TensorRef


class CheckpointReader:
    """Read a committed checkpoint from one process."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER,
    ) -> None:
        self.path = os.fspath(path)
        self.manifest, self.storage = read_manifest(path)
        self.threads = threads or default_threads()
        self.max_buffer = max_buffer_bytes
        self._where = self.storage.describe(MANIFEST_NAME)

    # -- metadata -------------------------------------------------------------------------
    def tensor_keys(self) -> list[str]:
        return list(self.manifest.tensors)

    def tensor_meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        entry = self._entry(key)
        return tuple(entry.shape), dtype_from_name(entry.dtype, self._where)

    def object_keys(self) -> list[str]:
        return list(self.manifest.objects)

    def _entry(self, key: str) -> Any:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise MissingKeyError(f"{self.path}: no tensor {key!r} in the checkpoint") from None

    # -- data -----------------------------------------------------------------------------
    def read_tensor(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole global tensor ``key``, consolidated from its pieces and verified."""
        shape, dtype = self.tensor_meta(key)
        entry = self._entry(key)
        entry.check_tiling(key, self._where)
        with DataReader(self.storage, self.manifest.block_bytes, self.max_buffer) as reader:
            for piece in entry.pieces:  # the manifest's shape is backed by bytes on disk
                reader.check_extent(piece.extent, f"tensor {key!r}")
            data = (
                out
                if out is not None
                else _allocate(shape, dtype, f"{self._where}: tensor {key!r}")
            )
            tasks, covered = plan_reads(
                key,
                entry.pieces,
                [(full_box(shape), data)],
                dtype,
                max(1, self.max_buffer // dtype.itemsize),
            )
            if covered != math.prod(shape):
                raise CheckpointError(
                    f"{self.path}: tensor {key!r}: pieces cover {covered} of {math.prod(shape)} elements"
                )
            run_tasks(reader, tasks, self.threads)
        return data

    def read_regions(self, regions: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each ``out`` with the region ``box`` (global coordinates) of tensor ``key``,
        every block verified: any box of any stored layout, read by this process alone (what
        a reader driven by another framework's planner, e.g. ``shardsafe.dcp``, needs)."""
        tasks = []
        tiled: set[str] = set()
        with DataReader(self.storage, self.manifest.block_bytes, self.max_buffer) as reader:
            for key, box, out in regions:
                entry = self._entry(key)
                if key not in tiled:
                    entry.check_tiling(key, self._where)
                    tiled.add(key)
                dtype = dtype_from_name(entry.dtype, self._where)
                if not box.within(tuple(entry.shape)) or tuple(out.shape) != box.shape:
                    raise IncompatibleRequestError(
                        f"{self.path}: tensor {key!r} has shape {list(entry.shape)}; the request "
                        f"for the box at {list(box.offset)} of shape {list(box.shape)} into a "
                        f"tensor of shape {list(out.shape)} does not fit it"
                    )
                if out.dtype != dtype:
                    raise IncompatibleRequestError(
                        f"{self.path}: tensor {key!r} is stored as {entry.dtype}, the request "
                        f"asks for {out.dtype}; read the stored dtype and cast"
                    )
                part, covered = plan_reads(
                    key,
                    entry.pieces,
                    [(box, out)],
                    dtype,
                    max(1, self.max_buffer // dtype.itemsize),
                )
                if covered != box.numel:
                    raise CorruptCheckpointError(
                        f"{self._where}: tensor {key!r}: pieces cover {covered} of the "
                        f"{box.numel} elements requested"
                    )
                tasks.extend(part)
            run_tasks(reader, tasks, self.threads)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors one at a time, so memory stays bounded by the largest one."""
        for key in self.tensor_keys():
            yield key, self.read_tensor(key)

    def _fetch(self, reader: DataReader) -> Callable[[str], bytes]:
        def fetch(blob_id: str) -> bytes:
            extent = self.manifest.blobs.get(blob_id)
            if extent is None:
                raise CorruptCheckpointError(
                    f"{self._where}: blob {blob_id!r} is referenced but not listed"
                )
            return reader.read_extent(extent, f"blob {blob_id!r}")

        return fetch

    def read_object(self, unique_key: str) -> Any:
        try:
            entry = self.manifest.objects[unique_key]
        except KeyError:
            raise MissingKeyError(
                f"{self.path}: no object {unique_key!r} in the checkpoint"
            ) from None
        with DataReader(self.storage, self.manifest.block_bytes) as reader:
            return decode(entry.value, self._fetch(reader), f"{self._where}: object {unique_key!r}")

    def common(self, tensors: bool = False, refs: bool = False) -> Any:
        """The common (non-sharded) state saved by the coordinator.

        Plain tensor leaves of the saved state dict are stored as tensors: ``tensors=True``
        puts each back in its place (read whole), ``refs=True`` leaves a
        :class:`~shardsafe.sharding.TensorRef` naming it there, otherwise they are left out as
        sharded entries are (their keys are in :meth:`tensor_keys`).
        """
        with DataReader(self.storage, self.manifest.block_bytes) as reader:
            value = decode(
                self.manifest.common, self._fetch(reader), f"{self._where}: common state"
            )
        if refs and not tensors:
            return value if value is not None else {}
        value = _place_refs(value, self.read_tensor if tensors else None)
        return value if value is not None else {}

    # -- integrity ------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-read every stored byte, check checksums, sizes and coverage. Never raises for damage
        (a manifest that fails its own digest already refused to open)."""
        return verify_manifest(self.manifest, self.storage, progress)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as e:
        raise CorruptCheckpointError(
            f"{where}: cannot allocate a tensor of shape {list(shape)[:8]} ({dtype}): {str(e).splitlines()[0]}"
        ) from None


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    tensors: int = 0
    objects: int = 0
    notes: list[str] = field(default_factory=list)
    """What was not checked, without being a problem (a manifest written without a digest)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_manifest(
    manifest: Manifest, storage: Any, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    report = VerifyReport(tensors=len(manifest.tensors), objects=len(manifest.objects))
    if manifest.digest is None:
        report.notes.append(
            f"{MANIFEST_NAME} has no manifest_digest (written before shardsafe stored one): "
            "the data is checked against its checksums, the manifest itself is not"
        )
    for name, entry in manifest.files.items():
        try:
            size = storage.size(name)
        except FileNotFoundError:
            report.problems.append(f"{name}: missing")
            continue
        except OSError as e:
            report.problems.append(f"{name}: unreadable ({e.strerror or e})")
            continue
        if size < entry.nbytes:
            report.problems.append(
                f"{name}: {size} bytes, the manifest expects {entry.nbytes} (truncated)"
            )
    for key, tensor in manifest.tensors.items():
        boxes = [b for p in tensor.pieces for _, b in p.boxes()]
        try:
            overlap = find_overlap(boxes)
        except LayoutTooFragmentedError as e:
            report.problems.append(f"tensor {key!r}: {e}")
            continue
        if overlap is not None:
            report.problems.append(
                f"tensor {key!r}: stored pieces overlap ({boxes[overlap[0]]} and {boxes[overlap[1]]})"
            )
        covered = sum(b.numel for b in boxes)
        if covered != math.prod(tensor.shape):
            hole = first_uncovered(tensor.shape, boxes)
            report.problems.append(
                f"tensor {key!r}: stored pieces cover {covered} of {math.prod(tensor.shape)} elements"
                + (f" (e.g. index {hole} is missing)" if hole is not None else "")
            )
    extents = [(f"tensor {k!r}", p.extent) for k, t in manifest.tensors.items() for p in t.pieces]
    extents += [(f"blob {b!r}", e) for b, e in manifest.blobs.items()]
    with DataReader(storage, manifest.block_bytes) as reader:
        for what, extent in extents:
            if block_count(extent.nbytes, manifest.block_bytes) != len(extent.checksums):
                report.problems.append(f"{what}: wrong number of checksums")
                continue
            try:
                reader.read_extent(extent, what)
            except CheckpointError as e:
                report.problems.append(str(e))
            report.bytes_checked += extent.nbytes
            if progress is not None:
                progress(extent.nbytes)
    return report


def load_metadata(path: str | os.PathLike[str]) -> dict[str, ShardedTensor | ShardedObject]:
    """Every tensor key as a data-less ShardedTensor of its global shape and dtype, and every
    object (by unique key) as a data-less ShardedObject. Reads only the manifest."""
    manifest, storage = read_manifest(path)
    where = storage.describe(MANIFEST_NAME)
    out: dict[str, ShardedTensor | ShardedObject] = {}
    for key, t in manifest.tensors.items():
        dtype = dtype_from_name(t.dtype, where)
        shape = tuple(t.shape)
        out[key] = ShardedTensor(
            key, None, dtype, shape, shape, (0,) * len(shape), (1,) * len(shape)
        )
    for ukey, o in manifest.objects.items():
        out[ukey] = ShardedObject(o.key, None, o.global_shape, o.global_offset)
    return out


def load_plain_tensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor whole, under its key, plus the common state's top-level entries."""
    reader = CheckpointReader(path)
    out: dict[str, Any] = {}
    common = reader.common()
    if isinstance(common, dict):
        out.update(common)
    out.update(dict(reader.iter_tensors()))
    return out


def load_common_state_dict(path: str | os.PathLike[str]) -> Any:
    return CheckpointReader(path).common()


def _place_refs(tree: Any, read: Callable[[str], torch.Tensor] | None) -> Any:
    """Each :class:`TensorRef` read (``read``) or left out (dict entries dropped, list items None)."""
    if isinstance(tree, TensorRef):
        return read(tree.key) if read else None
    if isinstance(tree, dict):
        return {
            k: _place_refs(v, read)
            for k, v in tree.items()
            if read is not None or not isinstance(v, TensorRef)
        }
    if isinstance(tree, list):
        return [_place_refs(v, read) for v in tree]
    return tree
