"""The steps of one save, shared by the blocking and the asynchronous paths.

1. :func:`plan_save` (collective): every rank describes its pieces; the coordinator
   validates the union and picks one writer per unique piece (balanced by bytes over the
   replicas). A cached plan is reused when every rank's full local structure is unchanged,
   agreed with one tiny all-gather. Errors of any rank reach every rank.
2. :func:`write_share`: a rank writes its assigned pieces (and the objects it owns; the
   coordinator also the common state) into a temporary directory beside the target.
3. :func:`shardsafe.commit.finalize` (coordinator): check every reported file, assemble
   ``manifest.json``, write it last, fsync and swap the directory into place. Until then
   nothing at ``path`` looks like a new checkpoint, and an old one there stays complete.

:func:`begin` takes the save's lease on the name (:mod:`shardsafe.lease`) and refuses to
replace anything but a checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import xxhash

from .checksum import digest
from .codec import encode, tensor_bytes
from .dist import Comm, error_record, outcome, raise_for
from .dtypes import dtype_name
from .engine import DEFAULT_MAX_BUFFER, split_balanced, verify_written, write_data_file
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    UnsafeObjectError,
    ValidationError,
)
from .format import (
    MANIFEST_NAME,
    Extent,
    data_file_name,
)
from .lease import LEASE_SECONDS, Lease, LeaseInfo, read_lease
from .location import Location
from .planning import GlobalPlan, LocalPlan, ObjectDesc, PieceDesc, RankAssignment, make_global_plan
from .sharding import (
    PLACEHOLDER,
    CoordinatorObject,
    Path,
    ShardedObject,
    ShardedTensor,
    SplitStateDict,
    adapt,
    apply_factories,
    format_path,
    is_main_replica,
    split_state_dict,
)
from .storage import Storage

CoordinatorPlan = tuple[list[LocalPlan], GlobalPlan]
T = TypeVar("T")

log = logging.getLogger("shardsafe")

_DATA_FILE = re.compile(r"rank-\d{5}-\d{2,}(-[0-9a-f]{16})?\.bin")
"""Data files a shardsafe save writes (the remains of an interrupted one may be replaced)."""


@dataclass
class SaveStats:
    """What one save did. ``bytes_written`` is this rank's share, ``total_bytes`` the checkpoint's."""

    path: str
    bytes_written: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    seconds_planning: float = 0.0
    seconds_blocked: float = 0.0
    seconds_writing: float = 0.0
    plan_cached: bool = False
    files: list[str] = field(default_factory=list)


def piece_desc(st: ShardedTensor) -> PieceDesc:
    box = st.chunk_box
    return PieceDesc(
        st.key,
        dtype_name(st.dtype),
        st.global_shape,
        box.offset,
        box.shape,
        st.flat_bounds,
        is_main_replica(st.replica_id),
        st.numel * st.dtype.itemsize,
    )


def object_desc(obj: ShardedObject) -> ObjectDesc:
    return ObjectDesc(
        obj.unique_key,
        obj.key,
        obj.global_shape,
        obj.global_offset,
        is_main_replica(obj.replica_id),
    )


def prepare(sharded_state_dict: Any, rank: int) -> tuple[SplitStateDict, LocalPlan]:
    """Apply factories, split off common state, describe this rank's pieces.

    Plain tensor leaves are replicas of one whole tensor: rank 0's is the main one.
    """
    split = split_state_dict(apply_factories(adapt(sharded_state_dict)))
    for i in split.replicated:
        path, st = split.tensors[i]
        split.tensors[i] = (path, replace(st, replica_id=rank))
    for _, st in split.tensors:
        if st.data is None:
            raise ValidationError(f"{st.key!r}: a ShardedTensor without data cannot be saved")
        st.validate_metadata_integrity()
    plan = LocalPlan(
        rank,
        tuple(piece_desc(st) for _, st in split.tensors),
        tuple(object_desc(o) for _, o in split.objects),
    )
    return split, plan


def replica_digests(split: SplitStateDict, tensors: bool = True) -> dict[str, str]:
    """A digest per common leaf and per plain (replicated) tensor, named as errors name them.

    Encoding every common leaf here also refuses, before anything is written, a value that
    could not be stored or loaded back.
    """
    out: dict[str, str] = {}

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, CoordinatorObject) or node is PLACEHOLDER:
            return  # rank 0's by choice; a sharded entry (lists keep its place)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
            return
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))
            return
        try:
            enc = encode(node, "")
        except (ValidationError, UnsafeObjectError) as e:
            raise type(e)(f"{format_path(path)}: {e}") from None
        parts = [json.dumps(enc.node, sort_keys=True).encode()]
        parts += [bytes(b) for b in enc.blobs.values()]
        out[f"common state {format_path(path)}"] = digest(b"\0".join(parts))

    walk(split.common, ())
    for i in split.replicated if tensors else ():
        st = split.tensors[i][1]
        assert st.data is not None
        out[f"tensor {st.key!r}"] = tensor_digest(st.data)
    return out


def tensor_digest(t: Any, chunk_bytes: int = 64 << 20, chunked: bool | None = None) -> str:
    """xxh3-64 of a tensor's bytes; a device tensor is copied to the host one chunk at a time
    (``chunked``, the default off the CPU), so comparing replicas never holds more than
    ``chunk_bytes`` of it in host memory. Both ways give the same digest."""
    if not (t.device.type != "cpu" if chunked is None else chunked):
        return digest(tensor_bytes(t))
    h = xxhash.xxh3_64()
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), chunk_bytes):
        h.update(tensor_bytes(flat[start : start + chunk_bytes]))
    return h.hexdigest()


def divergence(digests: Sequence[dict[str, str]]) -> str | None:
    """Which common leaves / replicated tensors differ between ranks, or None."""
    names = sorted(set().union(*digests))
    bad = []
    for name in names:
        values = [d.get(name) for d in digests]
        if len(set(values)) > 1:
            groups: dict[str | None, list[int]] = {}
            for rank, v in enumerate(values):
                groups.setdefault(v, []).append(rank)
            ranks = "; ".join(
                ("absent on" if v is None else "one value on") + f" ranks {rs}"
                for v, rs in groups.items()
            )
            bad.append(f"{name} ({ranks})")
    if not bad:
        return None
    more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
    return (
        f"{len(bad)} value{'s' if len(bad) != 1 else ''} that every rank must hold identically "
        f"differ between ranks: {', '.join(bad[:10])}{more}. Common state and plain tensors are "
        "saved once; give each rank's part its own key (ShardedTensor / ShardedObject), or wrap "
        "the value in shardsafe.CoordinatorObject to store rank 0's copy on purpose"
    )


def combined(digests: dict[str, str]) -> str:
    return digest(json.dumps(sorted(digests.items())).encode())


# --------------------------------------------------------------------------- planning


@dataclass
class _CacheEntry:
    structure: str
    plan_id: str
    assignment: RankAssignment
    coordinator_plan: CoordinatorPlan | None


@dataclass
class PlanCache:
    """The last global plan, reused while every rank's local structure is unchanged."""

    entry: _CacheEntry | None = None
    hits: int = 0
    misses: int = 0


@dataclass
class PlannedSave:
    loc: Location
    token: str
    split: SplitStateDict
    local_plan: LocalPlan
    assignment: RankAssignment
    coordinator_plan: CoordinatorPlan | None
    cached: bool
    lease: Lease | None = None  # the coordinator's, renewed until commit or abort


def plan_save(
    comm: Comm,
    sharded_state_dict: Any,
    loc: Location,
    overwrite: bool,
    cache: PlanCache | None,
    content_metadata: Mapping[str, Any] | None = None,
    timeout: float = 1800.0,
    lease_ttl: float = LEASE_SECONDS,
) -> PlannedSave:
    """Collective: validate and plan (or reuse the cached plan); raise the same error everywhere."""

    def checked() -> tuple[SplitStateDict, LocalPlan, dict[str, str]]:
        check_content_metadata(content_metadata)
        split, plan = prepare(sharded_state_dict, comm.rank)
        return split, plan, replica_digests(split, tensors=comm.distributed)

    prepared3, err = outcome(checked)
    prepared = prepared3[:2] if prepared3 else None
    digests = prepared3[2] if prepared3 else {}
    structure = (
        f"{comm.world_size}/{comm.rank}/{prepared[1].structure_hash()}" if prepared else None
    )
    candidate = (
        cache.entry.plan_id
        if cache and cache.entry and cache.entry.structure == structure
        else None
    )
    token = uuid.uuid4().hex[:16]
    lease: Lease | None = None
    if comm.is_coordinator and err is None:
        lease, err = outcome(lambda: begin(loc, token, overwrite, lease_ttl))
    try:
        comm.arrive("save planning", timeout)
    except BaseException:
        if lease is not None:
            abort(loc, token, lease)
        raise
    votes = _or_abort(
        lease,
        loc,
        token,
        lambda: comm.all_gather(
            {
                "cached": candidate,
                "error": err,
                "token": token if comm.is_coordinator else None,
                "digest": combined(digests),
            }
        ),
    )
    errors = [v["error"] for v in votes]
    if not any(errors) and len({v["digest"] for v in votes}) > 1:
        every = _or_abort(lease, loc, token, lambda: comm.all_gather(digests))
        errors = [error_record(ValidationError(divergence(every) or "state differs"))] * len(votes)
    if any(errors):
        if lease is not None:
            abort(loc, token, lease)
        raise_for(errors, "save planning")
    token = votes[0]["token"]
    assert prepared is not None
    split, local_plan = prepared
    if candidate is not None and all(v["cached"] == candidate for v in votes):
        assert cache is not None and cache.entry is not None
        cache.hits += 1
        return PlannedSave(
            loc,
            token,
            split,
            local_plan,
            cache.entry.assignment,
            cache.entry.coordinator_plan,
            True,
            lease,
        )

    gathered = _or_abort(lease, loc, token, lambda: comm.gather(local_plan.to_json()))
    replies: list[Any] | None = None
    coordinator_plan: CoordinatorPlan | None = None
    if gathered is not None:
        try:
            plans = [LocalPlan.from_json(g) for g in gathered]
            plan = make_global_plan(plans)
            coordinator_plan = (plans, plan)
            replies = [
                {"assignment": plan.assignments[r].to_json(), "plan_id": token}
                for r in range(len(plans))
            ]
        except Exception as e:
            abort(loc, token, lease)
            replies = [{"errors": [error_record(e)] * len(gathered)}] * len(gathered)
    reply = _or_abort(lease, loc, token, lambda: comm.scatter(replies))
    raise_for(reply.get("errors") or [], "save planning")
    assignment = RankAssignment.from_json(reply["assignment"])
    if cache is not None and structure is not None:
        cache.misses += 1
        cache.entry = _CacheEntry(structure, reply["plan_id"], assignment, coordinator_plan)
    return PlannedSave(loc, token, split, local_plan, assignment, coordinator_plan, False, lease)


def _or_abort(lease: Lease | None, loc: Location, token: str, fn: Callable[[], T]) -> T:
    """A collective of planning; if it fails (a peer died), the coordinator drops its lease."""
    try:
        return fn()
    except BaseException:
        if lease is not None:
            abort(loc, token, lease)
        raise


def check_content_metadata(content_metadata: Mapping[str, Any] | None) -> None:
    """It is stored as plain JSON in the manifest: refuse anything else before writing data."""
    if content_metadata is None:
        return
    try:
        json.dumps(dict(content_metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValidationError(
            f"content_metadata must be plain JSON data (str keys; str, int, float, bool, None, lists, dicts): {e}"
        ) from None


def begin(loc: Location, token: str, overwrite: bool, lease_ttl: float = LEASE_SECONDS) -> Lease:
    """Coordinator: refuse an existing target (or anything but a checkpoint with ``overwrite``)
    or a concurrent save; take the lease and create the work directory."""
    check_target(loc, overwrite)
    lease = Lease.acquire(loc.parent, loc.lock_name, token, lease_ttl)
    try:
        check_target(loc, overwrite)  # again, now that no other save of this name can run
        work = work_dir(loc, token)
        loc.parent.make_dir(work)
        loc.parent.make_dir(f"{work}/data")
    except BaseException:
        lease.release()
        raise
    return lease.start()


def check_target(loc: Location, overwrite: bool) -> None:
    """Only a shardsafe checkpoint (or an empty directory) may be replaced, and only with ``overwrite``."""
    parent = loc.parent
    if not occupied(loc):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{loc.url} already exists; pass overwrite=True to replace it (the old checkpoint stays intact until the new one commits)"
        )
    if parent.exists(loc.join(MANIFEST_NAME)):
        return
    if parent.is_dir(loc.name):
        stray = [n for n in parent.list_dir(loc.name) if n != "data"]
        stray += [
            f"data/{n}" for n in parent.list_dir(loc.join("data")) if not _DATA_FILE.fullmatch(n)
        ]
        if not stray:
            return
        what = (
            f"a directory holding {', '.join(sorted(stray)[:5])}{' ...' if len(stray) > 5 else ''}"
        )
    else:
        what = "a file"
    raise CheckpointExistsError(
        f"{loc.url} is {what} but not a shardsafe checkpoint (it has no {MANIFEST_NAME}); "
        "overwrite replaces checkpoints only: move or delete it yourself, or pick another path"
    )


def occupied(loc: Location) -> bool:
    """Whether the target exists; an existing *empty* directory is free to save into (Megatron's ``save`` expects one)."""
    parent = loc.parent
    if not parent.exists(loc.name):
        return False
    return not (parent.is_dir(loc.name) and not parent.list_dir(loc.name))


def work_dir(loc: Location, token: str) -> str:
    """Where the ranks write: a hidden sibling (swapped in at commit), or the target on object stores."""
    return loc.tmp_name(token) if loc.parent.atomic_rename else loc.name


def file_name(loc: Location, token: str, rank: int, index: int) -> str:
    """A data file's name. On object stores the save's token is part of it, so that a new
    checkpoint is written beside the old one it replaces, never over it."""
    name = data_file_name(rank, index)
    return name if loc.parent.atomic_rename else name.replace(".bin", f"-{token}.bin")


def check_work_dir(loc: Location, token: str, rank: int) -> None:
    """A rank must see the work directory the coordinator created: else it would write to a
    disk nobody else sees and the checkpoint would miss its files."""
    if loc.parent.atomic_rename and not loc.parent.is_dir(work_dir(loc, token)):
        raise CheckpointError(
            f"rank {rank} on host {socket.gethostname()} cannot see the work directory "
            f"{loc.parent.describe(work_dir(loc, token))} that the coordinator created: "
            "every rank must write to the same shared file system (is it mounted on that host?)"
        )


# --------------------------------------------------------------------------- writing


@dataclass
class ShareItems:
    """Everything one rank writes: (identity, bytes) items plus the encoded objects/common state."""

    items: list[tuple[Any, Any]]
    objects: dict[int, Any]
    common: Any


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
) -> dict[str, Any]:
    """Write this rank's items into its data files (in parallel); return the extents for the manifest.

    Files are numbered from ``first_file``, so a save written in waves gets distinct files.
    With ``verify_after_write`` each durable file is read back from the device and compared
    with the checksums of the bytes handed to the write (still held); a file that differs is
    written once more, and fails the save if it differs again.
    """
    check_work_dir(planned.loc, planned.token, rank)
    work = work_dir(planned.loc, planned.token)
    items = share.items
    groups = split_balanced([_nbytes(d) for _, d in items], files_per_rank) if items else []

    def one(index: int, group: Sequence[int]) -> tuple[str, dict[Any, Extent], int]:
        name = file_name(planned.loc, planned.token, rank, first_file + index)
        resolved = [(items[i][0], _resolve(items[i][1])) for i in group]
        storage, rel = planned.loc.parent, f"{work}/{name}"
        ext, size = write_data_file(storage, rel, resolved, block_bytes, on_bytes)
        if verify_after_write:
            ext, size = _verified(storage, rel, resolved, block_bytes, ext, size, rank)
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
    items: list[tuple[Any, Any]],
    block_bytes: int,
    ext: dict[Any, Extent],
    size: int,
    rank: int,
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
    ext, size = write_data_file(storage, rel, items, block_bytes)
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


# --------------------------------------------------------------------------- commit


def abort(loc: Location, token: str, lease: Lease | None = None) -> None:
    """Remove what an unsuccessful save wrote, and its lease; never a committed checkpoint's files."""
    parent = loc.parent
    if parent.atomic_rename:
        parent.remove_tree(loc.tmp_name(token))
    else:
        for name in parent.list_dir(loc.join("data")):
            if name.endswith(f"-{token}.bin"):
                parent.remove_tree(loc.join("data", name))
    if lease is not None:
        lease.release()
        return
    info = read_lease(parent, loc.lock_name)
    if isinstance(info, LeaseInfo) and info.owner == token:
        parent.remove_tree(loc.lock_name)
