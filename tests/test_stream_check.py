"""The in-stream check of a copy: block checksums of extents computed from the bytes as they
arrive in chunks of any size, compared with the sender's."""

from __future__ import annotations

import random

import pytest

from shardsafe.checksum import StreamCheck, block_checksums
from shardsafe.format import Extent

BLOCK = 64


def extent(data: bytes, offset: int, nbytes: int) -> Extent:
    return Extent(
        "f", offset, nbytes, tuple(block_checksums(data[offset : offset + nbytes], BLOCK))
    )


def fed(data: bytes, extents: list[Extent], cuts: list[int]) -> list[str]:
    """Feed ``data`` cut at ``cuts`` (file offsets) and return the verdict."""
    check = StreamCheck(extents, BLOCK)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for lo, hi in zip(bounds, bounds[1:]):
        check.feed(lo, memoryview(data)[lo:hi])
    return check.finish()


DATA = random.Random(7).randbytes(1000)
# a header before the first extent, odd offsets and lengths, a gap (padding), a last short
# block, an extent of one block exactly, an empty one, and two that overlap
EXTENTS = [
    extent(DATA, 13, 200),
    extent(DATA, 230, 64),
    extent(DATA, 294, 0),
    extent(DATA, 301, 511),
    extent(DATA, 400, 77),
    extent(DATA, 990, 10),
]


@pytest.mark.parametrize("chunk", [1, 7, 63, 64, 65, 100, 333, 1000])
def test_blocks_cut_by_chunk_boundaries_match(chunk: int) -> None:
    assert fed(DATA, EXTENTS, list(range(chunk, len(DATA), chunk))) == []


def test_random_cuts_match() -> None:
    rng = random.Random(1)
    for _ in range(50):
        cuts = [rng.randrange(1, len(DATA)) for _ in range(rng.randrange(0, 30))]
        assert fed(DATA, EXTENTS, cuts) == [], cuts


@pytest.mark.parametrize("chunk", [1, 50, 1000])
def test_a_flipped_byte_names_its_block(chunk: int) -> None:
    bad = bytearray(DATA)
    bad[301 + 3 * BLOCK + 5] ^= 0x10  # block 3 of the extent at 301, not in the one at 400
    found = fed(bytes(bad), EXTENTS, list(range(chunk, len(DATA), chunk)))
    assert found == [f"bytes {301 + 3 * BLOCK} (block 3 of an extent at 301)"]


def test_a_flipped_byte_in_two_overlapping_extents_is_found_in_both() -> None:
    bad = bytearray(DATA)
    bad[420] ^= 0x01
    found = fed(bytes(bad), EXTENTS, [410, 421])
    assert sorted(found) == [
        "bytes 365 (block 1 of an extent at 301)",
        "bytes 400 (block 0 of an extent at 400)",
    ]


def test_bytes_outside_extents_are_not_checked() -> None:
    bad = bytearray(DATA)
    for i in (0, 12, 213, 295, 989):  # header, gaps between extents
        bad[i] ^= 0xFF
    assert fed(bytes(bad), EXTENTS, [100, 500]) == []


def test_a_short_stream_names_what_never_arrived() -> None:
    found = fed(DATA[:450], EXTENTS, [100, 300])
    assert found == [
        "bytes 429 to 812 (from block 2 of an extent at 301) never arrived: the stream ended at 450",
        "bytes 400 to 477 (from block 0 of an extent at 400) never arrived: the stream ended at 450",
        "bytes 990 to 1000 (from block 0 of an extent at 990) never arrived: the stream ended at 450",
    ]
    assert fed(b"", EXTENTS[:1], []) == [
        "bytes 13 to 213 (from block 0 of an extent at 13) never arrived: the stream ended at 0"
    ]


def test_checksums_that_do_not_fit_the_extent_are_refused() -> None:
    short = Extent("f", 13, 200, extent(DATA, 13, 200).checksums[:-1])
    assert fed(DATA, [short], []) == ["an extent at 13 of 200 bytes has 3 block checksums"]
    negative = Extent("f", -5, 10, ("0" * 16,))
    assert fed(DATA, [negative], []) == ["an extent at -5 of 10 bytes has 1 block checksums"]
    unreadable = Extent("f", "x", 10, ("0" * 16,))  # type: ignore[arg-type]
    assert fed(DATA, [unreadable, EXTENTS[0]], []) == [
        "an extent is not readable (invalid literal for int() with base 10: 'x')"
    ]


def test_chunks_must_come_in_file_order() -> None:
    check = StreamCheck(EXTENTS, BLOCK)
    check.feed(0, DATA[:100])
    with pytest.raises(ValueError, match="bytes at 200 fed after bytes up to 100"):
        check.feed(200, DATA[200:300])
