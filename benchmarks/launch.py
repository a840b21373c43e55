"""Run a benchmark function on ``world`` gloo ranks in new processes; results by rank.

The benchmarks' one launcher: each rank joins a process group on a free local port, runs
``fn(rank, world, cfg)`` and puts its result (or its traceback) on a queue; a rank that dies
without a word is named by its exit code, and the whole run is bounded by ``timeout``.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[[int, int, dict[str, Any]], Any],
    cfg: dict[str, Any],
    out: Any,
    pg_timeout: float,
    one_thread: bool,
) -> None:
    if one_thread:
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    import torch
    import torch.distributed as dist

    if one_thread:
        torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out.put((rank, "ok", fn(rank, world, cfg)))
    except BaseException as e:
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def launch(
    fn: Callable[[int, int, dict[str, Any]], Any],
    world: int,
    cfg: dict[str, Any],
    timeout: float,
    *,
    start_method: str = "spawn",
    pg_timeout: float = 600.0,
    one_thread: bool = False,
) -> list[Any]:
    """``fn(rank, world, cfg)`` on ``world`` new processes (``fn`` a module-level function);
    the results by rank, or a ``RuntimeError`` holding every failed rank's traceback."""
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, cfg, out, pg_timeout, one_thread))
        for r in range(world)
    ]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    what = getattr(fn, "__name__", "the benchmark")
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"world {world}: {what} did not finish in {timeout:.0f} s")
            try:
                rank, status, value = out.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in results and r not in errors:
                        errors[r] = f"process exited with code {p.exitcode}"
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RuntimeError(
            "\n".join(f"--- world {world} rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        )
    return [results[r] for r in range(world)]
