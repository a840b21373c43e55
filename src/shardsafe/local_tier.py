"""The node-local tier: frequent checkpoints on each host's own disk, with copies on peers.

Every rank writes its share of a step into its *place* (its host's local root, e.g. a RAM
disk or local NVMe) and sends a copy of its files to ``replicas`` ranks on other hosts
(:func:`shardsafe.peers.replica_peers`), who write them into theirs. A local save is an
ordinary :class:`shardsafe.saver.Saver` async save (plan, staging, the writer thread, the
store channel with heartbeats, the coordinator's manifest) configured with two seams: its
target (:class:`PlaceTarget`) has each place's leader (its lowest rank) take a lease there
and publish the step in its own directory, the same manifest everywhere beside the data
files that place holds; its after-write step sends the copies to peers and checks them. A
local step directory is an ordinary shardsafe checkpoint that may lack the files held
elsewhere. What the tier adds is that replication, the drain into the persistent tier and
retention in each place.

What a local save moves: each rank writes each of its bytes once, into its own file in its
place; the copy is streamed to each peer by reading that file (no second local write), and
each peer writes it once into its own place, checking the block checksums as the bytes arrive
(:class:`shardsafe.checksum.StreamCheck`; nothing copied is read back). Every byte is so
written on ``replicas + 1`` hosts, once on each.

A node's disk outlives the job, and several runs may share one ``local_root``: each run keeps
its steps in its own directory ``<local_root>/run-<key>/``, the key a digest of the run's
identity (the ``run_id`` the user gave, else the persistent root as the coordinator resolves
it), spelled out in ``run.json`` there. A run reads, replaces and deletes nothing outside it.

Restoring from it is :mod:`shardsafe.local_restore`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as tdist

from .checksum import DEFAULT_BLOCK_BYTES, StreamCheck
from .commit import assemble, commit, publish_manifest
from .directory import StepDirectory, parse_step
from .dist import Comm, error_record, get_comm, outcome, raise_for
from .errors import CheckpointError, DistributedError
from .format import Extent, Manifest
from .lease import LEASE_SECONDS, Lease
from .location import Location
from .peers import Copy, Place, check_offered, check_offered_size, place_ranks, replica_peers
from .retention import Retention, retain
from .save_plan import PlannedSave
from .save_target import abort, begin, work_dir
from .saver import AfterWrite, AsyncSaveHandle, Saver, SaveStats
from .signals import DEAD_AFTER
from .staging import StagingPool
from .storage import is_url
from .transfer import exchange_files

log = logging.getLogger("shardsafe")

T = TypeVar("T")


RUN_FILE = "run.json"
"""In a run's directory of a local root: the identity whose digest names the directory."""


def run_identity(persistent_root: str, run_id: str | None = None) -> dict[str, str]:
    """What tells one run's local steps from another's: ``run_id`` when the user gives one
    (a run whose persistent root moves keeps its local steps), else the persistent root
    (symbolic links resolved for a path, as given for a URL)."""
    if run_id is not None:
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty str or None, got {run_id!r}")
        return {"run_id": run_id}
    text = os.fspath(persistent_root)
    return {"persistent_root": text.rstrip("/") if is_url(text) else os.path.realpath(text)}


def run_dir_name(identity: Mapping[str, str]) -> str:
    """``run-<16 hex digits>``: the directory of a run's local steps under a local root."""
    canonical = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
    return "run-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _claim_run_dir(base: str, name: str, identity: Mapping[str, str]) -> None:
    """Leader of a place: create ``base/name`` with its ``run.json``, or check that the one
    there is this run's; say (once) that steps of an earlier version lie directly in ``base``."""
    storage = StepDirectory(base).storage
    storage.make_dir(name)
    rel = f"{name}/{RUN_FILE}"
    mine = json.dumps(dict(identity), sort_keys=True, indent=1).encode()
    try:
        theirs = json.loads(storage.read_bytes(rel)) if storage.exists(rel) else None
    except (OSError, ValueError):
        theirs = None  # a crash while writing it: written again below
    if theirs is not None and theirs != dict(identity):
        raise CheckpointError(
            f"{storage.describe(rel)} names another run ({theirs}) than this one "
            f"({dict(identity)}): the directory {storage.describe(name)} is not this run's "
            "(an edited file or a digest collision); remove it if no job uses it"
        )
    if theirs is None:
        tmp = f"{name}/.{RUN_FILE}.tmp-{uuid.uuid4().hex[:12]}"
        storage.write_bytes(tmp, mine)
        storage.rename(tmp, rel)
    legacy = sorted(n for n in storage.list_dir("") if parse_step(n) is not None)
    if legacy:
        log.warning(
            "local tier: %s holds local steps of an earlier shardsafe version (%s%s); they name "
            "no run, so no run restores or deletes them: remove them when no job needs them",
            base,
            ", ".join(legacy[:3]),
            " ..." if len(legacy) > 3 else "",
        )


@dataclass(frozen=True)
class LocalPlaces:
    """What a restore from the local tier needs of it: the places, this rank's among them,
    the ranks and the copy group (:mod:`shardsafe.local_restore` takes this, not the tier)."""

    comm: Comm
    host: str  # this rank's host (``node_id``)
    root: str  # this run's directory of local steps in this rank's place
    dir: StepDirectory  # ``root`` as a directory of steps
    place: Place  # (host, root) of this rank
    places: list[Place]  # every rank's place, by rank
    ranks_of: dict[Place, list[int]]  # the ranks of each place, lowest (its leader) first
    leader: bool  # this rank leads its place
    group: Any  # the tier's own gloo group for copies (None in one process)
    timeout: float  # how long a rank waits for the others to arrive
    dead_after: float  # a rank silent this long while others wait for it is dead
    # runs one exchange with some peers, naming a peer that stops heartbeating
    # (:meth:`LocalTier.copy_round`)
    copy_round: Callable[[Callable[[], Any], Iterable[int]], Any]


@dataclass(frozen=True)
class Drain:
    """Copy a committed local step into the persistent tier instead of saving it twice."""

    loc: Location  # the persistent checkpoint to create
    lease_ttl: float
    on_commit: Callable[[], None]  # the coordinator's bookkeeping once it committed


class PlaceTarget:
    """The local tier's :class:`shardsafe.commit.SaveTarget`: each place's leader takes
    a lease and makes the work directory in its place, and publishes there the manifest the
    coordinator assembled (no shared storage: the file check is the after-write's, the peers
    confirm every copy). A place that fails to publish says so; the others have the step."""

    what = "local save"

    def __init__(
        self, leader: bool, host: str, lease_ttl: float, on_published: Callable[[str], None]
    ) -> None:
        self.leader = leader
        self.leads_place = leader  # planning takes this place's lease when it can
        self.host = host
        self.lease_ttl = lease_ttl
        self.on_published = on_published  # the leader's retention after each publish

    def begin_places(self, comm: Comm, planned: PlannedSave, overwrite: bool) -> None:
        """Collective: every other place's leader takes the lease there and makes the work
        directory (the coordinator did in planning, and so did every leader when the save's
        token was known ahead: then there is nothing left to do, and no all-gather)."""
        if planned.places_begun:
            return
        err = None
        if self.leader and not comm.is_coordinator:
            planned.lease, err = outcome(
                lambda: begin(planned.loc, planned.token, overwrite, self.lease_ttl)
            )
        if comm.distributed:
            errors = [r["error"] for r in comm.all_gather({"error": err})]
            if any(errors):
                if planned.lease is not None:
                    abort(planned.loc, planned.token, planned.lease)
                raise_for(errors, "local save")

    def decide(
        self,
        planned: PlannedSave,
        records: list[dict[str, Any]],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
        block_bytes: int,
    ) -> dict[str, Any]:
        """Coordinator: the manifest every place publishes, or the errors."""
        errors = [r.get("error") for r in records]
        if any(errors):
            return {"errors": errors}
        try:
            assert planned.coordinator_plan is not None
            manifest = assemble(
                planned.coordinator_plan,
                [r["result"] for r in records],
                content_metadata,
                block_bytes,
            )
        except Exception as e:
            return {"errors": [error_record(e)] * len(records)}
        return {"manifest": json.loads(manifest.dumps()), "total_bytes": manifest.total_bytes}

    def publish(
        self, comm: Comm, planned: PlannedSave, status: dict[str, Any], overwrite: bool
    ) -> dict[str, Any]:
        """Leader: write the manifest beside this place's files and rename the step into place."""
        if not self.leader:
            return status
        loc, token, lease = planned.loc, planned.token, planned.lease
        if status.get("errors"):
            abort(loc, token, lease)
            return status
        try:
            manifest = Manifest.from_json(status["manifest"])
            commit(loc, token, manifest, overwrite=overwrite, lease=lease)
        except Exception as e:
            abort(loc, token, lease)
            raise CheckpointError(
                f"local step {loc.url} could not be published on {self.host}: {e}; "
                "the other hosts have it, restore fetches what this host lacks"
            ) from e
        if lease is not None:
            try:
                lease.release()
            except Exception as e:  # committed: a leftover lease only expires
                log.warning("could not release the lease of %s: %s", loc.url, e)
        self.on_published(loc.name)
        return status

    def abort(self, comm: Comm, planned: PlannedSave, decided: bool) -> None:
        if self.leader:  # the coordinator's decision publishes nothing: always safe
            abort(planned.loc, planned.token, planned.lease)


class LocalTier:
    """One rank's view of the node-local tier under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        persistent_root: str | os.PathLike[str],
        run_id: str | None = None,
        process_group: Any = None,
        node_id: str | None = None,
        replicas: int = 1,
        keep_last: int = 2,
        timeout: float = 1800.0,
        dead_after: float = DEAD_AFTER,
        lease_ttl: float = LEASE_SECONDS,
        files_per_rank: int = 2,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        verify_after_write: bool = False,
        direct_io: str | None = None,
        max_staging_bytes: int | None = None,
        staging: StagingPool | None = None,  # host staging memory shared with another Saver
    ) -> None:
        text = os.fspath(root)
        if is_url(text):
            raise CheckpointError(
                f"local_root must be a directory on this host's own disk, not {text!r}"
            )
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"local_keep_last must be a positive int, got {keep_last!r}")
        identity = run_identity(os.fspath(persistent_root), run_id)
        self.process_group = process_group
        self.comm = get_comm(process_group)
        self.comm.dead_after = dead_after
        self.base = os.path.abspath(text)
        """The ``local_root`` as given: this run's steps are in its directory :attr:`root`."""
        self.host = str(node_id) if node_id is not None else socket.gethostname()
        self.keep_last = keep_last
        # a damaged local step is of no use to a restore: it does not stay for inspection
        self.retention = Retention(keep_last, inspect_damaged=False)
        self.timeout = timeout
        self.dead_after = dead_after
        self.lease_ttl = lease_ttl
        self.block_bytes = block_bytes
        comm = self.comm
        report: list[Any] = [self.host, self.base, identity]
        places = comm.all_gather(report) if comm.distributed else [report]
        # the coordinator's view of the run: every place keeps it in the same directory
        self.identity: dict[str, str] = dict(places[0][2])
        run_dir = run_dir_name(self.identity)
        self.root = os.path.join(self.base, run_dir)
        """This run's directory of local steps under the local root (see the module docstring)."""
        self.places: list[Place] = [(str(h), os.path.join(str(b), run_dir)) for h, b, _ in places]
        self.place: Place = (self.host, self.root)
        self.ranks_of = place_ranks(self.places)
        self.leader = self.ranks_of[self.place][0] == comm.rank
        hosts = [p[0] for p in self.places]
        distinct = len(set(hosts))
        if replicas > distinct - 1:
            # a job restarted on fewer hosts must still restore and train: say loudly what is lost
            log.warning(
                "local tier: replicas=%d but the ranks run on %d host(s) (%s): local steps get "
                "%d copies on other hosts and do not survive losing %s",
                replicas,
                distinct,
                ", ".join(sorted(set(hosts))),
                distinct - 1,
                "that host" if distinct == 1 else "more hosts",
            )
            replicas = distinct - 1
        self.peers = replica_peers(hosts, replicas)
        self.replicas = replicas
        self.sources = [r for r in range(comm.world_size) if comm.rank in self.peers[r]]
        self.dir = StepDirectory(self.root)
        self.group: Any = None
        self._lost: str | None = None  # why a copy round was given up: the group is unusable
        if comm.distributed and comm.world_size > 1:
            # its own gloo group: copies move from a background thread while the training loop
            # runs collectives on the main group. A peer that stops heartbeating is named within
            # dead_after (Comm.with_peers); the group's timeout bounds only a slow, alive one
            self.group = tdist.new_group(
                ranks=[comm.global_rank(r) for r in range(comm.world_size)],
                backend="gloo",
                timeout=timedelta(seconds=timeout),
                use_local_synchronization=True,
            )
        self._lock = threading.Lock()  # guards _active
        self._active: set[str] = set()  # local steps being saved (retention leaves them alone)
        # the one save pipeline, published in every place, with copies to peers after writing
        self.saver = Saver(
            comm,
            files_per_rank=files_per_rank,
            block_bytes=block_bytes,
            timeout=timeout,
            dead_after=dead_after,
            lease_ttl=lease_ttl,
            verify_after_write=verify_after_write,
            direct_io=direct_io,
            max_staging_bytes=max_staging_bytes,
            staging=staging,
            target=PlaceTarget(self.leader, self.host, lease_ttl, self._retain),
            after_write=AfterWrite(self._after_write, self._check_copies),
        )
        err = None
        if self.leader:
            _, err = outcome(lambda: _claim_run_dir(self.base, run_dir, self.identity))
            if err is None:
                _, err = outcome(self.dir.clean)
        errors = comm.all_gather(err) if comm.distributed else [err]
        if any(errors):
            self.close()
            raise_for(errors, f"opening the local tier in {self.base}")

    @property
    def view(self) -> LocalPlaces:
        """The places of this tier as a restore sees them."""
        return LocalPlaces(
            self.comm,
            self.host,
            self.root,
            self.dir,
            self.place,
            self.places,
            self.ranks_of,
            self.leader,
            self.group,
            self.timeout,
            self.dead_after,
            self.copy_round,
        )

    # -- saving -----------------------------------------------------------------------------
    def save(
        self,
        name: str,
        state: Any,
        *,
        content_metadata: Mapping[str, Any] | None = None,
        on_commit: Callable[[], None] | None = None,
        drain: Drain | None = None,
    ) -> AsyncSaveHandle:
        """Collective: stage ``state`` and return; writing, copying to peers and the commit
        run in the background. The handle completes when every place has the step (and,
        with ``drain``, when its copy in the persistent tier has committed too)."""
        inner = self.saver.async_save(
            state,
            os.path.join(self.root, name),
            overwrite=True,
            content_metadata=content_metadata,
        )
        with self._lock:
            self._active.add(name)

        def after() -> SaveStats:
            try:
                stats = inner.result()
                log.debug(
                    "rank %d: local step %s committed in %.3f s",
                    self.comm.rank,
                    stats.path,
                    stats.seconds,
                )
                if drain is not None:
                    stats.seconds_draining = self._drain(name, stats, drain)
                return stats
            finally:
                with self._lock:
                    self._active.discard(name)
                if on_commit is not None:
                    on_commit()

        return self.saver.then(inner, after)

    def _drain(self, step: str, done: SaveStats, drain: Drain) -> float:
        """Copy every rank's own files of the committed local step into a new persistent
        checkpoint and commit it with the same manifest (same leases, channel and checks as
        any save); returns the seconds it took."""
        comm = self.comm
        t0 = time.perf_counter()
        token = uuid.uuid4().hex[:16] if not comm.distributed else done.token[:12] + "dr"
        ploc = drain.loc
        parent = ploc.parent
        work = work_dir(ploc, token)

        def target(name: str) -> str:
            return name if parent.atomic_rename else name.replace(".bin", f"-{token}.bin")

        lease: Lease | None = None

        def take_lease(records: list[dict[str, Any]]) -> dict[str, Any]:
            nonlocal lease
            errors = [r.get("error") for r in records]
            if any(errors):  # a rank lost since the local commit
                return {"errors": errors}
            lease, err = outcome(lambda: begin(ploc, token, True, drain.lease_ttl))
            return {"errors": [err] * comm.world_size} if err else {}

        # every rank posts once its local save returned, a place's leader after publishing the
        # step there: no rank reads its files from the step before its place has renamed it in
        status = self.saver.round(token + "b", {"error": None}, take_lease)
        raise_for(status.get("errors") or [], "drain to the persistent tier")
        source = self.dir.storage

        def copy_mine() -> dict[str, int]:
            sizes = {}
            for f in done.files:
                sizes[target(f)] = _copy_file(source, f"{step}/{f}", parent, f"{work}/{target(f)}")
            return sizes

        copied, err = outcome(copy_mine)

        def publish(records: list[dict[str, Any]]) -> dict[str, Any]:
            errors = [r.get("error") for r in records]
            if any(errors):
                with contextlib.suppress(Exception):
                    abort(ploc, token, lease)
                return {"errors": errors}
            assert done.manifest is not None
            published = publish_manifest(
                ploc, token, lease, _renamed(done.manifest, target), True, comm.world_size
            )
            if published.get("errors"):
                return published
            _, err = outcome(drain.on_commit)
            return {"errors": [err] * comm.world_size} if err else {}

        status = self.saver.round(token + "c", {"error": err, "files": copied}, publish)
        raise_for(status.get("errors") or [], "drain to the persistent tier")
        return time.perf_counter() - t0

    def _after_write(
        self, planned: PlannedSave, result: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The after-write step: every rank takes part in the copying, even after a failure
        of its own (its peers wait for it)."""
        received, err = self._copy_to_peers(planned, planned.loc, result)
        return {"received": received}, err

    def _check_copies(self, records: list[dict[str, Any]]) -> None:
        """Coordinator: every file reached every peer of its writer."""
        for rank, r in enumerate(records):
            for peer in self.peers[rank]:
                got = records[peer].get("received") or {}
                for name, size in r["result"]["files"].items():
                    if got.get(name) != size:
                        raise CheckpointError(
                            f"rank {peer} ({self.places[peer][0]}) did not confirm its copy of "
                            f"{name} from rank {rank}"
                        )

    def _copy_to_peers(
        self, planned: PlannedSave, loc: Location, result: dict[str, Any] | None
    ) -> tuple[dict[str, int], dict[str, Any] | None]:
        """Send this rank's files to its peers and take its sources' files; verify each copy."""
        if self.group is None or not self.replicas:
            return {}, None
        comm = self.comm
        storage = loc.parent
        work = work_dir(loc, planned.token)
        offer: dict[str, Any] = {"files": {}, "extents": []}
        if result is not None:
            offer = {
                "files": result["files"],
                "extents": [*result["pieces"].values(), *result["blobs"].values()],
            }
        errors: list[str] = []
        offers: dict[int, dict[str, Any]] = {}
        try:
            headers = self.copy_round(
                lambda: self._swap_headers(json.dumps(offer).encode()),
                [*self.peers[comm.rank], *self.sources],
                f"shardsafe/copies/{planned.token}/headers/dead",
            )
        except DistributedError as e:
            return {}, error_record(e)
        for src, raw in headers.items():
            offers[src], problem = self._parse_offer(src, raw)
            if problem:
                errors.append(problem)
        copies = [
            Copy(n, int(s), comm.rank, dst)
            for dst in self.peers[comm.rank]
            for n, s in sorted(offer["files"].items())
        ]
        # each copy is checked as it arrives against its sender's block checksums: no copied
        # byte is read back (the size on disk is still compared, for bytes outside extents)
        checks: dict[Copy, StreamCheck] = {}
        for src, theirs in sorted(offers.items()):
            by_file: dict[str, list[Extent]] = theirs["extents"]
            for n, s in sorted(theirs["files"].items()):
                c = Copy(n, s, src, comm.rank)
                copies.append(c)
                if n not in theirs["refused"]:
                    checks[c] = StreamCheck(by_file.get(n, []), self.block_bytes)
        try:
            errors += self.copy_round(
                lambda: exchange_files(
                    self.group,
                    comm.rank,
                    comm.global_rank,
                    copies,
                    storage,
                    lambda n: f"{work}/{n}",
                    storage,
                    lambda n: f"{work}/{n}",
                    checks=checks,
                ),
                {c.src if c.dst == comm.rank else c.dst for c in copies},
                f"shardsafe/copies/{planned.token}/files/dead",
            )
        except DistributedError as e:
            return {}, error_record(e)
        received: dict[str, int] = {}
        for c, check in checks.items():  # refused names were never written: no entry
            rel = f"{work}/{c.name}"
            try:
                bad = check.finish()
                size = storage.size(rel)
            except Exception as e:
                bad, size = [str(e)], -1
            if bad or size != c.nbytes:
                errors.append(
                    f"the copy of {c.name} from rank {c.src} ({self.places[c.src][0]}) arrived "
                    f"damaged on rank {comm.rank} ({self.host}): "
                    f"{bad[0] if bad else f'{size} of {c.nbytes} bytes'}"
                )
            else:
                received[c.name] = c.nbytes
        if errors:
            failure = CheckpointError(
                f"copying local-tier files between hosts failed: {'; '.join(errors[:5])}"
            )
            return received, error_record(failure)
        return received, None

    def copy_round(
        self, exchange: Callable[[], T], peers: Iterable[int], key: str | None = None
    ) -> T:
        """One copy round with ``peers``, under :meth:`~shardsafe.dist.Comm.with_peers`: a peer
        that stops heartbeating is named within ``dead_after``. Its thread may stay blocked
        in gloo afterwards, so the tier's group is not used again. ``key``, the same on every
        rank of the round, carries a verdict to every rank in it: a rank whose peers are alive
        but held by a frozen rank it does not look at learns of it from the rank that does."""
        if self._lost is not None:
            raise DistributedError(
                f"rank {self.comm.rank}: the local tier's copies stopped after an earlier copy "
                f"round lost a peer ({self._lost}); restart the job"
            )
        try:
            return self.comm.with_peers(
                exchange, peers, "the local tier's copy round", self.dead_after, verdict_key=key
            )
        except DistributedError as e:
            self._lost = str(e)
            raise

    def _parse_offer(self, src: int, raw: bytes) -> tuple[dict[str, Any], str | None]:
        """What rank ``src`` offers to send: ``{"files": {name: size}, "extents": {name:
        [Extent]}, "refused": {names}}``, and what is wrong with it. Every name is checked as
        a manifest's are before it becomes a path here; a refused name still gets its stream
        (its bytes are dropped) so that the sender is never left waiting."""
        sender = f"rank {src} ({self.places[src][0]})"
        files: dict[str, int] = {}
        refused: set[str] = set()
        extents: dict[str, list[Extent]] = {}
        problems: list[str] = []
        try:
            body = json.loads(raw)
            offered = body["files"]
            if not isinstance(offered, dict):
                raise TypeError(f"files is a {type(offered).__name__}")
        except Exception as e:
            problem = f"the offer of {sender} is not readable ({e}); it runs different code?"
            return {"files": {}, "extents": {}, "refused": set()}, problem
        for n, size in offered.items():
            try:
                files[n] = check_offered_size(size, str(n)[:100], sender)
            except CheckpointError as e:
                files[n] = 0
                problems.append(str(e))
            try:
                check_offered(n, sender)
            except CheckpointError as e:
                refused.add(n)
                problems.append(str(e))
        try:
            for x in body.get("extents") or []:
                if x["file"] in files and x["file"] not in refused:
                    extents.setdefault(x["file"], []).append(
                        Extent(x["file"], x["byte_offset"], x["nbytes"], tuple(x["checksums"]))
                    )
        except Exception as e:
            refused.update(files)  # nothing to check the copies against
            problems.append(f"the offer of {sender} has unreadable checksums ({e})")
        return {"files": files, "extents": extents, "refused": refused}, (
            "; ".join(problems) or None
        )

    def _swap_headers(self, payload: bytes) -> dict[int, bytes]:
        """Send ``payload`` to this rank's peers; return what each of its sources sent."""
        comm, group = self.comm, self.group
        lengths = {src: torch.zeros(1, dtype=torch.int64) for src in self.sources}
        mine = torch.tensor([len(payload)], dtype=torch.int64)
        ops = [
            tdist.isend(mine, dst=comm.global_rank(d), group=group) for d in self.peers[comm.rank]
        ]
        ops += [tdist.irecv(t, src=comm.global_rank(s), group=group) for s, t in lengths.items()]
        for op in ops:
            cast(Any, op).wait()
        body = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.zeros(0, dtype=torch.uint8)
        )
        bufs = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in lengths.items()}
        ops = [
            tdist.isend(body, dst=comm.global_rank(d), group=group) for d in self.peers[comm.rank]
        ]
        ops += [tdist.irecv(b, src=comm.global_rank(s), group=group) for s, b in bufs.items()]
        for op in ops:
            cast(Any, op).wait()
        return {s: bytes(b.numpy()) for s, b in bufs.items()}

    def _retain(self, latest: str) -> None:
        """Leader: point ``latest`` at the new step and keep the newest ``keep_last`` intact ones."""

        def active() -> set[str]:
            with self._lock:
                return set(self._active)

        try:
            retain(self.dir, latest, lambda c: self.retention.doomed(self.dir, c, latest), active)
        except Exception as e:
            log.warning("local tier %s: retention failed: %s", self.root, e)

    def settle(self) -> None:
        """Wait for the local save in flight; its failure stays on its handle (and in the log)."""
        self.saver.settle("the local save")

    def wait(self) -> None:
        """Wait for the local save in flight; raise its error unless already seen."""
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()

    # -- restoring --------------------------------------------------------------------------
    def mark_damaged(self, name: str, reason: str) -> None:
        if self.leader and self.dir.is_committed(name):
            try:
                self.dir.mark_damaged(name, reason)
            except Exception as e:
                log.warning("could not mark %s damaged: %s", self.dir.path(name), e)


def _copy_file(source: Any, src: str, target: Any, dst: str, chunk: int = 16 << 20) -> int:
    """Copy ``src`` to ``dst`` (a new file, fsynced); returns its size."""
    size = int(source.size(src))
    buf = bytearray(min(chunk, max(size, 1)))
    reader = source.open_read(src)
    try:
        with target.open_write(dst) as out:
            for start in range(0, size, chunk):
                n = min(chunk, size - start)
                view = memoryview(buf)[:n]
                reader.read_into(start, view)
                out.write(view)
    finally:
        reader.close()
    return size


def _renamed(manifest: Manifest, rename: Callable[[str], str]) -> Manifest:
    """``manifest`` with every data file renamed (object stores name files by save)."""

    def ext(e: Extent) -> Extent:
        return replace(e, file=rename(e.file))

    return replace(
        manifest,
        files={rename(k): v for k, v in manifest.files.items()},
        tensors={
            k: replace(t, pieces=tuple(replace(p, extent=ext(p.extent)) for p in t.pieces))
            for k, t in manifest.tensors.items()
        },
        blobs={k: ext(e) for k, e in manifest.blobs.items()},
    )
