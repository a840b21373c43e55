"""Named checkpoints inside one root: which are committed, which one is the newest (a pointer
file replaced atomically), and the remains of saves that never committed.

The manager (numbered steps) and the NeuronX-style API (tags) both build on this.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

from .errors import CheckpointError
from .format import MANIFEST_NAME
from .location import DAMAGED_SUFFIX, LOCK_SUFFIX, OLD_MARK, TMP_MARK
from .saving import pid_alive
from .storage import Storage, is_url, storage_for

log = logging.getLogger("shardsafe")

STEP_PREFIX = "step_"
STEP_DIGITS = 9
_STEP_RE = re.compile(rf"{STEP_PREFIX}(\d{{{STEP_DIGITS},}})")
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
        """Committed checkpoints in the order a restore tries them: the pointer's (or the
        newest), then older ones newest first; marked ones after every unmarked one."""
        committed = self.committed()
        first = self.latest()
        if first is None:
            return []
        older = [
            n for n in reversed(committed) if n != first and self.order(n) <= self.order(first)
        ]
        newer = [n for n in reversed(committed) if n != first and n not in older]
        ordered = [first, *older, *newer]
        marked = self.damaged()
        return [n for n in ordered if n not in marked] + [n for n in ordered if n in marked]

    def remove(self, name: str) -> None:
        """Delete a checkpoint, uncommitting it first so that an interrupted deletion never
        leaves something that looks committed (only a recognisable leftover)."""
        self.unmark(name)
        if self.storage.atomic_rename:
            trash = f".{name}{OLD_MARK}{uuid.uuid4().hex[:16]}"
            try:
                self.storage.rename(name, trash)
            except FileNotFoundError:
                return
            self.storage.sync_dir("")
            self.storage.remove_tree(trash)
        else:
            self.storage.remove_tree(f"{name}/{MANIFEST_NAME}")
            self.storage.remove_tree(name)

    # -- leftovers --------------------------------------------------------------------------
    def lock_state(self, name: str) -> str:
        """``"absent"``, ``"stale"`` (its process on this host is dead) or ``"alive"``.

        A lock from another host, or one that cannot be parsed, counts as alive: its owner
        cannot be checked from here, and deleting a running save's files would be worse than
        keeping a leftover.
        """
        try:
            raw = self.storage.read_bytes(f".{name}{LOCK_SUFFIX}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return "absent"
        try:
            host, pid, _ = raw.decode().split()
            alive = host != socket.gethostname() or pid_alive(int(pid))
        except ValueError:
            return "alive"
        return "alive" if alive else "stale"

    def leftovers(self, active: Collection[str] = ()) -> list[str]:
        """Entries left by saves that never committed, skipping the names in ``active``
        (saves in flight from this process) and anything a live lock protects:

        * ``.<name>.shardsafe-tmp-*`` work directories and ``.<name>.shardsafe-old-*``
          directories of an interrupted overwrite or deletion;
        * ``.<name>.shardsafe-lock`` files of processes that died on this host;
        * owned directories without a manifest (see :meth:`claims_uncommitted`);
        * temporary files of an interrupted pointer update.
        """
        found: list[str] = []
        locks: list[str] = []
        for entry in self.storage.list_dir(""):
            m = _HIDDEN_RE.fullmatch(entry)
            if m is not None:
                base = m.group("base")
                if base == self.pointer and m.group("tmp"):
                    found.append(entry)
                    continue
                if not self.owns(base) or base in active:
                    continue
                state = self.lock_state(base)
                if m.group("lock"):
                    if state == "stale":
                        locks.append(entry)
                elif state != "alive":
                    found.append(entry)
            elif (
                self.owns(entry)
                and entry not in active
                and self.claims_uncommitted(entry)
                and not self.is_committed(entry)
                and self.lock_state(entry) != "alive"
            ):
                found.append(entry)
        return found + locks  # locks last: they guard the directories until those are gone

    def clean(self, active: Collection[str] = ()) -> list[str]:
        """Remove :meth:`leftovers`; returns what was removed."""
        removed = []
        for entry in self.leftovers(active):
            try:
                self.storage.remove_tree(entry)
            except Exception as e:
                log.warning("could not remove %s: %s", self.storage.describe(entry), e)
                continue
            log.info(
                "removed %s (left by a save that never committed)", self.storage.describe(entry)
            )
            removed.append(entry)
        return removed


class StepDirectory(CheckpointDirectory):
    """``step_NNNNNNNNN`` checkpoints ordered by step, with the pointer ``latest``."""

    def __init__(self, root: str | os.PathLike[str], pointer: str = "latest") -> None:
        super().__init__(root, pointer)

    def owns(self, name: str) -> bool:
        return parse_step(name) is not None

    def order(self, name: str) -> Any:
        return parse_step(name)
