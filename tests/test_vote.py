"""Comm.vote: an arrival that counts every rank's ballot once and hands each rank the count."""

from __future__ import annotations

from typing import Any

import pytest
from distributed import run_ranks

from shardsafe import CheckpointError
from shardsafe.dist import Comm, get_comm


def _tally(ballots: list[Any]) -> dict[str, Any]:
    return {"order": [b["rank"] for b in ballots], "sum": sum(b["n"] for b in ballots)}


def _broken(ballots: list[Any]) -> Any:
    raise ValueError(f"cannot count {len(ballots)} ballots")


def _votes(rank: int, world: int) -> dict[str, Any]:
    comm = get_comm()
    out: dict[str, Any] = {}
    out["first"] = comm.vote("first", {"rank": rank, "n": 10**rank}, _tally, 60.0, 5.0)
    comm.arrive("between", 60.0, 5.0)  # arrivals and votes share one sequence
    out["gathered"] = comm.all_gather(rank)
    out["second"] = comm.vote("second", {"rank": rank, "n": rank}, _tally, 60.0, 5.0)
    try:
        comm.vote("broken", {"rank": rank}, _broken, 60.0, 5.0)
    except CheckpointError as e:
        out["broken"] = str(e)
    out["after"] = comm.vote("after", {"rank": rank, "n": 1}, _tally, 60.0, 5.0)
    out["left"] = _keys_left_after_beats(comm)
    comm.arrive("end", 60.0, 5.0)  # rank 0 hosts the store: nobody looks after it has gone
    return out


def _keys_left_after_beats(comm: Comm) -> list[str]:
    """The arrival keys of this rank's finished waits still in the store after three beats:
    the heartbeat deletes them off the waits' path, and it must delete every one."""
    import time

    from shardsafe.dist import _group_tag, _store
    from shardsafe.liveness import INTERVAL

    store = _store()
    tag = _group_tag(comm)
    last = int(store.add(f"shardsafe/arrivals/{tag}/r{comm.rank}", 0))
    keys = [
        f"shardsafe/arrive/{tag}/{seq}/{name}"
        for seq in range(1, last + 1)
        for name in [*(f"r{r}" for r in range(comm.world_size)), "count", "done", "all"]
    ]
    deadline = time.monotonic() + 3 * INTERVAL
    while True:
        left = [k for k in keys if store.check([k])]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_every_rank_gets_the_same_count_of_every_ballot() -> None:
    results = run_ranks(_votes, 3, timeout=90)
    for r in results:
        assert r["first"] == {"order": [0, 1, 2], "sum": 111}, r
        assert r["gathered"] == [0, 1, 2]
        assert r["second"] == {"order": [0, 1, 2], "sum": 3}
        # a count that fails is raised on every rank, saying what failed, and the next works
        assert "counting the votes of 'broken' failed" in r["broken"], r
        assert "cannot count 3 ballots" in r["broken"], r
        assert r["after"] == {"order": [0, 1, 2], "sum": 3}
        assert r["left"] == [], r["left"]


def test_one_process_counts_its_own_ballot() -> None:
    assert Comm().vote("alone", {"rank": 0, "n": 7}, _tally, 1.0) == {"order": [0], "sum": 7}


def _slow_count(rank: int, world: int) -> dict[str, Any]:
    """Rank 2 arrives last and counts slowly: the coordinator's heartbeat, seeing every ballot
    posted, ends the wait first (as it does for a rank that froze there); every rank then
    counts the ballots itself, and all get the same count."""
    import time

    from shardsafe.liveness import INTERVAL

    calls = []

    def slow(ballots: list[Any]) -> dict[str, Any]:
        calls.append(len(ballots))
        if rank == 2 and len(calls) == 1:
            time.sleep(4 * INTERVAL)
        return _tally(ballots)

    comm = get_comm()
    time.sleep(0.5 * rank)  # rank 0 waits first, rank 2 arrives last
    out = comm.vote("slow", {"rank": rank, "n": rank + 1}, slow, 60.0, 30.0)
    calls_in_vote = len(calls)
    comm.arrive("done", 60.0, 30.0)  # rank 0's process hosts the store: it stays till the end
    return {"out": out, "calls": calls_in_vote}


@pytest.mark.timeout(120)
def test_a_count_the_heartbeat_overtook_is_made_by_every_rank() -> None:
    results = run_ranks(_slow_count, 3, timeout=90)
    assert all(r["out"] == {"order": [0, 1, 2], "sum": 6} for r in results), results
    assert results[0]["calls"] == 1 and results[1]["calls"] == 1, results
