"""Where a save writes, and who may: the target check, the lease, the work directory.

:func:`begin` (coordinator) refuses to replace anything but a checkpoint (or an empty
directory), takes the save's lease on the name (:mod:`shardsafe.lease`) and creates the work
directory; :func:`abort` removes what an unsuccessful save wrote. On file systems the ranks
write into a hidden sibling that the commit renames into place; on object stores into the
target itself, under data file names that carry the save's token.
"""

from __future__ import annotations

import re
import socket

from .errors import CheckpointError, CheckpointExistsError
from .format import MANIFEST_NAME, data_file_name
from .lease import LEASE_SECONDS, Lease, LeaseInfo, read_lease
from .location import Location

_DATA_FILE = re.compile(r"rank-\d{5}-\d{2,}(-[0-9a-f]{16})?\.bin")
"""Data files a shardsafe save writes (the remains of an interrupted one may be replaced)."""


def begin(loc: Location, token: str, overwrite: bool, lease_ttl: float = LEASE_SECONDS) -> Lease:
    """Coordinator: refuse an existing target (or anything but a checkpoint with ``overwrite``)
    or a concurrent save; take the lease and create the work directory."""
    check_target(loc, overwrite)
    lease = Lease.acquire(loc.parent, loc.lock_name, token, lease_ttl)
    try:
        check_target(loc, overwrite)  # again, now that no other save of this name can run
        work = work_dir(loc, token)
        loc.parent.make_dir(work)
        loc.parent.make_dir(f"{work}/data")
    except BaseException:
        lease.release()
        raise
    return lease.start()


def check_target(loc: Location, overwrite: bool) -> None:
    """Only a shardsafe checkpoint (or an empty directory) may be replaced, and only with ``overwrite``."""
    parent = loc.parent
    if not occupied(loc):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{loc.url} already exists; pass overwrite=True to replace it (the old checkpoint stays intact until the new one commits)"
        )
    if parent.exists(loc.join(MANIFEST_NAME)):
        return
    if parent.is_dir(loc.name):
        stray = [n for n in parent.list_dir(loc.name) if n != "data"]
        stray += [
            f"data/{n}" for n in parent.list_dir(loc.join("data")) if not _DATA_FILE.fullmatch(n)
        ]
        if not stray:
            return
        what = (
            f"a directory holding {', '.join(sorted(stray)[:5])}{' ...' if len(stray) > 5 else ''}"
        )
    else:
        what = "a file"
    raise CheckpointExistsError(
        f"{loc.url} is {what} but not a shardsafe checkpoint (it has no {MANIFEST_NAME}); "
        "overwrite replaces checkpoints only: move or delete it yourself, or pick another path"
    )


def occupied(loc: Location) -> bool:
    """Whether the target exists; an existing *empty* directory is free to save into (Megatron's ``save`` expects one)."""
    parent = loc.parent
    if not parent.exists(loc.name):
        return False
    return not (parent.is_dir(loc.name) and not parent.list_dir(loc.name))


def work_dir(loc: Location, token: str) -> str:
    """Where the ranks write: a hidden sibling (swapped in at commit), or the target on object stores."""
    return loc.tmp_name(token) if loc.parent.atomic_rename else loc.name


def file_name(loc: Location, token: str, rank: int, index: int) -> str:
    """A data file's name. On object stores the save's token is part of it, so that a new
    checkpoint is written beside the old one it replaces, never over it."""
    name = data_file_name(rank, index)
    return name if loc.parent.atomic_rename else name.replace(".bin", f"-{token}.bin")


def check_work_dir(loc: Location, token: str, rank: int) -> None:
    """A rank must see the work directory the coordinator created: else it would write to a
    disk nobody else sees and the checkpoint would miss its files."""
    if loc.parent.atomic_rename and not loc.parent.is_dir(work_dir(loc, token)):
        raise CheckpointError(
            f"rank {rank} on host {socket.gethostname()} cannot see the work directory "
            f"{loc.parent.describe(work_dir(loc, token))} that the coordinator created: "
            "every rank must write to the same shared file system (is it mounted on that host?)"
        )


def abort(loc: Location, token: str, lease: Lease | None = None) -> None:
    """Remove what an unsuccessful save wrote, and its lease; never a committed checkpoint's files."""
    parent = loc.parent
    if parent.atomic_rename:
        parent.remove_tree(loc.tmp_name(token))
    else:
        for name in parent.list_dir(loc.join("data")):
            if name.endswith(f"-{token}.bin"):
                parent.remove_tree(loc.join("data", name))
    if lease is not None:
        lease.release()
        return
    info = read_lease(parent, loc.lock_name)
    if isinstance(info, LeaseInfo) and info.owner == token:
        parent.remove_tree(loc.lock_name)
