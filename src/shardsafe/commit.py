"""The last step of a save, on the coordinator: assemble the manifest from every rank's write
record, write it last, fsync, and make the checkpoint visible (rename into place on file
systems; on object stores the manifest itself is the commit). On any failure, clean up.

:class:`SaveTarget` is the seam of the Saver that says where and how a save is published:
the persistent tier's (:class:`SharedTarget`: the coordinator publishes in the one shared
location) or a node-local place's (:class:`shardsafe.local_tier.PlaceTarget`: each place's
leader publishes the coordinator's manifest beside the files it holds).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from typing import Any, Protocol

from ._version import __version__
from .codec import encode_inline, is_plain_json
from .dist import Comm, error_record
from .errors import CheckpointError, CheckpointExistsError
from .format import (
    MANIFEST_NAME,
    Extent,
    FileEntry,
    Manifest,
    ObjectEntry,
    StoredPiece,
    TensorEntry,
)
from .lease import Lease
from .location import Location
from .save_plan import CoordinatorPlan, PlannedSave
from .save_target import abort, check_target, work_dir
from .storage import Storage

log = logging.getLogger("shardsafe")


class SaveTarget(Protocol):
    """Where and how a save is published; the Saver calls these in this order.

    ``what`` names the save in errors; ``leads_place`` says this rank publishes in a place of
    its own, whose lease planning takes when it can (:func:`shardsafe.save_plan.plan_save`).
    ``begin_places`` (collective, after planning, in which the coordinator already took its
    lease with :func:`shardsafe.save_target.begin`) prepares every other place the save writes
    to that planning did not. ``decide`` (the coordinator, once every rank's write record is in) returns
    the outcome every rank gets; ``publish`` (every rank, with that outcome) makes it visible
    where this rank publishes. ``abort`` cleans up on this rank after the exchange failed
    (``decided``: the coordinator had run ``decide``).
    """

    what: str
    leads_place: bool

    def begin_places(self, comm: Comm, planned: PlannedSave, overwrite: bool) -> None: ...

    def decide(
        self,
        planned: PlannedSave,
        records: list[dict[str, Any]],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
        block_bytes: int,
    ) -> dict[str, Any]: ...

    def publish(
        self, comm: Comm, planned: PlannedSave, status: dict[str, Any], overwrite: bool
    ) -> dict[str, Any]: ...

    def abort(self, comm: Comm, planned: PlannedSave, decided: bool) -> None: ...


class SharedTarget:
    """The persistent tier's :class:`SaveTarget`: every rank writes
    into the one shared location, the coordinator checks the files and publishes."""

    what = "save"
    leads_place = False  # the coordinator publishes, in the one shared location

    def begin_places(self, comm: Comm, planned: PlannedSave, overwrite: bool) -> None:
        """The coordinator's lease and work directory (taken while planning) are all it needs."""

    def decide(
        self,
        planned: PlannedSave,
        records: list[dict[str, Any]],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
        block_bytes: int,
    ) -> dict[str, Any]:
        return finalize(planned, records, overwrite, content_metadata, block_bytes)

    def publish(
        self, comm: Comm, planned: PlannedSave, status: dict[str, Any], overwrite: bool
    ) -> dict[str, Any]:
        return status  # the coordinator published in decide

    def abort(self, comm: Comm, planned: PlannedSave, decided: bool) -> None:
        if comm.is_coordinator and not decided:  # decide cleans up after itself
            abort(planned.loc, planned.token, planned.lease)


def finalize(
    planned: PlannedSave,
    records: list[dict[str, Any]],
    overwrite: bool,
    content_metadata: Mapping[str, Any] | None,
    block_bytes: int,
) -> dict[str, Any]:
    """Coordinator: assemble the manifest from every rank's record and commit, or clean up.

    Returns the status every rank raises from or reports; nothing raises out of here.
    """
    loc, token, lease = planned.loc, planned.token, planned.lease
    errors = [r.get("error") for r in records]
    try:
        if any(errors):
            abort(loc, token, lease)
            return {"errors": errors}
        assert planned.coordinator_plan is not None
        manifest = assemble(
            planned.coordinator_plan, [r["result"] for r in records], content_metadata, block_bytes
        )
    except Exception as e:
        return _failed(loc, token, lease, e, len(records))
    return publish_manifest(loc, token, lease, manifest, overwrite, len(records))


def publish_manifest(
    loc: Location,
    token: str,
    lease: Lease | None,
    manifest: Manifest,
    overwrite: bool,
    ranks: int,
) -> dict[str, Any]:
    """Coordinator: check every file ``manifest`` lists is in the work directory, commit, and
    release the lease; or clean up. Returns the status for ``ranks`` ranks; never raises."""
    try:
        check_files(loc, token, manifest)
        commit(loc, token, manifest, overwrite, lease)
    except Exception as e:
        return _failed(loc, token, lease, e, ranks)
    try:
        if lease is not None:
            lease.release()
    except Exception as e:  # committed: a leftover lease only expires
        log.warning("could not release the lease of %s: %s", loc.url, e)
    return {"total_bytes": manifest.total_bytes}


def _failed(
    loc: Location, token: str, lease: Lease | None, e: Exception, ranks: int
) -> dict[str, Any]:
    try:
        abort(loc, token, lease)
    except Exception as cleanup:
        log.warning("could not clean up after the failed save into %s: %s", loc.url, cleanup)
    return {"errors": [error_record(e)] * ranks}


def check_files(loc: Location, token: str, manifest: Manifest) -> None:
    """Every file the ranks reported must be where the commit will publish it, with its size:
    a rank that wrote to a disk only it sees must fail the save, not leave a hole in it."""
    work = work_dir(loc, token)
    for name, entry in sorted(manifest.files.items()):
        rel = f"{work}/{name}"
        try:
            size = loc.parent.size(rel)
        except FileNotFoundError:
            size = None
        if size != entry.nbytes:
            found = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"{loc.parent.describe(rel)}, written by rank {entry.rank} ({entry.nbytes} bytes), "
                f"{found} where the coordinator looks: every rank must write to the same shared "
                "storage; nothing was committed"
            )


def assemble(
    coordinator_plan: CoordinatorPlan,
    results: list[dict[str, Any]],
    content_metadata: Mapping[str, Any] | None,
    block_bytes: int,
) -> Manifest:
    plans, plan = coordinator_plan
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
        key: TensorEntry(
            dtype, shape, tuple(sorted(pieces[key], key=lambda p: (p.offset, p.flat or (0, 0))))
        )
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
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        library_version=__version__,
        user_metadata=content_metadata_entry(content_metadata),
    )


def content_metadata_entry(content_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest's ``user_metadata``: plain JSON under ``content_metadata`` when JSON gives it
    back exactly, else its encoded value under ``content_metadata_encoded`` (tuples, int keys)."""
    if content_metadata is None:
        return {}
    value = dict(content_metadata)
    if is_plain_json(value):
        return {"content_metadata": value}
    return {"content_metadata_encoded": encode_inline(value, "content_metadata")}


def _extent(obj: dict[str, Any]) -> Extent:
    return Extent(obj["file"], obj["byte_offset"], obj["nbytes"], tuple(obj["checksums"]))


def commit(
    loc: Location, token: str, manifest: Manifest, overwrite: bool, lease: Lease | None = None
) -> None:
    """Write the manifest last and publish; a checkpoint being replaced stays complete until then.

    File systems: fsync, then swap the work directory with the old checkpoint in one atomic
    ``exchange`` (or rename it into place when there is none) and remove the old one. Where
    the file system cannot exchange, the old checkpoint is renamed aside first; a crash
    between the two renames leaves both complete beside the name, and the next clean-up
    renames the new one into place (:func:`shardsafe.directory.recover`).

    With ``lease``, the check that the lease is still this save's and the renames run under
    the parent directory's publish fence (:meth:`Storage.fence`): a save stalled past its
    lease's expiry (SIGSTOP, a paused VM) either publishes before the save that took its lease
    does (which then replaces it) or finds its lease gone and aborts; it never swaps its
    checkpoint over the newer one (FORMAT.md "Leases").

    Object stores: the new data files carry the save's token, so writing them never touched
    the old checkpoint; the manifest PUT replaces the old one in one step and is the commit.
    The old checkpoint's files are deleted after it.
    """
    parent = loc.parent
    work = work_dir(loc, token)
    if not parent.atomic_rename:
        if lease is not None:
            lease.check()
        parent.write_bytes(f"{work}/{MANIFEST_NAME}", manifest.dumps())
        try:
            remove_unlisted(parent, loc.name, manifest)
        except Exception as e:  # past the commit point: never abort
            log.warning("%s committed, but removing the replaced files failed: %s", loc.url, e)
        return
    parent.write_bytes(f"{work}/{MANIFEST_NAME}", manifest.dumps())
    parent.sync_dir(f"{work}/data")
    parent.sync_dir(work)
    with _fence(loc, lease):
        if lease is not None:
            lease.check()
        old = _publish(loc, parent, work, token, overwrite)
    _after_commit(loc, parent, old)


@contextmanager
def _fence(loc: Location, lease: Lease | None) -> Iterator[None]:
    if lease is None:
        yield
        return
    with ExitStack() as stack:
        try:
            stack.enter_context(loc.parent.fence("", lease.ttl))
        except TimeoutError as e:
            raise CheckpointExistsError(
                f"{e}: a save stalled in its publish (stopped or paused?) holds the fence; "
                f"nothing was committed to {loc.url}: retry once it has finished or been stopped"
            ) from None
        yield


def _publish(loc: Location, parent: Storage, work: str, token: str, overwrite: bool) -> str | None:
    """Move the work directory to the name; return where the replaced checkpoint now is."""
    if parent.exists(loc.name):
        check_target(loc, overwrite)
        if parent.exchange(work, loc.name):
            return work  # the work directory now holds the old checkpoint
        old = loc.old_name(token)
        parent.rename(loc.name, old)
        parent.rename(work, loc.name)
        return old
    parent.rename(work, loc.name)
    return None


def _after_commit(loc: Location, parent: Storage, old: str | None) -> None:
    """fsync the parent, delete what was replaced. Past the commit point a failure must not
    abort (that would delete committed files): what is left is a leftover for the clean-up."""
    try:
        parent.sync_dir("")
        if old is not None:
            parent.remove_tree(old)
    except Exception as e:
        log.warning("%s committed, but tidying up after it failed: %s", loc.url, e)


def remove_unlisted(storage: Storage, name: str, manifest: Manifest) -> None:
    """Delete the data files under ``name`` that ``manifest`` does not list (a replaced checkpoint's)."""
    for entry in storage.list_dir(f"{name}/data"):
        if f"data/{entry}" not in manifest.files:
            storage.remove_tree(f"{name}/data/{entry}")
