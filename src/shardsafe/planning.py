"""Pure planning: every rank's local descriptors -> one validated global save plan.

No I/O and no torch.distributed. Given the same inputs, every process computes the same
plan, so validation errors are the same everywhere and name the key and ranks involved.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ValidationError, describe_ranks
from .geometry import (
    Box,
    LayoutTooFragmentedError,
    boxes_disjoint,
    find_overlap,
    first_uncovered,
    flat_range_to_boxes,
)


@dataclass(frozen=True, slots=True)
class PieceDesc:
    """What a rank holds of one tensor: a box (or a flat range of it), and whether it is the main replica."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None
    main: bool
    nbytes: int

    @property
    def geometry(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None]:
        return (self.offset, self.shape, self.flat)

    def boxes(self) -> list[Box]:
        if self.flat is None:
            return [Box(self.offset, self.shape)]
        return [b.shifted(self.offset) for _, b in flat_range_to_boxes(self.shape, *self.flat)]

    def to_json(self) -> list[Any]:
        return [
            self.key,
            self.dtype,
            list(self.global_shape),
            list(self.offset),
            list(self.shape),
            list(self.flat) if self.flat else None,
            self.main,
            self.nbytes,
        ]

    @staticmethod
    def from_json(v: list[Any]) -> PieceDesc:
        return PieceDesc(
            v[0],
            v[1],
            tuple(v[2]),
            tuple(v[3]),
            tuple(v[4]),
            tuple(v[5]) if v[5] else None,
            bool(v[6]),
            int(v[7]),
        )


@dataclass(frozen=True, slots=True)
class ObjectDesc:
    unique_key: str
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    main: bool

    def to_json(self) -> list[Any]:
        return [
            self.unique_key,
            self.key,
            list(self.global_shape),
            list(self.global_offset),
            self.main,
        ]

    @staticmethod
    def from_json(v: list[Any]) -> ObjectDesc:
        return ObjectDesc(v[0], v[1], tuple(v[2]), tuple(v[3]), bool(v[4]))


@dataclass(frozen=True)
class LocalPlan:
    """One rank's descriptors, in the order of its state dict."""

    rank: int
    pieces: tuple[PieceDesc, ...]
    objects: tuple[ObjectDesc, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pieces": [p.to_json() for p in self.pieces],
            "objects": [o.to_json() for o in self.objects],
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> LocalPlan:
        return LocalPlan(
            int(obj["rank"]),
            tuple(PieceDesc.from_json(p) for p in obj["pieces"]),
            tuple(ObjectDesc.from_json(o) for o in obj["objects"]),
        )

    def structure_hash(self) -> str:
        """Hash of everything that shapes the plan: keys, dtypes, boxes, flat ranges, replicas."""
        return hashlib.sha256(
            json.dumps(self.to_json(), separators=(",", ":")).encode()
        ).hexdigest()


@dataclass(frozen=True)
class RankAssignment:
    """What one rank must write: indices into its own ``LocalPlan.pieces`` / ``.objects``."""

    pieces: tuple[int, ...]
    objects: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"pieces": list(self.pieces), "objects": list(self.objects)}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> RankAssignment:
        return RankAssignment(tuple(obj["pieces"]), tuple(obj["objects"]))


@dataclass(frozen=True)
class GlobalPlan:
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype, global shape)
    assignments: tuple[RankAssignment, ...]  # by rank

    def bytes_per_rank(self, local_plans: Sequence[LocalPlan]) -> list[int]:
        return [
            sum(lp.pieces[i].nbytes for i in a.pieces)
            for lp, a in zip(local_plans, self.assignments, strict=True)
        ]


def make_global_plan(local_plans: Sequence[LocalPlan]) -> GlobalPlan:
    """Validate the union of all ranks' pieces and choose one writer per unique piece.

    Replicas of a piece (same box and flat range on several ranks) are written once, by the
    replica whose rank has the fewest bytes assigned so far, biggest pieces first.

    One pass over all pieces groups them by key and geometry, so the per-replica work is a
    dict lookup; validation then runs once per unique piece. Coverage of a key is certified
    with a vectorised grid count; any key that fails it (or that the fast check cannot
    decide) is re-checked piece by piece, which finds and describes the problem.
    """
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    bad_meta: set[str] = set()
    per_key: dict[str, list[_Group]] = {}
    index: dict[tuple[Any, ...], _Group] = {}
    for lp in local_plans:
        rank = lp.rank
        for i, p in enumerate(lp.pieces):
            key = p.key
            m = meta.get(key)
            if m is None:
                meta[key] = (p.dtype, p.global_shape)
                per_key[key] = []
            elif m[0] != p.dtype or m[1] != p.global_shape:
                bad_meta.add(key)
            g = (key, p.offset, p.shape, p.flat)
            group = index.get(g)
            if group is None:
                group = index[g] = _Group(p)
                per_key[key].append(group)
            group.holders.append((rank, i))
            if p.main:
                group.mains.append(rank)
    del index
    for key, unique in per_key.items():
        if key in bad_meta:
            _check_tensor(key, _items(local_plans, key))
        for group in unique:
            _check_mains(key, group)
        shape = meta[key][1]
        if not _certify_coverage(shape, unique):
            _check_coverage(key, shape, unique)
    groups = [group for unique in per_key.values() for group in unique]
    order = sorted(
        (-group.piece.nbytes, group.piece.key, str(group.piece.geometry), j)
        for j, group in enumerate(groups)
    )
    loads = [0] * len(local_plans)
    chosen: list[list[int]] = [[] for _ in local_plans]
    for *_, j in order:
        group = groups[j]
        writers = group.holders
        if len(writers) == 1:
            rank, index_ = writers[0]
        else:
            rank, index_ = min(writers, key=lambda h: (loads[h[0]], h[0]))
        loads[rank] += group.piece.nbytes
        chosen[rank].append(index_)
    object_writes = _plan_objects(local_plans)
    return GlobalPlan(
        {key: meta[key] for key in per_key},
        tuple(
            RankAssignment(tuple(sorted(chosen[r])), tuple(object_writes[r]))
            for r in range(len(local_plans))
        ),
    )


class _Group:
    """The holders of one unique piece: ``(rank, index)`` pairs and the ranks holding it as main."""

    __slots__ = ("holders", "mains", "piece")

    def __init__(self, piece: PieceDesc) -> None:
        self.piece = piece
        self.holders: list[tuple[int, int]] = []
        self.mains: list[int] = []


def _items(local_plans: Sequence[LocalPlan], key: str) -> list[tuple[int, int, PieceDesc]]:
    return [(lp.rank, i, p) for lp in local_plans for i, p in enumerate(lp.pieces) if p.key == key]


def _describe_piece(p: PieceDesc) -> str:
    flat = f", flat range [{p.flat[0]}, {p.flat[1]})" if p.flat else ""
    return f"the piece at offset {p.offset} of shape {p.shape}{flat}"


def _is_empty(p: PieceDesc) -> bool:
    """A piece of no element (an uneven split that gave a rank nothing)."""
    return (p.flat[1] <= p.flat[0]) if p.flat is not None else math.prod(p.shape) == 0


def _check_mains(key: str, group: _Group) -> None:
    if len(group.mains) == 1:
        return
    if _is_empty(group.piece):
        return  # nothing to write: any number of ranks may call it theirs (Megatron saves it)
    desc = _describe_piece(group.piece)
    if not group.mains:
        raise ValidationError(
            f"{key!r}: {desc} held by {describe_ranks([r for r, _ in group.holders])} has no main replica; "
            "exactly one holder must use replica_id 0 (all zeros)"
        )
    raise ValidationError(
        f"{key!r}: {desc} is held as main replica (replica_id 0) by {describe_ranks(group.mains)}; "
        "replicas must have distinct, non-zero replica ids on all but one rank"
    )


def _check_tensor(key: str, items: list[tuple[int, int, PieceDesc]]) -> tuple[str, tuple[int, ...]]:
    variants: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    for rank, _, p in items:
        variants[(p.dtype, p.global_shape)].append(rank)
    if len(variants) > 1:
        parts = "; ".join(
            f"{describe_ranks(rs)} declare {dt} {list(shape)}"
            for (dt, shape), rs in variants.items()
        )
        raise ValidationError(f"{key!r}: ranks disagree on dtype or global shape: {parts}")
    return next(iter(variants))


def _certify_coverage(shape: tuple[int, ...], unique: list[_Group]) -> bool:
    """True only if the unique pieces tile ``shape`` exactly; False means "check piece by piece".

    Pieces with the same chunk box (flat ranges of one distributed-optimizer chunk, say) are
    checked as disjoint intervals of that chunk; the chunk boxes must then lie inside the
    shape and be pairwise disjoint, and the element counts must add up to the whole.
    """
    ndim = len(shape)
    if ndim == 0:
        return False
    chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
    covered = 0
    for group in unique:
        p = group.piece
        if len(p.offset) != ndim or len(p.shape) != ndim:
            return False
        if p.flat is None:
            a, b = 0, math.prod(p.shape)
        else:
            a, b = p.flat
            if not 0 <= a <= b <= math.prod(p.shape):
                return False
        if b > a:
            chunks.setdefault((p.offset, p.shape), []).append((a, b))
            covered += b - a
    if covered != math.prod(shape):
        return False
    for ranges in chunks.values():
        if len(ranges) > 1:
            ranges.sort()
            if any(nxt[0] < prev[1] for prev, nxt in itertools.pairwise(ranges)):
                return False
    if not chunks:
        return covered == 0
    offsets = np.array([c[0] for c in chunks], dtype=np.int64)
    ends = offsets + np.array([c[1] for c in chunks], dtype=np.int64)
    if (offsets < 0).any() or (ends > np.array(shape, dtype=np.int64)).any():
        return False
    return boxes_disjoint(offsets, ends) is True


def _check_coverage(key: str, shape: tuple[int, ...], unique: list[_Group]) -> None:
    """Piece by piece: raise naming the first overlap or a hole (the fast check found one)."""
    boxes: list[Box] = []
    owner: list[tuple[PieceDesc, list[int]]] = []
    for group in unique:
        p = group.piece
        for b in p.boxes():
            boxes.append(b)
            owner.append((p, [r for r, _ in group.holders]))
    try:
        overlap = find_overlap(boxes)
    except LayoutTooFragmentedError as e:
        raise ValidationError(f"{key!r}: {e}; save fewer, larger pieces") from None
    if overlap is not None:
        (pa, ra), (pb, rb) = owner[overlap[0]], owner[overlap[1]]
        raise ValidationError(
            f"{key!r}: {_describe_piece(pa)} ({describe_ranks(ra)}) overlaps {_describe_piece(pb)} ({describe_ranks(rb)}); "
            "each element must be saved by exactly one piece (mark copies as replicas with a non-zero replica_id)"
        )
    covered = sum(b.numel for b in boxes)
    total = math.prod(shape)
    if covered != total:
        hole = first_uncovered(shape, boxes)
        where = f", e.g. index {hole}" if hole is not None else ""
        raise ValidationError(
            f"{key!r}: the pieces of all ranks cover {covered} of {total} elements of shape {list(shape)}{where}; "
            "some rank is missing its piece of this tensor"
        )


def _plan_objects(local_plans: Sequence[LocalPlan]) -> list[list[int]]:
    writes: list[list[int]] = [[] for _ in local_plans]
    by_ukey: dict[str, list[tuple[int, int, ObjectDesc]]] = defaultdict(list)
    shapes: dict[str, dict[tuple[int, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
    for lp in local_plans:
        for i, o in enumerate(lp.objects):
            by_ukey[o.unique_key].append((lp.rank, i, o))
            shapes[o.key][o.global_shape].append(lp.rank)
    for key, variants in shapes.items():
        if len(variants) > 1:
            parts = "; ".join(f"{describe_ranks(rs)} use {list(s)}" for s, rs in variants.items())
            raise ValidationError(f"object {key!r}: ranks disagree on global_shape: {parts}")
    cells: dict[str, int] = defaultdict(int)
    for ukey, holders in by_ukey.items():
        mains = [(r, i) for r, i, o in holders if o.main]
        if len(mains) != 1:
            ranks = [r for r, _ in mains] if mains else [r for r, _, _ in holders]
            what = (
                "no holder with replica_id 0"
                if not mains
                else f"replica_id 0 on {describe_ranks(ranks)}"
            )
            raise ValidationError(
                f"object {ukey!r}: {what}; exactly one holder must be the main replica"
            )
        writes[mains[0][0]].append(mains[0][1])
        cells[holders[0][2].key] += 1
    for key, variants in shapes.items():
        (shape,) = variants
        if cells[key] != math.prod(shape):
            raise ValidationError(
                f"object {key!r}: {cells[key]} of the {math.prod(shape)} cells of global_shape {list(shape)} are saved; "
                "every cell of the grid needs one main replica"
            )
    return [sorted(w) for w in writes]
