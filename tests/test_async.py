"""async_save: returns after staging, commits in the background, errors reach every rank."""

import pytest
import torch
from distributed import run_ranks

import shardsafe
from shardsafe import ShardedObject, ShardedTensor


def state(scale=1.0, n=4096):
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(n, dtype=torch.float32) * scale),
        "b": ShardedTensor.from_rank_offsets("b", torch.ones(7, dtype=torch.bfloat16)),
        "rng": ShardedObject("rng", {"seed": 3}, (1,), (0,)),
        "step": 1,
    }


def test_async_save_snapshot_is_taken_at_call_time(tmp_path):
    saver = shardsafe.Saver()
    sd = state()
    seen = []
    handle = saver.async_save(
        sd, tmp_path / "a", progress=lambda stage, done, total: seen.append(stage)
    )
    sd["w"].data.mul_(-1)  # the training step after the call: must not leak into the checkpoint
    stats = handle.result(timeout=60)
    assert handle.done() and stats.total_bytes > 0 and stats.seconds_blocked <= stats.seconds
    assert seen[0] == "staged" and seen[-1] == "committed" and "written" in seen
    out = shardsafe.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4096))}, tmp_path / "a"
    )
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32))
    saver.close()


def test_repeated_saves_reuse_plan_and_staging(tmp_path):
    saver = shardsafe.Saver()
    first = saver.async_save(state(), tmp_path / "s1").result()
    allocations = saver.staging.allocations
    second = saver.async_save(state(2.0), tmp_path / "s2")  # same structure, new values
    assert second.result().plan_cached and not first.plan_cached
    assert saver.staging.allocations == allocations  # no new staging memory
    changed = state()
    changed["w"] = ShardedTensor.from_rank_offsets("w", torch.zeros(8192))  # another shape: replan
    assert not saver.async_save(changed, tmp_path / "s3").result().plan_cached
    sd = state()
    sd["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3, dtype=torch.float64))
    assert not saver.save(sd, tmp_path / "s4").plan_cached
    assert saver.plan_cache.hits == 1
    r = shardsafe.CheckpointReader(tmp_path / "s2")
    assert torch.equal(r.read_tensor("w"), torch.arange(4096, dtype=torch.float32) * 2)
    saver.close()


def test_new_async_save_waits_for_the_one_in_flight(tmp_path):
    saver = shardsafe.Saver()
    h1 = saver.async_save(state(n=1 << 20), tmp_path / "x1")
    h2 = saver.async_save(state(3.0, n=1 << 20), tmp_path / "x2")
    assert h1.done()  # the second call waited for the first before reusing the buffers
    h2.result()
    for name, scale in (("x1", 1.0), ("x2", 3.0)):
        got = shardsafe.CheckpointReader(tmp_path / name).read_tensor("w")
        assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) * scale)
    saver.close()


def test_async_error_reaches_the_handle_and_nothing_is_committed(tmp_path):
    saver = shardsafe.Saver()
    (tmp_path / "taken").mkdir()  # an empty directory is free to save into (as Megatron's save)
    (tmp_path / "taken" / "notes.txt").write_text("someone's file")
    with pytest.raises(shardsafe.CheckpointExistsError):
        saver.async_save(state(), tmp_path / "taken")
    sd = state()
    sd["bad"] = lambda: None  # cannot be stored: common state is refused while planning
    with pytest.raises(shardsafe.ValidationError, match=r"\['bad'\].*function"):
        saver.async_save(sd, tmp_path / "bad")
    sd["bad"] = shardsafe.ShardedObject("bad", lambda: None, (1,), (0,))  # fails while staging
    handle = saver.async_save(sd, tmp_path / "bad")
    with pytest.raises(shardsafe.CheckpointError, match="function"):
        handle.result(timeout=60)
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temporary directory left behind
    saver.close()


def _async_ranks(rank, world, root):
    tp = rank
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    results = []
    for step in range(3):
        sd = {
            "w": ShardedTensor.from_rank_offsets(
                "w", (w[tp * 4 : tp * 4 + 4] + step).clone(), (0, tp, 2)
            ),
            "rng": ShardedObject("rng", torch.tensor([rank, step]), (2,), (rank,)),
            "step": step,
        }
        handle = shardsafe.async_save(sd, f"{root}/step{step}")
        sd["w"].data.zero_()  # training goes on
        results.append(handle.result(timeout=60).plan_cached)
    # an error on rank 1 only, in the background write: every rank's handle raises, naming rank 1
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", w[tp * 4 : tp * 4 + 4].clone(), (0, tp, 2)),
        "step": 9,
    }
    if rank == 1:
        sd["w"] = ShardedTensor.from_rank_offsets("w", w[4:].clone(), (0, 1, 2))
        sd["obj"] = ShardedObject("o", lambda: 0, (1,), (0,))
    else:
        sd["obj"] = ShardedObject("o", None, (1,), (0,), replica_id=1)
    error = None
    try:
        shardsafe.async_save(sd, f"{root}/bad").result(timeout=60)
    except shardsafe.CheckpointError as e:
        error = str(e)
    shardsafe.wait_for_saves()
    return results, error


@pytest.mark.timeout(180)
def test_async_save_two_ranks(tmp_path):
    out = run_ranks(_async_ranks, 2, str(tmp_path), timeout=150)
    for cached, error in out:
        assert cached == [False, True, True]
        assert error is not None and "rank 1" in error
    for step in range(3):
        r = shardsafe.CheckpointReader(tmp_path / f"step{step}")
        assert torch.equal(
            r.read_tensor("w"), torch.arange(64, dtype=torch.float32).reshape(8, 8) + step
        )
        assert torch.equal(r.read_object("rng/shard_1_2"), torch.tensor([1, step]))
        assert r.common() == {"step": step}
    assert not (tmp_path / "bad").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0", "step1", "step2"]


def test_staging_budget_stages_and_writes_in_waves(tmp_path):
    pieces = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(6)}  # 6 x 256 KiB
    sd = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in pieces.items()}
    saver = shardsafe.Saver(files_per_rank=1, max_staging_bytes=600 << 10)  # two pieces per wave
    handle = saver.async_save(sd, tmp_path / "w")
    for st in sd.values():
        st.data.zero_()
    stats = handle.result(timeout=60)
    assert saver.staging.allocated_bytes <= 600 << 10  # never more host memory than the budget
    assert len(stats.files) == 3  # one data file per wave
    reader = shardsafe.CheckpointReader(tmp_path / "w")
    for key, value in pieces.items():
        assert torch.equal(reader.read_tensor(key), value)
    assert reader.verify().ok
    saver.close()


def test_release_frees_the_default_savers_and_saving_goes_on(tmp_path):
    from shardsafe import saver as saver_module

    t = torch.arange(4096, dtype=torch.float32)
    h = shardsafe.async_save(
        {"t": shardsafe.ShardedTensor.from_rank_offsets("t", t)}, tmp_path / "a"
    )
    before = saver_module.default_saver()
    shardsafe.release()  # waits for the save in flight, then frees its arenas
    assert h.done() and h.result().total_bytes > 0
    assert before.staging.allocated_bytes == 0 and not before.staging._arenas
    after = saver_module.default_saver()
    assert after is not before
    shardsafe.save({"t": shardsafe.ShardedTensor.from_rank_offsets("t", t)}, tmp_path / "b")
    shardsafe.release()
