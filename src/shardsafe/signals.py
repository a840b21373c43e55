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
  frozen) fails the save, named with its host, on every rank;
* a rank that is slow but heartbeating is waited for, and the wait is logged every
  ``log_every`` seconds.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from .dist import Comm
from .errors import DistributedError, describe_ranks

log = logging.getLogger("shardsafe")

HEARTBEAT_INTERVAL = 0.5
"""Seconds between two heartbeats of a rank, and the longest single blocking wait."""
DEAD_AFTER = 10.0
"""Seconds without a heartbeat after which a rank counts as dead."""


def default_store() -> Any:
    """The default process group's store (shared by every group created from it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as e:  # pragma: no cover - torch internals moved
        raise DistributedError(f"cannot reach the process group's store: {e}") from e


class StoreChannel:
    """Keys ``shardsafe/<token>/...`` in the store, for one save; heartbeats while open."""

    def __init__(
        self,
        comm: Comm,
        token: str,
        store: Any | None = None,
        *,
        dead_after: float = DEAD_AFTER,
        interval: float = HEARTBEAT_INTERVAL,
        log_every: float = 30.0,
    ) -> None:
        self.comm = comm
        self.prefix = f"shardsafe/{token}"
        self.store = store if store is not None else default_store()
        self.dead_after = dead_after
        self.interval = min(interval, dead_after / 4)
        self.log_every = log_every
        self._stop = threading.Event()
        self.store.set(self._key(f"host{comm.rank}"), socket.gethostname())
        self.store.add(self._key(f"beat{comm.rank}"), 1)
        self._beater = threading.Thread(target=self._beat, name="shardsafe-heartbeat", daemon=True)
        self._beater.start()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _beat(self) -> None:
        key = self._key(f"beat{self.comm.rank}")
        while not self._stop.wait(self.interval):
            try:
                self.store.add(key, 1)
            except Exception:  # the store is gone; the waits will say so
                return

    def stop(self) -> None:
        self._stop.set()

    # -- posting and waiting ----------------------------------------------------------------
    def post(self, record: dict[str, Any]) -> None:
        self.store.set(self._key(f"rank{self.comm.rank}"), json.dumps(record))

    def host(self, rank: int) -> str:
        try:
            return bytes(self.store.get(self._key(f"host{rank}"))).decode()
        except Exception:
            return "unknown host"

    def _wait(self, ranks: set[int], what: str, key_of: Any) -> dict[int, str]:
        """Block until ``key_of(r)`` exists for every rank in ``ranks``, or a rank among the
        missing stops heartbeating: returns {dead rank: why}."""
        pending = set(ranks)
        seen: dict[int, tuple[int, float]] = {}
        start = last_log = time.monotonic()
        while pending:
            keys = [key_of(r) for r in sorted(pending)]
            try:
                self.store.wait(keys, timedelta(seconds=self.interval))
                return {}
            except Exception as e:
                if not _is_timeout(e):
                    raise _store_lost(self.comm.rank, what, e) from None
            now = time.monotonic()
            pending = {r for r in pending if not self.store.check([key_of(r)])}
            dead = {}
            for r in pending:
                beats = int(self.store.add(self._key(f"beat{r}"), 0))
                if r not in seen or seen[r][0] != beats:
                    seen[r] = (beats, now)
                elif now - seen[r][1] > self.dead_after:
                    why = "never started" if beats == 0 else "stopped heartbeating"
                    dead[r] = (
                        f"rank {r} on {self.host(r)} {why} {now - seen[r][1]:.1f} s ago while "
                        f"{what} (its process died or is frozen)"
                    )
            if dead:
                return dead
            if pending and now - last_log >= self.log_every:
                last_log = now
                log.warning(
                    "rank %d: still waiting %.0f s for %s %s (alive and heartbeating)",
                    self.comm.rank,
                    now - start,
                    describe_ranks(sorted(pending)),
                    what,
                )
        return {}

    def collect(self) -> list[dict[str, Any]]:
        """Coordinator: every rank's record; a rank that stops heartbeating gets an error record."""
        dead = self._wait(
            set(range(self.comm.world_size)), "writing its share", lambda r: self._key(f"rank{r}")
        )
        records: list[dict[str, Any]] = []
        for r in range(self.comm.world_size):
            if r in dead:
                records.append(
                    {
                        "error": {
                            "type": "DistributedError",
                            "message": dead[r],
                            "origin": "DeadRank",
                            "trace": "",
                        }
                    }
                )
            else:
                records.append(json.loads(self.store.get(self._key(f"rank{r}"))))
        return records

    def publish(self, status: dict[str, Any]) -> None:
        self.store.set(self._key("status"), json.dumps(status))

    def await_status(self) -> dict[str, Any]:
        """The coordinator's outcome; raises naming it if it stops heartbeating first."""
        dead = self._wait({0}, "committing", lambda r: self._key("status"))
        if dead:
            raise DistributedError(
                f"rank {self.comm.rank}: no commit outcome from the coordinator: {dead[0]}"
            )
        return dict(json.loads(self.store.get(self._key("status"))))

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


def _is_timeout(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timeout" in text or "timed out" in text


def _store_lost(rank: int, what: str, e: Exception) -> DistributedError:
    return DistributedError(
        f"rank {rank}: lost the process group's store while waiting for ranks {what} "
        f"({type(e).__name__}: {e}); the process hosting it (rank 0 with a tcp:// or env:// "
        "rendezvous, or the launcher) probably died"
    )
