"""Run a function on N CPU ranks with the gloo backend, with a hard timeout and cleanup.

Each call picks its own free port; every child is killed if the body fails or hangs, so a
broken test never leaves processes behind. ``fn`` must be a module-level function (it is
pickled by reference for the children); it receives ``(rank, world_size, *args)``.

Ranks are forked from a forkserver that imported torch once (:data:`PRELOAD`, set up by
``conftest.py``): a spawned rank spends seconds importing torch again, which on a two-core
CI machine was most of the suite's time. Each child is still a fresh process (the server runs no threads and holds no
test state); it gets the caller's current environment and working directory, as a spawned
one would, so fixtures that export variables (the S3 server's endpoint) still reach it. Only
what a preloaded module reads at import time (``SHARDSAFE_DIRECT_IO``) is fixed when the server
starts: a test that changes such a variable passes ``start_method="spawn"``.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint.state_dict",
    "numpy",
    "shardsafe",
    "shardsafe.convert",
)
"""What the forkserver imports once for every rank it forks (the costly part of a start)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    pg_timeout: float,
    env: dict[str, str] | None = None,
) -> None:
    import torch.distributed as dist

    if env is not None:  # the caller's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world, *args)
        out.put((rank, "ok", result))
    except BaseException as e:  # report everything, including SystemExit from the body
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankFailure(AssertionError):
    """One or more ranks raised; ``errors`` maps rank -> formatted exception."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results by rank.

    Raises :class:`RankFailure` if any rank raised, and ``TimeoutError`` (after killing every
    child) if they do not all finish within ``timeout`` seconds. The default
    ``start_method="forkserver"`` starts each rank without importing torch again;
    ``"spawn"`` gives a child that imports everything itself.
    """
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_entry, args=(r, world, port, fn, args, out, pg_timeout, env), daemon=True
        )
        for r in range(world)
    ]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{world} ranks did not finish within {timeout} s (done: {sorted(results)}, failed: {sorted(errors)})"
                )
            try:
                rank, status, value = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    if errors:
        raise RankFailure(errors)
    return [results[r] for r in range(world)]


def preload_forkserver(*modules: str) -> None:
    """Have the forkserver import :data:`PRELOAD` and ``modules`` once, so each process forked
    from it starts fresh but fast (the server runs no threads, unlike a process that has
    trained). Takes effect only before the server's first start (one server per test run)."""
    mp.get_context("forkserver").set_forkserver_preload([*PRELOAD, *modules])
