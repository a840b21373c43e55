"""``save`` and ``async_save``, and the :class:`Saver` that keeps their reusable state.

A Saver holds what repeated saves reuse: the cached global plan, the host staging arenas,
the direct-I/O policy and bounce buffers, and the one background writer thread; ``close``
frees them. It runs the steps of a save, each in its module: plan (:mod:`.save_plan`, with
:mod:`.save_target`), stage (:mod:`.staging`), write (:mod:`.save_write`), commit
(:mod:`.commit`). ``shardsafe.save``/``async_save`` use one Saver per process group
(``default_saver``); make your own to control its lifetime. Savers may share one staging
pool (``Saver(staging=)``, as a CheckpointManager's two tiers do): a save holds it from its
first staged byte until its last one is written, and another waits for that.

What ``async_save`` blocks on: planning (one vote through the store when the plan is cached),
and the copy of this rank's share into host memory; with a cached plan the copy runs while
the vote does (:mod:`.save_plan`; dropped and made again in the rare save whose vote agrees
on another plan). Writing, checksums, fsync and the commit
run in the background; the commit is signalled through the process group's store, so the
training loop never has to call anything.

Both kinds of save commit through the same protocol (:meth:`Saver._commit`, with the store
channel of :mod:`shardsafe.signals`): every rank posts its write record and heartbeats until
the coordinator posts the outcome; a dead rank is named on every rank within ``dead_after``
seconds, a slow one is waited for.

Two seams make the one pipeline serve both tiers. The *target*
(:class:`shardsafe.commit.SaveTarget`) says where and how a save is published: the
persistent tier's shared location by default, or node-local places whose leaders publish
(the local tier). The *after-write* step (:class:`AfterWrite`) runs on every rank once it
wrote its share (the local tier sends copies to peers there) and adds to the record the
coordinator checks before the target decides.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .checksum import DEFAULT_BLOCK_BYTES
from .codec import tensor_bytes
from .commit import SaveTarget, SharedTarget
from .directio import DirectIO
from .dist import Comm, error_record, get_comm, outcome, raise_for
from .errors import ValidationError, call_each
from .format import Manifest
from .lease import LEASE_SECONDS
from .location import locate
from .planning import RankAssignment
from .save_plan import PlanCache, PlannedSave, plan_save
from .save_plan import prepare as split_pieces
from .save_write import (
    ShareItems,
    StreamedTensor,
    encode_share,
    merge_results,
    waves,
    write_share,
)
from .sharding import ShardedTensor, SplitStateDict
from .signals import DEAD_AFTER, StoreChannel, StoreClients, connect
from .staging import StagingHold, StagingPool, staged_bytes, wait_for_copies

log = logging.getLogger("shardsafe")

ProgressFn = Callable[[str, int, int], None]
"""``progress(stage, done_bytes, total_bytes)`` with stage ``"staged"``, ``"written"`` or ``"committed"``."""


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
    token: str = ""  # the save's id, the same on every rank
    manifest: Manifest | None = None  # where the outcome carries it (a local-tier save's)
    seconds_draining: float = 0.0  # a local step's copy into the persistent tier
    staged_while_planning: bool = False  # the staging copy ran during the planning vote


class AsyncSaveHandle:
    """The outcome of an ``async_save``: ``result(timeout)``, ``done()``, ``add_done_callback(fn)``."""

    def __init__(self, future: Future[SaveStats], path: str, seconds_blocked: float) -> None:
        self._future = future
        self.path = path
        self.seconds_blocked = seconds_blocked
        self.observed = False  # set once the caller has seen the outcome

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveStats:
        """Wait for the commit; raise the save's :class:`CheckpointError` (the same on every rank)."""
        try:
            stats = self._future.result(timeout)
            self.observed = True
            return stats
        except FutureTimeout:
            raise TimeoutError(
                f"async save into {self.path} still running after {timeout} s"
            ) from None
        except BaseException:
            self.observed = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = self._future.exception(timeout)
        self.observed = True
        return exc

    def add_done_callback(self, fn: Callable[[AsyncSaveHandle], Any]) -> None:
        """Call ``fn(handle)`` when done; an exception it raises is logged, never lost."""

        def call(_: Any) -> None:
            try:
                fn(self)
            except Exception:
                log.exception("a done-callback of the async save into %s raised", self.path)

        self._future.add_done_callback(call)


@dataclass(frozen=True)
class AfterWrite:
    """What a save does after each rank wrote its share, before the commit.

    ``run(planned, result)`` runs on every rank, even after its own write failed (peers may
    wait for it), and returns fields to add to its write record and an error record or None.
    ``check(records)`` runs on the coordinator over every rank's record when none failed, and
    raises what fails the save."""

    run: Callable[
        [PlannedSave, dict[str, Any] | None], tuple[dict[str, Any], dict[str, Any] | None]
    ]
    check: Callable[[list[dict[str, Any]]], None]


def settle(handle: AsyncSaveHandle | None, what: str) -> None:
    """Wait for ``handle``; a failure nobody has seen through it is logged, and stays on it."""
    if handle is None:
        return
    exc = handle._future.exception()
    if exc is not None and not handle.observed:
        log.error("%s into %s failed: %s", what, handle.path, exc)


class Saver:
    """Saves from one process group, reusing the plan, staging memory and writer thread."""

    def __init__(
        self,
        process_group: Any = None,
        *,
        files_per_rank: int = 2,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        timeout: float = 1800.0,
        cache_plan: bool = True,
        max_staging_bytes: int | None = None,
        dead_after: float = DEAD_AFTER,
        lease_ttl: float = LEASE_SECONDS,
        verify_after_write: bool = False,
        direct_io: str | None = None,
        target: SaveTarget | None = None,
        after_write: AfterWrite | None = None,
        staging: StagingPool | None = None,
    ) -> None:
        # where and how a save is published (the persistent tier's shared location by default)
        self.target: SaveTarget = target if target is not None else SharedTarget()
        # what runs after each rank wrote its share (the local tier's copies to peers)
        self.after_write = after_write
        # a process group, or a Comm (``Comm()``: this process alone, even in a distributed job)
        self.process_group = process_group
        # when data files bypass the page cache: "auto", "always" or "never"; None reads
        # SHARDSAFE_DIRECT_IO now. Holds the bounce buffers of direct writes until close().
        self.direct_io = DirectIO(direct_io)
        # read every data file back from the device once durable; rewrite once on a mismatch
        self.verify_after_write = verify_after_write
        self.files_per_rank = files_per_rank
        self.block_bytes = block_bytes
        self.timeout = timeout  # for every rank to reach planning
        # a rank silent this long while writing or committing is dead (named on every rank);
        # a slow rank that heartbeats is waited for
        self.dead_after = dead_after
        # a save's lease on its name expires this long after its coordinator stopped renewing it
        self.lease_ttl = lease_ttl
        # host memory an async save may stage at once; beyond it, waves are staged and written
        # before async_save returns (the last one is written in the background)
        self.max_staging_bytes = max_staging_bytes
        self.plan_cache = PlanCache() if cache_plan else None
        # host staging memory; a pool given here may be shared with other Savers (saves take
        # turns through StagingPool.hold) and is freed by whoever made it, not by close()
        self.staging = staging if staging is not None else StagingPool()
        self._owns_staging = staging is None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardsafe-save")
        self._inflight: AsyncSaveHandle | None = None
        self._lock = threading.Lock()
        self._clients: StoreClients | None = None  # connections of the commit protocol

    def comm(self) -> Comm:
        """The ranks that save together."""
        pg = self.process_group
        if isinstance(pg, Comm):
            return pg
        comm = get_comm(pg)
        comm.dead_after = self.dead_after  # its collectives name a lost rank this fast too
        return comm

    # -- ahead of the first save -------------------------------------------------------------
    def connect(self) -> None:
        """Open the commit protocol's store connections now rather than at the first save.
        Opening a TCP store connection holds the interpreter, and took 5 s at times here
        (torch's client looks up the name of the store's address on every connection, and
        the resolver dropped some lookups: :func:`shardsafe.liveness.open_connection` warns
        of it): in the middle of training that stalls the step and the heartbeat
        (:data:`shardsafe.liveness.STALL_GRACE`). A :class:`CheckpointManager` calls it."""
        if self._clients is None and self.comm().distributed:
            self._clients = connect()

    def prepare(
        self, sharded_state_dict: Any = None, *, nbytes: int | None = None, wait: bool = False
    ) -> int:
        """Page-lock ahead, in a background thread, the host memory that async saves of
        ``sharded_state_dict`` will stage its device tensors into; returns the bytes being
        locked (0 when it holds no device tensor). Not collective, no I/O.

        Locking runs at a few GB/s; done here, off the training's critical path, the first
        ``async_save`` blocks only for its copies (a save that comes before the locking has
        finished waits for the chunks its copies reach). The size is this rank's share when
        a plan of this structure is cached (after a first save), otherwise every device
        tensor this rank holds: more than its share only where tensors are replicated across
        ranks. Give ``nbytes`` instead to lock a size of your choice (e.g.
        ``max_staging_bytes``). Pass the full state (an optimizer's state exists after its
        first step): a later save that needs more replaces the arena, locking again.
        ``wait=True`` returns once locked, raising :class:`StagingError` if locking failed.
        Without a GPU, nothing is locked. With a pool shared with another Saver whose save
        is still writing from it, the bigger arena is made once that write is done.
        """
        if nbytes is None:
            if sharded_state_dict is None:
                raise ValidationError("Saver.prepare() needs the state dict to save, or nbytes")
            nbytes = self._pinned_need(sharded_state_dict)
        if not self.staging.pins:
            return 0
        self.staging.prepare(nbytes)  # deferred while a save sharing the pool still writes
        if wait:
            self.staging.wait_prepared(self.timeout)
        return nbytes

    def _pinned_need(self, sharded_state_dict: Any) -> int:
        """Pinned arena bytes a save of this state stages at once (its largest wave)."""
        comm = self.comm()
        split, local = split_pieces(sharded_state_dict, comm.rank)
        pieces: Sequence[int] = range(len(split.tensors))
        entry = self.plan_cache.entry if self.plan_cache is not None else None
        if entry is not None and entry.structure == (
            f"{comm.world_size}/{comm.rank}/{local.structure_hash()}"
        ):
            pieces = entry.assignment.pieces
        size = {i: local.pieces[i].nbytes for i in pieces}
        pinned = {
            i for i in pieces if _data(split.tensors[i][1]).device.type in self.staging.pin_devices
        }
        groups = waves(list(size.items()), self.max_staging_bytes)
        return max(staged_bytes([size[i] for i in g if i in pinned]) for g in groups)

    # -- blocking save -----------------------------------------------------------------------
    def save(
        self,
        sharded_state_dict: Any,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        content_metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> SaveStats:
        """Save and return when committed. CPU tensors are written straight from their memory;
        device tensors stream through the bounded staging pool (``max_staging_bytes``), in
        waves, like an async save that is waited for."""
        comm, planned, t0, t_plan = self._plan(
            sharded_state_dict, path, overwrite, content_metadata
        )
        if not all(_on_host(planned.split.tensors[i][1]) for i in planned.assignment.pieces):
            handle = self._stage_and_submit(
                comm, planned, t0, t_plan, overwrite, content_metadata, progress
            )
            stats = handle.result()
            stats.seconds_blocked = stats.seconds
            return stats

        def share() -> ShareItems:
            s = encode_share(planned, comm.rank, comm.is_coordinator, copy_blobs=False)
            s.items[:0] = [
                (("p", i), _host_item(planned.split.tensors[i][1]))
                for i in planned.assignment.pieces
            ]
            return s

        channel = self._channel(comm, planned)
        t1 = time.perf_counter()
        result, err = outcome(
            lambda: write_share(
                planned,
                comm.rank,
                share(),
                self.files_per_rank,
                self.block_bytes,
                _counter(progress, "written"),
                verify_after_write=self.verify_after_write,
                direct_io=self.direct_io,
            )
        )
        t_write = time.perf_counter() - t1
        record = self._record(planned, result, err)
        status = self._commit(comm, channel, planned, record, overwrite, content_metadata)
        raise_for(status.get("errors") or [], self.target.what)
        stats = _stats(planned, result, status, t0, t_plan, t_write)
        stats.seconds_blocked = stats.seconds
        _log_done(comm, stats, progress)
        return stats

    # -- asynchronous save -------------------------------------------------------------------
    def async_save(
        self,
        sharded_state_dict: Any,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        content_metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> AsyncSaveHandle:
        """Plan and stage, then return; writing and the commit continue in the background.

        A save still in flight is waited for first (its staging buffers are reused).
        """
        guesses: list[_StagedAhead] = []
        try:
            comm, planned, t0, t_plan = self._plan(
                sharded_state_dict, path, overwrite, content_metadata, self._stager(path, guesses)
            )
        except BaseException:
            for guess in guesses:
                guess.release()
            raise
        ahead = None
        for guess in guesses:
            if planned.cached and guess.assignment is planned.assignment:
                ahead = guess
            else:  # the vote agreed on another plan: this rank's share is staged anew
                guess.release()
        return self._stage_and_submit(
            comm, planned, t0, t_plan, overwrite, content_metadata, progress, ahead
        )

    def _stager(
        self, path: str | os.PathLike[str], out: list[_StagedAhead]
    ) -> Callable[[SplitStateDict, RankAssignment], None]:
        """``while_voting`` for :func:`plan_save`: stage the share the cached plan gives this
        rank while the vote runs (a share that fits the byte budget in one wave; waves are
        staged after planning). Errors are kept for the save to report, as staging's are."""

        def stage_ahead(split: SplitStateDict, assignment: RankAssignment) -> None:
            pieces = list(assignment.pieces)
            sizes = [(i, _nbytes(split.tensors[i][1])) for i in pieces]
            if not pieces or len(waves(sizes, self.max_staging_bytes)) > 1:
                return
            guess = _StagedAhead(assignment)
            out.append(guess)
            try:
                what = f"the {self.target.what} into {locate(path).url}"
                guess.hold = self.staging.hold(what, self.timeout)
                guess.items = self._stage_pieces(split, pieces, guess.hold)
            except Exception as e:
                guess.error = e

        return stage_ahead

    def _stage_pieces(
        self, split: SplitStateDict, pieces: list[int], hold: StagingHold | None
    ) -> list[tuple[Any, Any]]:
        staged = self.staging.stage([_to_stage(split.tensors[i][1]) for i in pieces], hold)
        return [(("p", i), item) for i, item in zip(pieces, staged, strict=True)]

    def _stage_and_submit(
        self,
        comm: Comm,
        planned: PlannedSave,
        t0: float,
        t_plan: float,
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
        progress: ProgressFn | None,
        ahead: _StagedAhead | None = None,
    ) -> AsyncSaveHandle:
        """Stage this rank's share (in waves under the byte budget), then write and commit in
        the background. ``ahead``: the share staged during the planning vote, for this plan."""
        sizes = [(i, planned.local_plan.pieces[i].nbytes) for i in planned.assignment.pieces]
        groups = waves(sizes, self.max_staging_bytes)
        early: list[dict[str, Any]] = []  # records of the waves written before returning
        # the pool, from the first staged byte until the last is written (it may be shared
        # with another Saver, whose save must not stage over bytes this one still writes)
        hold: StagingHold | None = ahead.hold if ahead is not None else None

        def stage(pieces: list[int]) -> list[tuple[Any, Any]]:
            return self._stage_pieces(planned.split, pieces, hold)

        def stage_all() -> ShareItems:
            nonlocal hold
            if ahead is not None:
                if ahead.error is not None:
                    raise ahead.error
                s = encode_share(planned, comm.rank, comm.is_coordinator, copy_blobs=True)
                s.items[:0] = ahead.items
                return s
            if sizes:
                hold = self.staging.hold(
                    f"the {self.target.what} into {planned.loc.url}", self.timeout
                )
            # with a byte budget, every wave but the last is staged and written before returning
            for group in groups[:-1]:
                part = ShareItems(stage(group), {}, None)
                first = sum(len(r["files"]) for r in early)
                early.append(
                    write_share(
                        planned,
                        comm.rank,
                        part,
                        self.files_per_rank,
                        self.block_bytes,
                        first_file=first,
                        verify_after_write=self.verify_after_write,
                        direct_io=self.direct_io,
                    )
                )
            s = encode_share(planned, comm.rank, comm.is_coordinator, copy_blobs=True)
            s.items[:0] = stage(groups[-1])
            return s

        staged_bytes = sum(planned.local_plan.pieces[i].nbytes for i in planned.assignment.pieces)

        def stage_and_report() -> ShareItems:
            staged = stage_all()
            if progress is not None:  # inside the error gathering, like every user callback
                progress("staged", staged_bytes, staged_bytes)
            return staged

        def let_go() -> None:
            if hold is not None:
                hold.release()

        try:
            channel = self._channel(comm, planned)
            share, err = outcome(stage_and_report)
        except BaseException:  # an interrupt: nothing will write what was staged
            let_go()
            raise
        if err is not None:
            let_go()
        blocked = time.perf_counter() - t0
        log.debug(
            "rank %d staged %d bytes for %s in %.3f s",
            comm.rank,
            staged_bytes,
            planned.loc.url,
            blocked,
        )

        def background() -> SaveStats:
            t1 = time.perf_counter()
            try:
                result, werr = (
                    (None, err)
                    if err is not None
                    else outcome(
                        lambda: merge_results(
                            [
                                *early,
                                write_share(
                                    planned,
                                    comm.rank,
                                    cast(ShareItems, share),
                                    self.files_per_rank,
                                    self.block_bytes,
                                    _counter(progress, "written"),
                                    first_file=sum(len(r["files"]) for r in early),
                                    verify_after_write=self.verify_after_write,
                                    direct_io=self.direct_io,
                                ),
                            ]
                        )
                    )
                )
            finally:
                let_go()  # written (and verified, which reads the staged bytes): nothing needs them
            t_write = time.perf_counter() - t1
            record = self._record(planned, result, werr)
            status = self._commit(comm, channel, planned, record, overwrite, content_metadata)
            raise_for(status.get("errors") or [], f"async {self.target.what}")
            stats = _stats(planned, result, status, t0, t_plan, t_write)
            stats.seconds_blocked = blocked
            stats.staged_while_planning = ahead is not None
            _log_done(comm, stats, progress)
            return stats

        try:
            with self._lock:
                handle = AsyncSaveHandle(self._writer.submit(background), planned.loc.url, blocked)
                self._inflight = handle
        except BaseException:
            let_go()
            raise
        return handle

    def _plan(
        self,
        sharded_state_dict: Any,
        path: str | os.PathLike[str],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
        while_voting: Callable[[SplitStateDict, RankAssignment], None] | None = None,
    ) -> tuple[Comm, PlannedSave, float, float]:
        """Wait for the save in flight, then plan this one: (comm, plan, start time, planning s)."""
        self._settle_previous()
        comm = self.comm()
        t0 = time.perf_counter()
        planned = plan_save(
            comm,
            sharded_state_dict,
            locate(path),
            overwrite,
            self.plan_cache,
            content_metadata,
            self.timeout,
            self.lease_ttl,
            self.dead_after,
            self.target.leads_place,
            while_voting,
        )
        self.target.begin_places(comm, planned, overwrite)
        return comm, planned, t0, time.perf_counter() - t0

    def _record(
        self, planned: PlannedSave, result: dict[str, Any] | None, err: dict[str, Any] | None
    ) -> dict[str, Any]:
        """This rank's write record, with what the after-write step adds."""
        record: dict[str, Any] = {"result": result, "error": err}
        if self.after_write is not None:
            extra, aerr = self.after_write.run(planned, result)
            record.update(extra)
            record["error"] = err or aerr
        return record

    def _decide(
        self,
        planned: PlannedSave,
        records: list[dict[str, Any]],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """Coordinator: the after-write check, then the target's decision."""
        if self.after_write is not None and not any(r.get("error") for r in records):
            _, err = outcome(lambda: cast(AfterWrite, self.after_write).check(records))
            if err is not None:
                records = [{**r, "error": err} for r in records]
        return self.target.decide(planned, records, overwrite, content_metadata, self.block_bytes)

    def _commit(
        self,
        comm: Comm,
        channel: StoreChannel | None,
        planned: PlannedSave,
        record: dict[str, Any],
        overwrite: bool,
        content_metadata: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """The one commit of blocking and async saves: post this rank's record; the coordinator
        collects every record (naming ranks that stop heartbeating) and decides, through the
        target, the outcome that every rank gets; then each rank's target publishes."""
        if channel is None:
            status = self._decide(planned, [record], overwrite, content_metadata)
            return self.target.publish(comm, planned, status, overwrite)
        decided = False
        try:
            channel.post(record)
            if comm.is_coordinator:
                records = channel.collect()
                decided = True
                status = self._decide(planned, records, overwrite, content_metadata)
                channel.publish(status)
            else:
                status = channel.await_status()
        except BaseException:
            self.target.abort(comm, planned, decided)
            raise
        finally:
            channel.cleanup()
        return self.target.publish(comm, planned, status, overwrite)

    def _channel(self, comm: Comm, planned: PlannedSave) -> StoreChannel | None:
        """Start heartbeating for this save (right after planning, before any slow step)."""
        try:
            return self._open_channel(comm, planned.token)
        except BaseException:
            self.target.abort(comm, planned, False)
            raise

    def _open_channel(self, comm: Comm, token: str) -> StoreChannel | None:
        if not comm.distributed:
            return None
        if self._clients is None:
            self._clients = connect()
        return StoreChannel(
            comm,
            token,
            self._clients,
            dead_after=self.dead_after,
            log_every=3 * self.dead_after,
            start_within=min(self.timeout, max(60.0, 6 * self.dead_after)),
        )

    def round(
        self,
        token: str,
        record: dict[str, Any] | None,
        decide: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> dict[str, Any]:
        """One exchange through the store, as a commit's (no collective: it may run in the
        background while the training runs its own): every rank posts ``record`` (unless
        None), the coordinator runs ``decide`` on all of them (a dead rank's is an error
        record) and every rank returns the status it published."""
        comm = self.comm()
        channel = self._open_channel(comm, token)
        if channel is None:
            return decide([record] if record is not None else [])
        try:
            if record is not None:
                channel.post(record)
            if not comm.is_coordinator:
                return channel.await_status()
            try:
                records = channel.collect() if record is not None else []
            except Exception as e:  # a dead rank: everyone learns it from the status
                records = [{"error": error_record(e)}] * comm.world_size
            status = decide(records)
            channel.publish(status)
            return status
        finally:
            channel.cleanup()

    def then(self, handle: AsyncSaveHandle, fn: Callable[[], SaveStats]) -> AsyncSaveHandle:
        """Run ``fn`` in the writer thread right after the save of ``handle`` (before any later
        save's background work); the returned handle, now the one in flight, completes with
        it. ``fn`` typically starts with ``handle.result()``."""
        with self._lock:
            chained = AsyncSaveHandle(self._writer.submit(fn), handle.path, handle.seconds_blocked)
            self._inflight = chained
        return chained

    def _settle_previous(self) -> None:
        """Wait for the save in flight; its failure stays on its handle (and in the log)."""
        self.settle("the previous async save")

    def settle(self, what: str = "the async save") -> None:
        """Wait for the save in flight; its failure stays on its handle (and in the log)."""
        with self._lock:
            handle, self._inflight = self._inflight, None
        settle(handle, what)

    def wait(self, timeout: float | None = None) -> SaveStats | None:
        """Wait for the save in flight, if any; returns its stats, raising an error nobody has seen yet."""
        with self._lock:
            handle = self._inflight
        if handle is None:
            return None
        try:
            exc = handle._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"async save into {handle.path} still running after {timeout} s"
            ) from None
        with self._lock:
            if self._inflight is handle:
                self._inflight = None
        if exc is not None:
            if handle.observed:
                return None
            return handle.result()
        return handle.result()

    def close(self) -> None:
        """Wait for the save in flight, stop the writer thread and free the staging memory
        (unless it was given to the Saver, which may share it)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._owns_staging:
                self.staging.release()
            self.direct_io.close()
            self._clients = None


@dataclass
class _StagedAhead:
    """This rank's share staged during the planning vote for the cached plan's ``assignment``:
    used when the vote agrees on that plan, released otherwise."""

    assignment: RankAssignment
    hold: StagingHold | None = None
    items: list[tuple[Any, Any]] = field(default_factory=list)
    error: Exception | None = None

    def release(self) -> None:
        """Let the pool go once no copy into it is in flight: a device copy queued for a guess
        the vote did not confirm still lands in the pinned arena, which the next stage may
        replace (unlock and unmap) when it needs a bigger one."""
        try:
            wait_for_copies([item for _, item in self.items])
        finally:
            if self.hold is not None:
                self.hold.release()


def _nbytes(st: ShardedTensor) -> int:
    return st.numel * st.dtype.itemsize


def _data(st: ShardedTensor) -> torch.Tensor:
    assert st.data is not None  # checked while planning
    return st.data


def _to_stage(st: ShardedTensor) -> torch.Tensor:
    if isinstance(st, StreamedTensor):
        raise ValidationError(
            f"{st.key!r}: a streamed tensor is read when written; only Saver.save writes one"
        )
    return _data(st)


def _on_host(st: ShardedTensor) -> bool:
    """Written straight from where it is: CPU memory, or read from its source when written."""
    return isinstance(st, StreamedTensor) or _data(st).device.type == "cpu"


def _host_item(st: ShardedTensor) -> Any:
    return st.item() if isinstance(st, StreamedTensor) else tensor_bytes(_data(st))


def _counter(progress: ProgressFn | None, stage: str) -> Callable[[int], None] | None:
    if progress is None:
        return None
    done = [0]

    def on_bytes(n: int) -> None:
        done[0] += n
        progress(stage, done[0], -1)

    return on_bytes


def _stats(
    planned: PlannedSave,
    result: dict[str, Any] | None,
    status: dict[str, Any],
    t0: float,
    t_plan: float,
    t_write: float,
) -> SaveStats:
    stats = SaveStats(
        planned.loc.url,
        plan_cached=planned.cached,
        seconds_planning=t_plan,
        seconds_writing=t_write,
    )
    if result:
        stats.bytes_written = sum(result["files"].values())
        stats.files = sorted(result["files"])
    stats.total_bytes = int(status.get("total_bytes", 0))
    stats.token = planned.token
    if status.get("manifest") is not None:
        stats.manifest = Manifest.from_json(status["manifest"])
    stats.seconds = time.perf_counter() - t0
    return stats


def _log_done(comm: Comm, stats: SaveStats, progress: ProgressFn | None) -> None:
    if progress is not None:
        progress("committed", stats.total_bytes, stats.total_bytes)
    if comm.is_coordinator:
        log.info(
            "committed %s: %d bytes in %.3f s (%.2f GB/s), blocked %.3f s, plan %s",
            stats.path,
            stats.total_bytes,
            stats.seconds,
            stats.total_bytes / max(stats.seconds, 1e-9) / 1e9,
            stats.seconds_blocked,
            "cached" if stats.plan_cached else f"computed in {stats.seconds_planning:.3f} s",
        )


_DEFAULT: dict[Any, Saver] = {}
_DEFAULT_LOCK = threading.Lock()


def default_saver(process_group: Any = None) -> Saver:
    """The Saver that ``shardsafe.save``/``async_save`` use for ``process_group`` in this process."""
    key = process_group if process_group is not None else "default"
    with _DEFAULT_LOCK:
        saver = _DEFAULT.get(key)
        if saver is None:
            saver = _DEFAULT[key] = Saver(process_group)
        return saver


def save(
    sharded_state_dict: Any,
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> SaveStats:
    """Save a sharded state dict from every rank of ``process_group`` into the directory ``path``.

    All ranks must call it. Returns when the checkpoint is committed, or raises the same
    :class:`CheckpointError` on every rank; nothing appears at ``path`` unless it committed.
    A Stateful object in the state dict (``state_dict()`` + ``load_state_dict()``, as in
    PyTorch DCP) is saved as what its ``state_dict()`` returns when ``save`` is called.
    """
    return default_saver(process_group).save(
        sharded_state_dict,
        path,
        overwrite=overwrite,
        content_metadata=content_metadata,
        progress=progress,
    )


def async_save(
    sharded_state_dict: Any,
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    content_metadata: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> AsyncSaveHandle:
    """Like :func:`save`, but return once the state is copied to host memory."""
    return default_saver(process_group).async_save(
        sharded_state_dict,
        path,
        overwrite=overwrite,
        content_metadata=content_metadata,
        progress=progress,
    )


def release() -> None:
    """Wait for the default Savers' saves in flight, then free their pinned staging memory,
    writer threads and store connections (the next ``save`` makes fresh ones)."""
    with _DEFAULT_LOCK:
        savers = list(_DEFAULT.values())
        _DEFAULT.clear()
    call_each(s.close for s in savers)


def wait_for_saves() -> None:
    """Wait for every default Saver's save in flight (call before exiting)."""
    with _DEFAULT_LOCK:
        savers = list(_DEFAULT.values())
    call_each(s.wait for s in savers)
