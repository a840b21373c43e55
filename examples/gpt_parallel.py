"""A small GPT trained with TP x PP x DP and a ZeRO-1 optimizer on CPU (gloo), checkpointed with shardsafe.

It is the reference program the library is checked against: the loss is layout independent
(up to float reduction order), so a checkpoint saved in one layout and loaded into another
must continue the same loss curve.

    python examples/gpt_parallel.py --tp 2 --pp 1 --dp 2 --steps 20
    python examples/gpt_parallel.py --tp 2 --dp 2 --steps 10 --save-dir /tmp/ck --save-every 5
    python examples/gpt_parallel.py --tp 1 --dp 2 --steps 10 --resume-from /tmp/ck

Checkpoint keys are global parameter names (``decoder.layers.3.mlp.linear_fc1.weight``, global
layer index, no stacking), so a pipeline regrouping only changes which rank holds a key.
Optimizer state is in parameter space: ``optimizer.<exp_avg|exp_avg_sq|fp32_param>.<name>``,
each rank describing the flat range of the TP-local shard that its ZeRO range covers.
"""

from __future__ import annotations

import argparse
import queue
import random
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from parallel_layers import (
    DistributedAdam,
    GPTConfig,
    GPTStage,
    Layout,
    ParallelState,
    global_shape,
    zero_param_ranges,
)

try:
    from shardsafe import ShardedObject, ShardedTensor
except ImportError:  # the package root may not re-export them
    from shardsafe.sharding import ShardedObject, ShardedTensor

__all__ = [
    "DistributedAdam",
    "GPTConfig",
    "Layout",
    "ParallelState",
    "Resumed",
    "SyntheticData",
    "TrainConfig",
    "describe_state_dict",
    "launch",
    "load_checkpoint",
    "load_into",
    "run",
    "save_checkpoint",
    "sharded_state_dict",
    "train_step",
    "train_worker",
    "zero_param_ranges",
]


# -- data ---------------------------------------------------------------------------------------
class SyntheticData:
    """A fixed token stream from a seeded Markov chain (learnable, identical on every rank).

    Row ``j`` of the run's sequence of samples is window ``j`` of the stream, so the global batch
    of a step depends on the step only, never on the layout.
    """

    def __init__(self, vocab: int, seq: int, seed: int, length: int = 1 << 14):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, 4), generator=g).tolist()
        choice = torch.randint(4, (length,), generator=g).tolist()
        noise = (torch.rand(length, generator=g) < 0.1).tolist()
        random_tok = torch.randint(vocab, (length,), generator=g).tolist()
        tokens, t = [], 0
        for i in range(length):
            t = random_tok[i] if noise[i] else successors[t][choice[i]]
            tokens.append(t)
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.seq = seq
        self.windows = (length - 1) // seq

    def global_batch(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of shape ``(batch, seq)`` for a step."""
        rows = (torch.arange(batch) + step * batch) % self.windows
        idx = rows[:, None] * self.seq + torch.arange(self.seq + 1)
        chunk = self.tokens[idx]
        return chunk[:, :-1], chunk[:, 1:]


# -- one training step (GPipe: all forwards, then all backwards) --------------------------------
@dataclass
class TrainConfig:
    """Everything a worker needs; picklable so it can cross ``spawn``."""

    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 10
    global_batch: int = 8
    micro_batches: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.01
    save_dir: str | None = None
    save_every: int = 0
    resume_from: str | None = None
    load_rng: bool | None = None  # None: only when the checkpoint's layout is this layout
    verbose: bool = False
    collect_metadata: bool = False


def train_step(
    model: GPTStage,
    opt: DistributedAdam,
    data: SyntheticData,
    ps: ParallelState,
    cfg: TrainConfig,
    iteration: int,
) -> float:
    """One optimizer step on global batch ``iteration``; returns the global mean loss on every rank."""
    dp, m = ps.layout.dp, cfg.micro_batches
    inputs, labels = data.global_batch(iteration, cfg.global_batch)
    local = cfg.global_batch // dp
    rows = slice(ps.dp_rank * local, (ps.dp_rank + 1) * local)
    micro = list(zip(inputs[rows].chunk(m), labels[rows].chunk(m), strict=True))
    tokens = cfg.global_batch * cfg.model.seq
    loss_sum = torch.zeros((), dtype=torch.float64)
    stash: list[tuple[torch.Tensor, torch.Tensor]] = []
    for ids, lbl in micro:
        if ps.is_first_stage:
            x = ids
        else:
            x = torch.empty(ids.shape[0], cfg.model.seq, cfg.model.hidden)
            dist.recv(x, ps.prev_rank)
            x.requires_grad_()
        y = model(x)
        if ps.is_last_stage:
            y = F.cross_entropy(y.flatten(0, 1), lbl.flatten(), reduction="sum") / tokens
            loss_sum += y.detach()
        else:
            dist.send(y.detach().contiguous(), ps.next_rank)
        stash.append((x, y))
    for x, y in stash:
        if ps.is_last_stage:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, ps.next_rank)
            y.backward(grad)
        if not ps.is_first_stage:
            assert x.grad is not None
            dist.send(x.grad.contiguous(), ps.prev_rank)
    opt.step()
    opt.zero_grad()
    report = loss_sum if ps.is_last_stage and ps.tp_rank == 0 else torch.zeros_like(loss_sum)
    if ps.layout.world > 1:
        dist.all_reduce(report)
    return float(report)


# -- the sharded state dict -------------------------------------------------------------------
def _rank_offsets(p: torch.Tensor, ps: ParallelState) -> tuple[tuple[int, int, int], ...]:
    axis = p.tp_axis  # type: ignore[attr-defined]
    return () if axis is None else ((axis, ps.tp_rank, ps.layout.tp),)


def sharded_state_dict(
    model: GPTStage,
    optimizer: DistributedAdam,
    ps: ParallelState,
    *,
    iteration: int | None = None,
    include_rng: bool = True,
) -> dict[str, Any]:
    """This rank's view of the training state; every tensor's ``data`` is a view of live storage,
    so a load that fills in place restores the run directly.

    Replica ids are ``(pp, tp, dp)``: a replicated weight is main only on tp rank 0 of dp rank 0,
    a TP-split weight on dp rank 0. Optimizer ranges are disjoint across dp, so their pieces are
    all main except for the copies of replicated parameters held by tp ranks > 0.
    """
    model_sd: dict[str, Any] = {}
    for name, p in model.named_parameters():
        replicated = p.tp_axis is None  # type: ignore[attr-defined]
        model_sd[name] = ShardedTensor.from_rank_offsets(
            name,
            p.detach(),
            *_rank_offsets(p, ps),
            replica_id=(0, ps.tp_rank if replicated else 0, ps.dp_rank),
        )
    opt_sd: dict[str, Any] = {state: {} for state in optimizer.state_buffers()}
    for r in optimizer.ranges:
        p = optimizer.params[r.name]
        replica = (0, ps.tp_rank if p.tp_axis is None else 0, 0)  # type: ignore[attr-defined]
        for state, buf in optimizer.state_buffers().items():
            opt_sd[state][r.name] = ShardedTensor.from_rank_offsets_flat(
                f"optimizer.{state}.{r.name}",
                buf[r.shard_start : r.shard_stop],
                tuple(p.shape),
                *_rank_offsets(p, ps),
                flattened_range=slice(r.param_start, r.param_stop),
                replica_id=replica,
            )
    opt_sd["step"] = optimizer.step_count
    it = optimizer.step_count if iteration is None else iteration
    sd: dict[str, Any] = {
        "model": model_sd,
        "optimizer": opt_sd,
        "iteration": it,  # the data position: step i trains on global batch i
        "layout": asdict(ps.layout),
        "model_config": asdict(model.cfg),
    }
    if include_rng:
        lay = ps.layout
        sd["rng_state"] = ShardedObject(
            "rng_state",
            {"torch": torch.get_rng_state(), "python": random.getstate()},
            (lay.pp, lay.tp, lay.dp),
            (ps.pp_rank, ps.tp_rank, ps.dp_rank),
            replica_id=0,
        )
    return sd


def _copy_back(dst: torch.Tensor, src: Any) -> None:
    src = src.data if isinstance(src, ShardedTensor) else src
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"expected a tensor in the loaded state dict, got {type(src).__name__}")
    if src.data_ptr() != dst.data_ptr() or src.shape != dst.shape:
        dst.copy_(src.reshape(dst.shape))


@torch.no_grad()
def load_into(model: GPTStage, optimizer: DistributedAdam, loaded: dict[str, Any]) -> int:
    """Put a loaded state dict back into the live run (a no-op copy where the load filled in place);
    returns the iteration to continue from."""
    params = dict(model.named_parameters())
    for name, value in loaded["model"].items():
        _copy_back(params[name], value)
    for state, buf in optimizer.state_buffers().items():
        for r in optimizer.ranges:
            _copy_back(buf[r.shard_start : r.shard_stop], loaded["optimizer"][state][r.name])
    optimizer.step_count = int(loaded["optimizer"]["step"])
    rng = loaded.get("rng_state")
    if rng is not None:
        rng = rng.data if isinstance(rng, ShardedObject) else rng
        torch.set_rng_state(rng["torch"])
        state = rng["python"]
        random.setstate((state[0], tuple(state[1]), state[2]))
    return int(loaded["iteration"])


def describe_state_dict(sd: Any) -> list[dict[str, Any]]:
    """Plain-python metadata of every sharded leaf (for cross-rank checks in tests)."""
    out = []
    for leaf in _leaves(sd):
        if isinstance(leaf, ShardedTensor):
            fr = leaf.flattened_range
            out.append(
                {
                    "kind": "tensor",
                    "key": leaf.key,
                    "global_shape": leaf.global_shape,
                    "global_offset": leaf.global_offset,
                    "local_shape": leaf.local_shape,
                    "flat": None if fr is None else (fr.start or 0, fr.stop),
                    "replica_id": leaf.replica_id,
                    "numel": leaf.numel,
                }
            )
        elif isinstance(leaf, ShardedObject):
            out.append(
                {
                    "kind": "object",
                    "key": leaf.key,
                    "global_shape": leaf.global_shape,
                    "global_offset": leaf.global_offset,
                    "replica_id": leaf.replica_id,
                }
            )
    return out


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


# -- checkpointing through shardsafe --------------------------------------------------------
def _shardsafe(name: str) -> Callable[..., Any]:
    import shardsafe

    fn = getattr(shardsafe, name, None)
    if fn is None:
        raise RuntimeError(
            f"shardsafe.{name} is not available in the installed shardsafe; "
            "the example's --save-dir/--resume-from need shardsafe.save and shardsafe.load"
        )
    return fn


def save_checkpoint(
    model: GPTStage, optimizer: DistributedAdam, ps: ParallelState, path: str | Path
) -> None:
    """Collective: every rank calls it with the same path."""
    _shardsafe("save")(sharded_state_dict(model, optimizer, ps), str(path))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest ``iter_NNNNNNN`` inside a save directory."""
    path = Path(path)
    steps = sorted(
        (int(m.group(1)), p)
        for p in path.glob("iter_*")
        if (m := re.fullmatch(r"iter_(\d+)", p.name))
    )
    return steps[-1][1] if steps else path


class Resumed(NamedTuple):
    iteration: int
    rng_restored: bool


def load_checkpoint(
    model: GPTStage,
    optimizer: DistributedAdam,
    ps: ParallelState,
    path: str | Path,
    *,
    load_rng: bool | None = None,
) -> Resumed:
    """Collective: load any layout's checkpoint into this one; returns where to continue from.

    RNG states are ShardedObjects and cannot be resharded, so by default they are loaded only
    when the checkpoint was written by this same layout.
    """
    load = _shardsafe("load")
    path = resolve_checkpoint(path)
    if load_rng is None:
        import shardsafe

        read_common = getattr(shardsafe, "load_common_state_dict", None)
        common = read_common(str(path)) if read_common else load({}, str(path))
        load_rng = common.get("layout") == asdict(ps.layout)
    loaded = load(sharded_state_dict(model, optimizer, ps, include_rng=load_rng), str(path))
    return Resumed(load_into(model, optimizer, loaded), load_rng)


# -- the per-rank worker and the launcher ---------------------------------------------------------
def build(ps: ParallelState, cfg: TrainConfig) -> tuple[GPTStage, DistributedAdam, SyntheticData]:
    """Model stage, optimizer and data of one rank (reusable by other programs and tests)."""
    if cfg.global_batch % (ps.layout.dp * cfg.micro_batches):
        raise ValueError(
            f"global batch {cfg.global_batch} must split into dp={ps.layout.dp} x {cfg.micro_batches} micro-batches"
        )
    torch.manual_seed(cfg.model.seed + ps.rank)
    random.seed(cfg.model.seed + ps.rank)
    model = GPTStage(cfg.model, ps)
    opt = DistributedAdam(model, ps, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, opt, SyntheticData(cfg.model.vocab, cfg.model.seq, cfg.model.seed)


def train_worker(ps: ParallelState, cfg: TrainConfig) -> dict[str, Any]:
    """Train (optionally resuming and saving) until ``cfg.steps``; returns this rank's losses and,
    with ``collect_metadata``, the metadata of its final sharded state dict."""
    model, opt, data = build(ps, cfg)
    resumed = Resumed(0, False)
    if cfg.resume_from:
        resumed = load_checkpoint(model, opt, ps, cfg.resume_from, load_rng=cfg.load_rng)
    iteration, losses = resumed.iteration, []
    while iteration < cfg.steps:
        losses.append(train_step(model, opt, data, ps, cfg, iteration))
        iteration += 1
        if cfg.verbose and ps.rank == 0:
            print(f"step {iteration} loss {losses[-1]:.9f}", flush=True)
        if cfg.save_dir and cfg.save_every and iteration % cfg.save_every == 0:
            save_checkpoint(model, opt, ps, Path(cfg.save_dir) / f"iter_{iteration:07d}")
    result: dict[str, Any] = {
        "losses": losses,
        "iteration": iteration,
        "rng_restored": resumed.rng_restored,
    }
    if cfg.collect_metadata:
        result["metadata"] = describe_state_dict(sharded_state_dict(model, opt, ps))
        result["global_shapes"] = {
            n: global_shape(p, ps.layout.tp) for n, p in model.named_parameters()
        }
    return result


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    layout: Layout,
    port: int,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores; also keeps reductions deterministic
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=layout.world,
        timeout=timedelta(seconds=120),
    )
    try:
        results.put((rank, fn(ParallelState.create(layout), *args)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], layout: Layout, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(parallel_state, *args)`` on ``layout.world`` spawned ranks; return the results by rank.

    A failing rank raises here with its traceback; a hang past ``timeout`` raises TimeoutError.
    Either way every spawned process is killed before this returns.
    """
    results_q = mp.get_context("spawn").Queue()
    ctx = mp.spawn(
        _entry, args=(fn, layout, free_port(), results_q, args), nprocs=layout.world, join=False
    )
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.05):
            _drain(results_q, results, wait=0.0)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks of layout {layout} did not finish within {timeout:.0f} s"
                )
        while len(results) < layout.world and _drain(results_q, results, wait=5.0):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(10)
        results_q.close()
    if len(results) < layout.world:
        raise RuntimeError(f"only ranks {sorted(results)} of {layout.world} returned a result")
    return [results[r] for r in range(layout.world)]


def _drain(q: Any, results: dict[int, Any], wait: float) -> bool:
    """Move everything queued into ``results``; False when nothing arrived."""
    got = False
    while True:
        try:
            rank, value = q.get(timeout=wait) if wait else q.get_nowait()
        except queue.Empty:
            return got
        results[rank] = value
        got, wait = True, 0.0


def run(
    tp: int, pp: int, dp: int, steps: int, *, timeout: float = 180.0, **train_kwargs: Any
) -> list[float]:
    """Train in layout (tp, pp, dp) until iteration ``steps`` (resuming first with
    ``resume_from=...``); return the global loss of every step this run took."""
    cfg = TrainConfig(steps=steps, **train_kwargs)
    return launch(train_worker, Layout(tp, pp, dp), cfg, timeout=timeout)[0]["losses"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="train until this iteration")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--save-dir", help="write a checkpoint iter_NNNNNNN here every --save-every steps"
    )
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume-from", help="a checkpoint, or a save dir (its newest iter_*)")
    parser.add_argument("--no-load-rng", action="store_true", help="never restore RNG states")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="kill all ranks after this many seconds"
    )
    a = parser.parse_args(argv)
    if a.save_dir and a.save_every <= 0:
        parser.error("--save-dir needs --save-every K > 0")
    cfg = TrainConfig(
        steps=a.steps,
        global_batch=a.global_batch,
        micro_batches=a.micro_batches,
        lr=a.lr,
        save_dir=a.save_dir,
        save_every=a.save_every,
        resume_from=a.resume_from,
        load_rng=False if a.no_load_rng else None,
        verbose=True,
    )
    if cfg.global_batch % (a.dp * cfg.micro_batches):
        parser.error(
            f"--global-batch {cfg.global_batch} must split into dp={a.dp} x {cfg.micro_batches} micro-batches"
        )
    launch(train_worker, Layout(a.tp, a.pp, a.dp), cfg, timeout=a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
