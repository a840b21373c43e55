"""What a checkpoint root may hold besides the manager's own checkpoints, and who else may
use it: links to checkpoints elsewhere, odd files at reserved names, a second process."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from stepstate import StepState

from shardsafe import CheckpointError, CheckpointManager, loading
from shardsafe.directory import step_name
from shardsafe.lease import LEASE_SECONDS, lease_state
from shardsafe.saver import Saver
from shardsafe.storage.local import LocalStorage

STATE = StepState(rows=8, cols=4, world=2)


def _manager(root: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(root, async_save=False, **kw)


def test_retention_removes_a_linked_step_but_never_what_it_links_to(tmp_path: Path) -> None:
    elsewhere = tmp_path / "pretrained"
    _manager(elsewhere).save(0, STATE.whole_state(0))
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / step_name(0), root / step_name(0))  # start from it
    manager = _manager(root, keep_last=1)
    STATE.assert_holds_step(manager.restore(STATE.whole_template()), 0)
    for step in (1, 2):
        manager.save(step, STATE.whole_state(step))
    assert manager.steps() == [2]
    assert not os.path.lexists(root / step_name(0))  # the link went
    # what it linked to is untouched
    assert (elsewhere / step_name(0) / "manifest.json").exists()
    STATE.assert_holds_step(_manager(elsewhere).restore(STATE.whole_template()), 0)


def test_remove_of_a_linked_step_removes_the_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other"
    _manager(elsewhere).save(5, STATE.whole_state(5))
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / step_name(5), root / step_name(5))
    manager = _manager(root)
    manager._dir.remove(step_name(5))
    assert not os.path.lexists(root / step_name(5))
    assert sorted(os.listdir(elsewhere / step_name(5))) == ["data", "manifest.json"]


def _odd_lease(root: Path, step: int, kind: str) -> Path:
    """Something that is not a lease at the lease name of ``step``."""
    lock = root / f".{step_name(step)}.shardsafe-lock"
    if kind == "directory":
        lock.mkdir()
        (lock / "notes.txt").write_text("mine")
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "symlink":
        target = root.parent / "target.txt"
        target.write_text("keep me")
        os.symlink(target, lock)
    else:
        os.symlink(root.parent / "nowhere", lock)
    return lock


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "dangling"])
def test_an_odd_file_at_a_lease_name_counts_as_held(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    lock = _odd_lease(root, 3, kind)
    before = os.lstat(lock)
    manager = _manager(root)  # opening the root runs the clean-up: it must neither fail nor delete
    manager.save(2, STATE.whole_state(2))
    assert os.lstat(lock).st_ino == before.st_ino
    if kind == "directory":
        assert (lock / "notes.txt").read_text() == "mine"
    if kind == "symlink":
        assert (tmp_path / "target.txt").read_text() == "keep me"
    # only a save that needs the name says so, naming the path
    with pytest.raises(CheckpointError, match=str(lock)):
        manager.save(3, STATE.whole_state(3))
    assert os.lstat(lock).st_ino == before.st_ino
    assert manager.steps() == [1, 2]


SAVES = 60


def _trainer(root: str, conn: Any) -> None:
    """Forked child: save steps 1..SAVES synchronously; report every error."""
    errors = []
    try:
        manager = _manager(Path(root))
        for step in range(1, SAVES + 1):
            try:
                manager.save(step, STATE.whole_state(step))
            except Exception as e:
                errors.append(f"step {step}: {type(e).__name__}: {e}")
        manager.close()
    except BaseException as e:
        errors.append(f"crashed: {e!r}")
    finally:
        conn.send(errors)
        conn.close()
        os._exit(0)


def _poller(root: str, read_only: bool, stop: Any, conn: Any) -> None:
    """Forked child: open the root again and again while the trainer saves (an eval poller)."""
    opened = 0
    problems = []
    try:
        while not stop.is_set():
            try:
                manager = CheckpointManager(root, async_save=False, read_only=read_only)
                manager.steps()
                opened += 1
            except Exception as e:
                problems.append(f"{type(e).__name__}: {e}")
    finally:
        conn.send((opened, problems))
        conn.close()
        os._exit(0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("read_only", [False, True])
def test_a_second_process_opening_the_root_never_breaks_the_trainer(
    tmp_path: Path, read_only: bool
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    t_parent, t_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    poller = ctx.Process(target=_poller, args=(str(root), read_only, stop, p_child))
    trainer = ctx.Process(target=_trainer, args=(str(root), t_child))
    poller.start()
    trainer.start()
    try:
        assert t_parent.poll(500), "the trainer did not finish"
        errors = t_parent.recv()
        stop.set()
        assert p_parent.poll(60), "the poller did not stop"
        opened, problems = p_parent.recv()
    finally:
        stop.set()
        for proc in (trainer, poller):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert errors == [], errors[:3]
    assert problems == [], problems[:3]
    assert opened > 0
    assert (root / "latest").read_text() == f"{step_name(SAVES)}\n"
    assert _manager(root).steps() == list(range(1, SAVES + 1))


def test_a_read_only_manager_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    leftover = root / ".step_000000002.shardsafe-tmp-0123456789abcdef"
    leftover.mkdir()
    before = sorted(os.listdir(root))
    reader = CheckpointManager(root, async_save=False, read_only=True)
    (root / step_name(1) / "data" / "rank-00000-00.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        reader.restore(STATE.whole_template())
    with pytest.raises(CheckpointError, match="read_only"):
        reader.save(2, STATE.whole_state(2))
    with pytest.raises(CheckpointError, match="read_only"):
        reader.cleanup()
    assert sorted(os.listdir(root)) == before  # no clean-up, no mark
    with pytest.raises(ValueError, match="local_root"):
        CheckpointManager(root, read_only=True, local_root=tmp_path / "local")


def test_a_pointer_update_in_flight_is_left_alone_and_an_abandoned_one_removed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    fresh = root / ".latest.shardsafe-tmp-00000000000000aa"
    stale = root / ".latest.shardsafe-tmp-00000000000000bb"
    for f in (fresh, stale):
        f.write_text(f"{step_name(1)}\n")
    old = time.time() - 2 * LEASE_SECONDS
    os.utime(stale, (old, old))
    _manager(root)  # the clean-up on open
    assert fresh.exists() and not stale.exists()


def _wait_stopped(pid: int, seconds: float = 120.0) -> None:
    """Until process ``pid`` is stopped (state T in /proc), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _stalled_overwrite(root: str) -> None:
    """Forked child: overwrite step 2 without RENAME_EXCHANGE, stopping itself (SIGSTOP) between
    the two renames, as a preempted or paused writer does."""
    rename = LocalStorage.rename

    def stalling(self: LocalStorage, src: str, dst: str) -> None:
        rename(self, src, dst)
        if ".shardsafe-old-" in dst:
            os.kill(os.getpid(), signal.SIGSTOP)

    LocalStorage.exchange = lambda self, a, b: False  # type: ignore[method-assign]
    LocalStorage.rename = stalling  # type: ignore[method-assign]
    try:
        _manager(Path(root)).save(2, STATE.whole_state(7))
    finally:
        os._exit(0)


@pytest.mark.timeout(300)
def test_a_restore_between_the_two_renames_of_an_overwrite_reads_the_new_step(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        _manager(root).save(step, STATE.whole_state(step))
    reader = _manager(root)
    proc = multiprocessing.get_context("fork").Process(target=_stalled_overwrite, args=(str(root),))
    proc.start()
    try:
        _wait_stopped(proc.pid)
        assert not (root / step_name(2)).exists()  # the window: the name is empty
        resume = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGCONT))
        resume.start()
        out = reader.restore(STATE.whole_template())
        resume.join()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert reader.restored_step == 2
    STATE.assert_holds_step(out, 7)  # the new checkpoint of step 2
    assert reader._dir.damaged() == {}


def _stalled_restore(root: str, conn: Any) -> None:
    """Forked child: restore, stopping itself (SIGSTOP) right after reading the manifest."""
    real = loading.read_manifest
    stopped = []

    def stalling(path: Any) -> Any:
        out = real(path)
        if not stopped:
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return out

    loading.read_manifest = stalling  # type: ignore[assignment]
    try:
        manager = _manager(Path(root))
        out = manager.restore(STATE.whole_template())
        STATE.assert_holds_step(out, 7)
        conn.send((manager.restored_step, manager._dir.damaged()))
    except BaseException as e:
        conn.send((repr(e), None))
    finally:
        conn.close()
        os._exit(0)


@pytest.mark.timeout(300)
def test_a_step_exchanged_while_it_is_read_is_read_again(tmp_path: Path) -> None:
    """With RENAME_EXCHANGE the name is never empty, but a reader that read the old manifest
    meets the new data files: that is no damage; the step is read again."""
    root = tmp_path / "run"
    writer = _manager(root)
    for step in (1, 2):
        writer.save(step, STATE.whole_state(step))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stalled_restore, args=(str(root), child))
    proc.start()
    try:
        _wait_stopped(proc.pid)
        writer.save(2, STATE.whole_state(7))  # replaces step 2 under the stopped reader
        os.kill(proc.pid, signal.SIGCONT)
        assert parent.poll(120), "the restoring process did not answer"
        restored, damaged = parent.recv()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert (restored, damaged) == (2, {})


def _frozen_publisher(root: str) -> None:
    """Forked child: save step 2 with a 1 s lease and stop itself (SIGSTOP) between its last
    lease check and the exchange that publishes: a stalled process, a paused VM."""
    exchange = LocalStorage.exchange

    def stalling(self: LocalStorage, a: str, b: str) -> bool:
        os.kill(os.getpid(), signal.SIGSTOP)
        return exchange(self, a, b)

    LocalStorage.exchange = stalling  # type: ignore[method-assign]
    try:
        _manager(Path(root), lease_ttl=1.0).save(2, STATE.whole_state(5))
    finally:
        os._exit(0)


@pytest.mark.timeout(300)
def test_a_frozen_lease_holder_never_publishes_over_the_save_that_took_its_lease(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    _manager(root).save(2, STATE.whole_state(2))
    proc = multiprocessing.get_context("fork").Process(target=_frozen_publisher, args=(str(root),))
    proc.start()
    done: list[Any] = []
    try:
        _wait_stopped(proc.pid)
        lock = f".{step_name(2)}.shardsafe-lock"
        storage = LocalStorage(str(root))
        deadline = time.monotonic() + 60
        while lease_state(storage, lock) != "expired":  # the frozen save's lease runs out
            assert time.monotonic() < deadline, "the frozen save's lease never expired"
            time.sleep(0.05)
        works = set(root.glob(f".{step_name(2)}.shardsafe-tmp-*"))

        def second_save() -> None:
            """A save that runs no clean-up (a plain ``Saver``): the frozen save's work
            directory stays, as it does when the second job opened its manager earlier."""
            try:
                saver = Saver(lease_ttl=60.0)
                try:
                    path = root / step_name(2)
                    done.append(saver.save(STATE.whole_state(7), path, overwrite=True))
                finally:
                    saver.close()
            except BaseException as e:
                done.append(e)

        saver = threading.Thread(target=second_save)
        saver.start()
        # let the second save get as far as it can: its manifest written, at its publish
        while not done and not any(
            (w / "manifest.json").exists()
            for w in set(root.glob(f".{step_name(2)}.shardsafe-tmp-*")) - works
        ):
            assert time.monotonic() < deadline + 60, "the second save made no progress"
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGCONT)
        saver.join(120)
        proc.join(120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert done and not isinstance(done[0], BaseException), done
    # the second save reported success: its checkpoint is the one at the name
    reader = _manager(root)
    STATE.assert_holds_step(reader.restore(STATE.whole_template(), step=2), 7)
    assert reader.steps() == [2]


def test_a_publish_fence_held_past_the_lease_ttl_fails_the_save_cleanly(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _manager(root).save(1, STATE.whole_state(1))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a process stopped inside its publish holds it
        saver = Saver(lease_ttl=1.0)
        try:
            with pytest.raises(CheckpointError, match=r"publishing.*nothing was committed"):
                saver.save(STATE.whole_state(2), root / step_name(2))
        finally:
            saver.close()
    finally:
        os.close(fd)
    assert sorted(os.listdir(root)) == ["latest", step_name(1)]  # no work dir, no lease
