"""CheckpointManager (retention, the latest pointer, restore, crash clean-up, async saves) and
the NeuronX-style save_checkpoint/load_checkpoint, in one process and on two gloo ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

import shardsafe
from shardsafe import CheckpointError, CheckpointNotFoundError, ShardedTensor, neuron
from shardsafe.directory import parse_step, step_name
from shardsafe.lease import LEASE_SECONDS, LeaseInfo
from shardsafe.manager import CheckpointManager

REPO = Path(__file__).resolve().parents[1]


def state(value: float, n: int = 16) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((n,), float(value))),
        "step": int(value),
    }


def template(n: int = 16) -> tuple[dict, torch.Tensor]:
    t = torch.zeros(n)
    return {"w": ShardedTensor.from_rank_offsets("w", t)}, t


def listing(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- naming -----------------------------------------------------------------------------------------
def test_step_names_sort_numerically() -> None:
    names = [step_name(s) for s in (5, 100, 20, 1_000_000)]
    assert names[1] == "step_000000100"
    assert sorted(names) == [step_name(s) for s in (5, 20, 100, 1_000_000)]
    assert parse_step("step_000000100") == 100 and parse_step("step_100") is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            step_name(bad)  # type: ignore[arg-type]


# -- retention --------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_retention_keep_last_and_keep_every(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=4, async_save=False) as m:
        seen = []
        for step in range(1, 11):
            stats = m.save(step, state(step))
            assert isinstance(stats, shardsafe.SaveStats) and stats.total_bytes > 0
            seen.append(m.steps())
        assert seen[2] == [2, 3] and seen[4] == [4, 5]
        assert m.steps() == [4, 8, 9, 10]
        assert m.latest_step() == 10
    assert listing(tmp_path) == ["latest", *(step_name(s) for s in (4, 8, 9, 10))]


@pytest.mark.timeout(60)
def test_retention_never_deletes_the_latest(tmp_path: Path) -> None:
    """After resuming from an older step, its successor is the latest even though a higher
    step exists; keep_last=1 then keeps both rather than deleting what was just saved."""
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as m:
        m.save(10, state(10))
        m.save(20, state(20))
        assert m.steps() == [20]
        m.save(15, state(15))
        assert m.steps() == [15, 20]
        assert m.latest_step() == 15
        assert (tmp_path / "latest").read_text() == "step_000000015\n"
        tpl, t = template()
        assert m.restore(tpl)["step"] == 15 and torch.all(t == 15)


@pytest.mark.timeout(60)
def test_keep_all_by_default(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_every=2, async_save=False) as m:
        for step in range(1, 6):
            m.save(step, state(step))
        assert m.steps() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)


@pytest.mark.timeout(60)
def test_deletion_only_after_the_new_checkpoint_commits(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(1, state(1)).result(timeout=30)
    m.save(2, state(2)).result(timeout=30)
    assert m.steps() == [2]
    during: list[list[int]] = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "written" and not during:
            during.append(m.steps())  # the old checkpoint is still there while writing

    h = m.save(3, state(3), progress=progress)
    assert h.result(timeout=30).total_bytes > 0
    assert during == [[2]] and m.steps() == [3]
    # A failing save deletes nothing and leaves the pointer alone.
    bad = state(4)
    bad["oops"] = lambda: None  # cannot be stored: refused while planning, before any write
    with pytest.raises(CheckpointError, match="oops"):
        m.save(4, bad).result(timeout=30)
    assert m.steps() == [3] and m.latest_step() == 3
    assert listing(tmp_path) == ["latest", "step_000000003"]
    m.close()


# -- the latest pointer -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_latest_pointer_is_replaced_atomically(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as m:
        assert m.latest_step() is None
        m.save(1, state(1))
        pointer = tmp_path / "latest"
        inode = pointer.stat().st_ino
        m.save(2, state(2))
        assert pointer.read_text() == "step_000000002\n"
        assert pointer.stat().st_ino != inode  # a new file renamed over the old, not rewritten
        assert not [n for n in listing(tmp_path) if "tmp" in n]


@pytest.mark.timeout(60)
def test_latest_falls_back_to_the_newest_committed(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        m.save(3, state(3))
        pointer = tmp_path / "latest"
        pointer.write_text("step_000000002\n")
        assert m.latest_step() == 2  # a valid pointer wins
        pointer.write_text("step_000000009\n")  # missing
        assert m.latest_step() == 3
        (tmp_path / "step_000000007" / "data").mkdir(parents=True)  # uncommitted
        pointer.write_text("step_000000007\n")
        assert m.latest_step() == 3
        pointer.write_text("garbage")
        assert m.latest_step() == 3
        pointer.unlink()
        assert m.latest_step() == 3
        tpl, _ = template()
        assert m.restore(tpl)["step"] == 3


# -- restore ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_restore_latest_and_explicit_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        tpl, _ = template()
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            m.restore(tpl)
        for step in (5, 10):
            m.save(step, state(step))
        tpl, t = template()
        out = m.restore(tpl)  # waits for the save in flight first
        assert out["step"] == 10 and torch.all(t == 10)
        out = m.restore(tpl, step=5)
        assert out["step"] == 5 and torch.all(t == 5)
        with pytest.raises(CheckpointNotFoundError):
            m.restore(tpl, step=7)
        assert m.checkpoint_path(5) == str(tmp_path / "step_000000005")


# -- crash leftovers -----------------------------------------------------------------------------
def _fake_save(root: Path, name: str, token: str) -> Path:
    work = root / f".{name}.shardsafe-tmp-{token}"
    (work / "data").mkdir(parents=True)
    (work / "data" / "rank-00000-00.bin").write_bytes(b"\0" * 100)
    return work


def lease(host: str, pid: int, age: float = 0.0) -> bytes:
    """A lease file as a save on ``host`` writes it, last renewed ``age`` seconds ago."""
    ns = os.readlink("/proc/self/ns/pid") if host == socket.gethostname() else "other"
    return LeaseInfo("t" * 16, host, pid, ns, time.time() - age, LEASE_SECONDS).to_bytes()


@pytest.mark.timeout(60)
def test_crash_leftovers_are_recognised_and_cleaned(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, state(1))
    host = socket.gethostname()
    dead = dead_pid()
    # Remains of crashed saves:
    _fake_save(tmp_path, "step_000000005", "dead1")
    (tmp_path / ".step_000000005.shardsafe-lock").write_bytes(lease(host, dead))
    _fake_save(tmp_path, "step_000000009", "expired")  # another host's, renewal long overdue
    (tmp_path / ".step_000000009.shardsafe-lock").write_bytes(
        lease("elsewhere.example", dead, age=600)
    )
    (tmp_path / "step_000000006" / "data").mkdir(parents=True)  # no manifest
    (tmp_path / ".step_000000001.shardsafe-old-dead2").mkdir()  # interrupted overwrite/deletion
    (tmp_path / ".latest.shardsafe-tmp-dead3").write_text("step_000000005\n")
    abandoned = time.time() - 3600  # a pointer update abandoned for an hour
    os.utime(tmp_path / ".latest.shardsafe-tmp-dead3", (abandoned, abandoned))
    # Saves that may still be running, and what is not ours:
    _fake_save(tmp_path, "step_000000007", "live1")
    (tmp_path / ".step_000000007.shardsafe-lock").write_bytes(lease(host, os.getpid()))
    _fake_save(tmp_path, "step_000000008", "other-host")
    (tmp_path / ".step_000000008.shardsafe-lock").write_bytes(lease("elsewhere.example", dead))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_5_backup").mkdir()

    m = CheckpointManager(tmp_path, async_save=False)  # cleans at start
    assert listing(tmp_path) == [
        ".step_000000007.shardsafe-lock",
        ".step_000000007.shardsafe-tmp-live1",
        ".step_000000008.shardsafe-lock",
        ".step_000000008.shardsafe-tmp-other-host",
        "latest",
        "notes.txt",
        "step_000000001",
        "step_5_backup",
    ]
    assert m.steps() == [1] and m.latest_step() == 1
    assert m.cleanup() == []
    # A new save into a cleaned step works, and the commit cleans again.
    _fake_save(tmp_path, "step_000000003", "dead4")
    m.save(2, state(2))
    assert ".step_000000003.shardsafe-tmp-dead4" not in listing(tmp_path)
    m.close()


@pytest.mark.timeout(60)
def test_cleanup_never_touches_a_save_in_flight(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path)
    release = threading.Event()
    writing = threading.Event()

    def hold(stage: str, done: int, total: int) -> None:
        if stage == "written":
            writing.set()
            release.wait(30)

    h = m.save(1, state(1), progress=hold)
    assert writing.wait(30)
    in_flight = [n for n in listing(tmp_path) if n.startswith(".step_000000001")]
    assert len(in_flight) == 2  # work directory and lock
    assert m.cleanup() == []
    with CheckpointManager(tmp_path) as other:  # a live lock protects it from others too
        assert other.cleanup() == []
    assert not h.done()
    release.set()
    h.result(timeout=30)
    assert listing(tmp_path) == ["latest", "step_000000001"]
    m.close()


_KILLED_SAVE = """
import os, signal, sys, threading, torch
from shardsafe import ShardedTensor
from shardsafe.manager import CheckpointManager
m = CheckpointManager(sys.argv[1])
st = lambda v: {"w": ShardedTensor.from_rank_offsets("w", torch.full((1 << 16,), float(v)))}
m.save(1, st(1)).result()
def hold(stage, done, total):
    if stage == "written":
        os.kill(os.getpid(), signal.SIGKILL)
m.save(2, st(2), progress=hold)
threading.Event().wait(30)
"""


@pytest.mark.timeout(90)
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(tmp_path)],
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = listing(tmp_path)
    assert "step_000000002" not in left
    assert any(n.startswith(".step_000000002.shardsafe-tmp-") for n in left)
    with pytest.raises(shardsafe.IncompleteCheckpointError):
        shardsafe.load({}, tmp_path / "step_000000002")
    m = CheckpointManager(tmp_path, async_save=False)
    assert listing(tmp_path) == ["latest", "step_000000001"]
    assert m.latest_step() == 1
    tpl, t = template(1 << 16)
    m.restore(tpl)
    assert torch.all(t == 1)
    m.save(2, state(2))  # the step can be saved again
    assert m.steps() == [1, 2]
    m.close()


# -- async saves ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_async_saves_through_the_manager(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=3)
    live = torch.zeros(1 << 14)
    handles = []
    for step in range(1, 6):
        live.fill_(step)
        h = m.save(step, {"w": ShardedTensor.from_rank_offsets("w", live), "step": step})
        live.fill_(-1)  # the training step after the call must not leak into the checkpoint
        handles.append(h)
    stats = m.wait(timeout=30)
    assert stats is not None and stats.path.endswith("step_000000005")
    assert all(h.done() for h in handles)
    assert all(h.seconds_blocked <= h.result().seconds for h in handles)
    assert m.steps() == [3, 4, 5] and m.latest_step() == 5
    done = threading.Event()
    h = m.save(6, {"w": ShardedTensor.from_rank_offsets("w", live.fill_(6)), "step": 6})
    h.add_done_callback(lambda _: done.set())
    assert done.wait(30) and (tmp_path / "latest").read_text() == "step_000000006\n"
    m.close()
    m.close()  # idempotent
    for step in (4, 5, 6):
        got = shardsafe.CheckpointReader(tmp_path / step_name(step)).read_tensor("w")
        assert torch.all(got == step)
    with pytest.raises(CheckpointError, match="closed"):
        m.save(7, state(7))


# -- two ranks ----------------------------------------------------------------------------------
# -- NeuronX-style API ----------------------------------------------------------------------------
def _training(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, x: torch.Tensor
) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.timeout(60)
def test_neuron_round_trip_resumes_training_exactly(tmp_path: Path) -> None:
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
    model, opt, sched = _training()
    for _ in range(3):
        _step(model, opt, sched, x)
    neuron.save_checkpoint(
        tmp_path, "step_3", model, opt, sched, user_content={"step": 3, "note": "hi"}
    )
    assert neuron.has_checkpoint(tmp_path) and (tmp_path / "newest").read_text() == "step_3\n"

    model2, opt2, sched2 = _training(seed=7)  # different weights, optimizer without state
    assert not _same(model, model2)
    content = neuron.load_checkpoint(tmp_path, model=model2, optimizer=opt2, scheduler=sched2)
    assert content == {"step": 3, "note": "hi"}
    assert _same(model, model2)
    assert sched2.state_dict() == sched.state_dict()  # type: ignore[attr-defined]
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        assert all(torch.equal(s1["state"][i][k], s2["state"][i][k]) for k in s1["state"][i])
    for _ in range(2):
        _step(model, opt, sched, x)
        _step(model2, opt2, sched2, x)
    assert _same(model, model2)
    reader = shardsafe.CheckpointReader(tmp_path / "step_3")
    assert "model.0.weight" in reader.tensor_keys()
    assert "optimizer.state.0.weight.exp_avg" in reader.tensor_keys()  # keyed by parameter name
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_neuron_accepts_every_keyword_of_nxd_save_checkpoint(tmp_path: Path) -> None:
    """NxD's own call (the keywords of its developer guide and signature) runs unchanged."""
    model, opt, sched = _training()
    _step(model, opt, sched, torch.randn(8, 6))
    neuron.save_checkpoint(
        tmp_path,
        tag="step_1",
        model=model,
        optimizer=opt,
        scheduler=sched,
        user_content={"total_steps": 1},
        num_workers=8,
        use_xser=True,
        num_kept_ckpts=2,
        async_save=True,
        zero1_optimizer=False,
        use_zero1_dcp=False,
        avoid_saving_lower_precision_weights=True,
    )
    model2, opt2, sched2 = _training(seed=7)
    content = neuron.load_checkpoint(
        tmp_path, model=model2, optimizer=opt2, scheduler=sched2, num_workers=4, strict=True
    )
    assert content == {"total_steps": 1} and _same(model, model2)
    with pytest.raises(shardsafe.ValidationError, match="zero1_optimizer=True"):
        neuron.save_checkpoint(tmp_path, "step_2", model=model, zero1_optimizer=True)
    with pytest.raises(shardsafe.ValidationError, match="num_workers"):
        neuron.save_checkpoint(tmp_path, "step_2", model=model, num_workers=0)
    assert not (tmp_path / "step_2").exists()
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_neuron_optimizer_alone_is_keyed_by_index(tmp_path: Path) -> None:
    x = torch.randn(8, 6)
    model, opt, sched = _training()
    _step(model, opt, sched, x)
    neuron.save_checkpoint(tmp_path, "opt_only", optimizer=opt)
    assert (
        "optimizer.state.0.exp_avg"
        in shardsafe.CheckpointReader(tmp_path / "opt_only").tensor_keys()
    )
    _, opt2, _ = _training()
    assert neuron.load_checkpoint(tmp_path, optimizer=opt2) is None
    assert torch.equal(
        opt.state_dict()["state"][1]["exp_avg"], opt2.state_dict()["state"][1]["exp_avg"]
    )
    with pytest.raises(CheckpointError, match="no scheduler"):
        neuron.load_checkpoint(tmp_path, "opt_only", scheduler=sched)
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_neuron_num_kept_ckpts_and_tag_none_resumes_the_newest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        neuron.load_checkpoint(tmp_path)
    model, opt, sched = _training()
    x = torch.randn(8, 6)
    for step in (8, 9, 10, 11):  # natural order: step_9 before step_10
        _step(model, opt, sched, x)
        neuron.save_checkpoint(
            tmp_path,
            f"step_{step}",
            model,
            opt,
            sched,
            user_content=step,
            async_save=True,
            num_kept_ckpts=2,
        )
    neuron.finalize_checkpoint()
    assert listing(tmp_path) == ["newest", "step_10", "step_11"]
    model2, opt2, sched2 = _training(seed=3)
    assert neuron.load_checkpoint(tmp_path, None, model2, opt2, sched2) == 11
    assert _same(model, model2)
    assert neuron.load_checkpoint(tmp_path, "step_10", model2) == 10
    with pytest.raises(CheckpointNotFoundError):
        neuron.load_checkpoint(tmp_path, "step_9", model2)
    for bad in ("newest", ".hidden", "a/b", ""):
        with pytest.raises(ValueError):
            neuron.save_checkpoint(tmp_path, bad, model)
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_neuron_state_lives_in_an_object_the_caller_holds_or_in_a_default_release_frees(
    tmp_path: Path,
) -> None:
    x = torch.randn(8, 6)
    model, opt, sched = _training()
    _step(model, opt, sched, x)
    mine = neuron.NeuronCheckpoints()
    handle = mine.save_checkpoint(tmp_path / "mine", "step_1", model, opt, async_save=True)
    assert len(mine) == 1 and len(neuron.DEFAULT) == 0  # nothing kept behind the caller's back
    mine.close()  # waits for the save in flight
    assert handle.done() and len(mine) == 0
    model2, opt2, _ = _training(seed=5)
    assert mine.load_checkpoint(tmp_path / "mine", model=model2, optimizer=opt2) is None
    assert _same(model, model2)
    mine.close()

    neuron.save_checkpoint(tmp_path / "default", "step_1", model, async_save=True)
    assert len(neuron.DEFAULT) == 1
    shardsafe.release()  # waits for it, frees the managers and their savers
    assert len(neuron.DEFAULT) == 0
    assert neuron.has_checkpoint(tmp_path / "default")
    model3, _, _ = _training(seed=6)
    neuron.load_checkpoint(tmp_path / "default", model=model3)
    assert _same(model, model3)
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_neuron_dtensor_state_needs_the_integration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, _ = _training()
    monkeypatch.setattr(
        neuron, "_is_dtensor", lambda v: isinstance(v, torch.Tensor) and v.dim() == 2
    )

    def missing(name: str) -> object:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(neuron.importlib, "import_module", missing)
    with pytest.raises(CheckpointError, match=r"integrations\.dtensor"):
        neuron.save_checkpoint(tmp_path, "t", model)
    assert not neuron.has_checkpoint(tmp_path)
    neuron.finalize_checkpoint()


@pytest.mark.timeout(60)
def test_a_run_that_saves_an_older_step_without_restoring_is_refused(tmp_path: Path) -> None:
    """A script whose resume is broken trains from scratch into a root holding step 3:
    retention keeps the newest step numbers, so its steps would go and a restore would bring
    back the old run. Its first save is refused; a save of the newest step (a replacement)
    or a newer one, a manager that restored, and a damaged newest step are let through."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    fresh = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="holds committed step 3, and step 1 is being"):
        fresh.save(1, state(1))
    with pytest.raises(CheckpointError, match="restored nothing"):  # asked again, not once
        fresh.save(2, state(2))
    fresh.save(3, state(33))  # the same step: replaced, as save() says
    fresh.save(4, state(4))
    fresh.close()
    resumed = CheckpointManager(tmp_path, async_save=False)
    tmpl, t = template()
    resumed.restore(tmpl, step=2)  # an explicit branch from an older step is the caller's
    assert torch.equal(t, torch.full((16,), 2.0))
    resumed.save(3, state(3))
    resumed.close()
    with CheckpointManager(tmp_path, async_save=False) as m:
        m._dir.mark_damaged(step_name(4), "flipped")  # a failed restore marked it
        m._dir.mark_damaged(step_name(3), "flipped")
        m.save(2, state(2))


def _refused_on_every_rank(rank: int, world: int, root: str) -> str:
    m = CheckpointManager(root)
    try:
        m.save(1, state(rank))  # the common "step" differs, but the check comes first
        m.wait()
    except CheckpointError as e:
        return str(e)
    finally:
        m.close()
    return "saved"


@pytest.mark.timeout(120)
def test_the_start_over_check_raises_on_every_rank(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(5, state(5))
    errors = run_ranks(_refused_on_every_rank, 2, str(tmp_path), timeout=90)
    assert all("holds committed step 5, and step 1" in e for e in errors), errors


def _two_rank_manager(rank: int, world: int, root: str) -> dict:
    def sd(step: int) -> dict:
        piece = torch.full((8,), float(step * 10 + rank))
        return {
            "w": ShardedTensor.from_rank_offsets("w", piece, (0, rank, world)),
            "step": step,
        }

    m = CheckpointManager(root, keep_last=2, keep_every=3)
    handles = [m.save(step, sd(step)) for step in range(1, 6)]
    stats = m.wait(timeout=60)
    assert stats is not None and all(h.done() for h in handles)
    torch.distributed.barrier()  # rank 0's pointer update has finished before anyone reads
    out = {"steps": m.steps(), "latest": m.latest_step()}
    t = torch.zeros(8)
    loaded = m.restore({"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world))})
    out["restored"] = (loaded["step"], t.tolist())
    full = torch.zeros(16)
    m.restore({"w": ShardedTensor.from_rank_offsets("w", full)}, step=3)  # other layout
    out["step3"] = full.tolist()
    m.close()
    return out


def _two_rank_neuron(rank: int, world: int, root: str) -> dict:
    """DDP-style: the same model on both ranks; each saves, a fresh model loads on each."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model, opt, sched = _training()
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():  # what DDP does: average the gradients
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        sched.step()
    # BatchNorm's running stats differ per rank (as in DDP without SyncBatchNorm); the
    # parameters and the optimizer state are the same everywhere.
    handle = neuron.save_checkpoint(
        root, "step_2", model, opt, sched, user_content={"r": 2}, async_save=True
    )
    handle.result(timeout=60)
    neuron.finalize_checkpoint()
    model2, opt2, sched2 = _training(seed=5)
    content = neuron.load_checkpoint(root, None, model2, opt2, sched2)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    exp_avg = opt2.state_dict()["state"][0]["exp_avg"]
    ref = opt.state_dict()["state"][0]["exp_avg"]
    return {"content": content, "params_equal": same, "exp_avg_equal": torch.equal(exp_avg, ref)}


def _fsdp2_training(
    seed: int, mesh: object
) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _full(model: torch.nn.Module) -> dict:
    return {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}


def _two_rank_fsdp2(rank: int, world: int, root: str) -> dict:
    """FSDP2 (DTensor parameters and moments) through the same one-call API."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model, opt, sched = _fsdp2_training(0, mesh)
    for _ in range(2):
        _step(model, opt, sched, x)
    saved = {k: v.tolist() for k, v in _full(model).items()}
    first = next(iter(model.parameters()))
    saved_exp_avg = opt.state[first]["exp_avg"].full_tensor().tolist()
    neuron.save_checkpoint(root, "fsdp", model, opt, sched, user_content="fsdp2")
    model2, opt2, sched2 = _fsdp2_training(5, mesh)  # other weights, optimizer without state
    content = neuron.load_checkpoint(root, None, model2, opt2, sched2)
    loaded_equal = all(
        (a == b).all() for a, b in zip(_full(model).values(), _full(model2).values())
    )
    _step(model, opt, sched, x)
    _step(model2, opt2, sched2, x)
    a, b = _full(model), _full(model2)
    # The other way: a replicated plain model's checkpoint into FSDP2.
    torch.manual_seed(7)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=2, gamma=0.5)
    _step(plain, plain_opt, plain_sched, torch.ones(4, 6))  # the same on both ranks
    neuron.save_checkpoint(root, "plain", plain, plain_opt, plain_sched)
    model3, opt3, sched3 = _fsdp2_training(9, mesh)
    neuron.load_checkpoint(root, "plain", model3, opt3, sched3)
    into_fsdp2 = all((v == plain.state_dict()[k].numpy()).all() for k, v in _full(model3).items())
    _step(plain, plain_opt, plain_sched, torch.ones(4, 6))
    _step(model3, opt3, sched3, torch.ones(4, 6))
    after = _full(model3)
    into_fsdp2 = into_fsdp2 and all(
        (after[k] == v.detach().numpy()).all() for k, v in plain.state_dict().items()
    )
    neuron.finalize_checkpoint()
    return {
        "plain_into_fsdp2": bool(into_fsdp2),
        "content": content,
        "loaded_equal": bool(loaded_equal),
        "continues_equal": all((a[k] == b[k]).all() for k in a),
        "saved": saved,
        "saved_exp_avg": saved_exp_avg,
        "moments_are_dtensors": all(
            type(st["exp_avg"]).__name__ == "DTensor" for st in opt2.state.values()
        ),
    }


def _two_ranks(rank: int, world: int, root: str) -> dict:
    """All two-rank scenarios in one spawn (starting ranks costs seconds)."""
    return {
        "manager": _two_rank_manager(rank, world, os.path.join(root, "manager")),
        "neuron": _two_rank_neuron(rank, world, os.path.join(root, "neuron")),
        "fsdp2": _two_rank_fsdp2(rank, world, os.path.join(root, "fsdp2")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("two_ranks")
    return root, run_ranks(_two_ranks, 2, str(root), timeout=110)


@pytest.mark.timeout(120)
def test_two_ranks_async_manager(two_ranks: tuple[Path, list[dict]]) -> None:
    root, out = two_ranks
    for rank, r in enumerate(out):
        r = r["manager"]
        assert r["steps"] == [3, 4, 5] and r["latest"] == 5
        assert r["restored"] == (5, [50.0 + rank] * 8)
        assert r["step3"] == [30.0] * 8 + [31.0] * 8
    assert listing(root / "manager") == ["latest", *(step_name(s) for s in (3, 4, 5))]


@pytest.mark.timeout(120)
def test_two_ranks_neuron_replicated_model(two_ranks: tuple[Path, list[dict]]) -> None:
    root, out = two_ranks
    assert [r["neuron"] for r in out] == [
        {"content": {"r": 2}, "params_equal": True, "exp_avg_equal": True}
    ] * 2
    files = sorted(p.name for p in (root / "neuron" / "step_2" / "data").iterdir())
    assert any(f.startswith("rank-00001") for f in files), files  # the replicas share the writing


# -- object storage -------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_manager_on_s3(s3_url: str) -> None:
    """Same contract on an object store: the pointer is a PUT, deletion uncommits first, and a
    crashed save's remains (written in place there) are recognised by their missing manifest."""
    m = CheckpointManager(s3_url, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, state(step)).result(timeout=60)
    assert m.steps() == [2, 3] and m.latest_step() == 3
    storage = m._dir.storage
    assert storage.read_bytes("latest") == b"step_000000003\n"
    storage.write_bytes("step_000000009/data/rank-00000-00.bin", b"\0" * 10)  # crashed, no manifest
    storage.write_bytes("latest", b"step_000000009\n")
    assert m.latest_step() == 3
    tpl, t = template()
    assert m.restore(tpl)["step"] == 3 and torch.all(t == 3)
    assert m.cleanup() == ["step_000000009"]
    m.save(4, state(4)).result(timeout=60)
    assert m.steps() == [3, 4] and storage.read_bytes("latest") == b"step_000000004\n"
    m.close()


@pytest.mark.timeout(120)
def test_two_ranks_neuron_fsdp2_model(two_ranks: tuple[Path, list[dict]]) -> None:
    """FSDP2 saves and resumes exactly; a plain single-process model and optimizer load the
    same checkpoint (DTensor state resharded to whole tensors), and FSDP2 loads a plain one."""
    root, out = two_ranks
    for r in out:
        r = r["fsdp2"]
        assert r["content"] == "fsdp2" and r["loaded_equal"] and r["continues_equal"]
        assert r["plain_into_fsdp2"]
        assert r["moments_are_dtensors"]
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    assert neuron.load_checkpoint(root / "fsdp2", "fsdp", model, opt) == "fsdp2"
    saved = out[0]["fsdp2"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.tensor(saved["saved"][k])), k
    assert torch.equal(
        opt.state_dict()["state"][0]["exp_avg"], torch.tensor(saved["saved_exp_avg"])
    )
    neuron.finalize_checkpoint()
