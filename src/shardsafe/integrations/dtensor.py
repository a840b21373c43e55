"""DTensor state dicts (FSDP2, tensor parallel) as sharded state dicts.

``to_sharded_state_dict(model.state_dict())`` turns every DTensor into the ShardedTensor(s) of
its local shard, placed with ``from_global_offset`` at the global box the placements give it,
so a checkpoint saved from one mesh loads into any other mesh, into Megatron-style
ShardedTensors or into a plain module in one process. The data of each piece is a view of
the DTensor's local tensor (the live storage of an FSDP2/TP parameter), so ``load`` fills the
model in place.

Geometry follows DTensor's own semantics: ``Shard(d)`` splits like ``torch.chunk`` (7 rows
over 2 ranks give 4 + 3, trailing ranks may get nothing), mesh dimensions apply left to right,
and ``_StridedShard(d, split_factor)`` (FSDP2 on top of tensor parallel) first cuts the
dimension into ``split_factor`` parts, splits each, and concatenates this rank's sub-chunks.
When that leaves a local shard that is not one box of the global tensor, it is saved as
several boxes (one ShardedTensor per box, grouped by a :class:`ShardedTensorFactory`, whose
``replica_id`` field carries the outer replica id).
``Partial`` placements hold pending reductions and are refused.

Replica ids: the coordinates of this rank on the mesh dimensions with ``Replicate()`` form
the replica id, so exactly one rank (coordinate 0 on all of them) is the main replica of
each piece. A DTensor living on a sub-mesh that lacks a dimension of the root mesh which
other DTensors of the same state dict use is replicated over that dimension (FSDP2 + TP:
parameters outside the TP plan sit on the data-parallel mesh only, one copy per TP rank),
so those coordinates join its replica id too. Plain tensors in a ``model.state_dict()``
(buffers, unsharded parameters) become replicated ShardedTensors with ``replica_id`` = rank,
saved once by rank 0; other values stay common state.

``dtensor_aware(tree)`` is the hook for sharded state dicts that merely *contain* DTensors:
it replaces only the DTensor leaves (by factories whose load result is the DTensor itself)
and leaves everything else alone.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..sharding import (
    ReplicaId,
    ShardedTensor,
    ShardedTensorFactory,
)

Run = tuple[int, int]
"""``(global start, length)``: a contiguous run of indices along one tensor dimension."""


class LocalBox(NamedTuple):
    """One box of a local shard: where it lies in the global tensor and in the local tensor."""

    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]


# --------------------------------------------------------------------------- detection


def _dtensor_type() -> type | None:
    """DTensor's class, or None when its module was never imported (then no DTensor can
    exist, and plain users pay nothing for the check)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # new, old home
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(cls, type):
            return cls
    return None


def is_dtensor(value: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(value, cls)


def has_dtensor(tree: Any) -> bool:
    """True if a DTensor appears in the nested dicts/lists of ``tree`` (the containers a
    sharded state dict is made of)."""
    cls = _dtensor_type()
    if cls is None:
        return False

    def walk(node: Any) -> bool:
        if isinstance(node, cls):
            return True
        if isinstance(node, Mapping):
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(tree)


# --------------------------------------------------------------------------- geometry


def _chunk_bounds(length: int, chunks: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``length`` items in ``chunks`` parts (may be empty)."""
    size = -(-length // chunks) if length else 0
    return min(index * size, length), min((index + 1) * size, length)


def _take(runs: list[Run], start: int, stop: int) -> list[Run]:
    """The runs covering positions ``[start, stop)`` of the index sequence ``runs`` spell out."""
    out: list[Run] = []
    pos = 0
    for first, n in runs:
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            out.append((first + a - pos, b - a))
        pos += n
        if pos >= stop:
            break
    return out


def _length(runs: list[Run]) -> int:
    return sum(n for _, n in runs)


def _merged(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for first, n in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((first, n))
    return out


def _placement_kind(placement: Any) -> tuple[str, int, int]:
    """``(kind, dim, split_factor)`` with kind ``shard``, ``strided`` or ``replicate``."""
    try:
        from torch.distributed.tensor import placement_types as pt
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import placement_types as pt  # type: ignore[no-redef]
    Shard, Replicate, Partial = pt.Shard, pt.Replicate, pt.Partial
    strided = getattr(pt, "_StridedShard", None)
    # _StridedShard subclassed Shard in some releases: test it first.
    if strided is not None and isinstance(placement, strided):
        return "strided", int(placement.dim), int(placement.split_factor)
    if isinstance(placement, Shard):
        return "shard", int(placement.dim), 1
    if isinstance(placement, Replicate):
        return "replicate", -1, 1
    if isinstance(placement, Partial):
        raise ValueError(
            f"a DTensor with placement {placement} holds partial values awaiting a reduction and "
            "cannot be checkpointed; redistribute it to Replicate() or Shard() first"
        )
    raise ValueError(f"unsupported DTensor placement {placement!r}")


def dtensor_local_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> list[LocalBox]:
    """The boxes of the global tensor held by the rank at ``coordinate``, with DTensor's
    semantics (see the module docstring); empty when that rank's shard is empty.

    Computed from the full index sets rather than a single offset because ``_StridedShard``
    can leave a local shard that is not one contiguous box.
    """
    if len(mesh_shape) != len(placements) or len(coordinate) != len(placements):
        raise ValueError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and "
            f"{len(placements)} placements do not match"
        )
    runs: list[list[Run]] = [[(0, int(n))] if n else [] for n in global_shape]
    for size, coord, placement in zip(mesh_shape, coordinate, placements, strict=True):
        kind, dim, split = _placement_kind(placement)
        if kind == "replicate":
            continue
        if not 0 <= dim < len(runs):
            raise ValueError(f"placement {placement} shards dim {dim} of a {len(runs)}-d tensor")
        current = runs[dim]
        length = _length(current)
        if kind == "shard":
            runs[dim] = _take(current, *_chunk_bounds(length, int(size), int(coord)))
            continue
        taken: list[Run] = []
        for part in range(split):
            a, b = _chunk_bounds(length, split, part)
            c0, c1 = _chunk_bounds(b - a, int(size), int(coord))
            taken += _take(current, a + c0, a + c1)
        runs[dim] = taken
    per_dim = [_merged(r) for r in runs]
    if any(not r for r in per_dim):
        return []
    boxes: list[LocalBox] = []
    for combo in _product([_with_local_offsets(r) for r in per_dim]):
        boxes.append(
            LocalBox(
                tuple(g for g, _, _ in combo),
                tuple(n for _, n, _ in combo),
                tuple(lo for _, _, lo in combo),
            )
        )
    return boxes


def _with_local_offsets(runs: list[Run]) -> list[tuple[int, int, int]]:
    out, pos = [], 0
    for first, n in runs:
        out.append((first, n, pos))
        pos += n
    return out


def _product(lists: list[list[tuple[int, int, int]]]) -> list[tuple[tuple[int, int, int], ...]]:
    combos: list[tuple[tuple[int, int, int], ...]] = [()]
    for options in lists:
        combos = [(*c, o) for c in combos for o in options]
    return combos


def _root_mesh(mesh: Any) -> Any:
    get = getattr(mesh, "_get_root_mesh", None)
    if callable(get):
        return get()
    try:  # older torch
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except (ImportError, AttributeError):
        return mesh


def _implicit_replicas(dtensors: Iterable[Any]) -> dict[int, tuple[int, ...]]:
    """``id(dtensor) -> coordinates`` on the dims of its root mesh that other DTensors of the
    same root use but its own mesh lacks.

    FSDP2 on top of tensor parallelism puts the parameters outside the TP plan on the
    data-parallel sub-mesh only, yet every TP rank holds a copy: those copies are replicas
    over the TP dim. A root dim that no DTensor uses (pipeline stages, which hold different
    keys) is not taken for replication.
    """
    used: dict[int, set[str]] = {}
    found: list[tuple[Any, Any, tuple[str, ...]]] = []
    for dt in dtensors:
        mesh = dt.device_mesh
        root = _root_mesh(mesh)
        names = tuple(mesh.mesh_dim_names or ())
        if not names or not root.mesh_dim_names:
            continue
        used.setdefault(id(root), set()).update(names)
        found.append((dt, root, names))
    out: dict[int, tuple[int, ...]] = {}
    for dt, root, names in found:
        coordinate = root.get_coordinate()
        if coordinate is None:
            continue
        extra = tuple(
            int(coordinate[i])
            for i, name in enumerate(root.mesh_dim_names)
            if name in used[id(root)] and name not in names
        )
        if extra:
            out[id(dt)] = extra
    return out


def _parts(replica_id: ReplicaId) -> list[int]:
    if isinstance(replica_id, tuple):
        return list(replica_id)
    return [replica_id] if replica_id else []


def _combine(outer: ReplicaId, extra: tuple[int, ...]) -> ReplicaId:
    return (*_parts(outer), *extra) if extra else outer


def _replica_id(
    coordinate: Sequence[int], placements: Sequence[Any], outer: ReplicaId
) -> ReplicaId:
    """``outer`` followed by the coordinates on replicated mesh dims (all zero: main)."""
    parts = _parts(outer) + [
        int(c)
        for c, p in zip(coordinate, placements, strict=True)
        if _placement_kind(p)[0] == "replicate"
    ]
    if not parts:
        return 0
    return tuple(parts) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------- conversion


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The DTensor's local shard, detached but sharing storage (writes reach the parameter)."""
    local = getattr(dtensor, "_local_tensor", None)
    if local is None:
        local = dtensor.to_local()
    return local.detach()


def dtensor_pieces(
    key: str,
    dtensor: Any,
    *,
    data: torch.Tensor | None = None,
    outer_replica_id: ReplicaId = 0,
) -> list[ShardedTensor]:
    """The ShardedTensor(s) of this rank's shard of ``dtensor`` under ``key``.

    ``data`` stands in for the local shard (a tensor of the same local shape laid out the
    same way, e.g. an optimizer state of the parameter); ``outer_replica_id`` is prepended
    to the replica id when the same DTensor also lives on ranks outside its mesh (a TP mesh
    replicated by plain data parallelism). Empty shards give no piece.
    """
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh
        return []
    local = local_tensor(dtensor) if data is None else data
    global_shape = tuple(int(s) for s in dtensor.shape)
    placements = tuple(dtensor.placements)
    replica = _replica_id(coordinate, placements, outer_replica_id)
    if math.prod(global_shape) == 0:
        # Nothing to store but the shape: every rank of the mesh holds the same empty box.
        flat = int(sum(c * math.prod(mesh.shape[i + 1 :]) for i, c in enumerate(coordinate)))
        rid: ReplicaId = (*replica, flat) if isinstance(replica, tuple) else (replica, flat)
        return [
            ShardedTensor.from_global_offset(
                key,
                torch.empty(global_shape, dtype=local.dtype),
                global_shape,
                (0,) * len(global_shape),
                replica_id=rid,
            )
        ]
    boxes = dtensor_local_boxes(global_shape, tuple(mesh.shape), tuple(coordinate), placements)
    expected = tuple(
        max((b.local_offset[d] + b.shape[d] for b in boxes), default=0)
        for d in range(len(global_shape))
    )
    if boxes and tuple(local.shape) != expected:
        raise ValueError(
            f"{key}: the local shard has shape {tuple(local.shape)}, but placements {placements} "
            f"on mesh {tuple(mesh.shape)} at {tuple(coordinate)} give {expected} of {global_shape}"
        )
    pieces = []
    for box in boxes:
        view = local[
            tuple(slice(o, o + n) for o, n in zip(box.local_offset, box.shape, strict=True))
        ]
        pieces.append(
            ShardedTensor.from_global_offset(
                key, view, global_shape, box.global_offset, replica_id=replica
            )
        )
    return pieces


def _convert_dtensor(key: str, dtensor: Any, outer: ReplicaId) -> Any:
    pieces = dtensor_pieces(key, dtensor, outer_replica_id=outer)
    if len(pieces) == 1:
        return pieces[0]
    # Several boxes, or none (an empty shard): a factory keeps the key and gives the local
    # tensor back on load, like a single ShardedTensor would.
    local = local_tensor(dtensor)
    return ShardedTensorFactory(key, dtensor, _build_pieces, lambda _loaded: local, outer)


def _build_pieces(key: str, dtensor: Any, outer: ReplicaId, _flat: Any) -> list[ShardedTensor]:
    """``ShardedTensorFactory.build_fn``: its ``replica_id`` carries the outer replica id."""
    return dtensor_pieces(key, dtensor, outer_replica_id=outer)


def _group_rank(process_group: Any) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank(process_group))
    return 0


def to_sharded_state_dict(
    state_dict: Mapping[str, Any],
    *,
    prefix: str = "",
    process_group: Any = None,
    outer_replica_id: ReplicaId = 0,
) -> dict[str, Any]:
    """A ``model.state_dict()`` (DTensors or plain tensors) as a sharded state dict.

    Keys are ``prefix + name``. A DTensor becomes a ShardedTensor of its local shard (a
    :class:`ShardedTensorFactory` when the shard is several boxes or empty), a plain tensor
    a replicated ShardedTensor with ``replica_id`` = rank in ``process_group`` (so it is saved once; it
    must hold the same values on every rank), a nested mapping is converted with
    ``name.`` added to the prefix, and anything else stays common state. On load, each
    converted entry comes back as the local tensor it filled in place.
    """
    rank = _group_rank(process_group)
    implicit = _implicit_replicas(v for _, v in _leaves(state_dict) if is_dtensor(v))

    def convert(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in tree.items():
            key = f"{prefix}{name}"
            if is_dtensor(value):
                outer = _combine(outer_replica_id, implicit.get(id(value), ()))
                out[name] = _convert_dtensor(key, value, outer)
            elif isinstance(value, torch.Tensor):
                data = value.detach()
                out[name] = ShardedTensor.from_global_offset(
                    key, data, tuple(data.shape), (0,) * data.ndim, replica_id=rank
                )
            elif isinstance(value, Mapping):
                out[name] = convert(value, f"{key}.")
            else:
                out[name] = value
        return out

    return convert(state_dict, prefix)


def _leaves(tree: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, leaf)`` over nested dicts and lists."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(((*path, str(k)), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*path, str(i)), v) for i, v in enumerate(node))
        else:
            yield path, node


def dtensor_aware(tree: Any, *, prefix: str = "", outer_replica_id: ReplicaId = 0) -> Any:
    """``tree`` with every DTensor leaf replaced by a factory of its pieces; the rest untouched.

    The key of a DTensor is ``prefix`` plus its path of dict keys/list indices joined by
    ``.``; ``load`` gives the DTensor itself back at that place (filled in place). Returns
    ``tree`` itself when it holds no DTensor, so calling it on every save/load is cheap.
    """
    if not has_dtensor(tree):
        return tree
    implicit = _implicit_replicas(v for _, v in _leaves(tree) if is_dtensor(v))

    def factory(key: str, dtensor: Any) -> ShardedTensorFactory:
        outer = _combine(outer_replica_id, implicit.get(id(dtensor), ()))
        return ShardedTensorFactory(key, dtensor, _build_pieces, lambda _loaded: dtensor, outer)

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if is_dtensor(node):
            return factory(prefix + ".".join(path), node)
        if isinstance(node, dict):
            return {k: walk(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(node)]
        return node

    return walk(tree, ())
