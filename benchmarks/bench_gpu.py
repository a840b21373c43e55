#!/usr/bin/env python
"""GPU checkpointing benchmark: shardsafe against the machine's limits and DCP, in one run.

    .venv/bin/python benchmarks/bench_gpu.py --device cuda [--gib 8] [--tensors 195]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --gib 0.125      # the same on CPU

One process, one device. The state is ``--tensors`` fp32 tensors of varied sizes on the device
(``--gib`` in all). Every figure is the best of ``--repeat`` and is printed as a ratio to what
it is compared with, all measured in this run on the same bytes:

- machine limits: device-to-host copy into pinned memory and into pageable memory (on CPU:
  memcpy into touched and into fresh memory), an ``O_DIRECT`` write (with fsync) and read of
  the same bytes, and a read of them from the page cache;
- DCP: ``async_save`` with its default stager and with its pinned stager (``DefaultStager``,
  pinned, asynchronous staging; blocking there lasts until staging completes, the earliest the
  state may change), ``save`` and ``load``;
- shardsafe: the first ``async_save`` of a fresh Saver (blocking time), the same after
  ``Saver.prepare(state)``, later saves (blocking and total), ``save``, ``load`` (as the saves
  left the page cache, and cold), pinned bytes / share;
- the training-step cost around a save: a loop of steps (matmuls plus an in-place update of
  every state tensor, like an optimizer step) started right after the call, against the same
  loop without a save; the checkpoint must equal the state at the call (checked, per library).

The figures and the machine description go to ``--out`` (``bench_gpu.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import shardsafe
from shardsafe import ShardedTensor
from shardsafe.directio import DirectIO

GIB = 1 << 30


# --------------------------------------------------------------------------- the state


def make_state(device: str, total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of varied sizes, ``total`` bytes in all, on ``device``."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.8, count)
    weights[: max(1, count // 10)] *= 8  # a few big ones (embeddings, MLP weights)
    sizes = np.maximum(1, (weights / weights.sum() * total / 4).astype(np.int64))
    cols = 1024
    out = {}
    for i, n in enumerate(sizes):
        rows = max(1, int(n) // cols)
        out[f"layer.{i:03d}.w"] = torch.randn(rows, cols, device=device)
    return out


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


# --------------------------------------------------------------------------- machine limits


def copy_limits(state: dict[str, torch.Tensor], device: str, repeat: int) -> dict[str, float]:
    """Device-to-host copy of the whole state into pinned and into pageable memory."""
    total = nbytes(state)
    tensors = [t.reshape(-1).view(torch.uint8) for t in state.values()]
    out: dict[str, float] = {}
    if device == "cuda":
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(total, dtype=torch.uint8)
        pageable.fill_(0)

        def into(dst: torch.Tensor, non_blocking: bool) -> float:
            def run() -> None:
                pos = 0
                for t in tensors:
                    dst[pos : pos + t.numel()].copy_(t, non_blocking=non_blocking)
                    pos += t.numel()

            return timed(run, device)[0]

        out["d2h_pinned"] = best(lambda: into(pinned, True), repeat)
        out["d2h_pageable"] = best(lambda: into(pageable, False), repeat)
        del pinned, pageable
        empty = getattr(torch._C, "_host_emptyCache", None)
        if callable(empty):
            empty()  # give torch's cached pinned block back before the libraries run
    else:
        touched = torch.empty(total, dtype=torch.uint8)
        touched.fill_(0)

        def memcpy(fresh: bool) -> float:
            def run() -> None:
                dst = torch.empty(total, dtype=torch.uint8) if fresh else touched
                pos = 0
                for t in tensors:
                    dst[pos : pos + t.numel()].copy_(t)
                    pos += t.numel()

            return timed(run, device)[0]

        out["memcpy_touched"] = best(lambda: memcpy(False), repeat)
        out["memcpy_fresh"] = best(lambda: memcpy(True), repeat)
        del touched
    return out


def evict(path: str) -> None:
    """Drop ``path``'s pages (every file under it) from the page cache."""
    files = (
        [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        if os.path.isdir(path)
        else [path]
    )
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_limits(total: int, root: str, repeat: int) -> dict[str, float]:
    """``O_DIRECT`` write (fsync) and cold read of ``total`` bytes; their read from the page
    cache after a buffered write."""
    total = -(-total // 4096) * 4096
    buf = np.frombuffer(mmap.mmap(-1, total), dtype=np.uint8)
    buf[:] = 7
    view = memoryview(buf)
    chunk = 64 << 20
    path = os.path.join(root, "limits.bin")
    out: dict[str, float] = {}

    def write(flags: int) -> float:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            start = time.perf_counter()
            for pos in range(0, total, chunk):
                os.pwrite(fd, view[pos : pos + chunk], pos)
            os.fsync(fd)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    def read(flags: int) -> float:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            start = time.perf_counter()
            for pos in range(0, total, chunk):
                os.preadv(fd, [view[pos : pos + chunk]], pos)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    direct = getattr(os, "O_DIRECT", 0)
    try:
        out["odirect_write"] = best(lambda: write(direct), repeat)
        out["odirect_read"] = best(lambda: (evict(path), read(direct))[1], repeat)
    except OSError as e:  # a file system without O_DIRECT
        print(f"  (no O_DIRECT here: {e})")
    out["buffered_write"] = best(lambda: write(0), repeat)
    read(0)  # now cached
    out["page_cache_read"] = best(lambda: read(0), repeat)
    os.remove(path)
    return out


# --------------------------------------------------------------------------- the libraries


class Ours:
    name = "shardsafe"

    def __init__(self, direct_io: str | None = None) -> None:
        self.saver = shardsafe.Saver(direct_io=direct_io)

    @staticmethod
    def sharded(state: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}

    def async_save(self, state: dict[str, torch.Tensor], path: str) -> Callable[[], None]:
        """Start a save; returns the function that waits for it (the state may change now)."""
        handle = self.saver.async_save(self.sharded(state), path)
        return lambda: handle.result() and None

    def save(self, state: dict[str, torch.Tensor], path: str) -> None:
        self.saver.save(self.sharded(state), path)

    def load(self, template: dict[str, torch.Tensor], path: str) -> None:
        shardsafe.load(self.sharded(template), path)

    def close(self) -> None:
        self.saver.close()


class Dcp:
    def __init__(self, pinned: bool) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.pinned = pinned
        self.name = "DCP pinned stager" if pinned else "DCP"
        self.stager = None
        if pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=True,
                )
            )

    def async_save(self, state: dict[str, torch.Tensor], path: str) -> Callable[[], None]:
        if self.stager is None:
            fut = self.dcp.async_save(state, checkpoint_id=path, no_dist=True)
            return lambda: fut.result() and None
        resp = self.dcp.async_save(
            state, checkpoint_id=path, no_dist=True, async_stager=self.stager
        )
        staged = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        if staged is not None:
            staged.result()  # the state must not change before DCP has staged it
        return lambda: upload.result() and None

    def save(self, state: dict[str, torch.Tensor], path: str) -> None:
        self.dcp.save(state, checkpoint_id=path, no_dist=True)

    def load(self, template: dict[str, torch.Tensor], path: str) -> None:
        self.dcp.load(template, checkpoint_id=path, no_dist=True)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


# --------------------------------------------------------------------------- training steps


class Trainer:
    """A step: a few matmuls, then every state tensor updated in place (an optimizer step)."""

    def __init__(self, state: dict[str, torch.Tensor], device: str, size: int) -> None:
        self.state = state
        self.device = device
        self.x = torch.randn(size, size, device=device)
        self.w = torch.randn(size, size, device=device) / size**0.5
        self.tensors = list(state.values())

    def step(self) -> None:
        y = self.x
        for _ in range(4):
            y = torch.tanh(y @ self.w)
        torch._foreach_add_(self.tensors, 1.0)
        self.x = y

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            out.append(timed(self.step, self.device)[0])
        return out


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    total = int(args.gib * GIB)
    root = tempfile.mkdtemp(prefix="shardsafe-gpu-bench-", dir=args.dir)
    counter = [0]

    def fresh(tag: str) -> str:
        counter[0] += 1
        path = os.path.join(root, f"{tag}-{counter[0]}")
        return path

    def drop(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    state = make_state(device, total, args.tensors)
    share = nbytes(state)
    figures: dict[str, Any] = {"share_bytes": share, "tensors": len(state)}
    print(f"state: {share / 1e9:.2f} GB in {len(state)} fp32 tensors on {device}")

    print("machine limits ...")
    figures.update(copy_limits(state, device, args.repeat))
    figures.update(disk_limits(share, root, args.repeat))

    template = {k: torch.zeros_like(v) for k, v in state.items()}

    def check(path: str, lib: Any, expected: dict[str, torch.Tensor]) -> bool:
        for t in template.values():
            t.zero_()
        lib.load(template, path)
        return all(torch.equal(template[k], expected[k]) for k in expected)

    # -- first saves: a fresh Saver, then one prepared ahead
    print("shardsafe first saves ...")
    ours = Ours(args.direct_io)
    path = fresh("ours-first")
    blocked, wait = timed(lambda: ours.async_save(state, path), "cpu")
    wait()
    figures["ours_first_blocking"] = blocked
    ours.saver.staging.wait_prepared()
    figures["ours_pinned_bytes"] = ours.saver.staging.pinned_bytes
    figures["ours_staging_bytes"] = ours.saver.staging.allocated_bytes
    ours.close()
    drop(path)

    ours = Ours(args.direct_io)
    start = time.perf_counter()
    ours.saver.prepare(Ours.sharded(state))
    figures["ours_prepare_returns"] = time.perf_counter() - start
    ours.saver.staging.wait_prepared()
    figures["ours_prepare_locked"] = time.perf_counter() - start
    path = fresh("ours-prepared")
    blocked, wait = timed(lambda: ours.async_save(state, path), "cpu")
    wait()
    figures["ours_first_blocking_prepared"] = blocked
    drop(path)

    # -- warm saves and loads
    print("warm saves and loads ...")
    libs: list[Any] = [ours, Dcp(pinned=False)]
    if device == "cuda":
        libs.append(Dcp(pinned=True))
    for lib in libs:
        key = lib.name
        samples: dict[str, list[float]] = {"blocking": [], "total": [], "save": [], "load": []}
        cold: list[float] = []
        for _ in range(args.repeat):
            path = fresh("w")
            start = time.perf_counter()
            wait = lib.async_save(state, path)
            samples["blocking"].append(time.perf_counter() - start)
            wait()
            samples["total"].append(time.perf_counter() - start)
            drop(path)
            if isinstance(lib, Dcp) and lib.pinned:
                continue  # its sync save and load are DCP's own, measured once
            path = fresh("s")
            samples["save"].append(
                timed(lambda lib=lib, path=path: lib.save(state, path), device)[0]
            )
            samples["load"].append(
                timed(lambda lib=lib, path=path: lib.load(template, path), device)[0]
            )
            evict(path)
            cold.append(timed(lambda lib=lib, path=path: lib.load(template, path), device)[0])
            drop(path)
        figures[key] = {k: min(v) for k, v in samples.items() if v}
        figures[key]["load_cold"] = min(cold) if cold else None

    # -- the training-step cost around a save, and the checkpoint equals the state at the call
    print("training steps around a save ...")
    trainer = Trainer(state, device, args.matmul)
    trainer.steps(3)  # warm up
    base = trainer.steps(args.steps)
    figures["step_alone"] = statistics.mean(base)
    for lib in libs:
        expected = {k: v.clone() for k, v in state.items()}
        path = fresh("t")
        start = time.perf_counter()
        wait = lib.async_save(state, path)
        blocked = time.perf_counter() - start
        times = trainer.steps(args.steps)  # changes the state right after the call
        wait()
        ok = check(path, lib, expected)
        drop(path)
        del expected
        figures[lib.name]["step_during_save"] = statistics.mean(times)
        figures[lib.name]["step_blocking"] = blocked
        figures[lib.name]["checkpoint_equals_state_at_call"] = ok
        if not ok:
            raise SystemExit(f"{lib.name}: the checkpoint differs from the state at the call")
    for lib in libs:
        lib.close()
    shutil.rmtree(root, ignore_errors=True)
    return figures


def report(figures: dict[str, Any], device: str) -> list[str]:
    lines = []
    ours, dcp = figures["shardsafe"], figures["DCP"]
    pinned = figures.get("DCP pinned stager")
    copy = figures.get("d2h_pinned", figures.get("memcpy_touched"))
    copy_name = "pinned D2H copy" if device == "cuda" else "memcpy (touched)"

    def r(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    def row(what: str, value: float | None, against: list[tuple[str, float | None]]) -> None:
        value_s = f"{value:.3f} s" if value is not None else "n/a"
        lines.append(
            f"{what:<38} {value_s:>10}   " + ", ".join(f"{r(value, b)} {n}" for n, b in against)
        )

    lines.append(f"{'figure':<38} {'value':>10}   ratios")
    # a first save also touches its staging memory for the first time
    first = [(copy_name, copy)]
    if device == "cpu":
        first.append(("memcpy (fresh)", figures["memcpy_fresh"]))
    row("first async save: blocking", figures["ours_first_blocking"], first)
    row("first async save after prepare", figures["ours_first_blocking_prepared"], first)
    row("  prepare (returns / locked)", figures["ours_prepare_returns"], [])
    lines[-1] += f"{figures['ours_prepare_locked']:.3f} s until locked"
    against = [(copy_name, copy), ("DCP async_save", dcp["blocking"])]
    if pinned:
        against.append(("DCP pinned stager", pinned["blocking"]))
    row("async save: blocking (warm)", ours["blocking"], against)
    against = [("DCP async_save", dcp["total"]), ("our save", ours["save"])]
    if pinned:
        against.append(("DCP pinned stager", pinned["total"]))
    row("async save: total (warm)", ours["total"], against)
    row(
        "save",
        ours["save"],
        [
            ("DCP save", dcp["save"]),
            ("O_DIRECT write", figures.get("odirect_write")),
            ("buffered write", figures.get("buffered_write")),
        ],
    )
    row(
        "load, page cache as the save left it",
        ours["load"],
        [("DCP load", dcp["load"]), ("page-cache read", figures.get("page_cache_read"))],
    )
    row(
        "load, cold",
        ours["load_cold"],
        [("DCP load cold", dcp["load_cold"]), ("O_DIRECT read", figures.get("odirect_read"))],
    )
    step = figures["step_alone"]
    for name in [n for n in ("shardsafe", "DCP", "DCP pinned stager") if n in figures]:
        f = figures[name]
        row(f"step during a save: {name}", f["step_during_save"], [("step alone", step)])
    share = figures["share_bytes"]
    staged = figures["ours_pinned_bytes"] if device == "cuda" else figures["ours_staging_bytes"]
    lines.append(
        f"{'pinned bytes / share' if device == 'cuda' else 'staging bytes / share':<38} "
        f"{staged / share:>9.3f}x   ({staged} / {share})"
    )
    if device == "cuda":
        lines.append(
            f"{'limits':<38} pinned D2H {share / figures['d2h_pinned'] / 1e9:.2f} GB/s, "
            f"pageable D2H {share / figures['d2h_pageable'] / 1e9:.2f} GB/s"
        )
    lines.append(
        f"{'':<38} O_DIRECT write {share / figures.get('odirect_write', float('nan')) / 1e9:.2f} GB/s, "
        f"O_DIRECT read {share / figures.get('odirect_read', float('nan')) / 1e9:.2f} GB/s, "
        f"page-cache read {share / figures['page_cache_read'] / 1e9:.2f} GB/s"
    )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--gib", type=float, default=None, help="state size (default 8 cuda, 0.125 cpu)"
    )
    ap.add_argument("--tensors", type=int, default=195)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="training steps timed per case")
    ap.add_argument("--matmul", type=int, default=None, help="matmul size of a step")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: the temp dir)")
    ap.add_argument("--direct-io", default=None, help="shardsafe's direct_io (default: auto)")
    ap.add_argument("--out", default="bench_out", help="where bench_gpu.json goes")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    if args.gib is None:
        args.gib = 8.0 if args.device == "cuda" else 0.125
    if args.matmul is None:
        args.matmul = 4096 if args.device == "cuda" else 256
    started = time.perf_counter()
    figures = run(args)
    lines = report(figures, args.device)
    print()
    print("\n".join(lines))
    machine = {
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "shardsafe": shardsafe.__version__,
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "direct_io_policy": str(
            DirectIO(args.direct_io).policy(
                shardsafe.storage.LocalStorage(args.dir or tempfile.gettempdir())
            )
        ),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump(
            {"machine": machine, "args": vars(args), "figures": figures, "table": lines},
            f,
            indent=1,
        )
    print(
        f"\n{machine}\ntotal {time.perf_counter() - started:.0f} s; wrote {args.out}/bench_gpu.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
