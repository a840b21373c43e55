"""``shardsafe.dcp``: DCP's ``save``/``async_save``/``load`` over shardsafe checkpoints.

Real DCP, real gloo ranks: the Writer at N ranks, the Reader at M != N (3 -> 2, uneven), into
DTensors and plain tensors; DCP's own FileSystemWriter of the same state loads to the same values
(through DCP and through ``shardsafe.load``); ``dcp.async_save`` stages into the Writer's reused
arena; FSDP2 with DCP's ``get_state_dict``/``set_state_dict``; ``verify``/``inspect``/``convert``
on what the Writer wrote; a flipped byte and an unsafe value refused; a run SIGKILLed in the middle
of its second save resumes from its first, equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import shardsafe
from shardsafe.cli import main
from shardsafe.dcp import Reader, Writer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _full_w() -> torch.Tensor:
    return torch.arange(35.0).reshape(7, 5)  # 7 rows: 3 + 3 + 1 over 3 ranks, 4 + 3 over 2


def _state(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(_full_w(), mesh, placements),
            "b": torch.arange(4, dtype=torch.int64) * 10,  # a plain (replicated) tensor
        },
        "step": 5,
        "cfg": {"lr": 0.25, "names": ["a", "b"]},
    }


def _empty(mesh: Any, placements: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(torch.zeros(7, 5), mesh, placements),
            "b": torch.zeros(4, dtype=torch.int64),
        },
        "step": 0,
        "cfg": {"lr": 0.0, "names": ["", ""]},
    }


def _plain(sd: dict[str, Any]) -> dict[str, Any]:
    w = sd["model"]["w"]
    return {
        "w": (w.full_tensor() if hasattr(w, "full_tensor") else w).numpy(),
        "b": sd["model"]["b"].numpy(),
        "step": sd["step"],
        "cfg": sd["cfg"],
    }


def _save_three(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = _state(mesh, [Shard(0)])
    writer = Writer(f"{root}/ours")
    dcp.save(sd, storage_writer=writer)
    writer.close()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/theirs"))


def _load_two(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, placements in (("rows", [Shard(0)]), ("cols", [Shard(1)])):
        sd = _empty(mesh, placements)
        local = sd["model"]["w"]._local_tensor
        dcp.load(sd, storage_reader=Reader(f"{root}/ours"))
        assert sd["model"]["w"]._local_tensor.data_ptr() == local.data_ptr()  # in place
        out[name] = _plain(sd)
    theirs = _empty(mesh, [Shard(0)])
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(f"{root}/theirs"))
    out["theirs"] = _plain(theirs)
    # shardsafe.load of DCP's own directory, into this layout too
    direct = _empty(mesh, [Shard(1)])
    loaded = shardsafe.load(direct, f"{root}/theirs")
    assert loaded["step"] == 5 and loaded["cfg"] == {"lr": 0.25, "names": ["a", "b"]}
    out["direct"] = _plain(loaded)
    return out


@pytest.mark.timeout(240)
def test_writer_at_three_ranks_reader_at_two_and_one(tmp_path: Path) -> None:
    run_ranks(_save_three, 3, str(tmp_path), timeout=200)
    assert (tmp_path / "ours" / "manifest.json").is_file()
    assert not (tmp_path / "ours" / ".metadata").exists()  # no pickled DCP metadata
    results = run_ranks(_load_two, 2, str(tmp_path), timeout=200)
    for out in results:
        for name in ("rows", "cols", "theirs", "direct"):
            got = out[name]
            assert (got["w"] == _full_w().numpy()).all(), name
            assert list(got["b"]) == [0, 10, 20, 30], name
            assert got["step"] == 5 and got["cfg"] == {"lr": 0.25, "names": ["a", "b"]}, name
    # one process, plain tensors, no process group: the same values
    sd = {"model": {"w": torch.zeros(7, 5), "b": torch.zeros(4, dtype=torch.int64)}, "step": 0}
    dcp.load(sd, storage_reader=Reader(tmp_path / "ours"))
    assert torch.equal(sd["model"]["w"], _full_w()) and sd["step"] == 5
    # an ordinary shardsafe checkpoint: verify, inspect, load, convert
    assert main(["verify", str(tmp_path / "ours")]) == 0
    assert main(["inspect", str(tmp_path / "ours"), "--json"]) == 0
    plain = shardsafe.load_plain_tensors(tmp_path / "ours")
    assert torch.equal(plain["model.w"], _full_w()) and plain["step"] == 5
    template = {"model": {"w": torch.zeros(7, 5), "b": torch.zeros(4, dtype=torch.int64)}}
    loaded = shardsafe.load({**template, "step": 0, "cfg": {"lr": 0.0}}, tmp_path / "ours")
    assert loaded["step"] == 5 and loaded["cfg"] == {"lr": 0.25, "names": ["a", "b"]}
    assert torch.equal(template["model"]["w"], _full_w())
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "one.pt"), "--to", "torch"]) == 0
    assert torch.equal(torch.load(tmp_path / "one.pt")["model.w"], _full_w())


def _async_twice(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = _state(mesh, [Shard(0)])
    writer = Writer(f"{root}/a1")
    allocations = []
    for step, name in ((5, "a1"), (6, "a2")):
        sd["step"] = step
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=f"{root}/{name}")
        # the training loop goes on: the checkpoint holds what was staged
        sd["model"]["w"]._local_tensor.add_(1000.0)
        sd["model"]["b"].add_(1000)
        fut.result()
        allocations.append(writer.staging.allocations)
        sd["model"]["w"]._local_tensor.sub_(1000.0)
        sd["model"]["b"].sub_(1000)
    writer.close()
    back = _empty(mesh, [Shard(1)])
    dcp.load(back, storage_reader=Reader(f"{root}/a2"))
    return {"allocations": allocations, "back": _plain(back)}


@pytest.mark.timeout(240)
def test_async_save_stages_into_the_writers_reused_arena(tmp_path: Path) -> None:
    results = run_ranks(_async_twice, 2, str(tmp_path), timeout=200)
    for out in results:
        assert out["allocations"] == [1, 1]  # the second save reused the first one's arena
        assert (out["back"]["w"] == _full_w().numpy()).all()
        assert list(out["back"]["b"]) == [0, 10, 20, 30] and out["back"]["step"] == 6
    assert shardsafe.CheckpointReader(tmp_path / "a1").verify().ok


def _fsdp2_model(seed: int, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp2_model(0, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=Writer(f"{root}/fsdp"))

    fresh = _fsdp2_model(1, mesh)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.5)
    msd2, osd2 = get_state_dict(fresh, fresh_optim)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=Reader(f"{root}/fsdp"))
    set_state_dict(
        fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )

    def full(t: Any) -> Any:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy()

    same_params = all(
        (full(a) == full(b)).all()
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    before, after = optim.state_dict(), fresh_optim.state_dict()
    same_state = all(
        (full(before["state"][i][k]) == full(after["state"][i][k])).all()
        for i in before["state"]
        for k in ("exp_avg", "exp_avg_sq", "step")
    )
    return {
        "params": same_params,
        "state": same_state,
        "lr": after["param_groups"][0]["lr"],
    }


@pytest.mark.timeout(240)
def test_fsdp2_with_get_and_set_state_dict(tmp_path: Path) -> None:
    for out in run_ranks(_fsdp2_round_trip, 2, str(tmp_path), timeout=200):
        assert out == {"params": True, "state": True, "lr": 0.1}


def _corrupt(path: Path) -> None:
    data = sorted((path / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _cause(e: CheckpointException) -> BaseException:
    """The first rank's exception inside DCP's wrapper."""
    failure = next(iter(e.failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


def test_a_flipped_byte_is_caught_by_the_reader(tmp_path: Path) -> None:
    sd = {"w": torch.arange(20000.0), "step": 3}
    dcp.save(sd, storage_writer=Writer(tmp_path / "c"))
    assert main(["verify", str(tmp_path / "c")]) == 0
    _corrupt(tmp_path / "c")
    assert main(["verify", str(tmp_path / "c")]) != 0
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(20000)}, storage_reader=Reader(tmp_path / "c"))
    assert isinstance(_cause(info.value), shardsafe.CorruptCheckpointError)


class _Custom:
    def __init__(self) -> None:
        self.x = 1


def test_a_value_that_needs_pickled_code_is_refused_with_its_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3), "extra": _Custom()}, storage_writer=Writer(tmp_path / "c"))
    cause = _cause(info.value)
    assert isinstance(cause, shardsafe.CheckpointError) and "'extra'" in str(cause)
    assert not (tmp_path / "c").exists()  # nothing published


def test_reader_reads_a_checkpoint_written_by_shardsafe_save(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    shardsafe.save(
        {"model": model.state_dict(), "step": 9, "sched": {"milestones": [1, 2]}},
        tmp_path / "s",
    )
    into = {"model": torch.nn.Linear(3, 2).state_dict(), "step": 0, "sched": {"milestones": []}}
    dcp.load(into, storage_reader=Reader(tmp_path / "s"))
    assert torch.equal(into["model"]["weight"], model.weight.detach())
    assert into["step"] == 9 and into["sched"] == {"milestones": [1, 2]}
    meta = Reader(tmp_path / "s").read_metadata()
    assert set(meta.state_dict_metadata) == {
        "model.weight",
        "model.bias",
        "step",
        "sched.milestones",
    }


def test_a_second_save_into_the_same_path_is_refused_unless_overwrite(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=Writer(tmp_path / "c"))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(3)}, storage_writer=Writer(tmp_path / "c"))
    assert isinstance(_cause(info.value), shardsafe.CheckpointExistsError)
    dcp.save({"w": torch.zeros(3)}, storage_writer=Writer(tmp_path / "c", overwrite=True))
    got = {"w": torch.ones(3)}
    dcp.load(got, storage_reader=Reader(tmp_path / "c"))
    assert torch.equal(got["w"], torch.zeros(3))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert "w" in manifest["tensors"]
    assert os.listdir(tmp_path) == ["c"]


def test_shardsafe_load_reads_a_dcp_filesystemwriter_directory(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    dcp.save({"model": model.state_dict(), "step": 4}, checkpoint_id=str(tmp_path / "fs"))
    fresh = torch.nn.Linear(3, 2)
    out = shardsafe.load({"model": fresh.state_dict(), "step": 0}, tmp_path / "fs")
    assert out["step"] == 4 and torch.equal(fresh.weight, model.weight)
    with pytest.raises(shardsafe.MissingKeyError, match="DCP checkpoint"):
        shardsafe.load({"model": {"nope": torch.zeros(2)}}, tmp_path / "fs")
    # the tools that read only our format say what it is and how to convert it
    with pytest.raises(shardsafe.CheckpointNotFoundError, match=r"PyTorch DCP checkpoint.*convert"):
        shardsafe.CheckpointReader(tmp_path / "fs")


def test_reader_offers_flat_range_pieces_as_boxes(tmp_path: Path) -> None:
    """A distributed optimizer's flat shards (ranges cutting rows) reach DCP as boxes."""
    full = torch.arange(24.0).reshape(6, 4)
    flat = full.reshape(-1)
    pieces = {
        f"p{a}": shardsafe.ShardedTensor.from_rank_offsets_flat(
            "exp_avg", flat[a:b].clone(), (6, 4), flattened_range=slice(a, b)
        )
        for a, b in ((0, 10), (10, 24))
    }
    shardsafe.save(pieces, tmp_path / "flat")
    chunks = Reader(tmp_path / "flat").read_metadata().state_dict_metadata["exp_avg"].chunks
    assert len(chunks) > 2  # rows cut by the ranges come out as several boxes
    into = {"exp_avg": torch.zeros(6, 4)}
    dcp.load(into, storage_reader=Reader(tmp_path / "flat"))
    assert torch.equal(into["exp_avg"], full)


def _one_rank_unsafe(rank: int, world: int, root: str) -> str:
    sd: dict[str, Any] = {"w": torch.ones(4) * rank}
    if rank == 1:
        sd["extra"] = _Custom()  # planned on rank 1 only
    try:
        dcp.save(sd, storage_writer=Writer(f"{root}/c"))
    except CheckpointException as e:
        return type(_cause(e)).__name__
    return "saved"


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    assert run_ranks(_one_rank_unsafe, 2, str(tmp_path), timeout=100) == ["UnsafeObjectError"] * 2
    assert not (tmp_path / "c").exists()


def _per_rank_items(rank: int, world: int, root: str) -> dict[str, Any]:
    # a key only its own rank holds (torchtitan's `dataloader.dp_rank_N`)
    sd: dict[str, Any] = {"w": torch.ones(4), "loader": {f"dp_rank_{rank}": {"pos": 10 + rank}}}
    try:
        dcp.save(sd, storage_writer=Writer(f"{root}/c"))
    except CheckpointException as e:
        raise _cause(e) from None
    return shardsafe.CheckpointReader(f"{root}/c").common()


@pytest.mark.timeout(120)
def test_items_only_some_ranks_hold_are_nested_where_their_rank_has_them(tmp_path: Path) -> None:
    for common in run_ranks(_per_rank_items, 2, str(tmp_path), timeout=100):
        assert common["loader"] == {"dp_rank_0": {"pos": 10}, "dp_rank_1": {"pos": 11}}


# --------------------------------------------------------------------------- a run killed between


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(model: Any, optim: Any, rank: int, first: int, last: int) -> None:
    for step in range(first, last + 1):
        model(_batch(rank, step)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _save_step(model: Any, optim: Any, step: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": step}, storage_writer=Writer(path))


def _killed_run(rank: int, world: int, root: str) -> None:
    """Trains 2 steps and saves; trains 2 more and is SIGKILLed (every rank) mid-write."""
    from faultinject import kill_every_rank, patch_data_writes
    from torch.distributed.device_mesh import init_device_mesh

    Path(root, f"pid-{rank}").write_text(str(os.getpid()))
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp2_model(0, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, optim, rank, 1, 2)
    _save_step(model, optim, 2, f"{root}/step-2")
    _train(model, optim, rank, 3, 4)
    patch_data_writes(16, lambda: kill_every_rank(root, world))
    _save_step(model, optim, 4, f"{root}/step-4")
    raise AssertionError("the second save was not killed")


def _plain_state(model: Any, optim: Any) -> dict[str, Any]:
    def full(t: Any) -> Any:  # numpy: a tensor would leave the rank as shared memory
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()

    osd = optim.state_dict()
    return {
        "params": [full(p) for p in model.parameters()],
        "optim": {i: {k: full(v) for k, v in s.items()} for i, s in osd["state"].items()},
        "groups": osd["param_groups"],
    }


def _resumed_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Loads the first save into a different model, trains to step 6, saves step 4 on the way;
    beside it, an uninterrupted run of 6 steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp2_model(1, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 0}
    dcp.load(state, storage_reader=Reader(f"{root}/step-2"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, optim, rank, state["step"] + 1, 4)
    _save_step(model, optim, 4, f"{root}/step-4")  # the path the killed save left is free
    _train(model, optim, rank, 5, 6)
    reference = _fsdp2_model(0, mesh)
    ref_optim = torch.optim.Adam(reference.parameters(), lr=0.1)
    _train(reference, ref_optim, rank, 1, 6)
    return {
        "resumed": _plain_state(model, optim),
        "uninterrupted": _plain_state(reference, ref_optim),
    }


@pytest.mark.timeout(240)
def test_a_run_killed_mid_save_resumes_from_its_first_save_exactly(tmp_path: Path) -> None:
    from distributed import RankFailure

    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_run, 2, str(tmp_path), timeout=200)
    assert sorted(info.value.errors) == [0, 1]
    assert all("exited with code -9" in e for e in info.value.errors.values()), info.value
    assert any(n.startswith(".step-4") for n in os.listdir(tmp_path))  # half-written, hidden
    with pytest.raises(shardsafe.IncompleteCheckpointError, match="step-4"):
        Reader(tmp_path / "step-4")  # names the uncommitted save into it
    for out in run_ranks(_resumed_run, 2, str(tmp_path), timeout=200):
        resumed, uninterrupted = out["resumed"], out["uninterrupted"]
        assert resumed["groups"] == uninterrupted["groups"]
        for a, b in zip(resumed["params"], uninterrupted["params"], strict=True):
            assert (a == b).all()
        assert resumed["optim"].keys() == uninterrupted["optim"].keys()
        for i, moments in resumed["optim"].items():
            assert moments.keys() == uninterrupted["optim"][i].keys()
            for k, v in moments.items():
                assert (v == uninterrupted["optim"][i][k]).all(), (i, k)
    assert main(["verify", str(tmp_path / "step-4")]) == 0
