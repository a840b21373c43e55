"""``save``: plan globally, write this rank's pieces, commit atomically.

1. Every rank describes its pieces; the coordinator validates the union and picks one
   writer per unique piece (balanced by bytes over the replicas); errors reach every rank.
2. Each rank writes its assigned pieces (and the objects it owns; the coordinator also the
   common state) into a temporary directory beside the target.
3. The coordinator writes ``manifest.json`` last, fsyncs, and renames the directory into
   place. Until then nothing at ``path`` looks like a checkpoint.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import __version__
from .checksum import DEFAULT_BLOCK_BYTES
from .codec import encode, tensor_bytes
from .dist import Comm, error_record, get_comm, outcome, raise_for
from .dtypes import dtype_name
from .engine import split_balanced, write_data_file
from .errors import CheckpointExistsError, ValidationError
from .format import (
    MANIFEST_NAME,
    Extent,
    FileEntry,
    Manifest,
    ObjectEntry,
    StoredPiece,
    TensorEntry,
    data_file_name,
)
from .location import Location, locate
from .planning import GlobalPlan, LocalPlan, ObjectDesc, PieceDesc, RankAssignment, make_global_plan
from .sharding import ShardedObject, ShardedTensor, SplitStateDict, apply_factories, is_main_replica, split_state_dict

log = logging.getLogger("shardsafe")


@dataclass
class SaveStats:
    """What one save did, on this rank (``total_bytes`` is the whole checkpoint's)."""

    path: str
    bytes_written: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    seconds_planning: float = 0.0
    seconds_writing: float = 0.0
    files: list[str] = field(default_factory=list)


def piece_desc(st: ShardedTensor) -> PieceDesc:
    box = st.chunk_box
    return PieceDesc(
        st.key, dtype_name(st.dtype), st.global_shape, box.offset, box.shape, st.flat_bounds,
        is_main_replica(st.replica_id), st.numel * st.dtype.itemsize,
    )


def object_desc(obj: ShardedObject) -> ObjectDesc:
    return ObjectDesc(obj.unique_key, obj.key, obj.global_shape, obj.global_offset, is_main_replica(obj.replica_id))


def prepare(sharded_state_dict: Any, rank: int) -> tuple[SplitStateDict, LocalPlan]:
    """Apply factories, split off common state, describe this rank's pieces."""
    split = split_state_dict(apply_factories(sharded_state_dict))
    for _, st in split.tensors:
        if st.data is None:
            raise ValidationError(f"{st.key!r}: a ShardedTensor without data cannot be saved")
    plan = LocalPlan(rank, tuple(piece_desc(st) for _, st in split.tensors), tuple(object_desc(o) for _, o in split.objects))
    return split, plan


def save(
    sharded_state_dict: Any,
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Mapping[str, Any] | None = None,
    files_per_rank: int = 1,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> SaveStats:
    """Save a sharded state dict from every rank of ``process_group`` into the directory ``path``.

    All ranks must call it. Returns when the checkpoint is committed (or raises the same
    :class:`CheckpointError` on every rank). ``content_metadata`` is stored in the manifest
    and read back by :func:`load_content_metadata` without loading tensors.
    """
    comm = get_comm(process_group)
    loc = locate(path)
    t0 = time.perf_counter()
    stats = SaveStats(loc.url)

    prepared, err = outcome(lambda: prepare(sharded_state_dict, comm.rank))
    token = uuid.uuid4().hex[:12]
    if comm.is_coordinator and err is None:
        _, err = outcome(lambda: _begin(loc, token, overwrite))
    gathered = comm.gather({"plan": prepared[1].to_json() if prepared else None, "error": err})
    replies: list[Any] | None = None
    global_plan: tuple[list[LocalPlan], GlobalPlan] | None = None
    if gathered is not None:
        replies, global_plan = _plan_replies(gathered, token)
        if any(r.get("errors") for r in replies) and err is None:
            _abort(loc, token)
    reply = comm.scatter(replies)
    raise_for(reply.get("errors") or [], "save planning")
    assert prepared is not None
    split, local_plan = prepared
    assignment = RankAssignment.from_json(reply["assignment"])
    token = reply["token"]
    stats.seconds_planning = time.perf_counter() - t0

    t1 = time.perf_counter()
    result, err = outcome(lambda: _write_rank(loc, token, comm, split, local_plan, assignment, files_per_rank, block_bytes))
    stats.seconds_writing = time.perf_counter() - t1
    gathered = comm.gather({"result": result, "error": err})
    status: dict[str, Any] = {}
    if gathered is not None:
        assert global_plan is not None
        status = _finish(loc, token, global_plan, gathered, overwrite, content_metadata, block_bytes)
    status = comm.broadcast(status)
    raise_for(status.get("errors") or [], "save")
    if result:
        stats.bytes_written = sum(result["files"].values())
        stats.files = sorted(result["files"])
    stats.total_bytes = int(status.get("total_bytes", 0))
    stats.seconds = time.perf_counter() - t0
    if comm.is_coordinator:
        gbps = stats.total_bytes / max(stats.seconds, 1e-9) / 1e9
        log.info("saved %s: %d bytes in %.3f s (%.2f GB/s; planning %.3f s)", loc.url, stats.total_bytes, stats.seconds, gbps, stats.seconds_planning)
    return stats


def _begin(loc: Location, token: str, overwrite: bool) -> None:
    """Coordinator: refuse an existing target or a concurrent save; create the temporary directory."""
    parent = loc.parent
    if parent.exists(loc.name) and not overwrite:
        raise CheckpointExistsError(
            f"{loc.url} already exists; pass overwrite=True to replace it (the old checkpoint stays intact until the new one commits)"
        )
    if not take_lock(loc):
        raise CheckpointExistsError(
            f"another save into {loc.url} is running (lock {parent.describe(loc.lock_name)}); "
            "if no save is running, delete that lock file and retry"
        )
    work = loc.tmp_name(token) if parent.atomic_rename else loc.name
    if not parent.atomic_rename and parent.exists(loc.join(MANIFEST_NAME)):
        parent.remove_tree(loc.join(MANIFEST_NAME))  # object store overwrite: uncommit first
    parent.make_dir(work)
    parent.make_dir(f"{work}/data")


def take_lock(loc: Location) -> bool:
    """Create the save lock; break it when it was left by a dead process on this host."""
    body = f"{socket.gethostname()} {os.getpid()} {time.time():.0f}".encode()
    if loc.parent.create_exclusive(loc.lock_name, body):
        return True
    try:
        host, pid, _ = loc.parent.read_bytes(loc.lock_name).decode().split()
        stale = host == socket.gethostname() and not _pid_alive(int(pid))
    except (OSError, ValueError):
        stale = False
    if stale:
        loc.parent.remove_tree(loc.lock_name)
        return loc.parent.create_exclusive(loc.lock_name, body)
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _plan_replies(gathered: list[Any], token: str) -> tuple[list[dict[str, Any]], tuple[list[LocalPlan], GlobalPlan] | None]:
    errors = [g["error"] for g in gathered]
    world = len(gathered)
    if any(errors):
        return [{"errors": errors}] * world, None
    try:
        plans = [LocalPlan.from_json(g["plan"]) for g in gathered]
        plan = make_global_plan(plans)
    except Exception as e:
        return [{"errors": [error_record(e)] * world}] * world, None
    return [{"assignment": plan.assignments[r].to_json(), "token": token} for r in range(world)], (plans, plan)


def _write_rank(
    loc: Location,
    token: str,
    comm: Comm,
    split: SplitStateDict,
    plan: LocalPlan,
    assignment: RankAssignment,
    files_per_rank: int,
    block_bytes: int,
) -> dict[str, Any]:
    """Write this rank's share; return the extents the coordinator needs for the manifest."""
    items: list[tuple[Any, Any]] = []
    for i in assignment.pieces:
        st = split.tensors[i][1]
        assert st.data is not None
        items.append((("p", i), tensor_bytes(st.data)))
    objects: dict[int, Any] = {}
    for j in assignment.objects:
        enc = encode(split.objects[j][1].data, f"r{comm.rank}.o{j}.")
        objects[j] = enc.node
        items.extend((("b", bid), data) for bid, data in enc.blobs.items())
    common = None
    if comm.is_coordinator:
        enc = encode(split.common, "c.")
        common = enc.node
        items.extend((("b", bid), data) for bid, data in enc.blobs.items())
    work = loc.tmp_name(token) if loc.parent.atomic_rename else loc.name
    sizes = [len(memoryview(d).cast("B")) if isinstance(d, memoryview) else len(d) for _, d in items]
    groups = split_balanced(sizes, files_per_rank) if items else []
    extents: dict[Any, Extent] = {}
    files: dict[str, int] = {}
    for index, group in enumerate(groups):
        name = data_file_name(comm.rank, index)
        ext, size = write_data_file(loc.parent, f"{work}/{name}", [items[i] for i in group], block_bytes)
        # extents name the file relative to the checkpoint, not the work directory
        extents.update({k: Extent(name, e.byte_offset, e.nbytes, e.checksums) for k, e in ext.items()})
        files[name] = size
    return {
        "pieces": {str(i): extents[("p", i)].to_json() for i in assignment.pieces},
        "blobs": {bid: e.to_json() for (kind, bid), e in extents.items() if kind == "b"},
        "objects": {str(j): node for j, node in objects.items()},
        "files": files,
        "common": common,
    }


def _abort(loc: Location, token: str) -> None:
    if loc.parent.atomic_rename:
        loc.parent.remove_tree(loc.tmp_name(token))
    loc.parent.remove_tree(loc.lock_name)


def _finish(
    loc: Location,
    token: str,
    global_plan: tuple[list[LocalPlan], GlobalPlan],
    gathered: list[Any],
    overwrite: bool,
    content_metadata: Mapping[str, Any] | None,
    block_bytes: int,
) -> dict[str, Any]:
    """Coordinator: assemble the manifest from every rank's results and commit, or clean up."""
    errors = [g["error"] for g in gathered]
    if any(errors):
        _abort(loc, token)
        return {"errors": errors}
    try:
        manifest = _assemble(global_plan, [g["result"] for g in gathered], content_metadata, block_bytes)
        _commit(loc, token, manifest, overwrite)
    except Exception as e:
        _abort(loc, token)
        return {"errors": [error_record(e)] * len(gathered)}
    loc.parent.remove_tree(loc.lock_name)
    return {"total_bytes": manifest.total_bytes}


def _assemble(
    global_plan: tuple[list[LocalPlan], GlobalPlan],
    results: list[dict[str, Any]],
    content_metadata: Mapping[str, Any] | None,
    block_bytes: int,
) -> Manifest:
    plans, plan = global_plan
    pieces: dict[str, list[StoredPiece]] = {key: [] for key in plan.tensors}
    objects: dict[str, ObjectEntry] = {}
    blobs: dict[str, Extent] = {}
    files: dict[str, FileEntry] = {}
    for rank, (lp, res) in enumerate(zip(plans, results, strict=True)):
        for i_str, ext in res["pieces"].items():
            d = lp.pieces[int(i_str)]
            pieces[d.key].append(StoredPiece(d.offset, d.shape, d.flat, _extent(ext)))
        for j_str, node in res["objects"].items():
            o = lp.objects[int(j_str)]
            objects[o.unique_key] = ObjectEntry(o.key, o.global_shape, o.global_offset, node)
        blobs.update({bid: _extent(e) for bid, e in res["blobs"].items()})
        files.update({name: FileEntry(size, rank) for name, size in res["files"].items()})
    tensors = {
        key: TensorEntry(dtype, shape, tuple(sorted(pieces[key], key=lambda p: (p.offset, p.flat or (0, 0)))))
        for key, (dtype, shape) in sorted(plan.tensors.items())
    }
    return Manifest(
        world_size=len(plans),
        block_bytes=block_bytes,
        files=files,
        tensors=tensors,
        objects=dict(sorted(objects.items())),
        blobs=blobs,
        common=results[0]["common"],
        created=now_iso(),
        library_version=__version__,
        user_metadata={"content_metadata": dict(content_metadata)} if content_metadata is not None else {},
    )


def _extent(obj: dict[str, Any]) -> Extent:
    return Extent(obj["file"], obj["byte_offset"], obj["nbytes"], tuple(obj["checksums"]))


def _commit(loc: Location, token: str, manifest: Manifest, overwrite: bool) -> None:
    parent = loc.parent
    work = loc.tmp_name(token) if parent.atomic_rename else loc.name
    parent.write_bytes(f"{work}/{MANIFEST_NAME}", manifest.dumps())
    if not parent.atomic_rename:
        return  # the manifest, written last, is the commit
    parent.sync_dir(f"{work}/data")
    parent.sync_dir(work)
    old = None
    if parent.exists(loc.name):
        if not overwrite:
            raise CheckpointExistsError(f"{loc.url} appeared while saving; pass overwrite=True to replace it")
        old = loc.old_name(token)
        parent.rename(loc.name, old)
    parent.rename(work, loc.name)
    parent.sync_dir("")
    if old is not None:
        parent.remove_tree(old)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = ["SaveStats", "save"]
