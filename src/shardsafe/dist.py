"""Collectives with error gathering, and a no-distributed mode.

A step that spans ranks runs as :func:`outcome` on each rank (its result or its exception's
record), a gather of the records, and :func:`raise_for`: if any rank failed, every rank
raises the same :class:`CheckpointError` naming the failing ranks. No rank is left waiting in
a collective that a failed peer will never reach.

Before a collective, :meth:`Comm.arrive` waits in the store for every rank: the last to
arrive sets the wait's ``all`` key, and while the wait lasts the process's heartbeat thread
(:mod:`shardsafe.liveness`) sets it instead to the verdict on an awaited rank that stopped
heartbeating for ``dead_after`` s (``compare_set``: the first of the two wins for every rank).
So a rank that died or froze since the last operation is named with its host on every
waiting rank within ``dead_after`` + 2 s, and one that is alive but slow is waited for up to
``timeout``. :meth:`Comm.with_peers` does the same for a point-to-point exchange with a few
peers (the local tier's copy rounds), which no store key ends, and every collective of a
:class:`Comm` runs under it (:meth:`Comm._guarded`), so a rank lost inside one is named too.
Their store calls run in a thread of their own (:meth:`~shardsafe.liveness.Heartbeat.call`):
a frozen store never answers, and the waiting thread raises naming it instead.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch.distributed as tdist

from . import errors as _errors
from .errors import CheckpointError, DistributedError, describe_ranks
from .liveness import (
    DEAD_AFTER,
    HEARTBEATS,
    INTERVAL,
    POLL,
    Heartbeat,
    Watch,
    dead_after_of,
    in_thread,
    start_within_of,
)

T = TypeVar("T")


@dataclass
class Comm:
    """The ranks taking part in one checkpoint operation (a process group, or just this process)."""

    group: Any = None
    rank: int = 0
    world_size: int = 1
    distributed: bool = False
    dead_after: float = DEAD_AFTER  # a rank silent this long in a collective is named dead

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def arrive(self, stage: str, timeout: float, dead_after: float = DEAD_AFTER) -> None:
        """Wait until every rank reached ``stage``; raise naming a rank that died meanwhile.

        Runs through the process group's store before a collective, so that a dead or frozen
        rank becomes a :class:`DistributedError` naming it and its host within ``dead_after``
        (+ 2 s; see :mod:`shardsafe.liveness`) instead of a hang until the process group's
        own timeout; a rank that is alive but slow is waited for up to ``timeout`` s, then
        named as absent. Every rank must call the same stages in the same order.
        """
        if self.distributed:
            self._arrive(stage, timeout, dead_after, None)

    def vote(
        self,
        stage: str,
        ballot: Any,
        tally: Callable[[list[Any]], Any],
        timeout: float,
        dead_after: float = DEAD_AFTER,
    ) -> Any:
        """:meth:`arrive` that counts a vote on the way: ``tally`` of every rank's ``ballot``
        (JSON values; group rank order), the same on every rank.

        Each ballot rides in its rank's arrival key; the last rank to arrive reads them all
        (one ``multi_get``) and ends the wait with the tally instead of "1". One round
        through the store instead of an arrival and an all-gather after it, and each rank
        reads the tally only (the store serves N small writes, one read of N keys and N
        reads of the tally: no N x N). ``tally`` must be deterministic; one that raises is
        raised on every rank."""
        if not self.distributed:
            try:
                return tally([ballot])
            except Exception as e:
                raise _TallyFailed(error_record(e), stage) from e
        return self._arrive(stage, timeout, dead_after, (ballot, tally))

    def _arrive(
        self,
        stage: str,
        timeout: float,
        dead_after: float,
        voting: tuple[Any, Callable[[list[Any]], Any]] | None,
    ) -> Any:
        store = _store()
        try:
            beat = _heartbeat(store)

            def wait() -> Any:
                base = f"shardsafe/arrive/{_group_tag(self)}/{self._next_sequence(store)}"
                return self._wait_for_all(store, beat, base, stage, timeout, dead_after, voting)

            # in a thread of its own: a frozen store never answers, and this one says so
            return beat.call(wait, self.rank, f"waiting for '{stage}'", dead_after_of(dead_after))
        except (DistributedError, _TallyFailed):
            raise
        except Exception as e:  # the store itself is gone: its host process died
            raise DistributedError(
                f"rank {self.rank}: lost the process group's store while waiting for '{stage}' "
                f"({type(e).__name__}: {e}); the process hosting it (rank 0 with a tcp:// or env:// "
                "rendezvous, or the launcher) probably died"
            ) from None

    def _next_sequence(self, store: Any) -> int:
        """This rank's count of arrivals on this group, kept in the group's store: equal on
        every rank that called the same steps, whichever Saver, manager or load called them,
        and gone with the process group (this process keeps no count)."""
        return int(store.add(f"shardsafe/arrivals/{_group_tag(self)}/r{self.rank}", 1))

    def _wait_for_all(
        self,
        store: Any,
        beat: Heartbeat,
        base: str,
        stage: str,
        timeout: float,
        dead_after: float,
        voting: tuple[Any, Callable[[list[Any]], Any]] | None = None,
    ) -> Any:
        """The last rank to arrive sets ``all`` to "1" (with ``voting``: to the tally of the
        ballots), or this process's heartbeat thread sets it to the verdict on a rank that
        stopped beating; everyone blocks in the store's ``wait`` for it and reads which it
        holds. Returns the tally (None without ``voting``)."""
        arrival = stage if voting is None else json.dumps({"stage": stage, "ballot": voting[0]})
        store.set(f"{base}/r{self.rank}", arrival)
        done = f"{base}/all"
        if int(store.add(f"{base}/count", 1)) == self.world_size:
            store.compare_set(
                done, "", "1" if voting is None else _tally(store, base, self.world_size, voting[1])
            )
        others = [r for r in range(self.world_size) if r != self.rank]
        handle = beat.watch(
            Watch(
                done,
                lambda r: f"{base}/r{r}",
                others if self.is_coordinator else [0],
                self.global_rank,
                self.is_coordinator,
                stage,
                dead_after_of(dead_after),
                start_within_of(dead_after, timeout),
                members=self.members(),
                exits=True,  # a rank that has not arrived and exited never will
            )
        )
        try:
            store.wait([done], timedelta(seconds=timeout))
        except Exception as e:
            if not store.check([done]):
                absent = [r for r in range(self.world_size) if not store.check([f"{base}/r{r}"])]
                if absent or "timeout" in f"{type(e).__name__} {e}".lower():
                    raise DistributedError(
                        f"rank {self.rank}: {describe_ranks(absent)} did not reach '{stage}' within {timeout:.0f} s "
                        "(alive but stuck, or calling a different checkpoint operation)",
                        {r: "absent" for r in absent},
                    ) from None
                raise
        finally:
            beat.unwatch(handle)
        ended = json.loads(bytes(store.get(done)).decode())
        if isinstance(ended, dict) and "message" in ended:  # a verdict
            raise DistributedError(
                f"rank {self.rank}: {ended['message']}", {int(ended["rank"]): "dead"}
            )
        if voting is not None and not isinstance(ended, dict):
            # the coordinator's heartbeat saw every ballot posted and ended the wait before
            # the last rank counted them (it froze or died there, or was just slower): each
            # rank counts them itself, before the keys go (the same tally everywhere)
            ended = json.loads(_tally(store, base, self.world_size, voting[1]))
        if int(store.add(f"{base}/done", 1)) == self.world_size:
            # every rank has read what it needs: the heartbeat deletes the keys at its next beat
            beat.discard(
                [f"{base}/r{r}" for r in range(self.world_size)]
                + [f"{base}/count", f"{base}/done", done]
            )
        if voting is None:
            return None
        if "failed" in ended:
            raise _TallyFailed(ended["failed"], stage)
        return ended["tally"]

    def with_peers(
        self,
        fn: Callable[[], T],
        peers: Iterable[int],
        stage: str,
        dead_after: float = DEAD_AFTER,
        verdict_key: str | None = None,
    ) -> T:
        """``fn()``, a blocking exchange of point-to-point messages with ``peers`` (group
        ranks), raising a :class:`DistributedError` naming a peer and its host as soon as it
        has not heartbeated for ``dead_after`` s (+ 2 s; see :mod:`shardsafe.liveness`).

        Gloo's waits cannot be interrupted (``Work`` has no ``abort``, and aborting the group
        leaves them blocked), so ``fn`` runs in a thread of its own while this one waits for it
        or for the heartbeat thread's verdict; after a verdict that thread stays blocked until
        the group's own timeout and the group is not to be used again. A peer that is slow but
        beating is waited for (up to that timeout). When ``fn`` raises (gloo saw a peer's
        connection close), the verdict on the dead peer is awaited for up to ``dead_after``
        + 4 s (this rank looking at once) so that the error names it; otherwise the error
        says what gloo said. With ``verdict_key``, a verdict is also written there and one
        found there (another rank's, on a peer this rank does not look at) ends this rank's
        wait too.
        """
        awaited = sorted(set(peers) - {self.rank})
        if not self.distributed or not awaited:
            return fn()
        try:
            beat = _heartbeat(_store())
        except Exception:  # the store is gone: gloo's own error is all there is to say
            return fn()
        ended, box = in_thread(fn, "shardsafe-exchange")  # gloo's waits cannot be interrupted
        watch = Watch(
            verdict_key,
            lambda r: "",
            awaited,
            self.global_rank,
            False,
            stage,
            dead_after_of(dead_after),
            start_within_of(dead_after, float("inf")),
            notify=lambda _verdict: ended.set(),
            relay=verdict_key is not None,
            members=self.members(),
        )
        handle = beat.watch(watch)
        limit = dead_after_of(dead_after)
        lost: DistributedError | None = None
        try:
            while not ended.wait(POLL):  # the heartbeat's verdict, or the store stops answering
                if (lost := beat.lost_error(self.rank, f"in {stage}", limit)) is not None:
                    break
            if lost is None and watch.verdict is None and "error" in box:  # a connection closed
                watch.exits = True  # the exchange failed: a peer that exited is the one
                beat.look_now()
                grace = time.monotonic() + limit + 4 * INTERVAL
                while watch.verdict is None and time.monotonic() < grace:
                    if (lost := beat.lost_error(self.rank, f"in {stage}", limit)) is not None:
                        break  # no verdict can come through a lost store
                    time.sleep(INTERVAL / 4)
        finally:
            beat.unwatch(handle)
        if "result" in box:  # done: a peer lost now is named by the next wait
            return cast(T, box["result"])
        if watch.verdict is None and lost is not None:
            raise lost
        if watch.verdict is not None:
            raise DistributedError(
                f"rank {self.rank}: {watch.verdict['message']}",
                {int(watch.verdict["rank"]): "dead"},
            )
        if "error" in box:
            e = box["error"]
            raise DistributedError(
                f"rank {self.rank}: '{stage}' with {describe_ranks(awaited)} failed "
                f"({type(e).__name__}: {e}); none of them stopped heartbeating"
            ) from e
        raise AssertionError("unreachable: the exchange ended without a result or an error")

    def _guarded(self, fn: Callable[[], None], what: str, root: int | None) -> None:
        """Run the collective ``fn`` under the heartbeat: a rank that dies or freezes in it is
        named on every rank within ``dead_after`` (+ 3 s) instead of holding them until the
        group's timeout. The coordinator looks at every rank, the others at the coordinator
        and their two ring neighbours (gloo's all-gather is a ring; its gather, scatter and
        broadcast go through the root); a verdict goes into a key of this collective that
        every rank's heartbeat looks at, so each raises it. A collective's cost: one store
        request per rank, and the store's reads only while it lasts past a heartbeat."""
        try:
            store = _store()
            beat = _heartbeat(store)
            seq = beat.call(
                lambda: self._next_sequence(store),
                self.rank,
                f"starting {what}",
                dead_after_of(self.dead_after),
            )
        except DistributedError:  # the store stopped answering
            raise
        except Exception as e:  # no store to watch through: gloo's own timeout bounds it
            try:
                fn()
            except Exception as e2:
                raise self._collective_failed(e2, root) from e
            return
        base = f"shardsafe/collective/{_group_tag(self)}/{seq}"
        n = self.world_size
        watched = range(n) if self.is_coordinator else {0, (self.rank - 1) % n, (self.rank + 1) % n}
        self.with_peers(fn, watched, what, self.dead_after, verdict_key=f"{base}/dead")

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        payload = json.dumps(obj)
        self._guarded(
            lambda: tdist.all_gather_object(out, payload, group=self.group), "an all-gather", None
        )
        return [json.loads(s) for s in out]

    def gather(self, obj: Any) -> list[Any] | None:
        """To the coordinator only; other ranks get None."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        payload = json.dumps(obj)
        self._guarded(
            lambda: tdist.gather_object(payload, out, dst=self.global_rank(0), group=self.group),
            "a gather to rank 0",
            0,
        )
        return [json.loads(s) for s in out] if out is not None else None

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [json.dumps(obj) if self.is_coordinator else None]
        self._guarded(
            lambda: tdist.broadcast_object_list(box, src=self.global_rank(0), group=self.group),
            "a broadcast from rank 0",
            0,
        )
        return json.loads(box[0])  # type: ignore[arg-type]

    def scatter(self, objs: list[Any] | None) -> Any:
        """Item ``r`` of the coordinator's list on rank ``r``."""
        if not self.distributed:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        inputs = [json.dumps(o) for o in objs] if self.is_coordinator and objs is not None else None
        self._guarded(
            lambda: tdist.scatter_object_list(
                out, inputs, src=self.global_rank(0), group=self.group
            ),
            "a scatter from rank 0",
            0,
        )
        return json.loads(out[0])

    def _collective_failed(self, e: Exception, root: int | None) -> DistributedError:
        """A collective raised (a peer's connection closed, or the group's timeout passed)."""
        who = (
            f"rank {root} (the coordinator) or another rank"
            if root is not None and self.rank != root
            else "another rank"
        )
        return DistributedError(
            f"rank {self.rank}: a collective failed ({e}); {who} probably died or timed out"
        )

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return tdist.get_global_rank(self.group, group_rank)

    def members(self) -> list[int]:
        """The group's global ranks, by group rank."""
        return [self.global_rank(r) for r in range(self.world_size)]


class _TallyFailed(CheckpointError):
    """The tally of a :meth:`Comm.vote` raised on the rank that counted it."""

    def __init__(self, record: dict[str, Any], stage: str) -> None:
        super().__init__(f"counting the votes of '{stage}' failed: {_with_origin(record)}")


def _tally(store: Any, base: str, world_size: int, tally: Callable[[list[Any]], Any]) -> str:
    """The last arrival's count of a vote: every ballot in one read, then ``tally``; its
    failure is the result too (every rank raises it), never a wait that does not end."""
    keys = [f"{base}/r{r}" for r in range(world_size)]
    try:
        try:
            raw = store.multi_get(keys)
        except (NotImplementedError, AttributeError):  # a store without it
            raw = [store.get(k) for k in keys]
        ballots = [json.loads(bytes(v).decode())["ballot"] for v in raw]
        return json.dumps({"tally": tally(ballots)})
    except Exception as e:
        return json.dumps({"failed": error_record(e)})


def _group_tag(comm: Comm) -> str:
    """Names the group by its global ranks, the same on every member."""
    if comm.group is None:
        return f"world{comm.world_size}"
    ranks = tdist.get_process_group_ranks(comm.group)
    return f"g{len(ranks)}-{ranks[0]}-{hash(tuple(ranks)) & 0xFFFFFFFF:x}"


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as e:  # pragma: no cover - torch internals moved
        raise DistributedError(f"cannot reach the process group's store: {e}") from e


def _heartbeat(store: Any) -> Heartbeat:
    """This process's heartbeat in the default group's store (started if it is not yet)."""
    return HEARTBEATS.ensure(store, tdist.get_rank(), tdist.get_world_size())


def get_comm(process_group: Any = None) -> Comm:
    """The ranks of ``process_group`` (default group if None), or a single-process Comm."""
    if not (tdist.is_available() and tdist.is_initialized()):
        if process_group is not None:
            raise CheckpointError(
                "a process_group was given but torch.distributed is not initialised"
            )
        return Comm()
    # beating from the first operation on, so that a rank lost before its next one is named
    with contextlib.suppress(Exception):  # a store lost now is reported by the next wait
        _heartbeat(_store())
    return Comm(
        process_group, tdist.get_rank(process_group), tdist.get_world_size(process_group), True
    )


def outcome(fn: Callable[[], T]) -> tuple[T | None, dict[str, Any] | None]:
    """Run ``fn``; return ``(result, None)`` or ``(None, error_record)``."""
    try:
        return fn(), None
    except Exception as e:
        return None, error_record(e)


_LOCAL = threading.local()


def error_record(e: BaseException) -> dict[str, Any]:
    """A JSON-able description of ``e``; the exception itself is kept for chaining on this rank."""
    _LOCAL.last = e
    cls = type(e).__name__ if isinstance(e, CheckpointError) else "CheckpointError"
    message = str(e) or type(e).__name__
    if not isinstance(e, CheckpointError):
        message = f"{type(e).__name__}: {message}"
    return {
        "type": cls,
        "message": message,
        "origin": type(e).__name__,
        "trace": traceback.format_exc(limit=6),
    }


def _local_cause() -> BaseException | None:
    cause = getattr(_LOCAL, "last", None)
    _LOCAL.last = None
    return cause


def agree(comm: Comm, fn: Callable[[], T], stage: str) -> T:
    """Run ``fn`` on every rank and gather the outcomes: raise everywhere if it failed anywhere
    (for a step whose failure on one rank would leave the others in a later collective)."""
    result, err = outcome(fn)
    raise_for(comm.all_gather(err) if comm.distributed else [err], stage)
    return cast(T, result)


def raise_for(records: list[dict[str, Any] | None], stage: str) -> None:
    """Raise one error on this rank if any rank's record is an error.

    When every failing rank reports the same :class:`CheckpointError` (a validation error
    computed from the same plan, say), that error is raised as-is; otherwise a
    :class:`DistributedError` names each failing rank and its message.
    """
    failed = {r: rec for r, rec in enumerate(records) if rec is not None}
    if not failed:
        return
    kinds = {(rec["type"], rec["message"]) for rec in failed.values()}
    if len(kinds) == 1:
        ((kind, message),) = kinds
        cls = getattr(_errors, kind, None)
        if (
            isinstance(cls, type)
            and issubclass(cls, CheckpointError)
            and cls is not DistributedError
        ):
            if len(records) > 1 and len(failed) < len(records):
                message = f"{message} (on {describe_ranks(list(failed))} during {stage})"
            raise cls(message) from _local_cause()
    lines = "; ".join(f"rank {r}: {_with_origin(rec)}" for r, rec in sorted(failed.items())[:8])
    raise DistributedError(
        f"{stage} failed on {describe_ranks(list(failed))}: {lines}",
        {r: rec["message"] for r, rec in failed.items()},
        {r: rec["type"] for r, rec in failed.items()},
    ) from _local_cause()


def _with_origin(rec: dict[str, Any]) -> str:
    """``Origin: message`` unless the message already starts with its exception type."""
    message, origin = str(rec["message"]), str(rec["origin"])
    return message if message.startswith(f"{origin}:") else f"{origin}: {message}"
