"""Leases on a checkpoint name: taken exclusively, renewed, expired by time (any host) or at
once when the owner's process on this host is gone, lost when another owner takes over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardsafe.errors import CheckpointExistsError
from shardsafe.lease import Lease, LeaseInfo, lease_state, process_start, read_lease
from shardsafe.storage import storage_for

REL = ".ck.shardsafe-lock"


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write(
    tmp_path: Path, host: str, pid: int, age: float, ttl: float = 60.0, started: str | None = None
) -> None:
    ns = os.readlink("/proc/self/ns/pid") if host == socket.gethostname() else "elsewhere"
    if started is None:
        started = process_start(pid) if host == socket.gethostname() else ""
    info = LeaseInfo("o" * 16, host, pid, ns, time.time() - age, ttl, started)
    (tmp_path / REL).write_bytes(info.to_bytes())


def test_taken_once_renewed_and_released(tmp_path: Path) -> None:
    storage = storage_for(str(tmp_path))
    lease = Lease.acquire(storage, REL, "a" * 16, ttl=60)
    with pytest.raises(CheckpointExistsError, match=rf"held by pid {os.getpid()} on "):
        Lease.acquire(storage, REL, "b" * 16)
    first = read_lease(storage, REL)
    assert isinstance(first, LeaseInfo) and first.owner == "a" * 16
    time.sleep(0.01)
    lease.renew()
    second = read_lease(storage, REL)
    assert isinstance(second, LeaseInfo) and second.renewed > first.renewed
    assert sorted(os.listdir(tmp_path)) == [REL]  # the renewal's temporary file is gone
    lease.release()
    assert lease_state(storage, REL) == "absent"


def test_background_renewal_keeps_a_short_lease_alive(tmp_path: Path) -> None:
    storage = storage_for(str(tmp_path))
    lease = Lease.acquire(storage, REL, "a" * 16, ttl=0.4).start()
    time.sleep(1.2)  # three ttls
    assert lease_state(storage, REL) == "held" and lease.lost is None
    lease.release()
    assert lease_state(storage, REL) == "absent"


@pytest.mark.parametrize(
    ("where", "age", "state"),
    [
        ("this host, process gone", 0.0, "expired"),
        ("this host, process alive", 0.0, "held"),
        ("another host, renewed now", 0.0, "held"),
        ("another host, renewal overdue", 120.0, "expired"),
    ],
)
def test_expiry(tmp_path: Path, where: str, age: float, state: str) -> None:
    host = socket.gethostname() if where.startswith("this") else "elsewhere.example"
    pid = os.getpid() if "alive" in where else dead_pid()
    write(tmp_path, host, pid, age)
    storage = storage_for(str(tmp_path))
    assert lease_state(storage, REL) == state
    if state == "expired":  # broken by the next save
        Lease.acquire(storage, REL, "n" * 16).release()
    else:  # refused at once when not waiting for another host's silent lease to expire
        with pytest.raises(CheckpointExistsError):
            Lease.acquire(storage, REL, "n" * 16, wait_silent=False)


def test_a_reused_process_id_does_not_keep_a_dead_saves_lease(tmp_path: Path) -> None:
    """A host's PID namespace restarted (or ids wrapped): the lease's pid now names a live
    process that is not its writer. It started at another time, so the lease has expired."""
    mine = process_start(os.getpid())
    assert mine, "this test needs /proc"
    boot, ticks = mine.rsplit("/", 1)
    write(tmp_path, socket.gethostname(), os.getpid(), 0.0, started=f"{boot}/{int(ticks) - 1}")
    storage = storage_for(str(tmp_path))
    assert lease_state(storage, REL) == "expired"
    Lease.acquire(storage, REL, "n" * 16, wait_silent=False).release()
    # the writer itself, still running: held
    write(tmp_path, socket.gethostname(), os.getpid(), 0.0)
    assert lease_state(storage, REL) == "held"
    # written by an earlier version (no start time): the pid alone decides, as before
    write(tmp_path, socket.gethostname(), os.getpid(), 0.0, started="")
    assert lease_state(storage, REL) == "held"


def test_another_hosts_silent_lease_is_broken_once_its_ttl_has_passed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a save that died with its host (a restart after losing the coordinator's host)
    write(tmp_path, "elsewhere.example", 1, 0.0, ttl=1.0)
    storage = storage_for(str(tmp_path))
    assert lease_state(storage, REL) == "held"
    with caplog.at_level("WARNING", logger="shardsafe"):
        lease = Lease.acquire(storage, REL, "n" * 16)
    assert "waiting up to" in caplog.text and "elsewhere.example" in caplog.text
    info = read_lease(storage, REL)
    assert isinstance(info, LeaseInfo) and info.owner == "n" * 16
    lease.release()


def test_another_hosts_live_lease_is_refused_when_it_is_renewed(tmp_path: Path) -> None:
    stop = threading.Event()

    def renew() -> None:  # a live save on another host renews every quarter ttl
        while not stop.is_set():
            write(tmp_path, "elsewhere.example", 1, 0.0, ttl=2.0)
            stop.wait(0.5)

    t = threading.Thread(target=renew)
    t.start()
    try:
        storage = storage_for(str(tmp_path))
        with pytest.raises(CheckpointExistsError, match=r"elsewhere\.example"):
            Lease.acquire(storage, REL, "n" * 16)
    finally:
        stop.set()
        t.join()
    info = read_lease(storage, REL)
    assert isinstance(info, LeaseInfo) and info.owner == "o" * 16  # never broken


def test_a_lease_taken_over_is_lost_and_not_released(tmp_path: Path) -> None:
    storage = storage_for(str(tmp_path))
    lease = Lease.acquire(storage, REL, "a" * 16)
    write(tmp_path, "elsewhere.example", 1, 0.0)  # another owner took it (we were stalled)
    with pytest.raises(CheckpointExistsError, match="lost the lease"):
        lease.check()
    lease.release()
    assert json.loads((tmp_path / REL).read_text())["owner"] == "o" * 16


def test_foreign_and_old_lock_files(tmp_path: Path) -> None:
    storage = storage_for(str(tmp_path))
    (tmp_path / REL).write_text("not a lease")
    assert lease_state(storage, REL) == "held"
    with pytest.raises(CheckpointExistsError, match=r"not a lease.*delete it yourself"):
        Lease.acquire(storage, REL, "n" * 16)
    (tmp_path / REL).write_text(f"{socket.gethostname()} {dead_pid()} {time.time():.0f}")
    assert lease_state(storage, REL) == "expired"  # an earlier version's lock of a dead process


def test_a_lease_file_is_never_left_half_written(tmp_path, monkeypatch):
    """A process that dies while writing a lease must leave nothing at the lease's name: an
    empty or partial file there would refuse every later save of that step."""
    import os

    from shardsafe.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))

    def dies(fd):  # the process is killed after creating the file, before its bytes are durable
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", dies)
    with pytest.raises(KeyboardInterrupt):
        storage.create_exclusive(".step_000000002.shardsafe-lock", b'{"owner": "x"}')
    monkeypatch.undo()
    assert not (tmp_path / ".step_000000002.shardsafe-lock").exists()
    assert storage.create_exclusive(".step_000000002.shardsafe-lock", b"one")
    assert not storage.create_exclusive(".step_000000002.shardsafe-lock", b"two")
    assert (tmp_path / ".step_000000002.shardsafe-lock").read_bytes() == b"one"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_000000002.shardsafe-lock"]
