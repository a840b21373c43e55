"""One small exception tree.

Every problem with a checkpoint's files or with a request surfaces as a subclass of
:class:`CheckpointError`; each also subclasses the built-in exception it means, so
``except FileNotFoundError`` keeps working for code that does not know shardsafe.
Messages name the key, file and ranks involved and say what to do.
"""

from __future__ import annotations

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
    "UnsafeObjectError",
    "IncompleteCheckpointError",
    "CheckpointNotFoundError",
)


def is_damaged_checkpoint(e: BaseException) -> bool:
    """True when ``e`` says the checkpoint's files are corrupt, incomplete or gone (on every
    failing rank), as opposed to a request that does not fit or a rank that failed: the case
    where an older checkpoint is worth trying."""
    if isinstance(e, DistributedError):
        types = set(e.rank_error_types.values())
        return bool(types) and types <= set(_DAMAGE)
    return isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)) and not isinstance(
        e, CheckpointExistsError
    )


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
