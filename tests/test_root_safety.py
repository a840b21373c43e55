"""What a checkpoint root may hold besides the manager's own checkpoints, and who else may
use it: links to checkpoints elsewhere, odd files at reserved names, a second process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from stepstate import StepState

from shardsafe import CheckpointManager
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
