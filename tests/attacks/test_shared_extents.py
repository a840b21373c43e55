"""Class 2: one stretch of bytes cannot back many pieces or blobs.

256 pieces over the same 1 MiB used to give a 256 MiB tensor from a 1 MiB file (and
``verify`` said OK); 600 references to one blob multiplied it 600 times. Stored extents
may not overlap (checked while parsing, by sorting: O(n log n)), and each blob is
referenced once, so what any reader allocates is bounded by the bytes of the data files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xxhash

from .harness import (
    N_READERS,
    READERS,
    assert_cli_refused,
    assert_refused,
    run_calls,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(240)
MIB = 1 << 20


def _extra_file(path: Path, doc: dict[str, Any], nbytes: int) -> dict[str, Any]:
    data = bytes(range(256)) * (nbytes // 256)
    (path / "data" / "extra.bin").write_bytes(data)
    doc["files"]["data/extra.bin"] = {"nbytes": nbytes, "rank": 0}
    block = doc["checksum"]["block_bytes"]
    sums = [xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, nbytes, block)]
    return {"file": "data/extra.bin", "byte_offset": 0, "nbytes": nbytes, "checksums": sums}


def _pieces_sharing_bytes(path: Path) -> None:
    doc = save_small(path)
    extent = _extra_file(path, doc, MIB)
    cols = MIB // 4
    doc["tensors"]["w"] = {
        "dtype": "float32",
        "shape": [256, cols],
        "pieces": [
            {"offset": [i, 0], "shape": [1, cols], "flat": None, **extent} for i in range(256)
        ],
    }
    write_manifest(path, doc)


def _blob_referenced_600_times(path: Path) -> None:
    doc = save_small(path)
    doc["blobs"]["c.x"] = _extra_file(path, doc, 10_000 // 64 * 64)
    doc["common"] = {"$dict": [[str(i), {"$bytes": "c.x"}] for i in range(600)]}
    write_manifest(path, doc)


def _blob_overlapping_a_piece(path: Path) -> None:
    doc = save_small(path)
    piece = doc["tensors"]["w"]["pieces"][0]
    doc["blobs"]["c.y"] = {k: piece[k] for k in ("file", "byte_offset", "nbytes", "checksums")}
    doc["common"] = {"$bytes": "c.y"}
    write_manifest(path, doc)


def test_shared_bytes_are_refused(tmp_path: Path) -> None:
    builders = {
        "pieces": (_pieces_sharing_bytes, "must not overlap"),
        "blob-600": (_blob_referenced_600_times, "already used"),
        "blob-on-piece": (_blob_overlapping_a_piece, "must not overlap"),
    }
    for label, (build, _) in builders.items():
        build(tmp_path / label)
    code = READERS + "".join(
        f"every_reader({str(tmp_path / label)!r}, {label + ': '!r})\n" for label in builders
    )
    code += "".join(
        f"cli({c!r}, {c!r}, {str(tmp_path / 'pieces')!r})\n" for c in ("verify", "inspect")
    )
    results = run_calls(code, tmp_path / "outside")
    for r in results[-2:]:
        assert_cli_refused(r)
    results = results[:-2]
    for i, (_, match) in enumerate(builders.values()):
        assert_refused(results[i * N_READERS : (i + 1) * N_READERS], N_READERS, match=match)
