"""Runs sharing one local root: a node's disk outlives the job, and ``/local_nvme/ckpt`` is the
same path for every job on the node. Each run keeps its local steps in its own directory (named
by its persistent root, or by ``run_id``), so no run restores another's step as its own, and no
run's retention deletes another's steps; steps of an earlier version (directly in the local
root, naming no run) are neither restored nor deleted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import CheckpointError, CheckpointManager
from tests.distributed import run_ranks
from tests.tierstate import COLS, ROWS, reference, rows_of, state_of, train_and_save

pytestmark = pytest.mark.timeout(300)


def manager(persistent: Path | str, local: Path | str, host: str = "a", **kw: Any) -> Any:
    return CheckpointManager(
        persistent,
        local_root=local,
        node_id=host,
        local_every=1,
        persistent_every=100,
        replicas=1,
        dead_after=2.0,
        **kw,
    )


def restored(mgr: Any, rank: int = 0, world: int = 1) -> dict[str, Any]:
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    m = torch.full_like(w, float("nan"))
    state = mgr.restore(state_of(rank, world, w, m, 0))
    w_ref, m_ref = reference(state["step"])
    rows = rows_of(rank, world)
    return {
        "step": mgr.restored_step,
        "tier": mgr.restored_tier,
        "exact": torch.equal(w, w_ref[rows]) and torch.equal(m, m_ref[rows]),
    }


def local_steps(local: Path) -> list[str]:
    """Every committed local step under ``local``, as ``<dir>/<step>``, whatever the run."""
    return sorted(str(p.parent.relative_to(local)) for p in local.glob("**/step_*/manifest.json"))


def test_two_runs_sharing_a_local_root_restore_and_keep_their_own_steps(tmp_path: Path) -> None:
    node = tmp_path / "local_nvme"
    first = manager(tmp_path / "first", node)
    train_and_save(first, 5)  # local steps 4 and 5 kept
    first.close()
    second = manager(tmp_path / "second", node)
    train_and_save(second, 2)  # fewer steps: the other run's are newer
    second.close()
    again = manager(tmp_path / "second", node)
    got = restored(again)
    again.close()
    assert got == {"step": 2, "tier": "local", "exact": True}
    # the second run's retention deleted none of the first run's steps, and kept its own
    again = manager(tmp_path / "first", node)
    assert restored(again) == {"step": 5, "tier": "local", "exact": True}
    again.close()
    steps = local_steps(node)
    assert sorted(s.rsplit("/", 1)[1] for s in steps) == [
        "step_000000001",
        "step_000000002",
        "step_000000004",
        "step_000000005",
    ], steps
    assert len({s.rsplit("/", 1)[0] for s in steps}) == 2, steps


def test_run_id_tells_runs_of_one_persistent_root_apart(tmp_path: Path) -> None:
    node = tmp_path / "local_nvme"
    old = manager(tmp_path / "ckpt", node, run_id="run-1")
    train_and_save(old, 4)
    old.close()
    # the same persistent root started afresh under another run id: the old steps are not its
    new = manager(tmp_path / "ckpt", node, run_id="run-2")
    train_and_save(new, 1)
    new.close()
    assert restored(manager(tmp_path / "ckpt", node, run_id="run-2"))["step"] == 1
    # a run id keeps the local steps of a run whose persistent root moved
    moved = manager(tmp_path / "elsewhere", node, run_id="run-1")
    assert restored(moved) == {"step": 4, "tier": "local", "exact": True}
    moved.close()
    with pytest.raises(ValueError, match="run_id"):
        manager(tmp_path / "ckpt", node, run_id="")


def test_steps_of_an_earlier_version_are_neither_restored_nor_deleted(
    tmp_path: Path, caplog: Any
) -> None:
    node = tmp_path / "local_nvme"
    # an earlier version wrote its local steps directly in the local root, naming no run
    earlier = manager(tmp_path / "ckpt", node)
    train_and_save(earlier, 3)
    earlier.close()
    (run_dir,) = node.glob("run-*")
    for step in run_dir.glob("step_*"):
        step.rename(node / step.name)
    (run_dir / "latest").rename(node / "latest")
    legacy = sorted(p.name for p in node.glob("step_*"))
    assert legacy == ["step_000000002", "step_000000003"]
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        mgr = manager(tmp_path / "ckpt", node)
    assert "earlier shardsafe version" in caplog.text and "step_000000002" in caplog.text
    train_and_save(mgr, 1)
    assert restored(mgr) == {"step": 1, "tier": "local", "exact": True}
    mgr.close()
    assert sorted(p.name for p in node.glob("step_*")) == legacy
    assert all((node / n / "manifest.json").exists() for n in legacy)


def test_a_run_directory_naming_another_run_is_refused(tmp_path: Path) -> None:
    from shardsafe.local_tier import RUN_FILE, run_dir_name, run_identity

    node = tmp_path / "local_nvme"
    identity = run_identity(str(tmp_path / "ckpt"))
    run_dir = node / run_dir_name(identity)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"persistent_root": "/somewhere/else"}))
    with pytest.raises(CheckpointError, match="names another run"):
        manager(tmp_path / "ckpt", node)
    # a run.json cut short by a crash is written again
    (run_dir / RUN_FILE).write_text("")
    manager(tmp_path / "ckpt", node).close()
    assert json.loads((run_dir / RUN_FILE).read_text()) == identity


def _two_hosts(rank: int, world: int, tmp: str, run: str, last: int) -> Any:
    host = "ab"[rank]
    mgr = manager(f"{tmp}/{run}", f"{tmp}/node-{host}", host)
    if last:
        train_and_save(mgr, last, rank, world)
        mgr.close()
        return None
    got = restored(mgr, rank, world)
    mgr.close()
    return got


def test_two_runs_on_two_hosts_sharing_their_local_roots(tmp_path: Path) -> None:
    run_ranks(_two_hosts, 2, str(tmp_path), "first", 4, timeout=120)
    run_ranks(_two_hosts, 2, str(tmp_path), "second", 2, timeout=120)
    second = run_ranks(_two_hosts, 2, str(tmp_path), "second", 0, timeout=120)
    assert second == [{"step": 2, "tier": "local", "exact": True}] * 2
    first = run_ranks(_two_hosts, 2, str(tmp_path), "first", 0, timeout=120)
    assert first == [{"step": 4, "tier": "local", "exact": True}] * 2
