"""Verified restore with fallback: a newest checkpoint that is corrupt, truncated or missing a
file is marked and the newest older intact one is restored, on every rank, exactly."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from stepstate import StepState

from shardsafe import CheckpointManager, CorruptCheckpointError, neuron
from shardsafe.directory import step_name
from shardsafe.errors import UnsafeObjectError

STATE = StepState(rows=8, cols=4, world=2)


def _save_steps(root: Path, steps: tuple[int, ...] = (1, 2, 3), **kw: Any) -> CheckpointManager:
    manager = CheckpointManager(root, async_save=False, **kw)
    for s in steps:
        manager.save(s, STATE.whole_state(s))
    return manager


def _data_file(root: Path, step: int, key: str = "w") -> tuple[Path, int, int]:
    """(file, byte offset, nbytes) of the first stored piece of ``key`` at ``step``."""
    ckpt = root / step_name(step)
    piece = json.loads((ckpt / "manifest.json").read_text())["tensors"][key]["pieces"][0]
    return ckpt / piece["file"], piece["byte_offset"], piece["nbytes"]


def flip_byte(root: Path, step: int) -> None:
    path, offset, nbytes = _data_file(root, step)
    raw = bytearray(path.read_bytes())
    raw[offset + nbytes // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def truncate(root: Path, step: int) -> None:
    path, offset, _ = _data_file(root, step)
    os.truncate(path, offset + 3)


def delete_file(root: Path, step: int) -> None:
    path, _, _ = _data_file(root, step)
    path.unlink()


@pytest.mark.parametrize("damage", [flip_byte, truncate, delete_file])
def test_restore_falls_back_to_the_newest_intact_step(
    tmp_path: Path, damage: Callable[[Path, int], None], caplog: pytest.LogCaptureFixture
) -> None:
    _save_steps(tmp_path)
    damage(tmp_path, 3)
    manager = CheckpointManager(tmp_path, async_save=False)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        out = manager.restore(STATE.whole_template())
    STATE.assert_holds_step(out, 2)
    assert manager.restored_step == 2
    said = caplog.text
    assert step_name(3) in said and "damaged" in said and f"trying {step_name(2)}" in said
    # marked, not deleted: the files stay for inspection
    assert (tmp_path / step_name(3) / "manifest.json").exists()
    assert step_name(3) in manager._dir.damaged()

    # A mark is a claim, not a verdict: the next restart checks step 3 again, says so, and
    # falls back again, saying which step it used instead of the newest.
    caplog.clear()
    again = CheckpointManager(tmp_path, async_save=False)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        STATE.assert_holds_step(again.restore(STATE.whole_template()), 2)
    said = caplog.text
    assert f"{step_name(3)} is marked damaged" in said and "checking it again" in said
    assert f"restored {step_name(2)} from the persistent tier, not the newest step" in said
    assert again.restored_step == 2 and step_name(3) in again._dir.damaged()


def test_without_fallback_or_with_an_explicit_step_the_error_is_raised(tmp_path: Path) -> None:
    _save_steps(tmp_path)
    flip_byte(tmp_path, 3)
    manager = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        manager.restore(STATE.whole_template(), fallback=False)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        manager.restore(STATE.whole_template(), step=3)
    assert manager._dir.damaged() == {}  # nothing marked when nothing fell back
    STATE.assert_holds_step(manager.restore(STATE.whole_template(), step=2), 2)


def test_every_step_damaged_names_each(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1, 2))
    flip_byte(tmp_path, 2)
    truncate(tmp_path, 1)
    manager = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CorruptCheckpointError) as info:
        manager.restore(STATE.whole_template())
    text = str(info.value)
    assert step_name(1) in text and step_name(2) in text and "shardsafe verify" in text


def test_a_request_that_does_not_fit_is_not_taken_for_damage(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1, 2))
    manager = CheckpointManager(tmp_path, async_save=False)
    template = STATE.whole_template()
    template["w"] = type(template["w"]).from_rank_offsets("w", torch.zeros(3, 3))
    with pytest.raises(Exception, match="shape"):
        manager.restore(template)
    assert manager._dir.damaged() == {}


def test_retention_counts_intact_steps_and_a_new_save_clears_the_mark(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1, 2, 3))
    flip_byte(tmp_path, 3)
    manager = CheckpointManager(tmp_path, async_save=False, keep_last=2)
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 2)
    manager.save(4, STATE.whole_state(4))
    # keep_last=2 keeps 4 and 2 (intact); the damaged 3, newer than 2, stays for inspection
    assert manager.steps() == [2, 3, 4]
    manager.save(5, STATE.whole_state(5))
    assert manager.steps() == [4, 5] and manager._dir.damaged() == {}
    # Saving a step again under a damaged name clears its mark once it commits.
    flip_byte(tmp_path, 5)
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 4)
    manager.save(5, STATE.whole_state(5))
    assert manager._dir.damaged() == {}
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 5)


def test_neuron_load_checkpoint_falls_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {}
    for tag in ("1", "2"):
        with torch.no_grad():
            model.weight.add_(1.0)
        saved[tag] = model.weight.detach().clone()
        neuron.save_checkpoint(tmp_path, tag, model, opt, user_content={"tag": tag})
    neuron.finalize_checkpoint()
    manifest = json.loads((tmp_path / "2" / "manifest.json").read_text())
    piece = manifest["tensors"]["model.weight"]["pieces"][0]
    path = tmp_path / "2" / piece["file"]
    raw = bytearray(path.read_bytes())
    raw[piece["byte_offset"]] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    content = neuron.load_checkpoint(tmp_path, None, fresh, fresh_opt)
    assert content == {"tag": "1"}
    assert torch.equal(fresh.weight, saved["1"])
    with pytest.raises(CorruptCheckpointError):
        neuron.load_checkpoint(tmp_path, "2", fresh, fresh_opt)
    neuron.finalize_checkpoint()


# -- two ranks: the damage is seen by one rank only, both fall back together -------------------
def _two_rank_fallback(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    manager = CheckpointManager(root, async_save=False)
    for s in (1, 2, 3):
        manager.save(s, STATE.rank_state(rank, s))
    if rank == 0:  # damage rank 1's rows of step 3 only
        manifest = json.loads(Path(root, step_name(3), "manifest.json").read_text())
        piece = next(p for p in manifest["tensors"]["w"]["pieces"] if p["offset"][0] > 0)
        path = Path(root, step_name(3), piece["file"])
        raw = bytearray(path.read_bytes())
        raw[piece["byte_offset"] + 5] ^= 0x10
        path.write_bytes(bytes(raw))
    dist.barrier()
    out = manager.restore(STATE.rank_template(rank))
    half = STATE.rows // world
    return {
        "step": manager.restored_step,
        "w": bool(torch.equal(out["w"].data, STATE.full_w(2)[rank * half : (rank + 1) * half])),
        "rng": out["rng"].data,
        "damaged": sorted(manager._dir.damaged()),
    }


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_the_fallback(tmp_path: Path) -> None:
    out = run_ranks(_two_rank_fallback, 2, str(tmp_path), timeout=100)
    for rank, r in enumerate(out):
        assert r["step"] == 2 and r["w"], r
        assert r["rng"] == {"seed": rank, "step": 2}
        assert r["damaged"] == [step_name(3)]


class Config:
    """A class a process must allow before loading it (``add_safe_globals``)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_class_this_process_does_not_allow_is_not_damage(tmp_path: Path) -> None:
    manager = _save_steps(tmp_path, (1,))
    with torch.serialization.safe_globals([Config]):
        manager.save(2, {**STATE.whole_state(2), "cfg": Config(0.5)})
    fresh = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(UnsafeObjectError, match="Config"):
        fresh.restore(STATE.whole_template())
    assert fresh._dir.damaged() == {} and fresh.restored_step is None
    with torch.serialization.safe_globals([Config]):
        out = fresh.restore(STATE.whole_template())
    STATE.assert_holds_step(out, 2)
    assert out["cfg"].lr == 0.5


def _restore_as_nobody(root: str, conn: Any) -> None:
    """Forked child: drop to an unprivileged user (when root) and restore; report the outcome."""
    try:
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        manager = CheckpointManager(root, async_save=False)
        try:
            manager.restore(STATE.whole_template())
            conn.send(("restored", manager.restored_step, manager._dir.damaged()))
        except Exception as e:
            conn.send((type(e).__name__, str(e), manager._dir.damaged()))
    except BaseException as e:  # pragma: no cover - reported to the parent
        conn.send(("crashed", repr(e), {}))
    finally:
        conn.close()
        os._exit(0)


def test_a_file_the_os_will_not_let_us_read_is_not_damage(tmp_path: Path) -> None:
    """EACCES on the newest step: restore raises, names the file, marks nothing, falls back to
    nothing; once the permission is fixed the step restores."""
    root = Path(tempfile.mkdtemp(prefix="shardsafe-eacces-"))
    try:
        os.chmod(root, 0o777)  # the unprivileged child may write (a mark, were it to make one)
        _save_steps(root, (1, 2))
        data, _, _ = _data_file(root, 2)
        os.chmod(data, 0o600)  # owned by us: the child may not read it
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_restore_as_nobody, args=(str(root), child))
        proc.start()
        try:
            assert parent.poll(120), "the restoring child did not answer"
            kind, detail, damaged = parent.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        assert kind == "CheckpointReadError", (kind, detail)
        assert str(data) in detail and "Permission denied" in detail
        assert damaged == {}
        os.chmod(data, 0o644)
        manager = CheckpointManager(root, async_save=False)
        STATE.assert_holds_step(manager.restore(STATE.whole_template()), 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _save_then_die_before_the_pointer(root: str) -> None:
    """Forked child: save step 3, and be killed right after its commit, before ``latest`` moves."""
    manager = CheckpointManager(root, async_save=False)
    manager._dir.write_pointer = lambda name: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    manager.save(3, STATE.whole_state(3))
    os._exit(3)  # not reached


def test_a_step_committed_after_the_pointer_was_written_is_the_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_steps(tmp_path, (1, 2))
    proc = multiprocessing.get_context("fork").Process(
        target=_save_then_die_before_the_pointer, args=(str(tmp_path),)
    )
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    assert (tmp_path / "latest").read_text() == f"{step_name(2)}\n"  # stale
    manager = CheckpointManager(tmp_path, async_save=False)
    assert manager.latest_step() == 3
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        STATE.assert_holds_step(manager.restore(STATE.whole_template()), 3)
    assert manager.restored_step == 3 and "committed after it was written" in caplog.text
    # step 3 damaged: the fallback is step 2, never the pointer's choice first
    flip_byte(tmp_path, 3)
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 2)


def test_a_mark_is_checked_again_and_cleared_when_the_step_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mark left by a failure that is gone (a fixed mount, an older version's verdict) must not
    hide a newer intact step: restore checks it, uses it, clears the mark and says so."""
    manager = _save_steps(tmp_path, (1, 2, 3))
    manager._dir.mark_damaged(step_name(3), "cannot read data/rank-00000-00.bin: [Errno 5] EIO")
    fresh = CheckpointManager(tmp_path, async_save=False)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        STATE.assert_holds_step(fresh.restore(STATE.whole_template()), 3)
    said = caplog.text
    assert f"{step_name(3)} is marked damaged" in said and "Errno 5" in said
    assert "its damage mark is cleared" in said
    assert fresh.restored_step == 3 and fresh._dir.damaged() == {}


def test_restoring_an_older_step_is_said_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_steps(tmp_path, (1, 2))
    manager = CheckpointManager(tmp_path, async_save=False)
    with caplog.at_level(logging.INFO, logger="shardsafe"):
        manager.restore(STATE.whole_template())
    newest = [r for r in caplog.records if "restored" in r.getMessage()]
    assert newest and all(r.levelno == logging.INFO for r in newest)
    caplog.clear()
    truncate(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="shardsafe"):
        manager.restore(STATE.whole_template())
    older = [r for r in caplog.records if "restored" in r.getMessage()]
    assert older and all(r.levelno == logging.WARNING for r in older)
    assert f"restored {step_name(1)} from the persistent tier, not the newest step" in caplog.text


def test_restoring_from_the_slower_tier_is_said_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def open_manager() -> CheckpointManager:
        return CheckpointManager(
            tmp_path / "persistent", local_root=tmp_path / "local", async_save=False
        )

    manager = open_manager()
    manager.save(1, STATE.whole_state(1))
    manager.close()
    shutil.rmtree(tmp_path / "local")  # the host's disk was replaced
    again = open_manager()
    with caplog.at_level(logging.INFO, logger="shardsafe"):
        STATE.assert_holds_step(again.restore(STATE.whole_template()), 1)
    again.close()
    assert again.restored_tier == "persistent"
    said = [r for r in caplog.records if "persistent tier" in r.getMessage()]
    assert said and any(r.levelno == logging.WARNING for r in said), caplog.text
