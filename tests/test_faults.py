"""Crash safety with real processes and real files: a rank SIGKILLed while writing, while
writing in the background, or in the middle of the commit; a full disk; a rank that never
arrives; two saves racing into one path.

In every case the previous checkpoint stays intact and stays the latest, the partial save is
refused by ``load`` and removed by the manager, and the surviving ranks raise an error naming
the culprit within the configured timeout instead of hanging. Each spawn of ranks costs
seconds, so one spawn checks several things; the ranks report through JSON files because a
killed rank makes ``run_ranks`` raise instead of returning the survivors' results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import RankFailure, run_ranks
from faultinject import (
    kill_self,
    no_space,
    patch_commit_then_die,
    patch_data_writes,
    patch_quota,
    patch_slow_data_writes,
)
from stepstate import StepState

import shardsafe
import shardsafe.convert
from shardsafe import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReader,
    IncompleteCheckpointError,
    Saver,
    ShardedTensor,
)
from shardsafe.manager import CheckpointManager

ST = ShardedTensor
WORLD = 2
ROWS, COLS = 64, 1024  # 256 KiB of float32, half on each rank
TIMEOUT = 6.0  # Saver/load timeout of the faulty operations
STUCK_TIMEOUT = 2.0  # the same where a rank never arrives: the wait always ends in it
DEAD_AFTER = 3.0  # a killed rank is named by its silence this long (the floor, MIN_DEAD_AFTER)
SLACK = 15.0  # scheduling noise allowed on top of it (a hang would take the group's 60 s)


# --------------------------------------------------------------------------- state dicts


STATE = StepState(ROWS, COLS, WORLD)
full_w = STATE.full_w
rank_state = STATE.rank_state
rank_template = STATE.rank_template
whole_state = STATE.whole_state
whole_template = STATE.whole_template
assert_holds_step = STATE.assert_holds_step


def record(fn: Callable[[], Any]) -> dict[str, Any] | None:
    """What ``fn`` raised (type, message, whether a CheckpointError, seconds), or None."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {
            "type": type(e).__name__,
            "checkpoint_error": isinstance(e, CheckpointError),
            "message": str(e),
            "seconds": time.monotonic() - t0,
        }
    return None


def related(root: str | Path, name: str) -> list[str]:
    """``name`` and its hidden siblings (work directories, lock) in ``root``."""
    return sorted(n for n in os.listdir(root) if n == name or n.startswith(f".{name}."))


# --------------------------------------------------------------------------- SIGKILL


CRASHES = {
    # mode: (rank killed, async save?)
    "sync-write": (1, False),
    "async-write": (1, True),
    "sync-commit": (0, False),
    "async-commit": (0, True),
}


def _crash(rank: int, world: int, root: str, out: str, mode: str) -> None:
    victim, use_async = CRASHES[mode]
    groups = [dist.new_group([r]) for r in range(world)]  # for the survivor to go on alone
    manager = CheckpointManager(root, async_save=False)
    manager.save(1, rank_state(rank, 1))  # the good, committed checkpoint
    manager.close()
    target = manager.checkpoint_path(2)
    name = os.path.basename(target)

    if rank == victim:
        if mode.endswith("write"):
            patch_data_writes(32 << 10, kill_self)  # dies with 32 KiB of its 128 KiB written
        else:
            patch_commit_then_die()
    saver = Saver(timeout=TIMEOUT, dead_after=DEAD_AFTER)

    def faulty_save() -> None:
        if use_async:
            saver.async_save(rank_state(rank, 2), target).result(timeout=TIMEOUT + 120)
        else:
            saver.save(rank_state(rank, 2), target)

    report: dict[str, Any] = {"error": record(faulty_save)}
    # only the survivor gets here
    report["after"] = related(root, name)
    if rank == 0:
        # the coordinator survived: it cleaned up, and the path is free for a retry right away
        solo = groups[0]
        report["load_partial"] = record(
            lambda: shardsafe.load(rank_template(0), target, process_group=solo)
        )
        retry = Saver(solo, timeout=TIMEOUT)
        retry.save(whole_state(2), target)
        got = shardsafe.load(whole_template(), target, process_group=solo)
        report["retry_ok"] = torch.equal(got["w"], full_w(2))
        shutil.rmtree(target)  # step 2 stays uncommitted for the checks in the test
        retry.close()
    else:
        # the coordinator (and the store it hosted) died: later calls fail fast, never hang
        report["later_load"] = record(
            lambda: shardsafe.load(rank_template(1), manager.checkpoint_path(1), timeout=TIMEOUT)
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(CRASHES))
def test_sigkilled_rank_leaves_the_previous_checkpoint_latest(tmp_path: Path, mode: str) -> None:
    victim, _ = CRASHES[mode]
    survivor = 1 - victim
    root, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_crash, WORLD, str(root), str(out), mode, timeout=150)
    assert info.value.errors == {victim: "process exited with code -9"}, info.value.errors
    assert time.monotonic() - started < 150
    report = json.loads((out / f"rank{survivor}.json").read_text())

    # the survivor raised a DistributedError naming the dead rank, within the timeout
    err = report["error"]
    assert err is not None and err["checkpoint_error"], report
    assert err["type"] == "DistributedError", err
    assert f"rank {victim}" in err["message"], err["message"]
    assert err["seconds"] < TIMEOUT + SLACK, err
    if victim == 1:
        assert "rank 1 on " in err["message"] and "stopped heartbeating" in err["message"]
        # the coordinator removed the partial save and its lock at once; the path was free again
        assert report["after"] == [], report["after"]
        assert report["load_partial"]["type"] == "CheckpointNotFoundError", report["load_partial"]
        assert report["retry_ok"]
    else:
        assert "coordinator" in err["message"], err["message"]
        later = report["later_load"]
        assert later is not None and later["type"] == "DistributedError", later
        assert later["seconds"] < TIMEOUT + SLACK, later

    # what the crash left: nothing (coordinator survived) or the uncommitted work directory
    name = "step_000000002"
    left = related(root, name)
    target = root / name
    if victim == 0:
        work = [n for n in left if ".shardsafe-tmp-" in n]
        assert len(work) == 1 and f".{name}.shardsafe-lock" in left, left
        # killed after the complete manifest reached the work directory, before the rename
        assert (root / work[0] / "manifest.json").is_file()
        with pytest.raises(IncompleteCheckpointError, match="uncommitted save"):
            shardsafe.load(whole_template(), target)
    else:
        assert left == [], left
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load(whole_template(), target)
    with pytest.raises(CheckpointNotFoundError):
        CheckpointReader(target)

    # the previous checkpoint is intact and still the pointer's; the manager removes the rest,
    # except a complete checkpoint: killed between its manifest and its rename, step 2 is
    # complete, and clean-up never deletes what holds a complete manifest (it renames it in)
    step1 = root / "step_000000001"
    assert CheckpointReader(step1).verify().ok
    manager = CheckpointManager(root, async_save=False)  # the coordinator cleans up on start
    restored = ["step_000000002"] if victim == 0 else []
    assert sorted(os.listdir(root)) == ["latest", "step_000000001", *restored]
    # a complete step put back is the newest committed step: it is the latest, although the
    # pointer (written before it committed) still names step 1
    newest = 2 if restored else 1
    assert manager.steps() == [1, *([2] if restored else [])] and manager.latest_step() == newest
    if restored:
        assert CheckpointReader(target).verify().ok
    assert_holds_step(manager.restore(whole_template()), newest)
    # and the next save into the crashed step's name works
    manager.save(2, whole_state(2))
    assert manager.latest_step() == 2
    assert_holds_step(manager.restore(whole_template()), 2)
    manager.close()


# --------------------------------------------------------------------------- full disk, stuck rank, racing saves


SMALL_FS = "1m"  # tmpfs size
QUOTA = 1 << 20  # the same in the fallback, per process


@contextmanager
def small_filesystem(path: Path) -> Iterator[bool]:
    """A 1 MiB tmpfs at ``path`` (True), or a plain directory when mounting is not permitted."""
    path.mkdir()
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount"):
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS}", "tmpfs", str(path)],
            capture_output=True,
            timeout=30,
        )
        mounted = proc.returncode == 0
    try:
        yield mounted
    finally:
        if mounted and subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def big_state(rank: int) -> dict[str, Any]:
    """1 MiB per rank: two ranks cannot fit a 1 MiB file system."""
    return {
        "w": ST.from_rank_offsets("w", torch.full((512, 512), float(rank)), (0, rank, WORLD)),
        "step": 3,
    }


def small_state(rank: int) -> dict[str, Any]:
    return {
        "w": ST.from_rank_offsets("w", torch.full((64, 32), float(rank)), (0, rank, WORLD)),
        "step": 4,
    }


def _resources(rank: int, world: int, base: str, mounted: bool) -> dict[str, Any]:
    small = os.path.join(base, "small")
    rec: dict[str, Any] = {}

    def on_small_fs(fn: Callable[[], Any]) -> dict[str, Any] | None:
        undo = None if mounted else patch_quota(small, QUOTA)  # a fresh budget: freed space
        try:
            return record(fn)
        finally:
            if undo is not None:
                undo()

    def listing(path: str) -> list[str]:
        dist.barrier()
        names = sorted(os.listdir(path))
        dist.barrier()
        return names

    # -- a full disk: the blocking save, then the async one, fail on every rank
    rec["full_sync"] = on_small_fs(
        lambda: shardsafe.save(big_state(rank), os.path.join(small, "ck"))
    )
    rec["full_sync_listing"] = listing(small)

    def async_full() -> None:
        handle = shardsafe.async_save(big_state(rank), os.path.join(small, "ck_async"))
        handle.result(timeout=120)

    rec["full_async"] = on_small_fs(async_full)
    rec["full_async_listing"] = listing(small)
    # the failed saves gave their space back: a small save into the same file system works
    rec["small_fits"] = on_small_fs(
        lambda: shardsafe.save(small_state(rank), os.path.join(small, "ok"))
    )
    rec["small_listing"] = listing(small)
    # the processes live on: a save into a healthy location works, and loads back
    healthy = os.path.join(base, "healthy")
    shardsafe.save(big_state(rank), healthy)

    def columns(r: int) -> dict[str, Any]:  # another layout: a column block of [1024, 512]
        return {"w": ST.from_rank_offsets("w", torch.zeros(1024, 256), (1, r, WORLD))}

    got = shardsafe.load(columns(rank), healthy)
    expected = torch.cat([torch.zeros(512, 256), torch.ones(512, 256)])
    rec["healthy_ok"] = bool(torch.equal(got["w"], expected)) and got["step"] == 3

    # -- two processes, each saving alone, into the same path at the same moment
    groups = [dist.new_group([r]) for r in range(world)]
    undo = patch_slow_data_writes(1.0)  # both saves are surely in flight together
    race = os.path.join(base, "race")
    dist.barrier()
    rec["race"] = record(
        lambda: shardsafe.save(
            {"v": ST.from_rank_offsets("v", torch.full((1000,), float(rank)))},
            race,
            process_group=groups[rank],
        )
    )
    undo()
    rec["race_listing"] = listing(base)

    # -- a rank that never reaches the collective: rank 1 waits for rank 0 to finish
    done = os.path.join(base, "stuck-done")
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return rec
    saver = Saver(timeout=STUCK_TIMEOUT)
    rec["stuck_save"] = record(lambda: saver.save(small_state(0), os.path.join(base, "stuck")))
    rec["stuck_after"] = related(base, "stuck")
    rec["stuck_async"] = record(
        lambda: saver.async_save(small_state(0), os.path.join(base, "stuck"))
    )
    rec["stuck_load"] = record(lambda: shardsafe.load(columns(0), healthy, timeout=STUCK_TIMEOUT))
    Path(done).touch()
    return rec


@pytest.fixture(scope="module")
def resources(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, bool]:
    base = tmp_path_factory.mktemp("resources")
    with small_filesystem(base / "small") as mounted:
        out = run_ranks(_resources, WORLD, str(base), mounted, timeout=150)
        leftover = sorted(os.listdir(base / "small"))
    assert leftover == ["ok"], leftover
    return out, base, mounted


def _same_on_every_rank(results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    recs = [r[name] for r in results]
    assert all(rec is not None for rec in recs), f"{name}: some rank did not raise: {recs}"
    assert len({(rec["type"], rec["message"]) for rec in recs}) == 1, recs
    assert recs[0]["checkpoint_error"], recs[0]
    return recs[0]


@pytest.mark.timeout(180)
def test_full_disk_fails_on_every_rank_and_leaves_nothing(
    resources: tuple[list[dict[str, Any]], Path, bool],
) -> None:
    """On a real 1 MiB tmpfs where mounting is permitted, else with an ENOSPC-raising storage."""
    results, base, _ = resources
    for name in ("full_sync", "full_async"):
        rec = _same_on_every_rank(results, name)
        assert "No space left on device" in rec["message"], rec["message"]
        assert rec["seconds"] < 60, rec
    for r in results:
        # nothing committed, no work directory, no lock
        assert r["full_sync_listing"] == [] and r["full_async_listing"] == []
        assert r["small_fits"] is None and r["small_listing"] == ["ok"]
        assert r["healthy_ok"]
    assert not (base / "small" / "ck").exists()


@pytest.mark.timeout(180)
def test_two_processes_saving_into_one_path(
    resources: tuple[list[dict[str, Any]], Path, bool],
) -> None:
    results, base, _ = resources
    outcomes = [r["race"] for r in results]
    winners = [rank for rank, rec in enumerate(outcomes) if rec is None]
    assert len(winners) == 1, outcomes
    (loser,) = [rec for rec in outcomes if rec is not None]
    assert loser["type"] == "CheckpointExistsError", loser
    assert "another save" in loser["message"] or "already exists" in loser["message"]
    for r in results:
        assert r["race_listing"].count("race") == 1
        assert not [n for n in r["race_listing"] if n.startswith(".race")]
    reader = CheckpointReader(base / "race")
    assert reader.verify().ok
    assert torch.equal(reader.read_tensor("v"), torch.full((1000,), float(winners[0])))


@pytest.mark.timeout(180)
def test_rank_that_never_arrives_is_named_not_waited_for(
    resources: tuple[list[dict[str, Any]], Path, bool],
) -> None:
    results, base, _ = resources
    rec = results[0]
    for name, stage in (
        ("stuck_save", "save planning"),
        ("stuck_async", "save planning"),
        ("stuck_load", "load"),
    ):
        err = rec[name]
        assert err is not None and err["type"] == "DistributedError", err
        assert f"rank 1 did not reach '{stage}' within {STUCK_TIMEOUT:.0f} s" in err["message"], (
            err["message"]
        )
        assert STUCK_TIMEOUT - 0.5 <= err["seconds"] < STUCK_TIMEOUT + SLACK, err
    assert rec["stuck_after"] == []  # the coordinator removed its work directory and lock
    assert not (base / "stuck").exists()


# --------------------------------------------------------------------------- racing threads


def race_threads(path: Path, second: str) -> dict[int, BaseException | None]:
    """Two threads, each with its own Saver, save different values into ``path`` at once."""
    barrier = threading.Barrier(2)
    outcomes: dict[int, BaseException | None] = {}

    def run(i: int) -> None:
        saver = Saver()
        sd = {"v": ST.from_rank_offsets("v", torch.full((4096,), float(i)))}
        barrier.wait()
        try:
            if i == 1 and second == "async_save":
                saver.async_save(sd, path).result(timeout=60)
            else:
                saver.save(sd, path)
            outcomes[i] = None
        except BaseException as e:
            outcomes[i] = e
        finally:
            saver.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", ["save", "async_save"])
def test_two_threads_saving_into_one_path(tmp_path: Path, second: str) -> None:
    undo = patch_slow_data_writes(0.5)  # both saves are surely in flight together
    try:
        for round_ in range(3):
            path = tmp_path / f"ck{round_}"
            outcomes = race_threads(path, second)
            winners = [i for i, e in outcomes.items() if e is None]
            assert len(outcomes) == 2 and len(winners) == 1, outcomes
            (error,) = [e for e in outcomes.values() if e is not None]
            assert isinstance(error, CheckpointExistsError), error
            reader = CheckpointReader(path)
            assert reader.verify().ok
            assert torch.equal(reader.read_tensor("v"), torch.full((4096,), float(winners[0])))
            assert sorted(os.listdir(tmp_path)) == [f"ck{i}" for i in range(round_ + 1)]
    finally:
        undo()


def test_full_disk_single_process_error_names_the_condition(tmp_path: Path) -> None:
    """The ENOSPC error text survives the trip through the error records, without ranks."""
    undo = patch_data_writes(1000, no_space)
    try:
        with pytest.raises(CheckpointError, match="No space left on device") as info:
            shardsafe.save(whole_state(1), tmp_path / "ck")
    finally:
        undo()
    assert isinstance(info.value, CheckpointError)
    assert os.listdir(tmp_path) == []
    shardsafe.save(whole_state(1), tmp_path / "ck")
    assert_holds_step(shardsafe.load(whole_template(), tmp_path / "ck"), 1)


def _files_of(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("fmt", ["torch", "hf", "dcp", "megatron", "shardsafe"])
def test_convert_onto_its_own_source_is_refused_and_the_source_survives(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``convert X X --overwrite`` once deleted a DCP/Megatron checkpoint before reading it and
    wrote wrong tensors over a Hugging Face folder. A destination that is (by any spelling:
    a symlink, ``..``), holds or lies inside the source is refused, and the source is untouched."""
    from shardsafe.cli import main

    model = torch.nn.Linear(64, 48)
    shardsafe.save({"model": model.state_dict(), "step": 3}, tmp_path / "orig")
    src = tmp_path / ("src.pt" if fmt == "torch" else "src")
    extra = ["--max-shard-size", "4KB"] if fmt == "hf" else []  # several shards
    assert main(["convert", str(tmp_path / "orig"), str(src), "--to", fmt, *extra]) == 0
    before = _files_of(src)
    (tmp_path / "link").symlink_to(src)
    spellings = [src, tmp_path / "link", tmp_path / "x" / ".." / src.name, tmp_path]
    if fmt != "torch":
        spellings.append(src / "inside")
    for dst in spellings:
        capsys.readouterr()
        code = main(["convert", str(src), str(dst), "--to", fmt, "--overwrite", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "never writes where it reads" in err, (dst, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert _files_of(src) == before, dst
    assert not (src / "inside").exists()
    back = shardsafe.convert.open_source(src)
    assert torch.equal(back.read_tensor("model.weight"), model.weight.detach())
