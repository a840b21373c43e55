"""The commit protocol's messages, through the process group's key-value store.

Blocking and asynchronous saves commit the same way: each rank posts its write record under
a key unique to the save, the coordinator waits for all of them, commits, and posts the
outcome every rank waits for. No collective is involved, so a background commit never races
the training loop's collectives.

Failure bounds. From the moment it starts writing until it has the outcome, every rank
increments a heartbeat counter in the store every ``interval`` seconds from a thread. A
waiting rank blocks in the store's ``wait`` for at most ``interval`` at a time, then looks at
the heartbeats of those it still waits for:

* a rank whose counter has not moved for ``dead_after`` seconds (its process is gone, or
  frozen) fails the save, named with its host, on every rank (one that never beat in this
  save gets ``start_within`` seconds: it may still be on its way from planning);
* a rank that is slow but heartbeating is waited for, and the wait is logged every
  ``log_every`` seconds.

These beats belong to one save. Outside a save (between saves, before planning, in a load,
at the start of a restore, in the local tier's copy rounds) a process's own heartbeat
(:mod:`shardsafe.liveness`, the same ``dead_after``) is what the waits consult.

Why the commit keeps beats of its own rather than watching the process heartbeat: that one
beats and looks every :data:`shardsafe.liveness.INTERVAL` (1 s) and so names a dead rank
within ``dead_after`` + 2 s, with ``dead_after`` raised to at least 3 s; the commit beats and
looks every ``min(0.5, dead_after / 4)`` s, so a rank lost mid-save is named within
``dead_after`` + 0.5 s, for any ``dead_after`` (the bound README's failure table states). To
carry that bound, every process would have to beat every 0.5 s all the time, twice the
store's idle load (measured in ``benchmarks/bench_liveness.py``), or beat faster only while a
save is open (one heartbeat at two rates; not done). What the two share is the store,
the ``dead_after`` a Saver is given, the host key's role and the verdict's wording.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from .dist import Comm
from .errors import DistributedError, describe_ranks
from .liveness import DEAD_AFTER as DEAD_AFTER

log = logging.getLogger("shardsafe")

HEARTBEAT_INTERVAL = 0.5
"""Seconds between two heartbeats of a rank, and the longest single blocking wait."""


def default_store() -> Any:
    """The default process group's store (shared by every group created from it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as e:  # pragma: no cover - torch internals moved
        raise DistributedError(f"cannot reach the process group's store: {e}") from e


@dataclass
class StoreClients:
    """Two connections to the store: one for the blocking waits of the thread that commits,
    one for the heartbeat thread. A store client serialises its requests, so a thread blocked
    in ``wait`` would hold up a heartbeat on the same client. Made once per :class:`Saver`
    and reused by its saves (connecting anew for every save costs seconds at scale)."""

    wait: Any
    beat: Any
    blocking: bool


def connect(store: Any | None = None) -> StoreClients:
    """Fresh clients of the TCP store behind ``store`` (the default group's by default); for
    another kind of store, the store itself, waited on by polling."""
    shared = store if store is not None else default_store()
    tcp = shared
    while not isinstance(tcp, tdist.TCPStore):
        tcp = getattr(tcp, "underlying_store", None)
        if tcp is None:
            return StoreClients(shared, shared, False)

    def client() -> Any:
        return tdist.PrefixStore(
            "shardsafe",
            tdist.TCPStore(
                tcp.host,
                tcp.port,
                is_master=False,
                timeout=timedelta(seconds=60),
                wait_for_workers=False,
            ),
        )

    return StoreClients(client(), client(), True)


class StoreChannel:
    """Keys ``shardsafe/<token>/...`` in the store, for one save; heartbeats while open."""

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
        self.dead_after = dead_after
        self.interval = min(interval, dead_after / 4)
        self.log_every = log_every
        # a rank that never heartbeated in this save is late rather than dead: more slack
        self.start_within = start_within if start_within is not None else max(60.0, 6 * dead_after)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch: tuple[set[int], str, Any] | None = None
        self.store.set(self._key(f"host{comm.rank}"), socket.gethostname())
        self.store.add(self._key(f"beat{comm.rank}"), 1)
        self._thread = threading.Thread(target=self._run, name="shardsafe-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # -- the heartbeat thread: beat, and watch the ranks the main thread waits for ---------------
    def _run(self) -> None:
        beat = self._key(f"beat{self.comm.rank}")
        seen: dict[int, tuple[int, float]] = {}
        last_log = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.beat_store.add(beat, 1)
                with self._lock:
                    watch = self._watch
                if watch is not None:
                    last_log = self._check(watch, seen, last_log)
            except Exception:  # the store is gone; the main thread's wait says so
                return

    def _check(
        self, watch: tuple[set[int], str, Any], seen: dict[int, tuple[int, float]], last_log: float
    ) -> float:
        """Fill the awaited key of a rank that stopped heartbeating with an error (which
        wakes the blocked wait); log the ranks that are slow but alive."""
        ranks, what, key_of = watch
        now = time.monotonic()
        pending = [r for r in sorted(ranks) if not self.beat_store.check([key_of(r)])]
        for r in pending:
            beats = int(self.beat_store.add(self._key(f"beat{r}"), 0))
            if r not in seen or seen[r][0] != beats:
                seen[r] = (beats, now)
            elif now - seen[r][1] > (self.dead_after if beats else self.start_within):
                why = "never started heartbeating" if beats == 0 else "stopped heartbeating"
                message = (
                    f"rank {r} on {self.host(r)} {why} {now - seen[r][1]:.1f} s ago while "
                    f"{what} (its process died or is frozen)"
                )
                dead = {"dead": message}
                self.beat_store.compare_set(key_of(r), "", json.dumps(dead))
        if pending and now - last_log >= self.log_every:
            log.warning(
                "rank %d: still waiting for %s %s (alive and heartbeating)",
                self.comm.rank,
                describe_ranks(pending),
                what,
            )
            return now
        return last_log

    # -- posting and waiting ----------------------------------------------------------------
    def post(self, record: dict[str, Any]) -> None:
        self.store.set(self._key(f"rank{self.comm.rank}"), json.dumps(record))

    def host(self, rank: int) -> str:
        try:
            return bytes(self.beat_store.get(self._key(f"host{rank}"))).decode()
        except Exception:
            return "unknown host"

    def _wait(self, ranks: set[int], what: str, key_of: Any, waiting_for: str) -> dict[int, Any]:
        """Block until ``key_of(r)`` exists for every rank in ``ranks`` (a dead rank's key is
        filled by the heartbeat thread); returns what each key holds."""
        with self._lock:
            self._watch = (ranks, what, key_of)
        try:
            keys = [key_of(r) for r in sorted(ranks)]
            if self.blocking:
                self.store.wait(keys, timedelta(days=365))
            else:
                while not all(self.store.check([k]) for k in keys):
                    time.sleep(self.interval / 5)
            return {r: json.loads(self.store.get(key_of(r))) for r in sorted(ranks)}
        except Exception as e:
            raise _store_lost(self.comm.rank, waiting_for, e) from None
        finally:
            with self._lock:
                self._watch = None

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
        self.store.set(self._key("status"), json.dumps(status))

    def await_status(self) -> dict[str, Any]:
        """The coordinator's outcome; raises naming it if it stops heartbeating first."""
        status = self._wait(
            {0}, "committing", lambda r: self._key("status"), "the coordinator's commit outcome"
        )[0]
        if "dead" in status:
            raise DistributedError(
                f"rank {self.comm.rank}: no commit outcome from the coordinator: {status['dead']}"
            )
        return dict(status)

    def cleanup(self) -> None:
        """Stop heartbeating; the last rank to read the outcome deletes the save's keys."""
        self.stop()
        try:
            if int(self.store.add(self._key("acks"), 1)) == self.comm.world_size:
                names = [
                    f"{kind}{r}"
                    for r in range(self.comm.world_size)
                    for kind in ("rank", "beat", "host")
                ]
                for name in [*names, "status", "acks"]:
                    self.store.delete_key(self._key(name))
        except Exception:
            pass  # stores without delete keep a few bytes; harmless


def _store_lost(rank: int, what: str, e: Exception) -> DistributedError:
    return DistributedError(
        f"rank {rank}: lost the process group's store while waiting for {what} "
        f"({type(e).__name__}: {e}); the process hosting it (rank 0 with a tcp:// or env:// "
        "rendezvous, or the launcher) probably died"
    )
