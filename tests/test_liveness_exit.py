"""A process that exits through the interpreter's exit marks its heartbeat counter: a wait that
still awaits it names it at its next look, not ``dead_after`` later; a mark left by an earlier
process of the rank is neither news to a watcher nor kept by the rank's next process.

Two heartbeats in this process on a real TCPStore (the watcher, global rank 0; the watched,
global rank 1), as two processes' heartbeats would be."""

from __future__ import annotations

import gc
import json
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as tdist

from shardsafe.liveness import EXITED, Heartbeat, Watch, beat_key

DEAD = 30.0  # no wait here may end by silence: only an exit names a rank within the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def store() -> Any:
    server = tdist.TCPStore(
        "127.0.0.1", _free_port(), is_master=True, timeout=timedelta(seconds=30)
    )
    yield server


def _watch(key: str, exits: bool) -> Watch:
    """Rank 0 waiting for rank 1 to arrive, as the coordinator of an arrival does."""
    return Watch(
        f"{key}/done",
        lambda r: f"{key}/r{r}",
        [1],
        lambda r: r,
        True,
        "the test's stage",
        DEAD,
        DEAD,
        members=[0, 1],
        exits=exits,
    )


def _verdict_within(store: Any, key: str, seconds: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return json.loads(bytes(store.get(key)).decode())
        time.sleep(0.05)
    return None


def _seen_beating(watcher: Heartbeat, g: int) -> None:
    """Until the watcher's beat has read ``g``'s counter (below EXITED)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen = watcher._latest.get(g)
        if seen is not None and 0 < seen[0] < EXITED:
            return
        time.sleep(0.05)
    raise AssertionError(f"the watcher never read rank {g}'s counter")


@pytest.mark.timeout(60)
def test_an_exited_rank_is_named_at_the_next_look(store: Any) -> None:
    watcher = Heartbeat(store, 0, 2)
    watched = Heartbeat(store, 1, 2)
    try:
        _seen_beating(watcher, 1)
        watched.stop(2.0)  # what the interpreter's exit runs
        assert int(store.add(beat_key(1), 0)) >= EXITED
        t0 = time.monotonic()
        handle = watcher.watch(_watch("a", exits=True))
        verdict = _verdict_within(store, "a/done", 10.0)
        watcher.unwatch(handle)
        assert verdict is not None, "rank 1 exited and was not named"
        assert time.monotonic() - t0 < DEAD / 3
        assert verdict["rank"] == 1
        assert f"rank 1 on {socket.gethostname()} exited" in verdict["message"], verdict
        assert "the test's stage" in verdict["message"], verdict
        # posted on the board too, for the waits of other ranks
        assert int(store.add("shardsafe/verdicts/count", 0)) == 1
    finally:
        watcher.stop(2.0)
        watched.stop(2.0)


@pytest.mark.timeout(60)
def test_an_exit_is_not_named_where_a_wait_cannot_tell_a_finished_peer(store: Any) -> None:
    """An exchange's or a collective's peer may finish its part and exit before this rank's
    own part returns: their waits do not take an exit as a failure."""
    watcher = Heartbeat(store, 0, 2)
    watched = Heartbeat(store, 1, 2)
    try:
        _seen_beating(watcher, 1)
        watched.stop(2.0)
        handle = watcher.watch(_watch("b", exits=False))
        assert _verdict_within(store, "b/done", 3.0) is None
        watcher.unwatch(handle)
    finally:
        watcher.stop(2.0)
        watched.stop(2.0)


@pytest.mark.timeout(60)
def test_an_earlier_processs_exit_is_not_news_and_the_next_process_clears_it(
    store: Any,
) -> None:
    earlier = Heartbeat(store, 1, 2)
    earlier.stop(2.0)
    left = int(store.add(beat_key(1), 0))
    assert left >= EXITED
    # a watcher that first looks at a counter already marked: an earlier attempt's process,
    # whose rank may be starting again now
    watcher = Heartbeat(store, 0, 2)
    try:
        handle = watcher.watch(_watch("c", exits=True))
        assert _verdict_within(store, "c/done", 3.0) is None
        watcher.unwatch(handle)
        again = Heartbeat(store, 1, 2)
        try:
            now = int(store.add(beat_key(1), 0))
            assert 0 < now < EXITED and now > left - EXITED
            _seen_beating(watcher, 1)
            assert 1 not in watcher._exited
        finally:
            again.stop(2.0)
    finally:
        watcher.stop(2.0)


_RAISES = """
import sys, time
from datetime import timedelta
import torch.distributed as tdist
from shardsafe.liveness import HEARTBEATS
store = tdist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                       timeout=timedelta(seconds=30))
HEARTBEATS.ensure(store, 1, 2)  # what a shardsafe call does in a rank
time.sleep(2.5)  # beats the watcher reads
raise RuntimeError("the training step failed")
"""


@pytest.mark.timeout(90)
def test_a_process_that_raised_is_named_exited(store: Any) -> None:
    """A real interpreter exit on an uncaught exception marks the counter (atexit)."""
    import subprocess
    import sys

    watcher = Heartbeat(store, 0, 2)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RAISES, str(store.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1 and "the training step failed" in proc.stderr, proc.stderr
        assert int(store.add(beat_key(1), 0)) >= EXITED
        handle = watcher.watch(_watch("d", exits=True))
        verdict = _verdict_within(store, "d/done", 10.0)
        watcher.unwatch(handle)
        assert verdict is not None and "exited" in verdict["message"], verdict
    finally:
        watcher.stop(2.0)


@pytest.mark.timeout(60)
def test_a_new_groups_heartbeat_is_not_marked_by_the_last_ones_exit(store: Any) -> None:
    """A process that makes a new process group on the same store server (an in-process
    restart): the old heartbeat's exit mark comes before the new one starts, which clears it,
    never after it on the new process's counter."""
    from shardsafe.liveness import Heartbeats

    beats = Heartbeats()
    first = tdist.TCPStore("127.0.0.1", store.port, is_master=False)
    second = tdist.TCPStore("127.0.0.1", store.port, is_master=False)
    try:
        beats.ensure(first, 1, 2)
        del first  # the old group destroyed: its heartbeat finds its store gone
        gc.collect()
        beats.ensure(second, 1, 2)
        time.sleep(2 * 1.0 + 0.5)  # the old heartbeat's thread would have woken by now
        assert 0 < int(store.add(beat_key(1), 0)) < EXITED
    finally:
        beats.stop()
