"""A store that holds every request for a while (a TCP store seemed to, for 4-5 s, while ranks
opened new connections to it: each connecting thread held its interpreter through a name lookup
the resolver had dropped) is not a rank's death: the watching process could not look either, so
its clocks start again; a rank that really stopped is still named afterwards."""

from __future__ import annotations

import threading
import time
from typing import Any

from shardsafe.liveness import Heartbeat, Watch, beat_key

DEAD = 3.0


class HeldStore:
    """A dict-backed store whose requests wait while the monotonic time is within ``hold``
    (start, end), widened by ``lead`` before and ``lag`` after for this view: a peer's view
    is held from before the watcher's last look until after its first one, as when a
    coordinator sampled the others' counters before their own held beats landed."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.hold: list[float] = [0.0, 0.0]
        self.lead = self.lag = 0.0
        self._lock = threading.Lock()

    def view(self, lead: float, lag: float) -> HeldStore:
        other = HeldStore()
        other.data, other.hold, other._lock = self.data, self.hold, self._lock
        other.lead, other.lag = lead, lag
        return other

    def clone(self) -> HeldStore:
        return self.view(0.0, 0.0)

    def _held(self) -> None:
        while self.hold[0] - self.lead <= time.monotonic() < self.hold[1] + self.lag:
            time.sleep(0.01)

    def add(self, key: str, n: int) -> int:
        self._held()
        with self._lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def set(self, key: str, value: Any) -> None:
        self._held()
        with self._lock:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self._held()
        with self._lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._held()
        with self._lock:
            return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._held()
        with self._lock:
            return [self.data[k] for k in keys]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._held()
        with self._lock:
            if self.data.get(key, b"") == expected.encode():
                self.data[key] = desired.encode()
            return self.data[key]


def _rank1_beating(peer: HeldStore) -> tuple[threading.Event, threading.Thread]:
    """Rank 1's heartbeat through ``peer``, every 0.3 s until the event is set."""
    stop = threading.Event()

    def rank1_beats() -> None:
        while not stop.is_set():
            peer.add(beat_key(1), 1)
            time.sleep(0.3)

    beater = threading.Thread(target=rank1_beats, daemon=True)
    beater.start()
    return stop, beater


def _watching_rank1(store: HeldStore, dead_after: float, notify: Any) -> Heartbeat:
    """Rank 0's heartbeat in ``store``, watching rank 1 with ``dead_after``."""
    beat = Heartbeat(store, 0, world_size=2)
    beat.watch(
        Watch(
            None,
            lambda r: f"arrived{r}",
            [1],
            lambda r: r,
            False,
            "test",
            dead_after,
            60.0,
            notify=notify,
        )
    )
    return beat


def test_a_store_that_held_every_request_is_no_ranks_death() -> None:
    store = HeldStore()
    # rank 1's beats are held from 1.5 s before the watcher's requests (so from before its
    # last look) until half a second after them (so after its first look)
    peer = store.view(lead=1.5, lag=0.5)
    stop, beater = _rank1_beating(peer)
    verdicts: list[dict[str, Any]] = []
    _watching_rank1(store, DEAD, verdicts.append)
    try:
        time.sleep(1.0)
        start = time.monotonic() + 1.5
        store.hold[:] = [start, start + DEAD + 1.5]  # every request held longer than dead_after
        time.sleep(1.5 + DEAD + 1.5 + 3.0)
        assert verdicts == [], verdicts  # rank 1 beat all along: the store held its beats
        stop.set()  # now rank 1 stops for real
        beater.join()
        deadline = time.monotonic() + DEAD + 4.0
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.1)
        assert verdicts and verdicts[0]["rank"] == 1, verdicts
        assert "stopped heartbeating" in verdicts[0]["message"]
    finally:
        stop.set()
        del store  # the heartbeat thread ends with its store


def test_a_rank_that_died_while_the_watcher_could_not_look_is_named_after_the_grace() -> None:
    """The watcher's own requests are held (its looks stall) for longer than dead_after; rank 1,
    whose store is not held, beats into the middle of that stall and dies. The beats the watcher
    finds when it can look again came at some moment of the stall, not then: rank 1 is named
    once the stall's grace is over, not dead_after after the stall."""
    from shardsafe.liveness import INTERVAL, STALL_GRACE

    dead_after = 8.0
    store = HeldStore()
    peer = store.view(0.0, 0.0)
    peer.hold = [0.0, 0.0]  # its own: rank 1's beats are never held
    stop, beater = _rank1_beating(peer)
    verdicts: list[tuple[float, dict[str, Any]]] = []
    _watching_rank1(store, dead_after, lambda v: verdicts.append((time.monotonic(), v)))
    try:
        time.sleep(1.5)
        start = time.monotonic() + 0.5
        end = start + dead_after + 1.0
        store.hold[:] = [start, end]  # the watcher cannot look for longer than dead_after
        time.sleep(0.5 + 2.0)
        stop.set()  # rank 1 dies 2 s into the stall
        beater.join()
        deadline = end + dead_after + 4.0
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.1)
        assert verdicts and verdicts[0][1]["rank"] == 1, verdicts
        # named within the grace (+ two looks) after the stall, not dead_after after it
        assert verdicts[0][0] - end < STALL_GRACE + 2 * INTERVAL + 0.5, verdicts[0][0] - end
    finally:
        stop.set()
        del store


def test_a_slow_store_connection_is_reported_with_its_likely_cause(caplog: Any) -> None:
    """Opening a store connection should take a millisecond; one that took longer than
    ``warn_after`` (here 0 s, so a real connection to a real store counts as slow) is logged
    with the address and what to do about the name lookup behind it; a quick one is not."""
    import logging
    from datetime import timedelta

    import torch.distributed as tdist

    from shardsafe.liveness import open_connection, store_address

    server = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    address = store_address(server)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        quick = open_connection(server.clone, address, warn_after=60.0)
        assert not caplog.records
        slow = open_connection(server.clone, address, warn_after=0.0)
    quick.set("k", "v")
    assert bytes(slow.get("k")) == b"v"  # a working client either way
    (record,) = caplog.records
    message = record.getMessage()
    assert address in message and address.endswith(f":{server.port}")
    assert "::ffff:" in message and "/etc/hosts" in message
