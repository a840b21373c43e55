#!/usr/bin/env python
"""DCP through shardsafe's storage layer against DCP's own, same state, same run.

    .venv/bin/python benchmarks/bench_dcp_layer.py [--mib 256] [--worlds 2] [--repeat 3]
                                                   [--dir DIR] [--out results.json]

Every world size runs as its own set of spawned CPU processes (gloo). The state is a dict of
fp32 DTensors sharded on axis 0 over a 1-D mesh (plus a step counter), ``--mib`` in all.
Timed with DCP's own calls, only the storage differs: ``dcp.save`` with
``shardsafe.dcp.Writer`` vs ``FileSystemWriter``; ``dcp.async_save`` (blocking time until it
returns, and total until its future is done) with the Writer as its stager vs
``FileSystemWriter`` with DCP's default stager; ``dcp.load`` in the same layout with
``shardsafe.dcp.Reader`` vs ``FileSystemReader``. Each sample is the max over ranks; the best
of ``--repeat`` is reported, with the ratio ours / DCP's. Every checkpoint goes to a fresh
directory; nothing is dropped from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

from launch import launch as spawn_ranks

MIB = 1 << 20


def _state(mib: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows_total = max(world, (mib * MIB) // (4 * 1024) // 8)  # 8 tensors of 1024 columns
    state: dict[str, Any] = {"step": 1}
    for i in range(8):
        rows = rows_total + i  # uneven on purpose
        per = -(-rows // world)
        rank = mesh.get_local_rank()
        start, stop = min(rows, rank * per), min(rows, (rank + 1) * per)
        local = torch.arange(start * 1024, stop * 1024, dtype=torch.float32).reshape(-1, 1024)
        state[f"layer{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, 1024), stride=(1024, 1)
        )
    return state


def _max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from shardsafe.dcp import Reader, Writer

    warnings.simplefilter("ignore")
    state = _state(cfg["mib"], world)
    root = cfg["dir"]
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        samples.setdefault(name, []).append(_max_over_ranks(time.perf_counter() - t0))
        return out

    def fresh(name: str) -> str:
        path = os.path.join(root, name)
        if rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
        dist.barrier()
        return path

    writer = Writer(os.path.join(root, "unused"))  # one Writer: its plan cache and arena reused
    for n in range(cfg["repeat"]):
        ours, theirs = fresh(f"ours_{n}"), fresh(f"dcp_{n}")
        timed("save_ours", lambda p=ours: dcp.save(state, storage_writer=writer, checkpoint_id=p))
        timed("save_dcp", lambda p=theirs: dcp.save(state, storage_writer=dcp.FileSystemWriter(p)))
        for tag, make in (
            ("ours", lambda p: writer),
            ("dcp", lambda p: dcp.FileSystemWriter(p)),
        ):
            path = fresh(f"async_{tag}_{n}")
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=make(path), checkpoint_id=path)
            blocked = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
            samples.setdefault(f"async_block_{tag}", []).append(_max_over_ranks(blocked))
            samples.setdefault(f"async_total_{tag}", []).append(_max_over_ranks(total))
        target = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()
        }
        timed("load_ours", lambda p=ours, t=target: dcp.load(t, storage_reader=Reader(p)))
        ok = all(
            torch.equal(target[k]._local_tensor, state[k]._local_tensor)
            for k in state
            if k != "step"
        )
        timed(
            "load_dcp",
            lambda p=theirs, t=target: dcp.load(t, storage_reader=dcp.FileSystemReader(p)),
        )
        assert ok and target["step"] == 1, "the Reader loaded different values"
    writer.close()
    return {"samples": samples}


# --------------------------------------------------------------------------- launcher


def launch(world: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run :func:`run` on ``world`` spawned processes; results by rank."""
    return spawn_ranks(run, world, cfg, timeout)


def report(world: int, mib: int, samples: dict[str, list[float]]) -> list[str]:
    best = {k: min(v) for k, v in samples.items()}
    lines = [f"world {world}, {mib} MiB fp32 DTensors, best of {len(samples['save_ours'])}:"]
    for label, name in (
        ("dcp.save", "save"),
        ("dcp.async_save blocking", "async_block"),
        ("dcp.async_save total", "async_total"),
        ("dcp.load (same layout)", "load"),
    ):
        ours, theirs = best[f"{name}_ours"], best[f"{name}_dcp"]
        lines.append(
            f"  {label:<26} shardsafe.dcp {ours:8.3f} s   DCP FileSystem {theirs:8.3f} s   "
            f"ratio {ours / theirs:5.2f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--worlds", default="2", help="comma-separated world sizes (default 2)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write every sample as JSON here")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="bench_dcp_layer_")
    everything: dict[str, Any] = {"mib": args.mib, "worlds": {}}
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = {"mib": args.mib, "repeat": args.repeat, "dir": os.path.join(base, f"w{world}")}
            os.makedirs(cfg["dir"], exist_ok=True)
            per_rank = launch(world, cfg, timeout=1800)
            samples = per_rank[0]["samples"]  # already the max over ranks
            everything["worlds"][world] = samples
            print("\n".join(report(world, args.mib, samples)), flush=True)
            shutil.rmtree(cfg["dir"], ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
