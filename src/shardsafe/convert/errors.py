"""Errors specific to format conversion; both fit the project's CheckpointError tree."""

from __future__ import annotations

from ..errors import CheckpointError, CorruptCheckpointError

TRUST_HINT = (
    "If you trust the file, pass trust=True (--trust on the command line) to load it with the "
    "full pickle machinery, which can run arbitrary code."
)


class UnsafePickleError(CorruptCheckpointError):
    """A pickle refers to something the safe loader does not admit; nothing of it was executed."""

    def __init__(self, where: str, refused: str, what: str = "a checkpoint") -> None:
        super().__init__(
            f"{where}: refused to unpickle {refused}: it is not among the types {what} may contain. {TRUST_HINT}"
        )
        self.refused = refused


class UnsupportedFormatError(CheckpointError, ValueError):
    """The path holds something, but not a checkpoint format the converters read."""
