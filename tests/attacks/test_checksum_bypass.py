"""Class 1: the manifest cannot switch checksums off.

A huge ``block_bytes`` used to round the block count to zero, so readers returned bytes
no checksum covered and ``verify`` said OK. ``block_bytes`` now lies in
``[1, MAX_BLOCK_BYTES]``, block counts are integers, and every byte handed out has passed
the one checksum block that covers it (``DataReader._verify`` refuses partial coverage).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsafe.format import MAX_BLOCK_BYTES

from .harness import (
    N_READERS,
    READERS,
    assert_cli_refused,
    assert_cli_refuses,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(240)


def _variants(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for label, block in {
        "huge": 10**330,
        "2**40": 2**40,
        "over-max": MAX_BLOCK_BYTES + 1,
        "zero": 0,
        "negative": -4096,
        "float": 4096.5,
    }.items():
        path = tmp_path / label
        doc = save_small(path)
        # flip a data byte, then claim block sizes that would skip its checksum
        data = path / next(iter(doc["files"]))
        raw = bytearray(data.read_bytes())
        raw[doc["tensors"]["w"]["pieces"][0]["byte_offset"]] ^= 0xFF
        data.write_bytes(bytes(raw))
        doc["checksum"]["block_bytes"] = block
        for extent in [p for t in doc["tensors"].values() for p in t["pieces"]] + list(
            doc["blobs"].values()
        ):
            extent["checksums"] = extent["checksums"][:1] if block else []
        write_manifest(path, doc)
        out[label] = path
    return out


def _wrong_counts(tmp_path: Path) -> dict[str, Path]:
    """One checksum too few, or two too many, for the extent."""
    out = {}
    for label, extra in (("one short", None), ("two extra", ["0" * 16] * 2)):
        path = tmp_path / label
        doc = save_small(path, block_bytes=64)
        piece = doc["tensors"]["w"]["pieces"][0]
        piece["checksums"] = (
            piece["checksums"][:-1] if extra is None else piece["checksums"] + extra
        )
        write_manifest(path, doc)
        out[label] = path
    return out


def test_block_bytes_cannot_disable_checksums(tmp_path: Path) -> None:
    paths = _variants(tmp_path)
    counts = _wrong_counts(tmp_path)
    code = READERS + "".join(
        f"every_reader({str(p)!r}, {label + ': '!r})\n" for label, p in {**paths, **counts}.items()
    )
    code += f"cli('verify', 'verify', {str(paths['huge'])!r})\n"
    results = run_calls(code, tmp_path / "outside")
    assert_cli_refused(results.pop())
    n = N_READERS * len(paths)
    assert_refused(results[:n], n, match="block_bytes")
    assert_refused(results[n:], N_READERS * len(counts), match="checksums")
    proc = run_cli("verify", str(paths["huge"]))  # the real command, in its own process
    assert_cli_refuses(proc)


def test_partial_block_coverage_is_refused_structurally() -> None:
    """The reader's own guard: bytes that do not span whole blocks are never returned."""
    import shardsafe
    from shardsafe.engine import DataReader
    from shardsafe.format import Extent

    reader = DataReader(storage=None, block_bytes=64)  # type: ignore[arg-type]
    extent = Extent("data/x", 0, 200, ("0" * 16,) * 4)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="whole checksum blocks"):
        reader._verify(extent, 10, memoryview(bytes(54)), "test")
    with pytest.raises(shardsafe.CorruptCheckpointError, match="whole checksum blocks"):
        reader._verify(extent, 0, memoryview(bytes(100)), "test")
