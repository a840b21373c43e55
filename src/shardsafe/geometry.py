"""Pure n-d geometry: boxes, flat ranges, intersections and coverage.

Every stored or requested piece of a tensor is normalised here into boxes (a global offset
plus a shape). A flat range ``[a, b)`` of the row-major flattening of a box, as ZeRO and
Megatron's distributed optimizer produce, becomes at most ``2n - 1`` boxes, each of which
is one contiguous run of the range. Resharding in any direction is then box ∩ box.

No I/O, no torch: plain integers and tuples, so it can be tested at any scale.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned region ``offset <= index < offset + shape`` of an n-d array."""

    offset: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"box offset {self.offset} and shape {self.shape} differ in rank")
        if any(s < 0 for s in self.shape) or any(o < 0 for o in self.offset):
            raise ValueError(f"box offset {self.offset} / shape {self.shape} must be non-negative")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        """True if the box lies inside an array of ``shape``."""
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.end, shape, strict=True))

    def shifted(self, delta: Sequence[int]) -> Box:
        return Box(tuple(o + d for o, d in zip(self.offset, delta, strict=True)), self.shape)

    def relative_to(self, origin: Sequence[int]) -> Box:
        return Box(tuple(o - d for o, d in zip(self.offset, origin, strict=True)), self.shape)


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes of the same rank, or None when they do not meet."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.end, b.end, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def strides(shape: Sequence[int]) -> Shape:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def flat_index(shape: Sequence[int], index: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, strides(shape), strict=True))


def is_contiguous_in(outer_shape: Sequence[int], inner: Box) -> bool:
    """True if ``inner`` is one contiguous run of the row-major flattening of ``outer_shape``.

    That holds when every axis after the first one longer than 1 is taken whole.
    """
    if inner.numel == 0:
        return True
    axes = range(inner.ndim)
    first = next((i for i in axes if inner.shape[i] != 1), inner.ndim)
    return all(inner.shape[j] == outer_shape[j] for j in range(first + 1, inner.ndim))


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """Split the flat range ``[start, stop)`` of an array of ``shape`` into contiguous boxes.

    Returns ``(position, box)`` pairs in flat order: ``box`` (in the array's coordinates)
    holds the elements ``data[position : position + box.numel]`` of the range's data.
    At most ``2 * ndim - 1`` boxes.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside an array of {total} elements")
    boxes = _split(shape, start, stop)
    out: list[tuple[int, Box]] = []
    position = 0
    for box in boxes:
        out.append((position, box))
        position += box.numel
    return out


def _split(shape: Shape, a: int, b: int) -> list[Box]:
    if a >= b:
        return []
    if len(shape) == 0:
        return [Box((), ())]
    if len(shape) == 1:
        return [Box((a,), (b - a,))]
    row = math.prod(shape[1:])
    rest = shape[1:]
    r0, c0 = divmod(a, row)
    r1, c1 = divmod(b, row)
    if r0 == r1:
        return [_prefix(r0, box) for box in _split(rest, c0, c1)]
    out: list[Box] = []
    if c0:
        out.extend(_prefix(r0, box) for box in _split(rest, c0, row))
        r0 += 1
    if r1 > r0:
        out.append(Box((r0,) + (0,) * len(rest), (r1 - r0, *rest)))
    if c1:
        out.extend(_prefix(r1, box) for box in _split(rest, 0, c1))
    return out


def _prefix(index: int, box: Box) -> Box:
    return Box((index, *box.offset), (1, *box.shape))


class LayoutTooFragmentedError(ValueError):
    """The boxes cannot be checked for overlaps within the work budget (see :func:`find_overlap`)."""


def find_overlap(boxes: Sequence[Box], budget: int | None = None) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None.

    Divide and conquer: a group of boxes whose compressed grid (see :func:`boxes_disjoint`)
    is small is checked at once; a larger one is cut at a coordinate of one axis that the
    fewest boxes straddle (preferring the cut nearest its middle), and a straddling box goes
    to both sides, clipped. Layouts that sharding produces (grids, flat ranges, guillotine
    cuts) always have a cut nothing straddles, so the work is ``O(n log² n)`` in the number
    of boxes. Adversarial layouts could make clipped copies multiply: the number of box
    copies handled is capped at ``budget`` (default ``64 n + 4096``), and
    :class:`LayoutTooFragmentedError` is raised beyond it.
    """
    import numpy as np

    if len(boxes) < 2:
        return None
    if boxes[0].ndim == 0:
        return (0, 1)
    try:
        lo = np.asarray([b.offset for b in boxes], dtype=np.int64)
        shape = np.asarray([b.shape for b in boxes], dtype=np.int64)
    except (OverflowError, ValueError):
        raise LayoutTooFragmentedError("box coordinates beyond 2**63 cannot be checked") from None
    if lo.max() >= 1 << 61 or shape.max() >= 1 << 61:
        raise LayoutTooFragmentedError("box coordinates beyond 2**61 cannot be checked")
    keep = (shape > 0).all(axis=1)
    index = np.flatnonzero(keep)
    if len(index) < 2:
        return None
    lo, hi = lo[keep], lo[keep] + shape[keep]
    left = budget if budget is not None else 64 * len(index) + 4096
    if boxes_disjoint(lo, hi, max_cells=1 << 22):
        return None
    stack = [(index, lo, hi, False)]
    while stack:
        idx, glo, ghi, try_grid = stack.pop()
        m = len(idx)
        left -= m
        if left < 0:
            raise LayoutTooFragmentedError(
                f"{len(index)} boxes are too fragmented to check for overlaps within the work budget"
            )
        if m < 2:
            continue
        if m <= 8:
            for x in range(m):
                inter = (np.maximum(glo[x], glo[x + 1 :]) < np.minimum(ghi[x], ghi[x + 1 :])).all(
                    axis=1
                )
                if inter.any():
                    y = x + 1 + int(np.argmax(inter))
                    a, b = int(idx[x]), int(idx[y])
                    return (min(a, b), max(a, b))
            continue
        if try_grid and boxes_disjoint(glo, ghi, max_cells=max(1 << 14, 16 * m)):
            continue
        cut = _best_cut(glo, ghi)
        if cut is None:  # every box spans the same range on every axis
            a, b = int(idx[0]), int(idx[1])
            return (min(a, b), max(a, b))
        axis, c = cut
        below = glo[:, axis] < c
        above = ghi[:, axis] > c
        blo, bhi = glo[below], ghi[below].copy()
        np.minimum(bhi[:, axis], c, out=bhi[:, axis])
        alo, ahi = glo[above].copy(), ghi[above]
        np.maximum(alo[:, axis], c, out=alo[:, axis])
        stack.append((idx[below], blo, bhi, True))
        stack.append((idx[above], alo, ahi, True))
    return None


def _best_cut(lo: Any, hi: Any) -> tuple[int, int] | None:
    """``(axis, coordinate)`` strictly inside the boxes' span that the fewest of them straddle."""
    import numpy as np

    m, ndim = lo.shape
    best: tuple[int, int, int, int] | None = None  # (straddlers, imbalance, axis, coordinate)
    for axis in range(ndim):
        starts = np.sort(lo[:, axis])
        ends = np.sort(hi[:, axis])
        cands = np.unique(starts)[1:]
        if len(cands) == 0:
            continue
        before = np.searchsorted(starts, cands, side="left")
        straddle = before - np.searchsorted(ends, cands, side="right")
        score = straddle * (2 * m + 1) + np.abs(2 * before - m)
        k = int(np.argmin(score))
        cand = (int(straddle[k]), int(abs(2 * before[k] - m)), axis, int(cands[k]))
        if best is None or cand < best:
            best = cand
    return None if best is None else (best[2], best[3])


def covered_volume(boxes: Iterable[Box]) -> int:
    """Sum of the boxes' volumes (equal to the covered volume when they do not overlap)."""
    return sum(b.numel for b in boxes)


def first_uncovered(
    shape: Sequence[int], boxes: Sequence[Box], max_cells: int = 1 << 20
) -> Shape | None:
    """An index of ``shape`` that no box covers, or None if all are covered or the search is too big.

    Compresses coordinates to the boxes' cut points, so the work depends on the number of
    distinct cuts, not on the tensor's size.
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return None
    if not shape:
        return None if boxes else ()
    cuts = [
        sorted({0, n, *(b.offset[ax] for b in boxes), *(b.end[ax] for b in boxes)})
        for ax, n in enumerate(shape)
    ]
    cuts = [[c for c in axis if c <= n] for axis, n in zip(cuts, shape, strict=True)]
    if math.prod(len(c) - 1 for c in cuts) > max_cells:
        return None
    import numpy as np

    grid = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    position = [{c: i for i, c in enumerate(axis)} for axis in cuts]
    for b in boxes:
        sl = tuple(
            slice(position[ax][b.offset[ax]], position[ax][min(b.end[ax], shape[ax])])
            for ax in range(len(shape))
        )
        grid[sl] = True
    missing = np.argwhere(~grid)
    if len(missing) == 0:
        return None
    return tuple(int(cuts[ax][int(i)]) for ax, i in enumerate(missing[0]))


def boxes_disjoint(offsets: Any, ends: Any, max_cells: int = 1 << 21) -> bool | None:
    """Whether the boxes ``[offsets[i], ends[i])`` (int arrays of shape ``(n, ndim)``) are pairwise disjoint.

    Vectorised: coordinates are compressed to the boxes' cut points and every box adds one
    to the cells it covers (corner differences, then a prefix sum per axis), so the work
    depends on the number of distinct cuts, not on the extent. Returns None when that grid
    would exceed ``max_cells`` cells; use :func:`find_overlap` then. Empty boxes cover nothing.
    """
    import numpy as np

    offsets = np.asarray(offsets, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    n, ndim = offsets.shape
    if n < 2:
        return True
    keep = (ends > offsets).all(axis=1)
    offsets, ends = offsets[keep], ends[keep]
    if len(offsets) < 2:
        return True
    if ndim == 0:
        return False
    if ndim > 8:  # the corner loop below runs 2**ndim times
        return None
    cuts = [np.unique(np.concatenate([offsets[:, a], ends[:, a]])) for a in range(ndim)]
    if math.prod(len(c) for c in cuts) > max_cells:
        return None
    lo = [np.searchsorted(cuts[a], offsets[:, a]) for a in range(ndim)]
    hi = [np.searchsorted(cuts[a], ends[:, a]) for a in range(ndim)]
    counts = np.zeros([len(c) for c in cuts], dtype=np.int32)
    for corner in itertools.product((0, 1), repeat=ndim):
        index = tuple(hi[a] if c else lo[a] for a, c in enumerate(corner))
        np.add.at(counts, index, -1 if sum(corner) % 2 else 1)
    for a in range(ndim):
        np.cumsum(counts, axis=a, out=counts)
    return bool(counts.max() <= 1)
