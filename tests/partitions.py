"""Random and named partitions of a global tensor into ShardedTensors, for resharding tests."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from shardsafe import ShardedTensor


def grid_boxes(
    shape: Sequence[int], rng: random.Random, max_cuts: int = 2
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random (uneven) grid of boxes tiling ``shape``."""
    axes = []
    for n in shape:
        cuts = (
            sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, max_cuts)))) if n > 1 else []
        )
        bounds = [0, *cuts, n]
        axes.append(list(zip(bounds[:-1], bounds[1:])))
    boxes = [((), ())]
    for ranges in axes:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in ranges]
    return boxes


def flat_splits(numel: int, rng: random.Random, max_parts: int = 3) -> list[tuple[int, int]]:
    k = rng.randint(1, max_parts)
    cuts = sorted(rng.sample(range(1, numel), min(numel - 1, k - 1))) if numel > 1 else []
    bounds = [0, *cuts, numel]
    return list(zip(bounds[:-1], bounds[1:]))


def region(
    full: torch.Tensor, offset: Sequence[int], shape: Sequence[int], flat: tuple[int, int] | None
) -> torch.Tensor:
    view = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    if flat is not None:
        return view.reshape(-1)[flat[0] : flat[1]]
    return view


def random_partition(
    key: str,
    full: torch.Tensor,
    rng: random.Random,
    flatten: float = 0.4,
    replicas: float = 0.2,
    with_data: bool = True,
) -> list[ShardedTensor]:
    """ShardedTensors tiling ``full``: uneven boxes, some split into flat ranges, some replicated."""
    out = []
    for offset, shape in grid_boxes(tuple(full.shape), rng):
        pieces: list[tuple[int, int] | None] = [None]
        if full.ndim and rng.random() < flatten:
            pieces = list(flat_splits(math.prod(shape), rng))
        for flat in pieces:
            copies = 2 if rng.random() < replicas else 1
            for replica in range(copies):
                data = (
                    region(full, offset, shape, flat).clone()
                    if with_data
                    else torch.zeros_like(region(full, offset, shape, flat))
                )
                out.append(
                    ShardedTensor.from_global_offset(
                        key,
                        data,
                        tuple(full.shape),
                        offset,
                        replica_id=replica,
                        flattened_range=slice(*flat) if flat else None,
                        local_shape=shape if flat else None,
                    )
                )
    return out


def expected(full: torch.Tensor, st: ShardedTensor) -> torch.Tensor:
    box = st.chunk_box
    return region(full, box.offset, box.shape, st.flat_bounds).reshape(
        st.data.shape if st.data is not None else -1
    )
