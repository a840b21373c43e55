"""What every ``shardsafe`` subcommand shares: counted words, sizes, progress bars, the
missing-path message. Imported by :mod:`shardsafe.cli` and :mod:`shardsafe.cli_convert`, so
neither imports the other for them."""

from __future__ import annotations

import os
import sys
from typing import Any


def plural(n: int, word: str) -> str:
    """``1 piece``, ``2 pieces``, ``3 entries``."""
    if n == 1:
        return f"{n} {word}"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}es" if word.endswith(("s", "sh", "ch")) else f"{n} {word}s"


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None,
        file=sys.stderr,
    )


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def require_path(path: str) -> None:
    """The one message for a local path that does not exist (object-store paths are left to
    the readers, which say what is missing there)."""
    from .errors import CheckpointNotFoundError
    from .storage import is_url

    if not is_url(path) and not os.path.lexists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
