#!/usr/bin/env python
"""Soak test of recovery: many cycles of train -> one random fault -> restart in a random layout.

    .venv/bin/python benchmarks/soak.py [--cycles 500] [--seed 1] [--replay SEED] [--json out.json]

Each cycle has its own seed (``--seed`` x 1,000,000 + the cycle's index), from which
everything in it is drawn, so ``--replay SEED`` runs one cycle again, printing every rank's
log. A cycle:

1. **Train.** 2 x 2 ranks (node ids ``host0``, ``host0``, ``host1``, ``host1`` on this machine,
   each host its own local root) run :mod:`tests.tierstate` (SGD with momentum, whose state
   after step s is a function of s: the reference is computed, not run again) for 5 steps,
   saving every step to the local tier (one copy on the other host) and every 2nd step to the
   persistent tier (through the local tier with ``drain=True`` in some cycles),
   ``dead_after`` 3 s (the least :mod:`shardsafe.liveness` takes). The process group's store
   is hosted by this harness, as torchrun's agent hosts it, in 3 cycles of 4, by rank 0 (a
   ``tcp://`` rendezvous) in the others.
2. **One fault**, drawn from: SIGKILL of a rank (``kill-rank``), or in half of those cycles its
   process ending as a script's does on an uncaught exception (``exit-rank``: the interpreter's
   exit stops the heartbeat, which marks the rank exited), SIGKILL of both ranks of a host
   (``kill-host``), or SIGSTOP of a rank (``stop-rank``), each at a random moment of one stage
   of a save (``staging``, ``writing``, ``copying`` to peers, ``committing``, ``draining``) or
   of a restore (``restoring``: the first restart is hit, a second one follows); a flipped,
   truncated or deleted file (a data file or a manifest) of a committed step in either tier
   (``flip``, ``truncate``, ``delete``); a full disk (``full-disk``: the local disk of one host,
   or the persistent file system, runs out of space during a save); a stale lease of a dead job
   (``stale-lease``: the lease and work directory of a save that died, at the step the restarted
   run saves next, in either tier; expired by time or held by a gone process of this host).
3. **Restart** on 1-4 ranks, each on a node id drawn from ``host0``, ``host1`` and a new
   ``host2`` (an empty local disk): ``CheckpointManager.restore``, then one more step saved to
   both tiers.

Each cycle checks (a failed check fails the cycle, with its seed):

- the restored state equals the uninterrupted run's at the step restore reports, on every rank;
- that step is the *expected* one: the newest step with an intact copy the restart can reach:
  a persistent step whose manifest and files are all present, full-sized and not the damaged
  file (in the step's directory, or in the work directory of a save that died after writing
  its manifest there, which the restart's clean-up puts back unless that save's lease still
  holds it: then the step before it is right too), or a local step whose manifest and every
  file have such a copy in a place (node id + local root) of the restart's layout. Steps
  committed before the fault must all still be there (none lost that the fault did not
  touch); the step being saved when a process fault struck counts only where it committed;
- every surviving rank of a process fault or a full disk raised an error (a save never
  succeeds with a rank dead, stopped or out of space), within ``dead_after`` + 3 s (the bound
  ``liveness.py`` states) + ``--slack`` of the fault;
- the restarted run saves its next step in both tiers (over any stale lease).

Every phase runs under a hard timeout (a hung phase fails the cycle); processes are killed and
temporary directories deleted whatever happens. The summary gives the success rate, the
time-to-recover distribution (a restarted rank's start to its restore returning, max over
ranks), the survivors' detection times and every failure with its seed.

With ``--namespaces-every K`` every K-th cycle (index i with (i + 1) % K == 0) runs each host
(``host0``, ``host1``, ``host2``) in its own network, PID and mount namespaces
(:mod:`tests.namespaces`, the recipe of docs/DESIGN.md; root, ``ip`` and ``unshare``): a
launcher per host forks its ranks, on rank 0's host it hosts the store (lost with that host,
as torchrun's agent), the host's own disk is bind-mounted over one local-root path, its
hostname is the node id, the persistent tier is a directory every host sees; SIGKILL of a
host kills its PID namespace. Same faults and checks, but a stale lease is always an expired
one, and a restart whose next save meets a killed host's lease waits (inside the save) for
its ttl (20 s here) and breaks it then (see :func:`_save_over_a_lost_hosts_lease`). Where namespaces are refused the
soak says why and runs every cycle on node ids. The namespaces, processes, mounts and
directories go whatever ends the run (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # tests.tierstate and tests.faultinject
    sys.path.insert(0, ROOT)

TRAIN_HOSTS = ("host0", "host0", "host1", "host1")
RESTART_HOSTS = ("host0", "host1", "host2")
STEPS = 5
PERSIST_EVERY = 2
DEAD_AFTER = 3.0  # the least liveness.py takes (MIN_DEAD_AFTER)
STATED_BOUND = 3.0  # liveness.py: a wait names a rank silent for dead_after within 2 s more,
# and a rank that learns the verdict from the board one beat after that
# liveness.py: a frozen store (rank 0 hosting it through tcp://, SIGSTOPped) is named once a
# request has gone unanswered for max(dead_after, STORE_DEAD_AFTER), within INTERVAL + 2 POLL
FROZEN_STORE_BOUND = 10.0 + 1.0 + 0.5
PHASE_TIMEOUT = 150.0
STAGES = ("staging", "writing", "copying", "committing", "draining", "restoring")
PROCESS_FAULTS = ("kill-rank", "kill-host", "stop-rank", "exit-rank")
FILE_FAULTS = ("flip", "truncate", "delete")
KINDS = (*PROCESS_FAULTS, *FILE_FAULTS, "full-disk", "stale-lease")
# what a seed's first draw picks from: exit-rank takes half of kill-rank's cycles by a draw of
# its own, so that every other seed draws the fault it drew before exit-rank existed
FIRST_DRAW = tuple(k for k in KINDS if k != "exit-rank")
RUN_ID = "soak"
# in namespaces: a killed host's lease holds its step until this has passed (see
# _save_over_a_lost_hosts_lease); shorter than the default 60 s to keep such cycles short
NS_LEASE_TTL = 20.0


# --------------------------------------------------------------------------- the draw


@dataclass
class Fault:
    """One cycle's fault and layouts, all drawn from the cycle's seed."""

    kind: str
    stage: str | None = None  # process faults: where it strikes
    step: int | None = None  # the save it strikes (process faults, full-disk)
    victim: int | None = None  # the rank (kill-host: a rank of the host)
    delay: float = 0.0  # seconds after the stage began
    write_bytes: int = 0  # writing: bytes this rank writes before the fault
    tier: str = "local"  # committing, file faults, full-disk, stale-lease: which tier
    place: str = "host0"  # file faults, full-disk, stale-lease in the local tier: whose disk
    target_step: str = "newest"  # file faults: "newest" or "older" committed step
    target_file: str = "data"  # file faults: "data" or "manifest"
    pick: float = 0.0  # file faults: which file / byte / length, as a fraction
    lease_kind: str = "expired"  # stale-lease: "expired" (by time) or "dead-pid" (this host)
    drain: bool = False
    store: str = "agent"  # who hosts the process group's store: "agent" (torchrun) or "rank0"
    first_layout: list[str] = field(default_factory=list)  # restoring: the layout hit
    layout: list[str] = field(default_factory=list)  # the restart that must recover
    namespaces: bool = False  # each host its own network/PID/mount namespaces (--namespaces-every)


def draw(seed: int, namespaces: bool = False) -> Fault:
    """The fault of cycle ``seed``. In namespaces the same draw, but a stale lease is always
    one expired by time: a lease held by a process that is gone names a PID of its host's PID
    namespace, which a restarted host (a new namespace) can no longer judge, so only its ttl
    frees it (as on a real host whose container was replaced)."""
    rng = random.Random(seed)
    kind = rng.choice(FIRST_DRAW)
    f = Fault(kind=kind)
    f.drain = rng.random() < 0.3
    f.store = "agent" if rng.random() < 0.75 else "rank0"
    if kind in PROCESS_FAULTS:
        f.stage = rng.choice(STAGES)
        f.victim = rng.randrange(len(TRAIN_HOSTS))
        f.delay = rng.uniform(0.0, 0.05)
        f.write_bytes = rng.randrange(0, 250)  # less than a rank writes in a local save
        f.tier = rng.choice(("local", "persistent"))
        f.step = rng.randrange(2, STEPS)  # a later step follows: survivors must meet the fault
        if f.stage == "committing" and f.tier == "persistent":
            f.drain = False  # with drain, the persistent commit is the local tier's (draining)
        if f.stage == "draining":
            f.drain = True
            f.step = rng.choice([s for s in range(2, STEPS) if s % PERSIST_EVERY == 0])
    elif kind in FILE_FAULTS:
        f.tier = rng.choice(("local", "persistent"))
        f.place = rng.choice(("host0", "host1"))
        f.target_step = rng.choice(("newest", "newest", "older"))
        f.target_file = rng.choice(("data", "data", "manifest"))
        f.pick = rng.random()
    elif kind == "full-disk":
        f.tier = rng.choice(("local", "persistent"))
        f.place = rng.choice(("host0", "host1"))
        f.step = rng.randrange(2, STEPS)
        f.write_bytes = rng.randrange(0, 1500)
    else:  # stale-lease
        f.tier = rng.choice(("local", "persistent"))
        f.place = rng.choice(("host0", "host1"))
        f.lease_kind = rng.choice(("expired", "dead-pid"))
    if f.stage == "restoring":
        f.first_layout = _layout(rng)
        f.victim = rng.randrange(len(f.first_layout))
        while len(f.first_layout) == 1 or (
            f.kind == "kill-host"
            and len({h for h in f.first_layout}) == 1  # the whole job would be gone
        ):
            f.first_layout = _layout(rng, at_least=2)
            f.victim = rng.randrange(len(f.first_layout))
    f.layout = _layout(rng)
    if kind == "kill-rank" and random.Random(f"{seed}/exit").random() < 0.5:
        f.kind = "exit-rank"
    if namespaces:
        f.namespaces = True
        f.lease_kind = "expired"
    return f


def seeds_for(wanted: list[dict[str, Any]], start: int = 0) -> list[int]:
    """For each entry of ``wanted`` (fields of :class:`Fault` and their values, or predicates
    on them), the first seed
    from ``start`` on whose fault has them, in order: a fixed set of cycles covering chosen
    faults, for the test suite."""
    seeds = []
    seed = start

    def fits(f: Fault, fields: dict[str, Any]) -> bool:
        return all(
            v(getattr(f, k)) if callable(v) else getattr(f, k) == v for k, v in fields.items()
        )

    for fields in wanted:
        while not fits(draw(seed), fields):
            seed += 1
        seeds.append(seed)
        seed += 1
    return seeds


def _layout(rng: random.Random, at_least: int = 1) -> list[str]:
    return [rng.choice(RESTART_HOSTS) for _ in range(rng.randint(at_least, 4))]


# --------------------------------------------------------------------------- in the ranks


def _local_root(cfg: dict[str, Any], host: str) -> str:
    """Where a rank of ``host`` finds its node-local disk: its own directory on this machine,
    or in namespaces the one path every host uses, over which each binds its own disk (the
    harness sees that disk at ``local/<host>``)."""
    return f"{cfg['tmp']}/localdisk" if cfg.get("namespaces") else f"{cfg['tmp']}/local/{host}"


def _manager(cfg: dict[str, Any], host: str, **kw: Any) -> Any:
    from shardsafe import CheckpointManager

    if cfg.get("namespaces"):
        kw["lease_ttl"] = NS_LEASE_TTL
    return CheckpointManager(
        f"{cfg['tmp']}/persistent",
        local_root=_local_root(cfg, host),
        # in namespaces, the node id is the host's name, as on real hosts
        node_id=None if cfg.get("namespaces") else host,
        local_every=1,
        replicas=1,
        dead_after=DEAD_AFTER,
        run_id=RUN_ID,
        **kw,
    )


class _Armed:
    """The fault, put into this rank's process at the stage it strikes (one shot)."""

    def __init__(self, cfg: dict[str, Any], rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.fault = cfg["fault"]
        self.step: int | None = None
        self.pending: threading.Thread | None = None  # a delayed fault on its way

    def fire(self, step: int | None = None) -> None:
        """Record the moment (once across processes), then the action. ``step`` is the step
        whose save the fault's stage was met in: a delayed action may land after this rank
        moved on (a rank that does not lead its place returns from a local save once the
        step is decided, before its place's leader renamed it in)."""
        f = self.fault
        path = os.path.join(self.cfg["tmp"], "fault.json")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if f["kind"] != "full-disk":
                return
        else:
            struck = self.step if step is None else step
            record = {"time": time.time(), "rank": self.rank, "step": struck, "now": self.step}
            os.write(fd, json.dumps(record).encode())
            os.close(fd)
        kind = f["kind"]
        if kind == "full-disk":
            from tests.faultinject import no_space

            no_space()
        if kind == "kill-host" and self.cfg.get("namespaces"):
            # every process of this host's PID namespace but its init (a shell, which then
            # ends, and the namespace with it): the ranks and the launcher (the store's host)
            os.kill(-1, signal.SIGKILL)
        elif kind == "kill-host":
            for pid in self.cfg["host_pids"]():
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if kind == "stop-rank":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if kind == "exit-rank":
            # a script's rank that raised: the interpreter's exit stops the heartbeat (which
            # marks the rank exited) and ends the process; no other clean-up of ours runs
            from shardsafe.liveness import HEARTBEATS

            HEARTBEATS.stop()
            os._exit(1)
        from tests.faultinject import kill_self

        kill_self()

    def later(self) -> None:
        delay = float(self.fault["delay"])
        if delay <= 0:
            self.fire()
            return
        step = self.step
        self.pending = threading.Thread(
            target=lambda: (time.sleep(delay), self.fire(step)), daemon=True
        )
        self.pending.start()

    def settle(self) -> None:
        """Let a delayed fault that was set off strike before the run ends (a daemon thread
        dies with its process: a fault met in the last save's background would never strike)."""
        if self.pending is not None:
            self.pending.join()

    def install(self) -> None:
        import shardsafe.local_restore
        import shardsafe.local_tier
        import shardsafe.location
        import shardsafe.manager
        import shardsafe.saver
        import shardsafe.staging
        from tests import faultinject

        f = self.fault
        stage = f["stage"]
        if f["kind"] == "full-disk":
            root = (
                _local_root(self.cfg, f["place"])
                if f["tier"] == "local"
                else f"{self.cfg['tmp']}/persistent"
            )
            budget = faultinject.ByteBudget(int(f["write_bytes"]), self.fire)
            original = shardsafe.location.storage_for
            prefix = os.path.abspath(root)

            def storage_for(location: str) -> Any:
                storage = original(location)
                if os.path.abspath(location).startswith(prefix):
                    return faultinject.FaultyStorage(storage, budget)
                return storage

            shardsafe.location.storage_for = storage_for
            return
        if stage == "writing":
            faultinject.patch_data_writes(int(f["write_bytes"]), self.fire)
            return

        def local_commit(saver: Any, *_: Any) -> bool:  # both tiers commit in Saver._commit
            return isinstance(saver.target, shardsafe.local_tier.PlaceTarget)

        def any_call(*_: Any) -> bool:
            return True

        targets: dict[str, list[tuple[Any, str, Callable[..., bool]]]] = {
            "staging": [(shardsafe.staging.StagingPool, "stage", any_call)],
            "copying": [(shardsafe.local_tier, "exchange_files", any_call)],
            "committing": [
                (
                    shardsafe.saver.Saver,
                    "_commit",
                    local_commit
                    if f["tier"] == "local"
                    else (lambda saver, *_: not local_commit(saver)),
                )
            ],
            "draining": [(shardsafe.local_tier, "_copy_file", any_call)],
            "restoring": [
                (shardsafe.local_restore, "_fetch", any_call),
                (shardsafe.manager, "load", any_call),
            ],
        }
        shot = [False]
        for owner, name, when in targets[stage]:
            original = getattr(owner, name)

            def hooked(*a: Any, _original: Any = original, _when: Any = when, **k: Any) -> Any:
                if not shot[0] and _when(*a):
                    shot[0] = True
                    if stage == "restoring":
                        # at once: a restore may be over (its collectives with it) within the
                        # delay, and a fault after them leaves nothing for survivors to meet
                        self.fire()
                    else:
                        self.later()
                return _original(*a, **k)

            setattr(owner, name, hooked)


def _strikes(cfg: dict[str, Any], rank: int) -> bool:
    f = cfg["fault"]
    if f is None:
        return False
    hosts = cfg["hosts"]
    if f["kind"] == "full-disk":
        return f["tier"] == "persistent" or hosts[rank] == f["place"]
    if f["kind"] == "kill-host":
        return hosts[rank] == hosts[f["victim"]]
    return rank == f["victim"]


def train(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phase 1: train STEPS steps saving every one; the fault (if any) strikes at its step."""
    import torch

    from tests.tierstate import COLS, ROWS, rows_of, state_of, train_step

    host = cfg["hosts"][rank]
    mgr = _manager(cfg, host, persistent_every=PERSIST_EVERY, drain=cfg["drain"])
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    state = state_of(rank, world, w, m, 0)
    armed = _Armed(cfg, rank) if _strikes(cfg, rank) else None
    for step in range(1, STEPS + 1):
        train_step(w, m, rows_of(rank, world), step)
        state["step"] = step
        if armed is not None:
            armed.step = step
            if step == cfg["fault"]["step"]:
                armed.install()
        try:
            mgr.save(step, state)
            mgr.wait()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "error_time": time.time(), "step": step}
    try:
        mgr.close()
        if armed is not None:
            armed.settle()
        _last_out()
    except Exception as e:  # a fault that struck after the last save (its drain, say)
        return {"error": f"{type(e).__name__}: {e}", "error_time": time.time(), "step": STEPS}
    return {"done": STEPS}


def _last_out() -> None:
    """A job that ends well leaves together: with a ``tcp://`` rendezvous rank 0's process
    hosts the store, and exiting first would cut off ranks still reading a commit outcome.
    The ranks meet in one of shardsafe's collectives, which run under the heartbeat (a rank
    frozen after its last save is named within ``dead_after``, not a barrier's 60 s timeout),
    and no store read follows it."""
    from shardsafe.dist import get_comm

    comm = get_comm()
    comm.dead_after = DEAD_AFTER  # the managers' (a plain Comm's default is liveness's 10 s)
    comm.all_gather("the end of the run")


def restart(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phase 2: restore in this layout, then train and save one more step in both tiers."""
    import torch

    from tests.tierstate import COLS, ROWS, rows_of, state_of, train_step

    host = cfg["hosts"][rank]
    t0 = time.monotonic()
    mgr = _manager(cfg, host, persistent_every=1)  # opens its store connections
    construct_s = time.monotonic() - t0
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    m = torch.full_like(w, float("nan"))
    armed = _Armed(cfg, rank) if _strikes(cfg, rank) else None
    if armed is not None:
        armed.install()
    try:
        state = mgr.restore(state_of(rank, world, w, m, 0))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "error_time": time.time()}
    restored = time.time()
    out = {
        "restored": mgr.restored_step,
        "step": state["step"],
        "tier": mgr.restored_tier,
        "restored_time": restored,
        "construct_s": construct_s,
        "w": w.tolist(),
        "m": m.tolist(),
    }
    if cfg.get("no_continue"):
        return out
    nxt = int(state["step"]) + 1
    train_step(w, m, rows_of(rank, world), nxt)
    state["step"] = nxt
    try:
        _save_over_a_lost_hosts_lease(cfg, mgr, nxt, state, out)
        mgr.close()
        _last_out()
    except Exception as e:
        out["continue_error"] = f"{type(e).__name__}: {e}"
    return out


def _save_over_a_lost_hosts_lease(
    cfg: dict[str, Any], mgr: Any, step: int, state: dict[str, Any], out: dict[str, Any]
) -> None:
    """Save ``step`` in both tiers. In namespaces, a host killed while saving this step left
    a lease no restarted host can judge (its PID namespace is gone, and a restarted host is a
    new one): the save watches it and breaks it once its ttl has passed without a renewal
    (:meth:`shardsafe.lease.Lease.acquire`); a save that took longer than a few seconds goes
    to ``out["lease_wait_s"]``."""
    t0 = time.monotonic()
    mgr.save(step, state)
    mgr.wait()
    took = time.monotonic() - t0
    if cfg.get("namespaces") and took > 5.0:
        out["lease_wait_s"] = took


def _rank_main(
    rank: int, world: int, port: int, fn_name: str, cfg: dict[str, Any], start: float
) -> None:
    """One rank: log to a file, join the group, run the phase, write the result, exit at once
    (a dead peer must not hang the exit in a process group's teardown)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp, phase = cfg["tmp"], cfg["phase"]
    with open(os.path.join(tmp, "pids", f"{phase}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    # c10d prints its tracebacks of dead peers on stderr: into the rank's log, not the summary
    out = os.open(
        os.path.join(tmp, "logs", f"{phase}.rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT, 0o644
    )
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # a hung phase is killed at PHASE_TIMEOUT: every thread's stack into the log first
    faulthandler.dump_traceback_later(PHASE_TIMEOUT - 10, exit=False)
    logging.basicConfig(
        filename=os.path.join(tmp, "logs", f"{phase}.rank{rank}.log"),
        level=logging.INFO,
        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    result: dict[str, Any]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        hosts = cfg["hosts"]

        def host_pids() -> list[int]:
            pids = []
            for r, h in enumerate(hosts):
                if h == hosts[rank]:
                    try:
                        with open(os.path.join(tmp, "pids", f"{phase}.{r}")) as f:
                            pids.append(int(f.read()))
                    except (OSError, ValueError):
                        pass
            return pids

        cfg = {**cfg, "host_pids": host_pids}
        pg_timeout = datetime.timedelta(seconds=60)
        master = cfg.get("master", "127.0.0.1")  # in namespaces: rank 0's host
        t_pg = time.monotonic()
        if cfg["store"] == "agent":  # hosted by the harness, as torchrun's agent hosts it
            store = dist.TCPStore(master, port, world, is_master=False, timeout=pg_timeout)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=pg_timeout
            )
        else:  # tcp:// rendezvous: rank 0's process hosts the store
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{master}:{port}",
                rank=rank,
                world_size=world,
                timeout=pg_timeout,
            )
        pg_s = time.monotonic() - t_pg
        result = {
            "start": start,
            "pg_s": pg_s,
            **{"train": train, "restart": restart}[fn_name](rank, world, cfg),
        }
    except BaseException as e:
        result = {
            "error": f"{type(e).__name__}: {e}",
            "error_time": time.time(),
            "tb": traceback.format_exc(),
        }
    path = os.path.join(tmp, "results", f"{phase}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    # a script's rank ends through the interpreter's exit, which stops the heartbeat and marks
    # the rank exited (shardsafe.liveness.EXITED); this forked one ends in os._exit, which runs
    # no exit handler, so it does that step itself
    from shardsafe.liveness import HEARTBEATS

    HEARTBEATS.stop()
    logging.shutdown()
    os._exit(0)


# --------------------------------------------------------------------------- the harness


@dataclass
class Phase:
    results: dict[int, dict[str, Any]]
    exit_codes: dict[int, int | None]
    timed_out: bool
    seconds: float


def run_phase_on_ids(
    ctx: Any, tmp: str, phase: str, fn_name: str, hosts: list[str], cfg: dict[str, Any]
) -> Phase:
    """Start one process per rank; wait until each exited or wrote its result (a stopped rank
    never does: it is killed once every other rank is done), or the phase's hard timeout."""
    import torch.distributed as dist
    from launch import free_port

    world = len(hosts)
    cfg = {**cfg, "tmp": tmp, "phase": phase, "hosts": hosts}
    port = free_port()
    store = None
    if cfg["store"] == "agent":
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn_name, cfg, time.time()))
        for r in range(world)
    ]
    timed_out = False
    try:
        for p in procs:
            p.start()
        deadline = t0 + PHASE_TIMEOUT
        while True:
            # a rank is done once it exited or wrote its result; a stopped one stays stopped
            pending = [
                r
                for r, p in enumerate(procs)
                if p.is_alive()
                and not os.path.exists(_result_path(tmp, phase, r))
                and not _stopped(p.pid)
            ]
            if not pending:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=10)
        del store
    results = {}
    for r in range(world):
        try:
            with open(_result_path(tmp, phase, r)) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return Phase(
        results, {r: p.exitcode for r, p in enumerate(procs)}, timed_out, time.monotonic() - t0
    )


def run_phase_ns(
    hosts: Any, tmp: str, phase: str, fn_name: str, layout: list[str], cfg: dict[str, Any]
) -> Phase:
    """:func:`run_phase_on_ids` with each host of ``layout`` in its own namespaces
    (:mod:`tests.namespaces`): a launcher (this script, ``--ns-launch``) on each host forks its
    ranks and, on rank 0's host, hosts the store, as torchrun's agent on the rendezvous host
    does (lost with that host); its local root is ``local/<host>`` bind-mounted over
    ``localdisk``, the persistent tier the directory every host sees. A rank is done once its
    result is written, its launcher saw it exit or stop, or its host is gone."""
    import subprocess
    from importlib.util import find_spec

    from launch import free_port

    world = len(layout)
    port = free_port()  # any: every host has its own network stack
    master = hosts.ips[hosts.hostnames.index(layout[0])]
    cfg = {**cfg, "tmp": tmp, "phase": phase, "hosts": layout, "namespaces": True}
    cfg["master"] = master
    spec_origin = find_spec("shardsafe")
    assert spec_origin is not None and spec_origin.origin is not None
    src = os.path.dirname(os.path.dirname(spec_origin.origin))
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "eth0",
        "PYTHONPATH": os.pathsep.join([src, ROOT]),
        "OMP_NUM_THREADS": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    mountpoint = os.path.join(tmp, "localdisk")
    os.makedirs(mountpoint, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    timed_out = False
    ended = False
    try:
        for h in dict.fromkeys(layout):  # rank 0's host first: it hosts the store
            disk = os.path.join(tmp, "local", h)
            os.makedirs(disk, exist_ok=True)
            spec = {
                "fn": fn_name,
                "ranks": [r for r, x in enumerate(layout) if x == h],
                "world": world,
                "port": port,
                "store_host": h == layout[0] and cfg["store"] == "agent",
                "cfg": cfg,
            }
            spec_path = os.path.join(tmp, f"{phase}.{h}.spec.json")
            with open(spec_path, "w") as fh:
                json.dump(spec, fh)
            argv = [sys.executable, os.path.abspath(__file__), "--ns-launch", spec_path]
            cmd = hosts.command(
                hosts.hostnames.index(h), argv, binds=[(disk, mountpoint)], exec_program=False
            )
            with open(os.path.join(tmp, "logs", f"{phase}.{h}.launcher.log"), "wb") as log:
                procs[h] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + PHASE_TIMEOUT
        while True:
            pending = [
                r
                for r in range(world)
                if procs[layout[r]].poll() is None
                and not os.path.exists(_result_path(tmp, phase, r))
                and not os.path.exists(_result_path(tmp, phase, r) + ".gone")
            ]
            if not pending:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        ended = True
    finally:
        # the launchers kill what is left of their ranks (a stopped one) and leave; on a
        # timeout or an interruption each host is ended at once (--kill-child: its namespace)
        with open(os.path.join(tmp, "results", f"{phase}.end"), "w"):
            pass
        for p in procs.values():
            if ended and not timed_out:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=20)
            if p.poll() is None:
                p.kill()
            p.wait()
    results: dict[int, dict[str, Any]] = {}
    codes: dict[int, int | None] = {r: None for r in range(world)}
    for r in range(world):
        try:
            with open(_result_path(tmp, phase, r)) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            pass
    for h in procs:
        try:
            with open(os.path.join(tmp, "results", f"{phase}.{h}.exits.json")) as f:
                codes.update({int(r): c for r, c in json.load(f).items()})
        except (OSError, ValueError):
            pass  # the host was killed: its ranks' exit codes died with it
    return Phase(results, codes, timed_out, time.monotonic() - t0)


def ns_launch(spec_path: str) -> int:
    """One host's launcher, inside its namespaces: fork its ranks (torch imported once, here),
    host the store if it is rank 0's host, mark each rank that exits or stops (``.gone``), and
    once the harness ends the phase kill what is left and write the ranks' exit codes."""
    import torch.distributed as dist

    import shardsafe  # noqa: F401  (imported before the fork, as the forkserver preloads it)
    import tests.faultinject
    import tests.tierstate  # noqa: F401

    with open(spec_path) as fh:
        spec = json.load(fh)
    cfg = spec["cfg"]
    tmp, phase, world, port = cfg["tmp"], cfg["phase"], spec["world"], spec["port"]
    ctx = mp.get_context("fork")  # no thread runs yet in this process: the store comes after
    procs = {
        r: ctx.Process(target=_rank_main, args=(r, world, port, spec["fn"], cfg, time.time()))
        for r in spec["ranks"]
    }
    for p in procs.values():
        p.start()
    store = None
    if spec["store_host"]:
        store = dist.TCPStore(cfg["master"], port, world, is_master=True, wait_for_workers=False)
    end = os.path.join(tmp, "results", f"{phase}.end")
    deadline = time.monotonic() + PHASE_TIMEOUT + 30  # the harness is gone: leave anyway
    gone: set[int] = set()
    try:
        while not os.path.exists(end) and time.monotonic() < deadline:
            for r, p in procs.items():
                if r not in gone and (not p.is_alive() or _stopped(p.pid)):
                    gone.add(r)
                    with open(_result_path(tmp, phase, r) + ".gone", "w"):
                        pass
            time.sleep(0.02)
    finally:
        for p in procs.values():
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.join(timeout=10)
        host = cfg["hosts"][spec["ranks"][0]]
        path = os.path.join(tmp, "results", f"{phase}.{host}.exits.json")
        with open(path, "w") as fh:
            json.dump({r: p.exitcode for r, p in procs.items()}, fh)
        del store
    return 0


def _result_path(tmp: str, phase: str, rank: int) -> str:
    return os.path.join(tmp, "results", f"{phase}.{rank}.json")


def _stopped(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class CycleFailure(Exception):
    """A check of the cycle failed."""


@dataclass
class CycleResult:
    seed: int
    fault: dict[str, Any]
    ok: bool
    message: str = ""
    restored: int | None = None
    expected: int | None = None
    tier: str | None = None
    recover_s: float | None = None  # restart's start to restored, max over ranks
    detect_s: list[float] = field(default_factory=list)  # survivors: fault to their error
    seconds: float = 0.0
    lease_wait_s: float | None = None  # namespaces: the restart's save waited for a lease
    # the restart's slowest rank's time to open its store connections: joining the process
    # group and constructing the manager (a stall there is the name lookup of
    # benchmarks/store_connect.py, not recovery work)
    connect_s: float | None = None


def _place_dir(tmp: str, host: str) -> str | None:
    base = os.path.join(tmp, "local", host)
    try:
        runs = [n for n in os.listdir(base) if n.startswith("run-")]
    except FileNotFoundError:
        return None
    return os.path.join(base, runs[0]) if len(runs) == 1 else None


def _steps_in(d: str | None) -> list[int]:
    if d is None or not os.path.isdir(d):
        return []
    return sorted(
        int(n.removeprefix("step_"))
        for n in os.listdir(d)
        if n.startswith("step_") and os.path.exists(os.path.join(d, n, "manifest.json"))
    )


def _intact_files(step_dir: str, damaged: set[str]) -> tuple[dict[str, int] | None, set[str]]:
    """(the manifest's files and sizes if the manifest is intact, the intact files here)."""
    mpath = os.path.join(step_dir, "manifest.json")
    if mpath in damaged or not os.path.exists(mpath):
        return None, set()
    try:
        with open(mpath) as f:
            files = {n: int(e["nbytes"]) for n, e in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None, set()
    intact = set()
    for n, size in files.items():
        p = os.path.join(step_dir, n)
        if p not in damaged and os.path.isfile(p) and os.path.getsize(p) == size:
            intact.add(n)
    return files, intact


def _step_dirs(d: str | None, leased: bool = True) -> dict[int, list[str]]:
    """Each step's directories under ``d`` that hold a manifest: the step itself, else the work
    directories of a save that died after writing its manifest there and before renaming it
    into place, which the restart's clean-up puts back as the step
    (:meth:`shardsafe.directory.CheckpointDirectory.recover`) unless the save's lease still
    holds it then (its ttl not over, its process not askable from the restart's host): without
    ``leased``, such a work directory is left out."""
    from shardsafe.lease import lease_state
    from shardsafe.storage.local import LocalStorage

    found: dict[int, list[str]] = {}
    if d is None or not os.path.isdir(d):
        return found
    for n in sorted(os.listdir(d)):
        name = n[1:].split(".shardsafe-tmp-")[0] if ".shardsafe-tmp-" in n else n
        if not name.startswith("step_") or not os.path.exists(os.path.join(d, n, "manifest.json")):
            continue
        if (
            not leased
            and name != n
            and lease_state(LocalStorage(d), f".{name}.shardsafe-lock") == "held"
        ):
            continue
        found.setdefault(int(name.removeprefix("step_")), []).append(os.path.join(d, n))
    for s, dirs in found.items():
        main = os.path.join(d, f"step_{s:09d}")
        if main in dirs:
            found[s] = [main]
    return found


def expected_step(
    tmp: str, layout: list[str], damaged: set[str], leased: bool = True
) -> int | None:
    """The newest step with an intact copy the restart can reach (see the module docstring);
    without ``leased``, a work directory still under its save's lease is out of reach."""
    best: int | None = None
    for s, dirs in _step_dirs(os.path.join(tmp, "persistent"), leased).items():
        files, intact = _intact_files(dirs[0], damaged)
        if files is not None and set(files) == intact:
            best = max(best or 0, s)
    places = [_step_dirs(_place_dir(tmp, h), leased) for h in sorted(set(layout))]
    for s in sorted({s for p in places for s in p}):
        manifest: dict[str, int] | None = None
        have: set[str] = set()
        for p in places:
            for step_dir in p.get(s, [])[:1]:
                files, intact = _intact_files(step_dir, damaged)
                if files is not None:
                    manifest = files
                    have |= intact
        if manifest is not None and set(manifest) <= have:
            best = max(best or 0, s)
    return best


def _check_nothing_lost(tmp: str, before: int) -> None:
    """Every step committed before the fault is still there: persistent ones all, local ones
    (the newest two, keep_last=2) in both original places, unless retention made room for
    steps published there after the fault's stage was met (a delayed fault can land in a
    later step's save; a place may or may not have published the step it struck)."""
    have = _steps_in(os.path.join(tmp, "persistent"))
    lost = [s for s in range(PERSIST_EVERY, before + 1, PERSIST_EVERY) if s not in have]
    if lost:
        raise CycleFailure(f"persistent steps {lost} committed before the fault are gone ({have})")
    for host in ("host0", "host1"):
        held = _steps_in(_place_dir(tmp, host))
        want = sorted({*range(1, before + 1), *(s for s in held if s > before)})[-2:]
        if any(s not in held for s in want):
            raise CycleFailure(f"{host}'s local steps {held}: lost some of {want}")


def _damage(tmp: str, f: Fault) -> set[str]:
    """Flip a byte of, truncate or delete one file of a committed step; returns its path."""
    if f.tier == "local":
        d = _place_dir(tmp, f.place)
        assert d is not None, f"no local place of {f.place}"
    else:
        d = os.path.join(tmp, "persistent")
    steps = _steps_in(d)
    step = steps[-1] if f.target_step == "newest" or len(steps) < 2 else steps[-2]
    sdir = os.path.join(d, f"step_{step:09d}")
    if f.target_file == "manifest":
        path = os.path.join(sdir, "manifest.json")
    else:
        names = sorted(os.listdir(os.path.join(sdir, "data")))
        path = os.path.join(sdir, "data", names[int(f.pick * len(names))])
    size = os.path.getsize(path)
    if f.kind == "delete":
        os.unlink(path)
    elif f.kind == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(int(f.pick * size))
    else:
        with open(path, "r+b") as fh:
            at = int(f.pick * size)
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x10]))
    return {path}


def _stale_lease(tmp: str, f: Fault, step: int) -> None:
    """A dead job's lease and half-written work directory at ``step``."""
    if f.tier == "local":
        parent = _place_dir(tmp, f.place)
        assert parent is not None
    else:
        parent = os.path.join(tmp, "persistent")
    name = f"step_{step:09d}"
    now = time.time()
    if f.lease_kind == "expired":
        lease = {
            "owner": "d" * 16,
            "host": "gone-host",
            "pid": 4242,
            "pid_ns": "",
            "renewed": now - 3600,
            "ttl": 60.0,
        }
    else:
        gone = _gone_pid()
        try:
            ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            ns = ""
        lease = {
            "owner": "d" * 16,
            "host": platform.node(),
            "pid": gone,
            "pid_ns": ns,
            "renewed": now,
            "ttl": 60.0,
        }
    with open(os.path.join(parent, f".{name}.shardsafe-lock"), "w") as fh:
        json.dump(lease, fh)
    work = os.path.join(parent, f".{name}.shardsafe-tmp-{'d' * 16}", "data")
    os.makedirs(work)
    with open(os.path.join(work, "rank-00000-00.bin"), "wb") as fh:
        fh.write(b"\0" * 100)


def _gone_pid() -> int:
    """The id of a process of this host that has exited."""
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _survivor_checks(
    phase: Phase,
    fired: dict[str, Any] | None,
    victims: set[int],
    slack: float,
    what: str,
    frozen_store: bool = False,
) -> list[float]:
    """Every rank the fault did not strike raised an error, within the stated bound (that of
    a frozen store when the rank frozen hosts it)."""
    if fired is None:
        raise CycleFailure(
            f"{what}: the fault never struck (exit codes {phase.exit_codes}, results "
            f"{_brief(phase.results)})"
        )
    waits = []
    stated = FROZEN_STORE_BOUND if frozen_store else DEAD_AFTER + STATED_BOUND
    bound = stated + slack
    for r, code in phase.exit_codes.items():
        if r in victims:
            continue
        res = phase.results.get(r)
        if res is None:
            raise CycleFailure(f"{what}: surviving rank {r} left no result (exit code {code})")
        if "error" not in res:
            struck = {
                v: (
                    phase.exit_codes.get(v),
                    _brief({v: phase.results[v]}) if v in phase.results else "no result",
                )
                for v in victims
            }
            raise CycleFailure(
                f"{what}: rank {r} succeeded although rank(s) {sorted(victims)} were struck: {res}"
                f" (the fault's record {fired}; the struck ranks' exit codes and results {struck})"
            )
        wait = float(res["error_time"]) - float(fired["time"])
        waits.append(wait)
        if wait > bound:
            raise CycleFailure(
                f"{what}: rank {r} learnt of the fault after {wait:.1f} s, more than "
                f"{stated} + slack {slack} s: {res['error'][:300]}"
            )
    return waits


def _freezes_store(f: Fault) -> bool:
    """The fault stops the process that hosts the store (rank 0, ``tcp://`` rendezvous)."""
    return f.kind == "stop-rank" and f.store == "rank0" and f.victim == 0


def _victims(f: Fault, hosts: list[str]) -> set[int]:
    if f.kind == "kill-host":
        return {r for r, h in enumerate(hosts) if h == hosts[f.victim or 0]}
    if f.kind in PROCESS_FAULTS:
        return {f.victim or 0}
    return set()


def _read_fault(tmp: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(tmp, "fault.json")) as fh:
            return dict(json.load(fh))
    except (OSError, ValueError):
        return None


def run_cycle(
    seed: int,
    ctx: Any,
    slack: float = 1.0,
    verbose: bool = False,
    keep: bool = False,
    ns: Any = None,
) -> CycleResult:
    """One cycle; with ``ns`` (:func:`tests.namespaces.made` over :data:`RESTART_HOSTS`),
    each host runs in its own namespaces."""
    import torch

    from tests.tierstate import reference, rows_of

    f = draw(seed, namespaces=ns is not None)

    def run_phase(
        ctx: Any, tmp: str, phase: str, fn_name: str, layout: list[str], cfg: dict[str, Any]
    ) -> Phase:
        if ns is not None:
            return run_phase_ns(ns, tmp, phase, fn_name, layout, cfg)
        return run_phase_on_ids(ctx, tmp, phase, fn_name, layout, cfg)

    t0 = time.monotonic()
    res = CycleResult(seed, asdict(f), ok=False)
    tmp = tempfile.mkdtemp(prefix=f"soak-{seed}-")
    for d in ("pids", "logs", "results", "persistent", "local"):
        os.makedirs(os.path.join(tmp, d))

    def say(msg: str) -> None:
        if verbose:
            print(f"  [{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    try:
        say(f"fault: {asdict(f)}")
        in_training = f.kind in ("full-disk",) or (
            f.kind in PROCESS_FAULTS and f.stage != "restoring"
        )
        cfg = {"fault": asdict(f) if in_training else None, "drain": f.drain, "store": f.store}
        hosts = list(TRAIN_HOSTS)
        p1 = run_phase(ctx, tmp, "train", "train", hosts, cfg)
        say(f"train: {p1.seconds:.1f} s, exit codes {p1.exit_codes}, results {_brief(p1.results)}")
        if p1.timed_out:
            raise CycleFailure(f"training did not end within {PHASE_TIMEOUT:.0f} s")
        damaged: set[str] = set()
        fired = _read_fault(tmp)
        if in_training:
            victims = _victims(f, hosts) if f.kind != "full-disk" else set()
            if f.kind == "full-disk" and fired is None:
                raise CycleFailure("the disk never filled up")
            if f.kind == "full-disk":
                # every rank must fail: the one out of space and, through the commit, the others
                res.detect_s = _survivor_checks(p1, fired, set(), slack, "full disk")
            else:
                res.detect_s = _survivor_checks(
                    p1, fired, victims, slack, "training", _freezes_store(f)
                )
            assert fired is not None
            struck = int(fired["step"])
            _check_nothing_lost(tmp, struck - 1)
        else:
            bad = {r: x for r, x in p1.results.items() if "error" in x}
            if bad or len(p1.results) != len(hosts):
                raise CycleFailure(f"training without a fault failed: {_brief(p1.results)}")
            _check_nothing_lost(tmp, STEPS)
            if f.kind in FILE_FAULTS:
                damaged = _damage(tmp, f)
                say(f"damaged {sorted(damaged)} ({f.kind})")
            elif f.kind == "stale-lease":
                _stale_lease(tmp, f, STEPS + 1)
                say(f"stale lease ({f.lease_kind}) at step {STEPS + 1} in {f.tier} {f.place}")
        if f.stage == "restoring":
            cfg1 = {"fault": asdict(f), "drain": False, "no_continue": True, "store": f.store}
            before = expected_step(tmp, f.first_layout, damaged)
            p2 = run_phase(ctx, tmp, "restart1", "restart", f.first_layout, cfg1)
            say(
                f"restart hit while restoring {f.first_layout}: {p2.seconds:.1f} s, exit codes {p2.exit_codes}, results {_brief(p2.results)}"
            )
            if p2.timed_out:
                raise CycleFailure(
                    f"the restart hit while restoring did not end within {PHASE_TIMEOUT:.0f} s"
                )
            fired = _read_fault(tmp)
            if fired is None:
                raise CycleFailure("the fault never struck the restore")
            res.detect_s = _survivor_checks(
                p2, fired, _victims(f, f.first_layout), slack, "restoring", _freezes_store(f)
            )
            _check_nothing_lost(tmp, STEPS)
            del before
        res.expected = expected_step(tmp, f.layout, damaged)
        # a place's copy still under its save's lease when the restart cleans up is not put
        # back (its save may be alive): the step before it is right then too
        unleased = expected_step(tmp, f.layout, damaged, leased=False)
        say(
            f"restart in layout {f.layout}: expect step {res.expected}"
            + (f" ({unleased} where a lease still holds it)" if unleased != res.expected else "")
        )
        p3 = run_phase(
            ctx,
            tmp,
            "restart",
            "restart",
            f.layout,
            {"fault": None, "drain": False, "store": f.store},
        )
        say(
            f"restart: {p3.seconds:.1f} s, exit codes {p3.exit_codes}, results {_brief(p3.results)}"
        )
        if p3.timed_out:
            raise CycleFailure(f"the restart did not end within {PHASE_TIMEOUT:.0f} s")
        world = len(f.layout)
        for r in range(world):
            out = p3.results.get(r)
            if out is None:
                raise CycleFailure(
                    f"restart rank {r} left no result (exit code {p3.exit_codes[r]})"
                )
            if res.expected is None:  # nothing in reach: the run must be told
                # CheckpointNotFoundError where no step is complete in reach,
                # CorruptCheckpointError where the steps in reach all failed to load
                told = ("CheckpointNotFoundError", "CorruptCheckpointError")
                if not out.get("error", "").startswith(told):
                    raise CycleFailure(
                        f"no step in reach, yet restart rank {r} did not raise "
                        f"CheckpointNotFoundError or CorruptCheckpointError: {_brief({r: out})}"
                    )
                continue
            if "error" in out:
                raise CycleFailure(f"restart rank {r} failed: {out['error'][:600]}")
        if res.expected is None:
            res.ok = True
            return res
        steps = {p3.results[r]["restored"] for r in range(world)}
        res.restored = p3.results[0]["restored"]
        res.tier = p3.results[0]["tier"]
        res.recover_s = max(
            p3.results[r]["restored_time"] - p3.results[r]["start"] for r in range(world)
        )
        res.connect_s = max(
            p3.results[r].get("pg_s", 0.0) + p3.results[r].get("construct_s", 0.0)
            for r in range(world)
        )
        if len(steps) != 1:
            raise CycleFailure(f"the ranks restored different steps: {steps}")
        if res.restored not in (res.expected, unleased):
            raise CycleFailure(
                f"restored step {res.restored} ({res.tier} tier), expected {res.expected}: the newest "
                "step with an intact copy in reach"
            )
        w_ref, m_ref = reference(int(res.restored))
        for r in range(world):
            out = p3.results[r]
            rows = rows_of(r, world)
            if out["step"] != res.restored:
                raise CycleFailure(f"rank {r}: state['step'] {out['step']} != {res.restored}")
            if not torch.equal(
                torch.tensor(out["w"], dtype=torch.float64), w_ref[rows]
            ) or not torch.equal(torch.tensor(out["m"], dtype=torch.float64), m_ref[rows]):
                raise CycleFailure(
                    f"rank {r}: restored state differs from the reference at step {res.restored}"
                )
        waits = [
            p3.results[r]["lease_wait_s"] for r in range(world) if "lease_wait_s" in p3.results[r]
        ]
        if waits:
            res.lease_wait_s = max(waits)
            say(
                f"the next save waited {res.lease_wait_s:.1f} s for a killed host's lease to expire"
            )
        errs = {
            r: p3.results[r]["continue_error"]
            for r in range(world)
            if "continue_error" in p3.results[r]
        }
        if errs:
            raise CycleFailure(f"the restarted run could not save its next step: {errs}")
        nxt = int(res.restored) + 1
        if nxt not in _steps_in(os.path.join(tmp, "persistent")):
            raise CycleFailure(f"the restarted run's step {nxt} is not in the persistent tier")
        res.ok = True
    except CycleFailure as e:
        res.message = str(e)
    except Exception as e:
        res.message = f"harness error: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        res.seconds = time.monotonic() - t0
        if verbose or not res.ok:  # a failure in a long run leaves what it needs to be read
            if not res.ok and not verbose:
                print(f"  seed {seed} failed: {res.message}\n  its files and logs:")
                _print_tree(tmp)
            _print_logs(tmp)
        if keep:
            print(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return res


def _brief(results: dict[int, dict[str, Any]]) -> str:
    def one(x: dict[str, Any]) -> str:
        if "error" in x:
            return "error: " + x["error"][:160].replace("\n", " ")
        if "restored" in x:
            return f"restored {x['restored']} ({x['tier']})" + (
                f", continue_error {x['continue_error'][:120]}" if "continue_error" in x else ""
            )
        return "done"

    return "; ".join(f"{r}: {one(x)}" for r, x in sorted(results.items()))


def _print_tree(tmp: str) -> None:
    """Every file of both tiers, with its size (leases, marks and work directories too)."""
    for tier in ("persistent", "local"):
        top = os.path.join(tmp, tier)
        for here, dirs, files in sorted(os.walk(top)):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(here, name)
                with contextlib.suppress(OSError):
                    print(f"    {os.path.relpath(path, tmp)} {os.path.getsize(path)}")


def _print_logs(tmp: str) -> None:
    logs = os.path.join(tmp, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name)) as fh:
            text = fh.read().strip()
        if text:
            print(f"  --- {name}\n" + "\n".join("    " + line for line in text.splitlines()))


# --------------------------------------------------------------------------- the summary


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def label(fault: dict[str, Any]) -> str:
    if fault["kind"] in PROCESS_FAULTS:
        return f"{fault['kind']}@{fault['stage']}"
    return f"{fault['kind']}/{fault['tier']}"


def summary(results: list[CycleResult], slack: float, namespaces_every: int = 0) -> str:
    n = len(results)
    ok = sum(r.ok for r in results)
    lines = [f"cycles: {n}, succeeded: {ok} ({100.0 * ok / max(n, 1):.1f} %)"]
    ns = [r for r in results if r.fault.get("namespaces")]
    if ns:
        lines.append(
            f"in namespaces (each host its own network/PID/mount namespaces): {len(ns)} cycles, "
            f"succeeded: {sum(r.ok for r in ns)}"
        )
        waited = [r.lease_wait_s for r in ns if r.lease_wait_s is not None]
        if waited:
            lines.append(
                f"  of which the restart's next save waited for a killed host's lease (ttl "
                f"{NS_LEASE_TTL:.0f} s) to expire: {len(waited)}, up to {max(waited):.1f} s"
            )
    ttr = [r.recover_s for r in results if r.ok and r.recover_s is not None]
    if ttr:
        lines.append(
            "time to recover (restart's start to restored, max over ranks): "
            f"p50 {percentile(ttr, 50):.2f} s, p95 {percentile(ttr, 95):.2f} s, "
            f"max {max(ttr):.2f} s, mean {statistics.mean(ttr):.2f} s"
        )
        slow = [r for r in results if r.ok and r.recover_s is not None and r.recover_s > 4.0]
        if slow:
            stalled = [r for r in slow if r.connect_s is not None and r.connect_s > 4.0]
            lines.append(
                f"  over 4 s: {len(slow)}; of them, a rank that took over 4 s to open its store "
                f"connections (joining the group and constructing the manager; see "
                f"benchmarks/store_connect.py): {len(stalled)}"
            )
    det = [d for r in results for d in r.detect_s]
    if det:
        lines.append(
            f"survivors' detection (fault to error; bound dead_after {DEAD_AFTER} + "
            f"{STATED_BOUND} + slack {slack} s, a frozen store's {FROZEN_STORE_BOUND} + "
            f"slack): p50 {percentile(det, 50):.2f} s, "
            f"p95 {percentile(det, 95):.2f} s, max {max(det):.2f} s"
        )
    by: dict[str, list[int]] = {}
    for r in results:
        counts = by.setdefault(label(r.fault), [0, 0])
        counts[0] += 1
        counts[1] += r.ok
    lines.append("by fault: " + ", ".join(f"{k} {v[1]}/{v[0]}" for k, v in sorted(by.items())))
    failed = [r for r in results if not r.ok]
    if failed:
        again = f" (--namespaces-every {namespaces_every} too)" if ns else ""
        lines.append(f"failures ({len(failed)}), replay with --replay SEED{again}:")
        for r in failed:
            lines.append(
                f"  seed {r.seed}{_ns_mark(r)}: {label(r.fault)}: "
                f"{r.message.splitlines()[0][:400] if r.message else ''}"
            )
    return "\n".join(lines)


def context() -> Any:
    ctx = mp.get_context("forkserver")
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "shardsafe", "tests.tierstate", "tests.faultinject"]
    )
    return ctx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1, help="cycle i's seed is SEED * 1000000 + i")
    ap.add_argument("--replay", type=int, default=None, help="run this one cycle seed verbosely")
    ap.add_argument(
        "--slack", type=float, default=1.0, help="seconds added to the stated bound (machine load)"
    )
    ap.add_argument("--keep", action="store_true", help="keep each cycle's directory")
    ap.add_argument("--json", default=None, help="write every cycle's result here")
    ap.add_argument(
        "--namespaces-every",
        type=int,
        default=0,
        metavar="K",
        help="run every K-th cycle (the cycle of index i when (i + 1) %% K == 0, --replay "
        "included) with each host in its own network/PID/mount namespaces, joined by a bridge "
        "(docs/DESIGN.md; needs root, `ip` and `unshare`; where refused, says why and runs "
        "every cycle on node ids); 0: none",
    )
    ap.add_argument("--ns-launch", default=None, help=argparse.SUPPRESS)  # a host's launcher
    args = ap.parse_args(argv)
    if args.ns_launch is not None:
        return ns_launch(args.ns_launch)
    if args.namespaces_every < 0:
        ap.error("--namespaces-every must be 0 or more")
    # a stopped run still kills its ranks, ends its namespaces and deletes its directories
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = context()
    seeds = (
        [args.replay]
        if args.replay is not None
        else [args.seed * 1_000_000 + i for i in range(args.cycles)]
    )
    every = args.namespaces_every
    in_ns = [bool(every) and (s % 1_000_000 + 1) % every == 0 for s in seeds]
    print(
        f"soak: {len(seeds)} cycle(s) on {platform.node()} ({os.cpu_count()} cores), "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}"
        + (f", {sum(in_ns)} in namespaces" if any(in_ns) else ""),
        flush=True,
    )
    results: list[CycleResult] = []
    refused: str | None = None
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        ns = None
        if any(in_ns):
            from tests import namespaces

            etc = tempfile.mkdtemp(prefix="soak-etc-")
            stack.callback(shutil.rmtree, etc, True)
            try:
                ns = stack.enter_context(namespaces.made(RESTART_HOSTS, etc, prefix="sk"))
            except namespaces.Refused as e:
                refused = str(e)
                print(
                    f"--namespaces-every {every}: {refused}; every cycle runs on node ids",
                    file=sys.stderr,
                    flush=True,
                )
        for i, seed in enumerate(seeds):
            r = run_cycle(
                seed,
                ctx,
                slack=args.slack,
                verbose=args.replay is not None,
                keep=args.keep,
                ns=ns if in_ns[i] else None,
            )
            results.append(r)
            state = (
                "ok" if r.ok else f"FAILED: {r.message.splitlines()[0][:300] if r.message else ''}"
            )
            print(
                f"[{i + 1}/{len(seeds)}] seed {seed}{_ns_mark(r)} {label(r.fault)} -> restored "
                f"{r.restored} (expected {r.expected}, {r.tier}) recover {_fmt(r.recover_s)} "
                f"in {r.seconds:.1f} s: {state}",
                flush=True,
            )
            if args.replay is not None and r.message:
                print(r.message)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(
                        {
                            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
                            "elapsed_s": time.monotonic() - t0,
                            "namespaces_every": every,
                            "namespaces_refused": refused,
                            "cycles": [asdict(x) for x in results],
                        },
                        fh,
                        indent=1,
                    )
    print(summary(results, args.slack, every))
    if refused is not None:
        print(f"namespace cycles: none ran ({refused})")
    return 0 if all(r.ok for r in results) else 1


def _ns_mark(r: CycleResult) -> str:
    return " [namespaces]" if r.fault.get("namespaces") else ""


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
