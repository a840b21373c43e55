"""How long opening a connection to a TCP store takes, one after another (a machine fact).

shardsafe opens a few store connections per process (the process group's, the heartbeat's, and
one per Saver for the commit protocol). On the machine the README's figures come from, about
every 25th connection to a store server took 5.0 s to open, whatever the backend, while the others
took a millisecond; the opening thread holds the interpreter meanwhile. The cause: torch's
TCPStore client names the address it connected to (``getnameinfo`` without
``NI_NUMERICHOST``, in ``c10d::detail::SocketImpl``'s constructor) on every connection. It
connects to ``127.0.0.1`` as the IPv4-mapped ``::ffff:127.0.0.1``, which the ``127.0.0.1``
line of ``/etc/hosts`` does not match, so each connection asks the DNS server for the name
of ``1.0.0.127.in-addr.arpa``; that server here drops about every 25th query, and glibc's
resolver waits its 5 s timeout before asking again. This script measures both, with a bare
``torch.distributed.TCPStore`` and with ``socket.getnameinfo`` alone, no shardsafe involved:

    .venv/bin/python benchmarks/store_connect.py [--connections 60] [--legacy]

A line ``::ffff:127.0.0.1 localhost`` in ``/etc/hosts`` (for a store on another host: its
address in that form) answers the lookup from the file; with it, 80 connections here opened
in 0.1 ms each, none slow.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import time
from collections.abc import Callable
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
    clients: list[Any] = []

    def connect() -> None:
        clients.append(
            dist.TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                timeout=timedelta(seconds=60),
                wait_for_workers=False,
            )
        )

    def look_up() -> None:
        with contextlib.suppress(OSError):  # no name: the time is what counts
            socket.getnameinfo(("::ffff:127.0.0.1", port, 0, 0), socket.NI_NUMERICSERV)

    _report(connect, args.connections, "connections opened one after another")
    server.kill()
    _report(
        look_up,
        args.connections,
        "lookups of the name of ::ffff:127.0.0.1 (what each TCPStore connection makes)",
    )


def _report(fn: Callable[[], None], n: int, what: str) -> None:
    """Run ``fn`` ``n`` times one after another; print the median and every slow one."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        fn()
        times.append(time.monotonic() - t0)
    slow = [(i + 1, round(t, 2)) for i, t in enumerate(times) if t > 0.5]
    print(
        f"{n} {what}: median {sorted(times)[len(times) // 2] * 1000:.1f} ms; "
        f"slower than 0.5 s (n-th, seconds): {slow or 'none'}"
    )


if __name__ == "__main__":
    main()
