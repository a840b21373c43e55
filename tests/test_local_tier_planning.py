"""A local save's place leases ride on planning: from the second save on, every place
leader takes its lease under the token the coordinator drew in the previous vote, so no
all-gather of its own is needed, and a leader that cannot take it still fails the save on
every rank before anything is written, leaving nothing behind in any place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(300)


def _saves(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from shardsafe import CheckpointManager, ShardedTensor
    from shardsafe.directory import step_name
    from shardsafe.lease import Lease
    from shardsafe.location import locate

    host = "ab"[rank]
    mgr = CheckpointManager(
        f"{tmp}/persistent",
        local_root=f"{tmp}/local/{host}",
        node_id=host,
        local_every=1,
        persistent_every=1 << 60,
        replicas=1,
        dead_after=5.0,
    )
    local = mgr._local
    assert local is not None
    cache = local.saver.plan_cache
    assert cache is not None
    t = torch.arange(64, dtype=torch.float32) + rank

    def state(step: int) -> dict[str, Any]:
        return {"t": ShardedTensor.from_rank_offsets("t", t, (0, rank, world)), "step": step}

    out: dict[str, Any] = {"tokens": [], "ahead": []}
    for step in (1, 2, 3):
        out["ahead"].append(cache.next_token)
        handle = mgr.save(step, state(step))
        assert handle is not None and not isinstance(handle, type(None))
        out["tokens"].append(handle.result().token)
    # another live save of step 4 holds the lease in place b: the save fails on every rank
    # (the leader of b takes its lease in planning now) and leaves nothing in either place
    loc = locate(os.path.join(local.root, step_name(4)))
    held = Lease.acquire(loc.parent, loc.lock_name, "another-save", 60.0) if host == "b" else None
    try:
        mgr.save(4, state(4))
        out["error"] = None
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if held is not None:
            held.release()
    out["left"] = sorted(os.listdir(local.root))
    # and the next save goes through
    handle = mgr.save(5, state(5))
    assert handle is not None
    handle.result()
    mgr.close()
    return out


def test_place_leases_ride_on_planning_and_a_held_one_fails_the_save(tmp_path: Path) -> None:
    results = run_ranks(_saves, 2, str(tmp_path), timeout=240)
    for r in results:
        # the first save draws a token in planning; each later one uses the token drawn ahead
        assert r["ahead"][0] is None
        assert r["ahead"][1:] == r["tokens"][1:], r
        assert len(set(r["tokens"])) == 3
        assert r["error"] is not None and "another save holds the lease" in r["error"], r
        assert "step_000000004" in r["error"] and "on rank 1 during save planning" in r["error"], r
        # no work directory or lease of step 4 left in either place
        assert not [n for n in r["left"] if "00000004" in n], r["left"]
    assert results[0]["tokens"] == results[1]["tokens"]
