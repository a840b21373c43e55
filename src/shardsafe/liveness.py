"""Per-process heartbeats in the process group's store: how a wait tells a dead rank from a slow one.

Protocol. From the first time a process takes part in a distributed checkpoint operation
(:func:`shardsafe.dist.get_comm` or :meth:`~shardsafe.dist.Comm.arrive` with an initialised
process group) until it exits or the store goes away, a daemon thread with its own client of
the store (``store.clone()``: a client blocked in ``wait`` would hold up a beat) has written
its host name to ``shardsafe/alive/host<global rank>`` once and increments
``shardsafe/alive/beat<global rank>`` every :data:`INTERVAL` seconds. The heartbeat belongs to
the process, not to a Saver, manager or load: a rank between two saves, or one that dropped its
Saver and will make another later, is alive and beating.

Nobody is declared dead for not beating; only a wait fails. A rank waiting in
:meth:`~shardsafe.dist.Comm.arrive` hands the wait to its heartbeat thread, which on every beat
reads the counters of the ranks that could keep it waiting forever: the group's coordinator
reads those of every rank that has not arrived, any other rank the coordinator's only. A rank
whose counter has not moved for ``dead_after`` seconds while awaited (``start_within`` if it
never beat: it may still be importing) is written, with its host, into the key every waiting
rank blocks on (``compare_set``, so the first verdict, or the last arrival, wins for all), and
every waiting rank raises the same :class:`~shardsafe.errors.DistributedError`. So:

* a rank that died or froze (SIGKILL, SIGSTOP, a lost host) between saves, in planning, in a
  load or before one, is named on every waiting rank within ``dead_after + 2 * INTERVAL`` s of
  the later of its last beat and the coordinator's arrival at the wait (a dead coordinator:
  of the wait's start on each rank);
* a rank that is slow but beating is waited for until the wait's own ``timeout``;
* an exchange of point-to-point messages (the local tier's copy rounds, at save and restore)
  runs under :meth:`~shardsafe.dist.Comm.with_peers`: the heartbeat thread looks at the
  exchange's peers and hands its verdict to a callback instead of a key, so a peer that died
  or froze mid-round is named on the ranks in the round within ``dead_after + 2 * INTERVAL``
  s, and on the others by the next wait (the commit's, or a restore's next arrival);
* every collective of a :class:`~shardsafe.dist.Comm` runs under the same guard, with a
  verdict key per collective that each rank's heartbeat relays (the coordinator looks at every
  rank, the others at the coordinator and their ring neighbours), so a rank frozen between an
  arrival and the collective after it is named on every rank within ``dead_after + 3`` s;
* silence is measured from when this process first saw the rank's counter at its present
  value, whichever wait looked: a rank named by one wait is named again by the next one at
  its first look, so the verdict does not take ``dead_after`` once more for each wait it
  passes through (a copy round, then the commit);
* a save's commit (:mod:`shardsafe.signals`) watches this heartbeat too; while its channel is
  open every rank beats every ``min(0.5, dead_after / 4)`` s (:meth:`Heartbeat.hasten`), and a
  verdict fills the key of each rank lost (``each``) rather than one wait's key;
* a process that finished and exited normally is awaited by nobody, hence never named.

Store load: one beat per process per :data:`INTERVAL` (1 s), whether or not anyone waits
(two while a save is open).
While a wait lasts, each waiting rank adds two requests per interval (a check of the wait's
key, a read of the coordinator's beat) and the coordinator two per rank that has not arrived
yet (a wait that every rank reaches within an interval costs nothing more); a long scan
beats in between, so the coordinator is never silent itself. Measured with
``benchmarks/bench_liveness.py`` (a TCPStore server in its own process, client processes
running this heartbeat and :meth:`~shardsafe.dist.Comm.arrive`'s wait; 2-core x86_64 VM,
load average 11 to 17): 64 ranks idle 64 requests/s and 0.23 % of a core on the server, every
rank waiting 191/s and 0.47 %; 128 ranks 128/s, 0.40 % and 375/s, 0.97 %. At 25 to 35 µs of
server CPU a request, 4,096 ranks would make 4,096 requests/s idle (about 12 % of a core)
and 12,300/s while all wait (about 35 %), a linear extrapolation: the 8,192 connections such
a server holds (two per process) were not measured, and the coordinator's scan of 4,095
absent ranks is 8,190 round trips from one thread (about 0.8 s at 100 µs each).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import describe_ranks

log = logging.getLogger("shardsafe")

INTERVAL = 1.0
"""Seconds between two beats of a process, and between two looks at the awaited ranks."""
DEAD_AFTER = 10.0
"""Seconds without a heartbeat after which an awaited rank counts as dead."""
MIN_DEAD_AFTER = 3 * INTERVAL
"""A shorter ``dead_after`` is raised to this: fewer missed beats would name a busy rank."""


def beat_key(global_rank: int) -> str:
    return f"shardsafe/alive/beat{global_rank}"


def host_key(global_rank: int) -> str:
    return f"shardsafe/alive/host{global_rank}"


@dataclass
class Watch:
    """One wait in progress: the key it blocks on (or, with ``done_key`` None, the callback
    ``notify`` that wakes it), and whom to look at while it lasts."""

    done_key: str | None
    arrived_key: Callable[[int], str]
    ranks: list[int]  # group ranks that may keep this wait from ending
    global_rank: Callable[[int], int]
    coordinator: bool  # look only at the absent ones among ``ranks`` (else at all of them)
    stage: str
    dead_after: float
    start_within: float
    arrived: set[int] = field(default_factory=set)  # an arrival key stays until the wait ends
    notify: Callable[[dict[str, Any]], None] | None = None
    verdict: dict[str, Any] | None = None
    each: bool = False  # hand ``notify`` a verdict on every rank lost, not only the first
    doing: str = ""  # "while <doing>" in the verdict, instead of "waited for it to reach"
    keys: Any = None  # the store client of ``done_key`` and arrival keys (else the beat's)
    log_every: float = 0.0  # log the ranks still awaited (alive) this often; 0: never
    last_log: float = field(default_factory=time.monotonic)
    named: set[int] = field(default_factory=set)
    relay: bool = False  # a verdict another rank wrote into ``done_key`` is handed to ``notify``


class Heartbeat:
    """This process's beat in one store, and the watcher of the waits registered with it."""

    def __init__(self, store: Any, global_rank: int) -> None:
        self._store = weakref.ref(store)
        try:
            self.client = store.clone()
        except Exception:  # a store that cannot be cloned (tests' HashStore) serves both threads
            self.client = store
        self.global_rank = global_rank
        self._watches: dict[int, Watch] = {}
        # global rank -> (its beat counter, when this process first saw that value): shared by
        # every wait, so a rank already silent when a wait starts (named by an earlier one a
        # moment ago) is not granted a fresh ``dead_after`` by each later wait
        self._observed: dict[int, tuple[int, float]] = {}
        self._rates: dict[int, float] = {}  # faster beats asked for while a commit waits
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self.client.set(host_key(global_rank), socket.gethostname())
        self._last_beat = 0.0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="shardsafe-alive", daemon=True)
        self._thread.start()

    def serves(self, store: Any) -> bool:
        return self._store() is store and self._thread.is_alive()

    def watch(self, w: Watch) -> int:
        with self._lock:
            self._watches[id(w)] = w
        return id(w)

    def unwatch(self, handle: int) -> None:
        with self._lock:
            self._watches.pop(handle, None)

    def look_now(self) -> None:
        """Beat and look at the watched ranks now rather than at the next interval (a wait
        that just learnt from elsewhere that a peer may be gone starts its clock at once)."""
        self._wake.set()

    def hasten(self, interval: float) -> int:
        """Beat and look every ``interval`` s (if shorter than :data:`INTERVAL`) until
        :meth:`relax`: a save's commit does, on every rank in it, for its tighter bound."""
        token = object()
        with self._lock:
            self._rates[id(token)] = interval
        self._wake.set()
        return id(token)

    def relax(self, handle: int) -> None:
        with self._lock:
            self._rates.pop(handle, None)

    def interval(self) -> float:
        with self._lock:
            return min([INTERVAL, *self._rates.values()])

    def host(self, global_rank: int) -> str:
        try:
            return bytes(self.client.get(host_key(global_rank))).decode()
        except Exception:
            return "an unknown host"

    def _beat(self) -> None:
        self.client.add(beat_key(self.global_rank), 1)
        self._last_beat = time.monotonic()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval())
            self._wake.clear()
            if self._store() is None:  # the process group was destroyed
                return
            try:
                self._beat()
                with self._lock:
                    watches = list(self._watches.values())
                for w in watches:
                    self._check(w)
            except Exception:  # the store is gone; a waiting rank's own call says so
                return

    def _check(self, w: Watch) -> None:
        """Write the verdict on the first awaited rank that stopped beating into ``w.done_key``
        (or hand it to ``w.notify``)."""
        keys = w.keys if w.keys is not None else self.client
        if w.verdict is not None and not w.each:
            return
        if w.done_key is not None and keys.check([w.done_key]):
            if w.relay and w.verdict is None:  # another rank named one of the group
                w.verdict = json.loads(bytes(keys.get(w.done_key)).decode())
                if w.notify is not None:
                    w.notify(w.verdict)
            return
        now = time.monotonic()
        if w.coordinator:
            w.arrived.update(
                r for r in w.ranks if r not in w.arrived and keys.check([w.arrived_key(r)])
            )
        pending = [r for r in w.ranks if r not in w.arrived and r not in w.named]
        if pending and w.log_every and now - w.last_log >= w.log_every:
            w.last_log = now
            log.warning(
                "rank %d: still waiting for %s %s (alive and heartbeating)",
                self.global_rank,
                describe_ranks(pending),
                w.doing or f"to reach '{w.stage}'",
            )
        for r in pending:
            if time.monotonic() - self._last_beat >= self.interval():  # a long scan: beat too
                self._beat()
            g = w.global_rank(r)
            beats = int(self.client.add(beat_key(g), 0))
            seen = self._observed.get(g)
            if seen is None or seen[0] != beats:
                self._observed[g] = (beats, now)
                continue
            if now - seen[1] <= (w.dead_after if beats else w.start_within):
                continue
            name = f"rank {r}" if g == r else f"rank {r} (global rank {g})"
            why = "never started heartbeating" if beats == 0 else "stopped heartbeating"
            doing = w.doing or f"the others waited for it to reach '{w.stage}'"
            verdict = {
                "rank": r,
                "message": f"{name} on {self.host(g)} {why} {now - seen[1]:.1f} s ago while "
                f"{doing} (its process died or is frozen, or its host was lost)",
            }
            w.verdict = verdict
            w.named.add(r)
            if w.done_key is not None:
                keys.compare_set(w.done_key, "", json.dumps(verdict))
            if w.notify is not None:
                w.notify(verdict)
            if not w.each:
                return


class Heartbeats:
    """The one heartbeat of this process, per store (the default process group's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Heartbeat | None = None

    def ensure(self, store: Any, global_rank: int) -> Heartbeat:
        with self._lock:
            if self._current is None or not self._current.serves(store):
                self._current = Heartbeat(store, global_rank)
            return self._current


HEARTBEATS = Heartbeats()
"""Process-wide on purpose: a heartbeat says a process is alive, whatever Savers it holds."""


def dead_after_of(dead_after: float) -> float:
    return max(dead_after, MIN_DEAD_AFTER)


def start_within_of(dead_after: float, timeout: float) -> float:
    """Slack for a rank that never beat (still importing): as :mod:`shardsafe.signals` gives."""
    return min(timeout, max(60.0, 6 * dead_after))
