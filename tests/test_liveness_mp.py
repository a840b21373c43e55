"""A rank lost or frozen at any stage is named on every surviving rank within ``dead_after``.

Three real gloo ranks; rank 2 dies (SIGKILL) or freezes (SIGSTOP) right after a completed
save, or inside a local-tier copy round (at save or at restore); the two others must raise a
DistributedError naming rank 2 and its host long before the operation's own timeout; a rank
that is slow but alive is waited for. Survivors write what they raised to a file: the run
itself fails, as rank 2 never reports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import RankFailure, run_ranks

import shardsafe
from shardsafe import ShardedTensor

WORLD = 3
DEAD = 4.0  # dead_after of these tests
TIMEOUT = 600.0  # the operations' own timeout, which must not be what ends the wait
BOUND = 60.0  # a survivor's error comes well within this
LONG_DEAD = 30.0  # a silence this long is not what names a rank that exited


def _state(rank: int, world: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)), (0, rank, world))
    }


def _survive(rank: int, out: Path, op: Any) -> None:
    """Run ``op`` and write how it ended to ``out/rank<r>.json``."""
    t0 = time.monotonic()
    record: dict[str, Any] = {"type": None, "message": "", "rank_errors": {}}
    try:
        op()
    except Exception as e:
        record = {
            "type": type(e).__name__,
            "message": str(e),
            "rank_errors": {str(k): v for k, v in getattr(e, "rank_errors", {}).items()},
        }
    record["seconds"] = time.monotonic() - t0
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _survivors_name_rank_2(out: Path, bound: float) -> list[dict[str, Any]]:
    """Ranks 0 and 1's records: each raised a DistributedError naming rank 2, its host and
    its silence, within ``bound`` s."""
    records = []
    for r in (0, 1):
        rec = json.loads((out / f"rank{r}.json").read_text())
        assert rec["type"] == "DistributedError", rec
        assert f"rank 2 on {socket.gethostname()}" in rec["message"], rec
        assert "stopped heartbeating" in rec["message"], rec
        assert rec["seconds"] < bound, rec
        records.append(rec)
    return records


def _lost_between_saves(rank: int, world: int, base: str, how: str) -> None:
    out = Path(base)
    saver = shardsafe.Saver(timeout=TIMEOUT, dead_after=DEAD)
    saver.save(_state(rank, world), out / "step1")
    if rank == 2:
        (out / "pid2").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(TIMEOUT)  # not reached unless continued
    _survive(rank, out, lambda: saver.save(_state(rank, world), out / "step2"))
    if rank == 0 and how == "stop":  # the frozen rank would otherwise outlive the test
        os.kill(int((out / "pid2").read_text()), signal.SIGKILL)


def _lost_before_load(rank: int, world: int, base: str) -> None:
    out = Path(base)
    shardsafe.Saver(timeout=TIMEOUT).save(_state(rank, world), out / "step1")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}
    _survive(
        rank, out, lambda: shardsafe.load(target, out / "step1", timeout=TIMEOUT, dead_after=DEAD)
    )


def _raised_between_saves(rank: int, world: int, base: str) -> None:
    """Rank 2 raises (its training step failed) right after a save; its process ends the way a
    script does: ``finally: destroy_process_group()`` (the harness's), then the interpreter's
    exit."""
    out = Path(base)
    saver = shardsafe.Saver(timeout=TIMEOUT, dead_after=LONG_DEAD)
    saver.save(_state(rank, world), out / "step1")
    if rank == 2:
        raise RuntimeError("rank 2's training step failed")
    _survive(rank, out, lambda: saver.save(_state(rank, world), out / "step2"))


def _slow_between_saves(rank: int, world: int, base: str) -> float:
    out = Path(base)
    saver = shardsafe.Saver(timeout=TIMEOUT, dead_after=DEAD)
    saver.save(_state(rank, world), out / "step1")
    if rank == 2:
        time.sleep(2 * DEAD)
    t0 = time.monotonic()
    saver.save(_state(rank, world), out / "step2")
    return time.monotonic() - t0


def _check_survivors(out: Path, stage: str) -> None:
    for rec in _survivors_name_rank_2(out, BOUND):
        assert "stopped heartbeating" in rec["message"] and f"'{stage}'" in rec["message"], rec
        assert rec["rank_errors"] == {"2": "dead"}, rec


def _run_losing_rank_2(fn: Any, *args: Any) -> None:
    with pytest.raises(RankFailure) as failed:
        run_ranks(fn, WORLD, *args, timeout=150)
    assert set(failed.value.errors) == {2}, failed.value.errors  # the survivors did not raise


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_rank_lost_between_saves_is_named_on_every_survivor(tmp_path: Path, how: str) -> None:
    try:
        _run_losing_rank_2(_lost_between_saves, str(tmp_path), how)
    finally:
        if (tmp_path / "pid2").exists():  # never leave a frozen process behind
            try:
                os.kill(int((tmp_path / "pid2").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    _check_survivors(tmp_path, "save planning")
    assert not (tmp_path / "step2").exists()


@pytest.mark.timeout(240)
def test_rank_lost_before_a_load_is_named_on_every_survivor(tmp_path: Path) -> None:
    _run_losing_rank_2(_lost_before_load, str(tmp_path))
    _check_survivors(tmp_path, "load")


@pytest.mark.timeout(240)
def test_slow_but_alive_rank_is_waited_for(tmp_path: Path) -> None:
    seconds = run_ranks(_slow_between_saves, WORLD, str(tmp_path), timeout=150)
    assert min(seconds[:2]) >= DEAD  # ranks 0 and 1 did wait for rank 2 past dead_after
    assert shardsafe.CheckpointReader(tmp_path / "step2").verify().ok


@pytest.mark.timeout(240)
def test_a_rank_that_raised_and_exited_is_named_at_once(tmp_path: Path) -> None:
    """Its exit marks its heartbeat: the survivors' next wait names it within a beat or two,
    not after ``dead_after`` (30 s here) of silence."""
    with pytest.raises(RankFailure) as failed:  # spawned: each rank ends as a script does,
        # through the interpreter's exit (a forked child's os._exit runs no exit handler)
        run_ranks(_raised_between_saves, WORLD, str(tmp_path), timeout=150, start_method="spawn")
    assert set(failed.value.errors) == {2}, failed.value.errors
    for r in (0, 1):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["type"] == "DistributedError", rec
        assert f"rank 2 on {socket.gethostname()} exited" in rec["message"], rec
        assert "'save planning'" in rec["message"], rec
        assert rec["rank_errors"] == {"2": "dead"}, rec
        assert rec["seconds"] < LONG_DEAD / 2, rec
    assert not (tmp_path / "step2").exists()


def _lost_before_restore(rank: int, world: int, base: str) -> None:
    out = Path(base)
    manager = shardsafe.CheckpointManager(
        out / "run", async_save=False, timeout=TIMEOUT, dead_after=DEAD
    )
    manager.save(1, _state(rank, world))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    _survive(rank, out, lambda: manager.restore(_state(rank, world)))


@pytest.mark.timeout(240)
def test_rank_lost_before_a_restore_is_named_on_every_survivor(tmp_path: Path) -> None:
    _run_losing_rank_2(_lost_before_restore, str(tmp_path))
    _check_survivors(tmp_path, "restore")


# -- the local tier's copy rounds ------------------------------------------------------------
COPY_BOUND = 30.0  # dead_after + 2 s + the commit, with room for a loaded machine; the copy
# round's gloo group used to hold the survivors for max(60 s, 6 * dead_after)


def _tiered(tmp: Path, rank: int) -> shardsafe.CheckpointManager:
    """Three "hosts" (node ids) on this machine, each rank's files copied to the next host."""
    return shardsafe.CheckpointManager(
        tmp / "persistent",
        local_root=tmp / "local" / "abc"[rank],
        node_id="abc"[rank],
        local_every=1,
        persistent_every=100,
        replicas=1,
        timeout=TIMEOUT,
        dead_after=DEAD,
        async_save=False,
    )


def _copy_round_hook(out: Path, how: str) -> None:
    """On this rank, stop, die or dawdle when the next copy round starts (after the offers
    were swapped, so every peer is inside the round)."""
    import shardsafe.local_tier as local_tier

    real = local_tier.exchange_files

    def hooked(*args: Any, **kwargs: Any) -> Any:
        (out / "pid2").write_text(str(os.getpid()))
        if how == "slow":
            time.sleep(2 * DEAD)  # alive: the process heartbeat goes on
        else:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            time.sleep(TIMEOUT)  # not reached unless continued
        return real(*args, **kwargs)

    local_tier.exchange_files = hooked  # type: ignore[assignment]


def _lost_in_copy_round(rank: int, world: int, base: str, how: str) -> Any:
    out = Path(base)
    mgr = _tiered(out, rank)
    mgr.save(1, _state(rank, world))
    mgr.wait()
    if rank == 2:
        _copy_round_hook(out, how)
    if how == "slow":
        t0 = time.monotonic()
        mgr.save(2, _state(rank, world))
        mgr.wait()
        mgr.close()
        return time.monotonic() - t0
    _survive(rank, out, lambda: (mgr.save(2, _state(rank, world)), mgr.wait()))
    if rank == 0 and how == "stop":  # the frozen rank would otherwise outlive the test
        os.kill(int((out / "pid2").read_text()), signal.SIGKILL)
    return None


def _end_rank_2(out: Path) -> None:
    if (out / "pid2").exists():  # never leave a frozen process behind
        pid = int((out / "pid2").read_text())
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_rank_lost_in_a_copy_round_is_named_on_every_survivor(tmp_path: Path, how: str) -> None:
    try:
        _run_losing_rank_2(_lost_in_copy_round, str(tmp_path), how)
    finally:
        _end_rank_2(tmp_path)
    for r, rec in enumerate(_survivors_name_rank_2(tmp_path, COPY_BOUND)):
        assert "2" in rec["rank_errors"], rec
        print(f"rank {r}: {rec['seconds']:.1f} s: {rec['message'][:300]}")
    # the copy round named it on the peers that were in it with rank 2 (0 receives from it,
    # 1 sends to it, unless gloo took that send without rank 2); the commit on the others
    rec0 = json.loads((tmp_path / "rank0.json").read_text())
    assert "'the local tier's copy round'" in rec0["rank_errors"]["0"], rec0


@pytest.mark.timeout(240)
def test_slow_rank_in_a_copy_round_is_waited_for(tmp_path: Path) -> None:
    try:
        seconds = run_ranks(_lost_in_copy_round, WORLD, str(tmp_path), "slow", timeout=150)
    finally:
        _end_rank_2(tmp_path)
    assert min(seconds[:2]) >= 2 * DEAD  # ranks 0 and 1 waited for rank 2 past dead_after
    for host in "abc":  # committed on every host, with the copies of the previous host's files
        (run,) = (tmp_path / "local" / host).glob("run-*")
        assert (run / "step_000000002" / "manifest.json").is_file()
        source = "abc".index(host) - 1 if host != "a" else 2
        assert (run / "step_000000002" / "data" / f"rank-{source:05d}-00.bin").is_file()


def _held_by_a_frozen_rank(rank: int, world: int, base: str, relay: bool) -> None:
    """A chain of point-to-point messages 2 -> 1 -> 0: rank 2 freezes before it sends, so
    rank 1 never sends to rank 0 either. Rank 0 looks only at its own peer, rank 1, which is
    alive (it stays until rank 0 has its answer)."""
    import torch.distributed as dist

    from shardsafe.dist import get_comm

    out = Path(base)
    comm = get_comm()
    comm.arrive("before the chain", TIMEOUT, DEAD)
    key = "test/chain/dead" if relay else None
    if rank == 2:
        (out / "pid2").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(TIMEOUT)
    if rank == 1:

        def chain() -> None:
            got = torch.zeros(1)
            dist.recv(got, src=2)
            dist.send(got, dst=0)

        _survive(rank, out, lambda: comm.with_peers(chain, [2, 0], "a chain", DEAD, key))
        deadline = time.monotonic() + BOUND + 10
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    _survive(
        rank,
        out,
        lambda: comm.with_peers(
            lambda: dist.recv(torch.zeros(1), src=1), [1], "a chain", DEAD, key
        ),
    )
    os.kill(int((out / "pid2").read_text()), signal.SIGKILL)


@pytest.mark.timeout(240)
def test_a_verdict_reaches_a_rank_whose_own_peers_are_alive(tmp_path: Path) -> None:
    """A copy round's verdict key (``Comm.with_peers(..., verdict_key)``): rank 0's only peer
    is alive but held by frozen rank 2, which rank 0 does not look at; rank 1 names rank 2,
    and rank 0 learns it from the key instead of waiting out gloo's timeout (120 s here)."""
    try:
        with pytest.raises(RankFailure) as failed:
            run_ranks(
                _held_by_a_frozen_rank, WORLD, str(tmp_path), True, timeout=200, pg_timeout=120
            )
        assert set(failed.value.errors) == {2}, failed.value.errors
    finally:
        _end_rank_2(tmp_path)
    for rec in _survivors_name_rank_2(tmp_path, BOUND):
        assert rec["rank_errors"] == {"2": "dead"}, rec


def _coordinator_gone_after_naming(rank: int, world: int, base: str) -> None:
    """Rank 3 dies. Rank 0 names it in a wait ranks 1 and 2 are not in (they left for a later
    one that watches rank 0 alone), and then goes silent as a process that raised and exited
    does (its heartbeat stops; its process stays, as it hosts the store)."""
    from shardsafe.dist import get_comm
    from shardsafe.liveness import HEARTBEATS

    out = Path(base)
    comm = get_comm()
    comm.arrive("before", TIMEOUT, DEAD)
    if rank == 3:
        (out / "died").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        from shardsafe.signals import StoreChannel

        channel = StoreChannel(comm, "test-outcome", dead_after=DEAD)
        _survive(rank, out, lambda: comm.arrive("the coordinator's wait", TIMEOUT, DEAD))
        time.sleep(3.0)  # three beats: the others' heartbeats have read the board meanwhile
        channel.publish({"outcome": "the coordinator's"})
        channel.stop()
        HEARTBEATS.stop()
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline and not all(
            (out / f"rank{r}.json").exists() for r in (1, 2)
        ):
            time.sleep(0.05)
        return

    def later_wait() -> None:  # an exchange with rank 0 that rank 0 will never serve
        import threading

        threading.Event().wait(TIMEOUT)

    if rank == 1:
        _survive(rank, out, lambda: comm.with_peers(later_wait, [0], "a later wait", DEAD))
    else:  # a save's commit outcome, which rank 0 publishes after it named rank 3
        from shardsafe.signals import StoreChannel

        channel = StoreChannel(comm, "test-outcome", dead_after=DEAD)

        def outcome() -> None:
            (out / "outcome2.json").write_text(json.dumps(channel.await_status()))

        _survive(rank, out, outcome)
        channel.stop()
    record = json.loads((out / f"rank{rank}.json").read_text())
    record["after_death"] = time.time() - float((out / "died").read_text())
    (out / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.timeout(240)
def test_a_verdict_reaches_a_rank_that_left_the_wait_it_was_given_in(tmp_path: Path) -> None:
    """The verdict board: rank 1 waits on rank 0 alone, in an exchange, when rank 0, having
    named rank 3 in a wait rank 1 had left, goes silent. Rank 1 learns rank 3's verdict from
    the board at its next beat, instead of naming rank 0 ``dead_after`` s after its silence
    began. Rank 2 waits for a save's commit outcome, which is the coordinator's to decide: the
    board's verdict on rank 3 does not end that wait, and rank 2 gets what rank 0 publishes."""
    with pytest.raises(RankFailure) as failed:
        run_ranks(_coordinator_gone_after_naming, 4, str(tmp_path), timeout=200)
    assert set(failed.value.errors) == {3}, failed.value.errors
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert "rank 3 on" in first["message"], first
    rec = json.loads((tmp_path / "rank1.json").read_text())
    assert rec["type"] == "DistributedError", rec
    assert f"rank 3 on {socket.gethostname()} stopped heartbeating" in rec["message"], rec
    assert "named by rank 0" in rec["message"] and rec["rank_errors"] == {"3": "dead"}, rec
    # rank 0's verdict within dead_after + 2 intervals, one more beat to read the board
    assert rec["after_death"] < DEAD + 3 + 2, rec
    rec2 = json.loads((tmp_path / "rank2.json").read_text())
    assert rec2["type"] is None, rec2
    assert json.loads((tmp_path / "outcome2.json").read_text()) == {"outcome": "the coordinator's"}


def _lost_in_restore_copy(rank: int, world: int, base: str) -> None:
    out = Path(base)
    mgr = _tiered(out, rank)
    mgr.save(1, _state(rank, world))
    mgr.wait()
    if rank == 2:  # host c lost its own file of the step: restore fetches it from host a
        import shardsafe.local_restore as local_restore

        (run,) = (out / "local" / "c").glob("run-*")
        os.remove(run / "step_000000001" / "data" / "rank-00002-00.bin")

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        local_restore.exchange_files = die  # type: ignore[assignment]
    _survive(rank, out, lambda: mgr.restore(_state(rank, world)))


@pytest.mark.timeout(240)
def test_rank_lost_in_a_restore_copy_round_is_named_on_every_survivor(tmp_path: Path) -> None:
    _run_losing_rank_2(_lost_in_restore_copy, str(tmp_path))
    for rec in _survivors_name_rank_2(tmp_path, COPY_BOUND):
        assert rec["rank_errors"] == {"2": "dead"}, rec


def _lost_in_a_collective(rank: int, world: int, base: str, how: str) -> None:
    """Every rank arrives; rank 2 then dies or freezes before its part of an all-gather,
    which the others are already blocked in (no arrival guards it)."""
    from shardsafe.dist import get_comm

    out = Path(base)
    comm = get_comm()
    comm.dead_after = DEAD
    comm.arrive("before the all-gather", TIMEOUT, DEAD)
    if rank == 2:
        (out / "pid2").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(TIMEOUT)
    _survive(rank, out, lambda: comm.all_gather({"rank": rank}))
    if rank == 0:
        # rank 0's process hosts the store: leaving before rank 1 named rank 2 would end
        # rank 1's wait with the store's loss instead (what a job whose rank 0 exits sees)
        deadline = time.monotonic() + BOUND
        while not (out / "rank1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if how == "stop":  # the frozen rank would otherwise outlive the test
            os.kill(int((out / "pid2").read_text()), signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_rank_lost_inside_a_collective_is_named_on_every_survivor(tmp_path: Path, how: str) -> None:
    try:  # the group's own timeout (120 s) is not what must end the survivors' wait
        with pytest.raises(RankFailure) as failed:
            run_ranks(_lost_in_a_collective, WORLD, str(tmp_path), how, timeout=200, pg_timeout=120)
        assert set(failed.value.errors) == {2}, failed.value.errors
    finally:
        if (tmp_path / "pid2").exists():
            try:
                os.kill(int((tmp_path / "pid2").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    _survivors_name_rank_2(tmp_path, BOUND)


# -- silence counted from when the rank stopped ----------------------------------------------
BUSY = 3 * DEAD  # the survivors write their share this long after rank 2 died


def _lost_while_others_write(rank: int, world: int, base: str) -> None:
    """Rank 2 dies as the second save's writing starts; ranks 0 and 1 write for ``BUSY`` s
    (no wait of theirs looks at rank 2 meanwhile) before the commit's wait."""
    import shardsafe.saver as saver_module

    out = Path(base)
    saver = shardsafe.Saver(timeout=TIMEOUT, dead_after=DEAD)
    saver.save(_state(rank, world), out / "step1")
    real = saver_module.write_share

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(BUSY)
        return real(*args, **kwargs)

    saver_module.write_share = hooked  # type: ignore[assignment]
    _survive(rank, out, lambda: saver.save(_state(rank, world), out / "step2"))


@pytest.mark.timeout(240)
def test_silence_is_counted_from_when_the_rank_stopped(tmp_path: Path) -> None:
    """The heartbeat samples the ranks it watches on every beat, wait or no wait: the verdict
    counts rank 2's silence from its death (``BUSY`` s and more when the commit's wait starts),
    not from the wait's first look (which named it ``dead_after`` s later, with about
    ``dead_after`` s of silence)."""
    _run_losing_rank_2(_lost_while_others_write, str(tmp_path))
    for rec in _survivors_name_rank_2(tmp_path, BOUND):
        silence = re.search(r"stopped heartbeating ([0-9.]+) s ago", rec["message"])
        assert silence is not None, rec
        assert float(silence.group(1)) >= 2 * DEAD, rec  # counted from the death, not the wait
    assert not (tmp_path / "step2").exists()


# -- a frozen store ---------------------------------------------------------------------------
def _store_host_frozen(rank: int, world: int, base: str, where: str) -> None:
    """Rank 0 hosts the process group's store (``tcp://`` rendezvous) and freezes: between two
    saves, or inside an all-gather that every rank reached."""
    from shardsafe.dist import get_comm

    out = Path(base)
    saver = shardsafe.Saver(timeout=TIMEOUT, dead_after=DEAD)
    saver.save(_state(rank, world), out / "step1")
    comm = get_comm()
    comm.dead_after = DEAD
    if where == "collective":
        comm.arrive("before the all-gather", TIMEOUT, DEAD)
    (out / f"arrived{rank}").write_text("")
    if rank == 0:
        # every rank is through the first save's (and the arrival's) store calls: a rank still
        # reading the commit's outcome when the store freezes fails that save instead
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            if all((out / f"arrived{r}").exists() for r in range(world)):
                break
            time.sleep(0.05)
        (out / "pid0").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(TIMEOUT)  # not reached unless continued
    if where == "collective":
        _survive(rank, out, lambda: comm.all_gather({"rank": rank}))
    else:
        _survive(rank, out, lambda: saver.save(_state(rank, world), out / "step2"))
    if rank == 1:  # the frozen store host would otherwise outlive the test
        (out / "rank1.done").write_text("")
    if rank == 2:
        deadline = time.monotonic() + BOUND
        while not (out / "rank1.done").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(int((out / "pid0").read_text()), signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["between-saves", "collective"])
def test_frozen_store_host_is_named_on_every_survivor(tmp_path: Path, where: str) -> None:
    """A store client's request to a frozen server never returns (nor do the heartbeats'):
    the survivors must still raise, within the bound, naming the store and who hosts it."""
    try:
        with pytest.raises(RankFailure) as failed:
            run_ranks(_store_host_frozen, WORLD, str(tmp_path), where, timeout=150, pg_timeout=120)
        assert set(failed.value.errors) == {0}, failed.value.errors
    finally:
        if (tmp_path / "pid0").exists():
            try:
                os.kill(int((tmp_path / "pid0").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for r in (1, 2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["type"] == "DistributedError", rec
        assert "the process group's store at 127.0.0.1:" in rec["message"], rec
        assert "stopped answering" in rec["message"], rec
        assert f"rank 0, on {socket.gethostname()}" in rec["message"], rec
        assert "restart the job on every rank" in rec["message"], rec
        assert rec["seconds"] < BOUND, rec
        print(f"rank {r}: {rec['seconds']:.1f} s: {rec['message'][:300]}")


# -- a rank frozen inside its own arrival -----------------------------------------------------
class _FreezeOnCount:
    """The store, for a rank that freezes after posting its arrival, before counting itself."""

    def __init__(self, store: Any, out: Path) -> None:
        self._store, self._out = store, out

    def add(self, key: str, n: int) -> int:
        if key.endswith("/count"):
            (self._out / "pid2").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(TIMEOUT)  # not reached unless continued
        return int(self._store.add(key, n))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _frozen_inside_arrival(rank: int, world: int, base: str) -> None:
    from shardsafe.dist import Comm, get_comm

    out = Path(base)
    comm = get_comm()
    comm.dead_after = DEAD
    if rank == 2:
        real = Comm._wait_for_all

        def freezing(self: Comm, store: Any, *args: Any) -> None:
            real(self, _FreezeOnCount(store, out), *args)

        Comm._wait_for_all = freezing  # type: ignore[method-assign]

    def op() -> None:
        comm.arrive("before the all-gather", TIMEOUT, DEAD)
        comm.all_gather({"rank": rank})

    _survive(rank, out, op)
    if rank == 0:  # hosting the store: rank 1 reads the verdict through it before rank 0 leaves
        deadline = time.monotonic() + BOUND
        while not (out / "rank1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int((out / "pid2").read_text()), signal.SIGKILL)  # it would outlive the test


@pytest.mark.timeout(240)
def test_rank_frozen_inside_its_arrival_is_named_on_every_survivor(tmp_path: Path) -> None:
    """Rank 2 posts its arrival and freezes before counting itself, so the count never reaches
    the world size: the coordinator's heartbeat, seeing every arrival posted, ends the wait,
    and the all-gather after it names rank 2 (it used to hold every rank for the timeout)."""
    try:
        _run_losing_rank_2(_frozen_inside_arrival, str(tmp_path))
    finally:
        _end_rank_2(tmp_path)
    _survivors_name_rank_2(tmp_path, BOUND)
