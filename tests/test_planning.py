"""The save planner: validation messages, writer balancing, determinism, and agreement with a
piece-by-piece reference planner on random layouts."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partitions import flat_splits, grid_boxes

from shardsafe.errors import ValidationError, describe_ranks
from shardsafe.geometry import Box, boxes_disjoint, find_overlap, first_uncovered
from shardsafe.planning import (
    GlobalPlan,
    LocalPlan,
    ObjectDesc,
    PieceDesc,
    RankAssignment,
    _plan_objects,
    make_global_plan,
)


def piece(
    key: str,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    global_shape: tuple[int, ...] = (8, 4),
    flat: tuple[int, int] | None = None,
    main: bool = True,
    dtype: str = "float32",
) -> PieceDesc:
    numel = flat[1] - flat[0] if flat else math.prod(shape)
    return PieceDesc(key, dtype, global_shape, offset, shape, flat, main, numel * 4)


def plans(*per_rank: Sequence[PieceDesc]) -> list[LocalPlan]:
    return [LocalPlan(r, tuple(pieces), ()) for r, pieces in enumerate(per_rank)]


def error(local_plans: list[LocalPlan]) -> str:
    with pytest.raises(ValidationError) as info:
        make_global_plan(local_plans)
    return str(info.value)


# --------------------------------------------------------------------------- validation messages


def test_overlap_names_key_pieces_and_ranks():
    msg = error(
        plans(
            [piece("w", (0, 0), (5, 4))],
            [piece("w", (4, 0), (4, 4))],
        )
    )
    assert msg.startswith("'w': ")
    assert "offset (0, 0) of shape (5, 4) (rank 0)" in msg
    assert "overlaps the piece at offset (4, 0) of shape (4, 4) (rank 1)" in msg


def test_overlapping_flat_ranges_of_one_chunk():
    msg = error(
        plans(
            [piece("w", (0, 0), (8, 4), flat=(0, 20))],
            [piece("w", (0, 0), (8, 4), flat=(16, 32))],
        )
    )
    assert "'w'" in msg and "flat range [0, 20)" in msg and "flat range [16, 32)" in msg
    assert "(rank 0)" in msg and "(rank 1)" in msg and "overlaps" in msg


def test_gap_names_key_count_and_a_missing_index():
    msg = error(plans([piece("w", (0, 0), (4, 4))], [piece("w", (4, 0), (2, 4))]))
    assert "'w': the pieces of all ranks cover 24 of 32 elements of shape [8, 4]" in msg
    assert "index (6, 0)" in msg and "missing its piece" in msg


def test_gap_in_flat_ranges():
    msg = error(
        plans(
            [piece("w", (0, 0), (8, 4), flat=(0, 10))],
            [piece("w", (0, 0), (8, 4), flat=(11, 32))],
        )
    )
    assert "cover 31 of 32 elements" in msg and "index (2, 2)" in msg


def test_disagreeing_dtype_and_shape_name_the_ranks():
    msg = error(
        plans(
            [piece("w", (0, 0), (4, 4))],
            [piece("w", (4, 0), (4, 4), dtype="bfloat16")],
            [piece("w", (4, 0), (4, 4), main=False)],
        )
    )
    assert msg == (
        "'w': ranks disagree on dtype or global shape: ranks 0, 2 declare float32 [8, 4]; "
        "rank 1 declare bfloat16 [8, 4]"
    )
    msg = error(
        plans([piece("w", (0, 0), (4, 4))], [piece("w", (4, 0), (4, 4), global_shape=(9, 4))])
    )
    assert "'w'" in msg and "rank 0 declare float32 [8, 4]" in msg
    assert "rank 1 declare float32 [9, 4]" in msg


def test_no_main_replica_names_every_holder():
    msg = error(
        plans(
            [piece("w", (0, 0), (8, 4), main=False)],
            [piece("w", (0, 0), (8, 4), main=False)],
            [piece("w", (0, 0), (8, 4), main=False)],
        )
    )
    assert msg.startswith("'w': the piece at offset (0, 0) of shape (8, 4) held by ranks 0, 1, 2")
    assert "has no main replica" in msg


def test_two_mains_name_both_ranks():
    msg = error(
        plans(
            [piece("w", (0, 0), (8, 4))],
            [piece("w", (0, 0), (8, 4), main=False)],
            [piece("w", (0, 0), (8, 4))],
        )
    )
    assert "'w'" in msg and "held as main replica (replica_id 0) by ranks 0, 2" in msg


def test_many_ranks_are_abbreviated():
    holders = [[piece("w", (0, 0), (8, 4), main=False)] for _ in range(20)]
    msg = error(plans(*holders))
    assert "ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (+12 more)" in msg


def test_the_first_bad_key_is_reported():
    msg = error(
        plans(
            [piece("a", (0, 0), (8, 4)), piece("b", (0, 0), (4, 4))],
            [piece("a", (0, 0), (8, 4), main=False)],
        )
    )
    assert msg.startswith("'b': the pieces of all ranks cover 16 of 32")


# --------------------------------------------------------------------------- assignments


def test_replicated_writes_are_balanced_over_the_replicas():
    # 8 equal pieces, each held by all 4 ranks: every rank writes 2
    per_rank = [
        [piece(f"t{i}", (0,), (16,), global_shape=(16,), main=r == 0) for i in range(8)]
        for r in range(4)
    ]
    plan = make_global_plan(plans(*per_rank))
    assert [len(a.pieces) for a in plan.assignments] == [2, 2, 2, 2]
    assert plan.bytes_per_rank(plans(*per_rank)) == [128, 128, 128, 128]


def test_biggest_pieces_go_first_to_the_least_loaded_rank():
    huge = piece("huge", (0, 0), (16, 4), global_shape=(16, 4))  # 256 bytes, only on rank 0
    big = [piece("big", (0, 0), (8, 4), main=r == 0) for r in range(2)]  # 128 bytes, both
    small = [piece("small", (0,), (8,), global_shape=(8,), main=r == 1) for r in range(2)]
    # huge first -> rank 0 (256); big goes to the lighter rank 1 (128); small to rank 1 (160)
    lp = plans([small[0], huge, big[0]], [big[1], small[1]])
    plan = make_global_plan(lp)
    assert plan.assignments[0] == RankAssignment((1,), ())
    assert plan.assignments[1] == RankAssignment((0, 1), ())
    assert plan.bytes_per_rank(lp) == [256, 160]


def test_unique_pieces_are_written_by_their_holder_and_objects_by_their_main():
    lp = [
        LocalPlan(
            0,
            (piece("w", (0, 0), (4, 4)),),
            (ObjectDesc("rng/shard_0_2", "rng", (2,), (0,), True),),
        ),
        LocalPlan(
            1,
            (piece("w", (4, 0), (4, 4)),),
            (ObjectDesc("rng/shard_1_2", "rng", (2,), (1,), True),),
        ),
    ]
    plan = make_global_plan(lp)
    assert plan.tensors == {"w": ("float32", (8, 4))}
    assert plan.assignments == (RankAssignment((0,), (0,)), RankAssignment((0,), (0,)))


def _layout(tp: int, dp: int) -> list[LocalPlan]:
    """TP-split weights replicated over DP, flat optimizer ranges split over DP."""
    out = []
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        rows = 16 // tp
        pieces = [
            piece("w", (t * rows, 0), (rows, 4), global_shape=(16, 4), main=d == 0),
            piece("b", (0,), (4,), global_shape=(4,), main=rank == 0),
        ]
        n = rows * 4
        a, b = n * d // dp, n * (d + 1) // dp
        pieces.append(piece("exp_avg", (t * rows, 0), (rows, 4), global_shape=(16, 4), flat=(a, b)))
        out.append(LocalPlan(rank, tuple(reversed(pieces)), ()))
    return out


def test_plan_is_deterministic_and_order_independent_of_dict_state():
    lp = _layout(2, 4)
    first = make_global_plan(lp)
    again = make_global_plan([LocalPlan.from_json(json.loads(json.dumps(p.to_json()))) for p in lp])
    assert first == again


def test_plan_is_the_same_in_other_processes():
    """Every rank computes the plan; string hashing differs between processes."""
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from test_planning import _layout; "
        "from shardsafe.planning import make_global_plan; "
        "p = make_global_plan(_layout(4, 4)); "
        "print(json.dumps([sorted(p.tensors.items()), [a.to_json() for a in p.assignments]]))"
    )
    procs = [  # concurrently: each interpreter spends seconds importing torch
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2", "3")
    ]
    outs = set()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            outs.add(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert len(outs) == 1 and outs != {""}


# --------------------------------------------------------------------------- the vectorised helper


@st.composite
def box_sets(draw):
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(0, 6))
    offsets = [[draw(st.integers(0, 5)) for _ in range(ndim)] for _ in range(n)]
    sizes = [[draw(st.integers(0, 3)) for _ in range(ndim)] for _ in range(n)]
    return ndim, offsets, sizes


@given(box_sets())
@settings(max_examples=300, deadline=None)
def test_boxes_disjoint_matches_find_overlap(case):
    ndim, offsets, sizes = case
    boxes = [Box(tuple(o), tuple(s)) for o, s in zip(offsets, sizes)]
    off = np.array(offsets, dtype=np.int64).reshape(len(offsets), ndim)
    ends = off + np.array(sizes, dtype=np.int64).reshape(len(sizes), ndim)
    assert boxes_disjoint(off, ends) == (find_overlap(boxes) is None)


def test_boxes_disjoint_declines_huge_grids():
    n = 200
    off = np.stack([np.arange(n), np.arange(n)], axis=1)
    assert boxes_disjoint(off, off + 1, max_cells=1000) is None
    assert boxes_disjoint(off, off + 1) is True


# --------------------------------------------------------------------------- against the reference


def reference_global_plan(local_plans: Sequence[LocalPlan]) -> GlobalPlan:
    """The planner written piece by piece, as the specification of the fast one."""
    by_key: dict[str, list[tuple[int, int, PieceDesc]]] = defaultdict(list)
    for lp in local_plans:
        for i, p in enumerate(lp.pieces):
            by_key[p.key].append((lp.rank, i, p))
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    groups: list[tuple[int, str, tuple[Any, ...], list[tuple[int, int]]]] = []
    for key, items in by_key.items():
        variants: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
        for rank, _, p in items:
            variants[(p.dtype, p.global_shape)].append(rank)
        if len(variants) > 1:
            parts = "; ".join(
                f"{describe_ranks(rs)} declare {dt} {list(shape)}"
                for (dt, shape), rs in variants.items()
            )
            raise ValidationError(f"{key!r}: ranks disagree on dtype or global shape: {parts}")
        tensors[key] = next(iter(variants))
        by_geometry: dict[tuple[Any, ...], list[tuple[int, int, PieceDesc]]] = defaultdict(list)
        for rank, i, p in items:
            by_geometry[p.geometry].append((rank, i, p))
        for geometry, holders in by_geometry.items():
            mains = [r for r, _, p in holders if p.main]
            desc = _describe(holders[0][2])
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
        boxes: list[Box] = []
        owner: list[tuple[PieceDesc, list[int]]] = []
        for holders in by_geometry.values():
            p = holders[0][2]
            for b in p.boxes():
                boxes.append(b)
                owner.append((p, [r for r, _, _ in holders]))
        overlap = find_overlap(boxes)
        if overlap is not None:
            (pa, ra), (pb, rb) = owner[overlap[0]], owner[overlap[1]]
            raise ValidationError(
                f"{key!r}: {_describe(pa)} ({describe_ranks(ra)}) overlaps {_describe(pb)} ({describe_ranks(rb)}); "
                "each element must be saved by exactly one piece (mark copies as replicas with a non-zero replica_id)"
            )
        shape = tensors[key][1]
        covered = sum(b.numel for b in boxes)
        if covered != math.prod(shape):
            hole = first_uncovered(shape, boxes)
            where = f", e.g. index {hole}" if hole is not None else ""
            raise ValidationError(
                f"{key!r}: the pieces of all ranks cover {covered} of {math.prod(shape)} elements of shape {list(shape)}{where}; "
                "some rank is missing its piece of this tensor"
            )
    loads = [0] * len(local_plans)
    chosen: list[list[int]] = [[] for _ in local_plans]
    groups.sort(key=lambda g: (-g[0], g[1], str(g[2])))
    for nbytes, _, _, writers in groups:
        rank, index = min(writers, key=lambda h: (loads[h[0]], h[0]))
        loads[rank] += nbytes
        chosen[rank].append(index)
    objects = _plan_objects(local_plans)
    return GlobalPlan(
        tensors,
        tuple(
            RankAssignment(tuple(sorted(chosen[r])), tuple(objects[r]))
            for r in range(len(local_plans))
        ),
    )


def _describe(p: PieceDesc) -> str:
    flat = f", flat range [{p.flat[0]}, {p.flat[1]})" if p.flat else ""
    return f"the piece at offset {p.offset} of shape {p.shape}{flat}"


def random_layout(seed: int) -> list[LocalPlan]:
    """A random valid layout over 1-4 ranks, then (usually) one random defect."""
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    per_rank: list[list[PieceDesc]] = [[] for _ in range(world)]
    for k in range(rng.randint(1, 3)):
        key = f"t{k}"
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(["float32", "bfloat16"])
        for offset, size in grid_boxes(shape, rng):
            numel = math.prod(size)
            flats: list[tuple[int, int] | None] = [None]
            if numel > 1 and rng.random() < 0.4:
                flats = list(flat_splits(numel, rng))
            for flat in flats:
                n = flat[1] - flat[0] if flat else numel
                holders = rng.sample(range(world), rng.randint(1, world))
                main = rng.choice(holders)
                for r in holders:
                    per_rank[r].append(
                        PieceDesc(key, dtype, shape, offset, size, flat, r == main, n * 2)
                    )
    defect = rng.randrange(8)
    nonempty = [r for r in range(world) if per_rank[r]]
    r = rng.choice(nonempty)
    j = rng.randrange(len(per_rank[r]))
    p = per_rank[r][j]
    if defect == 1:  # a hole
        del per_rank[r][j]
    elif defect == 2:  # a second main, or no main at all
        per_rank[r][j] = replace(p, main=not p.main)
    elif defect == 3:
        per_rank[r][j] = replace(p, dtype="int64")
    elif defect == 4 and p.global_shape:
        per_rank[r][j] = replace(p, global_shape=(p.global_shape[0] + 1, *p.global_shape[1:]))
    elif defect == 5 and p.global_shape:  # an extra main piece overlapping others
        full = p.global_shape
        off = tuple(rng.randint(0, s - 1) for s in full)
        size = tuple(rng.randint(1, s - o) for o, s in zip(off, full))
        per_rank[rng.randrange(world)].append(
            PieceDesc(p.key, p.dtype, full, off, size, None, True, math.prod(size) * 2)
        )
    for pieces in per_rank:
        rng.shuffle(pieces)
    return [LocalPlan(r, tuple(pieces), ()) for r, pieces in enumerate(per_rank)]


def outcome(fn: Any, lp: list[LocalPlan]) -> Any:
    try:
        return fn(lp)
    except Exception as e:
        return (type(e).__name__, str(e))


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=400, deadline=None)
def test_matches_the_reference_planner(seed):
    lp = random_layout(seed)
    assert outcome(make_global_plan, lp) == outcome(reference_global_plan, lp)


def test_matches_the_reference_on_a_3d_parallel_layout():
    lp = _layout(4, 3)
    assert make_global_plan(lp) == reference_global_plan(lp)
