"""What a host copy of a few MiB costs after the host was idle: torch's ``copy_`` (its intra-op
thread pool, woken first) against the calling thread's copy (a machine fact).

``StagingPool`` copies a stage of at most ``inline_bytes`` of CPU tensors on the calling thread
(numpy) and a bigger one with torch's ``copy_``. A step that leaves the host idle (a GPU
computes, or ``bench_recovery.py --idle-step`` waits) lets the pool's threads sleep; where
waking them is slow (5 ms on the gVisor VM of the README's figures) it outweighs a copy of a
few MiB. Each copy here follows an idle gap (``--gap``), as a save after a step does:

    .venv/bin/python benchmarks/staging_copy.py [--mib 4 16 64] [--gap 0.05] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def after_idle(fn: Callable[[], None], gap: float, repeat: int) -> float:
    """Median seconds of ``fn()``, each call after ``gap`` s of sleep."""
    times = []
    for _ in range(repeat):
        time.sleep(gap)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(mib: int, gap: float, repeat: int) -> tuple[float, float, float]:
    """A copy of ``mib`` MiB: torch's after idle, the calling thread's after idle, torch's
    back to back (its pool awake)."""
    src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    s, d = src.numpy(), dst.numpy()
    woken = after_idle(lambda: dst.copy_(src), gap, repeat)
    calling = after_idle(lambda: np.copyto(d, s), gap, repeat)
    warm = after_idle(lambda: dst.copy_(src), 0.0, repeat)
    return woken, calling, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--gap", type=float, default=0.05, help="idle seconds before each copy")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, gap {args.gap} s"
    )
    print(
        f"{'MiB':>5} {'torch copy_ ms':>15} {'calling thread ms':>18} {'back-to-back copy_ ms':>22}"
    )
    for mib in args.mib:
        woken, calling, warm = measure(mib, args.gap, args.repeat)
        print(f"{mib:>5} {woken * 1e3:>15.2f} {calling * 1e3:>18.2f} {warm * 1e3:>22.2f}")


if __name__ == "__main__":
    main()
