"""The first step of a save: describe, check and plan (collective).

Every rank applies factories, splits off the common state and describes its pieces
(:func:`prepare`); the common state and plain tensors, which every rank must hold
identically, are digested and compared. The coordinator validates the union and picks one
writer per unique piece, balanced by bytes over the replicas. A cached plan
(:class:`PlanCache`) is reused when every rank's full local structure is unchanged, agreed
in the planning vote. The coordinator also takes the save's lease
(:func:`shardsafe.save_target.begin`), and so does each other rank that publishes in a place
of its own (``leads_place``: the local tier's place leaders) when the save's token is known
ahead: the coordinator draws the next save's token in each planning vote, so from the second
save on those leases ride on the planning vote instead of needing one more. The vote is one
round through the store (:meth:`Comm.vote`): each rank's ballot rides in its arrival, the last
to arrive counts them (:func:`tally_planning`), and every rank reads the count; a cache miss
adds a gather and a scatter of the plans, diverging replicas an all-gather of their digests.
Errors of any rank reach every rank.

A rank whose structure matches its cached plan does not wait for the vote idle: the lease and
the vote run in a thread of their own while the caller's ``while_voting`` (the Saver's staging
copy) runs on the calling thread, with the assignment the cached plan gives this rank. The
work is a guess the vote confirms or not: ``PlannedSave.cached`` with that same assignment
says it fits the agreed plan; otherwise the caller drops it and works from the plan agreed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import torch
import xxhash

from .checksum import digest
from .codec import encode, encode_inline, tensor_bytes
from .dist import Comm, error_record, outcome, raise_for
from .dtypes import dtype_name
from .errors import UnsafeObjectError, ValidationError
from .lease import LEASE_SECONDS, Lease
from .liveness import DEAD_AFTER, in_thread
from .location import Location
from .planning import GlobalPlan, LocalPlan, ObjectDesc, PieceDesc, RankAssignment, make_global_plan
from .save_target import abort, begin
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
    resolve_stateful,
    split_state_dict,
)

CoordinatorPlan = tuple[list[LocalPlan], GlobalPlan]
"""The coordinator's view of a plan: every rank's local plan and the global plan."""
T = TypeVar("T")


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

    Plain tensor leaves are replicas of one whole tensor: rank 0's is the main one. A
    :class:`SplitStateDict` is a state its caller took apart already (a converter's tensors
    and common state) and is planned as it is.
    """
    if isinstance(sharded_state_dict, SplitStateDict):
        split = sharded_state_dict
    else:
        resolved, _ = resolve_stateful(sharded_state_dict)  # Stateful objects: their state_dict()
        split = split_state_dict(apply_factories(adapt(resolved)))
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
    # the next save's token, drawn by the coordinator in this save's vote; taken (and cleared)
    # by the next planning, so that a token is never used twice
    next_token: str | None = None


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
    # every place leader (``leads_place``) took its lease in planning under this token
    places_begun: bool = False


def plan_save(
    comm: Comm,
    sharded_state_dict: Any,
    loc: Location,
    overwrite: bool,
    cache: PlanCache | None,
    content_metadata: Mapping[str, Any] | None = None,
    timeout: float = 1800.0,
    lease_ttl: float = LEASE_SECONDS,
    dead_after: float = DEAD_AFTER,
    leads_place: bool = False,
    while_voting: Callable[[SplitStateDict, RankAssignment], None] | None = None,
) -> PlannedSave:
    """Collective: validate and plan (or reuse the cached plan); raise the same error everywhere.

    ``leads_place``: this rank publishes in a place of its own and takes its lease here too
    when the token is known ahead (see the module docstring; ``places_begun`` says it was).
    ``while_voting(split, assignment)`` runs during the vote when this rank's cached plan may
    hold (see the module docstring); it must not raise but for an interrupt."""

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
    ahead = cache.next_token if cache is not None else None
    if cache is not None:
        cache.next_token = None  # used once, whatever happens to this save
    token = ahead if ahead is not None else uuid.uuid4().hex[:16]
    lease: Lease | None = None
    takes_lease = (comm.is_coordinator or (leads_place and ahead is not None)) and err is None

    def cast_vote() -> dict[str, Any]:
        nonlocal lease, err
        if takes_lease:
            lease, err = outcome(lambda: begin(loc, token, overwrite, lease_ttl))
        return cast(
            dict[str, Any],
            comm.vote(
                "save planning",
                {
                    "cached": candidate,
                    "error": err,
                    "token": token if comm.is_coordinator else None,
                    "digest": combined(digests),
                    "ahead": ahead,
                    "next": uuid.uuid4().hex[:16] if comm.is_coordinator else None,
                },
                tally_planning,
                timeout,
                dead_after,
            ),
        )

    def voted() -> dict[str, Any]:
        """The vote's count; with ``while_voting`` run meanwhile when the cached plan may hold."""
        if while_voting is None or candidate is None or prepared is None:
            return cast_vote()
        assert cache is not None and cache.entry is not None
        done, box = in_thread(cast_vote, "shardsafe-planning")
        try:
            while_voting(prepared[0], cache.entry.assignment)
        finally:
            done.wait()  # the vote ends (or names a lost rank) whatever happened here
        if "error" in box:
            raise box["error"]
        return cast(dict[str, Any], box["result"])

    def agree() -> PlannedSave:
        nonlocal lease
        vote = voted()
        if cache is not None:
            cache.next_token = vote["next"]
        errors = vote["errors"] or [None] * comm.world_size
        if not any(errors) and not vote["digests_agree"]:
            every = comm.all_gather(digests)
            errors = [error_record(ValidationError(divergence(every) or "state differs"))] * len(
                errors
            )
        raise_for(errors, "save planning")
        agreed = vote["token"]
        begun = vote["begun"]
        if not begun and lease is not None and not comm.is_coordinator:
            abort(loc, token, lease)  # taken under a token the others do not share: not this save's
            lease = None
        assert prepared is not None
        split, local_plan = prepared
        if candidate is not None and vote["cached"] == candidate:
            assert cache is not None and cache.entry is not None
            cache.hits += 1
            return PlannedSave(
                loc,
                agreed,
                split,
                local_plan,
                cache.entry.assignment,
                cache.entry.coordinator_plan,
                True,
                lease,
                begun,
            )

        gathered = comm.gather(local_plan.to_json())
        replies: list[Any] | None = None
        coordinator_plan: CoordinatorPlan | None = None
        if gathered is not None:
            try:
                plans = [LocalPlan.from_json(g) for g in gathered]
                plan = make_global_plan(plans)
                coordinator_plan = (plans, plan)
                replies = [
                    {"assignment": plan.assignments[r].to_json(), "plan_id": agreed}
                    for r in range(len(plans))
                ]
            except Exception as e:
                replies = [{"errors": [error_record(e)] * len(gathered)}] * len(gathered)
        reply = comm.scatter(replies)
        raise_for(reply.get("errors") or [], "save planning")
        assignment = RankAssignment.from_json(reply["assignment"])
        if cache is not None and structure is not None:
            cache.misses += 1
            cache.entry = _CacheEntry(structure, reply["plan_id"], assignment, coordinator_plan)
        return PlannedSave(
            loc, agreed, split, local_plan, assignment, coordinator_plan, False, lease, begun
        )

    try:
        return agree()
    except BaseException:
        # a rank died, or planning failed anywhere: the coordinator drops its lease and work dir
        if lease is not None:
            abort(loc, token, lease)
        raise


def tally_planning(ballots: list[dict[str, Any]]) -> dict[str, Any]:
    """The planning vote's outcome, counted once (see :meth:`Comm.vote`): every rank's error
    (None when none failed), the coordinator's token and the next save's, the plan id when
    every rank has the same one cached, whether the replica digests agree, and whether every
    rank planned under the token the coordinator drew ahead (their place leases are then
    this save's)."""
    first = ballots[0]
    errors = [b["error"] for b in ballots]
    cached = first["cached"]
    return {
        "errors": errors if any(errors) else None,
        "token": first["token"],
        "next": first["next"],
        "cached": cached if all(b["cached"] == cached for b in ballots) else None,
        "digests_agree": len({b["digest"] for b in ballots}) == 1,
        "begun": all(b["ahead"] == first["token"] for b in ballots),
    }


def check_content_metadata(content_metadata: Mapping[str, Any] | None) -> None:
    """It is stored in the manifest, which holds no blobs: refuse what needs one before writing
    data (tuples, int keys and the like are tagged and come back exactly)."""
    if content_metadata is None:
        return
    if not isinstance(content_metadata, Mapping):
        raise ValidationError(
            f"content_metadata must be a dict, got {type(content_metadata).__name__}"
        )
    try:
        encode_inline(dict(content_metadata), "content_metadata")
    except (ValidationError, UnsafeObjectError) as e:
        raise ValidationError(f"{e}") from None
