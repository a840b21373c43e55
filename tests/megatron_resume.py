"""A Megatron-Core training run killed mid-save and resumed in another layout, for the tests.

Megatron-Core has no training loop of its own; this is the loop its users write (Megatron-LM's
``train``/``save_checkpoint``/``load_checkpoint`` reduced to their calls): a GPTModel under
``initialize_model_parallel``, Megatron's DDP and optimizer and ``OptimizerParamScheduler``,
``model.sharded_state_dict()`` and ``optimizer.sharded_state_dict(...)`` saved by
``dist_checkpointing.save`` into ``iter_XXXXXXX`` (created by rank 0 first) with
``latest_checkpointed_iteration.txt`` written after it, and on resume
``dist_checkpointing.load`` then ``load_state_dict`` on each piece. ``dist_checkpointing`` is
shardsafe's, through the one line ``from shardsafe import megatron_api as dist_checkpointing``.

The gradients come from autograd through Megatron's DDP hooks, of a loss that acts on each
weight element by element, so that a run resumed under another tensor/pipeline layout can
equal the uninterrupted run bit for bit (a GPT forward pass splits its matmul sums over TP
ranks, which changes the rounding). Gradient clipping is off for the same reason (its norm
is summed over ranks). Every tensor's size is a multiple of 32 elements in both layouts, so
torch's CPU kernels take the same vector path for every element.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import torch
from faultinject import kill_self, patch_data_writes
from megatron_models import cpu_as_cuda, gpt, with_optimizer

from shardsafe import megatron_api as dist_checkpointing

LAYERS = 2
TOTAL = 5  # iterations of the whole run
SAVED = 2  # the committed checkpoint generation 1 leaves behind
KILLED = 4  # the save generation 1 is killed in the middle of
TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, iteration: int) -> str:
    """Megatron-LM's checkpoint directory name."""
    return os.path.join(root, f"iter_{iteration:07d}")


def build(tp: int, pp: int) -> dict[str, Any]:
    """Model, DDP, optimizer (no gradient clipping) and learning-rate schedule."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = gpt(tp, pp, seed=1234, layers=LAYERS)
    ddp, opt = with_optimizer(model, distributed=False, clip_grad=0.0, min_lr=1e-3)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=TOTAL,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=TOTAL,
        wd_incr_style="constant",
    )
    return {"model": model, "ddp": ddp, "opt": opt, "sched": sched, "iteration": 0}


def train_step(run: dict[str, Any]) -> None:
    """One iteration: zero the grad buffers, backward through the DDP hooks, sync, step."""
    ddp, opt = run["ddp"], run["opt"]
    target = 0.05 * ((run["iteration"] * 7) % 5 - 2)  # what this iteration's data asks for
    with cpu_as_cuda():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = sum(((p - target) * (p - target)).sum() for _, p in ddp.module.named_parameters())
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
    assert ok
    run["sched"].step(increment=1)
    run["iteration"] += 1


def train_until(run: dict[str, Any], iteration: int) -> None:
    while run["iteration"] < iteration:
        train_step(run)


def sharded_state_dict(run: dict[str, Any], loading: bool = False) -> dict[str, Any]:
    """What Megatron-LM saves (and asks for on load), without its args and RNG state."""
    model_sd = run["model"].sharded_state_dict()
    with cpu_as_cuda():
        optimizer = run["opt"].sharded_state_dict(model_sd, is_loading=loading)
    return {
        "model": model_sd,
        "optimizer": optimizer,
        "opt_param_scheduler": run["sched"].state_dict(),
        "iteration": run["iteration"],
        "checkpoint_version": 3.0,
    }


def save_checkpoint(run: dict[str, Any], root: str) -> None:
    """Megatron-LM's order: rank 0 creates the directory, every rank saves, then the tracker."""
    path = iter_dir(root, run["iteration"])
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict(run), path)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(run["iteration"]))
    torch.distributed.barrier()


def load_checkpoint(run: dict[str, Any], path: str) -> None:
    """Megatron-LM's resume: load into this run's own sharded state dict, then apply it."""
    out = dist_checkpointing.load(sharded_state_dict(run, loading=True), path)
    run["model"].load_state_dict(out["model"])
    # the fp32 main params are the parameters themselves here: copy without autograd
    with cpu_as_cuda(), torch.no_grad():
        run["opt"].load_state_dict(out["optimizer"])
    run["sched"].load_state_dict(out["opt_param_scheduler"])
    run["iteration"] = out["iteration"]


def report(run: dict[str, Any]) -> dict[str, Any]:
    """This rank's coordinates, parameters, Adam state, learning rate and schedule position."""
    from megatron.core import parallel_state as ps

    model, opt = run["model"], run["opt"]
    names = {id(p): n for n, p in model.named_parameters()}
    adam: dict[str, dict[str, torch.Tensor]] = {}
    lrs = set()
    for sub in opt.chained_optimizers:
        for group in sub.optimizer.param_groups:
            lrs.add(group["lr"])
            for p in group["params"]:
                st = sub.optimizer.state[p]
                adam[names[id(p)]] = {
                    k: torch.as_tensor(st[k]).detach().clone()
                    for k in ("exp_avg", "exp_avg_sq", "step")
                }
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "adam": adam,
        "lr": sorted(lrs),
        "num_steps": run["sched"].num_steps,
        "iteration": run["iteration"],
    }


# --------------------------------------------------------------------------- the generations


def generation_1(rank: int, world: int, root: str, tp: int, pp: int, kill_after: int) -> None:
    """Train, save iteration SAVED, train on, and be SIGKILLed ``kill_after`` bytes into the
    data files of iteration KILLED's save: every rank at once, as when a job is cancelled (a
    rank left alive would see the others die and fail on its own)."""
    pids: list[int] = [0] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    run = build(tp, pp)
    train_until(run, SAVED)
    save_checkpoint(run, root)
    train_until(run, KILLED)

    def kill_the_job() -> None:  # the first rank to reach the fault takes every rank down
        for pid in pids:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        kill_self()

    patch_data_writes(kill_after, kill_the_job)
    save_checkpoint(run, root)
    raise AssertionError(f"rank {rank} survived the save it should have been killed in")


def resume(rank: int, world: int, root: str, tp: int, pp: int) -> dict[str, Any]:
    """A fresh run in this layout: the half-written save is refused, the tracker's iteration
    loads, training goes on to TOTAL, saving KILLED again on the way and TOTAL at the end."""
    run = build(tp, pp)
    before = {n: p.detach().clone() for n, p in run["model"].named_parameters()}
    half = iter_dir(root, KILLED)
    refused: dict[str, Any] = {"raised": None}
    try:
        load_checkpoint(run, half)
    except Exception as e:
        refused = {"raised": type(e).__name__, "message": str(e), "error": _classes(e)}
    refused["untouched"] = all(
        torch.equal(before[n], p) for n, p in run["model"].named_parameters()
    )
    with open(os.path.join(root, TRACKER)) as f:
        latest = int(f.read().strip())
    load_checkpoint(run, iter_dir(root, latest))
    resumed_at = run["iteration"]
    train_until(run, KILLED)
    save_checkpoint(run, root)  # where the killed save was: its directory and leftovers are there
    train_until(run, TOTAL)
    save_checkpoint(run, root)  # the run's last save
    return {**report(run), "refused": refused, "resumed_at": resumed_at}


def uninterrupted(rank: int, world: int, tp: int, pp: int) -> dict[str, Any]:
    run = build(tp, pp)
    train_until(run, TOTAL)
    return report(run)


def load_damaged(rank: int, world: int, path: str, tp: int, pp: int) -> dict[str, Any]:
    """What the Megatron-named load raises on a checkpoint with a flipped byte."""
    run = build(tp, pp)
    try:
        load_checkpoint(run, path)
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "error": _classes(e)}
    return {"raised": None}


def _classes(e: BaseException) -> dict[str, bool]:
    from megatron.core.dist_checkpointing.core import CheckpointingException

    import shardsafe

    return {
        "checkpoint_error": isinstance(e, shardsafe.CheckpointError),
        "checkpointing_exception": isinstance(e, CheckpointingException),
    }
