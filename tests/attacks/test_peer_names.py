"""Class 11: a file name that crosses a rank boundary never becomes a path outside a root.

The node-local tier moves files between ranks by name: a peer offers the files it sends, a
restoring rank says which files it needs, a place's leader reports the files it holds. Each
name is checked as a manifest's are (``manifest.json`` or ``data/<name>`` without ``..``)
before it is opened on either end; a refused name still has its bytes moved (zeros, dropped)
so that no rank is left waiting, and the failure reaches every rank as a ``CheckpointError``.
Here one rank of a real gloo group offers ``data/../../../../escaped``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import CheckpointError, CheckpointManager
from shardsafe.errors import CorruptCheckpointError
from shardsafe.peers import Copy
from tests.distributed import run_ranks
from tests.tierstate import COLS, ROWS, rows_of, state_of, train_step

pytestmark = pytest.mark.timeout(300)

HOSTILE = "data/../../../../escaped"
GOOD = "data/rank-00000-00.bin"


def escaped(tmp: Path) -> list[Path]:
    """Every file named ``escaped`` under the test's directory (the roots lie deep inside it)."""
    return sorted(tmp.rglob("escaped*"))


def _exchange(rank: int, world: int, tmp: str) -> Any:
    import torch.distributed as dist

    from shardsafe.storage.local import LocalStorage
    from shardsafe.transfer import exchange_files

    storage = LocalStorage(f"{tmp}/a/b/c/r{rank}")
    storage.write_bytes(f"src/{GOOD}", b"x" * 300)
    storage.make_dir("got/data")
    # rank 0 offers a good file between two hostile ones; rank 1 receives all three
    copies = [Copy(HOSTILE, 50, 0, 1), Copy(GOOD, 300, 0, 1), Copy(HOSTILE + "2", 7, 0, 1)]
    errors = exchange_files(
        dist.group.WORLD,
        rank,
        lambda r: r,
        copies,
        storage,
        lambda n: f"src/{n}",
        storage,
        lambda n: f"got/{n}",
        chunk_bytes=64,
    )
    got = storage.read_bytes(f"got/{GOOD}") if rank == 1 else None
    return errors, got


def test_exchange_refuses_a_name_outside_the_root_on_both_ends(tmp_path: Path) -> None:
    results = run_ranks(_exchange, 2, str(tmp_path), timeout=120)
    for rank, (errors, _) in enumerate(results):
        assert len(errors) == 2, (rank, errors)
        assert all("not a checkpoint file name" in e for e in errors), errors
    assert results[1][1] == b"x" * 300  # the good file in the same stream arrived intact
    assert escaped(tmp_path) == []


def _hostile_save(rank: int, world: int, tmp: str) -> Any:
    import shardsafe.saver as saver

    if rank == 1:  # this rank runs code that offers a name outside the root with its files
        real = saver.write_share

        def write_share(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            result["files"][HOSTILE] = 8
            return result

        saver.write_share = write_share  # type: ignore[assignment]
    host = "ab"[rank]
    mgr = CheckpointManager(
        f"{tmp}/x/y/z/persistent",
        local_root=f"{tmp}/x/y/z/local/{host}",
        node_id=host,
        persistent_every=100,
        dead_after=2.0,
    )
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    train_step(w, m, rows_of(rank, world), 1)
    mgr.save(1, state_of(rank, world, w, m, 1))
    try:
        mgr.wait()
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e), "steps": mgr.steps()}
    finally:
        mgr.close()
    return {"error": None}


def test_local_save_refuses_a_hostile_name_from_a_peer(tmp_path: Path) -> None:
    results = run_ranks(_hostile_save, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} committed a save with a hostile peer"
        assert "not a checkpoint file name" in r["message"], r["message"]
    assert escaped(tmp_path) == []
    committed = [p for p in (tmp_path / "x/y/z/local").rglob("manifest.json")]
    assert committed == []


def test_inventory_report_with_hostile_names_is_refused() -> None:
    from shardsafe.local_restore import _checked_report

    good = {"digest": "0" * 16, "files": {GOOD: 8}, "held": {"manifest.json": 10, GOOD: 8}}
    assert _checked_report({"steps": {"step_000000001": good}}, "rank 1 (b)")
    for bad in (
        {"steps": {"../step_000000001": good}},
        {"steps": {"step_000000001": {**good, "files": {HOSTILE: 8}}}},
        {"steps": {"step_000000001": {**good, "held": {"/etc/passwd": 8}}}},
        {"steps": {"step_000000001": {**good, "held": {GOOD: -1}}}},
        {"steps": ["step_000000001"]},
        {"nothing": 1},
    ):
        with pytest.raises(CorruptCheckpointError, match=r"rank 1 \(b\)"):
            _checked_report(bad, "rank 1 (b)")


def test_check_offered_takes_the_manifest_and_data_files_only() -> None:
    from shardsafe.peers import check_offered

    assert check_offered("manifest.json", "rank 0") == "manifest.json"
    assert check_offered(GOOD, "rank 0") == GOOD
    for bad in (HOSTILE, "data/..", "/data/x", "data/a/b", "latest", "", None, 3, "data/.hidden"):
        with pytest.raises(CorruptCheckpointError, match="rank 0 named the file"):
            check_offered(bad, "rank 0")
