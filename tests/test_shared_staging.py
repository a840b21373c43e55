"""One host staging pool shared by several Savers: the local and the persistent tier of a
CheckpointManager stage into the same arenas, taking turns, so that their saves together hold
no more host memory than one of them would, and no save stages over bytes another one has
still to write. Real tensors (``nn.Parameter``s through ``model.state_dict()``), real files,
two gloo ranks on two "hosts" for the manager."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager, ShardedTensor, StagingError
from shardsafe.staging import StagingPool, staged_bytes
from tests.distributed import run_ranks
from tests.test_staging_pinned import PAGE, Recorder, wait_until

pytestmark = pytest.mark.timeout(600)


# -- the pool ---------------------------------------------------------------------------------
def test_a_second_hold_waits_until_the_first_is_released():
    pool = StagingPool()
    first = pool.hold("the save into A", timeout=60)
    got: list[Any] = []
    second = threading.Thread(target=lambda: got.append(pool.hold("the save into B", 60)))
    second.start()
    wait_until(lambda: pool.waiting == 1, "the second save never waited")
    assert not got and pool.holder == "the save into A"
    first.release()
    second.join(60)
    assert len(got) == 1 and pool.holder == "the save into B" and pool.waiting == 0
    first.release()  # idempotent: cannot take the pool from its new holder
    assert pool.holder == "the save into B"
    got[0].release()
    assert pool.holder is None


def test_a_hold_kept_past_the_timeout_is_an_error_naming_its_holder():
    pool = StagingPool()
    hold = pool.hold("the local save into /local/step_000000003", timeout=60)
    with pytest.raises(StagingError, match=r"the save into B waited .*step_000000003"):
        pool.hold("the save into B", timeout=0.2)
    assert pool.waiting == 0 and pool.holder is not None
    hold.release()


def test_staging_into_a_held_pool_needs_its_hold():
    pool = StagingPool()
    t = torch.arange(1000.0)
    hold = pool.hold("the save into A", timeout=60)
    staged = pool.stage([t], hold)
    with pytest.raises(StagingError, match="in use by the save into A"):
        pool.stage([torch.zeros(1000)])
    assert bytes(staged[0].ready()) == t.numpy().tobytes()  # left as staged
    hold.release()
    pool.stage([torch.zeros(1000)])  # free again: staging without a hold, as before
    pool.release()


def test_prepare_while_held_grows_the_arena_only_once_the_hold_is_released():
    pinning = Recorder()
    pool = StagingPool(chunk_bytes=PAGE, pinning=pinning, pin_devices=("cpu",))
    t = torch.arange(5000.0)
    hold = pool.hold("the save into A", timeout=60)
    staged = pool.stage([t], hold)
    before = list(pinning.registered)
    assert pool.prepare(20 * PAGE) is None  # deferred: the save still reads its arena
    assert pinning.unregistered == [] and pool.allocations == 1
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (pool.wait_prepared(60), done.set()))
    waiter.start()
    assert bytes(staged[0].ready()) == t.numpy().tobytes()  # the write reads intact bytes
    assert not done.is_set()
    hold.release()
    waiter.join(60)
    assert done.is_set() and pool.allocations == 2
    assert sorted(pinning.unregistered) == sorted(a for a, _ in before)
    assert pool.pinned_bytes == 20 * PAGE and pool.peak_bytes == 20 * PAGE
    pool.release()


# -- two Savers, one pool ---------------------------------------------------------------------
def _model_state(seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 16))
    return model, {"model": model.state_dict(), "seed": seed}


class Gate:
    """A ``progress`` callback that holds a save's writes back until ``until()`` holds (or
    ``limit`` s passed since its first write), so another save can try to stage meanwhile."""

    def __init__(self, until: Any, limit: float = 10.0) -> None:
        self.until = until
        self.limit = limit
        self.deadline: float | None = None
        self.opened = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != "written":
            return
        if self.deadline is None:
            self.deadline = time.monotonic() + self.limit
        while not self.until() and time.monotonic() < self.deadline:
            time.sleep(0.005)
        self.opened = self.opened or bool(self.until())


def test_savers_sharing_a_pool_take_turns_and_each_save_is_exact(tmp_path: Path):
    pool = StagingPool()
    a = shardsafe.Saver(files_per_rank=1, staging=pool)
    b = shardsafe.Saver(files_per_rank=1, staging=pool)
    model_a, state_a = _model_state(1)
    model_b, state_b = _model_state(2)
    want_a = {k: v.clone() for k, v in model_a.state_dict().items()}
    want_b = {k: v.clone() for k, v in model_b.state_dict().items()}
    gate = Gate(lambda: pool.waiting > 0)
    first = a.async_save(state_a, tmp_path / "a", progress=gate)
    with torch.no_grad():
        for p in model_a.parameters():
            p.mul_(-3)  # the training goes on right after the call
    second = b.async_save(state_b, tmp_path / "b")  # waits until a's staged bytes are written
    with torch.no_grad():
        for p in model_b.parameters():
            p.mul_(-3)
    first.result(60)
    second.result(60)
    for path, want in ((tmp_path / "a", want_a), (tmp_path / "b", want_b)):
        out, _ = _model_state(0)
        shardsafe.load({"model": out.state_dict(), "seed": 0}, path)
        for k, v in out.state_dict().items():
            assert torch.equal(v, want[k]), f"{path.name}: {k} differs"
    assert gate.opened  # b did wait for a's write
    assert pool.peak_bytes == staged_bytes([v.nbytes for v in want_a.values()])
    a.close()
    b.close()
    assert pool.allocated_bytes > 0  # a pool given to a Saver is freed by its owner
    pool.release()


def test_a_save_that_waits_too_long_for_the_pool_fails_naming_the_write_it_waited_for(
    tmp_path: Path,
):
    pool = StagingPool()
    slow = shardsafe.Saver(files_per_rank=1, staging=pool)
    impatient = shardsafe.Saver(files_per_rank=1, staging=pool, timeout=0.5)
    _, state = _model_state(1)
    released = threading.Event()
    first = slow.async_save(state, tmp_path / "slow", progress=Gate(released.is_set, 60))
    with pytest.raises(StagingError, match=r"waited 0.5 s .*the save into .*slow"):
        impatient.async_save(_model_state(2)[1], tmp_path / "late").result(60)
    assert not (tmp_path / "late").exists()
    released.set()
    first.result(60)
    impatient.close()
    slow.close()
    pool.release()


def test_saver_prepare_on_a_pool_in_use_locks_once_the_write_is_done(tmp_path: Path):
    pinning = Recorder()
    pool = StagingPool(chunk_bytes=1 << 16, pinning=pinning, pin_devices=("cpu",))
    writer = shardsafe.Saver(files_per_rank=1, staging=pool)
    other = shardsafe.Saver(staging=pool)
    model, state = _model_state(1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    released = threading.Event()
    handle = writer.async_save(state, tmp_path / "a", progress=Gate(released.is_set, 60))
    small = pool.allocated_bytes
    need = 1 << 20
    assert other.prepare(nbytes=need) == need  # returns at once, while the write is held back
    assert pool.allocated_bytes == small and pinning.unregistered == []
    released.set()
    handle.result(60)
    other.prepare(nbytes=need, wait=True)
    assert pool.pinned_bytes == need and pool.allocations == 2
    out, _ = _model_state(0)
    shardsafe.load({"model": out.state_dict(), "seed": 0}, tmp_path / "a")
    assert all(torch.equal(v, want[k]) for k, v in out.state_dict().items())
    writer.close()
    other.close()
    pool.release()
    assert sorted(pinning.unregistered) == sorted(a for a, _ in pinning.registered)


# -- a CheckpointManager with both tiers, two ranks on two hosts -----------------------------
STEPS = 4


def _tiers_state(rank: int, world: int) -> tuple[torch.nn.Module, torch.Tensor, dict[str, Any]]:
    """A replicated model (``nn.Parameter``s through ``model.state_dict()``) and one sharded
    tensor whose rows this rank holds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 32))
    shard = torch.zeros(256 // world, 128)  # 64 KiB a rank, as the biggest parameter
    state = {
        "model": model.state_dict(),
        "shard": ShardedTensor.from_rank_offsets("shard", shard, (0, rank, world)),
        "step": 0,
    }
    return model, shard, state


def _train(model: torch.nn.Module, shard: torch.Tensor, rank: int, step: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(step)
    x = torch.randn(8, 128)  # the same on every rank: the replicas stay equal
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    shard.add_(step * 1000 + rank)


def _snapshot(model: torch.nn.Module, shard: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in model.state_dict().items()}, "shard": shard.clone()}


def _restored(mgr: CheckpointManager, rank: int, world: int, step: int) -> dict[str, Any]:
    model, shard, template = _tiers_state(rank, world)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    shard.fill_(float("nan"))
    out = mgr.restore(template, step=step)
    assert out["step"] == step
    return _snapshot(model, shard)


def _both_tiers(
    rank: int, world: int, tmp: str, mode: str, budget: int | None, drain: bool
) -> dict[str, Any]:
    host = "ab"[rank]
    common: dict[str, Any] = {
        "process_group": None,
        "max_staging_bytes": budget,
        "async_save": mode == "async",
        "dead_after": 3.0,
    }
    # what one tier stages: the same run, persistent tier only, saved asynchronously (a
    # blocking save writes CPU tensors straight from their memory, staging nothing)
    model, shard, state = _tiers_state(rank, world)
    with CheckpointManager(f"{tmp}/one-tier", **{**common, "async_save": True}) as one:
        for step in range(1, STEPS + 1):
            _train(model, shard, rank, step)
            state["step"] = step
            one.save(step, state)
            one.wait()
        one_tier = one.staging.peak_bytes

    model, shard, state = _tiers_state(rank, world)
    mgr = CheckpointManager(
        f"{tmp}/persistent",
        local_root=f"{tmp}/local/{host}",
        node_id=host,
        local_every=1,
        persistent_every=1,
        replicas=1,
        local_keep_last=STEPS,
        drain=drain,
        **common,
    )
    pools = {id(p): p for p in (mgr._saver.staging, mgr._local.saver.staging)}  # type: ignore[union-attr]
    want = {}
    gates = []
    for step in range(1, STEPS + 1):
        _train(model, shard, rank, step)
        state["step"] = step
        want[step] = _snapshot(model, shard)
        progress = None
        if mode == "async" and not drain and step < STEPS:
            # hold this step's persistent write back until the next step's local save waits
            # for the pool: were it not waiting, it would stage over bytes not yet written
            gate = Gate(lambda: sum(p.waiting for p in pools.values()) > 0, limit=30)
            gates.append(gate)
            progress = gate
        mgr.save(step, state, progress=progress)
    mgr.wait()
    peak = sum(p.peak_bytes for p in pools.values())
    mismatches = []
    for step in range(1, STEPS + 1):
        got = _restored(mgr, rank, world, step)
        if mgr.restored_tier != "local":
            mismatches.append(f"step {step} came from the {mgr.restored_tier} tier")
        mismatches += [
            f"local step {step}: {k}" for k in got if not torch.equal(got[k], want[step][k])
        ]
    mgr.close()
    with CheckpointManager(f"{tmp}/persistent", **common) as persistent:
        for step in range(1, STEPS + 1):
            got = _restored(persistent, rank, world, step)
            mismatches += [
                f"persistent step {step}: {k}"
                for k in got
                if not torch.equal(got[k], want[step][k])
            ]
    return {
        "pools": len(pools),
        "peak": peak,
        "one_tier": one_tier,
        "mismatches": mismatches,
        "waited": [g.opened for g in gates],
    }


@pytest.mark.parametrize(
    ("mode", "budget", "drain"),
    [
        ("async", None, False),
        ("async", 64 << 10, False),
        ("blocking", 64 << 10, False),
        ("async", 64 << 10, True),
    ],
)
def test_both_tiers_stage_into_one_pool_no_more_than_one_tier_and_restore_exactly(
    tmp_path: Path, mode: str, budget: int | None, drain: bool
):
    results = run_ranks(_both_tiers, 2, str(tmp_path), mode, budget, drain, timeout=400)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
        # both tiers' saves of the same steps together: what one tier alone stages
        assert 0 < r["peak"] == r["one_tier"], f"rank {rank}: {r}"
        assert r["pools"] == 1, "the tiers stage into pools of their own"
        if budget is not None:
            # the local tier stages in waves too: never more than the budget at once
            assert r["peak"] <= budget, f"rank {rank}: {r}"
        else:
            assert r["peak"] > 64 << 10  # the whole share at once: more than one wave

        assert all(r["waited"]), f"rank {rank}: a local save did not wait for the pool: {r}"
