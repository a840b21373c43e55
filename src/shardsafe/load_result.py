"""What a load hands back: the template's tree with the loaded values and the checkpoint's
common state merged in, tensor references resolved, factories merged, and each Stateful object
given its part (``load_state_dict``) and put back in its place.

Pure tree work on what :mod:`shardsafe.loading` read; no I/O, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import CheckpointError, IncompatibleRequestError, MissingKeyError
from .sharding import (
    CoordinatorObject,
    LocalNonPersistentObject,
    Path,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    TensorRef,
    format_path,
    is_plain_tensor,
)

ABSENT = object()
"""What a lookup or a merge finds where a tree holds nothing."""


def hand_back(result: Any, statefuls: list[tuple[Path, Any]], where: str) -> Any:
    """Give each Stateful object (innermost first) its loaded part, and put the object in its
    place in ``result``, so the result saves again as the template did."""
    for at, obj in statefuls:
        value = lookup_or(result, at)
        if value is ABSENT:
            raise MissingKeyError(
                f"{where}: nothing was loaded for the {type(obj).__qualname__} at "
                f"{format_path(at)}: its state_dict() keys are not in the checkpoint"
            )
        try:
            obj.load_state_dict(value)
        except CheckpointError:
            raise
        except Exception as e:
            raise IncompatibleRequestError(
                f"{where}: {type(obj).__qualname__}.load_state_dict() of {format_path(at)} failed "
                f"on what the checkpoint holds: {type(e).__name__}: {e}"
            ) from e
        result = replace_at(result, at, obj)
    return result


def lookup_or(tree: Any, path: Path) -> Any:
    """The value at ``path`` in ``tree``, or :data:`ABSENT`."""
    for p in path:
        if isinstance(tree, dict):
            tree = tree.get(p, ABSENT)
        elif isinstance(tree, list) and isinstance(p, int) and 0 <= p < len(tree):
            tree = tree[p]
        else:
            return ABSENT
        if tree is ABSENT:
            return ABSENT
    return tree


def apply_factories_recording(
    node: Any, path: Path, out: list[tuple[Path, ShardedTensorFactory]]
) -> Any:
    """``node`` with every factory built, each recorded in ``out`` with its path (its
    ``merge_fn`` puts the loaded pieces back together)."""
    if isinstance(node, ShardedTensorFactory):
        out.append((path, node))
        return apply_factories_recording(node.build(), path, out)
    if isinstance(node, dict):
        return {k: apply_factories_recording(v, (*path, k), out) for k, v in node.items()}
    if isinstance(node, list):
        return [apply_factories_recording(v, (*path, i), out) for i, v in enumerate(node)]
    return node


def merge_common(
    template: Any, common: Any, values: dict[int, Any], plain: dict[Path, Any], path: Path
) -> Any:
    """The template's structure with loaded values, plain leaves from the checkpoint's common state.

    A plain tensor of the template comes back as itself, filled in place.
    """
    if isinstance(template, ShardedTensor):
        return values.get(id(template), ABSENT)
    if isinstance(template, ShardedObject):
        return values.get(id(template), ABSENT)
    if isinstance(template, LocalNonPersistentObject):
        return template.unwrap()
    if isinstance(template, CoordinatorObject):
        return template.unwrap() if common is ABSENT else common
    if is_plain_tensor(template):
        if path in plain:
            return template
        if isinstance(common, torch.Tensor) and common.shape == template.shape:
            template.detach().copy_(common)  # a checkpoint that kept it in common state
            return template
        return ABSENT
    if isinstance(template, dict):
        out = dict(common) if isinstance(common, dict) else {}
        for k, v in template.items():
            merged = merge_common(
                v,
                common.get(k, ABSENT) if isinstance(common, dict) else ABSENT,
                values,
                plain,
                (*path, k),
            )
            if merged is ABSENT:
                out.pop(k, None)
            else:
                out[k] = merged
        return out
    if isinstance(template, list):
        base = common if isinstance(common, list) else []
        out_list = [
            merge_common(v, base[i] if i < len(base) else ABSENT, values, plain, (*path, i))
            for i, v in enumerate(template)
        ]
        kept = [v for v in out_list if v is not ABSENT]
        if any(holds_pieces(v) for v in template):
            return kept  # the layout gives this list its length (per-rank pieces)
        # a list of plain values is common state: stored items past the template's end are
        # kept, as a dict's stored keys the template lacks are (never dropped without a word)
        return kept + base[len(template) :]
    return template if common is ABSENT else common


def holds_pieces(node: Any) -> bool:
    """Whether ``node`` is or holds a sharded entry or a plain tensor of the template."""
    if isinstance(node, (ShardedTensor, ShardedObject, LocalNonPersistentObject)):
        return True
    if is_plain_tensor(node):
        return True
    if isinstance(node, dict):
        return any(holds_pieces(v) for v in node.values())
    if isinstance(node, list):
        return any(holds_pieces(v) for v in node)
    return False


def resolve_refs(tree: Any, read: Callable[[str], torch.Tensor]) -> Any:
    """Replace every :class:`TensorRef` left in ``tree`` by the stored tensor, read whole."""
    if isinstance(tree, TensorRef):
        return read(tree.key)
    if isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(v, (TensorRef, dict, list)):
                tree[k] = resolve_refs(v, read)
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            if isinstance(v, (TensorRef, dict, list)):
                tree[i] = resolve_refs(v, read)
        return tree
    return tree


def get_at(tree: Any, path: Path) -> Any:
    """The value at ``path`` in ``tree`` (which holds it)."""
    for p in path:
        tree = tree[p]
    return tree


def replace_at(tree: Any, path: Path, value: Any) -> Any:
    """``tree`` with ``value`` at ``path`` (in place; the value itself for the root)."""
    if not path:
        return value
    get_at(tree, path[:-1])[path[-1]] = value
    return tree
