"""What a checkpoint root may hold besides the manager's own checkpoints, and who else may
use it: links to checkpoints elsewhere, odd files at reserved names, a second process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from stepstate import StepState

from shardsafe import CheckpointError, CheckpointManager
from shardsafe.directory import step_name

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
