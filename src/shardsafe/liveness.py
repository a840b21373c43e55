"""Per-process heartbeats in the process group's store: how a wait tells a dead rank from a slow one.

Protocol. From the first time a process takes part in a distributed checkpoint operation
(:func:`shardsafe.dist.get_comm` or :meth:`~shardsafe.dist.Comm.arrive` with an initialised
process group) until it exits or the store goes away, a daemon thread with its own client of
the store (``store.clone()``: a client blocked in ``wait`` would hold up a beat) has written
its host name to ``shardsafe/alive/host<global rank>`` once and increments
``shardsafe/alive/beat<global rank>`` every :data:`INTERVAL` seconds. The heartbeat belongs to
the process, not to a Saver, manager or load: a rank between two saves, or one that dropped its
Saver and will make another later, is alive and beating.

Every beat also reads, in one ``multi_get``, the counters of the ranks this process watches,
whether or not it waits: the coordinator (global rank 0) every rank, the others rank 0 and
their two ring neighbours, and every rank a wait of this process has looked at. Each rank's
counter is kept with when this process first saw its present value, so a rank's silence is
counted from when it stopped beating (within an interval), not from when a wait first looks.
A stall of this process's own looks is no one's death: when its own beat took longer than an
interval, or its loop ran late (a store that held every request for seconds, as a TCP store
may while ranks open new connections to it; a thread that did not get the interpreter), it
names nobody for :data:`STALL_GRACE` s, the time the others' held-up beats need to land; a
rank silent since before the stall is named right after that.

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
  its last beat, or at the next beat after the coordinator (for a dead coordinator: each
  rank) reaches the wait if that is later: a survivor busy with its own share (staging,
  writing) when a peer dies names it as soon as it waits, if the peer has been silent for
  ``dead_after`` by then (a rank this process never watched before, such as a copy round's
  peer on another host, is counted from the wait's first look, as before);
* a rank that is slow but beating is waited for until the wait's own ``timeout``;
* a rank that froze or died inside its own arrival, after posting it but before counting
  itself (or setting the key as the last one), would hold every rank: the coordinator's
  heartbeat, seeing every arrival posted, sets the key itself, and the next wait names it;
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
  value, whichever beat or wait looked: a rank named by one wait is named again by the next
  one at its first look, so the verdict does not take ``dead_after`` once more for each wait
  it passes through (a copy round, then the commit);
* the store itself: a request to a frozen store server (SIGSTOP of the process hosting it,
  rank 0 with a ``tcp://`` rendezvous) never returns, whatever the client's timeout (that
  covers waits only), so every blocking store call of a wait runs in a thread of its own
  (:meth:`Heartbeat.call`) and the waiting thread raises, on every rank, a
  :class:`~shardsafe.errors.DistributedError` naming the store's ``host:port`` and who hosts
  it once a request of this heartbeat has been unanswered for ``max(dead_after,``
  :data:`STORE_DEAD_AFTER` ``)`` s (within that + ``INTERVAL + 2 * POLL`` s of the freeze:
  a live store may hold requests for seconds), or at once when the store's connection
  failed (the process hosting it died or exited); the abandoned thread stays blocked. The
  training's own store connection keeps its timeout;
* a save's commit (:mod:`shardsafe.signals`) watches this heartbeat too; while its channel is
  open every rank beats every ``min(0.5, dead_after / 4)`` s (:meth:`Heartbeat.hasten`), and a
  verdict fills the key of each rank lost (``each``) rather than one wait's key;
* a process that finished and exited normally is awaited by nobody, hence never named;
* a process that exits through the interpreter's exit (an uncaught exception, ``sys.exit``;
  under ``torchrun``, ``mp.spawn``, ``srun``: not a forked child's ``os._exit``, nor a
  SIGKILL) or whose process group is destroyed first adds :data:`EXITED` to its counter as
  its heartbeat's last request. A watcher that saw the counter below it and now sees it at or
  above names the rank at its next look, without ``dead_after``, in the waits that can tell a
  rank that did its part from one that did not: an arrival (the rank has not arrived) and a
  save's commit (its record, or the coordinator's outcome, is not in). An exchange or a
  collective does not (a peer may finish its part and exit before this rank returns) unless
  it failed: gloo saw the peer's connection close. A counter already marked at a watcher's
  first look is an earlier process's (another attempt on a store that outlived it), and the
  rank's next process takes the mark off as it starts;
* the verdict board: whoever names a rank first by its own look also posts the verdict (the
  rank's global number, its counter when named, the message) as ``shardsafe/verdicts/<n>``
  and counts it in ``shardsafe/verdicts/count``, which every beat reads in the same
  ``multi_get`` as the counters. Every heartbeat then ends each of its waits whose group
  holds that rank with the verdict (its key, or its callback; a commit's wait only if it
  awaits that rank, as its outcome is the coordinator's to decide), as long as the rank's
  counter has not moved since (a frozen rank that was continued is not dead). So a rank that had left the wait the verdict was given in (its part
  of a gather did not need the dead rank) and now waits on a coordinator that raised and
  exits names the dead rank one beat after the first verdict (within ``dead_after + 3 *
  INTERVAL`` s of its last beat), not the coordinator ``dead_after`` s after that; a wait
  that starts later ends at its first look. Verdicts posted before this process's heartbeat
  started (another attempt of a job on a store that outlived it) are not read.

Store load: per process and :data:`INTERVAL` (1 s), one beat and one ``multi_get`` of the
counters it watches and the board's count, whether or not anyone waits (twice that while a
save is open); two requests more per verdict posted, and two per reader to read it.
While a wait lasts, each waiting rank adds one request per interval (a check of the wait's
key) and the coordinator one per rank that has not arrived yet (its arrival key; a wait
that every rank reaches within an interval costs nothing more); a long scan beats in
between, so the coordinator is never silent itself. Measured with
``benchmarks/bench_liveness.py`` (a TCPStore server in its own process, client processes
running this heartbeat, the board's count included, and :meth:`~shardsafe.dist.Comm.arrive`'s
wait; 2-core x86_64 VM, otherwise idle): 64 ranks idle 128 requests/s and 0.45 % of a core
on the server, every rank waiting 192/s and 0.50 %; 128 ranks 256/s, 0.85 % and 384/s,
1.05 %. The same rates as before the board (its count rides in the beat's ``multi_get``).
Reading the counters every beat doubled the idle requests and tripled the server's idle CPU
(the earlier protocol, one beat a second and reads only while waiting: 63/s at 64 ranks).
At 25 to 35 µs of server CPU a request here (40 to 60 µs in an earlier run under a load
average of 6 to 10), 4,096 ranks would make 8,192 requests/s idle (about 23 % of a core, 40 %
at the loaded figure) and 12,300/s while all wait (about 35 %, 60 %), a linear extrapolation:
the 8,192 connections such a server holds (two per process) were not measured, and the
coordinator's scan of 4,095 absent ranks is 4,095 round trips from one
thread (about 0.4 s at 100 µs each).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .errors import DistributedError, describe_ranks

T = TypeVar("T")

log = logging.getLogger("shardsafe")

INTERVAL = 1.0
"""Seconds between two beats of a process, and between two looks at the awaited ranks."""
DEAD_AFTER = 10.0
"""Seconds without a heartbeat after which an awaited rank counts as dead."""
MIN_DEAD_AFTER = 3 * INTERVAL
"""A shorter ``dead_after`` is raised to this: fewer missed beats would name a busy rank."""
SLOW_CONNECT = 1.0
"""Seconds after which opening a store connection (a millisecond, usually) is worth a warning."""
POLL = 0.25
"""Seconds between two looks of a waiting thread at whether the store still answers."""
STALL_GRACE = 2 * INTERVAL
"""After this process could not look for a while (a beat of its own that took more than an
interval, a loop that ran late), how long it names nobody: beats the stall held up land."""
STALL_GAP = 2 * INTERVAL
"""Two looks this far apart are a stall of this process's looks (it missed at least one): a
beat first seen after it counts from the look before, under :data:`STALL_GRACE`. Beats seen
after a shorter gap count from when they were seen, at most this late (the looks ran up to
3 s apart at times on a loaded two-core machine, under the earlier 3 s threshold, and a death
during such a gap was named 3 s late)."""
EXITED = 1 << 40
"""Added to a process's beat counter when it exits through the interpreter's exit (an
uncaught exception included; not a SIGKILL, nor a forked child's ``os._exit``): a watcher that
saw the counter below this and now sees it at or above knows the process ended, and a wait
that can tell its ranks' arrivals (:attr:`Watch.exits`) names it at its next look instead of
``dead_after`` later. A new process of the same rank takes it off again as it starts."""
STORE_DEAD_AFTER = 10.0
"""A store request unanswered this long (or ``dead_after``, if longer) counts as a frozen
store. More than a rank's ``dead_after`` floor: a store that is alive may hold every request
for seconds (measured here: 4 to 5 s, every rank at once, while ranks open new connections to
it), and naming it frozen ends the job on every rank."""


def beat_key(global_rank: int) -> str:
    return f"shardsafe/alive/beat{global_rank}"


def host_key(global_rank: int) -> str:
    return f"shardsafe/alive/host{global_rank}"


BOARD_COUNT = "shardsafe/verdicts/count"
"""How many verdicts the board holds: read in every beat's ``multi_get``."""


def board_key(n: int) -> str:
    """The board's ``n``-th verdict (from 1): ``{"global", "beats", "message", "by"}``."""
    return f"shardsafe/verdicts/{n}"


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
    members: list[int] | None = None  # the group's global ranks (by group rank): takes the board's
    boarded: set[int] = field(default_factory=set)  # global ranks the board's verdicts named
    # an awaited rank whose process exited is named at once: only where a rank still in
    # ``ranks`` (not arrived) cannot have done its part (an arrival, a commit's records; not
    # a collective or an exchange, which a peer may finish and leave before this one returns)
    exits: bool = False


class Heartbeat:
    """This process's beat in one store, the watcher of the waits registered with it, and the
    judge of whether the store itself still answers."""

    def __init__(self, store: Any, global_rank: int, world_size: int = 1) -> None:
        self._store = weakref.ref(store)
        self.address = store_address(store)
        try:
            self.client = open_connection(store.clone, self.address)
        except Exception:  # a store that cannot be cloned (tests' HashStore) serves both threads
            self.client = store
        self.global_rank = global_rank
        self._watches: dict[int, Watch] = {}
        # global rank -> (its beat counter, when this process first saw that value): shared by
        # every wait, so a rank already silent when a wait starts (named by an earlier one a
        # moment ago) is not granted a fresh ``dead_after`` by each later wait
        self._observed: dict[int, tuple[int, float]] = {}
        # the ranks whose counters every beat reads (one request), wait or no wait, so that a
        # rank's silence is measured from when it stopped, not from a wait's first look: the
        # coordinator (global rank 0) all, the others rank 0 and their ring neighbours, and
        # every rank a wait of this process has looked at
        if global_rank == 0:
            self._standing = set(range(1, world_size))
        else:
            near = {0, (global_rank - 1) % world_size, (global_rank + 1) % world_size}
            self._standing = near - {global_rank}
        self._latest: dict[int, tuple[int, float]] = {}  # rank -> (counter, when read): this beat's
        # global ranks seen beating and then exiting (counter crossed EXITED while watched): a
        # counter at or above it at the first look is an earlier process's, not news
        self._exited: set[int] = set()
        self._counted: set[int] = set()  # ranks whose counter key exists (a read cannot block)
        self._multi = True  # the store answers ``multi_get`` (else one read per rank)
        self._host0: str | None = socket.gethostname() if global_rank == 0 else None
        self._rates: dict[int, float] = {}  # faster beats asked for while a commit waits
        self._discarded: list[str] = []  # keys to delete at the next beat (see discard)
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        # when this process's request to the store in flight was sent (None: none in flight),
        # and how the store failed for good: what tells a frozen or lost store from a slow rank
        self._pending_since: float | None = None
        self._pending_what = ""
        self._store_failed: tuple[float, str] | None = None
        # when this process last came out of a stall of its own looks (a beat that took more
        # than an interval, or a loop that ran late): silence before it is not counted
        self._stalled_until = 0.0
        self._grace_until = 0.0  # no verdict before this (monotonic): see _sample
        self._last_sample = time.monotonic()
        self.client.set(host_key(global_rank), socket.gethostname())
        # an earlier process of this rank that exited (another attempt on a store that outlived
        # it) left EXITED on the counter: this one is not exited
        mine = int(self.client.add(beat_key(global_rank), 0))
        if mine >= EXITED:
            self.client.add(beat_key(global_rank), -(mine - mine % EXITED))
        # the verdict board: verdicts posted before this process beat are another attempt's
        # (a restarted job on a store that outlived it), not this one's
        self._board: list[dict[str, Any]] = []
        self._board_read = int(self.client.add(BOARD_COUNT, 0))
        self._last_beat = 0.0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="shardsafe-alive", daemon=True)
        self._thread.start()

    def serves(self, store: Any) -> bool:
        """Still this store's heartbeat (one that lost its store stays, to say so at once)."""
        alive = self._thread.is_alive() or self._store_failed is not None
        return self._store() is store and alive

    def watch(self, w: Watch) -> int:
        """Look at ``w``'s ranks from the next beat on (at once if one is silent already)."""
        ranks = {w.global_rank(r) for r in w.ranks} - {self.global_rank}
        now = time.monotonic()
        with self._lock:
            self._watches[id(w)] = w
            self._standing |= ranks
            silent = any(
                now - self._observed[g][1] > w.dead_after
                for g in ranks
                if g in self._observed and self._observed[g][0]
            )
        if silent or self._board:
            self._wake.set()
        return id(w)

    def unwatch(self, handle: int) -> None:
        with self._lock:
            self._watches.pop(handle, None)

    def discard(self, keys: list[str]) -> None:
        """Delete ``keys`` from the store at the next beat, off the caller's path: a finished
        wait's keys, which nothing reads any more (each request is a round trip that a save
        would otherwise block for)."""
        with self._lock:
            self._discarded.extend(keys)

    def _delete_discarded(self) -> None:
        with self._lock:
            keys, self._discarded = self._discarded, []
        client = _Timed(self.client, self)
        for key in keys:
            with contextlib.suppress(Exception):  # gone already, or the store is: nothing to keep
                client.delete_key(key)

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

    def store_lost(self, dead_after: float) -> str | None:
        """Why the store counts as lost for a wait that allows ``dead_after`` s of silence (a
        request of this heartbeat unanswered that long, at least :data:`STORE_DEAD_AFTER`, or
        the store's connection failed), or None. Not a verdict for good: a store that answers
        again is no longer lost."""
        failed = self._store_failed
        if failed is not None:
            return (
                f"the process group's store at {self.address} failed {time.monotonic() - failed[0]:.1f}"
                f" s ago ({failed[1]}): {self._store_host()} died, exited or lost its host"
            )
        since = self._pending_since
        if since is not None and time.monotonic() - since > max(dead_after, STORE_DEAD_AFTER):
            time.sleep(POLL)  # a heartbeat thread that only waited for the GIL has its answer now
            if self._pending_since != since:
                return None
            return (
                f"the process group's store at {self.address} stopped answering "
                f"{time.monotonic() - since:.1f} s ago ({self._pending_what}): {self._store_host()} is frozen "
                "(SIGSTOP, a debugger), overloaded or cut off"
            )
        return None

    def _store_host(self) -> str:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return "the process hosting it (torchrun's agent)"
        host0 = self._host0 or "its host"
        return (
            f"the process hosting it (rank 0, on {host0}, with a tcp:// or env:// rendezvous; "
            "else the launcher that made it)"
        )

    def lost_error(self, rank: int, what: str, dead_after: float) -> DistributedError | None:
        """The error a rank raises while ``what`` when the store counts as lost, or None."""
        why = self.store_lost(dead_after)
        if why is None:
            return None
        return DistributedError(
            f"rank {rank}: {why}, while {what}. No rank can go on: restart the job on every "
            "rank (a process group does not outlive its store), and end the process hosting "
            "the store if it is still there"
        )

    def call(self, fn: Callable[[], T], rank: int, what: str, dead_after: float) -> T:
        """``fn()``, a blocking request (or wait) to the store, run in a thread of its own so
        that this one can raise :meth:`lost_error` when the store stops answering: a store
        client's request to a frozen server never returns (its timeout covers only waits)."""
        err = self.lost_error(rank, what, dead_after)
        if err is not None:
            raise err
        done, box = in_thread(fn, "shardsafe-store")
        while not done.wait(POLL):
            err = self.lost_error(rank, what, dead_after)
            if err is not None:  # the thread stays blocked until the store answers, or forever
                raise err
        if "error" in box:
            raise box["error"]
        return cast(T, box["result"])

    def host(self, global_rank: int) -> str:
        try:
            client = _Timed(self.client, self)
            if not client.check([host_key(global_rank)]):  # never started: a get would wait
                return "an unknown host"
            return bytes(client.get(host_key(global_rank))).decode()
        except Exception:
            return "an unknown host"

    def _beat(self) -> None:
        t0 = time.monotonic()
        _Timed(self.client, self).add(beat_key(self.global_rank), 1)
        self._last_beat = time.monotonic()
        if self._last_beat - t0 > INTERVAL:  # the store, or this process, stalled meanwhile
            self._stalled_until = self._last_beat

    def stop(self, timeout: float) -> None:
        """End the heartbeat thread (at the interpreter's exit), waiting up to ``timeout`` s
        for its store requests in flight: its last one marks this process exited."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _mark_exited(self) -> None:
        """Add :data:`EXITED` to this process's counter: it takes no part in the job any more
        (the interpreter exits, or the process group was destroyed)."""
        try:
            _Timed(self.client, self).add(beat_key(self.global_rank), EXITED)
        except Exception as e:  # the store went first: the others name the silence instead
            log.debug("rank %d: could not mark the exit: %r", self.global_rank, e)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval())
            self._wake.clear()
            if self._stopping or self._store() is None:  # exiting, or the group was destroyed
                self._mark_exited()
                return
            try:
                self._beat()
                self._sample()
                with self._lock:
                    watches = list(self._watches.values())
                for w in watches:
                    self._apply_board(w)
                    self._check(w)
                self._delete_discarded()
            except Exception as e:  # the store is gone: every wait raises, naming it
                self._store_failed = (time.monotonic(), f"{type(e).__name__}: {e}"[:200])
                log.warning(
                    "rank %d: the heartbeat stopped: the store failed: %r", self.global_rank, e
                )
                return

    def _sample(self) -> None:
        """Read the counters of the standing ranks (one ``multi_get``) and note when each
        changed: the silence clock of a rank starts when it stops, whatever this process was
        doing then (writing its share, staging), not when a wait first looks at it."""
        with self._lock:
            ranks = sorted(self._standing)
        if not ranks:
            return
        client = _Timed(self.client, self)
        for g in ranks:
            if g not in self._counted:  # a counter that does not exist yet would make a read wait
                client.add(beat_key(g), 0)
                self._counted.add(g)
        values: list[int] = []
        keys = [*(beat_key(g) for g in ranks), BOARD_COUNT]
        if self._multi:
            try:
                values = [int(bytes(v).decode()) for v in client.multi_get(keys)]
            except (NotImplementedError, AttributeError, RuntimeError):  # a store without it
                self._multi = False  # (a lost store fails the reads below too, and says so)
        if not self._multi:
            values = [int(client.add(k, 0)) for k in keys]
        posted = values.pop()
        now = time.monotonic()
        previous = self._last_sample
        # this process could not look for a while (its own beat or loop stalled: a store that
        # held every request, a thread that did not get the interpreter): the others' beats may
        # have been held just the same, so nobody is named until they have had time to land
        if now - previous > STALL_GAP:
            self._stalled_until = now
        self._last_sample = now
        stalled = self._stalled_until >= now - self.interval()
        if stalled:
            self._grace_until = now + STALL_GRACE
        for g, beats in zip(ranks, values, strict=True):
            self._latest[g] = (beats, now)
            seen = self._observed.get(g)
            self._note_exit(g, beats, seen)
            if beats and (seen is None or seen[0] != beats):
                # a beat seen after a stall came at some moment of it: counted from the look
                # before, so that a rank that died during the stall is named once the grace
                # is over, not dead_after after it (a live rank beats again within the grace)
                self._observed[g] = (beats, previous if stalled and seen is not None else now)
        if self._host0 is None and self._latest.get(0, (0, now))[0]:  # named if the store stops
            self._host0 = self.host(0)
        if posted > self._board_read:
            self._read_board(client, posted)

    def _read_board(self, client: Any, posted: int) -> None:
        """Read the verdicts posted since the last look, and the counter of each rank they
        name (from now on with every beat): a verdict holds while that counter stays put."""
        for n in range(self._board_read + 1, posted + 1):
            if not client.check([board_key(n)]):  # counted, not written yet: at the next beat
                return
            verdict = json.loads(bytes(client.get(board_key(n))).decode())
            g = int(verdict["global"])
            if g != self.global_rank:
                with self._lock:
                    self._standing.add(g)
                if g not in self._latest:
                    self._latest[g] = (int(client.add(beat_key(g), 0)), time.monotonic())
                    self._counted.add(g)
                self._board.append(verdict)
            self._board_read = n

    def _post(self, g: int, beats: int, message: str) -> None:
        """Put this process's verdict on global rank ``g`` on the board, for every wait of
        every rank: one that has left the wait it was named in (its part of a gather did not
        need ``g``) and now waits on a coordinator that raised and exits learns it at its next
        beat, instead of naming that coordinator ``dead_after`` later."""
        client = _Timed(self.client, self)
        n = int(client.add(BOARD_COUNT, 1))
        record = {"global": g, "beats": beats, "message": message, "by": self.global_rank}
        client.set(board_key(n), json.dumps(record))

    def _apply_board(self, w: Watch) -> None:
        """End ``w`` with a verdict on the board on a rank of its group whose counter has not
        moved since it was named (one that beat again was frozen and is back: not dead)."""
        if w.members is None or not self._board or (w.verdict is not None and not w.each):
            return
        for posted in self._board:
            g = int(posted["global"])
            if g in w.boarded or g not in w.members:
                continue
            if self._latest.get(g, (None, 0.0))[0] != int(posted["beats"]):
                continue
            r = w.members.index(g)
            if w.each and r not in w.ranks:
                # a commit's wait: its outcome is the coordinator's to decide (a rank lost
                # after posting its record does not fail the save), so only an awaited rank's
                # key takes the verdict; a verdict on another rank would make this rank abort
                # a save the coordinator commits
                continue
            verdict = {"rank": r, "message": f"{posted['message']} (named by rank {posted['by']})"}
            w.boarded.add(g)
            w.named.add(r)
            if not w.each:
                w.verdict = verdict
            self._deliver(w, verdict)
            if not w.each:
                return

    def _deliver(self, w: Watch, verdict: dict[str, Any]) -> None:
        """End ``w``'s wait with ``verdict``: into its key (the first verdict wins for every
        rank blocked on it), and to its callback (which may write to the store: timed as a
        request)."""
        if w.done_key is not None:
            keys = _Timed(w.keys if w.keys is not None else self.client, self)
            keys.compare_set(w.done_key, "", json.dumps(verdict))
        if w.notify is not None:
            self._pending_since = time.monotonic()
            try:
                w.notify(verdict)
            finally:
                self._pending_since = None

    def _check(self, w: Watch) -> None:
        """Write the verdict on the first awaited rank that stopped beating into ``w.done_key``
        (or hand it to ``w.notify``)."""
        keys = _Timed(w.keys if w.keys is not None else self.client, self)
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
            if w.done_key is not None and len(w.arrived) == len(w.ranks):
                # every rank arrived, but the last one froze or died before it counted itself
                # or set the key: the wait is over all the same (the next one names that rank)
                keys.compare_set(w.done_key, "", "1")
                return
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
            if g in self._latest:  # this beat's sample (when it was read, not now: conservative)
                beats, now = self._latest[g]
            else:  # a rank this wait is the first to look at (its counter: in the beat's store)
                beats = int(_Timed(self.client, self).add(beat_key(g), 0))
                now = time.monotonic()
                self._counted.add(g)
            seen = self._observed.get(g)
            self._note_exit(g, beats, seen)
            name = f"rank {r}" if g == r else f"rank {r} (global rank {g})"
            doing = w.doing or f"the others waited for it to reach '{w.stage}'"
            if w.exits and g in self._exited:
                self._name(
                    w,
                    r,
                    g,
                    beats,
                    f"{name} on {self.host(g)} exited (its process ended, by an exception or "
                    f"a normal exit, without taking its part) while {doing}",
                )
                if not w.each:
                    return
                continue
            if seen is None or seen[0] != beats:
                self._observed[g] = (beats, now)
                continue
            if now - seen[1] <= (w.dead_after if beats else w.start_within):
                continue
            if time.monotonic() < self._grace_until:  # just out of a stall of its own
                continue
            why = "never started heartbeating" if beats == 0 else "stopped heartbeating"
            message = (
                f"{name} on {self.host(g)} {why} {now - seen[1]:.1f} s ago while "
                f"{doing} (its process died or is frozen, or its host was lost)"
            )
            self._name(w, r, g, beats, message)
            if not w.each:
                return

    def _name(self, w: Watch, r: int, g: int, beats: int, message: str) -> None:
        """End ``w`` with the verdict on its rank ``r`` (global ``g``, counter ``beats``), and
        post it on the board for the waits of other ranks."""
        verdict = {"rank": r, "message": message}
        w.verdict = verdict
        w.named.add(r)
        self._deliver(w, verdict)
        if w.members is not None and g not in w.boarded:  # for the waits this one is not
            w.boarded.add(g)
            self._post(g, beats, message)

    def _note_exit(self, g: int, beats: int, seen: tuple[int, float] | None) -> None:
        """Keep :attr:`_exited` true: a counter seen below :data:`EXITED` and now at or above
        it is a process that exited; one below it again is a new process of that rank."""
        if beats < EXITED:
            self._exited.discard(g)
        elif seen is not None and seen[0] < EXITED:
            self._exited.add(g)


def open_connection(open_: Callable[[], T], address: str, warn_after: float = SLOW_CONNECT) -> T:
    """``open_()``, a new client of the store at ``address``, with a warning naming the likely
    cause when it took longer than ``warn_after`` s: torch's TCPStore client asks for the name
    of the address it connected to (``getnameinfo``, in IPv4-mapped form) on every connection,
    so a resolver that is slow to answer (or drops a query: 5 s) stalls each one, and the
    thread opening it holds the interpreter meanwhile."""
    t0 = time.monotonic()
    client = open_()
    took = time.monotonic() - t0
    if took > warn_after:
        log.warning(
            "opening a connection to the process group's store at %s took %.1f s (a millisecond "
            "is usual, and training stalls meanwhile): torch's TCPStore client looks up the name "
            "of the address it connects to, in IPv4-mapped form (::ffff:a.b.c.d), on every "
            "connection, and this host's resolver answered slowly. Put the store's address in "
            "that form in /etc/hosts (e.g. '::ffff:127.0.0.1 localhost') or make the resolver "
            "answer at once",
            address,
            took,
        )
    return client


def in_thread(fn: Callable[[], Any], name: str) -> tuple[threading.Event, dict[str, Any]]:
    """Start ``fn()`` in a daemon thread: (set when it ended, ``{"result"|"error": ...}``). For
    a call this thread must be able to give up on (a frozen store, a gloo wait that cannot be
    interrupted): the abandoned thread stays blocked."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done, box


class _Timed:
    """A store client whose request in flight shows in its heartbeat's ``_pending_since``: a
    request that a frozen store server never answers is how a wait learns it is frozen."""

    def __init__(self, client: Any, beat: Heartbeat) -> None:
        self._client, self._beat = client, beat

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._beat._pending_since = time.monotonic()
            self._beat._pending_what = f"{name}{args!r}"[:120]
            try:
                return fn(*args, **kwargs)
            finally:
                self._beat._pending_since = None

        return call


def store_address(store: Any) -> str:
    """``host:port`` of the TCP store behind ``store`` (through its prefix wrappers)."""
    tcp = store
    while tcp is not None and not (hasattr(tcp, "host") and hasattr(tcp, "port")):
        tcp = getattr(tcp, "underlying_store", None)
    return f"{tcp.host}:{tcp.port}" if tcp is not None else f"({type(store).__name__})"


class Heartbeats:
    """The one heartbeat of this process, per store (the default process group's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Heartbeat | None = None
        self._at_exit = False

    def ensure(self, store: Any, global_rank: int, world_size: int = 1) -> Heartbeat:
        with self._lock:
            if self._current is None or not self._current.serves(store):
                if self._current is not None:
                    # the earlier group's heartbeat marks its exit now, not up to an interval
                    # later on top of a new process group's counter in the same store
                    self._current.stop(timeout=2.0)
                self._current = Heartbeat(store, global_rank, world_size)
            if not self._at_exit:
                # a script that ends without destroying its process group may otherwise exit
                # with this thread inside a store request while the store's C++ objects are torn
                # down (the README example once ended "terminate called without an active
                # exception", exit code -6, its work done; the cause is not proven)
                atexit.register(self.stop)
                self._at_exit = True
            return self._current

    def stop(self) -> None:
        """Stop this process's heartbeat (registered to run at the interpreter's exit)."""
        with self._lock:
            current = self._current
        if current is not None:
            current.stop(timeout=2.0)


HEARTBEATS = Heartbeats()
"""Process-wide on purpose: a heartbeat says a process is alive, whatever Savers it holds."""


def dead_after_of(dead_after: float) -> float:
    return max(dead_after, MIN_DEAD_AFTER)


def start_within_of(dead_after: float, timeout: float) -> float:
    """Slack for a rank that never beat (still importing): as :mod:`shardsafe.signals` gives."""
    return min(timeout, max(60.0, 6 * dead_after))
