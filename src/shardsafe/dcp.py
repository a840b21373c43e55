"""PyTorch DCP's storage layer backed by shardsafe: ``dcp.save``/``async_save``/``load`` with
:class:`Writer` and :class:`Reader` read and write ordinary shardsafe checkpoints.

DCP keeps its planner (flattening, deduplication of replicas, resharding on load); the storage
translates and hands over to shardsafe's own machinery, never a second protocol or format:

* :class:`Writer` turns each rank's ``WriteItem``s into :class:`~shardsafe.ShardedTensor` boxes
  (tensor chunks at their global offsets) and the common state (DCP's non-tensor items,
  gathered from the ranks DCP planned them on and nested again by the planner's mapping), and
  runs one :meth:`shardsafe.Saver.save` with them inside ``write_data``, where all ranks are.
  Data files, per-block checksums, the manifest, the lease, the atomic publish and the
  agreement on every rank's error are the Saver's. The commit happens there rather than in
  ``finish`` (called on the coordinator only, after DCP's gather): the Saver's commit watches the
  other ranks' heartbeats and names a dead one, and cleans up after a failed write; ``finish``
  only checks that every rank reported its items. Nothing of DCP's pickled ``Metadata`` is stored.
* :class:`Reader` builds DCP's ``Metadata`` from our manifest (no pickle: tensor keys with every
  stored box as a chunk, non-tensor state as bytes items) and fills each ``ReadItem``'s region
  through :meth:`shardsafe.CheckpointReader.read_regions`, checksums verified. It reads any
  shardsafe checkpoint, whoever wrote it.
* The Writer is DCP's ``AsyncStager``: ``dcp.async_save`` stages into its reused host arena
  (pinned for CUDA tensors), and the background save writes from there.

Non-tensor state: DCP hands it over pickled with ``torch.save``. The Writer decodes it with
``torch.load(weights_only=True)`` and stores the value (common state, encoded by our codec), so
our load never unpickles DCP's bytes; a value that does not load that way is refused with its
key (allow-list its class with ``torch.serialization.add_safe_globals``, or make it plain data). The Reader gives DCP's planner
those values re-serialised by ``torch.save`` from decoded data, never bytes from the checkpoint.
"""

from __future__ import annotations

import base64
import copy
import io
import os
import pickle
import threading
import time
import uuid
import weakref
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .dist import get_comm, outcome, raise_for
from .dtypes import dtype_from_name
from .engine import DEFAULT_MAX_BUFFER
from .errors import (
    DistributedError,
    IncompatibleRequestError,
    MissingKeyError,
    UnsafeObjectError,
    ValidationError,
)
from .format import MANIFEST_NAME, Manifest
from .geometry import Box
from .reader import CheckpointReader
from .saver import Saver, SaveStats
from .sharding import ShardedTensor, TensorRef, set_at
from .staging import StagingPool

__all__ = ["Reader", "Writer", "metadata_from_manifest"]

_ONE_CELL = ((1,), (0,))  # a ShardedObject that is the only cell of its grid


class Writer(StorageWriter):
    """``dcp.save(state_dict, storage_writer=Writer(path))`` writes a shardsafe checkpoint.

    ``options`` are :class:`shardsafe.Saver`'s (``files_per_rank``, ``block_bytes``,
    ``max_staging_bytes``, ``dead_after``, ``verify_after_write``, ``direct_io``...), used for
    the Saver the Writer owns; or pass ``saver=`` to use yours. ``process_group`` must be the
    one given to ``dcp.save`` (default: the default group). ``overwrite=True`` replaces a
    checkpoint already at ``path`` (DCP's ``checkpoint_id`` given to ``dcp.save`` replaces
    ``path``). Also DCP's ``AsyncStager``: ``dcp.async_save`` copies into the Writer's reused
    host arena; wait for a save's future before the next save through the same Writer.
    ``close()`` frees the Saver (if it made it) and the arena.
    """

    _synchronize_after_execute = False  # stage() returns once every copy is complete

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        process_group: Any = None,
        overwrite: bool = False,
        content_metadata: dict[str, Any] | None = None,
        saver: Saver | None = None,
        stage_timeout: float = 1800.0,
        **options: Any,
    ) -> None:
        self.path = os.fspath(path)
        self.process_group = process_group
        self.overwrite = overwrite
        self.content_metadata = content_metadata
        if saver is not None and options:
            raise TypeError(f"pass Saver options {sorted(options)} to your Saver, or no saver=")
        self._own_saver = saver is None
        self.saver = saver if saver is not None else Saver(process_group, **options)
        self.stats: SaveStats | None = None  # this rank's stats of the last save
        self.is_coordinator = False
        # the arena of dcp.async_save, free again once the save that reads it wrote its data
        self.staging = StagingPool()
        self.stage_timeout = stage_timeout
        self._arena_free = threading.Event()
        self._arena_free.set()
        self._staged: list[weakref.ref[torch.Tensor]] = []

    # -- StorageWriter -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValidationError(
                f"{self.path}: shardsafe.dcp.Writer commits with every rank of the group; "
                "call dcp.save with use_collectives=True"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's items as a shardsafe state dict, saved and committed by the Saver.

        Tensor chunks become ShardedTensors at their global offsets. Non-tensor items, each
        planned on one rank, are gathered so that every rank holds all of them, decoded and
        nested again by the planner's mapping: they are the checkpoint's common state, which
        ``shardsafe.load`` merges into a template as it does for any checkpoint."""
        try:
            local, err = outcome(lambda: _resolve(plan, planner))
            pieces, mine, results = local if local is not None else ([], [], [])
            comm = get_comm(self.process_group)
            # every rank's failure to resolve its items is raised on every rank, before saving
            comm.arrive("dcp non-tensor items", self.saver.timeout, self.saver.dead_after)
            # each item is nested where the rank that planned it has it (the planner's mappings
            # are local: a key only some ranks hold is known to those ranks alone)
            mappings = getattr(planner, "mappings", None) or {}
            paths = {fqn: list(mappings.get(fqn, (fqn,))) for fqn, _ in mine}
            records = comm.all_gather({"error": err, "items": mine, "paths": paths})
            raise_for([r["error"] for r in records], "dcp.save (resolving the planned items)")
            state: dict[str, Any] = {}
            placed = sorted(
                (fqn, raw, tuple(r["paths"][fqn])) for r in records for fqn, raw in r["items"]
            )
            for fqn, raw, path in placed:
                state = set_at(state, path, _decode(fqn, base64.b64decode(raw)))
            for n, st in enumerate(pieces):  # a sharded entry leaves no trace in the common state
                key = f"\0dcp{n}"
                if key in state:
                    raise ValidationError(f"{self.path}: a state dict key {key!r} is reserved")
                state[key] = st
            self.stats = self.saver.save(
                state,
                self.path,
                overwrite=self.overwrite,
                content_metadata=self.content_metadata,
            )
        finally:
            self._staged = []
            self._arena_free.set()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Committed already (in ``write_data``, by every rank); check no item went astray."""
        written = {r.index.fqn for rank in results for r in rank}
        planned = set(metadata.state_dict_metadata)
        if planned - written:
            raise DistributedError(
                f"{self.path}: DCP planned {sorted(planned - written)[:10]} but no rank wrote them"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP's guess: pass storage_writer=Writer(path)

    # -- AsyncStager -----------------------------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose tensors live in this Writer's reused host arena
        (DTensors keep their mesh and placements); other values are deep-copied."""
        self._wait_for_arena()
        leaves: list[torch.Tensor] = []
        shape = _collect(state_dict, leaves, ())
        staged = self.staging.stage([_local(t) for t in leaves])
        copies = []
        for t, item in zip(leaves, staged, strict=True):
            local = _local(t)
            data = item.ready()
            host = (
                torch.frombuffer(data, dtype=torch.uint8).view(local.dtype).view(local.shape)
                if len(data)
                else torch.empty(local.shape, dtype=local.dtype)
            )
            copies.append(_rewrap(t, host))
        self._staged = [weakref.ref(c) for c in copies]
        self._arena_free.clear()
        return _rebuild(shape, iter(copies))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once its copies are complete."""

    def close(self) -> None:
        """Free the arena, and the Saver when the Writer made it (waits for its save in flight)."""
        try:
            if self._own_saver:
                self.saver.close()
        finally:
            self.staging.release()

    def _wait_for_arena(self) -> None:
        """The arena is reused: wait until the save that reads the last staged copy wrote it
        (or dropped it, e.g. failing before its write)."""
        deadline = time.monotonic() + self.stage_timeout
        while not self._arena_free.wait(0.05):
            if all(ref() is None for ref in self._staged):
                return
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"{self.path}: the previous dcp.async_save through this Writer has not "
                    f"written its data after {self.stage_timeout} s; wait for its future "
                    "before the next save"
                )


class Reader(StorageReader):
    """``dcp.load(state_dict, storage_reader=Reader(path))`` reads any shardsafe checkpoint into
    DCP's planner (any layout); every block read is verified. The manifest is read and checked
    when the Reader is made (or reset to another ``checkpoint_id``)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER,
    ) -> None:
        self.threads = threads
        self.max_buffer_bytes = max_buffer_bytes
        self._open(path)

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.reader = CheckpointReader(
            path, threads=self.threads, max_buffer_bytes=self.max_buffer_bytes
        )
        # decoded now, so a hostile common state or object raises here as itself (DCP turns an
        # error of read_metadata into an AssertionError)
        self._values = non_tensor_items(self.reader)
        self._metadata = metadata_from_manifest(
            self.reader.manifest, self._values, self.reader.storage.describe(MANIFEST_NAME)
        )
        self._metadata.storage_meta = StorageMeta(checkpoint_id=self.path)

    # -- StorageReader -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill every requested region from our data files (checksums verified), then hand the
        non-tensor items to the planner."""
        values = self._values
        regions: list[tuple[str, Box, torch.Tensor]] = []
        commits: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in values:
                    raise MissingKeyError(f"{self.path}: no non-tensor item {fqn!r}")
                buf = io.BytesIO()
                torch.save(values[fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            offset = tuple(
                int(a) + int(b)
                for a, b in zip(
                    item.storage_index.offset or (0,) * len(item.lengths),
                    item.storage_offsets,
                    strict=True,
                )
            )
            box = Box(offset, tuple(int(n) for n in item.lengths))
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != box.shape:
                raise IncompatibleRequestError(
                    f"{self.path}: {fqn!r}: the planner's destination has shape "
                    f"{list(target.shape)}, the region read {list(box.shape)}"
                )
            if fqn in values:  # a tensor kept in the common state of an old checkpoint
                region = tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))
                target.copy_(values[fqn][region])
                planner.commit_tensor(item, target)
                continue
            stored = self.reader.tensor_meta(fqn)[1]
            direct = target.dtype == stored and target.device.type == "cpu"
            work = target if direct else torch.empty(box.shape, dtype=stored)
            regions.append((fqn, box, work))
            commits.append((item, target, work))
        self.reader.read_regions(regions)
        for item, target, work in commits:
            if work is not target:
                target.copy_(work)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), MANIFEST_NAME))


def metadata_from_manifest(
    manifest: Manifest, non_tensor: dict[str, Any], where: str = MANIFEST_NAME
) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint: each tensor with every stored box as a chunk (flat
    ranges cut into boxes), each non-tensor value as a bytes item; a tensor among them (from
    the common state of an old checkpoint) as one whole chunk. Every tensor's pieces must tile
    it exactly: DCP's planner reads only where chunks are, and would leave a hole unfilled."""
    entries: dict[str, Any] = {}
    for key, entry in manifest.tensors.items():
        entry.check_tiling(key, where)
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape))
            for piece in entry.pieces
            for _, box in piece.boxes()
        ]
        entries[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(entry.dtype, MANIFEST_NAME)),
            size=torch.Size(entry.shape),
            chunks=chunks,
        )
    for fqn, value in non_tensor.items():
        if fqn in entries:
            continue
        if isinstance(value, torch.Tensor):
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=value.dtype),
                size=value.shape,
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size((0,) * value.dim()), sizes=value.shape)
                ],
            )
        else:
            entries[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=entries)


def non_tensor_items(reader: CheckpointReader) -> dict[str, Any]:
    """DCP key -> value of every object (one-cell objects by key, others by unique key) and of
    every common-state leaf, flattened as DCP flattens a state dict (so a checkpoint written by
    ``shardsafe.save`` offers the keys ``dcp.load`` asks for)."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    out: dict[str, Any] = {}
    for unique, entry in reader.manifest.objects.items():
        one = (tuple(entry.global_shape), tuple(entry.global_offset)) == _ONE_CELL
        out[entry.key if one else unique] = reader.read_object(unique)
    marker = torch.empty(0, device="meta")  # where a plain tensor was: a tensor leaf to DCP

    def mark(node: Any) -> Any:
        if isinstance(node, TensorRef):
            return marker
        if isinstance(node, dict):
            return {k: mark(v) for k, v in node.items()}
        if isinstance(node, list):
            return [mark(v) for v in node]
        return node

    common = mark(reader.common(refs=True))
    if isinstance(common, dict) and common:

        def visit(path: tuple[Any, ...], value: Any) -> None:
            if value is not marker:
                out.setdefault(".".join(str(p) for p in path), value)

        traverse_state_dict(common, visit)
    return out


# -- write side helpers ------------------------------------------------------------------------


def _resolve(
    plan: SavePlan, planner: SavePlanner
) -> tuple[list[ShardedTensor], list[list[str]], list[WriteResult]]:
    """This rank's tensor pieces, its non-tensor items as ``[fqn, base64 of DCP's bytes]``,
    and DCP's write results for them."""
    pieces: list[ShardedTensor] = []
    items: list[list[str]] = []
    results = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            items.append([item.index.fqn, base64.b64encode(raw).decode()])
            nbytes = len(raw)
        else:
            st = _tensor_piece(item, data)
            pieces.append(st)
            nbytes = st.numel * st.dtype.itemsize
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
    return pieces, items, results


def _tensor_piece(item: WriteItem, data: Any) -> ShardedTensor:
    """One tensor WriteItem as a ShardedTensor: its chunk, at its global offset."""
    fqn = item.index.fqn
    if not isinstance(data, torch.Tensor) or item.tensor_data is None:
        raise ValidationError(f"{fqn!r}: DCP planned a tensor item but resolved a {type(data)}")
    tensor = data.detach()
    chunk = item.tensor_data.chunk
    if tuple(tensor.shape) != tuple(chunk.sizes):
        raise ValidationError(
            f"{fqn!r}: the planner resolved a tensor of shape {list(tensor.shape)} for a chunk "
            f"of shape {list(chunk.sizes)}"
        )
    return ShardedTensor.from_global_offset(
        fqn, tensor, tuple(item.tensor_data.size), tuple(int(o) for o in chunk.offsets)
    )


def _decode(fqn: str, raw: bytes) -> Any:
    """DCP's ``torch.save`` of a non-tensor value, decoded without running code from it."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafeObjectError(
            f"{fqn!r}: this non-tensor value does not load without running pickled code, and "
            f"shardsafe stores only what its load reads safely ({str(e).splitlines()[0][:300]}); "
            "make it plain data (numbers, strings, lists, dicts, tensors) or allow-list its "
            "class with torch.serialization.add_safe_globals"
        ) from None
    except Exception as e:
        raise ValidationError(f"{fqn!r}: DCP's bytes for this value do not load: {e}") from None


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return cast(Any, t)._local_tensor if _is_dtensor(t) else t


def _rewrap(original: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    if not _is_dtensor(original):
        return host
    from torch.distributed.tensor import DTensor

    return DTensor(host, cast(Any, original)._spec, requires_grad=False)


_Shape = Any  # the tree of :func:`_collect`: containers of _Slot and deep-copied leaves


class _Slot:
    """Where the next staged tensor goes back."""


def _collect(node: Any, out: list[torch.Tensor], path: tuple[Any, ...]) -> _Shape:
    """The tree with a :class:`_Slot` per tensor leaf (appended to ``out``); other leaves copied."""
    if isinstance(node, torch.Tensor):
        if node.layout != torch.strided or not (type(node) in _PLAIN or _is_dtensor(node)):
            raise ValidationError(
                f"state_dict{''.join(f'[{p!r}]' for p in path)}: a {type(node).__name__} "
                "cannot be staged by shardsafe.dcp.Writer; use DTensors or plain tensors"
            )
        out.append(node)
        return _Slot()
    if isinstance(node, dict):
        tree = copy.copy(node)
        for k, v in node.items():
            tree[k] = _collect(v, out, (*path, k))
        return tree
    if type(node) in (list, tuple):
        return type(node)(_collect(v, out, (*path, i)) for i, v in enumerate(node))
    return copy.deepcopy(node)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _rebuild(shape: _Shape, staged: Any) -> Any:
    if isinstance(shape, _Slot):
        return next(staged)
    if isinstance(shape, dict):
        for k, v in shape.items():
            shape[k] = _rebuild(v, staged)
        return shape
    if type(shape) in (list, tuple):
        return type(shape)(_rebuild(v, staged) for v in shape)
    return shape
