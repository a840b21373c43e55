"""Pure planning: every rank's local descriptors -> one validated global save plan.

No I/O and no torch.distributed. Given the same inputs, every process computes the same
plan, so validation errors are the same everywhere and name the key and ranks involved.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ValidationError, describe_ranks
from .geometry import Box, find_overlap, first_uncovered, flat_range_to_boxes


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
    """
    by_key: dict[str, list[tuple[int, int, PieceDesc]]] = defaultdict(list)
    for lp in local_plans:
        for i, p in enumerate(lp.pieces):
            by_key[p.key].append((lp.rank, i, p))
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    groups: list[tuple[int, str, tuple[Any, ...], list[tuple[int, int]]]] = []
    for key, items in by_key.items():
        tensors[key] = _check_tensor(key, items)
        by_geometry: dict[tuple[Any, ...], list[tuple[int, int, PieceDesc]]] = defaultdict(list)
        for rank, i, p in items:
            by_geometry[p.geometry].append((rank, i, p))
        unique: list[tuple[tuple[Any, ...], list[tuple[int, int, PieceDesc]]]] = list(
            by_geometry.items()
        )
        for geometry, holders in unique:
            mains = [r for r, _, p in holders if p.main]
            desc = _describe_piece(holders[0][2])
            if not mains:
                raise ValidationError(
                    f"{key!r}: {desc} held by {describe_ranks([r for r, _, _ in holders])} has no main replica; "
                    "exactly one holder must use replica_id 0 (all zeros)"
                )
            if len(mains) > 1:
                raise ValidationError(
                    f"{key!r}: {desc} is held as main replica (replica_id 0) by {describe_ranks(mains)}; "
                    "replicas must have distinct, non-zero replica ids on all but one rank"
                )
            groups.append((holders[0][2].nbytes, key, geometry, [(r, i) for r, i, _ in holders]))
        _check_coverage(key, tensors[key][1], [(g, h) for g, h in unique])
    loads = [0] * len(local_plans)
    chosen: list[list[int]] = [[] for _ in local_plans]
    groups.sort(key=lambda g: (-g[0], g[1], str(g[2])))
    for nbytes, _, _, writers in groups:
        rank, index = min(writers, key=lambda h: (loads[h[0]], h[0]))
        loads[rank] += nbytes
        chosen[rank].append(index)
    object_writes = _plan_objects(local_plans)
    return GlobalPlan(
        tensors,
        tuple(
            RankAssignment(tuple(sorted(chosen[r])), tuple(object_writes[r]))
            for r in range(len(local_plans))
        ),
    )


def _describe_piece(p: PieceDesc) -> str:
    flat = f", flat range [{p.flat[0]}, {p.flat[1]})" if p.flat else ""
    return f"the piece at offset {p.offset} of shape {p.shape}{flat}"


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


def _check_coverage(
    key: str,
    shape: tuple[int, ...],
    unique: list[tuple[tuple[Any, ...], list[tuple[int, int, PieceDesc]]]],
) -> None:
    boxes: list[Box] = []
    owner: list[tuple[PieceDesc, list[int]]] = []
    for _, holders in unique:
        p = holders[0][2]
        for b in p.boxes():
            boxes.append(b)
            owner.append((p, [r for r, _, _ in holders]))
    overlap = find_overlap(boxes)
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
