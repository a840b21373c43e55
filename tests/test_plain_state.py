"""What frameworks hand us: plain tensors, parameters, the state a restore returned."""

from __future__ import annotations

import pytest
import torch
from distributed import preload_forkserver
from distributed import run_ranks as spawn_ranks

import shardsafe
from shardsafe import (
    CheckpointReader,
    CoordinatorObject,
    ShardedTensor,
    ValidationError,
)
from shardsafe.errors import UnsafeObjectError

preload_forkserver("numpy", "shardsafe", "test_plain_state")


def run_ranks(fn, world, *args):
    """New rank processes forked from a server that imported torch once (fast starts)."""
    return spawn_ranks(fn, world, *args, start_method="forkserver")


class _Custom:
    def __init__(self) -> None:
        self.x = 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_plain_state_dict_is_stored_as_tensors_and_loaded_in_place(tmp_path):
    model = _model()
    shardsafe.save({"model": model.state_dict(), "step": 3}, tmp_path / "c")
    reader = CheckpointReader(tmp_path / "c")
    assert sorted(reader.tensor_keys()) == sorted(f"model.{k}" for k in model.state_dict())
    assert reader.verify().ok
    assert reader.common() == {"model": {}, "step": 3}
    whole = reader.common(tensors=True)
    assert all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    template = {"model": other.state_dict()}
    out = shardsafe.load(template, tmp_path / "c")
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
        assert out["model"][k] is template["model"][k]
    assert out["step"] == 3


def test_plain_tensor_loads_into_another_layout(tmp_path):
    w = torch.arange(24.0).reshape(6, 4)
    shardsafe.save({"w": w}, tmp_path / "c")
    half = torch.nn.Parameter(torch.zeros(3, 4))
    shardsafe.load({"w": ShardedTensor.from_rank_offsets("w", half, (0, 1, 2))}, tmp_path / "c")
    assert torch.equal(half.detach(), w[3:])


@pytest.mark.parametrize("no_grad", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_parameters_as_destinations_when_the_layout_changes(tmp_path, no_grad, flat):
    w = torch.arange(64.0).reshape(8, 8)
    halves = [ShardedTensor.from_rank_offsets("w", w[4 * i : 4 * i + 4], (0, i, 2)) for i in (0, 1)]
    shardsafe.save({"a": halves[0], "b": halves[1], "w2": w.clone()}, tmp_path / "c")
    # rows 2..6 straddle both stored pieces; columns 2..5 of the plain tensor "w2" are strided
    p = torch.nn.Parameter(torch.zeros(4, 8))
    q = torch.nn.Parameter(torch.zeros(24) if flat else torch.zeros(8, 3))
    if flat:
        req = ShardedTensor.from_rank_offsets_flat("w2", q, (8, 8), flattened_range=slice(20, 44))
    else:
        req = ShardedTensor.from_global_offset("w2", q, (8, 8), (0, 2))
    grown = torch.nn.Parameter(torch.ones(9, 8))
    grown_req = ShardedTensor.from_global_offset(
        "w", grown, (9, 8), (0, 0), allow_shape_mismatch=True
    )
    template = {
        "p": ShardedTensor.from_global_offset("w", p, (8, 8), (2, 0)),
        "q": req,
        "g": grown_req,
    }
    ctx = torch.no_grad() if no_grad else torch.enable_grad()
    with ctx:
        shardsafe.load(template, tmp_path / "c", threads=4)
    assert p.requires_grad and q.requires_grad and grown.requires_grad
    assert torch.equal(p.detach(), w[2:6])
    expect = w.reshape(-1)[20:44] if flat else w[:, 2:5]
    assert torch.equal(q.detach(), expect)
    assert torch.equal(grown.detach()[:8], w) and not grown.detach()[8].any()
    (p.sum() + q.sum()).backward()  # autograd still works on the loaded parameters
    assert p.grad is not None and q.grad is not None


def test_fresh_optimizer_gets_its_state_back(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    shardsafe.save({"optim": opt.state_dict()}, tmp_path / "c")
    fresh = torch.optim.Adam(_model().parameters(), lr=0.1)
    out = shardsafe.load({"optim": fresh.state_dict()}, tmp_path / "c")
    fresh.load_state_dict(out["optim"])
    for a, b in zip(opt.state.values(), fresh.state.values(), strict=True):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_storing_what_load_would_refuse_fails_at_save(tmp_path):
    with pytest.raises(UnsafeObjectError, match="_Custom"):
        shardsafe.save({"x": _Custom()}, tmp_path / "c")
    with pytest.raises(ValidationError, match="cannot store"):
        shardsafe.save({"f": lambda: 1}, tmp_path / "d")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def _diverge(rank, world, path, what):
    state = {"step": 5, "cfg": {"lr": 0.1}}
    if what == "common":
        state["cfg"]["lr"] = 0.1 * (rank + 1)
    elif what == "tensor":
        state["rows"] = torch.full((2, 3), float(rank))
    elif what == "opt_out":
        state["rows"] = CoordinatorObject(torch.full((2, 3), float(rank)))
        state["seed"] = CoordinatorObject(rank)
    try:
        shardsafe.save(state, path)
    except ValidationError as e:
        return str(e)
    out = shardsafe.load({"rows": CoordinatorObject(None), "seed": 0}, path)
    return [out["rows"].tolist(), out["seed"]]


@pytest.mark.timeout(120)
def test_divergent_common_state_raises_on_every_rank_naming_the_key(tmp_path):
    msgs = run_ranks(_diverge, 2, str(tmp_path / "a"), "common")
    assert all("['cfg']['lr']" in m and "differ between ranks" in m for m in msgs), msgs
    msgs = run_ranks(_diverge, 2, str(tmp_path / "b"), "tensor")
    assert all("tensor 'rows'" in m for m in msgs), msgs
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    out = run_ranks(_diverge, 2, str(tmp_path / "c"), "opt_out")
    assert out[0] == out[1] == [[[0.0] * 3] * 2, 0]


def _fsdp_optimizer(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardsafe.integrations.optimizer import (
        init_optimizer_state,
        load_optimizer_state,
        optimizer_sharded_state_dict,
    )

    def build():
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = build()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd = model.state_dict()  # DTensors, as FSDP2 hands them
    shardsafe.save({"model": msd, "optim": optimizer_sharded_state_dict(opt, msd)}, path)
    fresh, fopt = build()
    init_optimizer_state(fopt)
    fsd = fresh.state_dict()
    out = shardsafe.load({"model": fsd, "optim": optimizer_sharded_state_dict(fopt, fsd)}, path)
    load_optimizer_state(fopt, out["optim"])
    for a, b in zip(opt.state.values(), fopt.state.values(), strict=True):
        for k in a:
            full = [getattr(t, "full_tensor", lambda t=t: t)() for t in (a[k], b[k])]
            assert torch.equal(*full), k
    return True


@pytest.mark.timeout(120)
def test_optimizer_state_from_an_fsdp2_model_state_dict(tmp_path):
    assert run_ranks(_fsdp_optimizer, 2, str(tmp_path / "c")) == [True, True]


def test_optimizer_state_from_a_plain_model_state_dict(tmp_path):
    from shardsafe.integrations.optimizer import (
        init_optimizer_state,
        load_optimizer_state,
        optimizer_sharded_state_dict,
    )

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd = model.state_dict()
    shardsafe.save({"model": msd, "optim": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "c")
    assert "optimizer.state.exp_avg.0.weight" in CheckpointReader(tmp_path / "c").tensor_keys()
    fresh = _model()
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    init_optimizer_state(fopt)
    fsd = fresh.state_dict()
    out = shardsafe.load(
        {"model": fsd, "optim": optimizer_sharded_state_dict(fopt, fsd)}, tmp_path / "c"
    )
    load_optimizer_state(fopt, out["optim"])
    for a, b in zip(opt.state.values(), fopt.state.values(), strict=True):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _parallel_into_parameters(rank, world, path):
    w = torch.arange(24.0).reshape(6, 4)
    shardsafe.save(
        {"w": ShardedTensor.from_rank_offsets("w", w[3 * rank : 3 * rank + 3], (0, rank, 2))}, path
    )
    p = torch.nn.Parameter(torch.zeros(4, 4))  # rows 1..5: both ranks request it whole
    req = ShardedTensor.from_global_offset("w", p, (6, 4), (1, 0), replica_id=rank)
    shardsafe.load({"w": req}, path, fully_parallel=True)
    assert p.requires_grad and torch.equal(p.detach(), w[1:5])
    return True


@pytest.mark.timeout(120)
def test_fully_parallel_exchange_fills_parameters(tmp_path):
    assert run_ranks(_parallel_into_parameters, 2, str(tmp_path / "c")) == [True, True]


def test_tensors_kept_in_common_state_still_load_in_place(tmp_path):
    """Checkpoints written before plain tensors were stored as tensors (common-state blobs)."""
    w = torch.arange(6.0).reshape(2, 3)
    shardsafe.save({"model": {"w": CoordinatorObject(w)}, "step": 2}, tmp_path / "c")
    assert CheckpointReader(tmp_path / "c").tensor_keys() == []
    dest = torch.nn.Parameter(torch.zeros(2, 3))
    out = shardsafe.load({"model": {"w": dest}}, tmp_path / "c")
    assert out["model"]["w"] is dest and torch.equal(dest.detach(), w) and dest.requires_grad
    with pytest.raises(shardsafe.MissingKeyError, match=r"model\.v"):
        shardsafe.load({"model": {"v": torch.zeros(2)}}, tmp_path / "c")


def test_replica_digest_is_the_same_chunked_or_whole():
    from shardsafe.save_plan import tensor_digest

    t = torch.randn(37, 11).t()  # not contiguous either
    whole = tensor_digest(t)
    assert tensor_digest(t, chunk_bytes=100, chunked=True) == whole
    assert tensor_digest(t.contiguous() + 1, chunk_bytes=100, chunked=True) != whole


def test_stored_list_items_past_a_shorter_template_are_kept(tmp_path):
    """A template list shorter than the stored one (an empty list of names, a history that
    grew) gets the stored items, as a template dict gets the stored keys it lacks."""
    w = torch.arange(4.0)
    shardsafe.save({"names": ["a", "b"], "hist": [1, {"x": 2}, 3], "w": w}, tmp_path / "c")
    dest = torch.zeros(4)
    out = shardsafe.load({"names": [], "hist": [7], "w": dest}, tmp_path / "c")
    assert out["names"] == ["a", "b"]
    assert out["hist"] == [1, {"x": 2}, 3]
    assert out["w"] is dest and torch.equal(dest, w)
