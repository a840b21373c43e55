#!/usr/bin/env python
"""The commit protocol's own cost at many ranks on one machine.

    .venv/bin/python benchmarks/bench_protocol.py [--world 64] [--repeat 5] [--dir /tmp/x]

Forks ``world`` gloo ranks from one parent that has imported torch (so they share its
memory) and times, on rank 0, with a tiny state (one 256-element float32 piece per rank),
so that the time is the protocol's and not the bytes':

* ``channel``: the store protocol alone: open the channel (the process heartbeat hastened;
  the two store connections a Saver keeps), post a record, rank 0 collects every record and
  publishes, every rank reads it;
* ``barrier``: a gloo ``dist.barrier()``, for scale;
* ``save``/``async_save``: whole saves (plan cached after the first, lease, write, commit,
  rename), median over ``repeat`` after one warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(
    rank: int, world: int, port: int, base: str, repeat: int, saves_only: bool, out: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    from shardsafe import Saver, ShardedTensor
    from shardsafe.dist import get_comm

    comm = get_comm()
    timings: dict[str, list[float]] = {"barrier": [], "channel": [], "save": [], "async_save": []}
    if not saves_only:
        from shardsafe.signals import StoreChannel, connect

        clients = connect()  # made once, as a Saver does
    for _ in range(0 if saves_only else repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.barrier()
        timings["barrier"].append(time.perf_counter() - t0)

        token = [uuid.uuid4().hex[:16]]
        dist.broadcast_object_list(token)
        dist.barrier()
        t0 = time.perf_counter()
        ch = StoreChannel(comm, token[0], clients)
        ch.post({"result": {"n": rank}, "error": None})
        if rank == 0:
            ch.collect()
            ch.publish({"total_bytes": 0})
        else:
            ch.await_status()
        ch.cleanup()
        timings["channel"].append(time.perf_counter() - t0)

    saver = Saver()
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((256,), float(rank)), (0, rank, world))
    }
    for kind in ("save", "async_save"):
        for i in range(repeat + 1):
            dist.barrier()
            t0 = time.perf_counter()
            path = f"{base}/{kind}_{i}"
            if kind == "save":
                saver.save(state, path)
            else:
                saver.async_save(state, path).result(600)
            timings[kind].append(time.perf_counter() - t0)
    saver.close()
    dist.barrier()
    if rank == 0:
        out.put({k: statistics.median(v[1:]) for k, v in timings.items() if v})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--saves-only", action="store_true", help="time whole saves only (any shardsafe version)"
    )
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        procs = [
            ctx.Process(
                target=_rank, args=(r, args.world, port, base, args.repeat, args.saves_only, out)
            )
            for r in range(args.world)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        try:
            result = out.get(timeout=1800)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    result = {k: round(v * 1000, 1) for k, v in result.items()}
    print(
        json.dumps(
            {
                "world": args.world,
                "cpus": os.cpu_count(),
                "ms_median": result,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
