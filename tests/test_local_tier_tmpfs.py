"""The node-local tier in host memory: ``local_root`` on a RAM disk (tmpfs, ``/dev/shm``).

2 hosts x 2 ranks (hosts as node ids) save locally every step with their local roots under
``/dev/shm``; the processes end (as a killed job would), and the steps are restored from the RAM
disks; then host b's RAM disk is lost (a reboot) and a restart on 3 ranks, one on a fresh host,
resumes from the newest local step through the copies host a holds, exactly. Even with
``direct_io="always"`` no file on the RAM disk is opened with ``O_DIRECT``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import CheckpointManager, ShardedTensor
from shardsafe.io_policy import in_memory
from tests.distributed import preload_forkserver, run_ranks
from tests.tierstate import COLS, ROWS, reference, rows_of, state_of, train_step

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def shm() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm") or not in_memory("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="shardsafe-test-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _no_direct_io_under(shm: str) -> None:
    """In this process, opening a file under ``shm`` with ``O_DIRECT`` fails the test (recent
    kernels accept it on tmpfs: only the direct-I/O policy keeps it away)."""
    from shardsafe import directio

    real = directio._open_direct

    def guarded(storage: Any, rel: str) -> int | None:
        if storage.path(rel).startswith(shm):
            raise AssertionError(f"O_DIRECT tried on the RAM disk: {storage.path(rel)}")
        return real(storage, rel)

    directio._open_direct = guarded  # type: ignore[assignment]


def _manager(tmp: str, shm: str, host: str) -> CheckpointManager:
    _no_direct_io_under(shm)
    return CheckpointManager(
        f"{tmp}/persistent",
        local_root=f"{shm}/{host}",
        node_id=host,
        local_every=1,
        persistent_every=10,
        replicas=1,
        dead_after=2.0,
        run_id="ram",
        direct_io="always",  # even so, never on the RAM disk
    )


BIG = 12 * 8192  # float64 elements: each rank's piece is large enough for direct I/O


def big_of(rank: int, world: int, step: int) -> torch.Tensor:
    per = BIG // world
    return (torch.arange(BIG, dtype=torch.float64) * step)[rank * per : (rank + 1) * per].clone()


def with_big(state: dict[str, Any], big: torch.Tensor, rank: int, world: int) -> dict[str, Any]:
    return {**state, "big": ShardedTensor.from_rank_offsets("big", big, (0, rank, world))}


def _train(rank: int, world: int, tmp: str, shm: str, hosts: list[str], last: int) -> Any:
    mgr = _manager(tmp, shm, hosts[rank])
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    big = big_of(rank, world, 0)
    state = with_big(state_of(rank, world, w, m, 0), big, rank, world)
    for step in range(1, last + 1):
        train_step(w, m, rows_of(rank, world), step)
        big.copy_(big_of(rank, world, step))
        state["step"] = step
        mgr.save(step, state)
        mgr.wait()
    mgr.close()
    return None


def _restore(rank: int, world: int, tmp: str, shm: str, hosts: list[str]) -> Any:
    mgr = _manager(tmp, shm, hosts[rank])
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    m = torch.full_like(w, float("nan"))
    big = torch.full((BIG // world,), float("nan"), dtype=torch.float64)
    state = mgr.restore(with_big(state_of(rank, world, w, m, 0), big, rank, world))
    mgr.close()
    return {
        "step": state["step"],
        "tier": mgr.restored_tier,
        "w": w.numpy(),
        "m": m.numpy(),
        "big": big.numpy(),
    }


def check_exact(results: list[dict[str, Any]], step: int) -> None:
    w_ref, m_ref = reference(step)
    world = len(results)
    for rank, r in enumerate(results):
        assert r["step"] == step and r["tier"] == "local", r
        assert torch.equal(torch.as_tensor(r["w"]), w_ref[rows_of(rank, world)]), rank
        assert torch.equal(torch.as_tensor(r["m"]), m_ref[rows_of(rank, world)]), rank
        assert torch.equal(torch.as_tensor(r["big"]), big_of(rank, world, step)), rank


def test_local_tier_on_a_ram_disk_survives_the_job_and_a_lost_host(
    tmp_path: Path, shm: Path
) -> None:
    preload_forkserver("shardsafe")
    args = (str(tmp_path), str(shm))
    run_ranks(_train, 4, *args, ["a", "a", "b", "b"], 3, timeout=240)
    assert not (tmp_path / "persistent").exists() or not [
        p for p in (tmp_path / "persistent").iterdir() if p.name.startswith("step_")
    ]
    for host in ("a", "b"):  # each RAM disk holds its ranks' files and copies of the other's
        (run,) = (shm / host).glob("run-*")
        data = run / "step_000000003" / "data"
        assert {p.name.split("-")[1] for p in data.iterdir()} == {
            "00000",
            "00001",
            "00002",
            "00003",
        }
    # the job ended (its processes are gone, as after a kill): the RAM disks hold the steps
    check_exact(run_ranks(_restore, 4, *args, ["a", "a", "b", "b"], timeout=240), 3)
    # host b rebooted: its RAM disk is empty; the copies on host a cover it
    shutil.rmtree(shm / "b")
    check_exact(run_ranks(_restore, 3, *args, ["a", "a", "c"], timeout=240), 3)
