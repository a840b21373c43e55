"""Optimizer state in parameter space: Adam trained under FSDP2 on 2 ranks resumes under
tensor parallelism, in a single process and from a ZeRO-1 flat buffer, matching an
uninterrupted single-process run."""

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks

import shardsafe
from shardsafe.integrations import (
    flat_optimizer_sharded_state_dict,
    init_optimizer_state,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    to_sharded_state_dict,
)

LR = 0.01
BATCH = 6


class Net(nn.Module):
    """Hidden size 8 splits evenly for TP's forward; under FSDP2 fc2 (3 rows) splits 2 + 1 and
    ``gate`` (1 row) leaves rank 1 an empty shard."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)
        self.gate = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.gate


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def train(model, opt, steps, rows=slice(None), average=None):
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach()
        if average is not None:
            value = average(value)
        losses.append(float(value))
    return losses


def reference():
    """4 uninterrupted steps in one process; exp_avg after step 2."""
    model = Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    first = train(model, opt, [0, 1])
    exp_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return first + train(model, opt, [2, 3]), exp_avg


def checkpoint_sd(model, opt, **kw):
    model_sd = to_sharded_state_dict(model.state_dict())
    return {"model": model_sd, "optimizer": optimizer_sharded_state_dict(opt, model_sd, **kw)}


def resume(model, opt, path, **kw):
    """Load model + optimizer from ``path`` into a fresh model/optimizer (lr differs on purpose:
    the checkpoint's hyperparameters must win)."""
    init_optimizer_state(opt)
    loaded = shardsafe.load(checkpoint_sd(model, opt, **kw), path)
    load_optimizer_state(opt, loaded["optimizer"])
    assert opt.param_groups[0]["lr"] == LR


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "gate"]


def flat_layout(rank, split):
    """ZeRO-1: the params' concatenated flat space, rank 0 holding [0, split), rank 1 the rest
    (the cut falls inside fc1.weight)."""
    shapes = {n: s for n, s in zip(NAMES, [(8, 5), (8,), (3, 8), (3,), (1, 3)])}
    lo, hi = (
        (0, split) if rank == 0 else (split, sum(torch.Size(s).numel() for s in shapes.values()))
    )
    entries, start = [], 0
    for name in NAMES:
        n = torch.Size(shapes[name]).numel()
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            entries.append((name, slice(a - start, b - start), a - lo, b - lo))
        start += n
    return entries, hi - lo


def flat_sd(rank, model, buffers, step):
    entries, _ = flat_layout(rank, 29)
    flat_state = {
        name: [(k, fr, buf[a:b]) for k, fr, a, b in entries] for name, buf in buffers.items()
    }
    model_sd = to_sharded_state_dict(model.state_dict())
    opt_sd = flat_optimizer_sharded_state_dict(
        flat_state, model_sd, scalar_state={"step": step}, param_groups=[{"lr": LR}]
    )
    return {"model": model_sd, "optimizer": opt_sd}


def _ranks(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def average(t):
        dist.all_reduce(t)
        return t / world

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    # FSDP2, data parallel: each rank trains on its half of the batch.
    fsdp = Net(0)
    fully_shard(fsdp.fc1, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out["fsdp_losses"] = train(fsdp, opt, [0, 1], half, average)
    shardsafe.save(checkpoint_sd(fsdp, opt), f"{root}/fsdp")
    names = dict(fsdp.named_parameters())
    out["exp_avg"] = {n: full(opt.state[names[n]]["exp_avg"]) for n in NAMES}
    out["exp_avg_sq"] = {n: full(opt.state[names[n]]["exp_avg_sq"]) for n in NAMES}

    # Tensor parallel resumes (every rank sees the whole batch).
    tp = Net(5)
    parallelize_module(tp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    tp_opt = torch.optim.Adam(tp.parameters(), lr=0.5)
    resume(tp, tp_opt, f"{root}/fsdp", params_by_name=dict(tp.named_parameters()))
    tp_names = dict(tp.named_parameters())
    out["tp_exp_avg"] = {n: full(tp_opt.state[tp_names[n]]["exp_avg"]) for n in NAMES}
    out["tp_step"] = float(tp_opt.state[tp_names["gate"]]["step"])
    out["tp_losses"] = train(tp, tp_opt, [2, 3])

    # ZeRO-1: flat exp_avg / exp_avg_sq buffers load from the FSDP2 checkpoint, then save.
    _, size = flat_layout(rank, 29)
    buffers = {"exp_avg": torch.zeros(size), "exp_avg_sq": torch.zeros(size)}
    step = torch.tensor(0.0)
    plain = Net(0)
    shardsafe.load(flat_sd(rank, plain, buffers, step), f"{root}/fsdp")
    out["flat"] = {k: v.numpy().copy() for k, v in buffers.items()}
    out["flat_step"] = float(step)
    shardsafe.save(flat_sd(rank, plain, buffers, step), f"{root}/flat")
    return out


def _concat(per_param):
    return torch.cat([torch.from_numpy(per_param[n]).reshape(-1) for n in NAMES])


@pytest.mark.timeout(120)
def test_adam_resumes_across_fsdp2_tp_flat_and_single_process(tmp_path):
    ref_losses, ref_exp_avg = reference()
    results = run_ranks(_ranks, 2, str(tmp_path), timeout=110)
    r0 = results[0]
    torch.testing.assert_close(r0["fsdp_losses"], ref_losses[:2], rtol=0, atol=1e-5)
    for n in NAMES:
        torch.testing.assert_close(torch.from_numpy(r0["exp_avg"][n]), ref_exp_avg[n])
    for r in results:
        for n in NAMES:  # resharded FSDP2 -> TP: bit for bit
            assert torch.equal(
                torch.from_numpy(r["tp_exp_avg"][n]), torch.from_numpy(r0["exp_avg"][n])
            )
        assert r["tp_step"] == 2.0 and r["flat_step"] == 2.0
        torch.testing.assert_close(r["tp_losses"], ref_losses[2:], rtol=0, atol=1e-5)
    # the flat buffers hold exactly the concatenated per-parameter state
    for name in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([torch.from_numpy(r["flat"][name]) for r in results])
        assert torch.equal(flat, _concat(r0[name]))

    # A single process resumes from the FSDP2 checkpoint and from the ZeRO-1 one.
    for ck in ("fsdp", "flat"):
        model = Net(9)
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        resume(model, opt, tmp_path / ck)
        for n, p in model.named_parameters():
            assert torch.equal(opt.state[p]["exp_avg"], torch.from_numpy(r0["exp_avg"][n])), (ck, n)
            assert float(opt.state[p]["step"]) == 2.0
        torch.testing.assert_close(train(model, opt, [2, 3]), ref_losses[2:], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- one process


def test_init_optimizer_state_creates_zero_state_and_changes_nothing_else():
    model = Net(0)
    model.fc2.bias.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    opt = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.1)
    init_optimizer_state(opt)
    for n, p in model.named_parameters():
        state = opt.state.get(p)
        if n == "fc2.bias":
            assert not state  # frozen: no state
            continue
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.fc1.weight.grad, torch.ones_like(model.fc1.weight))
    assert model.fc1.bias.grad is None and opt.param_groups[0]["lr"] == LR
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    init_optimizer_state(sgd)
    assert not sgd.state[model.gate]["momentum_buffer"].any()


def test_keys_scalars_and_errors(tmp_path):
    model = Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    train(model, opt, [0])
    sd = checkpoint_sd(model, opt)
    entry = sd["optimizer"]["state"]["fc1.weight"]
    assert entry["exp_avg"].key == "optimizer.state.exp_avg.fc1.weight"
    assert entry["step"].global_shape == () and entry["step"].replica_id == 0
    assert sd["optimizer"]["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    shardsafe.save(sd, tmp_path / "c")

    # a fresh optimizer's template gets its state created, so the load fills it
    fresh = Net(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    loaded = shardsafe.load(checkpoint_sd(fresh, fresh_opt), tmp_path / "c")
    load_optimizer_state(fresh_opt, loaded["optimizer"])
    assert fresh_opt.param_groups[0]["lr"] == LR
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    # ... but an optimizer without state never takes the checkpoint's silently
    stateless = torch.optim.Adam(fresh.parameters(), lr=LR)
    with pytest.raises(
        shardsafe.IncompatibleRequestError,
        match="state for 5 parameters the optimizer has no state",
    ):
        load_optimizer_state(stateless, loaded["optimizer"])
    with pytest.raises(shardsafe.IncompatibleRequestError, match="OptimizerState"):
        load_optimizer_state(fresh_opt, {"state": {}, "param_groups": []})

    opt.state[model.gate]["odd"] = torch.zeros(7)
    with pytest.raises(ValueError, match="cannot be resharded"):
        checkpoint_sd(model, opt)
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    train_step = other.param_groups[0]["params"][0]
    other.state[train_step]["exp_avg"] = torch.zeros(2)
    with pytest.raises(KeyError, match="params_by_name"):
        optimizer_sharded_state_dict(other, to_sharded_state_dict(model.state_dict()))
