"""The commit protocol's messages, through the process group's key-value store.

Blocking and asynchronous saves commit the same way: each rank posts its write record under
a key unique to the save, the coordinator waits for all of them, commits, and posts the
outcome every rank waits for. No collective is involved, so a background commit never races
the training loop's collectives.

Failure bounds. The heartbeat is the process's own (:mod:`shardsafe.liveness`), the one every
wait of the library consults; while a save's channel is open, from planning until the rank
has the outcome, it beats and looks every ``interval`` = ``min(0.5, dead_after / 4)`` s
instead of every second (:meth:`~shardsafe.liveness.Heartbeat.hasten`), on every rank in the
save. A waiting rank blocks in the store's ``wait``; the heartbeat thread looks at the beats
of those it still waits for:

* a rank whose counter has not moved for ``dead_after`` seconds (at least liveness's floor,
  3 s: a rank outside any channel beats once a second) (its process is gone, or
  frozen) has its awaited key filled with ``{"dead": message}`` and fails the save, named
  with its host, on every rank within ``dead_after + 2 * interval`` s of its last beat (one
  that never beat gets ``start_within`` seconds: it may still be importing);
* a rank that is slow but heartbeating is waited for, and the wait is logged every
  ``log_every`` seconds;
* a verdict another wait posted on the board (:mod:`shardsafe.liveness`) ends these waits
  only for a rank they await: the coordinator records it as that rank's error if its record
  has not come; a rank awaiting the outcome takes only a verdict on the coordinator. A verdict
  on another rank must not end it: the coordinator may commit without that rank (its record
  came first), and a place whose leader gave up would then not publish a committed step;
* a store that stops answering (the process hosting it frozen) fails every rank's post, wait
  or publish within ``dead_after`` + ``interval`` s, naming the store (each runs in a thread
  of its own: :meth:`~shardsafe.liveness.Heartbeat.call`).

The counters of the ranks a rank watches are read on every beat, not only while it waits, so
a rank that died while the others were still writing their share is named as soon as the
coordinator waits, if it has been silent ``dead_after`` s by then.

So a save costs the store no beats of its own: the process's beats (and reads of the watched
counters) come twice as often while it lasts (four requests per rank a second instead of two;
a channel with its own counters made more).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as tdist

from .dist import Comm
from .errors import DistributedError
from .liveness import DEAD_AFTER as DEAD_AFTER
from .liveness import HEARTBEATS, Heartbeat, Watch, dead_after_of, open_connection, store_address

T = TypeVar("T")

HEARTBEAT_INTERVAL = 0.5
"""Seconds between two heartbeats of a rank while a save's channel is open (at most)."""


def default_store() -> Any:
    """The default process group's store (shared by every group created from it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as e:  # pragma: no cover - torch internals moved
        raise DistributedError(f"cannot reach the process group's store: {e}") from e


@dataclass
class StoreClients:
    """The commit protocol's store clients: ``wait``, a connection of its own for the blocking
    waits of the thread that commits (a store client serialises its requests: a thread blocked
    in ``wait`` would hold up any other on the same client); ``beat``, the process heartbeat's
    connection (:mod:`shardsafe.liveness`), for its looks at this save's keys and its verdicts,
    which only the heartbeat thread makes and which never block. Made once per :class:`Saver`
    and reused by its saves (connecting anew for every save costs seconds at scale): a process
    holds its heartbeat's connection and one per Saver."""

    wait: Any
    beat: Any
    blocking: bool


def connect() -> StoreClients:
    """A fresh client of the default group's store (a TCP store, or one behind prefixes) for
    the waits, and the process heartbeat's for the looks; for another kind of store, the store
    itself, waited on by polling."""
    shared = default_store()
    tcp = shared
    while not isinstance(tcp, tdist.TCPStore):
        tcp = getattr(tcp, "underlying_store", None)
        if tcp is None:
            return StoreClients(shared, shared, False)
    heartbeat = HEARTBEATS.ensure(shared, tdist.get_rank(), tdist.get_world_size())
    if heartbeat.client is shared:  # a store that cannot be cloned: two fresh connections
        return StoreClients(_fresh(tcp), _fresh(tcp), True)
    return StoreClients(
        tdist.PrefixStore("shardsafe", open_connection(shared.clone, store_address(shared))),
        tdist.PrefixStore("shardsafe", heartbeat.client),
        True,
    )


def _fresh(tcp: Any) -> Any:
    return tdist.PrefixStore(
        "shardsafe",
        open_connection(
            lambda: tdist.TCPStore(
                tcp.host,
                tcp.port,
                is_master=False,
                timeout=timedelta(seconds=60),
                wait_for_workers=False,
            ),
            store_address(tcp),
        ),
    )


class StoreChannel:
    """Keys ``shardsafe/<token>/...`` in the store, for one save; hastens the process
    heartbeat (:mod:`shardsafe.liveness`) while open."""

    def __init__(
        self,
        comm: Comm,
        token: str,
        clients: StoreClients | None = None,
        *,
        dead_after: float = DEAD_AFTER,
        interval: float = HEARTBEAT_INTERVAL,
        log_every: float = 30.0,
        start_within: float | None = None,
    ) -> None:
        self.comm = comm
        self.prefix = f"shardsafe/{token}"
        clients = clients if clients is not None else connect()
        self.store, self.beat_store, self.blocking = clients.wait, clients.beat, clients.blocking
        # no less than liveness's floor: a rank whose own channel closed (a leader publishing,
        # a rank already in the next step) beats once a second, not at this channel's pace
        self.dead_after = dead_after_of(dead_after)
        self.interval = min(interval, self.dead_after / 4)
        self.log_every = log_every
        # a rank that never heartbeated is late rather than dead: more slack
        self.start_within = start_within if start_within is not None else max(60.0, 6 * dead_after)
        self.heartbeat: Heartbeat = HEARTBEATS.ensure(
            default_store(), tdist.get_rank(), tdist.get_world_size()
        )
        self._haste: int | None = self.heartbeat.hasten(self.interval)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def stop(self) -> None:
        """Back to the process heartbeat's own pace."""
        if self._haste is not None:
            self.heartbeat.relax(self._haste)
            self._haste = None

    # -- posting and waiting ----------------------------------------------------------------
    def _call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on the store, raising as soon as the store counts as lost (frozen or gone):
        see :meth:`~shardsafe.liveness.Heartbeat.call`."""
        return self.heartbeat.call(fn, self.comm.rank, what, dead_after_of(self.dead_after))

    def post(self, record: dict[str, Any]) -> None:
        key, value = self._key(f"rank{self.comm.rank}"), json.dumps(record)
        self._call(lambda: self.store.set(key, value), "posting its write record")

    def _wait(self, ranks: set[int], what: str, key_of: Any, waiting_for: str) -> dict[int, Any]:
        """Block until ``key_of(r)`` exists for every rank in ``ranks``; the heartbeat thread
        fills the key of a rank that stopped beating with ``{"dead": message}``. Returns what
        each key holds."""

        def dead(verdict: dict[str, Any]) -> None:
            key = key_of(int(verdict["rank"]))
            record = {"dead": verdict["message"], "rank": int(verdict["rank"])}
            self.beat_store.compare_set(key, "", json.dumps(record))

        handle = self.heartbeat.watch(
            Watch(
                None,
                key_of,
                sorted(ranks),
                self.comm.global_rank,
                True,
                waiting_for,
                self.dead_after,
                self.start_within,
                notify=dead,
                each=True,
                doing=what,
                keys=self.beat_store,
                log_every=self.log_every,
                members=self.comm.members(),
                exits=True,  # a rank whose record (or outcome) is not in and that exited
            )
        )
        keys = [key_of(r) for r in sorted(ranks)]

        def wait() -> dict[int, Any]:
            if self.blocking:
                self.store.wait(keys, timedelta(days=365))
            else:
                while not all(self.store.check([k]) for k in keys):
                    time.sleep(self.interval / 5)
            return {r: json.loads(self.store.get(key_of(r))) for r in sorted(ranks)}

        try:
            return self._call(wait, f"waiting for {waiting_for}")
        except DistributedError:  # the store stopped answering
            raise
        except Exception as e:
            raise _store_lost(self.comm.rank, waiting_for, e) from None
        finally:
            self.heartbeat.unwatch(handle)

    def collect(self) -> list[dict[str, Any]]:
        """Coordinator: every rank's record; a rank that stops heartbeating gets an error record."""
        got = self._wait(
            set(range(self.comm.world_size)),
            "writing its share",
            lambda r: self._key(f"rank{r}"),
            "every rank's write record",
        )
        records: list[dict[str, Any]] = []
        for r in range(self.comm.world_size):
            rec = got[r]
            if "dead" in rec:
                rec = {
                    "error": {
                        "type": "DistributedError",
                        "message": rec["dead"],
                        "origin": "DeadRank",
                        "trace": "",
                    }
                }
            records.append(rec)
        return records

    def publish(self, status: dict[str, Any]) -> None:
        key, value = self._key("status"), json.dumps(status)
        self._call(lambda: self.store.set(key, value), "publishing the commit outcome")

    def await_status(self) -> dict[str, Any]:
        """The coordinator's outcome; raises naming it if it stops heartbeating first."""
        status = self._wait(
            {0}, "committing", lambda r: self._key("status"), "the coordinator's commit outcome"
        )[0]
        if "dead" in status:
            lost = int(status.get("rank", 0))
            if lost == 0:
                raise DistributedError(
                    f"rank {self.comm.rank}: no commit outcome from the coordinator: {status['dead']}",
                    {0: "dead"},
                )
            # a verdict from the board (another wait named a rank of this save): the save
            # cannot have committed without it unless its record came first, which only the
            # coordinator knows
            raise DistributedError(
                f"rank {self.comm.rank}: {status['dead']}; the coordinator's commit outcome did "
                "not come before this verdict (restore tells whether the save committed)",
                {lost: "dead"},
            )
        return dict(status)

    def cleanup(self) -> None:
        """Stop heartbeating; the last rank to read the outcome deletes the save's keys."""
        self.stop()

        def clean() -> None:
            if int(self.store.add(self._key("acks"), 1)) == self.comm.world_size:
                names = [f"rank{r}" for r in range(self.comm.world_size)]
                for name in [*names, "status", "acks"]:
                    self.store.delete_key(self._key(name))

        # stores without delete keep a few bytes; a lost store fails the next wait
        with contextlib.suppress(Exception):
            self._call(clean, "cleaning up the save's keys")


def _store_lost(rank: int, what: str, e: Exception) -> DistributedError:
    return DistributedError(
        f"rank {rank}: lost the process group's store while waiting for {what} "
        f"({type(e).__name__}: {e}); the process hosting it (rank 0 with a tcp:// or env:// "
        "rendezvous, or the launcher) probably died"
    )
