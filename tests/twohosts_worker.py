"""One rank of the two-host tests, started by torchrun inside a host's namespaces.

    python -m torch.distributed.run ... twohosts_worker.py MODE ROOT MARKER

``save``: save steps 1 and 2 on every rank, then step 3, in which rank 0 writes MARKER once
its share is written and then waits to be killed with its host. ``resume``: restore the
latest step, report what is left of step 3, wait for its lease to expire, clean up, save
steps 3 and 4. ``private``: save into ROOT (over which one host has its own file system)
and report the error. ``tier``: train with a node-local tier (LOCAL, the host's own disk)
every step and persistent saves every 10; after step 13 rank 0 writes MARKER in the middle of
saving step 14 and waits to be killed with its host. ``tier-resume``: restore (from the newest
complete local step), report it, train on to step 20 and compare with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardsafe
from shardsafe import ShardedTensor
from shardsafe.manager import CheckpointManager

ROWS = 24  # divisible by every world size used
# long enough that the restart begins while it is valid (its age then: 4-5 s here), and the
# restart's save of the same step waits for it to expire
LEASE_TTL = 15.0


def state(rank: int, world: int, step: int) -> dict[str, Any]:
    rows = ROWS // world
    data = torch.arange(rank * rows * 8, (rank + 1) * rows * 8, dtype=torch.float32)
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", (data.view(rows, 8) + step * 1000), (0, rank, world)
        ),
        "step": step,
    }


def template(rank: int, world: int) -> tuple[dict[str, Any], torch.Tensor]:
    t = torch.zeros(ROWS // world, 8)
    return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world)), "step": None}, t


def tiered(root: str, local: str) -> CheckpointManager:
    return CheckpointManager(
        root,
        local_root=local,
        local_every=1,
        persistent_every=10,
        replicas=1,
        dead_after=3.0,
        lease_ttl=LEASE_TTL,
    )


def train_with_tiers(mode: str, root: str, marker: str, local: str, report: dict[str, Any]) -> None:
    from tierstate import COLS, ROWS, reference, rows_of, state_of, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    m = tiered(root, local)
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    opt = torch.full_like(w, float("nan"))
    st = state_of(rank, world, w, opt, 0)
    start = 0
    if mode == "tier":
        w.zero_()
        opt.zero_()
    else:
        st = m.restore(st)
        start = st["step"]
        report["restored"] = m.restored_step
        report["tier"] = m.restored_tier
    for step in range(start + 1, 21):
        train_step(w, opt, rows_of(rank, world), step)
        st["step"] = step
        m.save(step, st)
        if mode == "tier" and step == 14:
            if rank == 0:
                Path(marker).write_text(socket.gethostname())
                time.sleep(600)  # until the host is killed
            try:
                m.wait()
                report["error"] = None
            except Exception as e:
                report["error"] = str(e)
            Path(f"{marker}.rank{rank}.json").write_text(json.dumps(report))
            _await_host_reports(marker, report["host"])
            os._exit(1)
        m.wait()
    w_ref, m_ref = reference(20)
    report["exact"] = bool(
        torch.equal(w, w_ref[rows_of(rank, world)])
        and torch.equal(opt, m_ref[rows_of(rank, world)])
    )
    report["local_steps"] = sorted(n for n in os.listdir(local) if n.startswith("step_"))
    m.close()


def _await_host_reports(marker: str, host: str, limit: float = 120.0) -> None:
    """Exit only once every rank of this host has reported. torchrun stops a host's other ranks
    as soon as one exits non-zero, and a rank that is not its host's leader is done with a
    local save before the leader has published the step on the host's disk (manifest, fsyncs,
    rename, pointer, retention): exiting at once let torchrun kill the leader half-way through
    on a loaded machine, leaving three steps (or a stray one) on the survivor's disk."""
    mine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done = 0
        for path in Path(marker).parent.glob(f"{Path(marker).name}.rank*.json"):
            try:
                done += json.loads(path.read_text()).get("host") == host
            except ValueError:  # being written
                pass
        if done >= mine:
            return
        time.sleep(0.1)


def main() -> None:
    mode, root, marker = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"host": socket.gethostname(), "world": world}
    if mode in ("tier", "tier-resume"):
        train_with_tiers(mode, root, marker, sys.argv[4], report)
    elif mode == "save":
        m = CheckpointManager(root, async_save=False, dead_after=3.0, lease_ttl=LEASE_TTL)
        for step in (1, 2):
            m.save(step, state(rank, world, step))

        def stall(stage: str, done: int, total: int) -> None:
            if rank == 0 and stage == "written":
                Path(marker).write_text(socket.gethostname())
                time.sleep(600)  # until the host is killed

        m.save(3, state(rank, world, 3), progress=stall)
    elif mode == "resume":
        lock = Path(root, ".step_000000003.shardsafe-lock")
        lease = json.loads(lock.read_text()) if rank == 0 else {}
        report["lease_age_at_start"] = time.time() - lease.get("renewed", 0)
        m = CheckpointManager(root, async_save=False, dead_after=3.0, lease_ttl=LEASE_TTL)
        tpl, t = template(rank, world)
        out = m.restore(tpl)
        expect = state(rank, world, out["step"])["w"].data
        report["restored"] = out["step"]
        report["restored_ok"] = bool(torch.equal(t, expect))
        if rank == 0:
            report["left_at_start"] = sorted(n for n in os.listdir(root) if "000000003" in n)
            time.sleep(max(0.0, lease["renewed"] + lease["ttl"] + 0.5 - time.time()))
            report["cleaned"] = m.cleanup()
        dist.barrier()
        for step in (3, 4):
            m.save(step, state(rank, world, step))
        report["steps"] = m.steps()
        report["listing"] = sorted(os.listdir(root))
        m.close()
    else:
        try:
            shardsafe.save(state(rank, world, 1), f"{root}/ck")
            report["error"] = None
        except shardsafe.CheckpointError as e:
            report["error"] = str(e)
    Path(f"{marker}.rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
