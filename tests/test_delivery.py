"""Deliveries: the bytes of fetched files put straight into the tensors a load reads them into,
and the planning that says where those are (the same as the load's own in-place reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe import ShardedTensor
from shardsafe.delivery import Deliveries
from shardsafe.loading import in_place_deliveries, read_manifest


def buf(n: int) -> memoryview:
    return memoryview(bytearray(n))


def test_overlapping_spans_are_refused_the_first_wins() -> None:
    d = Deliveries()
    assert d.add("f", 10, buf(10))
    assert not d.add("f", 15, buf(10))  # overlaps [10, 20)
    assert not d.add("f", 5, buf(6))
    assert d.add("f", 20, buf(5))  # touching is fine
    assert d.add("f", 0, buf(10))
    assert not d.add("f", 30, buf(0))  # empty
    assert not d.add("f", -1, buf(1))


def test_land_and_fill_move_each_byte_once_and_name_the_rest() -> None:
    d = Deliveries()
    a, b = bytearray(4), bytearray(4)
    d.add("f", 2, memoryview(a))
    d.add("f", 8, memoryview(b))
    data = bytes(range(12))
    rest = d.land("f", 0, memoryview(data))
    assert bytes(a) == data[2:6] and bytes(b) == data[8:12]
    assert rest == [(0, 2), (6, 8)]
    # a chunk in the middle of the file: offsets are the file's
    rest = d.land("f", 4, memoryview(b"\xff" * 6))
    assert bytes(a) == data[2:4] + b"\xff\xff" and bytes(b) == b"\xff\xff" + data[10:12]
    assert rest == [(2, 4)]
    out = bytearray(10)
    gaps = d.fill("f", 1, memoryview(out))
    assert gaps == [(0, 1), (5, 7)]
    assert out[1:5] == a and out[7:10] == b[:3]
    assert d.land("other", 0, memoryview(data)) == [(0, 12)]
    assert d.fill("other", 0, memoryview(out)) == [(0, 10)]


def test_fill_into_the_span_itself_copies_nothing() -> None:
    d = Deliveries()
    target = np.arange(16, dtype=np.uint8)
    d.add("f", 100, memoryview(target))
    view = memoryview(target)[4:8]
    assert d.fill("f", 104, view) == []
    assert list(target) == list(range(16))


def test_whole_keeps_the_bytes_between_spans_or_drops_the_file() -> None:
    d = Deliveries()
    t = bytearray(8)
    d.add("f", 4, memoryview(t))
    assert d.whole("f", 16, max_kept=8)
    assert d.files == {"f"} and d.size("f") == 16 and d.kept == 8 and d.nbytes == 8
    data = bytes(range(16))
    assert d.land("f", 0, memoryview(data)) == []  # every byte has a place
    out = bytearray(16)
    assert d.fill("f", 0, memoryview(out)) == [] and bytes(out) == data
    # too much outside the spans: not delivered at all
    d.add("g", 0, buf(4))
    assert not d.whole("g", 100, max_kept=8)
    assert "g" not in d.files and d.size("g") is None
    assert d.land("g", 0, memoryview(bytes(100))) == [(0, 100)]
    # a span beyond the file's end: not delivered
    d.add("h", 8, buf(8))
    assert not d.whole("h", 12, max_kept=100)
    # no span: nothing to deliver
    assert not d.whole("i", 10, max_kept=100)


def test_planning_names_exactly_the_load_s_in_place_reads(tmp_path: Path) -> None:
    """The spans are the load's own in-place reads: the same memory, the same file bytes.
    A tensor the load reads through a buffer (another dtype, a column block) has none."""
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    b = torch.arange(10, dtype=torch.float64)
    shardsafe.save({"w": w, "b": b, "step": 3}, tmp_path / "ck")
    manifest, _ = read_manifest(tmp_path / "ck")
    files = {p.extent.file for e in manifest.tensors.values() for p in e.pieces}
    into_w = torch.nn.Parameter(torch.zeros(64, 32))
    into_b = torch.zeros(10, dtype=torch.float64)
    d = in_place_deliveries({"w": into_w, "b": into_b, "step": 0}, manifest, files)
    assert d.nbytes == w.numel() * 4 + b.numel() * 8
    # the bytes the file holds, landed, are the tensors' values, without a load
    for f in files:
        raw = (tmp_path / "ck" / f).read_bytes()
        assert d.whole(f, len(raw), max_kept=1 << 20)
        assert d.land(f, 0, memoryview(raw)) == []
    assert torch.equal(into_w.detach(), w) and torch.equal(into_b, b)
    assert into_w.requires_grad
    # another dtype, a column block, a tensor not handed in: read through a buffer, no span
    other = in_place_deliveries(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 16), (1, 0, 2)),
            "b": torch.zeros(10, dtype=torch.float32),
        },
        manifest,
        files,
    )
    assert other.nbytes == 0


def test_a_load_takes_delivered_bytes_from_memory_and_verifies_them(tmp_path: Path) -> None:
    w = torch.randn(256, 64)
    shardsafe.save({"w": w}, tmp_path / "ck")
    manifest, _ = read_manifest(tmp_path / "ck")
    (f,) = {p.extent.file for p in manifest.tensors["w"].pieces}
    raw = (tmp_path / "ck" / f).read_bytes()
    into = torch.zeros(256, 64)
    d = in_place_deliveries({"w": into}, manifest, {f})
    assert d.whole(f, len(raw), max_kept=1 << 20)
    d.land(f, 0, memoryview(raw))
    (tmp_path / "ck" / f).unlink()  # no file: every byte comes from memory
    shardsafe.load({"w": into}, tmp_path / "ck", delivered=d)
    assert torch.equal(into, w)
    # a byte changed in memory after it was delivered is caught by the load's checksums
    into.view(-1)[100] += 1
    with pytest.raises(shardsafe.CorruptCheckpointError, match="checksum mismatch"):
        shardsafe.load({"w": into}, tmp_path / "ck", delivered=d)
