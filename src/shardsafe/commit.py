"""The last step of a save, on the coordinator: assemble the manifest from every rank's write
record, write it last, fsync, and make the checkpoint visible (rename into place on file
systems; on object stores the manifest itself is the commit). On any failure, clean up.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from . import __version__
from .dist import error_record
from .errors import CheckpointExistsError
from .format import (
    MANIFEST_NAME,
    Extent,
    FileEntry,
    Manifest,
    ObjectEntry,
    StoredPiece,
    TensorEntry,
)
from .location import Location
from .saving import CoordinatorPlan, PlannedSave, abort, occupied, work_dir


def finalize(
    planned: PlannedSave,
    records: list[dict[str, Any]],
    overwrite: bool,
    content_metadata: Mapping[str, Any] | None,
    block_bytes: int,
) -> dict[str, Any]:
    """Coordinator: assemble the manifest from every rank's record and commit, or clean up."""
    loc, token = planned.loc, planned.token
    errors = [r.get("error") for r in records]
    if any(errors):
        abort(loc, token)
        return {"errors": errors}
    try:
        assert planned.coordinator_plan is not None
        manifest = assemble(
            planned.coordinator_plan, [r["result"] for r in records], content_metadata, block_bytes
        )
        commit(loc, token, manifest, overwrite)
    except Exception as e:
        abort(loc, token)
        return {"errors": [error_record(e)] * len(records)}
    loc.parent.remove_tree(loc.lock_name)
    return {"total_bytes": manifest.total_bytes}


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
        user_metadata={"content_metadata": dict(content_metadata)}
        if content_metadata is not None
        else {},
    )


def _extent(obj: dict[str, Any]) -> Extent:
    return Extent(obj["file"], obj["byte_offset"], obj["nbytes"], tuple(obj["checksums"]))


def commit(loc: Location, token: str, manifest: Manifest, overwrite: bool) -> None:
    """Write the manifest last; on file systems, fsync and rename the work directory into place."""
    parent = loc.parent
    work = work_dir(loc, token)
    parent.write_bytes(f"{work}/{MANIFEST_NAME}", manifest.dumps())
    if not parent.atomic_rename:
        return  # on object stores the manifest, written last, is the commit
    parent.sync_dir(f"{work}/data")
    parent.sync_dir(work)
    old = None
    if occupied(loc):
        if not overwrite:
            raise CheckpointExistsError(
                f"{loc.url} appeared while saving; pass overwrite=True to replace it"
            )
        old = loc.old_name(token)
        parent.rename(loc.name, old)
    parent.rename(work, loc.name)
    parent.sync_dir("")
    if old is not None:
        parent.remove_tree(old)
