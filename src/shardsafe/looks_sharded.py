"""Refuse to pickle a value that looks like a piece of a sharded tensor.

A state dict leaf that is not one of our sharded entities becomes *common* state: saved once,
from the coordinator's copy. When that leaf is in fact one rank's shard of something (a
framework's sharded tensor we do not understand, a DTensor inside a tuple, an object with
Megatron-style ``key``/``global_shape``/``global_offset``), saving it that way would store one
rank's piece, drop the others', write no tensor at all, and report success. This module names
such values so that ``save`` fails instead, on every rank, naming the path and the type.
"""

from __future__ import annotations

from typing import Any

from .errors import ValidationError

_SHARDING_ATTRS = ("key", "global_shape", "global_offset")
"""Megatron-style placement fields: a value carrying all three is one piece of a global tensor."""

_FRAMEWORK_MODULES = (
    "megatron.core.dist_checkpointing",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed._shard",
    "torch.distributed.checkpoint",
    "deepspeed.checkpoint",
    "deepspeed.runtime.zero",
)
"""Packages whose objects describe distributed shards; none of them is common state."""

_MAX_DEPTH = 32


def sharded_reason(value: Any) -> str | None:
    """Why ``value`` looks like a shard of a distributed tensor, or None when it does not."""
    cls = type(value)
    module = getattr(cls, "__module__", "") or ""
    if any(module == m or module.startswith(m + ".") for m in _FRAMEWORK_MODULES):
        return f"it is a {module}.{cls.__qualname__}, a sharded object this state dict walk does not handle"
    if all(hasattr(value, a) for a in _SHARDING_ATTRS):
        return "it carries sharding fields (key, global_shape, global_offset)"
    if hasattr(value, "_local_tensor") and hasattr(value, "placements"):
        return "it is DTensor-like (_local_tensor and placements)"
    if hasattr(value, "__create_write_items__") or hasattr(value, "__create_chunk_list__"):
        return "it implements torch.distributed.checkpoint's custom-tensor protocol"
    if hasattr(value, "build_fn") and hasattr(value, "merge_fn"):
        return "it is a sharded tensor factory (build_fn, merge_fn) outside a dict or list"
    return None


def refuse_sharded_leaf(value: Any, where: str) -> None:
    """Raise :class:`ValidationError` when the common-state leaf ``value`` at ``where`` looks sharded.

    Tuples, sets and frozensets are searched too: the state dict walk only descends into dicts
    and lists, so a shard inside a tuple would otherwise be pickled as common state.
    """
    _check(value, where, 0)


def _check(value: Any, where: str, depth: int) -> None:
    if isinstance(value, str | bytes | int | float | bool | type(None)):
        return
    reason = sharded_reason(value)
    if reason is not None:
        raise ValidationError(
            f"{where}: refusing to save a {type(value).__module__}.{type(value).__qualname__} "
            f"as common state: {reason}. Convert it to shardsafe.ShardedTensor/ShardedObject "
            "(or the framework's state dict adapter) before saving, or keep it out of the state dict"
        )
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, dict):
        for k, item in value.items():
            _check(item, f"{where}[{k!r}]", depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]", depth + 1)
