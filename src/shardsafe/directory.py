"""Named checkpoints inside one root: which are committed, which one is the newest (a pointer
file replaced atomically), and the remains of saves that never committed.

The manager (numbered steps) and the NeuronX-style API (tags) both build on this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

from .errors import CheckpointError
from .format import MANIFEST_NAME, Manifest
from .lease import LEASE_SECONDS, lease_state
from .location import DAMAGED_SUFFIX, LOCK_SUFFIX, OLD_MARK, TMP_MARK
from .storage import Storage, is_url, storage_for

log = logging.getLogger("shardsafe")

STEP_PREFIX = "step_"
STEP_DIGITS = 9
_STEP_RE = re.compile(rf"{STEP_PREFIX}(\d{{{STEP_DIGITS},}})")
OVERWRITE_WAIT = 10.0
"""How long a reader waits for an overwrite between its two renames (a few microseconds
unless its writer stalled or died) before reading without that checkpoint."""
_HIDDEN_RE = re.compile(
    rf"\.(?P<base>.+?)(?:(?P<tmp>{re.escape(TMP_MARK)}.+)|(?P<old>{re.escape(OLD_MARK)}.+)|(?P<lock>{re.escape(LOCK_SUFFIX)}))"
)


def step_name(step: int) -> str:
    """``step_000000100``: zero-padded so that lexical order is numeric order."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_NNNNNNNNN`` name, or None for any other name."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


class CheckpointDirectory(ABC):
    """Named checkpoints inside one root: which are committed, the pointer to the newest,
    and the leftovers of saves that never committed.

    A subclass says which names it manages (:meth:`owns`) and how they are ordered
    (:meth:`order`). Works through :class:`~shardsafe.storage.Storage`, so the root may be a
    local directory or an object-store URL.
    """

    def __init__(self, root: str | os.PathLike[str], pointer: str) -> None:
        text = os.fspath(root)
        if not text:
            raise CheckpointError("the checkpoint root is empty")
        self.url = text.rstrip("/") if is_url(text) else os.path.abspath(text)
        self.storage: Storage = storage_for(self.url)
        self.pointer = pointer

    # -- naming (what a subclass decides) ---------------------------------------------------
    @abstractmethod
    def owns(self, name: str) -> bool:
        """True for the names of checkpoints this directory manages."""

    @abstractmethod
    def order(self, name: str) -> Any:
        """Sort key of an owned name; the last is the newest."""

    def claims_uncommitted(self, name: str) -> bool:
        """True when an owned, uncommitted directory ``name`` can only be a save's remains."""
        return self.owns(name)

    # -- reading ----------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """The checkpoint path to hand to ``save``/``load``."""
        return f"{self.url}/{name}" if is_url(self.url) else os.path.join(self.url, name)

    def is_committed(self, name: str) -> bool:
        return self.storage.exists(f"{name}/{MANIFEST_NAME}")

    def committed(self) -> list[str]:
        """Every committed checkpoint, oldest first."""
        names = [n for n in self.storage.list_dir("") if self.owns(n) and self.is_committed(n)]
        return sorted(names, key=self.order)

    def read_pointer(self) -> str | None:
        """The name in the pointer file, or None when it is absent or unreadable."""
        try:
            raw = self.storage.read_bytes(self.pointer)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            log.warning("cannot read %s: %s", self.storage.describe(self.pointer), e)
            return None
        name = raw.decode("utf-8", "replace").strip()
        return name if name and "/" not in name and self.owns(name) else None

    def latest(self) -> str | None:
        """The pointer's checkpoint if it is committed, else the newest committed one."""
        name = self.read_pointer()
        if name is not None and self.is_committed(name):
            return name
        committed = self.committed()
        if name is not None:
            log.warning(
                "%s names %s, which is not a committed checkpoint; using %s",
                self.storage.describe(self.pointer),
                name,
                committed[-1] if committed else "nothing",
            )
        return committed[-1] if committed else None

    # -- writing (coordinator only) ------------------------------------------------------------
    def write_pointer(self, name: str) -> None:
        """Point at ``name``: write a temporary file, fsync, rename over the pointer, fsync the directory.

        Readers see the old or the new pointer, never a torn one. Object stores replace an
        object atomically on PUT, so there the pointer is written in place.
        """
        data = f"{name}\n".encode()
        if not self.storage.atomic_rename:
            self.storage.write_bytes(self.pointer, data)
            return
        tmp = f".{self.pointer}{TMP_MARK}{uuid.uuid4().hex[:16]}"
        self.storage.write_bytes(tmp, data)
        try:
            self.storage.rename(tmp, self.pointer)
        except BaseException:
            self.storage.remove_tree(tmp)
            raise
        self.storage.sync_dir("")

    # -- damage marks ---------------------------------------------------------------------
    def damage_mark(self, name: str) -> str:
        return f".{name}{DAMAGED_SUFFIX}"

    def mark_damaged(self, name: str, reason: str) -> None:
        """Record that committed checkpoint ``name`` failed to load (kept, not deleted, so it
        can be inspected; restores try it only after every unmarked one)."""
        record = {"checkpoint": name, "reason": reason[:4000], "time": time.time()}
        self.storage.write_bytes(self.damage_mark(name), json.dumps(record).encode())

    def damaged(self) -> dict[str, str]:
        """Marked checkpoints and the reason recorded for each."""
        out: dict[str, str] = {}
        for entry in self.storage.list_dir(""):
            if not (entry.startswith(".") and entry.endswith(DAMAGED_SUFFIX)):
                continue
            name = entry[1 : -len(DAMAGED_SUFFIX)]
            try:
                reason = str(json.loads(self.storage.read_bytes(entry))["reason"])
            except Exception:
                reason = "(unreadable mark)"
            out[name] = reason
        return out

    def unmark(self, name: str) -> None:
        """Forget a damage mark (a new save of ``name`` committed)."""
        if self.storage.exists(self.damage_mark(name)):
            self.storage.remove_tree(self.damage_mark(name))

    def restore_order(self) -> list[str]:
        """Committed checkpoints in the order a restore tries them: :meth:`latest`, then older
        ones newest first, then any newer ones. A damage mark does not move a checkpoint: it
        is a claim that the restore checks again (a mark is no verdict; the cause may have been
        fixed), so a marked newer step is never hidden behind an older one."""
        self.settle_overwrites()
        committed = self.committed()
        first = self.latest()
        if first is None:
            return []
        older = [
            n for n in reversed(committed) if n != first and self.order(n) <= self.order(first)
        ]
        newer = [n for n in reversed(committed) if n != first and n not in older]
        return [first, *older, *newer]

    def in_flight_overwrites(self) -> list[str]:
        """Names moved aside by an overwrite that cannot exchange (two renames): the name is
        empty while ``.<name>.shardsafe-old-*`` holds the complete old checkpoint."""
        out = []
        for entry in self.storage.list_dir(""):
            m = _HIDDEN_RE.fullmatch(entry)
            if m is None or not m.group("old"):
                continue
            base = m.group("base")
            if self.owns(base) and not self.is_committed(base) and self.is_committed(entry):
                out.append(base)
        return out

    def settle_overwrites(self, wait: float = OVERWRITE_WAIT) -> None:
        """Wait (at most ``wait`` seconds) for overwrites between their two renames to finish,
        so that a reader sees the old or the new checkpoint, never neither. Past the wait the
        writer is taken for dead (its clean-up puts a checkpoint back, :meth:`recover`)."""
        if not self.storage.atomic_rename:
            return
        deadline = time.monotonic() + wait
        while True:
            pending = self.in_flight_overwrites()
            if not pending:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "%s: an overwrite of %s has been between its two renames for %.0f s; "
                    "reading without it",
                    self.url,
                    ", ".join(pending),
                    wait,
                )
                return
            time.sleep(0.01)

    def fingerprint(self, name: str) -> str | None:
        """What identifies the checkpoint now at ``name`` (a digest of its manifest), None when
        nothing is committed there: a restore compares it before and after a failed load to
        tell a checkpoint replaced while it was read from a damaged one."""
        self.settle_overwrites()
        try:
            raw = self.storage.read_bytes(f"{name}/{MANIFEST_NAME}")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            return f"unreadable: {e}"
        return hashlib.sha256(raw).hexdigest()

    def remove(self, name: str) -> None:
        """Delete a checkpoint, uncommitting it first (its manifest goes before its data), so an
        interrupted deletion leaves only a recognisable leftover, never a torn checkpoint.

        A name that is a symbolic link (a checkpoint linked in from elsewhere, to start from
        it) loses the link only: nothing is ever deleted through a link."""
        self.unmark(name)
        if self.storage.is_link(name):
            self.storage.remove_tree(name)  # removes the link, not its target
            return
        self.storage.remove_tree(f"{name}/{MANIFEST_NAME}")
        self.storage.remove_tree(name)

    # -- leftovers --------------------------------------------------------------------------
    def lease_state(self, name: str) -> str:
        """``"absent"``, ``"expired"`` or ``"held"``: the lease of a save into ``name``.

        A save in flight renews its lease; one whose owner died stops renewing, and its lease
        expires after its ttl wherever it was written (at once on the owner's own host when the
        process is gone). Only then are its remains touched.
        """
        return lease_state(self.storage, f".{name}{LOCK_SUFFIX}")

    def _hidden(self, active: Collection[str]) -> list[tuple[str, str, str]]:
        """(entry, base name, kind) of hidden entries of owned names not protected by a lease."""
        out = []
        for entry in self.storage.list_dir(""):
            m = _HIDDEN_RE.fullmatch(entry)
            if m is None:
                continue
            base = m.group("base")
            kind = "tmp" if m.group("tmp") else "old" if m.group("old") else "lock"
            if base == self.pointer and kind == "tmp":
                if self._abandoned(entry):
                    out.append((entry, base, "pointer"))
            elif self.owns(base) and base not in active and self.lease_state(base) != "held":
                out.append((entry, base, kind))
        return out

    def _abandoned(self, entry: str) -> bool:
        """A temporary pointer file is an update in flight (another process's, maybe) until it is
        older than a lease's ttl; only then is it a crashed update's leftover."""
        written = self.storage.modified(entry)
        return written is not None and time.time() - written > LEASE_SECONDS

    def recover(self, active: Collection[str] = ()) -> list[str]:
        """Put back a checkpoint whose name is empty while a complete copy lies beside it.

        That happens only when a save replacing a checkpoint died between moving the old one
        aside and moving the new one in (on file systems that cannot swap two directories in
        one step): both are complete, and the new one takes the name. Returns the names restored.
        """
        if not self.storage.atomic_rename:
            return []
        restored = []
        candidates = sorted(
            (kind != "tmp", entry, base)
            for entry, base, kind in self._hidden(active)
            if kind in ("tmp", "old") and self.is_committed(entry)
        )
        for _, entry, base in candidates:
            if base in restored or self.is_committed(base):
                continue
            if self.storage.exists(base):
                if not self.claims_uncommitted(base):
                    continue
                self.storage.remove_tree(base)  # the remains of an interrupted deletion
            self.storage.rename(entry, base)
            self.storage.sync_dir("")
            log.warning(
                "restored %s from %s (a save replacing it was interrupted)",
                self.storage.describe(base),
                entry,
            )
            restored.append(base)
        return restored

    def leftovers(self, active: Collection[str] = ()) -> list[str]:
        """Entries left by saves that never committed, skipping the names in ``active``
        (saves in flight from this process) and anything a live lease protects:

        * ``.<name>.shardsafe-tmp-*`` work directories and ``.<name>.shardsafe-old-*``
          directories of an interrupted overwrite, once ``<name>`` holds a complete checkpoint
          (a complete one beside an empty name is restored by :meth:`recover` instead);
        * expired ``.<name>.shardsafe-lock`` leases;
        * owned directories without a manifest (see :meth:`claims_uncommitted`);
        * temporary files of an interrupted pointer update, once older than a lease's ttl
          (until then they may be another process's update in flight).

        Nothing that holds a complete manifest is listed unless the same name holds one too.
        """
        found: list[str] = []
        locks: list[str] = []
        for entry, base, kind in self._hidden(active):
            if kind == "lock":
                locks.append(entry)
            elif kind == "pointer" or not self.is_committed(entry) or self.is_committed(base):
                found.append(entry)
        for entry in self.storage.list_dir(""):
            if (
                self.owns(entry)
                and entry not in active
                and self.claims_uncommitted(entry)
                and not self.is_committed(entry)
                and self.lease_state(entry) != "held"
            ):
                found.append(entry)
        return found + locks  # leases last: they guard the directories until those are gone

    def clean(self, active: Collection[str] = ()) -> list[str]:
        """Restore interrupted overwrites (:meth:`recover`), then remove :meth:`leftovers`;
        returns what was removed."""
        try:
            self.recover(active)
        except OSError as e:
            log.warning("could not restore an interrupted overwrite in %s: %s", self.url, e)
        removed = []
        for entry in self.leftovers(active):
            try:
                if entry.endswith(LOCK_SUFFIX) and not self.storage.atomic_rename:
                    self._drop_replaced_files(entry[1 : -len(LOCK_SUFFIX)])
                self.storage.remove_tree(entry)
            except Exception as e:
                log.warning("could not remove %s: %s", self.storage.describe(entry), e)
                continue
            log.info(
                "removed %s (left by a save that never committed)", self.storage.describe(entry)
            )
            removed.append(entry)
        return removed

    def _drop_replaced_files(self, name: str) -> None:
        """Object stores: a save that died after its manifest PUT may leave the files of the
        checkpoint it replaced, or its own unpublished files, beside the committed ones."""
        if not self.is_committed(name):
            return
        manifest = Manifest.loads(self.storage.read_bytes(f"{name}/{MANIFEST_NAME}"))
        for entry in self.storage.list_dir(f"{name}/data"):
            if f"data/{entry}" not in manifest.files:
                self.storage.remove_tree(f"{name}/data/{entry}")


class StepDirectory(CheckpointDirectory):
    """``step_NNNNNNNNN`` checkpoints ordered by step, with the pointer ``latest``.

    The pointer is trusted only when it was written after every newer committed step: a run
    resumed from an older step moves the pointer to its next save although higher steps of the
    abandoned run remain (it must not jump back to them), whereas a save that committed and
    died before moving the pointer leaves a newer step committed *after* the pointer was
    written: that step is the latest. When the storage cannot say when files were written,
    the newest committed step wins.
    """

    def __init__(self, root: str | os.PathLike[str], pointer: str = "latest") -> None:
        super().__init__(root, pointer)

    def latest(self) -> str | None:
        committed = self.committed()
        if not committed:
            return None
        pointed = self.read_pointer()
        if pointed is None or pointed not in committed:
            return super().latest()
        newer = [n for n in committed if self.order(n) > self.order(pointed)]
        if not newer:
            return pointed
        written = self.storage.modified(self.pointer)
        after = [
            n
            for n in newer
            if written is None
            or (committed_at := self.storage.modified(f"{n}/{MANIFEST_NAME}")) is None
            or committed_at >= written
        ]
        if not after:
            return pointed  # moved back on purpose, after those steps committed
        log.warning(
            "%s names %s, but %s committed after it was written (a save that died before "
            "moving the pointer?); using %s",
            self.storage.describe(self.pointer),
            pointed,
            after[-1],
            after[-1],
        )
        return after[-1]

    def owns(self, name: str) -> bool:
        return parse_step(name) is not None

    def order(self, name: str) -> Any:
        return parse_step(name)
