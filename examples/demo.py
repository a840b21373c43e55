"""shardsafe's main job, end to end, on the reference GPT (examples/gpt_parallel.py).

1. An uninterrupted run on 4 ranks (TP2 x DP2, ZeRO-1 distributed optimizer) gives the
   reference loss curve.
2. The same run again, checkpointing asynchronously every few steps through a
   CheckpointManager (retention keep_last/keep_every). At a chosen step, rank 0's progress
   hook holds the background writer right after its first bytes reach the disk; the parent
   then kills every rank with SIGKILL, so the kill always lands in the middle of a save.
3. What the kill left: the half-written save is not a checkpoint (no manifest, ``load``
   refuses it), ``latest`` still names the previous step, whose checksums verify; a new
   CheckpointManager removes the remains.
4. Resumes from the latest committed checkpoint in other layouts (TP1 x DP2, TP1 x DP3,
   TP1 x PP3) and in the same one (TP2 x DP2, which then checkpoints to the end). The loss
   must continue the uninterrupted curve: bit for bit in the same layout, within RTOL where
   the float reduction order differs.

    python examples/demo.py            # about 40 s on an idle 2-core machine
    python examples/demo.py --quick    # the same flow with fewer steps (CI)

Exit code 0 only when every check passed. Ranks are started from a fork server that has
imported torch once, so a launch costs well under a second instead of an import per rank.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import gpt_parallel as gp
import torch
import torch.distributed as dist
from parallel_layers import Layout, ParallelState

import shardsafe
from shardsafe.directory import step_name
from shardsafe.lease import LeaseInfo
from shardsafe.manager import CheckpointManager

#: Relative tolerance on the loss where the layout changes the float reduction order (TP
#: all-reduces, DP gradient sums, ZeRO ranges); measured differences are around 1e-7.
RTOL = 1e-5
REFERENCE_LAYOUT = Layout(tp=2, pp=1, dp=2)
RESUME_LAYOUTS = [Layout(tp=1, pp=1, dp=2), Layout(tp=1, pp=1, dp=3), Layout(tp=1, pp=3, dp=1)]
PRELOAD = ["torch", "torch.distributed", "gpt_parallel", "parallel_layers", "shardsafe.manager"]


@dataclass(frozen=True)
class Plan:
    """The run's shape: how long, how often to save, where to kill, what to keep."""

    steps: int
    save_every: int
    kill_at: int
    keep_last: int
    keep_every: int
    global_batch: int = 12  # divisible by dp x micro-batches for dp = 1, 2, 3


FULL = Plan(steps=64, save_every=4, kill_at=36, keep_last=2, keep_every=16)
QUICK = Plan(steps=16, save_every=2, kill_at=10, keep_last=2, keep_every=4)


@dataclass(frozen=True)
class Job:
    """What one launch of ranks does (picklable: it crosses into the rank processes)."""

    title: str
    layout: Layout
    cfg: gp.TrainConfig
    root: str | None = None  # checkpoint root; None: no checkpoints
    resume: bool = False
    save_every: int = 0
    keep_last: int | None = None
    keep_every: int | None = None
    kill_at: int | None = None  # hold the save of this step mid-write and tell the parent


def describe(layout: Layout) -> str:
    parts = [f"TP{layout.tp}"] + ([f"PP{layout.pp}"] if layout.pp > 1 else []) + [f"DP{layout.dp}"]
    return " x ".join(parts) + f" ({layout.world} ranks)"


# -- inside each rank ------------------------------------------------------------------------------
class HoldWrite:
    """Progress hook that freezes the background writer once its first bytes are on disk.

    It runs in the save's writer threads, so while it holds them the save cannot commit; the
    main thread waits for ``started`` and tells the parent, which kills every rank.
    """

    def __init__(self) -> None:
        self.started = threading.Event()
        self.bytes_written = 0
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != "written":
            return
        with self._lock:
            self.bytes_written = max(self.bytes_written, done)
        self.started.set()
        threading.Event().wait(300)  # until SIGKILL; the parent's timeout is far shorter


def _report_commit(events: Any, step: int, handle: shardsafe.AsyncSaveHandle) -> None:
    try:
        stats = handle.result()
        events.put(("committed", step, stats.total_bytes, stats.seconds))
    except Exception as e:
        events.put(("save_failed", step, f"{type(e).__name__}: {e}"))


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train(ps: ParallelState, job: Job, events: Any) -> dict[str, Any]:
    """Build, optionally resume, train to ``cfg.steps``, checkpointing through the manager."""
    cfg = job.cfg
    model, opt, data = gp.build(ps, cfg)
    lead = ps.rank == 0
    manager = None
    if job.root is not None:
        manager = CheckpointManager(job.root, keep_last=job.keep_last, keep_every=job.keep_every)
    iteration = 0
    if job.resume:
        assert manager is not None
        step = _broadcast(manager.latest_step() if lead else None)
        if step is None:
            raise RuntimeError(f"no committed checkpoint under {job.root}")
        common = shardsafe.load_common_state_dict(manager.checkpoint_path(step))
        same_layout = common["layout"] == asdict(ps.layout)
        t0 = time.perf_counter()
        loaded = manager.restore(
            gp.sharded_state_dict(model, opt, ps, include_rng=same_layout), step=step
        )
        iteration = gp.load_into(model, opt, loaded)
        if lead:
            events.put(
                (
                    "resumed",
                    step,
                    iteration,
                    common["layout"],
                    same_layout,
                    time.perf_counter() - t0,
                )
            )
    # Everything built so far lives until the end: take it out of the garbage collector's
    # view, so that a full collection (hundreds of ms when ranks share 2 cores) does not
    # land inside a step or a save.
    gc.collect()
    gc.freeze()
    while iteration < cfg.steps:
        t0 = time.perf_counter()
        loss = gp.train_step(model, opt, data, ps, cfg, iteration)
        iteration += 1
        if lead:
            events.put(("loss", iteration, loss, time.perf_counter() - t0))
        if manager is None or not job.save_every or iteration % job.save_every:
            continue
        hold = HoldWrite() if lead and job.kill_at == iteration else None
        t0 = time.perf_counter()  # the loop's own view: includes waiting for the previous save
        handle = manager.save(iteration, gp.sharded_state_dict(model, opt, ps), progress=hold)
        if not lead:
            continue
        assert isinstance(handle, shardsafe.AsyncSaveHandle)
        events.put(("saving", iteration, time.perf_counter() - t0))
        handle.add_done_callback(lambda h, s=iteration: _report_commit(events, s, h))
        if hold is not None:
            if not hold.started.wait(60):
                raise RuntimeError("the held save never started writing")
            events.put(("in_flight", iteration, hold.bytes_written))
            time.sleep(300)  # the parent kills every rank now
    if manager is not None:
        manager.close()  # waits for the last save and its pointer update
    return {"iteration": iteration}


def rank_main(rank: int, job: Job, port: int, events: Any) -> None:
    torch.set_num_threads(1)  # ranks share the cores; also keeps reductions deterministic
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=job.layout.world,
        timeout=timedelta(seconds=120),
    )
    try:
        result = train(ParallelState.create(job.layout), job, events)
        dist.barrier()
        events.put(("done", rank, result))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


# -- in the parent -----------------------------------------------------------------------------------
@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)
    commits: dict[int, tuple[int, float]] = field(default_factory=dict)  # step -> (bytes, seconds)
    blocked: dict[int, float] = field(default_factory=dict)  # step -> seconds the loop was blocked
    train_seconds: float = 0.0
    killed_at: int | None = None
    bytes_at_kill: int = 0
    resumed: tuple[Any, ...] | None = None
    seconds: float = 0.0


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


class Demo:
    def __init__(self, plan: Plan, out: Path, quick: bool) -> None:
        self.plan, self.quick = plan, quick
        self.root = out / "checkpoints"
        self.checks: list[tuple[str, bool, str]] = []
        self.max_rel = 0.0  # largest relative loss difference of a resume into another layout
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self.ctx.set_forkserver_preload(PRELOAD)
        self.t_start = time.perf_counter()

    # -- plumbing ---------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, ok, detail))
        print(
            f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True
        )
        return ok

    def cfg(self) -> gp.TrainConfig:
        return gp.TrainConfig(steps=self.plan.steps, global_batch=self.plan.global_batch)

    def launch(self, job: Job, timeout: float = 240.0) -> RunResult:
        """Start ``job``'s ranks, print progress, SIGKILL them all when a save is reported in flight."""
        events = self.ctx.Queue()
        port = gp.free_port()
        procs = [
            self.ctx.Process(target=rank_main, args=(r, job, port, events), daemon=True)
            for r in range(job.layout.world)
        ]
        res = RunResult()
        done: set[int] = set()
        t0 = time.perf_counter()
        deadline = t0 + timeout
        every = self.plan.save_every
        try:
            for p in procs:
                p.start()
            while len(done) < len(procs):
                try:
                    kind, *payload = events.get(timeout=0.2)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in done
                    ]
                    if dead:
                        raise RuntimeError(f"{job.title}: ranks {dead} died") from None
                    if time.perf_counter() > deadline:
                        raise TimeoutError(
                            f"{job.title}: not finished after {timeout:.0f} s"
                        ) from None
                    continue
                if kind == "loss":
                    step, loss, seconds = payload
                    res.losses[step] = loss
                    res.train_seconds += seconds
                    if step % every == 0 or step == self.plan.steps:
                        print(f"    step {step:3d}  loss {loss:.6f}", flush=True)
                elif kind == "saving":
                    step, blocked = payload
                    res.blocked[step] = blocked
                    print(
                        f"    step {step:3d}  async save started; training blocked {blocked * 1e3:.1f} ms",
                        flush=True,
                    )
                elif kind == "committed":
                    step, nbytes, seconds = payload
                    res.commits[step] = (nbytes, seconds)
                    print(
                        f"    step {step:3d}  {step_name(step)} committed: {_mb(nbytes)}, {seconds * 1e3:.0f} ms after the call",
                        flush=True,
                    )
                elif kind == "save_failed":
                    raise RuntimeError(
                        f"{job.title}: save of step {payload[0]} failed: {payload[1]}"
                    )
                elif kind == "resumed":
                    res.resumed = tuple(payload)
                    step, iteration, saved_layout, same, seconds = payload
                    lay = Layout(**saved_layout)
                    print(
                        f"    resumed from {step_name(step)} (written by {describe(lay)}) in {seconds * 1e3:.0f} ms; "
                        f"RNG state {'restored' if same else 'not restored (other layout)'}; continuing at step {iteration + 1}",
                        flush=True,
                    )
                elif kind == "in_flight":
                    step, nbytes = payload
                    res.killed_at, res.bytes_at_kill = step, nbytes
                    for p in procs:
                        if p.pid is not None:
                            os.kill(p.pid, signal.SIGKILL)
                    for p in procs:
                        p.join(10)
                    codes = [p.exitcode for p in procs]
                    self._drain(events, res)  # reports queued just before the kill
                    print(
                        f"    step {step:3d}  save in flight ({_mb(nbytes)} of rank 0's share on disk, writer held): "
                        f"SIGKILL to all {len(procs)} ranks -> exit codes {codes}",
                        flush=True,
                    )
                    break
                elif kind == "error":
                    raise RuntimeError(f"{job.title}: rank {payload[0]} failed:\n{payload[1]}")
                elif kind == "done":
                    done.add(payload[0])
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)
            events.close()
        res.seconds = time.perf_counter() - t0
        return res

    @staticmethod
    def _drain(events: Any, res: RunResult) -> None:
        while True:
            try:
                kind, *payload = events.get(timeout=0.2)
            except queue.Empty:
                return
            if kind == "committed":
                step, nbytes, seconds = payload
                res.commits[step] = (nbytes, seconds)

    # -- the flow -----------------------------------------------------------------------------
    def run(self) -> int:
        plan = self.plan
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        print(
            f"shardsafe demo{' (quick)' if self.quick else ''}: {plan.steps} steps of the reference GPT, "
            f"async checkpoint every {plan.save_every} steps into {self.root}\n"
            f"  retention keep_last={plan.keep_last}, keep_every={plan.keep_every}; "
            f"SIGKILL while the save of step {plan.kill_at} is being written",
            flush=True,
        )

        print(f"\n[1/4] uninterrupted reference run, {describe(REFERENCE_LAYOUT)}", flush=True)
        ref = self.launch(Job("reference", REFERENCE_LAYOUT, self.cfg()))
        print(f"    {len(ref.losses)} steps in {ref.seconds:.1f} s", flush=True)

        print(
            f"\n[2/4] the same run with async checkpoints, killed mid-save at step {plan.kill_at}",
            flush=True,
        )
        crash = self.launch(
            Job(
                "checkpointed run",
                REFERENCE_LAYOUT,
                self.cfg(),
                root=str(self.root),
                save_every=plan.save_every,
                keep_last=plan.keep_last,
                keep_every=plan.keep_every,
                kill_at=plan.kill_at,
            )
        )
        before = [crash.losses.get(s) for s in range(1, plan.kill_at + 1)]
        self.check(
            "checkpointing does not perturb training",
            before == [ref.losses[s] for s in range(1, plan.kill_at + 1)],
            f"losses of steps 1..{plan.kill_at} bit-identical to the uninterrupted run",
        )
        self.check(
            "the kill landed while a save was in flight",
            crash.killed_at == plan.kill_at and plan.kill_at not in crash.commits,
            f"step {crash.killed_at}, {_mb(crash.bytes_at_kill)} written by rank 0 when killed",
        )

        print("\n[3/4] what the kill left behind", flush=True)
        latest = self.inspect_after_kill()

        print("\n[4/4] resume from the latest committed checkpoint", flush=True)
        resumes: list[tuple[Layout, RunResult]] = []
        for layout in [*RESUME_LAYOUTS, REFERENCE_LAYOUT]:
            same = layout == REFERENCE_LAYOUT
            print(
                f"  -> {describe(layout)}{' (same layout, checkpointing to the end)' if same else ''}",
                flush=True,
            )
            job = Job(
                f"resume {describe(layout)}",
                layout,
                self.cfg(),
                root=str(self.root),
                resume=True,
                save_every=plan.save_every if same else 0,
                keep_last=plan.keep_last,
                keep_every=plan.keep_every,
            )
            res = self.launch(job)
            resumes.append((layout, res))
            self.compare(layout, res, ref, latest)
        self.final_state(resumes[-1][1])
        return self.summary(ref, crash, resumes)

    def inspect_after_kill(self) -> int | None:
        plan = self.plan
        killed = step_name(plan.kill_at)
        entries = sorted(os.listdir(self.root))
        for e in entries:
            p = self.root / e
            if e == "latest":
                print(f"    {e:50s} -> {p.read_text().strip()}")
            elif p.is_dir():
                files = sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())
                size = sum((p / f).stat().st_size for f in files)
                manifest = "manifest.json" in files
                print(
                    f"    {e + '/':50s} {len(files)} files, {_mb(size)}, {'committed' if manifest else 'NO manifest.json'}"
                )
            else:
                info = LeaseInfo.parse(p.read_bytes())
                print(
                    f"    {e:50s} lease of pid {info.pid} on {info.host} "
                    f"({'expired' if info.expired() else 'valid'})"
                    if info is not None
                    else f"    {e:50s} (not a lease)"
                )
        tmp = [e for e in entries if e.startswith(f".{killed}.shardsafe-tmp-")]
        lock = f".{killed}.shardsafe-lock"
        self.check(
            "the half-written save is not committed",
            bool(tmp)
            and not (self.root / killed).exists()
            and not (self.root / tmp[0] / "manifest.json").exists(),
            f"{tmp[0] if tmp else '?'} holds data files but no manifest; {killed} does not exist",
        )
        try:
            shardsafe.load({}, self.root / killed)
            refused = "loaded!"
        except shardsafe.IncompleteCheckpointError as e:
            refused = f"IncompleteCheckpointError: {e}"
        except Exception as e:  # any other error is a failed check
            refused = f"{type(e).__name__}: {e}"
        self.check("loading the killed step is refused", refused.startswith("Incomplete"), refused)

        # A new manager (as a restarted job creates) sees the previous step as latest and cleans up.
        manager = CheckpointManager(self.root, keep_last=plan.keep_last, keep_every=plan.keep_every)
        removed = sorted(set(entries) - set(os.listdir(self.root)))
        latest = manager.latest_step()
        steps = manager.steps()
        manager.close()
        expected_latest = plan.kill_at - plan.save_every
        expected = _retained(range(plan.save_every, plan.kill_at, plan.save_every), plan)
        self.check(
            "the previous checkpoint is the latest",
            latest == expected_latest and steps == expected,
            f"latest_step() = {latest}, steps() = {steps} (retention kept {expected})",
        )
        if latest is not None:
            report = shardsafe.CheckpointReader(manager.checkpoint_path(latest)).verify()
            self.check(
                f"{step_name(latest)} verifies",
                report.ok,
                f"{_mb(report.bytes_checked)} re-read, {report.tensors} tensors, checksums "
                + ("match" if report.ok else f"FAIL: {report.problems[:2]}"),
            )
        self.check(
            "a new CheckpointManager removes the leftovers",
            lock in removed and any(r in removed for r in tmp),
            f"removed {removed}",
        )
        return latest

    def compare(self, layout: Layout, res: RunResult, ref: RunResult, latest: int | None) -> None:
        plan = self.plan
        start = res.resumed[0] if res.resumed else None
        steps = list(range((latest or 0) + 1, plan.steps + 1))
        got = [res.losses.get(s) for s in steps]
        want = [ref.losses[s] for s in steps]
        if start != latest or None in got:
            self.check(
                f"resume into {describe(layout)}",
                False,
                f"resumed from {start}, losses {got[:3]}...",
            )
            return
        if layout == REFERENCE_LAYOUT:
            equal = sum(a == b for a, b in zip(got, want))
            self.check(
                f"resume into {describe(layout)} is bit-identical",
                equal == len(steps),
                f"{equal}/{len(steps)} losses of steps {steps[0]}..{steps[-1]} equal to the uninterrupted run",
            )
            return
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        self.max_rel = max(self.max_rel, rel)
        self.check(
            f"resume into {describe(layout)} continues the curve",
            rel <= RTOL,
            f"steps {steps[0]}..{steps[-1]}: max relative difference {rel:.2e} (tolerance {RTOL:.0e})",
        )

    def final_state(self, last: RunResult) -> None:
        plan = self.plan
        manager = CheckpointManager(self.root, keep_last=plan.keep_last, keep_every=plan.keep_every)
        steps, latest = manager.steps(), manager.latest_step()
        manager.close()
        schedule = range(plan.save_every, plan.steps + 1, plan.save_every)
        expected = _retained(schedule, plan)  # the killed step was saved again after the resume
        pointer = (self.root / "latest").read_text().strip()
        self.check(
            "retention and the latest pointer after the resumed run",
            steps == expected and latest == plan.steps and pointer == step_name(plan.steps),
            f"kept {steps}, latest -> {pointer}",
        )
        bad = [
            s
            for s in steps
            if not shardsafe.CheckpointReader(manager.checkpoint_path(s)).verify().ok
        ]
        self.check(
            "every kept checkpoint verifies",
            not bad,
            f"{len(steps)} checked" + (f", bad: {bad}" if bad else ""),
        )

    def summary(
        self, ref: RunResult, crash: RunResult, resumes: list[tuple[Layout, RunResult]]
    ) -> int:
        saving = [crash, resumes[-1][1]]
        commits = sum(len(r.commits) for r in saving)
        nbytes = sum(b for r in saving for b, _ in r.commits.values())
        blocked = sum(t for r in saving for t in r.blocked.values())
        nsaves = sum(len(r.blocked) for r in saving)
        background = sum(s for r in saving for _, s in r.commits.values())
        train = sum(r.train_seconds for r in saving)
        resumed = [c for c in self.checks if c[0].startswith("resume into")]
        passed = sum(ok for _, ok, _ in self.checks)
        kept = len(os.listdir(self.root)) - 1
        resume_steps = ", ".join(f"{len(r.losses)} in {describe(lay)}" for lay, r in resumes)
        print("\n== summary ==")
        print(
            f"  steps trained    : {self.plan.steps} uninterrupted + {len(crash.losses)} until SIGKILL "
            f"+ resumed: {resume_steps}"
        )
        print(
            f"  checkpoints      : {nsaves} async saves: {commits} committed ({_mb(nbytes)} in all), "
            f"1 killed mid-write; {kept} kept on disk "
            f"(keep_last={self.plan.keep_last}, keep_every={self.plan.keep_every})"
        )
        print(
            f"  blocked by saves : {blocked * 1e3:.0f} ms in total, {blocked / max(nsaves, 1) * 1e3:.1f} ms per save "
            f"= {100 * blocked / max(train + blocked, 1e-9):.1f}% of the training loop's {train + blocked:.1f} s; "
            f"commits landed {background / max(commits, 1) * 1e3:.0f} ms after the call, in the background"
        )
        print(
            f"  resume checks    : {sum(ok for _, ok, _ in resumed)}/{len(resumed)} passed "
            f"(bit-identical in the same layout; across layouts max relative difference "
            f"{self.max_rel:.2e} <= {RTOL:.0e})"
        )
        print(f"  checks passed    : {passed}/{len(self.checks)}")
        print(f"  wall time        : {time.perf_counter() - self.t_start:.1f} s")
        if passed == len(self.checks):
            print("ALL CHECKS PASSED")
            return 0
        for name, ok, detail in self.checks:
            if not ok:
                print(f"FAILED: {name}: {detail}")
        return 1


def _retained(commits: Any, plan: Plan) -> list[int]:
    """Replay the retention policy over a sequence of commits (what should be on disk)."""
    kept: list[int] = []
    for step in commits:
        kept = sorted({*kept, step})
        keep = {step, *kept[-plan.keep_last :], *(s for s in kept if s % plan.keep_every == 0)}
        kept = [s for s in kept if s in keep]
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (the CI test runs this)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "demo_out",
        help="working directory; its checkpoints/ subdirectory is replaced",
    )
    args = parser.parse_args(argv)
    demo = Demo(QUICK if args.quick else FULL, args.out.resolve(), args.quick)
    try:
        return demo.run()
    except Exception:
        traceback.print_exc()
        print("DEMO FAILED")
        return 1


if __name__ == "__main__":
    sys.exit(main())
