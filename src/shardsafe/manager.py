"""Rolling checkpoints of a training run in one directory: numbered steps, a ``latest``
pointer, retention, and the clean-up of saves that never committed.

Layout::

    root/
      step_000000100/                       committed (manifest.json inside)
      step_000000200/
      latest                                "step_000000200\\n", replaced atomically after a commit
      .step_000000300.shardsafe-tmp-<token>/  a save in flight, or the remains of a crashed one
      .step_000000300.shardsafe-lock          the lease of the save of step 300 (owner, host, expiry)

Every rank calls :meth:`CheckpointManager.save` and :meth:`CheckpointManager.restore`. Only
the coordinator (rank 0 of the process group) moves the pointer, deletes old checkpoints and
removes leftovers. With async saves it does so from the save's completion callback: that
needs no collective, so a background commit never waits for the training loop and never
races its collectives.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import torch

from . import local_restore
from .delivery import Deliveries
from .directory import CheckpointDirectory, StepDirectory, parse_step, step_name
from .dist import get_comm, outcome, raise_for
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    call_each,
    is_damaged_checkpoint,
)
from .lease import LEASE_SECONDS
from .loading import StrictHandling, load
from .local_tier import Drain, LocalTier
from .location import locate
from .retention import Retention, retain
from .saver import AsyncSaveHandle, Saver, SaveStats
from .sharding import (
    CoordinatorObject,
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_stateful,
)
from .signals import DEAD_AFTER
from .staging import StagingPool

log = logging.getLogger("shardsafe")

_REREADS = 3
"""How many times a restore reads a checkpoint again that was replaced while it was read."""


class _Vanished(Exception):
    """The checkpoint a restore was reading was deleted meanwhile (no damage)."""


ProgressFn = Callable[[str, int, int], None]


class CheckpointManager:
    """Numbered checkpoints of one run under ``root``, with retention and crash clean-up.

    ``keep_last``: keep the newest N committed steps (None keeps all). ``keep_every``: also
    keep every step divisible by K (milestones). The step the ``latest`` pointer names is
    never deleted, and nothing is deleted before the new checkpoint has committed.
    With ``async_save`` (the default) :meth:`save` returns once the state is staged in host
    memory; the returned handle completes after the commit *and* the coordinator's pointer
    update and retention.
    ``run_id``: with a ``local_root``, names this run (else ``root`` does); local steps of
    another run sharing the local root are never restored or deleted.
    ``max_staging_bytes``: the host memory a save stages at once (see :class:`Saver`), for
    both tiers; the two tiers share one staging pool (:attr:`staging`), so their saves
    together never stage more than one of them would.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        process_group: Any = None,
        timeout: float = 1800.0,
        dead_after: float = DEAD_AFTER,
        lease_ttl: float = LEASE_SECONDS,
        verify_after_write: bool = False,
        local_root: str | os.PathLike[str] | None = None,
        local_every: int = 1,
        persistent_every: int = 1,
        replicas: int = 1,
        node_id: str | None = None,
        local_keep_last: int = 2,
        drain: bool = False,
        direct_io: str | None = None,
        run_id: str | None = None,
        read_only: bool = False,
        max_staging_bytes: int | None = None,
    ) -> None:
        for what, value in (
            ("keep_last", keep_last),
            ("keep_every", keep_every),
            ("local_every", local_every),
            ("persistent_every", persistent_every),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{what} must be a positive int or None, got {value!r}")
        if read_only and local_root is not None:
            raise ValueError("read_only opens the persistent root only: leave local_root out")
        self.read_only = read_only
        """Opened to read only (an evaluation poller, a monitor): nothing is cleaned, marked or saved."""
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.process_group = process_group
        self._dir = self._make_directory(root)
        self.root = self._dir.url
        self.timeout = timeout  # how long a rank waits for the others before naming the absent ones
        self.staging = StagingPool()
        """The host staging memory of both tiers' saves (they take turns: a save waits until
        the other tier's staged bytes are written); ``staging.peak_bytes`` is the most it held."""
        self._saver = Saver(
            process_group,
            timeout=timeout,
            dead_after=dead_after,
            lease_ttl=lease_ttl,
            verify_after_write=verify_after_write,
            direct_io=direct_io,
            max_staging_bytes=max_staging_bytes,
            staging=self.staging,
        )
        self._lock = threading.Lock()  # guards _active and _pending
        self._maintenance = threading.Lock()  # one pointer update / deletion pass at a time
        self._active: set[str] = set()
        self._pending: tuple[AsyncSaveHandle, Future[SaveStats]] | None = None
        self._closed = False
        self._restored: str | None = None
        # a first save before any restore checks that the run is not starting over on top
        # of its own newer steps (:meth:`_refuse_to_start_over`)
        self._start_checked = False
        self.restored_tier: str | None = None
        """``"local"`` or ``"persistent"``: where the last :meth:`restore` read from."""
        self.local_every = local_every
        self.persistent_every = persistent_every
        # a step due in both tiers is saved locally, then copied to root in the background
        self.drain = drain
        self.direct_io = direct_io  # for saves (both tiers) and restores
        if get_comm(process_group).is_coordinator and not read_only:
            self._dir.storage.make_dir("")
            self.cleanup()
        self._local: LocalTier | None = None
        if local_root is not None:
            self._local = LocalTier(
                local_root,
                persistent_root=self.root,
                run_id=run_id,
                process_group=process_group,
                node_id=node_id,
                replicas=replicas,
                keep_last=local_keep_last,
                timeout=timeout,
                dead_after=dead_after,
                lease_ttl=lease_ttl,
                verify_after_write=verify_after_write,
                direct_io=direct_io,
                max_staging_bytes=max_staging_bytes,
                staging=self.staging,
            )
        if not read_only:  # at start-up, not at the first save of each tier mid-training
            self._saver.connect()
            if self._local is not None:
                self._local.saver.connect()

    def _make_directory(self, root: str | os.PathLike[str]) -> CheckpointDirectory:
        return StepDirectory(root)

    # -- queries ----------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> str:
        """Where step ``step`` is (or would be) stored."""
        return self._dir.path(step_name(step))

    def steps(self) -> list[int]:
        """Committed persistent steps, ascending (as this process sees the directory now)."""
        return [s for s in (parse_step(n) for n in self._dir.committed()) if s is not None]

    def latest_step(self) -> int | None:
        """The step ``latest`` names if it is committed, else the newest committed step, else None.

        Read from storage by this process: right after an async save completes, a rank other
        than the coordinator may still see the previous pointer for a moment. ``restore()``
        without a step takes the coordinator's answer on every rank. The persistent tier
        only: with a ``local_root``, decide whether to resume by calling :meth:`restore`,
        which raises :class:`CheckpointNotFoundError` on every rank when neither tier holds
        a step.
        """
        name = self._dir.latest()
        return parse_step(name) if name is not None else None

    # -- saving -----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        content_metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> AsyncSaveHandle | SaveStats | None:
        """Collective: save the sharded state dict ``state`` as step ``step``.

        Waits first for this manager's previous save (its failure stays on its handle). An
        existing checkpoint of the same step is replaced, intact until the new one commits.
        The first save of a manager that restored nothing raises :class:`CheckpointError` when
        the run already holds a newer step (see :meth:`_refuse_to_start_over`).
        Returns an :class:`AsyncSaveHandle` with ``async_save``, else the :class:`SaveStats`.
        A failure to update the pointer after a successful commit is raised (or set on the
        handle) on the coordinator only, since only it writes the pointer.

        With a ``local_root``, a step divisible by ``local_every`` is also saved to the local
        tier (always asynchronously; copies go to peers on other hosts in the background),
        and only a step divisible by ``persistent_every`` goes to ``root``. Returns the
        persistent save's result when there is one, else the local save's handle, else None
        (nothing due at this step).
        """
        local = None
        persistent = step % self.persistent_every == 0
        due = persistent or (self._local is not None and step % self.local_every == 0)
        if due and not self._start_checked and self._restored is None and not self.read_only:
            self._refuse_to_start_over(step)
        if self._local is not None and step % self.local_every == 0:
            if self._closed:
                raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
            name = step_name(step)
            drain = None
            if persistent and self.drain:
                self._settle()
                with self._lock:
                    self._active.add(name)

                drain = Drain(
                    locate(self._dir.path(name)),
                    self._saver.lease_ttl,
                    lambda: self._after_commit(name),
                )

            def settled() -> None:
                if drain is not None:
                    with self._lock:
                        self._active.discard(name)

            try:
                local = self._local.save(
                    name, state, content_metadata=content_metadata, on_commit=settled, drain=drain
                )
            except BaseException:
                with self._lock:
                    self._active.discard(name)
                raise
            if drain is not None:
                return local
        if not persistent:
            return local
        return self._save_named(
            step_name(step), state, content_metadata=content_metadata, progress=progress
        )

    def _refuse_to_start_over(self, step: int) -> None:
        """Collective, before this manager's first save when it restored nothing: a run that
        saves ``step`` while its persistent tier holds a newer committed step, or its local
        tier one at least as new, has started over without restoring (a resume decided by
        :meth:`latest_step`, which reads the persistent tier only, does that when no
        persistent step exists yet; a script whose resume is broken does it anywhere). Saving
        on would mix two trainings in one run: retention keeps the newest step numbers, the
        old run's, and a restore would go back to them. Steps marked damaged do not count (a
        restore that failed on every step said so; starting over then is the caller's call).
        An existing step of the same number is replaced as :meth:`save` says."""
        comm = self._saver.comm()
        local = self._local

        def newest(d: CheckpointDirectory) -> int | None:
            marked = d.damaged()
            found = [parse_step(n) for n in d.committed() if n not in marked]
            return max((s for s in found if s is not None), default=None)

        ours, err = outcome(lambda: newest(self._dir)) if comm.is_coordinator else (None, None)
        if local is None:
            ours, err = comm.broadcast((ours, err))
            raise_for([err], "the check of this run's committed steps")
            seen: list[tuple[str, int | None, Any]] = []
        else:
            mine, lerr = outcome(lambda: newest(local.dir)) if local.leader else (None, None)
            gathered = local.comm.all_gather((local.host, mine, lerr or err, ours))
            raise_for([e for _, _, e, _ in gathered], "the check of this run's committed steps")
            ours = gathered[0][3]
            seen = [(host, s, e) for host, s, e, _ in gathered]
        if ours is not None and ours > step:
            raise CheckpointError(
                f"{self.root} holds committed step {ours}, and step {step} is being saved by "
                "a manager that restored nothing: a run that resumes calls "
                "manager.restore(state) before training; to start a run over, save it under "
                "another root or delete the newer steps"
            )
        clash = {host: s for host, s, _ in seen if s is not None and s >= step}
        if clash:
            assert local is not None
            newer = max(clash.values())
            hosts = sorted(clash)
            where = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
            raise CheckpointError(
                f"this run's local tier holds committed step {newer} on "
                f"host{'s' if len(hosts) > 1 else ''} {where} (this host's: {local.root}), "
                f"and step {step} is being saved by a manager that restored nothing: "
                "a run that resumes calls manager.restore(state) before training (it raises "
                "CheckpointNotFoundError when neither tier holds a step; latest_step() reads "
                "the persistent tier only); to start the run over, give it a new run_id or "
                "delete those local steps"
            )
        self._start_checked = True

    def _save_named(
        self,
        name: str,
        state: Any,
        *,
        content_metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> AsyncSaveHandle | SaveStats:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")
        self._writable("save")
        previous = self._settle()
        if (
            previous is not None
            and previous[1].exception() is not None
            and not previous[0].observed
        ):
            log.error(
                "the async save into %s failed: %s", previous[0].path, previous[1].exception()
            )
        with self._lock:
            self._active.add(name)
        path = self._dir.path(name)
        try:
            if not self.async_save:
                stats = self._saver.save(
                    state,
                    path,
                    overwrite=True,
                    content_metadata=content_metadata,
                    progress=progress,
                )
            else:
                inner = self._saver.async_save(
                    state,
                    path,
                    overwrite=True,
                    content_metadata=content_metadata,
                    progress=progress,
                )
        except BaseException:
            with self._lock:
                self._active.discard(name)
            raise
        if not self.async_save:
            try:
                self._after_commit(name)
            except Exception as e:
                raise CheckpointError(
                    f"{self._dir.path(name)} committed, but updating {self._dir.pointer!r} failed: {e}"
                ) from e
            finally:
                with self._lock:
                    self._active.discard(name)
            return stats
        future: Future[SaveStats] = Future()
        outer = AsyncSaveHandle(future, inner.path, inner.seconds_blocked)
        with self._lock:
            self._pending = (outer, future)
        inner.add_done_callback(lambda h: self._finish(h, name, future))
        return outer

    def _finish(self, inner: AsyncSaveHandle, name: str, future: Future[SaveStats]) -> None:
        """Completion callback (writer thread, or the caller's if already done): commit
        bookkeeping on the coordinator, then complete the handle the caller holds."""
        error: BaseException | None = None
        stats: SaveStats | None = None
        try:
            error = inner.exception()
            if error is None:
                stats = inner.result()
                try:
                    self._after_commit(name)
                except Exception as e:
                    error = CheckpointError(
                        f"{self._dir.path(name)} committed, but updating {self._dir.pointer!r} failed: {e}"
                    )
                    error.__cause__ = e
        except BaseException as e:  # never leave the caller's handle pending
            error = e
        with self._lock:
            self._active.discard(name)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(stats)  # type: ignore[arg-type]

    def _after_commit(self, name: str) -> None:
        """Coordinator: point ``latest`` at the new checkpoint, apply retention, clean leftovers."""
        if not self._saver.comm().is_coordinator:
            return

        def active() -> set[str]:
            with self._lock:
                return set(self._active)

        with self._maintenance:
            retain(self._dir, name, lambda committed: self._doomed(committed, name), active)

    def _doomed(self, committed: list[str], latest: str) -> list[str]:
        """The committed names retention deletes now that ``latest`` has committed."""
        return Retention(self.keep_last, self.keep_every).doomed(self._dir, committed, latest)

    # -- restoring --------------------------------------------------------------------------
    def restore(
        self,
        state: Any,
        step: int | None = None,
        *,
        strict: StrictHandling | str = StrictHandling.ASSUME_OK_UNEXPECTED,
        fallback: bool = True,
    ) -> Any:
        """Collective: load step ``step`` (default: the latest committed) into the template
        ``state``; returns the state to train with and save again.

        The returned state keeps the template's sharded entries (ShardedTensors filled in
        place, ShardedObjects and factories holding what was loaded) with the checkpoint's
        common state merged in, so ``state = manager.restore(state)`` followed by
        ``manager.save(step, state)`` stores the same layout generation after generation.
        (:func:`shardsafe.load` returns the plain loaded values instead.) :attr:`restored_step`
        then names the step that was loaded.

        Stateful objects in the template (``state_dict()`` + ``load_state_dict()``: an
        ``OptimizerState(optimizer, model)``, an LR scheduler, a module, DCP's ``AppState``) are
        loaded through their ``state_dict()`` and handed the result with ``load_state_dict``,
        on every rank; the returned state holds the objects themselves, so the next save asks
        them again. This is how a run resumes its optimizer (state, step, param groups and
        learning rate) and scheduler in any layout.

        Without ``step`` the coordinator picks the step and tells the others, so every rank
        loads the same checkpoint. Everything read is verified against its checksums. When the
        chosen step turns out corrupt or incomplete on any rank and ``fallback`` is true, every
        rank moves on together to the newest older intact step, the failed step is marked
        (``.<name>.shardsafe-damaged`` beside it, kept for inspection) so that later restores
        try it last, and a warning names the step, the reason and the step used instead.
        An explicit ``step`` is never replaced by another. Raises
        :class:`CheckpointNotFoundError` when there is no committed step in reach, and
        :class:`CorruptCheckpointError` when every step failed, in either tier (naming each
        and why).
        """

        def load_into(path: str, delivered: Deliveries | None = None) -> Any:
            loaded = load(
                state,
                path,
                process_group=self.process_group,
                strict=strict,
                timeout=self.timeout,
                direct_io=self.direct_io,
                dead_after=self._saver.dead_after,
                delivered=delivered,
            )
            if StrictHandling(strict).returns:
                result, missing, unexpected = loaded
                return resavable(state, result), missing, unexpected
            return resavable(state, loaded)

        # a rank lost since the last save is named here, not a hang in the inventory's broadcasts
        self._saver.comm().arrive("restore", self.timeout, self._saver.dead_after)
        self.restored_tier = None
        if self._local is None:
            return self.restore_with(
                load_into, None if step is None else step_name(step), fallback=fallback
            )
        local = self._local
        self._settle()
        local.settle()
        inv = local_restore.inventory(local.view)
        # complete across the surviving places, newest first (an explicit step: that one only)
        held: list[str] = [n for n in inv["steps"] if step is None or n == step_name(step)]
        tried: set[str] = set()
        damaged: list[str] = []  # "local step N: why", for the error when nothing restores

        def local_from(floor: int | None) -> tuple[bool, Any]:
            """The local steps not tried yet and at least as new as ``floor`` (None: any)."""
            names = [
                n
                for n in held
                if n not in tried and (floor is None or (parse_step(n) or 0) >= floor)
            ]
            tried.update(names)
            return self._restore_local(inv, names, held, state, load_into, fallback, damaged)

        if step is not None:
            found, result = local_from(None)
            if found:
                return result
            try:
                result = self.restore_with(load_into, step_name(step), fallback=fallback)
            except CheckpointNotFoundError as e:
                if not damaged:
                    raise
                raise CorruptCheckpointError(
                    f"step {step} could not be restored: {damaged[0]}; and the persistent tier: {e}"
                ) from None
        else:
            # the local tier first when it holds a step at least as new as the newest
            # persistent one; when persistent steps then turn out damaged, the local steps
            # newer than the next one are tried before it
            found, result = local_from(self._newest_unmarked())
            if found:
                return result
            result = self._restore_in_order(load_into, fallback, local_from, damaged)
            if self.restored_tier == "local":
                return result
        log.warning(
            "restore: step %s restored from the persistent tier %s: the local tier had no "
            "step as new that it could restore",
            self.restored_step,
            self.root,
        )
        return result

    def _newest_unmarked(self) -> int | None:
        """The coordinator's newest persistent step without a damage mark, on every rank."""
        comm = self._saver.comm()
        order = self._dir.restore_order() if comm.is_coordinator else None
        order = comm.broadcast(order)
        damaged = self._dir.damaged() if comm.is_coordinator else {}
        damaged = comm.broadcast(damaged)
        newest = next((n for n in order or [] if n not in damaged), None)
        return parse_step(newest) if newest is not None else None

    def _restore_local(
        self,
        inv: dict[str, Any],
        steps: list[str],
        held: list[str],
        state: Any,
        load_into: Callable[[str, Deliveries | None], Any],
        fallback: bool,
        damaged: list[str],
    ) -> tuple[bool, Any]:
        """Restore the first of the local ``steps`` that loads (``held``: every step the
        inventory ``inv`` found complete); ``(False, None)`` when none does, each step's
        damage appended to ``damaged``."""
        local = self._local
        assert local is not None
        for index, name in enumerate(steps):
            try:
                result = local_restore.restore(local.view, name, inv, state, load_into)
            except CheckpointError as e:
                if not fallback or not is_damaged_checkpoint(e):
                    raise  # only proven damage moves on (an unreadable file is no proof)
                local.mark_damaged(name, str(e))
                damaged.append(f"local step {parse_step(name)}: {e}")
                nxt = steps[index + 1] if index + 1 < len(steps) else "the persistent tier"
                log.warning(
                    "restore: local step %s could not be restored (%s); trying %s", name, e, nxt
                )
                continue
            self._restored = name
            self.restored_tier = "local"
            newest = held[0]
            (log.warning if name != newest else log.info)(
                "restore: step %s restored from the local tier%s",
                parse_step(name),
                f", not its newest step {parse_step(newest)}" if name != newest else "",
            )
            return True, result
        return False, None

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` loaded (None before one succeeded)."""
        return None if self._restored is None else parse_step(self._restored)

    def restore_with(
        self, load_fn: Callable[[str], Any], name: str | None = None, *, fallback: bool = True
    ) -> Any:
        """Collective: run ``load_fn(path)`` (itself collective, raising the same error on every
        rank) on checkpoint ``name``, or on the newest committed one with fallback to older
        intact ones as :meth:`restore` describes."""
        if name is not None:
            self._settle()
            result = load_fn(self._dir.path(name))
            self._restored = name
            self.restored_tier = "persistent"
            return result
        return self._restore_in_order(load_fn, fallback)

    def _restore_in_order(
        self,
        load_fn: Callable[[str], Any],
        fallback: bool,
        local_from: Callable[[int | None], tuple[bool, Any]] | None = None,
        local_damaged: list[str] | None = None,
    ) -> Any:
        """The persistent steps in restore order, each after ``local_from(its step)``: the
        local tier's steps at least as new that were not tried yet (then any left, before
        giving up). ``local_damaged`` (filled by ``local_from``): the local steps that failed,
        which make the final error a :class:`CorruptCheckpointError` too: a run told that
        nothing exists would start over on top of its damaged steps."""
        local_damaged = [] if local_damaged is None else local_damaged
        candidates = self._candidates(required=local_from is None)
        comm = self._saver.comm()
        marks = comm.broadcast(self._dir.damaged() if comm.is_coordinator else None) or {}
        failures: list[str] = []
        skipped: list[str] = []
        for index, candidate in enumerate(candidates):
            if local_from is not None:
                found, result = local_from(parse_step(candidate))
                if found:
                    return result
            path = self._dir.path(candidate)
            if candidate in marks:
                log.warning(
                    "restore: %s is marked damaged (%s); checking it again",
                    path,
                    marks[candidate],
                )
            try:
                result = self._load_settled(load_fn, candidate)
            except CheckpointError as e:
                if not fallback or not is_damaged_checkpoint(e):
                    raise
                self._agree_damaged(candidate)
                reason = str(e)
                failures.append(f"{candidate}: {reason}")
                skipped.append(f"{candidate}: {reason}")
                nxt = candidates[index + 1] if index + 1 < len(candidates) else None
                log.warning(
                    "restore: %s is damaged (%s); %s",
                    path,
                    reason,
                    f"trying {nxt}" if nxt else "no other committed checkpoint is left",
                )
                if comm.is_coordinator and not self.read_only and candidate not in marks:
                    try:
                        self._dir.mark_damaged(candidate, reason)
                    except Exception as mark_error:
                        log.warning("could not mark %s damaged: %s", candidate, mark_error)
                continue
            except _Vanished as gone:
                if not fallback and gone.__cause__ is not None:
                    raise gone.__cause__ from None
                log.warning("restore: %s was deleted while it was read; trying the next", path)
                skipped.append(f"{candidate}: deleted while it was read")
                continue
            self._restored = candidate
            self.restored_tier = "persistent"
            if candidate in marks:
                log.warning("restore: %s restored and verified: its damage mark is cleared", path)
                if comm.is_coordinator and not self.read_only:
                    try:
                        self._dir.unmark(candidate)
                    except Exception as mark_error:
                        log.warning("could not clear the mark of %s: %s", candidate, mark_error)
            if index > 0:
                log.warning(
                    "restore: restored %s from the persistent tier, not the newest step %s: %s",
                    candidate,
                    candidates[0],
                    "; ".join(skipped),
                )
            else:
                log.info("restore: restored %s from the persistent tier", candidate)
            return result
        if local_from is not None:
            found, result = local_from(None)
            if found:
                return result
        failures = local_damaged + failures
        if not failures and skipped:
            raise CheckpointNotFoundError(
                f"every committed checkpoint under {self.root} was deleted while it was read: "
                + "; ".join(skipped)
            )
        if not failures:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.root} nor in the local tier"
            )
        raise CorruptCheckpointError(
            f"no committed checkpoint of this run could be restored ({self.root}"
            + (" and the local tier" if local_from is not None else "")
            + "): "
            + "; ".join(failures)
            + " (the files are kept, marked damaged; `shardsafe verify` shows what is wrong; "
            "to start the run over anyway, give it a new run_id or delete those steps)"
        )

    def _load_settled(self, load_fn: Callable[[str], Any], name: str) -> Any:
        """``load_fn`` on checkpoint ``name``; read again when it failed because the checkpoint
        was replaced while it was read (an overwrite of the same step): that is no damage.
        Raises :class:`_Vanished` when it was deleted meanwhile."""
        comm = self._saver.comm()
        for attempt in range(_REREADS + 1):
            before = comm.broadcast(self._dir.fingerprint(name) if comm.is_coordinator else None)
            try:
                return load_fn(self._dir.path(name))
            except CheckpointError as e:
                if not is_damaged_checkpoint(e):
                    raise
                after = comm.broadcast(self._dir.fingerprint(name) if comm.is_coordinator else None)
                if after is None:
                    raise _Vanished(name) from e
                if after == before or attempt == _REREADS:
                    raise
                log.warning(
                    "restore: %s was replaced while it was read (%s); reading it again",
                    self._dir.path(name),
                    e,
                )
        raise AssertionError("unreachable")

    def _candidates(self, required: bool = True) -> list[str]:
        """The coordinator's restore order, the same on every rank (``required``: raise
        :class:`CheckpointNotFoundError` when it is empty)."""
        self._settle()
        comm = self._saver.comm()
        order = self._dir.restore_order() if comm.is_coordinator else None
        order = comm.broadcast(order)
        if not order and required:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        return [str(n) for n in order or []]

    def _agree_damaged(self, name: str) -> None:
        """Every rank raised the same error (loads gather them), so every rank falls back;
        check it anyway, so that a disagreement is an error rather than a hang."""
        comm = self._saver.comm()
        if not comm.distributed:
            return
        verdicts = comm.all_gather(name)
        if len(set(verdicts)) != 1:
            raise DistributedError(
                f"ranks disagree on which checkpoint failed to restore: {verdicts}"
            )

    def _resolve(self, name: str | None) -> str:
        self._settle()
        if name is not None:
            return name
        return self._candidates()[0]

    # -- housekeeping -----------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        """Coordinator: remove what crashed saves left behind (never this manager's saves in
        flight, nor anything a valid lease protects, nor a complete checkpoint: one found beside
        its empty name is renamed back); returns the removed names. Other ranks: []."""
        self._writable("clean up")
        if not self._saver.comm().is_coordinator:
            return []
        with self._maintenance:
            with self._lock:
                active = set(self._active)
            return self._dir.clean(active)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise CheckpointError(
                f"cannot {what}: the CheckpointManager of {self.root} was opened with "
                "read_only=True (open another one without it, in the training job)"
            )

    def wait(self, timeout: float | None = None) -> SaveStats | None:
        """Wait for the save in flight (and its pointer update); return its stats.

        Raises its error unless the caller has already seen it through the handle.
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            if self._local is not None:
                self._local.wait()
            return None
        handle, future = pending
        if self._local is not None:
            self._local.wait()
        seen = handle.observed
        try:
            exc = future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save into {handle.path} still running after {timeout} s") from None
        with self._lock:
            if self._pending is pending:
                self._pending = None
        if exc is not None:
            if seen:
                return None
            return handle.result()  # raises, and marks it seen
        return handle.result()

    def _settle(self) -> tuple[AsyncSaveHandle, Future[SaveStats]] | None:
        """Wait, without raising, for the save in flight to finish its commit and bookkeeping."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending[1].exception()
        return pending

    def close(self) -> None:
        """Wait for the save in flight, then release the writer thread and staging memory."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            local = self._local
            try:
                call_each([self._saver.close, *([local.close] if local is not None else [])])
            finally:
                self.staging.release()  # the tiers' writers are stopped: nothing holds it

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, "
            f"keep_every={self.keep_every}, async_save={self.async_save})"
        )


__all__ = [
    "CheckpointDirectory",
    "CheckpointManager",
    "StepDirectory",
    "parse_step",
    "step_name",
]


def resavable(template: Any, loaded: Any) -> Any:
    """``loaded`` with the template's sharded entries put back around the loaded values, and
    its Stateful objects (loaded through ``load_state_dict``) themselves."""
    if is_stateful(template):
        return template
    if isinstance(template, ShardedTensor):
        if template.data is None and isinstance(loaded, torch.Tensor):
            return replace(template, data=loaded)
        return template
    if isinstance(template, (ShardedObject, ShardedTensorFactory)):
        return replace(template, data=loaded)
    if isinstance(template, (LocalNonPersistentObject, CoordinatorObject)):
        return replace(template, obj=loaded)
    if isinstance(template, dict) and isinstance(loaded, dict):
        out = {k: resavable(template[k], v) if k in template else v for k, v in loaded.items()}
        out.update({k: v for k, v in template.items() if k not in loaded})  # skipped keys
        return out
    if isinstance(template, list) and isinstance(loaded, list) and len(template) == len(loaded):
        return [resavable(t, v) for t, v in zip(template, loaded, strict=True)]
    return loaded
