"""A pool of gloo CPU rank processes reused by the tests of one module.

Starting a rank costs seconds even when forked from the server that preloaded torch (heavy
framework imports such as Megatron-Core, the process group), so a test module that runs
several multi-process tests starts its ranks once and sends
each test a module-level function to run on every rank. Every call has a hard timeout; a pool
whose call failed or timed out is killed, and the next call starts a fresh one, so one broken
test cannot leave the next with half-initialised processes.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp
from distributed import RankFailure, free_port


def _serve(
    rank: int, world: int, port: int, inbox: Any, out: Any, pg_timeout: float, env: dict[str, str]
) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment, not the forkserver's at its start
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, args, timeout = job
            # a hung rank prints where it hangs before the caller kills it
            faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
            try:
                result = fn(rank, world, *args)
                ForkingPickler.dumps(result)  # fail here, not silently in the queue's feeder thread
                out.put((rank, "ok", result))
            except BaseException as e:
                out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            finally:
                faulthandler.cancel_dump_traceback_later()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class RankPool:
    """``world`` gloo ranks; ``run(fn, *args)`` calls ``fn(rank, world, *args)`` on each."""

    def __init__(self, world: int, pg_timeout: float = 60.0) -> None:
        self.world = world
        self.pg_timeout = pg_timeout
        self.procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")  # ranks start without importing torch again
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        env = dict(os.environ)
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, self.world, port, self.inboxes[r], self.out, self.pg_timeout, env),
                daemon=False,  # ranks may start helper processes (Megatron's save does)
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        """Results by rank; :class:`RankFailure` if a rank raised, TimeoutError if one hung."""
        import time

        if not self.procs or any(not p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for inbox in self.inboxes:
            inbox.put((fn, args, timeout))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < self.world:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self.world} ranks did not finish {fn.__name__} within {timeout} s "
                        f"(done: {sorted(results)}, failed: {sorted(errors)})"
                    )
                try:
                    rank, status, value = self.out.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    for r, p in enumerate(self.procs):
                        if not p.is_alive() and r not in results and r not in errors:
                            errors[r] = f"process exited with code {p.exitcode}"
                    continue
                (results if status == "ok" else errors)[rank] = value
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()  # a failed rank may have left collectives half done
            raise RankFailure(errors)
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for p, inbox in zip(self.procs, getattr(self, "inboxes", [])):
            if p.is_alive():
                try:
                    inbox.put(None)
                except Exception:
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
