"""Class 4: validation costs O(n log n) in pieces, whatever their layout.

100,000 pieces sharing axis 0 (the layout that kept every box active in the old sweep,
42 s for a 511 KB manifest) are parsed, checked for overlaps and holes and verified
within :data:`BOUND` seconds (``verify`` reads and hashes every piece); the same layout with one overlapping piece is refused as
fast. The scratch buffer is bounded too: ``block_bytes`` is at most ``MAX_BLOCK_BYTES``,
so a read task re-reads at most two blocks beyond ``max_buffer_bytes``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from shardsafe.geometry import Box, LayoutTooFragmentedError, find_overlap

from .harness import run_calls

pytestmark = pytest.mark.timeout(300)
PIECES = 100_000
BOUND = 30.0
"""Seconds for each whole-checkpoint call on 100k pieces (about 5 s on an idle laptop core)."""


def _many_pieces(path: Path, overlap: bool) -> None:
    rows = 7
    (path / "data").mkdir(parents=True)
    data = bytes((i * 31) % 251 for i in range(rows * PIECES))
    (path / "data" / "rank-00000-00.bin").write_bytes(data)
    pieces = [
        {
            "offset": [0, i],
            "shape": [rows, 1],
            "flat": None,
            "file": "data/rank-00000-00.bin",
            "byte_offset": rows * i,
            "nbytes": rows,
            "checksums": [xxhash.xxh3_64_hexdigest(data[rows * i : rows * i + rows])],
        }
        for i in range(PIECES)
    ]
    if overlap:  # the last piece moves onto its neighbour's column
        pieces[-1]["offset"] = [0, PIECES - 2]
    doc = {
        "format": "shardsafe",
        "version": 1,
        "world_size": 1,
        "checksum": {"algorithm": "xxh3_64", "block_bytes": 4 << 20},
        "files": {"data/rank-00000-00.bin": {"nbytes": len(data), "rank": 0}},
        "tensors": {"w": {"dtype": "uint8", "shape": [rows, PIECES], "pieces": pieces}},
        "objects": {},
        "blobs": {},
        "common": None,
    }
    (path / "manifest.json").write_text(json.dumps(doc, separators=(",", ":")))


def test_100k_pieces_validate_in_seconds(tmp_path: Path) -> None:
    _many_pieces(tmp_path / "good", overlap=False)
    _many_pieces(tmp_path / "bad", overlap=True)
    code = f"""
    import torch
    good, bad = {str(tmp_path / "good")!r}, {str(tmp_path / "bad")!r}
    readers = {{}}
    def check(path):
        r = readers[path] = shardsafe.CheckpointReader(path)
        r.manifest.tensors["w"].check_tiling("w", "manifest.json")
    def verify(path):
        report = readers[path].verify()
        assert report.ok, report.problems[:3]
    attempt("good: parse and tiling", lambda: check(good))
    attempt("good: verify", lambda: verify(good))
    attempt("bad: parse and tiling", lambda: check(bad))
    """
    results = {r["name"]: r for r in run_calls(code, tmp_path / "outside", timeout=280)}
    assert len(results) == 3
    for name, r in results.items():
        expected = "ok" if name.startswith("good") else "CheckpointError"
        assert r["outcome"] == expected, (name, r["message"])
        assert r["seconds"] < BOUND, (name, r["seconds"])
        assert r["memory"] < 512 << 20, (name, r["memory"])
    assert "overlap" in results["bad: parse and tiling"]["message"]


@pytest.mark.parametrize(
    "layout",
    ["rows", "columns", "grid", "bricks", "3d", "30d"],
)
def test_overlap_check_scales_on_real_layouts(layout: str) -> None:
    """Layouts that sharding produces: no cut straddles, so no budget is ever exceeded."""
    import random

    rng = random.Random(0)
    if layout == "rows":
        boxes = [Box((i,), (1,)) for i in range(PIECES)]
    elif layout == "columns":
        boxes = [Box((0, i), (9, 1)) for i in range(PIECES)]
    elif layout == "grid":
        boxes = [Box((i, j), (1, 1)) for i in range(316) for j in range(316)]
    elif layout == "bricks":
        boxes = []
        for r in range(1000):
            cuts = [0, *sorted(rng.sample(range(1, 10_000), 99)), 10_000]
            boxes += [Box((r, a), (1, b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]
        rng.shuffle(boxes)
    elif layout == "30d":  # many axes: no 2**ndim corner loop, no grid of 2**30 cells
        boxes = [Box((i,) + (0,) * 29, (1,) + (2,) * 29) for i in range(PIECES // 10)]
    else:
        boxes = [Box((i, j, k), (1, 1, 1)) for i in range(46) for j in range(46) for k in range(47)]
    assert find_overlap(boxes) is None
    boxes.append(Box(boxes[len(boxes) // 2].offset, (1,) * boxes[0].ndim))
    pair = find_overlap(boxes)
    assert pair is not None and pair[1] == len(boxes) - 1


def test_work_stops_at_the_budget() -> None:
    """Whatever the layout, the work is capped: past the budget the check stops with an error
    (a manifest then gets a CorruptCheckpointError) instead of running on."""
    import random

    rng = random.Random(1)
    boxes = []
    for r in range(1000):  # too many distinct cuts for the one-shot grid check
        cuts = [0, *sorted(rng.sample(range(1, 10_000), 19)), 10_000]
        boxes += [Box((r, a), (1, b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]
    with pytest.raises(LayoutTooFragmentedError):
        find_overlap(boxes, budget=len(boxes))
    assert find_overlap(boxes) is None


def test_scratch_buffer_stays_bounded(tmp_path: Path) -> None:
    """A resharding read through the scratch buffer holds at most ``max_buffer`` plus two
    checksum blocks (``block_bytes`` is at most 64 MiB), whatever the pieces' sizes."""
    import torch

    import shardsafe
    from shardsafe.engine import DataReader, plan_reads, run_tasks
    from shardsafe.geometry import Box

    block, max_buffer = 64 << 10, 8 << 10
    value = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512)
    shardsafe.Saver(block_bytes=block).save(
        {"w": shardsafe.ShardedTensor.from_rank_offsets("w", value)}, tmp_path / "c"
    )
    reader = shardsafe.CheckpointReader(tmp_path / "c")
    entry = reader.manifest.tensors["w"]
    out = torch.zeros(512, 3)  # three columns: every row is a separate, unaligned region
    tasks, covered = plan_reads(
        "w", entry.pieces, [(Box((0, 100), (512, 3)), out)], torch.float32, max_buffer // 4
    )
    assert covered == out.numel()
    data = DataReader(reader.storage, block, max_buffer)
    run_tasks(data, tasks, threads=1)
    assert torch.equal(out, value[:, 100:103])
    assert data._local.buf.nbytes <= max(max_buffer + 2 * block, 1 << 16)
