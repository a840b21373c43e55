"""Retention, the one policy of both tiers: which committed steps stay after a commit."""

from __future__ import annotations

from pathlib import Path

import torch

import shardsafe
from shardsafe.directory import StepDirectory, step_name
from shardsafe.retention import Retention, retain


def _steps(root: Path, steps: range) -> StepDirectory:
    for s in steps:
        shardsafe.save({"w": torch.full((2,), float(s))}, root / step_name(s))
    return StepDirectory(root)


def test_policies_keep_intact_steps_and_treat_damage_as_asked(tmp_path: Path) -> None:
    d = _steps(tmp_path, range(1, 6))
    d.mark_damaged(step_name(4), "a flipped byte")
    committed, latest = d.committed(), step_name(5)
    names = {s: step_name(s) for s in range(1, 6)}
    # a damaged step never pushes out an intact one; the manager keeps it while newer than the oldest kept
    assert Retention(2).doomed(d, committed, latest) == [names[1], names[2]]
    # the local tier's disk keeps what restores only
    assert Retention(2, inspect_damaged=False).doomed(d, committed, latest) == [
        names[1],
        names[2],
        names[4],
    ]
    assert Retention(2, keep_every=2).doomed(d, committed, latest) == [names[1]]
    assert Retention(None).doomed(d, committed, latest) == []


def test_retain_points_at_the_new_step_deletes_and_cleans(tmp_path: Path) -> None:
    d = _steps(tmp_path, range(1, 4))
    d.mark_damaged(step_name(3), "an earlier restore failed")
    (tmp_path / f".{step_name(9)}.shardsafe-tmp-0123456789abcdef").mkdir()  # a crashed save's
    deleted = retain(d, step_name(3), lambda c: Retention(1).doomed(d, c, step_name(3)))
    assert deleted == [step_name(1), step_name(2)]
    assert d.committed() == [step_name(3)] and d.latest() == step_name(3)
    assert d.damaged() == {}  # a step that committed again is no longer marked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_name(3)]
