"""Journeys: what a user runs, generation after generation, in new processes each time.

Each journey saves, starts new processes (often in another layout), restores, trains a few
steps and saves again, at least three times; at the end every tensor must equal what an
uninterrupted run computes (or, where the layouts compute differently, exactly what the
previous generation saved). Training is arranged so that every layout does the same float
operations in the same order (data-parallel halves are summed as two micro-batches).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import RankFailure, preload_forkserver
from distributed import run_ranks as spawn_ranks

import shardsafe
from shardsafe import CheckpointManager, ShardedTensor

pytestmark = pytest.mark.timeout(240)

ROWS, COLS = 6, 4

preload_forkserver("numpy", "shardsafe", "torch.distributed.checkpoint.state_dict", "test_journeys")


def run_ranks(fn, world, *args):
    """A new process per rank and generation (forked from a clean server, for speed)."""
    return spawn_ranks(fn, world, *args, timeout=200, start_method="forkserver")


LR = 0.05


def _np(tree):
    """Tensors as numpy arrays, to travel back from the rank processes."""
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        t = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        return t.detach().clone().numpy()
    return tree


def _same(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


# --------------------------------------------------------------------------- README manager loop


def _readme_loop(rank, world, root, total_steps, killed=False):
    """The README's manager loop as written: the state is built once, before the loop.

    ``killed``: every rank is SIGKILLed 16 bytes into its first checkpoint write.
    """
    if killed:
        from faultinject import kill_self, patch_data_writes

        patch_data_writes(16, kill_self)
    rows = ROWS // world
    w = torch.zeros(rows, COLS)
    state = {"w": ShardedTensor.from_rank_offsets("layer.w", w, (0, rank, world)), "step": 0}
    manager = CheckpointManager(root, keep_last=3, keep_every=1000, async_save=True)
    if manager.latest_step() is not None:  # resume, in whatever layout this run uses
        state = manager.restore(state)  # fills the tensors in place
    for step in range(state["step"] + 1, total_steps):
        w.mul_(0.5).add_(torch.arange(rank * rows, (rank + 1) * rows)[:, None] * step)  # train
        if step % 2 == 0:
            state["step"] = step
            manager.save(step, state)
    manager.close()
    return _np(w), rank * rows


def test_readme_manager_loop_over_three_generations_and_layouts(tmp_path):
    root = str(tmp_path / "ckpt")
    ends = [(2, 5), (1, 9), (2, 13)]  # (ranks, total_steps): the last saved step is end - 1 or - 2
    for i, (world, end) in enumerate(ends):
        parts = run_ranks(_readme_loop, world, root, end)
        if i == 0:  # a generation killed while writing its first checkpoint (step 6)
            with pytest.raises(RankFailure, match="exited with code -9"):
                run_ranks(_readme_loop, 2, root, 9, True)
            assert CheckpointManager(root).latest_step() == 4  # and its leftovers are cleaned
    ref = torch.zeros(ROWS, COLS)
    step = 0
    for _, end in ends:  # each run resumes from the last *saved* step, as the loop does
        for s in range(step + 1, end):
            ref.mul_(0.5).add_(torch.arange(ROWS)[:, None] * s)
            if s % 2 == 0:
                saved, step = ref.clone(), s
        ref = saved.clone()
    got = np.concatenate([p for p, _ in sorted(parts, key=lambda x: x[1])])
    # the last run trained past its last save: compare the checkpoint, and the live tensor
    last = shardsafe.load(
        {"w": ShardedTensor.from_rank_offsets("layer.w", torch.empty(ROWS, COLS))},
        f"{root}/step_{step:09d}",
    )
    assert torch.equal(last["w"], saved) and last["step"] == step == 12
    assert got.shape == (ROWS, COLS)
    assert shardsafe.CheckpointReader(f"{root}/step_{step:09d}").tensor_keys() == ["layer.w"]
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "latest",
        "step_000000008",
        "step_000000010",
        "step_000000012",
    ]


# --------------------------------------------------------------------------- plain module + Adam


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(5, hidden)
        self.drop = torch.nn.Dropout(0.25)
        self.fc2 = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _half_loss(model, step, half):
    x, y = _batch(step)
    sl = slice(half * 4, half * 4 + 4)
    return torch.nn.functional.mse_loss(model(x[sl]), y[sl])


def _plain_generation(rank, world, path_in, path_out, steps):
    """One process: plain module + Adam through state_dict() / load_state_dict()."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    step = 0
    if path_in:
        template = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": 0,
        }
        out = shardsafe.load(template, path_in)
        opt.load_state_dict(out["optim"])
        torch.set_rng_state(out["rng"])
        step = out["step"]
    first = step + 1
    for step in range(first, first + steps):
        opt.zero_grad()
        for half in (0, 1):
            (_half_loss(model, step, half) * 0.5).backward()
        opt.step()
    if path_out:
        state = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }
        shardsafe.save(state, path_out)
    return _np({"model": model.state_dict(), "optim": opt.state_dict()["state"][0]})


def test_plain_module_and_adam_over_three_generations(tmp_path):
    paths = [None] + [str(tmp_path / f"g{i}") for i in range(3)]
    for i in range(3):
        got = run_ranks(_plain_generation, 1, paths[i], paths[i + 1], 3)[0]
    (ref,) = run_ranks(_plain_generation, 1, None, None, 9)
    _same(got, ref)
    reader = shardsafe.CheckpointReader(paths[-1])
    assert (
        "model.fc1.weight" in reader.tensor_keys()
        and "optim.state.0.exp_avg" in reader.tensor_keys()
    )
    assert reader.verify().ok


# --------------------------------------------------------------------------- DDP -> 1 -> DDP


def _ddp_generation(rank, world, path_in, path_out, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Net()
    model.drop.p = 0.0  # ranks draw no random numbers: the layouts stay comparable
    ddp = DDP(model) if world > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    step = 0
    if path_in:
        out = shardsafe.load(
            {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}, path_in
        )
        opt.load_state_dict(out["optim"])
        step = out["step"]
    first = step + 1
    for step in range(first, first + steps):
        opt.zero_grad()
        if world > 1:  # DDP averages the two ranks' gradients: g0/2 + g1/2
            _half_loss(ddp, step, rank).backward()
        else:  # the same sum as two micro-batches
            for half in (0, 1):
                (_half_loss(model, step, half) * 0.5).backward()
        opt.step()
    shardsafe.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, path_out)
    return _np({"model": model.state_dict(), "optim": opt.state_dict()["state"][0]})


def test_ddp_to_one_process_to_ddp(tmp_path):
    paths = [None] + [str(tmp_path / f"g{i}") for i in range(3)]
    for i, world in enumerate((2, 1, 2)):
        got = run_ranks(_ddp_generation, world, paths[i], paths[i + 1], 2)
    (ref,) = run_ranks(_ddp_generation, 1, None, str(tmp_path / "ref"), 6)
    _same(got[0], got[1])
    _same(got[0], ref)
    assert shardsafe.load({"step": 0}, paths[-1])["step"] == 6


# --------------------------------------------------------------------------- FSDP2 and TP


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _fsdp_generation(rank, world, path_in, path_out, api):
    """FSDP2 on 2 ranks (uneven shards), or the plain module in one process: model + Adam.

    ``api`` picks how the model's state dict is taken, on load and on save: DCP's
    ``get_model_state_dict`` or the plain ``model.state_dict()`` (same keys either way).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    model = Net()
    model.drop.p = 0.0
    if world > 1:
        fully_shard(model.fc1, mesh=_mesh(world))  # 7 rows over 2 ranks: uneven shards
        fully_shard(model, mesh=_mesh(world))
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def state():
        msd = get_model_state_dict(model) if api == "dcp" else model.state_dict()
        return {"model": msd, "optim": get_optimizer_state_dict(model, opt)}

    loaded = None
    if path_in:
        out = shardsafe.load(state(), path_in)  # get_optimizer_state_dict initialises the state
        set_optimizer_state_dict(model, opt, out["optim"])
        loaded = _np(state())
    for step in (1, 2):
        opt.zero_grad()
        _half_loss(model, step, rank if world > 1 else 0).backward()
        opt.step()
    shardsafe.save(state(), path_out)
    return loaded, _np(state())


def test_fsdp2_two_ranks_to_one_to_two(tmp_path):
    paths = [None] + [str(tmp_path / f"g{i}") for i in range(3)]
    saved = None
    for i, (world, api) in enumerate(((2, "dcp"), (1, "state_dict"), (2, "state_dict"))):
        results = run_ranks(_fsdp_generation, world, paths[i], paths[i + 1], api)
        for loaded, _ in results:
            if saved is not None:
                _same(loaded, saved)  # exactly what the previous generation trained
        saved = results[0][1]
    reader = shardsafe.CheckpointReader(paths[-1])
    assert "optim.state.fc1.weight.exp_avg" in reader.tensor_keys()
    assert reader.tensor_meta("model.fc1.weight")[0] == (7, 5)


def _tp_generation(rank, world, path_in, path_out):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Net(hidden=8)
    model.drop.p = 0.0
    if world > 1:
        parallelize_module(
            model, _mesh(world), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
    loaded = None
    if path_in:
        # parameters themselves (requires_grad=True) are the destinations
        params = dict(model.named_parameters())
        shardsafe.load({"model": params}, path_in)
        assert all(p.requires_grad for p in model.parameters())
        loaded = _np(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in (1, 2):
        opt.zero_grad()
        _half_loss(model, step, 0).backward()
        opt.step()
    shardsafe.save({"model": model.state_dict()}, path_out)
    return loaded, _np(model.state_dict())


def test_tensor_parallel_two_ranks_to_one_with_parameters(tmp_path):
    paths = [None] + [str(tmp_path / f"g{i}") for i in range(3)]
    saved = None
    for i, world in enumerate((2, 1, 2)):
        results = run_ranks(_tp_generation, world, paths[i], paths[i + 1])
        for loaded, _ in results:
            if saved is not None:
                _same(loaded, saved)
        saved = results[0][1]
    assert Path(paths[-1], "manifest.json").exists()


# --------------------------------------------------------------------------- TP + Adam + scheduler


def _optim_snapshot(model, opt, sched):
    """Every tensor of the model and the optimizer state by parameter name, whole, with the
    param groups (lr) and the scheduler's state."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        names[id(p)]: _np(dict(opt.state[p]))
        for g in opt.param_groups
        for p in g["params"]
        if opt.state.get(p)
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {
        "model": _np(dict(model.state_dict())),
        "state": state,
        "groups": groups,
        "scheduler": sched.state_dict(),
    }


def _tp_adam(world, hidden):
    """The model (fc1's columns split over the ranks, its output gathered so that every
    layout does the same float operations; fc2 replicated), Adam and a step scheduler."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = Net(hidden=hidden)
    model.drop.p = 0.0
    if world > 1:
        plan = {"fc1": ColwiseParallel(output_layouts=Replicate())}
        parallelize_module(model, _mesh(world), plan)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _adam_step(model, opt, sched, step):
    """One step on the whole batch, as two micro-batches."""
    opt.zero_grad()
    for half in (0, 1):
        (_half_loss(model, step, half) * 0.5).backward()
    opt.step()
    sched.step()


def _optim_generation(rank, world, root, steps):
    """The README's resume loop with model, Adam and an LR scheduler under tensor parallelism:
    fc1's columns split over the ranks (its output gathered, so every layout does the same
    float operations), fc2 replicated. Nothing but ``manager.restore`` restores them."""
    from shardsafe.integrations import OptimizerState

    model, opt, sched = _tp_adam(world, 8)
    state = {"model": model, "optim": OptimizerState(opt, model), "sched": sched, "step": 0}
    manager = CheckpointManager(root, keep_last=2)
    loaded = None
    if manager.latest_step() is not None:
        state = manager.restore(state)
        loaded = _optim_snapshot(model, opt, sched)
    first = state["step"] + 1
    for step in range(first, first + steps):
        _adam_step(model, opt, sched, step)
        state["step"] = step
    manager.save(state["step"], state)  # the state restore returned saves again as built
    manager.close()
    return loaded, _optim_snapshot(model, opt, sched)


def test_tensor_parallel_adam_and_scheduler_through_the_manager(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = None
    for world in (2, 1, 2, 1):
        results = run_ranks(_optim_generation, world, root, 3)
        for loaded, _ in results:
            if saved is not None:  # moments, step, lr and scheduler exactly as saved
                _same(loaded, saved)
        saved = results[0][1]
        _same(results[-1][1], saved)
    (ref,) = run_ranks(_optim_generation, 1, str(tmp_path / "ref"), 12)
    _same(saved, ref[1])  # equal to an uninterrupted run
    assert saved["groups"][0]["lr"] == LR * 0.5**6 and saved["scheduler"]["last_epoch"] == 12
    reader = shardsafe.CheckpointReader(f"{root}/step_{12:09d}")
    assert "optimizer.state.exp_avg.fc1.weight" in reader.tensor_keys()
    assert reader.verify().ok


# --------------------------------------------------------------------------- local tier, hosts lost


# 32 of fc1's rows per rank at 4 ranks: every layout's matrix products take the same kernels
# (with 2 rows per rank they do not, and the sums differ in the last bit)
HIDDEN = 128


def _lines_logged(fragment):
    """The library's log lines (INFO and above) that hold ``fragment``, as they come."""
    import logging

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if fragment in record.getMessage():
                lines.append(record.getMessage())

    logger = logging.getLogger("shardsafe")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return lines


def _local_tier_generation(rank, world, root, gen, hosts, last, kill):
    """The local-tier loop of the README under tensor parallelism (``_optim_generation``'s
    model, Adam and scheduler, ``model.state_dict()`` as the model's state): a local save
    every step with one copy on another host, a persistent one every 3rd. ``kill``: every rank
    of that host is SIGKILLed right after the call that starts step ``kill[1]``'s save. What
    the restore gave is written to ``restored-<gen>-<rank>.pkl`` (a killed generation returns
    nothing)."""
    import signal

    from shardsafe.errors import CheckpointError, CheckpointNotFoundError
    from shardsafe.integrations import OptimizerState

    model, opt, sched = _tp_adam(world, HIDDEN)
    manager = CheckpointManager(
        f"{root}/persistent",
        local_root=f"{root}/local/{hosts[rank]}",
        node_id=hosts[rank],
        local_every=1,
        persistent_every=3,
        replicas=1,
        dead_after=2.0,
    )
    state = {"model": model.state_dict(), "optim": OptimizerState(opt, model), "sched": sched}
    state["step"] = 0
    moved = _lines_logged("went straight into")
    restored = None
    try:  # latest_step() reads the persistent tier only: the local tier may hold newer steps
        state = manager.restore(state)
        restored = {
            "step": manager.restored_step,
            "tier": manager.restored_tier,
            "snapshot": _optim_snapshot(model, opt, sched),
            "moved": list(moved),
        }
    except CheckpointNotFoundError:
        pass  # neither tier holds a step: a fresh start
    with open(f"{root}/restored-{gen}-{rank}.pkl", "wb") as f:
        pickle.dump(restored, f)
    for step in range(state["step"] + 1, last + 1):
        _adam_step(model, opt, sched, step)
        state["step"] = step
        manager.save(step, state)  # the state restore returned, saved as it was built
        if kill is not None and step == kill[1]:
            if hosts[rank] == kill[0]:
                os.kill(os.getpid(), signal.SIGKILL)  # the whole host, its save in flight
            try:
                manager.wait()
            except CheckpointError as e:
                return {"restored": restored, "lost": str(e)}
            raise AssertionError(f"step {step}'s save survived the loss of host {kill[0]}")
        manager.wait()
    manager.close()
    return {"restored": restored, "final": _optim_snapshot(model, opt, sched)}


def _snapshots_of_an_uninterrupted_run(rank, world, steps):
    model, opt, sched = _tp_adam(1, HIDDEN)
    out = {}
    for step in range(1, max(steps) + 1):
        _adam_step(model, opt, sched, step)
        if step in steps:
            out[step] = _optim_snapshot(model, opt, sched)
    return out


def test_local_tier_over_lost_hosts_and_layouts(tmp_path):
    """Three generations, each on other hosts and another layout, each resuming from the
    newest *local* step after a host was lost with its disk: 4 ranks on a, a, b, b (b killed
    while saving step 5) -> 2 ranks on c, a (c is new: its rank takes a's copies of the files
    it reads straight into its tensors; a is killed while saving step 8) -> 4 ranks on c, c,
    d, d (d is new: it fetches the files its ranks read) to step 11. Every restore equals the
    uninterrupted run at the restored step, and the end equals it at step 11. The first
    generation finds nothing to restore, as a fresh start does."""
    import shutil

    root = str(tmp_path)
    ref = run_ranks(_snapshots_of_an_uninterrupted_run, 1, (4, 7, 11))[0]
    generations = [
        (["a", "a", "b", "b"], 11, ("b", 5), 4),
        (["c", "a"], 11, ("a", 8), 7),
        (["c", "c", "d", "d"], 11, None, 11),
    ]
    restored_at = None
    for gen, (hosts, last, kill, committed) in enumerate(generations):
        args = (root, gen, hosts, last, kill)
        if kill is None:
            for r in run_ranks(_local_tier_generation, len(hosts), *args):
                _same(r["final"], ref[committed])
        else:
            with pytest.raises(RankFailure) as failed:
                run_ranks(_local_tier_generation, len(hosts), *args)
            struck = [r for r, h in enumerate(hosts) if h == kill[0]]
            assert sorted(failed.value.errors) == struck, failed.value.errors
            assert all("code -9" in failed.value.errors[r] for r in struck)
            shutil.rmtree(f"{root}/local/{kill[0]}")  # the host is gone with its disk
        for rank in range(len(hosts)):
            with open(f"{root}/restored-{gen}-{rank}.pkl", "rb") as f:
                restored = pickle.load(f)
            if restored_at is None:
                assert restored is None
                continue
            assert (restored["step"], restored["tier"]) == (restored_at, "local"), restored
            _same(restored["snapshot"], ref[restored_at])
            # c's rank, alone on its host, took the copies of every file it reads straight
            # into its tensors; d's two ranks read the same files, which d fetched as files
            assert bool(restored["moved"]) == ((gen, rank) == (1, 0)), (gen, rank, restored)
        restored_at = committed
    # the persistent tier holds steps 3, 6, 9 (the kept ones of them): every restore above
    # came from the local tier, which alone held the newer steps
    assert CheckpointManager(f"{root}/persistent").latest_step() == 9
    # the new hosts hold the steps they saved themselves: each an ordinary, verified checkpoint
    for host in ("c", "d"):
        (run,) = Path(root, "local", host).glob("run-*")
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(("step_", "."))) == [
            "step_000000010",
            "step_000000011",
        ]
        assert shardsafe.CheckpointReader(str(run / "step_000000011")).verify().ok
