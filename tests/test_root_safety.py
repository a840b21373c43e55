"""What a checkpoint root may hold besides the manager's own checkpoints, and who else may
use it: links to checkpoints elsewhere, odd files at reserved names, a second process."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
from stepstate import StepState

from shardsafe import CheckpointError, CheckpointManager
from shardsafe.directory import step_name
from shardsafe.lease import LEASE_SECONDS

STATE = StepState(rows=8, cols=4, world=2)


def _manager(root: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(root, async_save=False, **kw)


def test_retention_removes_a_linked_step_but_never_what_it_links_to(tmp_path: Path) -> None:
    elsewhere = tmp_path / "pretrained"
    _manager(elsewhere).save(0, STATE.whole_state(0))
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / step_name(0), root / step_name(0))  # start from it
    manager = _manager(root, keep_last=1)
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 0)
    for step in (1, 2):
        manager.save(step, STATE.whole_state(step))
    assert manager.steps() == [2]
    assert not os.path.lexists(root / step_name(0))  # the link went
    # what it linked to is untouched
    assert (elsewhere / step_name(0) / "manifest.json").exists()
    STATE.assert_holds_step(_manager(elsewhere).restore(STATE.whole_template()), 0)


def test_remove_of_a_linked_step_removes_the_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other"
    _manager(elsewhere).save(5, STATE.whole_state(5))
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / step_name(5), root / step_name(5))
    manager = _manager(root)
    manager._dir.remove(step_name(5))
    assert not os.path.lexists(root / step_name(5))
    assert sorted(os.listdir(elsewhere / step_name(5))) == ["data", "manifest.json"]


def _odd_lease(root: Path, step: int, kind: str) -> Path:
    """Something that is not a lease at the lease name of ``step``."""
    lock = root / f".{step_name(step)}.shardsafe-lock"
    if kind == "directory":
        lock.mkdir()
        (lock / "notes.txt").write_text("mine")
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "symlink":
        target = root.parent / "target.txt"
        target.write_text("keep me")
        os.symlink(target, lock)
    else:
        os.symlink(root.parent / "nowhere", lock)
    return lock


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "dangling"])
def test_an_odd_file_at_a_lease_name_counts_as_held(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    lock = _odd_lease(root, 3, kind)
    before = os.lstat(lock)
    manager = _manager(root)  # opening the root runs the clean-up: it must neither fail nor delete
    manager.save(2, STATE.whole_state(2))
    assert os.lstat(lock).st_ino == before.st_ino
    if kind == "directory":
        assert (lock / "notes.txt").read_text() == "mine"
    if kind == "symlink":
        assert (tmp_path / "target.txt").read_text() == "keep me"
    # only a save that needs the name says so, naming the path
    with pytest.raises(CheckpointError, match=str(lock)):
        manager.save(3, STATE.whole_state(3))
    assert os.lstat(lock).st_ino == before.st_ino
    assert manager.steps() == [1, 2]


SAVES = 60


def _trainer(root: str, conn: Any) -> None:
    """Forked child: save steps 1..SAVES synchronously; report every error."""
    errors = []
    try:
        manager = _manager(Path(root))
        for step in range(1, SAVES + 1):
            try:
                manager.save(step, STATE.whole_state(step))
            except Exception as e:
                errors.append(f"step {step}: {type(e).__name__}: {e}")
        manager.close()
    except BaseException as e:
        errors.append(f"crashed: {e!r}")
    finally:
        conn.send(errors)
        conn.close()
        os._exit(0)


def _poller(root: str, read_only: bool, stop: Any, conn: Any) -> None:
    """Forked child: open the root again and again while the trainer saves (an eval poller)."""
    opened = 0
    problems = []
    try:
        while not stop.is_set():
            try:
                manager = CheckpointManager(root, async_save=False, read_only=read_only)
                manager.steps()
                opened += 1
            except Exception as e:
                problems.append(f"{type(e).__name__}: {e}")
    finally:
        conn.send((opened, problems))
        conn.close()
        os._exit(0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("read_only", [False, True])
def test_a_second_process_opening_the_root_never_breaks_the_trainer(
    tmp_path: Path, read_only: bool
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    t_parent, t_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    poller = ctx.Process(target=_poller, args=(str(root), read_only, stop, p_child))
    trainer = ctx.Process(target=_trainer, args=(str(root), t_child))
    poller.start()
    trainer.start()
    try:
        assert t_parent.poll(500), "the trainer did not finish"
        errors = t_parent.recv()
        stop.set()
        assert p_parent.poll(60), "the poller did not stop"
        opened, problems = p_parent.recv()
    finally:
        stop.set()
        for proc in (trainer, poller):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert errors == [], errors[:3]
    assert problems == [], problems[:3]
    assert opened > 0
    assert (root / "latest").read_text() == f"{step_name(SAVES)}\n"
    assert _manager(root).steps() == list(range(1, SAVES + 1))


def test_a_read_only_manager_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    leftover = root / ".step_000000002.shardsafe-tmp-0123456789abcdef"
    leftover.mkdir()
    before = sorted(os.listdir(root))
    reader = CheckpointManager(root, async_save=False, read_only=True)
    (root / step_name(1) / "data" / "rank-00000-00.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        reader.restore(STATE.whole_template())
    with pytest.raises(CheckpointError, match="read_only"):
        reader.save(2, STATE.whole_state(2))
    with pytest.raises(CheckpointError, match="read_only"):
        reader.cleanup()
    assert sorted(os.listdir(root)) == before  # no clean-up, no mark
    with pytest.raises(ValueError, match="local_root"):
        CheckpointManager(root, read_only=True, local_root=tmp_path / "local")


def test_a_pointer_update_in_flight_is_left_alone_and_an_abandoned_one_removed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    fresh = root / ".latest.shardsafe-tmp-00000000000000aa"
    stale = root / ".latest.shardsafe-tmp-00000000000000bb"
    for f in (fresh, stale):
        f.write_text(f"{step_name(1)}\n")
    old = time.time() - 2 * LEASE_SECONDS
    os.utime(stale, (old, old))
    _manager(root)  # the clean-up on open
    assert fresh.exists() and not stale.exists()
