"""The commit protocol's failure bounds, on two real gloo ranks.

One pool of two ranks runs every case in turn: a progress callback that raises on one rank
(blocking and async saves), a rank slower than the dead-rank detection time but heartbeating,
a rank that cannot see the shared work directory (its own mount namespace with a private
file system over the root), and last a rank frozen with SIGSTOP (its heartbeat stops).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import RankFailure, run_ranks

import shardsafe
from shardsafe import CheckpointError, Saver, ShardedTensor

DEAD_AFTER = 1.5
SLACK = 6.0  # scheduling noise on a loaded two-core machine


def sd(rank: int, world: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((256, 64), float(rank)), (0, rank, world)
        )
    }


def _timed(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return {"ok": True, "seconds": time.monotonic() - t0}
    except CheckpointError as e:
        return {
            "ok": False,
            "type": type(e).__name__,
            "message": str(e),
            "seconds": time.monotonic() - t0,
        }


def _private_mount(path: str) -> str | None:
    """Give this process its own mount namespace with a tmpfs over ``path``; None if refused."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return f"unshare(CLONE_NEWNS) refused: {os.strerror(ctypes.get_errno())}"
    for cmd in (["mount", "--make-rprivate", "/"], ["mount", "-t", "tmpfs", "tmpfs", path]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            return f"{' '.join(cmd)}: {r.stderr.strip()}"
    return None


def _cases(rank: int, world: int, base: str, out: str) -> None:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("shardsafe").addHandler(Keep())
    logging.getLogger("shardsafe").setLevel(logging.INFO)
    saver = Saver(dead_after=DEAD_AFTER, timeout=30)
    report: dict[str, Any] = {}

    # two Savers and a load on one group, interleaved: the arrivals agree because each rank's
    # count lives in the group's store, not in a Saver or in this process
    store = dist.distributed_c10d._get_default_store()
    counter = f"shardsafe/arrivals/{shardsafe.dist._group_tag(shardsafe.dist.get_comm())}/r{rank}"
    before = int(store.add(counter, 0))
    other = Saver(dead_after=DEAD_AFTER, timeout=30)
    report["two_savers"] = _timed(
        lambda: (
            saver.save(sd(rank, world), f"{base}/s1"),
            other.async_save(sd(rank, world), f"{base}/s2").result(60),
            saver.save(sd(rank, world), f"{base}/s3", overwrite=True),
            shardsafe.load(sd(rank, world), f"{base}/s2"),
        )
    )
    other.close()
    report["arrivals"] = int(store.add(counter, 0)) - before

    def raising(stage: str, done: int, total: int) -> None:
        if rank == 1:
            raise RuntimeError("callback failed on purpose")

    report["raise_sync"] = _timed(
        lambda: saver.save(sd(rank, world), f"{base}/a", progress=raising)
    )
    report["raise_async"] = _timed(
        lambda: saver.async_save(sd(rank, world), f"{base}/b", progress=raising).result(60)
    )

    def slow(stage: str, done: int, total: int) -> None:
        if rank == 1 and stage == "written":
            time.sleep(3 * DEAD_AFTER + 1)

    report["slow"] = _timed(lambda: saver.save(sd(rank, world), f"{base}/c", progress=slow))
    report["slow_async"] = _timed(
        lambda: saver.async_save(sd(rank, world), f"{base}/d", progress=slow).result(60)
    )
    report["waited_log"] = [m for m in messages if "still waiting for rank 1" in m]

    os.makedirs(f"{base}/priv", exist_ok=True)
    dist.barrier()
    report["mount"] = _private_mount(f"{base}/priv") if rank == 1 else None
    dist.barrier()
    report["private"] = _timed(lambda: saver.save(sd(rank, world), f"{base}/priv/ck"))
    report["host"] = socket.gethostname()

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def freeze(stage: str, done: int, total: int) -> None:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)

    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    report["frozen"] = _timed(lambda: saver.save(sd(rank, world), f"{base}/e", progress=freeze))
    if rank == 0:
        os.kill(pids[1], signal.SIGKILL)
        report["listing"] = sorted(os.listdir(base))
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    base = tmp_path_factory.mktemp("protocol")
    out = tmp_path_factory.mktemp("reports")
    with pytest.raises(RankFailure) as info:
        run_ranks(_cases, 2, str(base), str(out), timeout=240)
    assert info.value.errors == {1: "process exited with code -9"}, info.value.errors
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], base


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["raise_sync", "raise_async"])
def test_a_raising_callback_fails_every_rank_at_once(reports: Any, case: str) -> None:
    for rep in reports[0]:
        rec = rep[case]
        assert not rec["ok"] and "callback failed on purpose" in rec["message"], rec
        assert "rank 1" in rec["message"], rec
        assert rec["seconds"] < SLACK, rec  # not a timeout: the error travels with the record


@pytest.mark.timeout(300)
def test_two_savers_and_a_load_on_one_group_agree_on_their_arrivals(reports: Any) -> None:
    (r0, r1), _ = reports
    assert r0["two_savers"]["ok"] and r1["two_savers"]["ok"], (r0["two_savers"], r1["two_savers"])
    assert r0["arrivals"] == r1["arrivals"] >= 3


@pytest.mark.timeout(300)
def test_a_slow_rank_that_heartbeats_is_waited_for(reports: Any) -> None:
    for rep in reports[0]:
        assert rep["slow"]["ok"] and rep["slow"]["seconds"] > 3 * DEAD_AFTER, rep["slow"]
        assert rep["slow_async"]["ok"], rep["slow_async"]
    assert reports[0][0]["waited_log"], "the coordinator logged nothing while it waited"
    base = reports[1]
    assert shardsafe.CheckpointReader(base / "c").verify().ok


@pytest.mark.timeout(300)
def test_a_rank_that_cannot_see_the_work_directory_fails_every_rank(reports: Any) -> None:
    reps, base = reports
    if reps[1]["mount"] is not None:
        pytest.skip(f"no private mount namespace here: {reps[1]['mount']}")
    host = reps[1]["host"]
    for rep in reps:
        rec = rep["private"]
        assert not rec["ok"], rec
        assert f"rank 1 on host {host} cannot see the work directory" in rec["message"], rec
    assert sorted(os.listdir(base / "priv")) == []  # nothing committed, nothing left


@pytest.mark.timeout(300)
def test_a_frozen_rank_is_named_within_seconds(reports: Any) -> None:
    rec = reports[0][0]["frozen"]
    assert not rec["ok"] and "rank 1 on " in rec["message"], rec
    assert "stopped heartbeating" in rec["message"], rec
    assert rec["seconds"] < DEAD_AFTER + SLACK, rec
    assert not any(n.startswith(".e.") or n == "e" for n in reports[0][0]["listing"])
