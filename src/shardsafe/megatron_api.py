"""``megatron.core.dist_checkpointing``'s helper entry points, with its names and semantics.

Code that calls Megatron-Core's ``dist_checkpointing`` module can call ``shardsafe`` in its
place: these functions take the same arguments and return what Megatron's return (data-less
ShardedTensors keyed by tensor key, ShardedObjects keyed by unique key, the content metadata
dict). Strategy arguments are accepted for signature compatibility and must be None: shardsafe
has one storage format.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import ValidationError
from .loading import read_manifest
from .reader import load_metadata
from .sharding import ShardedObject, ShardedTensor, ShardedTensorFactory

CONTENT_METADATA_KEY = "content_metadata"
"""Where Megatron-LM looks for the content metadata in a loaded state dict."""


def _no_strategy(**strategies: Any) -> None:
    given = [name for name, value in strategies.items() if value is not None]
    if given:
        raise ValidationError(
            f"{', '.join(given)}: shardsafe has a single storage format; pass None "
            "(Megatron-Core's strategies do not apply to shardsafe checkpoints)"
        )


def load_tensors_metadata(
    checkpoint_dir: str | os.PathLike[str], sharded_strategy: Any = None
) -> dict[str, ShardedTensor]:
    """``{tensor key: ShardedTensor}`` without data, each one piece of its global shape and dtype."""
    _no_strategy(sharded_strategy=sharded_strategy)
    return {k: v for k, v in load_metadata(checkpoint_dir).items() if isinstance(v, ShardedTensor)}


def load_sharded_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
) -> dict[str, ShardedTensor | ShardedObject]:
    """:func:`load_tensors_metadata` plus every ShardedObject, keyed by its unique key."""
    _no_strategy(sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    return load_metadata(checkpoint_dir)


def load_content_metadata(
    checkpoint_dir: str | os.PathLike[str] | None = None,
    *,
    preloaded_state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``content_metadata`` given to ``save``; None when the checkpoint has none.

    With ``preloaded_state_dict`` (what ``load`` returned) nothing is read: ``load`` places the
    content metadata under ``"content_metadata"``, as Megatron-Core does.
    """
    if preloaded_state_dict is not None:
        value = preloaded_state_dict.get(CONTENT_METADATA_KEY)
        return dict(value) if isinstance(value, Mapping) else None
    if checkpoint_dir is None:
        raise ValidationError(
            "load_content_metadata needs checkpoint_dir or preloaded_state_dict (both are None)"
        )
    manifest, _ = read_manifest(checkpoint_dir)
    value = manifest.user_metadata.get(CONTENT_METADATA_KEY)
    return dict(value) if isinstance(value, dict) else None


def apply_factories(sharded_state_dict: Any) -> None:
    """Replace every ShardedTensorFactory by what it builds, *in place* (Megatron's contract)."""

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            while isinstance(v, ShardedTensorFactory):
                v = v.build()
                node[k] = v
            if isinstance(v, dict | list):
                walk(v)

    if not isinstance(sharded_state_dict, dict | list):
        raise ValidationError(
            f"apply_factories works in place on a dict or list, got {type(sharded_state_dict).__name__}"
        )
    walk(sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: tuple[Any, ...] = ()) -> Any:
    """Merge the loaded ``x1`` with the factories of ``x2`` in place; returns ``x1`` (Megatron's contract).

    Each factory of ``x2`` turns the subtree of ``x1`` at its place into one value with its
    ``merge_fn``. Structures that do not line up raise :class:`ValidationError` naming the path.
    """
    where = "state_dict" + "".join(f"[{p!r}]" for p in key)
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ValidationError(
                    f"{where}: the loaded state dict has no key {k!r} (it has {sorted(map(str, x1))[:10]})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, (*key, k))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValidationError(f"{where}: lists of different lengths ({len(x1)} and {len(x2)})")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, (*key, i))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise ValidationError(
                    f"{where}: key {k!r} does not index the loaded list of length {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, (*key, k))
    else:
        raise ValidationError(
            f"{where}: cannot merge a loaded {type(x1).__name__} with a {type(x2).__name__} template"
        )
    return x1
