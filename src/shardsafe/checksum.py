"""Block checksums (xxh3-64) of stored bytes.

Each stored piece carries one checksum per ``block_bytes`` block, so a load that reads only
part of a piece (resharding) still verifies everything it reads by reading whole blocks.
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_BYTES = 4 << 20


def digest(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def block_checksums(data: memoryview | bytes, block_bytes: int) -> list[str]:
    """One hex digest per ``block_bytes`` block of ``data`` (the last block may be short)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    return [digest(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)
