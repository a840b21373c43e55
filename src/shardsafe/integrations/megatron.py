"""Megatron-Core's own sharded state dicts, accepted as they are by ``save`` and ``load``.

``model.sharded_state_dict()`` and ``optimizer.sharded_state_dict(...)`` build instances of
``megatron.core.dist_checkpointing.mapping``'s classes, not ours. :func:`megatron_aware` (a
state dict adapter, registered by ``import shardsafe``) rewrites them into the equivalent
:mod:`shardsafe.sharding` entities field by field, so every field keeps its meaning:
``replica_id`` tuples, ``prepend_axis_num``, ``axis_fragmentations``, ``allow_shape_mismatch``,
``flattened_range``; factories build on save and merge on load (their ``build_fn`` output is
rewritten too); non-persistent objects are returned, never saved.

Megatron-Core is never imported here: the adapter looks the mapping module up in
``sys.modules``. A state dict that holds Megatron objects was built by code that imported
it, so when the module is absent there is nothing to rewrite.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..errors import ValidationError
from ..format import MANIFEST_NAME
from ..loading import StrictHandling
from ..sharding import (
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

MAPPING_MODULE = "megatron.core.dist_checkpointing.mapping"
"""Where Megatron-Core defines ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject."""


def megatron_mapping() -> ModuleType | None:
    """Megatron-Core's mapping module when the running program has imported it, else None."""
    return sys.modules.get(MAPPING_MODULE)


def megatron_aware(tree: Any) -> Any:
    """``tree`` with Megatron-Core's sharded entities replaced by shardsafe's (a new tree).

    Returns ``tree`` itself when Megatron-Core is not loaded in this process.
    """
    mapping = megatron_mapping()
    if mapping is None:
        return tree
    return _Converter(mapping).convert(tree, ())


class _Converter:
    def __init__(self, mapping: ModuleType) -> None:
        self.tensor = mapping.ShardedTensor
        self.obj = mapping.ShardedObject
        self.factory = mapping.ShardedTensorFactory
        self.nonpersistent = mapping.LocalNonpersistentObject

    def convert(self, node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            return {k: self.convert(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.convert(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, self.tensor):
            return _tensor(node, path)
        if isinstance(node, self.obj):
            return ShardedObject(
                node.key,
                node.data,
                tuple(node.global_shape),
                tuple(node.global_offset),
                node.replica_id,
            )
        if isinstance(node, self.factory):
            return ShardedTensorFactory(
                node.key,
                node.data,
                self._build(node.build_fn),
                node.merge_fn,
                node.replica_id,
                node.flattened_range,
            )
        if isinstance(node, self.nonpersistent):
            return LocalNonPersistentObject(node.obj)
        return node

    def _build(self, build_fn: Callable[..., Any]) -> Callable[..., Any]:
        """Megatron's ``build_fn``, whose sub state dict is rewritten as well."""

        def build(key: str, data: Any, replica_id: Any, flattened_range: Any) -> Any:
            return self.convert(build_fn(key, data, replica_id, flattened_range), (key,))

        return build


def _tensor(st: Any, path: tuple[Any, ...]) -> ShardedTensor:
    try:
        return ShardedTensor(
            key=st.key,
            # A detached view shares the parameter's storage: load fills it in place, as
            # Megatron's own load does, without autograd refusing an in-place copy into a leaf.
            data=st.data.detach() if isinstance(st.data, torch.Tensor) else st.data,
            dtype=st.dtype,
            local_shape=tuple(st.local_shape),
            global_shape=tuple(st.global_shape),
            global_offset=tuple(st.global_offset),
            axis_fragmentations=(
                tuple(st.axis_fragmentations) if st.axis_fragmentations is not None else None
            ),
            replica_id=st.replica_id,
            prepend_axis_num=st.prepend_axis_num,
            allow_shape_mismatch=st.allow_shape_mismatch,
            flattened_range=getattr(st, "flattened_range", None),
        )
    except ValidationError as e:
        where = "state_dict" + "".join(f"[{p!r}]" for p in path)
        raise ValidationError(f"{where}: Megatron-Core ShardedTensor: {e}") from e


def is_torch_dist_dir(path: Any) -> bool:
    """A local directory Megatron-Core wrote with its ``torch_dist`` backend (and not ours)."""
    if not isinstance(path, str | os.PathLike) or "://" in os.fspath(path):
        return False
    root = os.fspath(path)
    config = os.path.join(root, "metadata.json")
    if not os.path.isfile(config) or os.path.exists(os.path.join(root, MANIFEST_NAME)):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(backend == "torch_dist")


def load_torch_dist_dir(template: Any, path: Any, strict: StrictHandling) -> Any:
    """``load`` from a Megatron-Core ``torch_dist`` directory (the DCP reader loads on first use)."""
    from ..convert.megatron_dist import load_torch_dist

    return load_torch_dist(template, path, strict)
