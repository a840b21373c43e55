"""What a sharded state dict is made of, with Megatron-Core's names and semantics.

A *sharded state dict* is a nested dict/list whose leaves are:

* :class:`ShardedTensor` — this rank's piece of a global tensor (a box, or a flat range
  of a box), with a replica id telling replicas apart;
* :class:`ShardedObject` — a per-rank Python object placed in an n-d grid (RNG states...);
* :class:`ShardedTensorFactory` — a deferred transform applied the same way on save and load;
* :class:`LocalNonPersistentObject` — returned on load, never saved;
* a plain ``torch.Tensor`` (an ``nn.Parameter``, a ``model.state_dict()`` value) — a whole tensor
  replicated on every rank, keyed by its dotted path (as PyTorch DCP keys it);
* :class:`CoordinatorObject` — common state taken from the coordinator as is, not compared;
* a *Stateful* object (``state_dict()`` and ``load_state_dict()``, as in PyTorch DCP: a module,
  an LR scheduler, :class:`shardsafe.integrations.optimizer.OptimizerState`) — stands for what
  its ``state_dict()`` returns; a load then hands it the loaded value (:func:`resolve_stateful`);
* anything else — *common* state, which must agree across ranks, saved once by the coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .errors import CheckpointError, ValidationError
from .geometry import Box, flat_range_to_boxes
from .looks_sharded import refuse_sharded_leaf

ReplicaId = int | tuple[int, ...]
Path = tuple[str | int, ...]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Megatron's rule: the main replica has an all-zero replica id."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """This rank's piece of the global tensor ``key``.

    The piece is the box ``global_offset + (1,) * prepend_axis_num + local_shape`` of a tensor
    of ``global_shape``; with ``flattened_range`` set, ``data`` is only that 1-D slice of the
    box's row-major flattening (what a distributed optimizer holds).
    """

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None = None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(s) for s in self.axis_fragmentations)
        self.validate_metadata_integrity()

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
        flattened_range: slice | None = None,
    ) -> ShardedTensor:
        """Even splits: each ``(axis, rank_on_axis, fragments_on_axis)`` places ``data`` on that axis.

        Axes below ``prepend_axis_num`` are prepended singleton axes (stacking layers/experts).
        """
        if flattened_range is not None:
            raise ValidationError(
                f"{key}: from_rank_offsets takes no flattened_range; use from_rank_offsets_flat"
            )
        offset, shape, fragments = _place(key, tuple(data.shape), rank_offsets, prepend_axis_num)
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            shape,
            offset,
            fragments,
            replica_id,
            prepend_axis_num,
            allow_shape_mismatch,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...] | torch.Size,
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """``data`` is the slice ``flattened_range`` of the flattened local chunk of ``non_flat_local_shape``."""
        local = tuple(int(s) for s in non_flat_local_shape)
        offset, shape, fragments = _place(key, local, rank_offsets, prepend_axis_num)
        return cls(
            key,
            data,
            data.dtype,
            local,
            shape,
            offset,
            fragments,
            replica_id,
            prepend_axis_num,
            allow_shape_mismatch,
            flattened_range,
        )

    @classmethod
    def from_global_offset(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: tuple[int, ...] | torch.Size,
        global_offset: tuple[int, ...],
        *,
        replica_id: ReplicaId = 0,
        flattened_range: slice | None = None,
        local_shape: tuple[int, ...] | None = None,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Any box of the global tensor, uneven splits included."""
        if local_shape is None:
            if flattened_range is not None:
                raise ValidationError(f"{key}: a flattened_range needs the non-flat local_shape")
            local_shape = tuple(data.shape)
        return cls(
            key,
            data,
            data.dtype,
            tuple(local_shape),
            tuple(global_shape),
            tuple(global_offset),
            None,
            replica_id,
            0,
            allow_shape_mismatch,
            flattened_range,
        )

    # -- geometry ---------------------------------------------------------------------------
    @property
    def chunk_box(self) -> Box:
        """The (non-flat) box this piece lives in, in global coordinates."""
        return Box(self.global_offset, (1,) * self.prepend_axis_num + self.local_shape)

    @property
    def flat_bounds(self) -> tuple[int, int] | None:
        if self.flattened_range is None:
            return None
        return (self.flattened_range.start or 0, self.flattened_range.stop)

    def boxes(self) -> list[tuple[int, Box]]:
        """``(position in data, global box)`` pairs covering exactly this piece's elements."""
        chunk = self.chunk_box
        if self.flattened_range is None:
            return [(0, chunk)]
        start, stop = self.flat_bounds or (0, 0)
        return [
            (pos, box.shifted(chunk.offset))
            for pos, box in flat_range_to_boxes(chunk.shape, start, stop)
        ]

    @property
    def numel(self) -> int:
        bounds = self.flat_bounds
        return bounds[1] - bounds[0] if bounds else math.prod(self.local_shape)

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    def validate_metadata_integrity(self) -> None:
        """Raise :class:`ValidationError` naming the key when the description is inconsistent."""
        k = self.key
        if not isinstance(k, str) or not k:
            raise ValidationError(f"ShardedTensor key must be a non-empty string, got {k!r}")
        if len(self.global_shape) != len(self.local_shape) + self.prepend_axis_num:
            raise ValidationError(
                f"{k}: global_shape {self.global_shape} must have len(local_shape) + prepend_axis_num = "
                f"{len(self.local_shape) + self.prepend_axis_num} axes"
            )
        if len(self.global_offset) != len(self.global_shape):
            raise ValidationError(
                f"{k}: global_offset {self.global_offset} and global_shape {self.global_shape} differ in rank"
            )
        if not self.chunk_box.within(self.global_shape):
            raise ValidationError(
                f"{k}: the piece at offset {self.global_offset} of shape {self.chunk_box.shape} "
                f"lies outside the global shape {self.global_shape}"
            )
        if self.flattened_range is not None:
            fr = self.flattened_range
            if (
                fr.step not in (None, 1)
                or fr.stop is None
                or not 0 <= (fr.start or 0) <= fr.stop <= math.prod(self.local_shape)
            ):
                raise ValidationError(
                    f"{k}: flattened_range {fr} must be a step-1 slice inside the {math.prod(self.local_shape)} "
                    f"elements of local shape {self.local_shape}"
                )
        if self.data is None:
            return
        if not isinstance(self.data, torch.Tensor):
            raise ValidationError(
                f"{k}: data must be a torch.Tensor or None, got {type(self.data).__name__}"
            )
        if self.data.dtype != self.dtype:
            raise ValidationError(
                f"{k}: data dtype {self.data.dtype} differs from the declared dtype {self.dtype}"
            )
        if self.flattened_range is not None:
            if self.data.ndim != 1 or self.data.numel() != self.numel:
                raise ValidationError(
                    f"{k}: flattened data must be 1-D with {self.numel} elements (flattened_range "
                    f"{self.flattened_range}), got shape {tuple(self.data.shape)}"
                )
        elif tuple(self.data.shape) != self.local_shape:
            raise ValidationError(
                f"{k}: data shape {tuple(self.data.shape)} differs from local_shape {self.local_shape}"
            )


def _place(
    key: str, local: tuple[int, ...], rank_offsets: tuple[tuple[int, int, int], ...], prepend: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    ndim = len(local) + prepend
    offset = [0] * ndim
    shape = [1] * prepend + list(local)
    fragments = [1] * ndim
    seen: set[int] = set()
    for item in rank_offsets:
        if len(item) != 3:
            raise ValidationError(
                f"{key}: a rank offset is (axis, rank_on_axis, fragments_on_axis), got {item!r}"
            )
        axis, rank, fragm = (int(x) for x in item)
        if not 0 <= axis < ndim or axis in seen:
            raise ValidationError(
                f"{key}: rank offset axis {axis} is out of range or repeated (tensor has {ndim} axes)"
            )
        if not 0 <= rank < fragm:
            raise ValidationError(f"{key}: rank {rank} on axis {axis} must lie in [0, {fragm})")
        seen.add(axis)
        length = shape[axis]
        offset[axis] = rank * length
        shape[axis] = fragm * length
        fragments[axis] = fragm
    return tuple(offset), tuple(shape), tuple(fragments)


@dataclass
class ShardedObject:
    """A per-rank Python object, one cell of an n-d grid of objects. Cannot be resharded."""

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if not isinstance(self.key, str) or not self.key:
            raise ValidationError(f"ShardedObject key must be a non-empty string, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape, strict=True)
        ):
            raise ValidationError(
                f"{self.key}: global_offset {self.global_offset} must index a cell of global_shape {self.global_shape}"
            )

    @property
    def unique_key(self) -> str:
        off = ".".join(str(o) for o in self.global_offset)
        shape = ".".join(str(s) for s in self.global_shape)
        return f"{self.key}/shard_{off}_{shape}"

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)


@dataclass
class ShardedTensorFactory:
    """A deferred transform: ``build_fn(key, data, replica_id, flattened_range)`` gives the sub
    state dict to save or load; ``merge_fn(loaded_subtree)`` turns the loaded subtree back into
    the value placed where the factory was."""

    key: str
    data: Any
    build_fn: Callable[..., Any]
    merge_fn: Callable[[Any], Any]
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> Any:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


@dataclass
class LocalNonPersistentObject:
    """A value that is never saved; ``load`` puts ``obj`` back in its place."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


@dataclass
class CoordinatorObject:
    """Common state whose value the coordinator alone decides: saved from rank 0's copy, and
    never compared with the other ranks' copies (which may legitimately differ). Plain tensors
    inside stay common state. ``load`` puts the stored value in its place."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


@dataclass(frozen=True)
class TensorRef:
    """Where a plain tensor leaf stood in the common tree: the key it is stored under."""

    key: str


LocalNonpersistentObject = LocalNonPersistentObject
"""Megatron-Core's spelling of the same class."""

ShardedEntity = ShardedTensor | ShardedObject


@dataclass
class SplitStateDict:
    """A state dict taken apart: sharded leaves by path, the rest as the common tree.

    ``replicated`` holds the indices into ``tensors`` that came from plain tensor leaves:
    whole tensors every rank holds, whose copies must agree.
    """

    tensors: list[tuple[Path, ShardedTensor]] = field(default_factory=list)
    objects: list[tuple[Path, ShardedObject]] = field(default_factory=list)
    common: Any = None
    replicated: list[int] = field(default_factory=list)
    coordinator_only: list[Path] = field(default_factory=list)


def path_key(path: Path) -> str:
    """The key a plain tensor leaf is stored under: its path joined with dots (DCP's naming)."""
    if not path:
        return "tensor"
    return ".".join(str(p) for p in path)


def replicated_tensor(path: Path, tensor: torch.Tensor) -> ShardedTensor:
    """A plain tensor leaf as the whole global tensor ``path_key(path)`` (a replica)."""
    data = tensor.detach()
    shape = tuple(data.shape)
    return ShardedTensor(path_key(path), data, data.dtype, shape, shape, (0,) * len(shape))


def is_plain_tensor(node: Any) -> bool:
    """A tensor leaf with a dense layout that adapters left alone (DTensors are adapted first)."""
    return (
        isinstance(node, torch.Tensor)
        and node.layout == torch.strided
        and not node.is_quantized
        and not node.is_nested
        and type(node) in (torch.Tensor, torch.nn.Parameter)
    )


class _Placeholder:
    """Stands in the common tree where a sharded or non-persistent leaf was (in lists)."""

    def __repr__(self) -> str:
        return "<sharded>"


PLACEHOLDER = _Placeholder()


class StateDictAdapters:
    """The plugin point for framework leaves: the adapters ``save`` and ``load`` apply, in order.

    ``adapter(tree)`` returns the tree with such leaves replaced by sharded entities (or the
    tree itself when it has none). ``import shardsafe`` registers two (DTensor, Megatron-Core);
    :attr:`registered` lists them. Higher layers plug in here without the core importing them.
    """

    def __init__(self) -> None:
        self._adapters: list[Callable[[Any], Any]] = []

    def register(self, adapter: Callable[[Any], Any]) -> None:
        """Apply ``adapter`` after those registered before it (once, however often registered)."""
        if adapter not in self._adapters:
            self._adapters.append(adapter)

    def unregister(self, adapter: Callable[[Any], Any]) -> None:
        if adapter in self._adapters:
            self._adapters.remove(adapter)

    @property
    def registered(self) -> tuple[Callable[[Any], Any], ...]:
        return tuple(self._adapters)

    def __call__(self, tree: Any) -> Any:
        for adapter in self._adapters:
            tree = adapter(tree)
        return tree


STATE_DICT_ADAPTERS = StateDictAdapters()
"""The adapters of this process (see :class:`StateDictAdapters`)."""


def register_state_dict_adapter(adapter: Callable[[Any], Any]) -> None:
    """Let ``save``/``load`` accept framework leaves (DTensors...) by rewriting them first
    (``STATE_DICT_ADAPTERS.register``)."""
    STATE_DICT_ADAPTERS.register(adapter)


def adapt(tree: Any) -> Any:
    """Apply the registered adapters (see :class:`StateDictAdapters`)."""
    return STATE_DICT_ADAPTERS(tree)


def is_stateful(node: Any) -> bool:
    """An object with ``state_dict()`` and ``load_state_dict(sd)`` methods (PyTorch DCP's
    ``Stateful`` protocol): a module, an optimizer, an LR scheduler, DCP's ``AppState``."""
    return (
        not isinstance(node, (type, torch.Tensor, dict, list, tuple))
        and callable(getattr(node, "state_dict", None))
        and callable(getattr(node, "load_state_dict", None))
    )


def resolve_stateful(tree: Any, path: Path = ()) -> tuple[Any, list[tuple[Path, Any]]]:
    """``tree`` with each Stateful object replaced by its ``state_dict()``, and the
    ``(path, object)`` pairs replaced, innermost first (the order ``load_state_dict`` runs in).

    As in PyTorch DCP, save stores what ``state_dict()`` returns; load loads into it as a
    template and passes the result to ``load_state_dict``. Containers are copied only on
    the way to a Stateful object, so a tree without one comes back as it is.
    """
    found: list[tuple[Path, Any]] = []

    def walk(node: Any, at: Path) -> Any:
        if is_stateful(node):
            try:
                sd = node.state_dict()
            except CheckpointError:
                raise
            except Exception as e:
                raise ValidationError(
                    f"{_fmt(at)}: {type(node).__qualname__}.state_dict() failed: {e}"
                ) from e
            if sd is node:
                raise ValidationError(
                    f"{_fmt(at)}: {type(node).__qualname__}.state_dict() returned the object itself"
                )
            resolved = walk(sd, at)
            found.append((at, node))
            return resolved
        if isinstance(node, dict):
            items = {k: walk(v, (*at, k)) for k, v in node.items()}
            if all(items[k] is v for k, v in node.items()):
                return node
            return items
        if isinstance(node, list):
            values = [walk(v, (*at, i)) for i, v in enumerate(node)]
            if all(a is b for a, b in zip(values, node, strict=True)):
                return node
            return values
        return node

    return walk(tree, path), found


def apply_factories(tree: Any) -> Any:
    """Replace every :class:`ShardedTensorFactory` by what its ``build_fn`` returns (recursively)."""
    if isinstance(tree, ShardedTensorFactory):
        return apply_factories(tree.build())
    if isinstance(tree, dict):
        return {k: apply_factories(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [apply_factories(v) for v in tree]
    return tree


def iter_leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Depth-first ``(path, leaf)`` over dicts and lists; everything else is a leaf."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, (*path, i))
    else:
        yield path, tree


def split_state_dict(tree: Any, plain_tensors: bool = True) -> SplitStateDict:
    """Separate sharded entities from common state; drop non-persistent values.

    The common tree keeps the dict/list structure: sharded entries are removed from dicts and
    replaced by :data:`PLACEHOLDER` in lists, so positions survive a round trip. With
    ``plain_tensors``, a plain tensor leaf becomes a whole replicated :class:`ShardedTensor`
    keyed by its path, and a :class:`TensorRef` marks its place in the common tree (so a load
    without a template for it still puts it back where it was).
    """
    out = SplitStateDict()

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, CoordinatorObject):
            out.coordinator_only.append(path)
            return node
        if plain_tensors and is_plain_tensor(node):
            out.replicated.append(len(out.tensors))
            st = replicated_tensor(path, node)
            out.tensors.append((path, st))
            return TensorRef(st.key)
        if isinstance(node, ShardedTensorFactory):
            raise ValidationError(f"{_fmt(path)}: apply_factories must run before split_state_dict")
        if isinstance(node, ShardedTensor):
            out.tensors.append((path, node))
            return PLACEHOLDER
        if isinstance(node, ShardedObject):
            out.objects.append((path, node))
            return PLACEHOLDER
        if isinstance(node, LocalNonPersistentObject):
            return PLACEHOLDER
        if isinstance(node, dict):
            kept = {}
            for k, v in node.items():
                value = walk(v, (*path, k))
                if value is not PLACEHOLDER:
                    kept[k] = value
            return kept
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        refuse_sharded_leaf(node, _fmt(path))
        return node

    out.common = walk(tree, ())
    return out


def detached_copy(tree: Any) -> Any:
    """``tree`` with every tensor (DTensors included) replaced by a detached copy: what a load
    fills before anything live changes, so that damage found midway leaves the live state alone."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [detached_copy(v) for v in tree]
    return tree


def set_at(tree: Any, path: Path, value: Any) -> Any:
    """Put ``value`` at ``path`` inside ``tree`` (creating dicts, extending lists); returns the tree."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int) and (tree is None or isinstance(tree, list)):
        tree = list(tree or [])
        while len(tree) <= head:
            tree.append(None)
        tree[head] = set_at(
            tree[head] if not isinstance(tree[head], _Placeholder) else None, rest, value
        )
        return tree
    if not isinstance(tree, dict):
        tree = {}
    tree[head] = set_at(tree.get(head), rest, value)
    return tree


def _fmt(path: Path) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


format_path = _fmt
