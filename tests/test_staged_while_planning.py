"""A save whose plan is cached stages its share while the planning vote runs: what it staged
is used when the vote agrees on that plan, and dropped (and staged again for the plan agreed)
when another rank's structure changed and with it this rank's share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks

import shardsafe
from shardsafe import ShardedTensor, StagingError
from shardsafe.staging import StagingPool

N = 4096  # floats in each replicated tensor (16 KiB); the sharded "w" is much smaller


def _state(rank: int, world: int, step: int, extra: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {
        # plain tensors: replicas of one tensor on every rank, each written by one of them
        "a": torch.arange(N, dtype=torch.float32) + step,
        "b": torch.arange(N, dtype=torch.float32) * 2 + step,
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((16,), float(rank * 100 + step)), (0, rank, world)
        ),
        "step": step,
    }
    if extra:  # a tensor of rank 1's own, bigger than a or b: the writers of a and b change
        sd["c"] = ShardedTensor.from_rank_offsets("c", torch.full((4 * N,), float(step)))
    return sd


def _saves(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    saver = shardsafe.Saver()
    out = []
    for step in range(1, 6):
        extra = rank == 1 and step >= 4  # at step 4 only rank 1's structure changes
        sd = _state(rank, world, step, extra)
        handle = saver.async_save(sd, f"{root}/step{step}")
        for v in sd.values():  # the training step after the call must not reach the checkpoint
            if isinstance(v, ShardedTensor):
                v.data.zero_()
            elif isinstance(v, torch.Tensor):
                v.zero_()
        stats = handle.result(timeout=60)
        out.append(
            {
                "cached": stats.plan_cached,
                "ahead": stats.staged_while_planning,
                "bytes": stats.bytes_written,
            }
        )
    saver.close()
    return out


@pytest.mark.timeout(180)
def test_a_stage_made_during_the_vote_is_used_or_made_again_for_the_plan_agreed(
    tmp_path: Path,
) -> None:
    out = run_ranks(_saves, 2, str(tmp_path), timeout=150)
    r0, r1 = out
    # the first save plans (nothing cached); the next two stage while voting on the cached plan
    assert [s["cached"] for s in r0] == [False, True, True, False, True], r0
    assert [s["ahead"] for s in r0[:3]] == [False, True, True], r0
    assert [s["ahead"] for s in r1[:3]] == [False, True, True], r1
    # step 4: rank 1's structure changed; rank 0's did not, so it staged for the cached plan,
    # but the plan agreed gives it b as well as a: that stage was dropped and made again
    assert not r0[3]["ahead"] and not r1[3]["ahead"]
    assert r0[3]["bytes"] > r0[2]["bytes"], out
    # step 5: the new plan is cached everywhere, and staging rides on the vote again
    assert r0[4]["ahead"] and r1[4]["ahead"], out
    for step in range(1, 6):
        reader = shardsafe.CheckpointReader(tmp_path / f"step{step}")
        assert torch.equal(reader.read_tensor("a"), torch.arange(N, dtype=torch.float32) + step)
        assert torch.equal(reader.read_tensor("b"), torch.arange(N, dtype=torch.float32) * 2 + step)
        w = torch.cat([torch.full((16,), float(r * 100 + step)) for r in range(2)])
        assert torch.equal(reader.read_tensor("w"), w)
        if step >= 4:
            assert torch.equal(reader.read_tensor("c"), torch.full((4 * N,), float(step)))
        assert reader.common() == {"step": step}


def test_a_stage_that_failed_during_the_vote_fails_the_save(tmp_path: Path) -> None:
    """The stage made during the vote waits for the pool like any other; when it gives up,
    the save fails with that error and nothing is committed, and the next save goes on."""
    pool = StagingPool()
    saver = shardsafe.Saver(staging=pool, timeout=1.0)
    sd = _state(0, 1, 1, False)
    assert not saver.async_save(sd, tmp_path / "s1").result(timeout=60).staged_while_planning
    held = pool.hold("another save that is still writing")
    try:
        handle = saver.async_save(sd, tmp_path / "s2")
        with pytest.raises(StagingError, match="another save that is still writing"):
            handle.result(timeout=60)
    finally:
        held.release()
    assert not (tmp_path / "s2").exists()
    stats = saver.async_save(sd, tmp_path / "s3").result(timeout=60)
    assert stats.staged_while_planning
    assert torch.equal(
        shardsafe.CheckpointReader(tmp_path / "s3").read_tensor("a"),
        torch.arange(N, dtype=torch.float32) + 1,
    )
    saver.close()


class _QueuedCopy:
    """Stands for the CUDA event of a device copy still in flight (no GPU here): records
    whether anyone waited for it."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def test_a_guess_the_vote_did_not_confirm_waits_for_its_copies_before_letting_go() -> None:
    """The pinned arena a dropped guess staged into may be replaced by the next stage (unlocked
    and unmapped): the pool is let go only once the guess's device copies have landed."""
    from shardsafe.planning import RankAssignment
    from shardsafe.saver import _StagedAhead
    from shardsafe.staging import StagedItem

    pool = StagingPool()
    copies = [_QueuedCopy(), _QueuedCopy()]
    guess = _StagedAhead(RankAssignment((0, 1), ()), pool.hold("a dropped guess"))
    guess.items = [(("p", i), StagedItem(memoryview(b"x"), c)) for i, c in enumerate(copies)]
    guess.release()
    assert all(c.waited for c in copies)
    assert pool.holder is None
