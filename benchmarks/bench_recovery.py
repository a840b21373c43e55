#!/usr/bin/env python
"""Recovery benchmark for the two checkpoint tiers: restart-to-restored time, the training-step
cost of frequent local saves, and the cost of write verification.

    .venv/bin/python benchmarks/bench_recovery.py [--mib 64] [--worlds 2,4] [--repeat 3]
        [--steps 10] [--step-ms 75] [--dir DIR] [--local-dir DIR] [--out bench_out] [--no-dcp]

Each world size runs on CPU gloo ranks on two "hosts" (node ids ``a`` and ``b``, half the ranks
each, every host with its own local root), holding ``--mib`` MiB of fp32 state in all (16
tensors split by rows). Every figure runs in fresh processes forked from this one (torch and
shardsafe already imported, as in a restarted job after its imports), and is the max over ranks.

1. Restart to restored: ``CheckpointManager(...)`` constructed, then ``restore(state)``, for
   one step that is in both tiers: (a) the local tier after host ``b``'s local root is deleted
   (its ranks' files come from the copies on host ``a``, over the process group), (b) the local
   tier with every host intact, (c) the persistent tier (a manager without ``local_root``;
   ``--dir`` and ``--local-dir`` are on the same disk unless given otherwise: the output says
   which file systems they are on; ``--local-dir /dev/shm/...`` puts the local tier in host
   memory), and as a peer reference PyTorch DCP's ``dcp.load`` of the
   same state (``dcp.save`` once). Each restore is repeated once in the same processes
   (``again``), which shows what a fresh process adds. Before every restore the checkpoint
   files are evicted from the page cache, so every source is read from the device. The
   machine limits on the same per-rank bytes, all ranks at once, in the same run: memcpy, a
   read from the page cache (what a local root on a RAM disk could do), an ``O_DIRECT`` read
   (the device), a write + fsync, and a gloo send host a -> host b.
2. Training-step overhead: ``--steps`` steps of a fixed CPU matmul loop (``--step-ms`` alone)
   plus a small all-reduce, with no saves, a local save every step (async; the persistent tier
   never), and an async persistent save every step, the three taking turns in blocks of a few
   steps: the time each ``save`` call blocks and the step time against the run without saves;
   then a local save every N steps, N from the measured save time (item 3) and ``--step-ms``.
3. One save, call to committed on every host: local, without and with ``verify_after_write``,
   and persistent; from these and the step time, the ``local_every`` at which a local save no
   longer waits for the previous one.

Every restored value is compared with what was saved. The load average is printed at the
start and the end: the machine may be shared.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from launch import launch as spawn_ranks

import shardsafe
from shardsafe import CheckpointManager, ShardedTensor
from shardsafe.checksum import block_checksums
from shardsafe.directio import PageResidency

MIB = 1 << 20
COLS = 1024
TENSORS = 16
NEVER = 1 << 60  # a persistent_every no step reaches

# --------------------------------------------------------------------------- the state


def rows_per_tensor(total_mib: float, worlds: list[int]) -> int:
    """Rows of each of the TENSORS global tensors, divisible by every world size."""
    unit = math.lcm(*worlds)
    rows = int(total_mib * MIB) // (TENSORS * COLS * 4)
    return max(unit, rows // unit * unit)


def host_of(rank: int, world: int) -> str:
    return "a" if rank < world // 2 else "b"


def pattern(seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Values that depend on the global position, so a misplaced row is detected."""
    idx = torch.arange(first_row * COLS, (first_row + rows) * COLS, dtype=torch.int64)
    return ((idx * 2654435761 + seed * 97) % 65521).to(torch.float32).reshape(rows, COLS)


def local_tensors(cfg: dict[str, Any], rank: int, world: int, fill: bool) -> list[torch.Tensor]:
    """This rank's rows of every tensor: the saved values, or NaN (touched memory, as a
    model built before its restore)."""
    per = cfg["rows"] // world
    if fill:
        return [pattern(i, rank * per, per) for i in range(TENSORS)]
    return [torch.full((per, COLS), float("nan")) for _ in range(TENSORS)]


def ours_state(tensors: list[torch.Tensor], rank: int, world: int, step: int) -> dict[str, Any]:
    return {
        "model": {
            f"t{i}": ShardedTensor.from_rank_offsets(f"model.t{i}", t, (0, rank, world))
            for i, t in enumerate(tensors)
        },
        "step": step,
    }


def dcp_state(tensors: list[torch.Tensor], world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    shape = torch.Size((tensors[0].shape[0] * world, COLS))
    return {
        f"model.t{i}": DTensor.from_local(
            t, mesh, [Shard(0)], run_check=False, shape=shape, stride=(COLS, 1)
        )
        for i, t in enumerate(tensors)
    }


def correct(tensors: list[torch.Tensor], rank: int, world: int) -> bool:
    per = tensors[0].shape[0]
    return all(torch.equal(t, pattern(i, rank * per, per)) for i, t in enumerate(tensors))


def paths(cfg: dict[str, Any], rank: int, world: int) -> dict[str, str]:
    base = os.path.join(cfg["dir"], f"w{world}")
    local = os.path.join(cfg["local_dir"], f"w{world}")
    return {
        "persistent": os.path.join(base, "persistent"),
        "local": os.path.join(local, host_of(rank, world)),
        "dcp": os.path.join(base, "dcp"),
        "scratch": os.path.join(base, "scratch"),
    }


def manager(cfg: dict[str, Any], rank: int, world: int, **kw: Any) -> CheckpointManager:
    """The manager a job on two hosts builds: local tier with one copy on the other host."""
    p = paths(cfg, rank, world)
    kw.setdefault("persistent_every", 1)
    kw.setdefault("local_every", 1)
    return CheckpointManager(
        kw.pop("root", p["persistent"]),
        local_root=kw.pop("local_root", p["local"]),
        node_id=host_of(rank, world),
        replicas=1,
        **kw,
    )


# --------------------------------------------------------------------------- rank tasks


def task_prepare(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save step 1 into both tiers, and the same state with DCP."""
    tensors = local_tensors(cfg, rank, world, fill=True)
    p = paths(cfg, rank, world)
    out: dict[str, Any] = {"rank_bytes": sum(t.numel() * 4 for t in tensors)}
    mgr = manager(cfg, rank, world)
    dist.barrier()
    t0 = time.perf_counter()
    mgr.save(1, ours_state(tensors, rank, world, 1))
    mgr.wait()
    out["save_both_tiers"] = time.perf_counter() - t0
    mgr.close()
    if cfg["dcp"]:
        import torch.distributed.checkpoint as dcp

        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(dcp_state(tensors, world), checkpoint_id=p["dcp"])
        out["dcp_save"] = time.perf_counter() - t0
    dist.barrier()
    return out


def task_restore(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Restart to restored: the manager built and ``restore`` returned (or DCP's load). Then,
    except after a lost host (whose files are now on its disk), the same once more in the same
    processes, the files evicted again: what a fresh process costs beyond the reading."""
    how = cfg["how"]
    tensors = local_tensors(cfg, rank, world, fill=False)
    p = paths(cfg, rank, world)
    # the first full collection of the imported modules' objects (0.07-0.1 s here) would land
    # at random in one restore's clock or another's: a training process has long had it
    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {"started": cfg["launched"], "ready": time.perf_counter()}
    template = ours_state(tensors, rank, world, 0)
    sd = dcp_state(tensors, world) if how == "dcp" else None

    def once() -> tuple[float, float, str | None, int | None]:
        dist.barrier()
        t0 = time.perf_counter()
        if sd is not None:
            import torch.distributed.checkpoint as dcp

            dcp.load(sd, checkpoint_id=p["dcp"])
            return 0.0, time.perf_counter() - t0, "dcp", 1
        if how == "persistent":
            mgr = CheckpointManager(p["persistent"])
        else:
            mgr = manager(cfg, rank, world)
        t1 = time.perf_counter()
        state = mgr.restore(template)
        t2 = time.perf_counter()
        mgr.close()
        if state["step"] != 1:
            raise AssertionError(f"restored step field {state['step']!r}, saved 1")
        return t1 - t0, t2 - t1, mgr.restored_tier, mgr.restored_step

    out["construct"], out["restore"], out["tier"], out["step"] = once()
    out["total"] = out["construct"] + out["restore"]
    out["ok"] = correct(tensors, rank, world)
    if how != "local_host_lost":
        for t in tensors:
            t.fill_(float("nan"))
        dist.barrier()
        if rank == 0:
            evict(os.path.dirname(p["persistent"]), os.path.dirname(p["local"]))
        construct, restore, tier, _ = once()
        out["again"] = construct + restore
        out["ok"] = out["ok"] and tier == out["tier"] and correct(tensors, rank, world)
    dist.barrier()
    return out


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def task_limits(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """What the machine does with the same per-rank bytes and no library, all ranks at once."""
    src = local_tensors(cfg, rank, world, fill=True)
    dst = local_tensors(cfg, rank, world, fill=False)
    views = [t.numpy().data.cast("B") for t in src]
    into = [t.numpy().data.cast("B") for t in dst]
    nbytes = sum(len(v) for v in views)
    scratch = paths(cfg, rank, world)["scratch"]
    os.makedirs(scratch, exist_ok=True)
    path = os.path.join(scratch, f"limit-{rank}.bin")
    chunk = 64 * MIB
    samples: dict[str, list[float]] = {}

    def add(name: str, fn: Callable[[], Any]) -> None:
        samples.setdefault(name, []).append(_timed(fn))

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for v in views:
                for i in range(0, len(v), chunk):
                    f.write(v[i : i + chunk])
            os.fsync(f.fileno())

    def write_cached() -> None:  # into the page cache only (a RAM disk's write)
        with open(path, "wb", buffering=0) as f:
            for v in views:
                for i in range(0, len(v), chunk):
                    f.write(v[i : i + chunk])

    fresh: list[str] = []

    def write_new() -> None:  # into the page cache, a new file kept until the end: pages that
        # were never used yet (a copy fetched at restore is a new file; in a VM, memory the
        # guest has not touched since it booted costs a fault on the host at first use)
        fresh.append(os.path.join(scratch, f"limit-{rank}-new{len(fresh)}.bin"))
        with open(fresh[-1], "xb", buffering=0) as f:
            for v in views:
                for i in range(0, len(v), chunk):
                    f.write(v[i : i + chunk])

    def checksum() -> None:  # the block checksums a save computes (and a copy's check again)
        for v in views:
            block_checksums(v, 4 * MIB)

    def read_cached() -> None:  # into this rank's tensors, as a restore does
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            for out in into:
                done = 0
                while done < len(out):
                    n = os.preadv(fd, [out[done:]], pos + done)
                    if n <= 0:
                        raise OSError(f"short read of {path}")
                    done += n
                pos += len(out)
        finally:
            os.close(fd)

    def drop_cache() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def memcpy() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    peer = rank + world // 2 if rank < world // 2 else rank - world // 2

    def p2p() -> None:  # host a -> host b, as the copies a lost host's ranks fetch
        if rank < world // 2:
            ops = [dist.isend(t, dst=peer) for t in src]
        else:
            ops = [dist.irecv(t, src=peer) for t in dst]
        for op in ops:
            if op is not None:
                op.wait()

    # page aligned, as O_DIRECT needs; 4 MiB requests (much larger ones are slower on some
    # virtual disks)
    bounce = mmap.mmap(-1, 4 * MIB)

    def read_direct() -> None:  # the device's speed: into an aligned buffer, chunk by chunk
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for pos in range(0, nbytes, len(bounce)):
                os.preadv(fd, [bounce], pos)
        finally:
            os.close(fd)

    direct = hasattr(os, "O_DIRECT")
    for _ in range(cfg["repeat"]):
        add("memcpy", memcpy)
        add("checksum", checksum)
        add("write_page_cache", write_cached)
        add("write_new_file", write_new)
        add("write_fsync", write)
        add("read_page_cache", read_cached)
        if direct:
            try:  # the same answer on every rank: one file system
                os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
            except OSError:
                direct = False
        if direct:
            drop_cache()
            add("read_direct", read_direct)
        add("gloo_p2p", p2p)
    os.remove(path)
    for f in fresh:
        os.remove(f)
    dist.barrier()
    return {"rank_bytes": nbytes, "samples": samples}


def _matmul_step(a: torch.Tensor, n: int) -> None:
    x = a
    for _ in range(n):
        x = torch.mm(x, a)
        x.div_(x.abs().max() + 1)


def task_steps(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The training loop: fixed compute + a small all-reduce, saves of the state after each step."""
    tensors = local_tensors(cfg, rank, world, fill=True)
    state = ours_state(tensors, rank, world, 0)
    a = torch.rand(256, 256)
    grad = torch.zeros(1024)
    # calibrate together (the ranks share the cores): iterations for --step-ms
    iters = 10
    idle = cfg.get("idle_step", False)
    for _ in range(0 if idle else 4):  # scale to the step's own time, all ranks stepping together
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            _matmul_step(a, iters)
            dist.all_reduce(grad)
            times.append(time.perf_counter() - t0)
        took = torch.tensor([statistics.median(times)])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        iters = max(1, round(iters * cfg["step_ms"] / 1e3 / float(took)))
    p = paths(cfg, rank, world)
    out: dict[str, Any] = {"iters": iters, "idle": idle}

    def compute() -> None:
        if idle:  # the host waits for its device: the cores are free meanwhile
            time.sleep(cfg["step_ms"] / 1e3)
        else:
            _matmul_step(a, iters)

    managers: dict[str, CheckpointManager | None] = {
        "none": None,
        "local_every_step": manager(
            cfg,
            rank,
            world,
            root=p["persistent"] + "-steps",
            local_root=p["local"] + "-steps",
            persistent_every=NEVER,
        ),
        "persistent_every_step": CheckpointManager(p["persistent"] + "-steps", keep_last=2),
    }
    for mode in managers:
        out[mode] = {"steps": [], "blocked": [], "drain": 0.0}
    # the modes take turns in blocks of a few steps, so that a change in the machine's load
    # falls on all of them; a block ends when its last save has committed (not counted as steps)
    step = 0
    block = max(2, cfg["steps"] // 3)
    while len(out["none"]["steps"]) < cfg["steps"]:
        n = min(block, cfg["steps"] - len(out["none"]["steps"]))
        for mode, mgr in managers.items():
            dist.barrier()
            for _ in range(n):
                step += 1
                t0 = time.perf_counter()
                compute()
                dist.all_reduce(grad)
                if mgr is not None:
                    state["step"] = step
                    t1 = time.perf_counter()
                    mgr.save(step, state)
                    out[mode]["blocked"].append(time.perf_counter() - t1)
                out[mode]["steps"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if mgr is not None:
                mgr.wait()
            out[mode]["drain"] += time.perf_counter() - t0
    for mgr in managers.values():
        if mgr is not None:
            mgr.close()
    # a local save every N steps, N from the measured save time: enough steps for 3 saves
    every = cfg["local_every"]
    mgr = manager(
        cfg,
        rank,
        world,
        root=p["persistent"] + "-every",
        local_root=p["local"] + "-every",
        local_every=every,
        persistent_every=NEVER,
    )
    out["local_every_n"] = {"steps": [], "blocked": [], "drain": 0.0}
    dist.barrier()
    for step in range(1, max(cfg["steps"], 3 * every) + 1):
        t0 = time.perf_counter()
        compute()
        dist.all_reduce(grad)
        state["step"] = step
        t1 = time.perf_counter()
        mgr.save(step, state)
        if step % every == 0:
            out["local_every_n"]["blocked"].append(time.perf_counter() - t1)
        out["local_every_n"]["steps"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mgr.close()
    out["local_every_n"]["drain"] = time.perf_counter() - t0
    dist.barrier()
    return out


def task_saves(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One save, call to committed on every host: local without and with verify_after_write,
    and persistent (async, as the manager saves by default)."""
    tensors = local_tensors(cfg, rank, world, fill=True)
    state = ours_state(tensors, rank, world, 0)
    p = paths(cfg, rank, world)
    managers = {
        f"local_verify{int(verify)}": manager(
            cfg,
            rank,
            world,
            root=p["persistent"] + f"-verify{int(verify)}",
            local_root=p["local"] + f"-verify{int(verify)}",
            persistent_every=NEVER,
            verify_after_write=verify,
        )
        for verify in (False, True)
    }
    managers["persistent"] = CheckpointManager(p["persistent"] + "-saves", keep_last=2)
    out: dict[str, Any] = {k: {"total": [], "blocked": []} for k in managers}
    rounds = max(5, cfg["repeat"])  # saves are short and noisy: a few more samples
    for step in range(1, 2 + rounds):  # step 1 warms up: the plan is cached after it
        # in turn, the order reversed every other round, so that all see the same drift
        for key, mgr in sorted(managers.items(), reverse=step % 2 == 1):
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocked = time.perf_counter() - t0
            mgr.wait()
            dist.barrier()  # committed on every host
            if step > 1:
                out[key]["total"].append(time.perf_counter() - t0)
                out[key]["blocked"].append(blocked)
    for mgr in managers.values():
        mgr.close()
    return out


# --------------------------------------------------------------------------- launching


def launch(fn_name: str, world: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run ``fn_name(rank, world, cfg)`` on ``world`` fresh forked processes; results by rank."""
    cfg = {**cfg, "launched": time.perf_counter()}
    return spawn_ranks(
        globals()[fn_name], world, cfg, timeout, start_method="fork", one_thread=True
    )


# --------------------------------------------------------------------------- page cache


def evict(*roots: str) -> float:
    """Drop the files under ``roots`` from the page cache; returns the share still resident."""
    resident = total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    residency = PageResidency(fd)
                    try:
                        counts = residency.resident_pages()
                    finally:
                        residency.close()
                finally:
                    os.close(fd)
                if counts is not None:
                    resident += counts[0]
                    total += counts[1]
    return resident / total if total else 0.0


def file_system(path: str) -> str:
    """The device and type ``path`` is on (``df``), to say whether two roots share a disk."""
    try:
        text = subprocess.run(
            ["df", "--output=source,fstype,target", path],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()[-1]
        return " ".join(text.split())
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- one world size


def run_world(world: int, cfg: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    prepared = launch("task_prepare", world, cfg, 900)
    run: dict[str, Any] = {
        "rank_bytes": max(r["rank_bytes"] for r in prepared),
        "save_both_tiers": max(r["save_both_tiers"] for r in prepared),
        "load_average": {"start": load_average()},
    }
    if cfg["dcp"]:
        run["dcp_save"] = max(r["dcp_save"] for r in prepared)
    log(f"world {world}: saved step 1 in both tiers in {run['save_both_tiers']:.2f} s")
    base = os.path.join(cfg["dir"], f"w{world}")
    local = os.path.join(cfg["local_dir"], f"w{world}")
    pristine = os.path.join(base, "pristine-b")
    shutil.copytree(os.path.join(local, "b"), pristine, symlinks=True)
    b_changed = False
    hows = ["local_host_lost", "local_intact", "persistent"] + (["dcp"] if cfg["dcp"] else [])
    restores: dict[str, list[dict[str, Any]]] = {h: [] for h in hows}
    for rep in range(cfg["repeat"]):
        for how in hows:
            if how == "local_host_lost":
                shutil.rmtree(os.path.join(local, "b"))
                b_changed = True
            elif how == "local_intact" and b_changed:
                shutil.rmtree(os.path.join(local, "b"), ignore_errors=True)
                shutil.copytree(pristine, os.path.join(local, "b"), symlinks=True)
                b_changed = False
            cached = evict(base, local)
            ranks = launch(
                "task_restore", world, {**cfg, "how": "dcp" if how == "dcp" else how}, 900
            )
            tiers = {r["tier"] for r in ranks}
            expected = {"dcp": "dcp", "persistent": "persistent"}.get(how, "local")
            sample = {
                "construct": max(r["construct"] for r in ranks),
                "restore": max(r["restore"] for r in ranks),
                "total": max(r["total"] for r in ranks),
                "start_to_ready": max(r["ready"] - r["started"] for r in ranks),
                "again": max((r["again"] for r in ranks if "again" in r), default=None),
                "cached_before": cached,
                "tier": sorted(tiers),
                "steps": sorted({r["step"] for r in ranks}),
                "ok": all(r["ok"] for r in ranks) and tiers == {expected},
            }
            restores[how].append(sample)
            log(
                f"world {world} rep {rep + 1}: {how:<16} {sample['total']:.3f} s "
                f"(tier {','.join(sample['tier'])}, {'ok' if sample['ok'] else 'WRONG'})"
            )
    run["restores"] = restores
    limits = launch("task_limits", world, cfg, 900)
    names = sorted(set().union(*(r["samples"] for r in limits)))
    run["limits"] = {
        n: [max(vals) for vals in zip(*(r["samples"][n] for r in limits))] for n in names
    }
    log(
        f"world {world}: limits {', '.join(f'{n} {min(v):.3f} s' for n, v in run['limits'].items())}"
    )
    ranks = launch("task_saves", world, cfg, 900)
    run["saves"] = {
        key: {m: [max(v) for v in zip(*(r[key][m] for r in ranks))] for m in ("total", "blocked")}
        for key in ("local_verify0", "local_verify1", "persistent")
    }
    # the local_every at which a local save should no longer wait for the previous one
    every = max(1, math.ceil(med(run["saves"]["local_verify0"]["total"]) / (cfg["step_ms"] / 1e3)))
    ranks = launch("task_steps", world, {**cfg, "local_every": every}, 900)
    steps: dict[str, Any] = {
        "iters": ranks[0]["iters"],
        "idle": ranks[0]["idle"],
        "local_every": every,
    }
    for mode in ("none", "local_every_step", "persistent_every_step", "local_every_n"):
        # per step, the slowest rank's time (the ranks step together through the all-reduce)
        per_step = [max(v) for v in zip(*(r[mode]["steps"] for r in ranks))]
        blocked = [max(v) for v in zip(*(r[mode]["blocked"] for r in ranks))]
        steps[mode] = {
            "step_times": per_step,
            "blocked": blocked,
            "drain": max(r[mode]["drain"] for r in ranks),
        }
    run["steps"] = steps
    log(f"world {world}: training-loop modes done")
    run["load_average"]["end"] = load_average()
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    return run


# --------------------------------------------------------------------------- reporting


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    p = lines.append
    p(f"machine: {results['machine']}")
    p(f"load average (1/5/15 min) at start: {results['load_average']['start']}")
    p(f"persistent root on: {results['fs']['dir']}")
    p(f"local roots on:     {results['fs']['local_dir']}")
    if results["fs"]["dir"] == results["fs"]["local_dir"]:
        p("  -> both tiers are on the SAME disk here: the persistent figures are those of a local")
        p("     file system, not of a shared or object store")
    if results["fs"]["local_dir"].split()[1:2] in (["tmpfs"], ["ramfs"]):
        p("  -> the local roots are on a RAM disk: no local save writes to a disk, and local")
        p("     files cannot be evicted (a restore reads them from memory); a reboot loses them")
    p(
        f"state: {results['mib']:.0f} MiB of fp32 in {TENSORS} tensors, split by rows over the ranks; "
        f"two hosts (node ids a, b), half the ranks each; one copy of every file on the other host"
    )
    p(
        f"medians of {results['repeat']} (each sample: the slowest rank), fresh forked processes "
        "per restore, checkpoint files evicted from the page cache before each"
    )
    for w, run in sorted(results["runs"].items(), key=lambda kv: int(kv[0])):
        lim = {k: med(v) for k, v in run["limits"].items()}
        p("")
        p(
            f"== {w} ranks, {run['rank_bytes'] / MIB:.0f} MiB per rank "
            f"(load average {run['load_average']['start']} -> {run['load_average']['end']})"
        )
        p("1. restart (manager constructed) -> state restored, seconds:")
        ref_names = [
            ("page-cache read", "read_page_cache"),
            ("direct read", "read_direct"),
            ("write+fsync", "write_fsync"),
            ("memcpy", "memcpy"),
        ]
        head = "".join(f"{'x ' + n:>17}" for n, _ in ref_names)
        p(f"   {'source':<34}{'construct':>10}{'restore':>9}{'total':>8}{'again':>8}{head}")
        labels = {
            "local_host_lost": "local, host b lost (from peers)",
            "local_intact": "local, every host intact",
            "persistent": "persistent (same disk)"
            if results["fs"]["dir"] == results["fs"]["local_dir"]
            else "persistent",
            "dcp": "PyTorch DCP dcp.load (reference)",
        }
        for how, samples in run["restores"].items():
            total = med([s["total"] for s in samples])
            ratios = "".join(
                f"{total / lim[k]:>16.1f}x" if k in lim and lim[k] > 0 else f"{'-':>17}"
                for _, k in ref_names
            )
            again = [s["again"] for s in samples if s["again"] is not None]
            p(
                f"   {labels[how]:<34}{med([s['construct'] for s in samples]):>10.3f}"
                f"{med([s['restore'] for s in samples]):>9.3f}{total:>8.3f}"
                + (f"{med(again):>8.3f}" if again else f"{'-':>8}")
                + ratios
            )
        p(
            "   again: the same restore once more in the same processes, files evicted again "
            "(what a fresh process costs beyond the reading)"
        )
        p(
            "   limits, same bytes per rank, all ranks at once: "
            + ", ".join(f"{n} {lim[k]:.3f} s" for n, k in ref_names if k in lim)
            + f", gloo send host a -> b {lim.get('gloo_p2p', float('nan')):.3f} s"
            + f", checksum {lim.get('checksum', float('nan')):.3f} s"
            + f", page-cache write {lim.get('write_page_cache', float('nan')):.3f} s"
            + f" (into a new file {lim.get('write_new_file', float('nan')):.3f} s)"
        )
        spawn = med([s["start_to_ready"] for ss in run["restores"].values() for s in ss])
        cached = max(s["cached_before"] for ss in run["restores"].values() for s in ss)
        p(
            f"   (before the clock: fork + gloo init + template + a full garbage collection {spawn:.2f} s; "
            f"checkpoint pages cached before a restore: at most {cached:.0%}; "
            f"save into both tiers {run['save_both_tiers']:.2f} s"
            + (f", dcp.save {run['dcp_save']:.2f} s)" if "dcp_save" in run else ")")
        )
        st = run["steps"]
        base = med(st["none"]["step_times"])
        work = (
            "an idle wait (a host waiting for its device: the cores are free)"
            if st.get("idle")
            else f"{st['iters']} matmuls (256x256)"
        )
        p(
            f"2. training loop, {len(st['none']['step_times'])} steps of {work} + an all-reduce, "
            "modes in turns; per step, the slowest rank (wait: for the last save of each turn to "
            "commit, not in the steps):"
        )
        p(
            f"   {'saves':<28}{'step ms':>9}{'blocked/save ms':>17}{'max blocked':>13}"
            f"{'overhead':>10}{'wait s':>8}"
        )
        for mode, label in (
            ("none", "none"),
            ("local_every_step", "local every step (async)"),
            ("persistent_every_step", "persistent every step (async)"),
            ("local_every_n", f"local every {st['local_every']} (alone)"),
        ):
            m = st[mode]
            step = med(m["step_times"])
            blocked = (
                f"{med(m['blocked']) * 1e3:>17.1f}{max(m['blocked']) * 1e3:>13.1f}"
                if m["blocked"]
                else f"{'-':>17}{'-':>13}"
            )
            p(
                f"   {label:<28}{step * 1e3:>9.1f}{blocked}"
                f"{(step / base - 1) * 100:>9.0f}%{m['drain']:>8.2f}"
            )
        v = run["saves"]
        off, on = med(v["local_verify0"]["total"]), med(v["local_verify1"]["total"])
        pers = med(v["persistent"]["total"])
        p(
            f"   one save, call to committed on every host (median of {len(v['persistent']['total'])}): "
            f"local {off:.3f} s = "
            f"{off / base:.1f} steps of this loop, persistent {pers:.3f} s = {pers / base:.1f} steps"
        )
        p(
            f"   -> from about local_every >= {math.ceil(off / base)} a local save no longer waits "
            f"for the previous one (the last row: local_every = {st['local_every']}, from the "
            f"--step-ms target, run after the others, {len(st['local_every_n']['step_times'])} steps)"
        )
        floor = (
            lim.get("memcpy", 0.0)
            + 2 * lim.get("checksum", 0.0)
            + 2 * lim.get("write_page_cache", 0.0)
            + lim.get("read_page_cache", 0.0)
            + lim.get("gloo_p2p", 0.0)
        )
        what = (
            f"   floor of a local save's CPU work per rank, from the limits above: stage (memcpy) "
            f"+ checksum at the write and in the copy's check + its file and the copy it receives "
            f"into the page cache + the read to send + the send = {floor * 1e3:.0f} ms; "
        )
        if st.get("idle"):
            p(
                what + f"the step leaves the cores free, so a save every step keeps up when one "
                f"save, call to committed ({off * 1e3:.0f} ms), fits in a step ({base * 1e3:.0f} ms)"
            )
        else:
            p(
                what + f"where the ranks keep every core busy (here {w} ranks, {os.cpu_count()} "
                f"cores) a save every step costs at least {floor / base:.0%} of a "
                f"{base * 1e3:.0f} ms step: 5 % needs a step of {floor * 20 * 1e3:.0f} ms or more, "
                "or idle cores"
            )
        p(
            f"3. verify_after_write, one local save, call to committed on every host: {off:.3f} s "
            f"without, {on:.3f} s with ({(on / off - 1) * 100:+.0f}%); blocked "
            f"{med(v['local_verify0']['blocked']) * 1e3:.0f} / "
            f"{med(v['local_verify1']['blocked']) * 1e3:.0f} ms"
        )
    bad = [
        f"w{w} {how} rep {i + 1}"
        for w, run in results["runs"].items()
        for how, samples in run["restores"].items()
        for i, s in enumerate(samples)
        if not s["ok"]
    ]
    p("")
    p(
        "restored values and tiers checked against the saved ones: "
        + ("all correct" if not bad else f"WRONG: {bad}")
    )
    p(f"load average (1/5/15 min) at the end: {results['load_average']['end']}")
    p(f"total benchmark time {results['seconds']:.0f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=float, default=64.0, help="total fp32 state, MiB (64)")
    ap.add_argument("--worlds", default="2,4", help="world sizes, even (2,4)")
    ap.add_argument("--repeat", type=int, default=3, help="samples of each restore figure (3)")
    ap.add_argument("--steps", type=int, default=10, help="training-loop steps per mode (10)")
    ap.add_argument("--step-ms", type=float, default=75.0, help="compute per step, ms (75)")
    ap.add_argument(
        "--idle-step",
        action="store_true",
        help="each step waits --step-ms instead of computing, as a host whose device computes",
    )
    ap.add_argument("--dir", default=None, help="persistent-tier scratch (default: a temp dir)")
    ap.add_argument("--local-dir", default=None, help="local roots (default: under --dir)")
    ap.add_argument("--out", default="bench_out", help="where recovery.json goes")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP reference")
    args = ap.parse_args(argv)

    worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    if any(w < 2 or w % 2 for w in worlds):
        ap.error("every world size must be even and >= 2 (two hosts, half the ranks each)")
    rows = rows_per_tensor(args.mib, worlds)
    mib = TENSORS * rows * COLS * 4 / MIB
    root = tempfile.mkdtemp(prefix="shardsafe-recovery-", dir=args.dir)
    local_dir = (
        tempfile.mkdtemp(prefix="shardsafe-recovery-local-", dir=args.local_dir)
        if args.local_dir
        else os.path.join(root, "local")
    )
    os.makedirs(local_dir, exist_ok=True)
    cfg = {
        "rows": rows,
        "dir": root,
        "local_dir": local_dir,
        "repeat": args.repeat,
        "steps": args.steps,
        "step_ms": args.step_ms,
        "idle_step": args.idle_step,
        "dcp": not args.no_dcp,
    }
    results: dict[str, Any] = {
        "mib": mib,
        "repeat": args.repeat,
        "machine": f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"shardsafe {getattr(shardsafe, '__version__', '?')}, python {platform.python_version()}",
        "fs": {"dir": file_system(root), "local_dir": file_system(local_dir)},
        "load_average": {"start": load_average()},
        "runs": {},
    }

    def log(msg: str) -> None:
        print(f"# {msg}", file=sys.stderr, flush=True)

    log(f"{mib:.0f} MiB, worlds {worlds}, repeat {args.repeat}, scratch {root}, local {local_dir}")
    started = time.perf_counter()
    try:
        for w in worlds:
            t0 = time.perf_counter()
            results["runs"][str(w)] = run_world(w, cfg, log)
            log(f"world {w} done in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    results["load_average"]["end"] = load_average()
    text = report(results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "recovery.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}/recovery.json")
    ok = all(
        s["ok"] for run in results["runs"].values() for ss in run["restores"].values() for s in ss
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
