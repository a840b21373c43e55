"""Geometry against brute force over random shapes (hypothesis)."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe.geometry import (
    Box,
    find_overlap,
    first_uncovered,
    flat_index,
    flat_range_to_boxes,
    intersect,
    is_contiguous_in,
)

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@st.composite
def box_in(draw, shape):
    off = tuple(draw(st.integers(0, s - 1)) for s in shape)
    size = tuple(draw(st.integers(1, s - o)) for o, s in zip(off, shape))
    return Box(off, size)


@given(shape_and_range())
@settings(max_examples=300, deadline=None)
def test_flat_range_to_boxes_covers_exactly_the_range(case):
    shape, a, b = case
    parts = flat_range_to_boxes(shape, a, b)
    assert len(parts) <= max(1, 2 * len(shape) - 1)
    ids = np.arange(math.prod(shape)).reshape(shape)
    got = []
    position = 0
    for pos, box in parts:
        assert pos == position
        assert box.within(shape)
        assert is_contiguous_in(shape, box)
        region = ids[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)
        # each box is one contiguous run of the flat range, at its position
        assert list(region) == list(range(a + pos, a + pos + box.numel))
        got.extend(region.tolist())
        position += box.numel
    assert got == list(range(a, b))


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_intersection_matches_masks(data):
    shape = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
    a, b = data.draw(box_in(shape)), data.draw(box_in(shape))

    def mask(box):
        m = np.zeros(shape, bool)
        m[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))] = True
        return m

    both = mask(a) & mask(b)
    inter = intersect(a, b)
    if inter is None:
        assert not both.any()
    else:
        assert (mask(inter) == both).all()


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_contiguity_matches_flat_indices(data):
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple))
    box = data.draw(box_in(shape))
    ids = np.arange(math.prod(shape)).reshape(shape)
    region = ids[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)
    contiguous = bool((np.diff(region) == 1).all())
    assert is_contiguous_in(shape, box) == contiguous
    assert region[0] == flat_index(shape, box.offset)


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_overlap_and_coverage_match_brute_force(data):
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
    boxes = data.draw(st.lists(box_in(shape), min_size=1, max_size=6))
    count = np.zeros(shape, int)
    for box in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))] += 1
    overlap = find_overlap(boxes)
    assert (overlap is not None) == bool((count > 1).any())
    if overlap is not None:
        assert intersect(boxes[overlap[0]], boxes[overlap[1]]) is not None
    hole = first_uncovered(shape, boxes)
    if (count > 0).all():
        assert hole is None
    else:
        assert hole is not None and count[hole] == 0


def test_flat_range_of_a_scalar_and_empty_ranges():
    assert flat_range_to_boxes((), 0, 1) == [(0, Box((), ()))]
    assert flat_range_to_boxes((3, 4), 5, 5) == []


def test_overlap_search_scales_to_many_row_blocks():
    # 10,000 ZeRO-style pieces of one tensor: each flat range cuts rows in the middle
    shape = (5000, 4096)
    n = math.prod(shape)
    cuts = np.linspace(0, n, 10_001).astype(int)
    boxes = [
        b
        for a, z in zip(cuts[:-1], cuts[1:])
        for _, b in flat_range_to_boxes(shape, int(a), int(z))
    ]
    assert find_overlap(boxes) is None
    assert sum(b.numel for b in boxes) == n
