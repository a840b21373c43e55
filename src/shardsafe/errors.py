"""One small exception tree.

Every problem with a checkpoint's files or with a request surfaces as a subclass of
:class:`CheckpointError`; each also subclasses the built-in exception it means, so
``except FileNotFoundError`` keeps working for code that does not know shardsafe.
Messages name the key, file and ranks involved and say what to do.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping, Sequence


class CheckpointError(Exception):
    """Base class of every error shardsafe raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no checkpoint at all."""

    def __str__(self) -> str:  # FileNotFoundError would print errno-style tuples
        return str(self.args[0]) if self.args else ""


class IncompleteCheckpointError(CheckpointNotFoundError):
    """The path holds the remains of a save that never committed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target of a save exists and ``overwrite`` was not given, or a save into it is running."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Files are unreadable, truncated, fail a checksum or hold something refused by the safe loader."""


class UnsafeObjectError(CorruptCheckpointError):
    """A stored object needs a class or function that the safe loader does not allow."""


class CheckpointReadError(CheckpointError, OSError):
    """A checkpoint's file could not be read for a reason that proves nothing about its content
    (permissions, an I/O error, a stale handle, too many open files): not damage, so a restore
    neither falls back over it nor marks the checkpoint; fix the cause and retry."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ValidationError(CheckpointError, ValueError):
    """The sharding described by the ranks is inconsistent: overlaps, gaps, shape/dtype disagreement."""


class IncompatibleRequestError(CheckpointError, ValueError):
    """What ``load`` was asked for does not fit what the checkpoint holds (shape, dtype, kind)."""


class MissingKeyError(IncompatibleRequestError, KeyError):
    """A requested key is not in the checkpoint (or a checkpoint key was not requested, in strict modes)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StagingError(CheckpointError, MemoryError):
    """Host memory to stage a save's device tensors could not be set up (page-locking failed)."""


class DistributedError(CheckpointError, RuntimeError):
    """One or more ranks failed or did not answer in time; raised on every rank."""

    def __init__(
        self,
        message: str,
        rank_errors: Mapping[int, str] | None = None,
        rank_error_types: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank_errors: dict[int, str] = dict(rank_errors or {})
        # the exception class name each failing rank raised, so callers can tell a damaged
        # checkpoint from a dead rank without parsing messages
        self.rank_error_types: dict[int, str] = dict(rank_error_types or {})


_DAMAGE = (
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "CheckpointNotFoundError",
)


def is_damaged_checkpoint(e: BaseException) -> bool:
    """True when ``e`` proves the checkpoint's files damaged (a checksum, a size, the structure:
    corrupt, truncated, incomplete or gone) on every failing rank: the case where an older
    checkpoint is worth trying.

    Not damage: a request that does not fit, a rank that failed, a file the OS would not let
    us read (:class:`CheckpointReadError`), a class missing from this process's allow-list
    (:class:`UnsafeObjectError`: another process may load it). Those are raised."""
    if isinstance(e, DistributedError):
        types = set(e.rank_error_types.values())
        return bool(types) and types <= set(_DAMAGE)
    return isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)) and not isinstance(
        e, (CheckpointExistsError, UnsafeObjectError)
    )


_STRUCTURE_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})


def read_failure(message: str, error: OSError) -> CheckpointError:
    """The error for an ``OSError`` met reading a checkpoint's file: damage
    (:class:`CorruptCheckpointError`) when it is about what the checkpoint holds (a directory or
    a link where a file belongs, a file a reader refuses: ``error.refused``), else a
    :class:`CheckpointReadError`, which proves nothing about the bytes."""
    if getattr(error, "refused", False) or error.errno in _STRUCTURE_ERRNOS:
        return CorruptCheckpointError(message)
    out = CheckpointReadError(message)
    out.errno = error.errno
    return out


def describe_ranks(ranks: Sequence[int], limit: int = 8) -> str:
    """``ranks 0, 1, 5`` / ``rank 3`` / ``ranks 0, 1, ... (+9 more)`` for messages."""
    ranks = sorted(set(ranks))
    head = ", ".join(str(r) for r in ranks[:limit])
    more = f", ... (+{len(ranks) - limit} more)" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) != 1 else ''} {head}{more}"


def call_each(calls: Iterable[Callable[[], object]]) -> None:
    """Run every call even after one fails (each frees its own resources), then raise the
    first :class:`CheckpointError` seen."""
    errors: list[CheckpointError] = []
    for call in calls:
        try:
            call()
        except CheckpointError as e:
            errors.append(e)
    if errors:
        raise errors[0]
