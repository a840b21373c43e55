#!/usr/bin/env python
"""Save/load benchmark: shardsafe against torch.distributed.checkpoint (DCP), same state, same run.

    .venv/bin/python benchmarks/bench_save_load.py [--gib 2] [--worlds 1,2,4] [--out bench_out]
                                                   [--repeat N] [--dir DIR]

Every world size runs as its own set of spawned CPU processes (gloo). The state is a GPT-like
model in fp32 (embedding, per layer qkv/proj/fc1/fc2 weights and biases, two layernorms),
sharded TP-style: column-parallel weights split on axis 0, row-parallel ones on axis 1,
biases of row-parallel layers and layernorms replicated. shardsafe gets ``ShardedTensor``s,
DCP gets ``DTensor``s on a 1-D CPU device mesh over the same local tensors, so both can
reshard on load.

Per rank and reported as the max over ranks (best of ``--repeat``; every sample is in
``results.json``): sync save; async blocking time (until ``async_save`` returns) and total
time (until committed); load in the same layout; load into another world size; the RSS
growth during loads over the already-resident state. Before each measurement nothing is
dropped from the page cache; every checkpoint goes to a fresh directory and old ones are
deleted. How much of a checkpoint is in the page cache before each load is measured
(``mincore``) and printed. shardsafe writes local files with direct I/O, so its checkpoint
is not cached when loaded while DCP's is; one extra load of each with the checkpoint's own
pages evicted (``posix_fadvise``) compares the two cold.

Machine limits on the same per-rank bytes (all ranks at once, interleaved with the
measurements): memcpy into fresh and into already-touched memory, a plain sequential write
with fsync and its read back from the page cache, and the same through ``O_DIRECT`` (the
device's speed).

The training-loop stall of a background save is measured with a step of one CPU matmul plus
a little pure-Python work (standing in for the kernel-launch code of a GPU step), timed
alone and while each library's async save writes in the background.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from launch import launch as spawn_ranks

GIB = 1 << 30
MIB = 1 << 20

# --------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class Spec:
    """One global tensor: its shape and the axis it is split on (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    shard_dim: int | None
    seed: int


def model_specs(total_bytes: int) -> tuple[list[Spec], dict[str, int]]:
    """A GPT whose fp32 parameters come to about ``total_bytes``, with about 8 layers or more."""
    h = 128
    for cand in (4096, 2048, 1024, 512, 256, 128):
        vocab = min(32768, 16 * cand)
        if (vocab * cand + 8 * 12 * cand * cand) * 4 <= total_bytes:
            h = cand
            break
    vocab = min(32768, 16 * h)
    per_layer = (12 * h * h + 13 * h) * 4
    layers = max(2, round((total_bytes - vocab * h * 4) / per_layer))
    specs = [Spec("embedding.word", (vocab, h), 0, 1)]
    for i in range(layers):
        p = f"layers.{i}."
        specs += [
            Spec(p + "ln1.weight", (h,), None, 0),
            Spec(p + "ln1.bias", (h,), None, 0),
            Spec(p + "attn.qkv.weight", (3 * h, h), 0, 0),
            Spec(p + "attn.qkv.bias", (3 * h,), 0, 0),
            Spec(p + "attn.proj.weight", (h, h), 1, 0),
            Spec(p + "attn.proj.bias", (h,), None, 0),
            Spec(p + "ln2.weight", (h,), None, 0),
            Spec(p + "ln2.bias", (h,), None, 0),
            Spec(p + "mlp.fc1.weight", (4 * h, h), 0, 0),
            Spec(p + "mlp.fc1.bias", (4 * h,), 0, 0),
            Spec(p + "mlp.fc2.weight", (h, 4 * h), 1, 0),
            Spec(p + "mlp.fc2.bias", (h,), None, 0),
        ]
    specs += [Spec("final_ln.weight", (h,), None, 0), Spec("final_ln.bias", (h,), None, 0)]
    specs = [Spec(s.name, s.shape, s.shard_dim, i) for i, s in enumerate(specs)]
    info = {"hidden": h, "vocab": vocab, "layers": layers, "tensors": len(specs)}
    return specs, info


def chunk_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` semantics, which DTensor's Shard placement uses too."""
    size = -(-n // world)
    start = min(rank * size, n)
    return start, min(start + size, n)


def local_box(spec: Spec, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offset = [0] * len(spec.shape)
    shape = list(spec.shape)
    if spec.shard_dim is not None:
        a, b = chunk_bounds(spec.shape[spec.shard_dim], world, rank)
        offset[spec.shard_dim], shape[spec.shard_dim] = a, b - a
    return tuple(offset), tuple(shape)


def pattern(spec: Spec, offset: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """Values that depend on the global index, so a misplaced piece is detected after any reshard."""
    import torch

    if len(shape) == 1:
        idx = torch.arange(offset[0], offset[0] + shape[0], dtype=torch.int64)
        return ((idx * 7 + spec.seed) % 4093).to(torch.float32)
    rows = torch.arange(offset[0], offset[0] + shape[0], dtype=torch.int32)[:, None] * 7
    cols = torch.arange(offset[1], offset[1] + shape[1], dtype=torch.int32)[None, :] * 13
    out = rows + cols
    out.add_(spec.seed).remainder_(4093)
    return out.to(torch.float32)


@dataclass
class Local:
    spec: Spec
    offset: tuple[int, ...]
    tensor: Any


def build_state(specs: list[Spec], world: int, rank: int) -> list[Local]:
    out = []
    for s in specs:
        off, shape = local_box(s, world, rank)
        out.append(Local(s, off, pattern(s, off, shape)))
    return out


def verify(state: list[Local]) -> bool:
    import torch

    return all(
        torch.equal(x.tensor, pattern(x.spec, x.offset, tuple(x.tensor.shape))) for x in state
    )


def ours_state_dict(state: list[Local], rank: int, step: int = 0) -> dict[str, Any]:
    import shardsafe

    sd: dict[str, Any] = {
        x.spec.name: shardsafe.ShardedTensor.from_global_offset(
            x.spec.name,
            x.tensor,
            x.spec.shape,
            x.offset,
            replica_id=rank if x.spec.shard_dim is None else 0,
        )
        for x in state
    }
    sd["iteration"] = step
    return sd


def dcp_state_dict(state: list[Local], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd = {}
    for x in state:
        placement = Replicate() if x.spec.shard_dim is None else Shard(x.spec.shard_dim)
        shape = x.spec.shape
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        sd[x.spec.name] = DTensor.from_local(
            x.tensor, mesh, [placement], run_check=False, shape=shape, stride=stride
        )
    return sd


def mcore_state_dict(state: list[Local], rank: int) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor as McoreST

    return {
        x.spec.name: McoreST.from_rank_offsets(
            x.spec.name,
            x.tensor,
            *(
                []
                if x.spec.shard_dim is None
                else [
                    (
                        x.spec.shard_dim,
                        rank,
                        x.spec.shape[x.spec.shard_dim] // x.tensor.shape[x.spec.shard_dim],
                    )
                ]
            ),
            replica_id=rank if x.spec.shard_dim is None else 0,
        )
        for x in state
    }


# --------------------------------------------------------------------------- measuring


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakRSS:
    """Samples this process's RSS every few ms while the block runs."""

    def __init__(self, interval: float = 0.004) -> None:
        self.interval = interval
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        import psutil

        proc = psutil.Process()
        self.base = self.peak = int(proc.memory_info().rss)

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, int(proc.memory_info().rss))
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def resident_fraction(root: str) -> float:
    """Share of the files under ``root`` that are in the page cache (``mincore``)."""
    from shardsafe.directio import PageResidency

    resident = total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            residency = PageResidency(fd)
            try:
                counts = residency.resident_pages()
            finally:
                residency.close()
                os.close(fd)
            if counts is not None:
                resident += counts[0]
                total += counts[1]
    return resident / total if total else float("nan")


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Session:
    """One rank's side of a world-size run: the collectives and the sample store."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = rank
        self.world = world
        self.samples: dict[str, list[float]] = {}
        self.info: dict[str, Any] = {}

    def barrier(self) -> None:
        self.dist.barrier()

    def add(self, metric: str, value: float) -> None:
        self.samples.setdefault(metric, []).append(value)

    def timed(self, metric: str, fn: Callable[[], Any], rss_metric: str | None = None) -> Any:
        """Run ``fn`` on every rank at once; record this rank's time (and RSS growth)."""
        self.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            out = fn()
            self.add(metric, time.perf_counter() - t0)
        if rss_metric:
            self.add(rss_metric, mem.extra)
        self.barrier()
        return out

    def clean(self, *paths: str) -> None:
        self.barrier()
        if self.rank == 0:
            for p in paths:
                remove(p)
        self.barrier()


def measure_memcpy(s: Session, state: list[Local]) -> None:
    """memcpy of this rank's bytes: into fresh memory (page faults included) and into touched memory."""
    import numpy as np

    tensors = [x.tensor for x in state]
    fresh: list[Any] = []
    s.timed("limit_memcpy_fresh", lambda: fresh.extend(t.clone() for t in tensors))
    for _ in range(2):
        s.timed("limit_memcpy_warm_torch", lambda: [d.copy_(t) for d, t in zip(fresh, tensors)])

    def np_copy() -> None:
        for d, t in zip(fresh, tensors):
            np.copyto(d.numpy(), t.numpy())

    for _ in range(2):
        s.timed("limit_memcpy_warm_numpy", np_copy)
    fresh.clear()
    s.barrier()


class DiskLimits:
    """Plain sequential file I/O of this rank's bytes: what the machine can do without a library.

    Buffered: write + fsync, then read back (from the page cache). Direct (``O_DIRECT``,
    64 MiB page-aligned transfers): write + fsync, read; the device's own speed.
    """

    CHUNK = 64 * MIB

    def __init__(self, s: Session, state: list[Local], scratch: str) -> None:
        self.s = s
        self.views = [memoryview(x.tensor.numpy()).cast("B") for x in state]
        self.nbytes = sum(len(v) for v in self.views)
        self.buffered = os.path.join(scratch, f"limit-{s.rank}.bin")
        self.direct = os.path.join(scratch, f"limit-direct-{s.rank}.bin")
        self._buf = mmap.mmap(-1, self.CHUNK)  # page-aligned
        self._buf.write(b"\x5a" * self.CHUNK)

    def write_buffered(self) -> None:
        def run() -> None:
            with open(self.buffered, "wb", buffering=0) as f:
                for v in self.views:
                    for i in range(0, len(v), self.CHUNK):
                        f.write(v[i : i + self.CHUNK])
                os.fsync(f.fileno())

        self.s.timed("limit_write_fsync", run)

    def read_cached(self) -> None:
        """Into this rank's tensors, as a load would (the file was just written: cached)."""

        def run() -> None:
            fd = os.open(self.buffered, os.O_RDONLY)
            try:
                pos = 0
                for out in self.views:
                    done = 0
                    while done < len(out):
                        done += os.preadv(fd, [out[done:]], pos + done)
                    pos += len(out)
            finally:
                os.close(fd)

        self.s.timed("limit_read_cached", run)

    def write_direct(self) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        try:
            fd = os.open(self.direct, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        except OSError:
            return False

        def run() -> None:
            view = memoryview(self._buf)
            for i in range(0, self.nbytes, self.CHUNK):
                os.write(fd, view[: min(self.CHUNK, -(-(self.nbytes - i) // 4096) * 4096)])
            os.fsync(fd)

        try:
            self.s.timed("limit_write_direct", run)
        finally:
            os.close(fd)
        return True

    def read_direct(self) -> None:
        if not os.path.exists(self.direct):
            return
        fd = os.open(self.direct, os.O_RDONLY | os.O_DIRECT)

        def run() -> None:
            view = memoryview(self._buf)
            for i in range(0, self.nbytes, self.CHUNK):
                os.preadv(fd, [view], i)

        try:
            self.s.timed("limit_read_direct", run)
        finally:
            os.close(fd)

    def remove(self) -> None:
        for p in (self.buffered, self.direct):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)


@dataclass
class StepTimes:
    matmul: list[float]
    python: list[float]

    def summary(self) -> dict[str, float]:
        steps = [a + b for a, b in zip(self.matmul, self.python)]
        if not steps:
            return {"steps": 0}
        return {
            "steps": len(steps),
            "step_mean": statistics.fmean(steps),
            "step_max": max(steps),
            "matmul_mean": statistics.fmean(self.matmul),
            "python_mean": statistics.fmean(self.python),
        }


def train_steps(until: Callable[[], bool], min_steps: int = 0) -> StepTimes:
    """A stand-in training step: one CPU matmul (GIL released) and a bit of pure Python."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.rand(512, 512, generator=g)
    b = torch.rand(512, 512, generator=g)
    times = StepTimes([], [])
    n = 0
    while n < min_steps or not until():
        t0 = time.perf_counter()
        torch.mm(a, b)
        t1 = time.perf_counter()
        acc = 0
        for i in range(20000):
            acc += i & 7
        t2 = time.perf_counter()
        times.matmul.append(t1 - t0)
        times.python.append(t2 - t1)
        n += 1
    return times


def evict(path: str) -> None:
    """Drop one checkpoint's own pages from the page cache (``POSIX_FADV_DONTNEED``; no root needed)."""
    for dirpath, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_session(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardsafe

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    s = Session(rank, world)
    specs = [Spec(n, tuple(sh), d, seed) for n, sh, d, seed in cfg["specs"]]
    root = os.path.join(cfg["root"], f"w{world}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    s.barrier()
    mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    state = build_state(specs, world, rank)
    s.info["build_seconds"] = time.perf_counter() - t0
    s.info["rank_bytes"] = sum(x.tensor.numel() * 4 for x in state)
    s.info["rss_state"] = rss()
    repeat = cfg["repeat"]
    tasks = cfg["tasks"]
    phases: dict[str, float] = {}
    s.info["phase_seconds"] = phases

    def zero() -> None:
        for x in state:
            x.tensor.zero_()

    def residency(path: str, metric: str) -> None:
        s.barrier()
        if rank == 0:
            s.add(metric, resident_fraction(path))

    def load(lib: str, path: str, metric: str) -> None:
        """Zero the state, load ``lib``'s checkpoint at ``path`` into it (timed, with RSS)."""
        zero()
        residency(path, f"cache_{metric}")
        if lib == "ours":
            sd = ours_state_dict(state, rank)
            s.timed(metric, lambda: shardsafe.load(sd, path), f"{metric}_rss")
        else:
            dsd = dcp_state_dict(state, mesh)
            s.timed(
                metric,
                lambda: dcp.load(dsd, storage_reader=dcp.FileSystemReader(path)),
                f"{metric}_rss",
            )

    def pairs(r: int) -> tuple[str, str]:
        return ("ours", "dcp") if r % 2 == 0 else ("dcp", "ours")

    if "cross" in tasks:
        t0 = time.perf_counter()
        for src in cfg["cross_from"]:
            for r in range(repeat):
                for lib in pairs(r):
                    load(lib, os.path.join(cfg["keep"], f"{lib}_w{src}"), f"{lib}_load_from{src}")
                    if r == 0:
                        s.info[f"{lib}_load_from{src}_ok"] = verify(state)
        phases["cross"] = time.perf_counter() - t0

    if "save" in tasks:
        t0 = time.perf_counter()
        measure_memcpy(s, state)
        disk = DiskLimits(s, state, root)
        saver = shardsafe.Saver()
        last: dict[str, str] = {}

        def save(lib: str, path: str, metric: str | None, step: int = 0) -> None:
            if lib == "ours":
                sd = ours_state_dict(state, rank, step)
                if metric is None:
                    saver.save(sd, path)
                    return
                st = s.timed(metric, lambda: saver.save(sd, path))
                s.add("ours_save_plan_cached", float(st.plan_cached))
                s.add("ours_save_writing", st.seconds_writing)
            else:
                dsd = dcp_state_dict(state, mesh)
                writer = dcp.FileSystemWriter(path)
                if metric is None:
                    dcp.save(dsd, storage_writer=writer)
                else:
                    s.timed(metric, lambda: dcp.save(dsd, storage_writer=writer))

        for r in range(repeat):
            disk.write_buffered()
            disk.write_direct()
            for lib in pairs(r):
                # each library's previous checkpoint goes just before its next save, so both
                # find the same freshly freed memory for their page cache
                if lib in last:
                    s.clean(last[lib])
                last[lib] = os.path.join(root, f"{lib}_sync_{r}")
                save(lib, last[lib], f"{lib}_save", r)
        saver.close()
        phases["save"] = time.perf_counter() - t0
        # loads in the same layout, from the checkpoints just written, as the saves left them
        t0 = time.perf_counter()
        for r in range(repeat):
            disk.read_cached()
            disk.read_direct()
            for lib in pairs(r):
                load(lib, last[lib], f"{lib}_load")
                if r == 0:
                    s.info[f"{lib}_load_ok"] = verify(state)
        # and both cold: one more (untimed) checkpoint of each, its pages evicted; the last
        # ones stay as the saves left them, for the loads into other world sizes
        for lib in pairs(0):
            path = os.path.join(root, f"{lib}_cold")
            save(lib, path, None)
            s.barrier()
            if rank == 0:
                evict(path)
            load(lib, path, f"{lib}_load_cold")
            s.clean(path)
        disk.remove()
        s.barrier()
        if rank == 0:
            for lib, path in last.items():
                if cfg["keep_world"]:
                    os.replace(path, os.path.join(cfg["keep"], f"{lib}_w{world}"))
                else:
                    remove(path)
        s.barrier()
        phases["load"] = time.perf_counter() - t0

    if "async" in tasks:
        t0 = time.perf_counter()
        saver = shardsafe.Saver()
        prev: str | None = None
        for r in range(repeat + 1):  # the first one allocates the staging arena
            path = os.path.join(root, f"ours_async_{r}")
            sd = ours_state_dict(state, rank, r)
            s.barrier()
            t1 = time.perf_counter()
            handle = saver.async_save(sd, path)
            blocked = time.perf_counter() - t1
            stats = handle.result()
            total = time.perf_counter() - t1
            s.add("ours_async_block" if r else "ours_async_block_cold", blocked)
            s.add("ours_async_total" if r else "ours_async_total_cold", total)
            if r:
                s.add("ours_async_plan_cached", float(stats.plan_cached))
                s.add("ours_async_planning", stats.seconds_planning)
            if prev:
                s.clean(prev)
            prev = path
        saver.close()
        if prev:
            s.clean(prev)
        for r in range(repeat):
            path = os.path.join(root, f"dcp_async_{r}")
            dsd = dcp_state_dict(state, mesh)
            s.barrier()
            t1 = time.perf_counter()
            fut = dcp.async_save(dsd, storage_writer=dcp.FileSystemWriter(path))
            blocked = time.perf_counter() - t1
            fut.result()
            total = time.perf_counter() - t1
            s.add("dcp_async_block", blocked)
            s.add("dcp_async_total", total)
            s.clean(path)
        # DCP's own reusable staging (cache_staged_state_dict) needs pinned memory
        try:
            torch.empty(1, pin_memory=True)
            s.info["dcp_cached_staging"] = "available (not measured)"
        except Exception as e:
            s.info["dcp_cached_staging"] = f"unavailable: {str(e).splitlines()[0]}"
        phases["async"] = time.perf_counter() - t0

    if "stall" in tasks:
        t0 = time.perf_counter()
        s.barrier()
        t_end = time.perf_counter() + 1.5
        base = train_steps(lambda: time.perf_counter() > t_end)
        s.info["stall_base"] = base.summary()
        for lib in ("ours", "dcp"):
            path = os.path.join(root, f"{lib}_stall")
            s.barrier()
            if lib == "ours":
                saver = shardsafe.Saver()
                handle = saver.async_save(ours_state_dict(state, rank), path)
                during = train_steps(handle.done, 3)
                handle.result()
                saver.close()
            else:
                fut = dcp.async_save(
                    dcp_state_dict(state, mesh), storage_writer=dcp.FileSystemWriter(path)
                )
                during = train_steps(fut.done, 3)
                fut.result()
            s.info[f"stall_{lib}"] = during.summary()
            s.clean(path)
        phases["stall"] = time.perf_counter() - t0

    if "mcore" in tasks:
        from megatron.core import dist_checkpointing as mdc

        for r in range(repeat):
            path = os.path.join(root, f"mcore_{r}")
            if rank == 0:
                os.makedirs(path)
            s.barrier()
            s.timed("mcore_save", lambda path=path: mdc.save(mcore_state_dict(state, rank), path))
            zero()
            s.timed(
                "mcore_load",
                lambda path=path: mdc.load(mcore_state_dict(state, rank), path),
                "mcore_load_rss",
            )
            if r == 0:
                s.info["mcore_load_ok"] = verify(state)
            s.clean(path)

    s.info["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"samples": s.samples, "info": s.info}


def probe_mcore(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Can Megatron-Core's dist_checkpointing save and load here? The reason when not."""
    warnings.filterwarnings("ignore")
    try:
        import megatron.core
        import torch
        from megatron.core import dist_checkpointing as mdc
        from megatron.core.dist_checkpointing import ShardedTensor as McoreST
    except Exception as e:
        return {"ok": False, "reason": f"import megatron.core failed: {type(e).__name__}: {e}"}
    version = getattr(megatron.core, "__version__", "?")
    try:
        path = os.path.join(cfg["root"], "mcore_probe")
        os.makedirs(path, exist_ok=True)
        mdc.save({"w": McoreST.from_rank_offsets("w", torch.ones(4, 4))}, path)
        out = mdc.load({"w": McoreST.from_rank_offsets("w", torch.zeros(4, 4))}, path)
        assert torch.equal(out["w"], torch.ones(4, 4))
        remove(path)
        return {"ok": True, "reason": f"megatron-core {version}"}
    except BaseException as e:
        where = traceback.extract_tb(e.__traceback__)
        frame = next(
            (f for f in reversed(where) if "megatron" in f.filename),
            where[-1] if where else None,
        )
        loc = (
            f" at {frame.filename.split('site-packages/')[-1]}:{frame.lineno} ({frame.name})"
            if frame
            else ""
        )
        first = str(e).splitlines()[0] if str(e) else ""
        return {
            "ok": False,
            "reason": f"megatron-core {version}: dist_checkpointing.save raised {type(e).__name__}: {first}{loc}",
        }


# --------------------------------------------------------------------------- process launching


def launch(fn_name: str, world: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run ``fn_name(rank, world, cfg)`` on ``world`` spawned processes; results by rank."""
    return spawn_ranks(globals()[fn_name], world, cfg, timeout, pg_timeout=900)


# --------------------------------------------------------------------------- reporting


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: each sample is the max over ranks (rank 0-only metrics stay as they are)."""
    metrics: dict[str, list[float]] = {}
    names = set().union(*(r["samples"] for r in per_rank))
    for m in sorted(names):
        columns = [r["samples"][m] for r in per_rank if m in r["samples"]]
        metrics[m] = [max(vals) for vals in zip(*columns)]
    return {"metrics": metrics, "ranks": [r["info"] for r in per_rank]}


def best(run: dict[str, Any], metric: str) -> float | None:
    vals = run["metrics"].get(metric)
    if not vals:
        return None
    return min(vals) if not metric.endswith("_rss") else max(vals)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:8.3f} s"


def fmt_mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MIB:7.1f} MiB"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt_r(v: float | None) -> str:
    return "-" if v is None else f"{v:5.2f}x"


def gbps(nbytes: int, seconds: float | None) -> str:
    return "-" if not seconds else f"{nbytes / seconds / 1e9:6.2f} GB/s"


def report(results: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The printed tables, and the list of target checks."""
    lines: list[str] = []
    checks: list[dict[str, Any]] = []
    runs = results["runs"]
    total = results["state"]["total_bytes"]
    p = lines.append
    p(
        f"state: {total / GIB:.2f} GiB fp32 in {results['state']['tensors']} tensors "
        f"(GPT h={results['state']['hidden']}, {results['state']['layers']} layers, vocab {results['state']['vocab']}); "
        f"best of {results['repeat']} per figure, max over ranks"
    )
    p(f"machine: {results['machine']}")
    p("")
    p("Machine limits on each rank's own bytes, all ranks at once (seconds, max over ranks):")
    p(
        f"{'world':>5} {'bytes/rank':>11} {'memcpy fresh':>13} {'memcpy warm':>12} {'(numpy)':>9} "
        f"{'write+fsync':>12} {'direct write':>13} {'cached read':>12} {'direct read':>12}"
    )
    for w, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        if "limit_memcpy_fresh" not in run["metrics"]:
            continue
        nb = run["rank_bytes"]
        p(
            f"{w:>5} {nb / MIB:>7.0f} MiB {fmt_s(best(run, 'limit_memcpy_fresh')):>13} "
            f"{fmt_s(best(run, 'limit_memcpy_warm_torch')):>12} {fmt_s(best(run, 'limit_memcpy_warm_numpy')):>9} "
            f"{fmt_s(best(run, 'limit_write_fsync')):>12} {fmt_s(best(run, 'limit_write_direct')):>13} "
            f"{fmt_s(best(run, 'limit_read_cached')):>12} {fmt_s(best(run, 'limit_read_direct')):>12}"
        )
    p(
        "  aggregate over all ranks (GB/s): "
        + "; ".join(
            f"w{w}: write+fsync {gbps(run['rank_bytes'] * int(w), best(run, 'limit_write_fsync'))}, "
            f"direct write {gbps(run['rank_bytes'] * int(w), best(run, 'limit_write_direct'))}, "
            f"direct read {gbps(run['rank_bytes'] * int(w), best(run, 'limit_read_direct'))}"
            for w, run in sorted(runs.items(), key=lambda kv: int(kv[0]))
            if "limit_write_fsync" in run["metrics"]
        )
    )
    p("")
    p("Absolute figures (seconds; RSS = growth during the load over the resident state):")
    head = f"{'world':>5}  {'measure':<34} {'shardsafe':>12} {'DCP':>12} {'ours/DCP':>9}"
    p(head)
    p("-" * len(head))
    rows = [
        ("sync save", "ours_save", "dcp_save"),
        ("async save: blocking (warm)", "ours_async_block", "dcp_async_block"),
        ("async save: blocking (1st, cold)", "ours_async_block_cold", "dcp_async_block"),
        ("async save: total (warm)", "ours_async_total", "dcp_async_total"),
        ("load, same layout", "ours_load", "dcp_load"),
        ("load, extra RSS", "ours_load_rss", "dcp_load_rss"),
        ("load, same layout, both cold", "ours_load_cold", "dcp_load_cold"),
    ]
    for w, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        wrows = list(rows)
        for src in run.get("cross_from", []):
            wrows += [
                (f"load saved by world {src}", f"ours_load_from{src}", f"dcp_load_from{src}"),
                (
                    f"load from world {src}, extra RSS",
                    f"ours_load_from{src}_rss",
                    f"dcp_load_from{src}_rss",
                ),
            ]
        for label, ours, theirs in wrows:
            a, b = best(run, ours), best(run, theirs)
            if a is None and b is None:
                continue
            f = fmt_mib if ours.endswith("_rss") else fmt_s
            p(f"{w:>5}  {label:<34} {f(a):>12} {f(b):>12} {fmt_r(ratio(a, b)):>9}")
        if "mcore_save" in run["metrics"]:
            p(
                f"{w:>5}  {'Megatron-Core save / load':<34} {fmt_s(best(run, 'mcore_save')):>12} "
                f"{fmt_s(best(run, 'mcore_load')):>12}"
            )
        p("")
    p(f"Megatron-Core dist_checkpointing: {results['mcore']['reason']}")
    if not results["mcore"]["ok"]:
        p("  -> skipped")
    cache = []
    for w, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        for m, vals in sorted(run["metrics"].items()):
            if m.startswith("cache_"):
                cache.append(f"w{w} {m[6:]}: {min(vals) * 100:.0f}-{max(vals) * 100:.0f}%")
    p("page cache before each load (share of the checkpoint's pages resident): " + "; ".join(cache))
    p("")

    # ---- targets
    p("Targets:")

    def check(world: str, name: str, value: float | None, limit: float | None, detail: str) -> None:
        ok = value is not None and limit is not None and value <= limit
        checks.append(
            {
                "world": int(world),
                "target": name,
                "value": value,
                "limit": limit,
                "pass": ok,
                "detail": detail,
            }
        )
        p(f"  [{'pass' if ok else 'MISS'}] w{world} {name}: {detail}")

    for w, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        b = lambda m, run=run: best(run, m)  # noqa: E731
        if b("ours_save") is not None:
            check(
                w,
                "sync save <= 0.7x DCP",
                b("ours_save"),
                0.7 * b("dcp_save"),
                f"{b('ours_save'):.3f} s vs DCP {b('dcp_save'):.3f} s = {b('ours_save') / b('dcp_save'):.2f}x; "
                f"plain write+fsync of the same bytes {b('limit_write_fsync'):.3f} s "
                f"= {b('limit_write_fsync') / b('dcp_save'):.2f}x DCP, direct write {_f(b('limit_write_direct'))} s",
            )
        if b("ours_async_block") is not None:
            check(
                w,
                "async blocking <= 0.3x DCP async_save",
                b("ours_async_block"),
                0.3 * b("dcp_async_block"),
                f"{b('ours_async_block'):.3f} s vs DCP {b('dcp_async_block'):.3f} s = "
                f"{b('ours_async_block') / b('dcp_async_block'):.2f}x; memcpy warm "
                f"{b('limit_memcpy_warm_torch'):.3f} s = {b('limit_memcpy_warm_torch') / b('dcp_async_block'):.2f}x DCP, "
                f"memcpy fresh {b('limit_memcpy_fresh'):.3f} s",
            )
            mc = min(b("limit_memcpy_warm_torch"), b("limit_memcpy_warm_numpy"))
            check(
                w,
                "async blocking <= 1.5x memcpy",
                b("ours_async_block"),
                1.5 * mc,
                f"{b('ours_async_block'):.3f} s vs fastest warm memcpy {mc:.3f} s = {b('ours_async_block') / mc:.2f}x "
                f"(planning with the cached plan: {_f(b('ours_async_planning'))} s of it)",
            )
            check(
                w,
                "async total <= 1.2x our sync save",
                b("ours_async_total"),
                1.2 * b("ours_save"),
                f"{b('ours_async_total'):.3f} s vs sync {b('ours_save'):.3f} s = {b('ours_async_total') / b('ours_save'):.2f}x",
            )
        if b("ours_load") is not None:
            cached = lambda m, run=run: max(run["metrics"].get(f"cache_{m}", [float("nan")]))  # noqa: E731
            check(
                w,
                "load <= 0.7x DCP (page cache as the saves left it)",
                b("ours_load"),
                0.7 * b("dcp_load"),
                f"{b('ours_load'):.3f} s vs DCP {b('dcp_load'):.3f} s = {b('ours_load') / b('dcp_load'):.2f}x; "
                f"cached before the load: ours {cached('ours_load'):.0%}, DCP {cached('dcp_load'):.0%}; "
                f"plain reads of the same bytes: from the page cache {_f(b('limit_read_cached'))} s, "
                f"direct from the device {_f(b('limit_read_direct'))} s",
            )
            if b("ours_load_cold") is not None:
                check(
                    w,
                    "load <= 0.7x DCP, both cold",
                    b("ours_load_cold"),
                    0.7 * b("dcp_load_cold"),
                    f"{b('ours_load_cold'):.3f} s vs DCP {b('dcp_load_cold'):.3f} s = "
                    f"{b('ours_load_cold') / b('dcp_load_cold'):.2f}x (one sample each); "
                    f"direct read of the same bytes {_f(b('limit_read_direct'))} s",
                )
            state = run["rank_bytes"]
            check(
                w,
                "extra RSS during load <= 10% of state",
                b("ours_load_rss"),
                0.1 * state,
                f"{b('ours_load_rss') / MIB:.1f} MiB of {state / MIB:.0f} MiB per rank = {b('ours_load_rss') / state * 100:.1f}%",
            )
        for src in run.get("cross_from", []):
            same = best(runs[w], "ours_load") if "ours_load" in runs[w]["metrics"] else None
            if same is None:
                continue
            v = b(f"ours_load_from{src}")
            check(
                w,
                f"load saved by world {src} <= 1.2x same-layout load",
                v,
                1.2 * same,
                f"{v:.3f} s vs same layout {same:.3f} s = {v / same:.2f}x (DCP {b(f'dcp_load_from{src}'):.3f} s)",
            )
            check(
                w,
                f"extra RSS loading from world {src} <= 10% of state",
                b(f"ours_load_from{src}_rss"),
                0.1 * run["rank_bytes"],
                f"{b(f'ours_load_from{src}_rss') / MIB:.1f} MiB of {run['rank_bytes'] / MIB:.0f} MiB per rank",
            )
    p("")
    p(
        "Training-loop stall while an async save writes in the background (per-step mean, max over ranks):"
    )
    p(
        f"{'world':>5} {'writer':<22} {'steps':>6} {'step':>9} {'matmul':>9} {'python':>9} {'step max':>9} {'slowdown':>9}"
    )
    for w, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        if "stall" not in run:
            continue
        base = run["stall"]["base"]
        for label, key in (
            ("none (baseline)", "base"),
            ("shardsafe (thread)", "ours"),
            ("DCP (thread)", "dcp"),
        ):
            st = run["stall"][key]
            if not st.get("steps"):
                p(f"{w:>5} {label:<22} {'0':>6} (the save finished before the first step)")
                continue
            p(
                f"{w:>5} {label:<22} {st['steps']:>6} {st['step_mean'] * 1e3:>6.2f} ms {st['matmul_mean'] * 1e3:>6.2f} ms "
                f"{st['python_mean'] * 1e3:>6.2f} ms {st['step_max'] * 1e3:>6.1f} ms {st['step_mean'] / base['step_mean']:>8.2f}x"
            )
    return "\n".join(lines), checks


def chart(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    worlds = sorted(runs, key=int)
    groups = [
        ("sync save", "ours_save", "dcp_save"),
        ("async block", "ours_async_block", "dcp_async_block"),
        ("async total", "ours_async_total", "dcp_async_total"),
        ("load", "ours_load", "dcp_load"),
        ("load, cold", "ours_load_cold", "dcp_load_cold"),
    ]
    fig, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 4.2), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        run = runs[w]
        labels = [g[0] for g in groups]
        ours = [best(run, g[1]) or 0.0 for g in groups]
        theirs = [best(run, g[2]) or 0.0 for g in groups]
        for src in run.get("cross_from", []):
            labels.append(f"load from w{src}")
            ours.append(best(run, f"ours_load_from{src}") or 0.0)
            theirs.append(best(run, f"dcp_load_from{src}") or 0.0)
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="shardsafe")
        ax.bar([i + 0.2 for i in x], theirs, 0.4, label="DCP")
        for name, metric, style, color in (
            ("memcpy", "limit_memcpy_warm_torch", ":", "gray"),
            ("write+fsync", "limit_write_fsync", "--", "gray"),
            ("direct write", "limit_write_direct", "--", "black"),
            ("cached read", "limit_read_cached", "-.", "gray"),
            ("direct read", "limit_read_direct", "-.", "black"),
        ):
            v = best(run, metric)
            if v:
                ax.axhline(v, color=color, linestyle=style, linewidth=1, label=name)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"world {w}, {run['rank_bytes'] / MIB:.0f} MiB/rank")
        ax.set_ylabel("seconds (max over ranks)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"shardsafe vs DCP, {results['state']['total_bytes'] / GIB:.2f} GiB fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="total fp32 state in GiB (default 2)")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes (default 1,2,4)")
    ap.add_argument("--out", default="bench_out", help="where results.json and the PNG go")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions of each figure")
    ap.add_argument(
        "--dir", default=None, help="checkpoint scratch directory (default: a temp dir)"
    )
    ap.add_argument(
        "--stall-worlds", default="1", help="world sizes that run the stall test ('' for none)"
    )
    args = ap.parse_args(argv)

    worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    specs, shape_info = model_specs(int(args.gib * GIB))
    total = sum(math.prod(s.shape) * 4 for s in specs)
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="shardsafe-bench-", dir=args.dir)
    keep = os.path.join(root, "keep")
    os.makedirs(keep)
    pairs: list[tuple[int, int]] = []
    if len(worlds) >= 2:
        big, small = worlds[-1], worlds[-2]
        pairs = [(big, small), (small, big)]
    sources = {a for a, _ in pairs}
    import torch

    results: dict[str, Any] = {
        "state": {"total_bytes": total, **shape_info},
        "repeat": args.repeat,
        "worlds": worlds,
        "machine": f"{platform.node()} {os.cpu_count()} cores, "
        f"{_mem_total() / GIB:.0f} GiB RAM, torch {torch.__version__}, python {platform.python_version()}",
        "scratch": root,
        "runs": {},
    }
    base_cfg = {
        "specs": [[s.name, list(s.shape), s.shard_dim, s.seed] for s in specs],
        "root": root,
        "keep": keep,
        "repeat": args.repeat,
    }
    print(
        f"# {total / GIB:.2f} GiB in {len(specs)} tensors, worlds {worlds}, repeat {args.repeat}, scratch {root}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    try:
        t0 = time.perf_counter()
        results["mcore"] = launch("probe_mcore", 1, base_cfg, 300)[0]
        print(
            f"# megatron probe ({time.perf_counter() - t0:.0f} s): {results['mcore']['reason']}",
            file=sys.stderr,
        )
        done_pairs: set[tuple[int, int]] = set()
        for w in worlds:
            cross_from = [
                a for a, b in pairs if b == w and os.path.exists(os.path.join(keep, f"ours_w{a}"))
            ]
            tasks = ["save", "async", "cross"]
            if str(w) in args.stall_worlds.split(","):
                tasks.append("stall")
            if results["mcore"]["ok"]:
                tasks.append("mcore")
            cfg = {**base_cfg, "tasks": tasks, "cross_from": cross_from, "keep_world": w in sources}
            t0 = time.perf_counter()
            per_rank = launch("run_session", w, cfg, 1800)
            run = merge(per_rank)
            run["cross_from"] = cross_from
            done_pairs |= {(a, w) for a in cross_from}
            _finish_run(run)
            results["runs"][str(w)] = run
            print(f"# world {w} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for a, b in pairs:
            if (a, b) in done_pairs:
                continue
            cfg = {**base_cfg, "tasks": ["cross"], "cross_from": [a], "keep_world": False}
            t0 = time.perf_counter()
            run = merge(launch("run_session", b, cfg, 1800))
            target = results["runs"][str(b)]
            target["metrics"].update(run["metrics"])
            target["cross_from"] = [*target.get("cross_from", []), a]
            for mine, theirs in zip(target["ranks"], run["ranks"]):
                mine.update({k: v for k, v in theirs.items() if "from" in k})
            print(
                f"# world {a} -> {b} loads done in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
    finally:
        remove(root)
    results["seconds"] = time.perf_counter() - started
    text, checks = report(results)
    results["checks"] = checks
    correct = {
        f"w{w}:{k}": v
        for w, run in results["runs"].items()
        for info in run["ranks"]
        for k, v in info.items()
        if k.endswith("_ok")
    }
    bad = sorted(k for k, v in correct.items() if not v)
    text += (
        "\n\nloaded values verified against the saved ones: "
        + ("all correct" if not bad else f"WRONG: {bad}")
        + f"\ntotal benchmark time {results['seconds']:.0f} s"
    )
    print(text)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=_jsonable)
    chart(results, os.path.join(args.out, "save_load.png"))
    print(f"wrote {args.out}/results.json and {args.out}/save_load.png")
    return 1 if bad else 0


def _finish_run(run: dict[str, Any]) -> None:
    infos = run["ranks"]
    run["rank_bytes"] = max(i["rank_bytes"] for i in infos)
    if "stall_base" in infos[0]:
        stall: dict[str, Any] = {}
        for key in ("base", "ours", "dcp"):
            per = [i[f"stall_{key}"] for i in infos]
            with_steps = [x for x in per if x.get("steps")]
            if not with_steps:
                stall[key] = {"steps": 0}
                continue
            stall[key] = {
                "steps": min(x["steps"] for x in with_steps),
                **{
                    k: max(x[k] for x in with_steps)
                    for k in ("step_mean", "step_max", "matmul_mean", "python_mean")
                },
            }
        run["stall"] = stall


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _jsonable(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
