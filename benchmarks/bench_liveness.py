#!/usr/bin/env python
"""The store load of the process heartbeat (:mod:`shardsafe.liveness`), measured at many ranks.

    .venv/bin/python benchmarks/bench_liveness.py [--ranks 64] [--window 20]

A TCPStore server runs in a process of its own; ``ranks`` client processes (forked from one
parent that imported torch, so they share its memory; no process group is needed) each run
the library's own :class:`~shardsafe.liveness.Heartbeat` on a client of that store, and, in
the waiting phases, the library's own arrival wait (``Comm._wait_for_all``, what
:meth:`shardsafe.dist.Comm.arrive` runs). Every request a client makes goes through a
counting wrapper; the server's CPU time is read from ``/proc``. Three windows of
``window`` seconds each:

* ``idle``: every process beating, nobody waiting (between saves);
* ``all wait``: every rank but the last has arrived at a wait and blocks in the store (the
  coordinator watches the one absent rank, the others watch the coordinator);
* ``coordinator waits``: only rank 0 has arrived, it watches ``ranks - 1`` absent ones (the
  coordinator's worst scan).

Requests per second are the protocol's (they do not depend on the machine); the server's CPU
per request is the machine's. The extrapolation to 4,096 ranks is linear in both: each
process's requests do not depend on the number of ranks, except the coordinator's scan.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from shardsafe.dist import Comm
from shardsafe.liveness import INTERVAL, Heartbeat

PHASES = ("idle", "all wait", "coordinator waits")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Counting:
    """A store client that counts the requests made through it (and through its clones)."""

    def __init__(self, store: Any, count: Any, slot: int, lock: threading.Lock) -> None:
        self._store, self._count, self._slot, self._lock = store, count, slot, lock

    def clone(self) -> Counting:
        return Counting(self._store.clone(), self._count, self._slot, self._lock)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._count[self._slot] += 1
            return fn(*args, **kwargs)

        return call


def _server(port: int, ready: Any, stop: Any) -> None:
    store = tdist.TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=300), wait_for_workers=False
    )
    ready.set()
    stop.wait()
    del store


def _client(rank: int, ranks: int, port: int, count: Any, go: Any, release: Any) -> None:
    raw = tdist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=300), wait_for_workers=False
    )
    store = Counting(raw, count, rank, threading.Lock())
    beat = Heartbeat(store, rank, ranks)  # the real heartbeat thread, on a clone of this client
    comm = Comm(None, rank, ranks, True)
    for phase, late in ((1, [ranks - 1]), (2, list(range(1, ranks)))):
        go[phase].wait()
        if rank in late:  # absent from the wait until the window is over, beating meanwhile
            release[phase].wait()
        # the arrival wait Comm.arrive runs, on the base key it would use
        comm._wait_for_all(store, beat, f"bench/arrive/{phase}", f"phase {phase}", 600.0, 600.0)
    go[3].wait()


def _measure(ranks: int, window: float) -> dict[str, tuple[float, float]]:
    ctx = mp.get_context("fork")
    port = _free_port()
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_server, args=(port, ready, stop), daemon=True)
    server.start()
    ready.wait(60)
    count = ctx.Array("q", ranks, lock=False)
    go = [ctx.Event() for _ in range(4)]
    release = [ctx.Event() for _ in range(3)]
    go[0].set()
    procs = [
        ctx.Process(target=_client, args=(r, ranks, port, count, go, release), daemon=True)
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    out: dict[str, tuple[float, float]] = {}
    try:
        deadline = time.monotonic() + 300
        while min(count) < 3 and time.monotonic() < deadline:  # every process beating
            time.sleep(0.5)
        for phase, name in enumerate(PHASES):
            go[phase].set()
            time.sleep(max(3 * INTERVAL, 3.0))  # everyone started and settled
            n0, c0, t0 = sum(count), _cpu_seconds(server.pid or 0), time.monotonic()
            time.sleep(window)
            n1, c1, t1 = sum(count), _cpu_seconds(server.pid or 0), time.monotonic()
            out[name] = ((n1 - n0) / (t1 - t0), (c1 - c0) / (t1 - t0))
            if phase:
                release[phase].set()
        go[3].set()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stop.set()
        server.join(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--window", type=float, default=20.0)
    args = ap.parse_args()
    out = _measure(args.ranks, args.window)
    load = os.getloadavg()[0]
    print(
        f"{args.ranks} ranks, {args.window:.0f} s windows, heartbeat every {INTERVAL:.1f} s; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {load:.1f}"
    )
    print(f"{'phase':<18} {'requests/s':>11} {'server CPU':>11} {'µs/request':>11}")
    for name, (rps, cpu) in out.items():
        print(f"{name:<18} {rps:>11.0f} {100 * cpu:>10.2f}% {1e6 * cpu / max(rps, 1):>11.1f}")
    per_request = sum(c for _, c in out.values()) / max(sum(r for r, _ in out.values()), 1)
    print(
        f"protocol's rates (requests/s) at {args.ranks} ranks: "
        + ", ".join(
            f"{name} {rate:.0f}" for name, rate in zip(PHASES, _nominal(args.ranks), strict=True)
        )
    )
    big = 4096
    print(
        f"at {big} ranks, the protocol's rates and {1e6 * per_request:.1f} µs of server CPU a request:"
    )
    for name, rps in zip(PHASES, _nominal(big), strict=True):
        print(f"{name:<18} {rps:>11.0f} {100 * rps * per_request:>10.1f}%")


def _nominal(n: int) -> tuple[float, float, float]:
    """Requests per second the protocol makes at ``n`` ranks (liveness.py's docstring): one
    beat per process and one ``multi_get`` of the counters it watches; a waiting rank also
    checks the wait's key; the coordinator checks, for each absent rank, its arrival key."""
    idle = 2 * n / INTERVAL
    all_wait = idle + ((n - 1) + 1) / INTERVAL  # one absent rank
    coordinator = idle + (1 + (n - 1)) / INTERVAL  # every other rank absent
    return idle, all_wait, coordinator


if __name__ == "__main__":
    main()
