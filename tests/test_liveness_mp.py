"""A rank lost or frozen between saves is named on every surviving rank within ``dead_after``.

Three real gloo ranks; rank 2 dies (SIGKILL) or freezes (SIGSTOP) right after a completed
save, the two others call the next save (or a load) and must raise a DistributedError naming
rank 2 and its host long before the operation's own timeout; a rank that is slow but alive
is waited for. Survivors write what they raised to a file: the run itself fails, as rank 2
never reports.
"""

from __future__ import annotations

import json
import os
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
    for r in (0, 1):
        rec = json.loads((out / f"rank{r}.json").read_text())
        assert rec["type"] == "DistributedError", rec
        assert f"rank 2 on {socket.gethostname()}" in rec["message"], rec
        assert "stopped heartbeating" in rec["message"] and f"'{stage}'" in rec["message"], rec
        assert rec["rank_errors"] == {"2": "dead"}, rec
        assert rec["seconds"] < BOUND, rec


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
