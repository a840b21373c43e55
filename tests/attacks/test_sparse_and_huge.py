"""Class 5: sparse or huge files cost nothing to plant and must cost nothing to read.

A sparse 8 GiB ``manifest.json`` (no bytes on disk) used to raise a raw ``MemoryError``;
a sparse data file with valid checksums (its holes read as zeros, whose xxh3 is easy to
compute) defeated the real-size checks. Manifests above ``MAX_MANIFEST_BYTES`` are
refused before reading (their size comes from the opened descriptor), and data files with
less than a quarter of their bytes allocated (beyond ``SPARSE_SLACK``) are refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from .harness import (
    N_READERS,
    READERS,
    assert_cli_refused,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(240)
GIB = 1 << 30


def _sparse_manifest(path: Path) -> None:
    save_small(path)
    with open(path / "manifest.json", "r+b") as f:
        f.truncate(8 * GIB)


def _sparse_data(path: Path) -> None:
    """A 4 GiB hole claimed as a uint8 tensor, with the checksums of its zeros."""
    doc = save_small(path)
    size, block = 4 * GIB, 64 << 20
    with open(path / "data" / "hole.bin", "wb") as f:
        f.truncate(size)
    zero = xxhash.xxh3_64_hexdigest(bytes(block))
    doc["files"]["data/hole.bin"] = {"nbytes": size, "rank": 0}
    doc["checksum"]["block_bytes"] = block
    for extent in [p for t in doc["tensors"].values() for p in t["pieces"]] + list(
        doc["blobs"].values()
    ):  # the real items are small: one block each
        extent["checksums"] = [xxhash.xxh3_64_hexdigest(_read(path, extent))]
    doc["tensors"]["w"] = {
        "dtype": "uint8",
        "shape": [size],
        "pieces": [
            {
                "offset": [0],
                "shape": [size],
                "flat": None,
                "file": "data/hole.bin",
                "byte_offset": 0,
                "nbytes": size,
                "checksums": [zero] * (size // block),
            }
        ],
    }
    write_manifest(path, doc)


def _read(path: Path, extent: dict) -> bytes:
    with open(path / extent["file"], "rb") as f:
        f.seek(extent["byte_offset"])
        return f.read(extent["nbytes"])


def test_sparse_files_are_refused(tmp_path: Path) -> None:
    _sparse_manifest(tmp_path / "manifest")
    _sparse_data(tmp_path / "data")
    code = READERS + (
        f"every_reader({str(tmp_path / 'manifest')!r}, 'manifest: ')\n"
        f"every_reader({str(tmp_path / 'data')!r}, 'data: ')\n"
        f"cli('verify', 'verify', {str(tmp_path / 'manifest')!r})\n"
        f"cli('inspect', 'inspect', {str(tmp_path / 'manifest')!r})\n"
    )
    results = run_calls(code, tmp_path / "outside")
    for r in results[-2:]:
        assert_cli_refused(r)
    results = results[:-2]
    assert_refused(results[:N_READERS], N_READERS, match="manifest.json")
    # readers that never touch the hole succeed; load refuses the [8, 8] request's shape first
    rest = {r["name"]: r for r in results[N_READERS:]}
    for name in ("load_metadata", "load_content_metadata", "common", "load_common_state_dict"):
        assert rest.pop(f"data: {name}")["outcome"] == "ok"
    assert_refused([rest.pop("data: load")], 1, match="global shape")
    assert_refused(list(rest.values()), 3, match="sparse")
    proc = run_cli("verify", str(tmp_path / "data"))  # a report of the problems, exit 1
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "sparse" in proc.stdout + proc.stderr


def test_manifest_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    """A dense manifest over the cap: refused by its size alone (checked in-process)."""
    import shardsafe
    from shardsafe import format as fmt

    save_small(tmp_path / "c")
    old = fmt.MAX_MANIFEST_BYTES
    size = os.path.getsize(tmp_path / "c" / "manifest.json")
    import shardsafe.loading as loading

    loading.MAX_MANIFEST_BYTES = size - 1
    try:
        with pytest.raises(shardsafe.CorruptCheckpointError, match="more than"):
            shardsafe.load_metadata(tmp_path / "c")
    finally:
        loading.MAX_MANIFEST_BYTES = old
