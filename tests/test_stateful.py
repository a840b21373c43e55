"""Stateful objects (``state_dict()`` + ``load_state_dict()``, PyTorch DCP's protocol) in the
state dicts of ``save``, ``load`` and the manager: DCP's tutorial ``AppState``, an LR
scheduler, ``OptimizerState``; and the hand-built optimizer template through ``restore``."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.integrations import (
    OptimizerState,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    to_sharded_state_dict,
)

LR = 0.1


class AppState:
    """PyTorch DCP's tutorial wrapper, as written there."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def trained(seed=0, steps=3, lr=LR):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def same_optimizer(a, b):
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        assert set(a.state[p]) == set(b.state[q])
        for name, value in a.state[p].items():
            assert type(b.state[q][name]) is torch.Tensor, name  # never a ShardedTensor
            assert torch.equal(value, b.state[q][name]), name


def test_dcp_tutorial_app_state_saves_and_loads(tmp_path):
    model, opt, _ = trained()
    shardsafe.save({"app": AppState(model, opt)}, tmp_path / "c")
    fresh, fresh_opt, _ = trained(seed=1, steps=0, lr=0.5)
    app = AppState(fresh, fresh_opt)
    out = shardsafe.load({"app": app}, tmp_path / "c")
    assert out["app"] is app
    same_optimizer(opt, fresh_opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_manager_restores_optimizer_and_scheduler_and_saves_again(tmp_path):
    model, opt, sched = trained()
    manager = CheckpointManager(tmp_path, async_save=False)
    state = {"model": model, "optim": OptimizerState(opt, model), "sched": sched, "step": 3}
    manager.save(3, state)
    fresh, fresh_opt, fresh_sched = trained(seed=1, steps=0, lr=0.5)
    template = {
        "model": fresh,
        "optim": OptimizerState(fresh_opt, fresh),
        "sched": fresh_sched,
        "step": 0,
    }
    restored = manager.restore(template)
    assert restored["step"] == 3 and restored["optim"] is template["optim"]
    assert restored["model"] is fresh and restored["sched"] is fresh_sched
    same_optimizer(opt, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == LR * 0.5**3
    assert fresh_sched.state_dict() == sched.state_dict()
    fresh_opt.param_groups[0]["lr"] = 0.25  # what the next save must store
    manager.save(4, restored)
    out = shardsafe.load(
        {"optim": OptimizerState(opt, model).state_dict()}, manager.checkpoint_path(4)
    )
    assert out["optim"]["param_groups"][0]["lr"] == 0.25


def test_hand_built_template_through_restore_and_load_optimizer_state(tmp_path):
    model, opt, _ = trained()
    msd = to_sharded_state_dict(model.state_dict())
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)})
    fresh, fresh_opt, _ = trained(seed=1, steps=0, lr=0.5)
    fsd = to_sharded_state_dict(fresh.state_dict())
    # no init_optimizer_state: the template creates the state it loads into
    state = manager.restore(
        {"model": fsd, "optimizer": optimizer_sharded_state_dict(fresh_opt, fsd)}
    )
    load_optimizer_state(fresh_opt, state["optimizer"])  # what restore returns is accepted
    same_optimizer(opt, fresh_opt)
    fresh_opt.step()  # state holds plain tensors: the next step runs
    with pytest.raises(shardsafe.IncompatibleRequestError, match="OptimizerState"):
        load_optimizer_state(fresh_opt, state)  # the whole state, not its optimizer part


class Broken:
    def __init__(self, fail_on):
        self.fail_on = fail_on

    def state_dict(self):
        if self.fail_on == "state_dict":
            raise RuntimeError("no state today")
        return {"x": 1}

    def load_state_dict(self, sd):
        if self.fail_on == "load_state_dict":
            raise RuntimeError("cannot take it")


def test_failing_stateful_is_named(tmp_path):
    with pytest.raises(shardsafe.ValidationError, match=r"\['b'\].*Broken.state_dict\(\) failed"):
        shardsafe.save({"b": Broken("state_dict")}, tmp_path / "c")
    shardsafe.save({"b": Broken(None)}, tmp_path / "c")
    with pytest.raises(
        shardsafe.IncompatibleRequestError, match=r"Broken.load_state_dict\(\) of .*\['b'\]"
    ):
        shardsafe.load({"b": Broken("load_state_dict")}, tmp_path / "c")


def _one_rank_refuses(rank, world, path):
    shardsafe.save({"b": Broken(None)}, path)
    try:
        shardsafe.load({"b": Broken("load_state_dict" if rank == 1 else None)}, path)
    except shardsafe.CheckpointError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.timeout(120)
def test_load_state_dict_failing_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_ranks(_one_rank_refuses, 2, str(tmp_path / "c"), timeout=100)
    for result in results:
        assert result is not None and result[0] == "IncompatibleRequestError"
        assert "on rank 1" in result[1] and "cannot take it" in result[1]
