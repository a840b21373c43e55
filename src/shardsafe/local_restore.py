"""Restore from the node-local tier: which steps the surviving places hold between them, and
how a step is brought to every place that needs it before the ordinary load reads it.

An all-gathered inventory (each place's leader reports the manifest digest and the files it
holds of every committed local step) names the steps complete across places. For the chosen
step each place fetches what its ranks will read (:func:`shardsafe.loading.files_to_read`)
from a rank that holds a copy (:func:`shardsafe.peers.plan_copies`,
:func:`shardsafe.transfer.exchange_files`), checks every copy against the manifest before
renaming it into place, and loads. A place that held none of the step fetches into a
directory of its own (``.shardsafe-fetched-<step>``, which no clean-up takes for a step). A
file there that one rank of the place alone reads (a fresh host in the saved layout: every
file) is not written at all: its bytes go from the copy round straight into that rank's
tensors (:mod:`shardsafe.delivery`), the load takes them from there, and the directory is
removed afterwards; the next local save puts the host's files back. A directory holding every
file it fetched is loaded while its leader makes the files durable (the load reads them from
the page cache meanwhile), and becomes the step once both are done. When the load finds damage,
every place checks the copies its ranks read, bad ones are replaced from other holders
(delivered files are fetched again as files) and the load runs again; a file with no intact
copy left fails the step (the caller marks it and tries the next).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

from .checksum import StreamCheck, digest
from .delivery import Deliveries
from .directory import StepDirectory, parse_step
from .dist import outcome, raise_for
from .engine import DEFAULT_MAX_BUFFER, verify_written
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedError,
    is_damaged_checkpoint,
)
from .format import MANIFEST_NAME, Extent, Manifest
from .loading import files_to_read, in_place_deliveries
from .local_tier import LocalPlaces
from .location import locate
from .peers import Place, check_offered, check_offered_size, complete_steps, plan_copies
from .storage.local import LocalStorage
from .transfer import exchange_files

log = logging.getLogger("shardsafe")

MAX_KEPT_BYTES = 1 << 20
"""A fetched file is delivered into memory only where its bytes that no tensor takes
(headers, padding, small items) fit in this many bytes of buffers of their own."""

FETCHED_PREFIX = ".shardsafe-fetched-"
"""Where a place that holds none of a step fetches it (``<prefix><step>``, in its run
directory); removed by the next restore when a restore failed or crashed."""


def inventory(tier: LocalPlaces) -> dict[str, Any]:
    """Collective: which committed local steps each place holds, and which are complete.

    Returns ``{"steps": [names, newest first, complete somewhere], "held": {place: {step:
    {file: size}}}, "manifests": {step: {file: size}}, "digests": {step: digest},
    "conflicts": {step: ["host:root digest", ...] where places hold different manifests}}``.
    Call it once the tier's save in flight has settled (:meth:`LocalTier.settle`).
    """
    report: dict[str, Any] = {"place": list(tier.place), "steps": {}}
    if tier.leader:
        damaged = tier.dir.damaged()
        for name in tier.dir.committed():
            entry = _held(tier.dir, name)
            entry["damaged"] = name in damaged
            report["steps"][name] = entry
    reports = _gather(tier, report, "the local tier's inventory")
    held: dict[Place, dict[str, dict[str, int]]] = {}
    votes: dict[str, dict[str, tuple[int, dict[str, int]]]] = {}
    damaged_anywhere: set[str] = set()
    # places whose copy of a step has no readable manifest: they hold none of it (the step
    # comes from the others' copies, and the restore moves that directory out of the way)
    unreadable: dict[str, list[Place]] = {}
    leaders = [
        (tier.places[r], _checked_report(rep, f"rank {r} ({tier.places[r][0]})"))
        for r, rep in enumerate(reports)
        if tier.ranks_of[tier.places[r]][0] == r
    ]
    for place, rep in leaders:
        for name, entry in rep["steps"].items():
            if entry.get("damaged"):
                damaged_anywhere.add(name)
            if entry.get("unreadable"):
                unreadable.setdefault(name, []).append(place)
                continue
            held.setdefault(place, {})[name] = entry["held"]
            count, files = votes.setdefault(name, {}).get(entry["digest"], (0, entry["files"]))
            votes[name][entry["digest"]] = (count + 1, files)
    manifests: dict[str, dict[str, int]] = {}
    digests: dict[str, str] = {}
    # places holding different manifests of one step: restore() refuses it as damaged
    conflicts: dict[str, list[str]] = {}
    for place, rep in leaders:
        for name, entry in rep["steps"].items():
            if not entry.get("unreadable") and len(votes[name]) > 1:
                conflicts.setdefault(name, []).append(f"{place[0]}:{place[1]} {entry['digest']}")
    for name, by_digest in votes.items():
        digest = max(sorted(by_digest), key=lambda d: by_digest[d][0])
        digests[name] = digest
        manifests[name] = by_digest[digest][1]
    # a place whose manifest differs from the majority's holds none of that step's files
    for place, rep in leaders:
        for name, entry in rep["steps"].items():
            if not entry.get("unreadable") and entry["digest"] != digests[name]:
                held.get(place, {}).pop(name, None)
    complete = [n for n in complete_steps(held, manifests) if n not in damaged_anywhere]
    return {
        "steps": list(reversed(complete)),
        "held": held,
        "manifests": manifests,
        "digests": digests,
        "conflicts": conflicts,
        "unreadable": unreadable,
    }


def restore(
    tier: LocalPlaces,
    name: str,
    inv: Mapping[str, Any],
    template: Any,
    load_into: Callable[[str, Deliveries | None], Any],
) -> Any:
    """Collective: make every place hold the files of step ``name`` its ranks will read
    (fetching verified copies from other places), then ``load_into(this place's copy,
    bytes delivered into memory)``. A place that held none of the step loads from the
    directory it fetched into; a file there that one rank of the place alone reads comes
    straight into that rank's tensors (:mod:`shardsafe.delivery`), and the directory, which
    then lacks those bytes, is removed after the load. A directory holding every byte it
    fetched becomes the step once the load succeeded and its files are synced."""
    if name in inv.get("conflicts", {}):  # the same inventory on every rank: all raise here
        raise CorruptCheckpointError(
            f"local step {name}: the hosts hold different manifest.json files (place, xxh3 "
            f"digest: {'; '.join(inv['conflicts'][name])}); none can be trusted over the others, "
            "so the step is treated as damaged"
        )
    token = os.urandom(8).hex()  # names this rank's partial files only
    held: dict[Place, dict[str, int]] = {
        p: dict(steps.get(name, {})) for p, steps in inv["held"].items()
    }
    for p in tier.ranks_of:
        held.setdefault(p, {})
    has_step = {p for p, steps in inv["held"].items() if name in steps}
    storage = tier.dir.storage
    here = tier.place in has_step
    # not a step's work directory (``.<step>.shardsafe-tmp-*``): a clean-up never puts it
    # back as the step, which it may not be (the files delivered into memory are not in it)
    fresh = f"{FETCHED_PREFIX}{name}"
    base = name if here else fresh

    # where this place fetches into a fresh directory of a local disk, its files are written
    # without an fsync each (:class:`_Syncing` syncs those it keeps while the load reads)
    defer = not here and isinstance(storage, LocalStorage)

    def dir_of(place: Place) -> str:
        return name if place in has_step else fresh

    if tier.leader:  # what a restore that failed or crashed left
        for entry in storage.list_dir(""):
            if entry.startswith(FETCHED_PREFIX):
                storage.remove_tree(entry)
    # 1. the manifest, where a place has no copy of the step
    sizes = dict(inv["manifests"][name])
    need_manifest = {p: {MANIFEST_NAME} for p in tier.ranks_of if p not in has_step}
    if need_manifest:  # every holder's copy has the same digest, so the same size
        msize = held[min(has_step)][MANIFEST_NAME]
        _fetch(
            tier,
            need_manifest,
            {p: {MANIFEST_NAME: msize} for p in has_step},
            {MANIFEST_NAME: msize},
            dir_of,
            token,
            None,
            sync=not defer,
        )
    # 2. the files every rank will read (one gather: whether each read the manifest, and what
    # it needs from it)
    manifest, err = outcome(lambda: _read_manifest(storage, base, inv["digests"][name]))
    mine: list[str] | None = None
    if manifest is not None:
        mine, err = outcome(lambda: sorted(files_to_read(template, manifest)))
    needs = _gather(tier, {"error": err, "files": mine}, f"restore of local step {name}: files")
    raise_for([cast(dict[str, Any], n)["error"] for n in needs], f"restore of local step {name}")
    assert manifest is not None
    needed: dict[Place, set[str]] = {}
    for rank, n in enumerate(needs):
        sender = f"rank {rank} ({tier.places[rank][0]})"
        files = {check_offered(f, sender) for f in n["files"]}
        unknown = sorted(files - set(manifest.files))
        if unknown:  # every rank sees the same lists: every rank raises this
            raise CorruptCheckpointError(
                f"{sender} asked for {unknown[0]!r}, which local step {name} does not hold"
            )
        needed.setdefault(tier.places[rank], set()).update(files)
    extents = _extents_by_file(manifest)
    # a file that a place fetches into a fresh directory and one rank of the place alone
    # reads goes to that rank, straight into its tensors: not written, not read back (not
    # where the place's own copy is unreadable: the fetched directory replaces that one)
    readers: dict[tuple[Place, str], list[int]] = {}
    for rank, n in enumerate(needs):
        for f in n["files"]:
            readers.setdefault((tier.places[rank], f), []).append(rank)
    repaired = {*has_step, *inv.get("unreadable", {}).get(name, ())}
    delivered = {
        key: rs[0] for key, rs in readers.items() if len(rs) == 1 and key[0] not in repaired
    }
    mine_delivered = {f for (p, f), r in delivered.items() if r == tier.comm.rank}
    deliveries = (
        _deliveries(template, manifest, {f: sizes[f] for f in mine_delivered if f in sizes})
        if mine_delivered
        else None
    )
    # 3. fetch what each place lacks from places that hold it (each copy verified on arrival);
    # into a directory of the place's own, written without an fsync per file: its leader syncs
    # them all while the load reads them from the page cache
    check = (extents, manifest.block_bytes)
    took = _fetch(
        tier,
        needed,
        held,
        sizes,
        dir_of,
        token,
        check,
        sync=not defer,
        receivers=delivered,
        deliveries=deliveries,
    )
    # a fetched directory that lacks what went into memory is never the step
    keep = here or not any(tier.places[r] == tier.place for r in took)
    if deliveries is not None:
        log.info(
            "restore: local step %s: %d bytes of %d fetched files went straight into rank %d's "
            "tensors",
            name,
            deliveries.nbytes,
            len(deliveries.files),
            tier.comm.rank,
        )
    syncing = (
        _Syncing(storage, base)
        if defer and keep and tier.leader and isinstance(storage, LocalStorage)
        else None
    )
    try:
        result = _load_repairing(
            tier,
            name,
            load_into,
            needed,
            held,
            sizes,
            dir_of,
            token,
            extents,
            manifest,
            syncing,
            deliveries,
            set(delivered),
        )
    finally:
        err = syncing.join() if syncing is not None else None
    # 4. a fetched directory holding every byte becomes the step once every rank of its place
    # has loaded from it and its files are durable; one with delivered bytes is removed
    if err is None and not here and keep and tier.leader:
        _, err = outcome(lambda: _publish_fetched(tier, storage, base, name, inv))
    _agree(tier, err, f"restore of local step {name}")
    if not keep and tier.leader:  # every rank of the place has loaded from it
        storage.remove_tree(fresh)
    return result


def _deliveries(template: Any, manifest: Manifest, sizes: Mapping[str, int]) -> Deliveries | None:
    """The files (of ``sizes``) that this rank's load reads almost wholly straight into its
    tensors, delivered whole; None where there are none, or the template cannot be planned
    against the manifest (the load then says why)."""
    try:
        out = in_place_deliveries(template, manifest, set(sizes))
    except Exception as e:
        log.debug("restore: nothing delivered in place (%s: %s)", type(e).__name__, e)
        return None
    for f, size in sorted(sizes.items()):
        out.whole(f, size, MAX_KEPT_BYTES)
    return out if out.files else None


def _load_repairing(
    tier: LocalPlaces,
    name: str,
    load_into: Callable[[str, Deliveries | None], Any],
    needed: Mapping[Place, set[str]],
    held: Mapping[Place, Mapping[str, int]],
    sizes: Mapping[str, int],
    dir_of: Callable[[Place], str],
    token: str,
    extents: Mapping[str, list[Extent]],
    manifest: Manifest,
    syncing: _Syncing | None,
    deliveries: Deliveries | None,
    delivered: set[tuple[Place, str]],
) -> Any:
    """``load_into`` this place's copy of the step; when the load finds damage, every place
    checks the copies its ranks read, bad ones are replaced from other holders, and the load
    runs again (the files that were delivered into memory fetched whole this time)."""
    base = dir_of(tier.place)
    path = os.path.join(tier.root, base)
    try:
        return load_into(path, deliveries)  # verifies every block it reads
    except CheckpointError as e:
        if not is_damaged_checkpoint(e):
            raise
        failure = e
    if syncing is not None:  # its files are checked and replaced below: no sync walks them now
        syncing.join()
    now = {
        p: {
            **held.get(p, {}),
            **{n: sizes[n] for n in needed.get(p, ()) if (p, n) not in delivered},
        }
        for p in held
    }
    refused = _verify_held(tier, needed, now, base, extents, manifest.block_bytes)
    if not refused:
        raise failure
    check = (extents, manifest.block_bytes)
    _fetch(tier, needed, now, sizes, dir_of, token, check, refused)
    _gather(tier, None, f"restore of local step {name}: replaced copies")
    log.warning(
        "restore: local step %s: replaced %d damaged cop%s from other hosts; loading again",
        name,
        len(refused),
        "y" if len(refused) == 1 else "ies",
    )
    return load_into(path, None)


class _Syncing:
    """fsync every file under ``base`` (then its directories) in a thread of its own: the
    fetched files go to disk while the load reads them from the page cache."""

    def __init__(self, storage: LocalStorage, base: str) -> None:
        self._where = storage.describe(base)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(storage, base), name="shardsafe-restore-sync", daemon=True
        )
        self._thread.start()

    def _run(self, storage: LocalStorage, base: str) -> None:
        try:
            _sync_tree(storage, base)
        except BaseException as e:
            self._error = e

    def join(self) -> dict[str, Any] | None:
        """Wait for the sync; an error record (:func:`shardsafe.dist.outcome`'s) or None."""
        self._thread.join()
        if self._error is None:
            return None
        error = self._error

        def fail() -> None:
            raise CheckpointError(
                f"cannot make the copies fetched into {self._where} durable "
                f"({type(error).__name__}: {error}); the step stays unpublished on this host"
            ) from error

        return outcome(fail)[1]


def _sync_tree(storage: LocalStorage, rel: str) -> None:
    for entry in storage.list_dir(rel):
        child = f"{rel}/{entry}"
        if storage.is_dir(child) and not storage.is_link(child):
            _sync_tree(storage, child)
            continue
        fd = os.open(storage.path(child), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    storage.sync_dir(rel)


class _Unsynced(LocalStorage):
    """The tier's storage, writing new files without an fsync each (:class:`_Syncing` makes
    them durable before their directory becomes a step)."""

    sync_writes = False


def _publish_fetched(
    tier: LocalPlaces, storage: Any, fetched: str, name: str, inv: Mapping[str, Any]
) -> None:
    """Rename the fetched copy of step ``name`` into place; a copy of it here whose manifest
    could not be read is moved aside first (and then deleted: the step is whole again)."""
    if tier.place in inv.get("unreadable", {}).get(name, ()) and storage.exists(name):
        aside = locate(os.path.join(tier.root, name)).tmp_name("unreadable")
        log.warning(
            "restore: local step %s: replacing %s, whose manifest is unreadable, with the "
            "copy fetched from other hosts",
            name,
            tier.dir.path(name),
        )
        storage.rename(name, aside)
        storage.rename(fetched, name)
        storage.remove_tree(aside)
    else:
        storage.rename(fetched, name)


def _verify_held(
    tier: LocalPlaces,
    needed: Mapping[Place, set[str]],
    held: Mapping[Place, Mapping[str, int]],
    base: str,
    extents: Mapping[str, list[Extent]],
    block_bytes: int,
) -> set[tuple[Place, str]]:
    """Each place checks the copies it will read (spread over its ranks); returns the bad ones."""
    comm = tier.comm
    ranks = tier.ranks_of[tier.place]
    mine = sorted(n for n in needed.get(tier.place, set()) if n in held.get(tier.place, {}))
    mine = [n for i, n in enumerate(mine) if ranks[i % len(ranks)] == comm.rank]
    bad: list[str] = []
    storage = tier.dir.storage
    for n in mine:
        try:
            diff = verify_written(
                storage,
                f"{base}/{n}",
                extents.get(n, []),
                block_bytes,
                DEFAULT_MAX_BUFFER,
                evict=False,
            )
        except Exception as e:
            diff = [str(e)]
        if diff:
            log.warning(
                "restore: the local copy of %s on %s is damaged (%s); fetching another",
                storage.describe(f"{base}/{n}"),
                tier.host,
                diff[0],
            )
            bad.append(n)
    every = _gather(tier, bad, "restore: checking local copies")
    return {(tier.places[r], n) for r, names in enumerate(every) for n in names}


def _fetch(
    tier: LocalPlaces,
    needed: Mapping[Place, set[str]],
    held: Mapping[Place, Mapping[str, int]],
    sizes: Mapping[str, int],
    dir_of: Callable[[Place], str],
    token: str,
    check: tuple[Mapping[str, list[Extent]], int] | None,
    refused: set[tuple[Place, str]] | None = None,
    sync: bool = True,
    receivers: Mapping[tuple[Place, str], int] | None = None,
    deliveries: Deliveries | None = None,
) -> set[int]:
    """Copy files to the places that need them; a copy that arrives damaged is refused
    and fetched again from another holder. Raises the same error on every rank when a
    file has no intact copy left. Without ``sync`` this rank writes what it receives without
    an fsync per file (the caller makes the files durable). ``receivers`` names the rank of
    a place that receives a file (the same on every rank); the files ``deliveries`` deliver
    go into this rank's memory, not into files. Returns the ranks that took a file into
    memory (the same on every rank)."""
    took: set[int] = set()
    comm = tier.comm
    refused = set(refused or ())
    storage = tier.dir.storage
    target = storage if sync else _Unsynced(storage.root)
    base = dir_of(tier.place)
    for _attempt in range(len(tier.ranks_of) + 1):
        copies, unavailable = plan_copies(needed, held, sizes, tier.ranks_of, refused, receivers)
        if unavailable:
            lost = sorted({n for names in unavailable.values() for n in names})
            raise CorruptCheckpointError(
                f"no intact copy of {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} "
                f"is left on any host ({len(lost)} files)"
            )
        if not copies:
            return took
        if any(c.dst == comm.rank for c in copies):
            # a receiver makes the directory it writes into (the place's leader cleared a
            # fresh one before the gathers that led here)
            storage.make_dir(f"{base}/data")
        # each copy is checked against the manifest's block checksums as it arrives: nothing
        # received is read back (its size on disk is still compared)
        checks = {
            c: StreamCheck(check[0].get(c.name, []), check[1])
            for c in copies
            if c.dst == comm.rank and check is not None
        }
        try:
            errors = tier.copy_round(
                partial(
                    exchange_files,
                    tier.group,
                    comm.rank,
                    comm.global_rank,
                    copies,
                    storage,
                    partial(_joined, base),
                    target,
                    partial(_part, base, token=token),
                    checks=checks,
                    deliveries=deliveries,
                ),
                {
                    c.src if c.dst == comm.rank else c.dst
                    for c in copies
                    if comm.rank in (c.src, c.dst)
                },
            )
        except DistributedError as e:  # a peer lost: the reports' arrival names it everywhere
            errors = [str(e)]
        failed: list[str] = []
        for c in copies:
            if c.dst != comm.rank:
                continue
            part = _part(base, c.name, token)
            ok = not errors
            in_memory = deliveries is not None and c.name in deliveries.files
            if ok and c in checks:
                try:
                    ok = not checks[c].finish() and (in_memory or storage.size(part) == c.nbytes)
                except Exception:
                    ok = False
            if ok and in_memory:
                continue  # no file: the load takes its bytes from memory
            if ok:
                storage.rename(part, f"{base}/{c.name}")
            else:
                storage.remove_tree(part)
                failed.append(c.name)
                log.warning(
                    "restore: the copy of %s from rank %d (%s) is damaged; trying another holder",
                    c.name,
                    c.src,
                    tier.places[c.src][0],
                )
        took_any = any(
            c.dst == comm.rank and deliveries is not None and c.name in deliveries.files
            for c in copies
        )
        reports = _gather(
            tier,
            {"failed": failed, "errors": errors, "in_memory": took_any},
            "restore: copy reports",
        )
        took |= {r for r, rep in enumerate(reports) if rep.get("in_memory")}
        if any(r["errors"] for r in reports):
            raise CheckpointError(
                "copying checkpoint files between hosts failed: "
                + "; ".join(
                    f"rank {i}: {r['errors'][0]}" for i, r in enumerate(reports) if r["errors"]
                )
            )
        bad = {
            (tier.places[c.src], c.name)
            for c in copies
            for n in reports[c.dst]["failed"]
            if n == c.name
        }
        if not bad:
            return took
        refused |= bad
        # what arrived intact is held now
        now = {p: dict(h) for p, h in held.items()}
        for c in copies:
            if c.name not in reports[c.dst]["failed"]:
                now[tier.places[c.dst]][c.name] = c.nbytes
        held = now
    raise CorruptCheckpointError("copies kept arriving damaged; giving up on this step")


def _agree(tier: LocalPlaces, err: dict[str, Any] | None, stage: str) -> None:
    raise_for([r["error"] for r in _gather(tier, {"error": err}, stage)], stage)


def _gather(tier: LocalPlaces, obj: Any, stage: str) -> list[Any]:
    """Every rank's ``obj``, gathered after an arrival through the store
    (:meth:`~shardsafe.dist.Comm.arrive`): a rank that died or froze is named on every rank
    within the tier's ``dead_after`` instead of holding them in the collective."""
    comm = tier.comm
    if not comm.distributed:
        return [obj]
    comm.arrive(stage, tier.timeout, tier.dead_after)
    return comm.all_gather(obj)


def _joined(base: str, name: str) -> str:
    return f"{base}/{name}"


def _part(base: str, name: str, token: str) -> str:
    head, _, tail = name.rpartition("/")
    return f"{base}/{head}/.{tail}.part-{token}" if head else f"{base}/.{tail}.part-{token}"


def _checked_report(report: Any, sender: str) -> dict[str, Any]:
    """A place leader's inventory report, every step and file name in it checked before any
    becomes a path here; the same reports reach every rank, so every rank raises alike."""
    try:
        steps = report["steps"]
        if not isinstance(steps, dict):
            raise TypeError(f"steps is a {type(steps).__name__}")
        for name, entry in steps.items():
            if not isinstance(name, str) or parse_step(name) is None:
                raise CorruptCheckpointError(
                    f"{sender} reported the local step {str(name)[:100]!r}, which is not a step name"
                )
            if not isinstance(entry["digest"], str):
                raise TypeError("a digest is not a string")
            for what in ("files", "held"):
                for f, size in entry[what].items():
                    check_offered(f, sender)
                    check_offered_size(size, f, sender)
    except CheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(
            f"the local-tier inventory report of {sender} is not readable ({e}); "
            "does that rank run a different shardsafe version?"
        ) from e
    return cast(dict[str, Any], report)


def _held(directory: StepDirectory, name: str) -> dict[str, Any]:
    """What this place holds of committed step ``name``: manifest digest, its files, ours."""
    storage = directory.storage
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST_NAME}")
        manifest = Manifest.loads(raw, storage.describe(f"{name}/{MANIFEST_NAME}"))
    except Exception as e:
        # other places may hold a good copy: this one counts as holding none of the step
        log.warning(
            "local tier: %s is unreadable, this copy of the step is not used: %s",
            directory.path(name),
            e,
        )
        return {"digest": "", "files": {}, "held": {}, "unreadable": True}
    held: dict[str, int] = {MANIFEST_NAME: len(raw)}
    for f in manifest.files:
        try:
            held[f] = storage.size(f"{name}/{f}")
        except (FileNotFoundError, OSError):
            continue
    return {
        "digest": digest(raw),
        "files": {f: e.nbytes for f, e in manifest.files.items()},
        "held": held,
    }


def _read_manifest(storage: Any, base: str, expected: str) -> Manifest:
    raw = storage.read_bytes(f"{base}/{MANIFEST_NAME}")
    if digest(raw) != expected:
        raise CorruptCheckpointError(
            f"{storage.describe(f'{base}/{MANIFEST_NAME}')} differs from the other hosts' copies"
        )
    return Manifest.loads(raw, storage.describe(f"{base}/{MANIFEST_NAME}"))


def _extents_by_file(manifest: Manifest) -> dict[str, list[Extent]]:
    out: dict[str, list[Extent]] = {}
    for entry in manifest.tensors.values():
        for piece in entry.pieces:
            out.setdefault(piece.extent.file, []).append(piece.extent)
    for extent in manifest.blobs.values():
        out.setdefault(extent.file, []).append(extent)
    return out


__all__ = ["inventory", "restore"]
