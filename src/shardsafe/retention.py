"""Retention: once a checkpoint has committed, point at it and delete what the policy drops.

One place for both tiers and every manager: :func:`retain` runs on the one process that
maintains a directory (the manager's coordinator, a local place's leader) after a commit;
:class:`Retention` says which committed checkpoints stay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .directory import CheckpointDirectory, parse_step

log = logging.getLogger("shardsafe")


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep_last`` intact checkpoints (None keeps all), every step divisible
    by ``keep_every``, and always the one just committed. A damaged checkpoint never pushes
    out an intact one; with ``inspect_damaged`` it stays (for inspection) while it is newer
    than the oldest one kept, else it goes (a node-local disk keeps only what restores)."""

    keep_last: int | None = None
    keep_every: int | None = None
    inspect_damaged: bool = True

    def doomed(
        self, directory: CheckpointDirectory, committed: list[str], latest: str
    ) -> list[str]:
        """The committed names to delete now that ``latest`` has committed."""
        if self.keep_last is None:
            return []
        damaged = directory.damaged()
        intact = [n for n in committed if n not in damaged]
        keep = {latest, *intact[-self.keep_last :]}
        if self.inspect_damaged:
            oldest = min(directory.order(n) for n in keep)
            keep |= {n for n in committed if n in damaged and directory.order(n) > oldest}
        if self.keep_every is not None:
            every = self.keep_every
            keep |= {n for n in committed if (parse_step(n) or 0) % every == 0}
        return [n for n in committed if n not in keep]


def retain(
    directory: CheckpointDirectory,
    latest: str,
    doomed: Callable[[list[str]], list[str]],
    active: Callable[[], Collection[str]] = lambda: (),
) -> list[str]:
    """After ``latest`` committed: point the directory at it, clear its damage mark, delete
    the committed names ``doomed(committed)`` returns (a failure to delete one is logged),
    and clean the leftovers of saves not ``active()``. Returns the deleted names; raises
    when the pointer cannot be written."""
    directory.write_pointer(latest)
    directory.unmark(latest)
    deleted = []
    for name in doomed(directory.committed()):
        try:
            directory.remove(name)
            log.info("retention: deleted %s", directory.path(name))
            deleted.append(name)
        except Exception as e:
            log.warning("retention: could not delete %s: %s", directory.path(name), e)
    directory.clean(set(active()) - {latest})
    return deleted
