"""Leases: who is saving a checkpoint name, valid across hosts and restarts.

A lease is a small JSON file beside the checkpoint (``.<name>.shardsafe-lock``) holding an
owner token (the save's token), the owner's host and process, the time it was last renewed
and how long it stays valid. The coordinator renews it from a background thread while the
save runs; a lease whose renewal is older than its ``ttl`` has expired, whoever wrote it and
wherever. On the writer's own host a lease whose process is gone (same PID namespace) is
expired at once. A lease from another host (or PID namespace) cannot be judged that way: a
save that meets one watches it for up to its ttl, and is refused when it is renewed (a live
save) or breaks it once it expired unrenewed (a save that died with its host), so a restart
after losing the coordinator's host does not fail its first save. A save checks that it
still owns its lease before it commits.

A process id alone does not name a process: ids are reused, and so are PID namespaces' ids
(a namespace made after one that ended may get its number). A lease also records when its
process started (the boot's id and the start time in ``/proc/<pid>/stat``), so a live process
that merely has the same id (a restarted host's new rank) does not keep a dead save's lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import cast

from .errors import CheckpointExistsError
from .location import LOCK_SUFFIX, TMP_MARK
from .storage import Storage

log = logging.getLogger("shardsafe")

LEASE_SECONDS = 60.0
"""How long a lease stays valid without renewal (renewed every quarter of it)."""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """Whether a process of this host (and PID namespace) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> str:
    """``<boot id>/<start time in clock ticks>`` of process ``pid``, or "" where this host
    cannot tell (no ``/proc``): with the pid, it names one process of one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        # the command name (field 2) may hold spaces and parentheses: count after its last ')'
        return f"{boot}/{stat[stat.rindex(')') + 2 :].split()[19]}"
    except (OSError, ValueError, IndexError):
        return ""


@dataclass(frozen=True)
class LeaseInfo:
    """The content of a lease file."""

    owner: str
    host: str
    pid: int
    pid_ns: str
    renewed: float
    ttl: float
    started: str = ""  # :func:`process_start` of ``pid`` ("": written by an earlier version)

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> LeaseInfo | None:
        """The lease in ``raw``, or None when it is not one (torn, foreign, or hand-edited)."""
        try:
            obj = json.loads(raw)
            return cls(
                str(obj["owner"]),
                str(obj["host"]),
                int(obj["pid"]),
                str(obj["pid_ns"]),
                float(obj["renewed"]),
                float(obj["ttl"]),
                str(obj.get("started", "")),
            )
        except (ValueError, KeyError, TypeError):
            pass
        try:  # the lock of earlier versions: "host pid time"
            host, pid, stamp = raw.decode().split()
            return cls("", host, int(pid), "", float(stamp), LEASE_SECONDS)
        except (ValueError, UnicodeDecodeError):
            return None

    def expired(self, now: float | None = None) -> bool:
        """Past its ttl since the last renewal, or its process is gone on this very host (no
        process has its id, or the one that has it started at another time)."""
        now = time.time() if now is None else now
        if now - self.renewed > self.ttl:
            return True
        if not self.on_this_host():
            return False
        if not pid_alive(self.pid):
            return True
        if not self.started:
            return False
        now_started = process_start(self.pid)
        return bool(now_started) and now_started != self.started

    def on_this_host(self) -> bool:
        """Its process is one this host can look up (same host name and PID namespace)."""
        return self.host == socket.gethostname() and (
            not self.pid_ns or self.pid_ns == _pid_namespace()
        )

    def describe(self) -> str:
        age = time.time() - self.renewed
        return f"held by pid {self.pid} on {self.host}, renewed {age:.0f} s ago, valid {self.ttl:.0f} s"


def read_lease(storage: Storage, rel: str) -> LeaseInfo | str | None:
    """The lease at ``rel``; None when absent; a description when something is there that is
    not a lease (a directory, a link, a FIFO, unreadable or foreign bytes).

    Such a thing is never opened through, followed or deleted: it counts as held, and only a
    save that needs the name reports it (see :meth:`Lease.acquire`).
    """
    try:
        raw = storage.read_bytes(rel)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        return "a directory, not a lease file"
    except OSError as e:
        if storage.is_link(rel):
            return "a symbolic link, not a lease file"
        return f"not a readable lease file ({e.strerror or e})"
    info = LeaseInfo.parse(raw)
    return info if info is not None else "not a lease (unrecognised content)"


def lease_state(storage: Storage, rel: str) -> str:
    """``"absent"``, ``"expired"`` or ``"held"``.

    A file there that is not a lease counts as held: leases are replaced whole (rename, PUT),
    so it is no torn lease but something else, and deleting it is the user's call (the error
    of a save that meets it says so).
    """
    info = read_lease(storage, rel)
    if info is None:
        return "absent"
    if isinstance(info, str):
        return "held"
    return "expired" if info.expired() else "held"


def _wait_until_expired(storage: Storage, rel: str, held: LeaseInfo) -> LeaseInfo | str | None:
    """Watch another host's lease until it expires, is renewed, changes hands or goes: what
    is there then (None: gone). Polled a few times per renewal period (a quarter ttl)."""
    wait = max(0.0, held.ttl - (time.time() - held.renewed)) + 0.5
    log.warning(
        "the lease %s is %s; its process cannot be asked from this host: waiting up to %.0f s "
        "for a renewal (a live save: this one is refused) or its expiry (a save that died "
        "with its host: the lease is broken)",
        storage.describe(rel),
        held.describe(),
        wait,
    )
    deadline = time.monotonic() + min(wait, held.ttl + 1.0)
    poll = min(1.0, max(0.05, held.ttl / 16))
    while True:
        current = read_lease(storage, rel)
        if not isinstance(current, LeaseInfo):
            return current
        if current.owner != held.owner or current.renewed != held.renewed or current.expired():
            return current
        if time.monotonic() >= deadline:
            return current
        time.sleep(poll)


class Lease:
    """A lease this process holds; :meth:`start` renews it in the background until :meth:`release`."""

    def __init__(self, storage: Storage, rel: str, owner: str, ttl: float = LEASE_SECONDS) -> None:
        self.storage, self.rel, self.owner, self.ttl = storage, rel, owner, ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()  # one write of the lease at a time
        self.lost: str | None = None  # why renewal failed, if it did

    def _info(self) -> LeaseInfo:
        pid = os.getpid()
        return LeaseInfo(
            self.owner,
            socket.gethostname(),
            pid,
            _pid_namespace(),
            time.time(),
            self.ttl,
            process_start(pid),
        )

    @classmethod
    def acquire(
        cls,
        storage: Storage,
        rel: str,
        owner: str,
        ttl: float = LEASE_SECONDS,
        wait_silent: bool = True,
    ) -> Lease:
        """Take the lease, breaking an expired one; raise :class:`CheckpointExistsError` if held.

        A lease held from another host (or PID namespace), whose process this host cannot
        ask about, is watched instead of refused at once (``wait_silent``): renewed meanwhile,
        its save is alive and this one is refused; left silent until its ttl has passed, it
        was a save that died with its host (a restart after losing the coordinator's host
        meets it at its first save) and is broken. The wait is at most the lease's ttl."""
        lease = cls(storage, rel, owner, ttl)
        if storage.create_exclusive(rel, lease._info().to_bytes()):
            return lease
        current = read_lease(storage, rel)
        silent_elsewhere = (
            wait_silent
            and isinstance(current, LeaseInfo)
            and not current.expired()
            and not current.on_this_host()
        )
        if silent_elsewhere:
            current = _wait_until_expired(storage, rel, cast(LeaseInfo, current))
            if current is None and storage.create_exclusive(rel, lease._info().to_bytes()):
                return lease
            if current is None:
                current = read_lease(storage, rel)
        if isinstance(current, LeaseInfo) and current.expired():
            log.warning(
                "breaking the expired lease %s (%s)", storage.describe(rel), current.describe()
            )
            storage.remove_tree(rel)
            if storage.create_exclusive(rel, lease._info().to_bytes()) and lease.owned():
                return lease
            current = read_lease(storage, rel)
        if isinstance(current, str):
            raise CheckpointExistsError(
                f"{storage.describe(rel)}, the lease name of this save, holds {current}; "
                "shardsafe never deletes or follows it: move or delete it yourself, then retry"
            )
        held = current.describe() if isinstance(current, LeaseInfo) else "released meanwhile"
        raise CheckpointExistsError(
            f"another save holds the lease {storage.describe(rel)} ({held}); wait for it to "
            "finish or to expire (a dead save's lease expires after its ttl) and retry; if you "
            "are sure no save is running, delete that lock file"
        )

    def owned(self) -> bool:
        info = read_lease(self.storage, self.rel)
        return isinstance(info, LeaseInfo) and info.owner == self.owner

    def renew(self) -> None:
        """Rewrite the lease with a new renewal time; raise when another owner took it."""
        with self._guard:
            if self._stop.is_set():
                return
            if not self.owned():
                raise CheckpointExistsError(
                    f"lost the lease {self.storage.describe(self.rel)}: another save took it "
                    "(this save was stalled for longer than the lease's ttl)"
                )
            data = self._info().to_bytes()
            if not self.storage.atomic_rename:
                self.storage.write_bytes(self.rel, data)  # a PUT replaces the object whole
                return
            tmp = self.rel.replace(LOCK_SUFFIX, f"{TMP_MARK}lease-{uuid.uuid4().hex[:12]}")
            self.storage.write_bytes(tmp, data)
            try:
                self.storage.rename(tmp, self.rel)
            except BaseException:
                self.storage.remove_tree(tmp)
                raise

    def check(self) -> None:
        """Before publishing: the lease must still be ours."""
        if self.lost is not None:
            raise CheckpointExistsError(self.lost)
        self.renew()

    def start(self) -> Lease:
        """Renew every quarter ttl from a daemon thread."""

        def loop() -> None:
            while not self._stop.wait(self.ttl / 4):
                try:
                    self.renew()
                except Exception as e:
                    self.lost = f"{e}"
                    log.error("could not renew %s: %s", self.storage.describe(self.rel), e)
                    return

        self._thread = threading.Thread(target=loop, name="shardsafe-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours."""
        with self._guard:
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(OSError):
            if self.owned():
                self.storage.remove_tree(self.rel)
