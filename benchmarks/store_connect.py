"""How long opening a connection to a TCP store takes, one after another (a machine fact).

shardsafe opens a few store connections per process (the process group's, the heartbeat's, and
two per Saver for the commit protocol). On the machine the README's figures come from, about
every 25th connection to a store server took 5.0 s to open, whatever the backend, while the others
took a millisecond; the opening thread holds the interpreter meanwhile. This script measures
it with a bare ``torch.distributed.TCPStore``, no shardsafe involved:

    .venv/bin/python benchmarks/store_connect.py [--connections 60] [--legacy]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any

from launch import free_port


def _server(port: int, ready: Any, libuv: bool) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False, use_libuv=libuv)
    ready.set()
    time.sleep(600)
    del store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=60)
    ap.add_argument("--legacy", action="store_true", help="the server without libuv")
    args = ap.parse_args()
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port, ready = free_port(), ctx.Event()
    server = ctx.Process(target=_server, args=(port, ready, not args.legacy), daemon=True)
    server.start()
    ready.wait()
    clients, times = [], []
    for _ in range(args.connections):
        t0 = time.monotonic()
        clients.append(
            dist.TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                timeout=timedelta(seconds=60),
                wait_for_workers=False,
            )
        )
        times.append(time.monotonic() - t0)
    slow = [(i + 1, round(t, 2)) for i, t in enumerate(times) if t > 0.5]
    print(
        f"{args.connections} connections opened one after another: median "
        f"{sorted(times)[len(times) // 2] * 1000:.1f} ms; slower than 0.5 s (n-th, seconds): "
        f"{slow or 'none'}"
    )
    server.kill()


if __name__ == "__main__":
    main()
