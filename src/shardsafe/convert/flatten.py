"""Flattening nested state into ``a.b.c`` keys, keeping only what a weights-only load reads back.

Formats without a notion of nesting (a flat ``torch.save`` dict, DCP's flat keys, safetensors)
all spell nested state this way, which is also how DCP itself flattens state dicts.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any

import torch

from .safe_pickle import is_weights_only_value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return False


def describe(skipped: Mapping[str, Any]) -> list[str]:
    return [f"{k} ({type(v).__module__}.{type(v).__qualname__})" for k, v in skipped.items()]


def flatten_state(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(flat, skipped)``: ``flat`` maps dotted keys to tensors and weights-only values;
    ``skipped`` holds, by dotted key, the leaves that a weights-only load could not read back.

    Dicts (and argparse namespaces) are always descended into; lists and tuples only when they
    hold tensors or unreadable items, so a list of plain numbers stays one value.
    """
    flat: dict[str, Any] = {}
    skipped: dict[str, Any] = {}

    def visit(path: str, value: Any) -> None:
        if isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                visit(f"{path}.{k}", v)
        elif (
            isinstance(value, (list, tuple))
            and value
            and (_holds_tensor(value) or not is_weights_only_value(value))
        ):
            for i, v in enumerate(value):
                visit(f"{path}.{i}", v)
        elif isinstance(value, torch.Tensor) and is_weights_only_value(value):
            flat[path] = value.detach().as_subclass(torch.Tensor)
        elif is_weights_only_value(value if not isinstance(value, Mapping) else dict(value)):
            flat[path] = dict(value) if isinstance(value, Mapping) else value
        else:
            skipped[path] = value

    for key, value in tree.items():
        visit(str(key), value)
    return flat, skipped


def drop_emptied(flat: dict[str, Any], tensor_keys: list[str]) -> None:
    """Remove empty containers whose contents went out as tensors (``model = {}`` beside
    ``model.fc.weight``); a container that was empty in the saved state stays."""
    for name in [k for k, v in flat.items() if isinstance(v, (dict, list, tuple)) and not v]:
        if any(t.startswith(f"{name}.") for t in tensor_keys):
            del flat[name]


def weights_only_tree(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(kept, skipped)``: ``tree`` with its nesting, minus the leaves (by dotted key) that a
    weights-only load could not read back. Dicts emptied that way disappear."""
    skipped: dict[str, Any] = {}

    def prune(path: str, value: Any) -> Any:
        if isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping):
            out = {k: prune(f"{path}.{k}", v) for k, v in value.items()}
            return {k: v for k, v in out.items() if v is not _DROP}
        if is_weights_only_value(value):
            return (
                value.detach().as_subclass(torch.Tensor)
                if isinstance(value, torch.Tensor)
                else value
            )
        skipped[path] = value
        return _DROP

    kept = {k: prune(str(k), v) for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v is not _DROP}, skipped


_DROP = object()


def common_leaves(tree: Any, tensor_keys: Collection[str]) -> dict[tuple[str, ...], Any]:
    """The leaves of a common-state tree by path, the way every format can be compared: dict
    keys and list indices as strings, dotted keys split (a flat export's ``a.b`` is the source's
    ``{'a': {'b'}}``, DCP's ``{0: ...}`` a list's ``[...]``), and without the places the
    tensors were taken from (``None`` where a tensor key is, containers only tensors filled)."""
    keys = {tuple(k.split(".")) for k in tensor_keys}
    holders = {k[:i] for k in keys for i in range(1, len(k))}
    out: dict[tuple[str, ...], Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, (Mapping, list, tuple)):
            items = list(node.items() if isinstance(node, Mapping) else enumerate(node))
            if not items and path and path not in holders:
                out[path] = {} if isinstance(node, Mapping) else []
            for k, v in items:
                walk(v, path + tuple(str(k).split(".")))
        elif not (node is None and path in keys):
            out[path] = node

    walk(tree, ())
    return out
