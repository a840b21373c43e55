"""Fully parallel load on this machine: is sending a replicated piece faster than re-reading it?

Two (or more) gloo ranks load the same replicated tensors, once with every rank reading for
itself and once with one reader sending to the others. Prints the times and the ratio that
the ``fully_parallel="auto"`` heuristic is based on.

    .venv/bin/python benchmarks/bench_parallel_load.py [--mib 512] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from distributed import run_ranks

import shardsafe


def _worker(rank: int, world: int, path: str, mib: int, repeat: int) -> dict[str, float]:
    import torch.distributed as dist

    n = mib * (1 << 20) // 4 // 8
    tensors = [torch.empty(n) for _ in range(8)]
    template = {
        f"t{i}": shardsafe.ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=rank)
        for i, t in enumerate(tensors)
    }
    times: dict[str, float] = {}
    for mode in (False, True, False, True)[: 2 * repeat]:
        dist.barrier()
        t0 = time.perf_counter()
        shardsafe.load(template, path, fully_parallel=mode)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        key = "shared" if mode else "each_reads"
        times[key] = min(times.get(key, float("inf")), elapsed)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=512, help="replicated state in MiB")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="shardsafe-bench-")
    try:
        path = os.path.join(root, "ckpt")
        n = args.mib * (1 << 20) // 4 // 8
        shardsafe.save(
            {
                f"t{i}": shardsafe.ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(n))
                for i in range(8)
            },
            path,
        )
        results = run_ranks(_worker, args.world, path, args.mib, args.repeat, timeout=600)
        each = max(r["each_reads"] for r in results)
        shared = max(r["shared"] for r in results)
        print(f"{args.world} gloo ranks, {args.mib} MiB replicated on every rank (page cache warm)")
        print(
            f"  every rank reads   : {each:7.3f} s  ({args.mib / 1024 / each:.2f} GiB/s per rank)"
        )
        print(f"  read once and send : {shared:7.3f} s")
        print(
            f"  ratio shared / each: {shared / each:.2f}  ->  {'share' if shared < each else 'every rank reads'} on this machine"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
