"""Who keeps copies of whose local-tier files, and where a restore fetches a file from.

Pure functions over ranks, hosts and file lists: no I/O, no process group. A *place* is one
node-local directory as seen by the ranks that share it (same host id and same local root);
ranks of one place see the same files, ranks of different places see none of each other's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CorruptCheckpointError
from .format import MANIFEST_NAME, MAX_INT, check_file_name

Place = tuple[str, str]
"""(host id, local root): the ranks that give the same pair share a directory."""


def hosts_in_order(hosts: Sequence[str]) -> list[str]:
    """Distinct host ids in order of their first rank."""
    return list(dict.fromkeys(hosts))


def replica_peers(hosts: Sequence[str], replicas: int) -> list[list[int]]:
    """For every rank, the ranks on ``replicas`` *other* hosts that keep a copy of its files.

    The i-th rank of host h sends to the (i mod n)-th rank of hosts h+1 … h+replicas (in
    order of first appearance, wrapping around), so every host receives about as many copies
    as it sends and losing any ``replicas`` hosts loses no file.
    """
    order = hosts_in_order(hosts)
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    if replicas > len(order) - 1:
        raise ValueError(
            f"replicas={replicas} needs at least {replicas + 1} hosts, but the ranks run on "
            f"{len(order)} ({', '.join(order)}); copies on the same host do not survive losing it: "
            "pass replicas=0, or give each group of ranks its own node_id"
        )
    ranks_of: dict[str, list[int]] = {h: [] for h in order}
    for rank, host in enumerate(hosts):
        ranks_of[host].append(rank)
    out: list[list[int]] = []
    for rank, host in enumerate(hosts):
        h = order.index(host)
        i = ranks_of[host].index(rank)
        targets = []
        for k in range(1, replicas + 1):
            other = ranks_of[order[(h + k) % len(order)]]
            targets.append(other[i % len(other)])
        out.append(targets)
    return out


def place_ranks(places: Sequence[Place]) -> dict[Place, list[int]]:
    """The ranks of every place, ascending; the first is the place's leader."""
    out: dict[Place, list[int]] = {}
    for rank, place in enumerate(places):
        out.setdefault(place, []).append(rank)
    return out


def check_offered(name: Any, sender: str) -> str:
    """Refuse a file name that came from another rank unless it is ``manifest.json`` or a
    name a manifest may hold (:func:`shardsafe.format.check_file_name`): such names become
    paths under a local root, and ``data/../../x`` would be written outside it."""
    if name == MANIFEST_NAME:
        return name
    try:
        return check_file_name(name)
    except CorruptCheckpointError:
        raise CorruptCheckpointError(
            f"{sender} named the file {str(name)[:100]!r}, which is not a checkpoint file name "
            f"(must be {MANIFEST_NAME!r} or look like 'data/rank-00000-00.bin'); refusing it: "
            "that rank runs different code or its memory is corrupt"
        ) from None


def check_offered_size(size: Any, name: str, sender: str) -> int:
    """Refuse a file size from another rank that is not an int in ``[0, MAX_INT)``."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < MAX_INT:
        raise CorruptCheckpointError(
            f"{sender} gave the size {str(size)[:40]!r} for {name}, which is not a file size; "
            "refusing it: that rank runs different code or its memory is corrupt"
        )
    return size


@dataclass(frozen=True)
class Copy:
    """One file sent from ``src`` (a rank that sees a copy) to ``dst`` (a rank that lacks it)."""

    name: str
    nbytes: int
    src: int
    dst: int


def complete_steps(
    reports: Mapping[Place, Mapping[str, Mapping[str, int]]],
    manifests: Mapping[str, Mapping[str, int]],
) -> list[str]:
    """Steps (names) whose every file is held, with its size, by at least one place.

    ``reports``: place -> step -> {file: size held there}; ``manifests``: step -> {file: size
    the manifest records}. Newest last (names sort by step).
    """
    out = []
    for step, files in manifests.items():
        if all(
            any(held.get(step, {}).get(name) == size for held in reports.values())
            for name, size in files.items()
        ):
            out.append(step)
    return sorted(out)


def plan_copies(
    needed: Mapping[Place, set[str]],
    held: Mapping[Place, Mapping[str, int]],
    sizes: Mapping[str, int],
    ranks: Mapping[Place, Sequence[int]],
    refused: set[tuple[Place, str]] = frozenset(),  # type: ignore[assignment]
    receivers: Mapping[tuple[Place, str], int] | None = None,
) -> tuple[list[Copy], dict[Place, list[str]]]:
    """Copies that give every place the files its ranks need, and the files nobody can give.

    A file a place already holds (and that was not found bad there) is not copied. Sources
    are places holding the file with the recorded size, minus ``refused`` (place, file)
    pairs whose copy was found corrupt; the least loaded source rank sends, to the rank of
    the receiving place that ``receivers`` names for the file (one of its ranks), else to
    its least loaded rank.
    """
    sent = dict.fromkeys((r for rs in ranks.values() for r in rs), 0)
    received = dict(sent)
    copies: list[Copy] = []
    unavailable: dict[Place, list[str]] = {}
    for place in sorted(needed):
        for name in sorted(needed[place]):
            size = sizes[name]
            if held.get(place, {}).get(name) == size and (place, name) not in refused:
                continue
            sources = [
                p
                for p in sorted(held)
                if p != place and held[p].get(name) == size and (p, name) not in refused
            ]
            if not sources:
                unavailable.setdefault(place, []).append(name)
                continue
            src = min((r for p in sources for r in ranks[p]), key=lambda r: (sent[r], r))
            dst = (receivers or {}).get((place, name), -1)
            if dst not in ranks[place]:
                dst = min(ranks[place], key=lambda r: (received[r], r))
            sent[src] += size
            received[dst] += size
            copies.append(Copy(name, size, src, dst))
    return copies, unavailable
