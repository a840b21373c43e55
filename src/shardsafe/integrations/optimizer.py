"""Optimizer state in parameter space, sharded exactly like the parameters.

A ``torch.optim`` state dict is keyed by parameter *index* and holds each rank's local
shards, so it only reloads into the same layout. Here every per-parameter state tensor of
the parameter's local shape (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``...)
gets the parameter's own ShardedTensor geometry under ``<prefix>state.<name>.<param key>``;
the optimizer state then reshards like the weights: FSDP2 to tensor parallel, to a plain
single-process model, to a ZeRO-1 flat buffer, and back.

* scalar state (Adam's ``step`` tensor) is one replicated element, ``<prefix>state.<name>.<param
  key>``, saved by the rank holding the parameter's first element;
* non-tensor per-parameter state and the ``param_groups`` hyperparameters are common state,
  saved by rank 0 (``params`` lists are stored as parameter keys);
* flat-buffer (ZeRO-1 / distributed optimizer) state is described by
  ``(param key, flat range within the param's local chunk, buffer view)`` entries and saved
  with ``flattened_range`` pieces of the same keys, so flat and per-parameter layouts load
  into each other.

The one way to save and resume it, with ``shardsafe.save``/``load`` or a CheckpointManager,
is :class:`OptimizerState`, a Stateful entry of the state dict::

    state = {"model": model_sd, "optimizer": OptimizerState(optimizer, model_sd),
             "scheduler": scheduler, "step": 0}
    state = manager.restore(state)  # moments, step, param groups (lr) and scheduler restored

By hand (what ``OptimizerState`` does)::

    model_sd = to_sharded_state_dict(model.state_dict())
    template = {"model": model_sd, "optimizer": optimizer_sharded_state_dict(optimizer, model_sd)}
    loaded = shardsafe.load(template, path)  # fills parameters and state tensors in place
    load_optimizer_state(optimizer, loaded["optimizer"])  # scalars, non-tensor state, hyperparameters
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import IncompatibleRequestError, ValidationError
from ..sharding import (
    LocalNonPersistentObject,
    ReplicaId,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from .dtensor import dtensor_pieces, is_dtensor, local_tensor

PARAMS_KEY = "_params"
"""Where the sharded optimizer dict keeps ``{param key: parameter}`` (never saved)."""


@dataclass
class _Geometry:
    """How one parameter is sharded: the model's pieces, reproducible for any same-shaped tensor."""

    key: str
    local: torch.Tensor
    pieces: Callable[[str, torch.Tensor], list[ShardedTensor]]

    def owns_origin(self) -> bool:
        """True on exactly one rank: the main holder of the parameter's first element."""
        for st in self.pieces(self.key, self.local):
            if (
                is_main_replica(st.replica_id)
                and not any(st.global_offset)
                and (st.flattened_range is None or not st.flattened_range.start)
            ):
                return True
        return False


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if is_dtensor(t) else t.detach()


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )


def _geometry(entry: Any, path: str = "") -> _Geometry | None:
    """The geometry of a model entry: a ShardedTensor, a DTensor's factory, or (as in a plain
    ``model.state_dict()``) a DTensor or a whole tensor, keyed by its dotted ``path``."""
    if is_dtensor(entry):
        dtensor = entry

        def like_plain_dtensor(key: str, t: torch.Tensor) -> list[ShardedTensor]:
            return dtensor_pieces(key, dtensor, data=t)

        return _Geometry(path, local_tensor(dtensor), like_plain_dtensor)
    if isinstance(entry, torch.Tensor) and path:
        rank = _group_rank()

        def whole(key: str, t: torch.Tensor) -> list[ShardedTensor]:
            shape = tuple(t.shape)
            return [
                ShardedTensor.from_global_offset(key, t, shape, (0,) * len(shape), replica_id=rank)
            ]

        return _Geometry(path, entry.detach(), whole)
    data = getattr(entry, "data", None)
    if isinstance(entry, ShardedTensor) and isinstance(data, torch.Tensor):
        st = entry

        def same_as_param(key: str, t: torch.Tensor) -> list[ShardedTensor]:
            return [replace(st, key=key, data=t, dtype=t.dtype)]

        return _Geometry(st.key, data, same_as_param)
    if isinstance(entry, ShardedTensorFactory) and is_dtensor(entry.data):
        factory = entry

        def like_dtensor(key: str, t: torch.Tensor) -> list[ShardedTensor]:
            return dtensor_pieces(key, factory.data, data=t, outer_replica_id=factory.replica_id)

        return _Geometry(factory.key, local_tensor(factory.data), like_dtensor)
    return None


def _walk(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf)`` over dicts/lists, stopping at sharded entries."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _walk(v, (*path, str(k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _walk(v, (*path, str(i)))
    else:
        yield ".".join(path), tree


def _match_params(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Any,
    params_by_name: Mapping[str, torch.Tensor] | None,
) -> dict[int, _Geometry]:
    """``id(param) -> geometry`` for every optimizer parameter found in the model dict."""
    by_path: dict[str, _Geometry] = {}
    by_key: dict[str, _Geometry] = {}
    by_storage: dict[tuple[Any, ...], _Geometry | None] = {}
    for path, leaf in _walk(model_sharded_state_dict):
        geo = _geometry(leaf, path)
        if geo is None:
            continue
        by_path[path] = geo
        by_key.setdefault(geo.key, geo)
        fp = _fingerprint(geo.local)
        by_storage[fp] = None if fp in by_storage else geo  # None: ambiguous
    out: dict[int, _Geometry] = {}
    if params_by_name is not None:
        for name, p in params_by_name.items():
            found = by_path.get(name) or by_key.get(name)
            if found is None:
                raise KeyError(
                    f"parameter {name!r} has no entry in the model's state dict (its keys: "
                    f"{sorted(by_path)[:8]}); pass the state dict of the model these parameters "
                    "belong to, with the same names"
                )
            out[id(p)] = found
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            geo = by_storage.get(_fingerprint(_local(p)))
            if geo is not None:
                out[id(p)] = geo
    return out


def _group_rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Any,
    params_by_name: Mapping[str, torch.Tensor] | None = None,
    prefix: str = "optimizer.",
) -> dict[str, Any]:
    """The optimizer's state as a sharded state dict, each state tensor sharded like its param.

    Parameters are matched to the model's entries (a plain or FSDP2/DTensor
    ``model.state_dict()``, :func:`to_sharded_state_dict`'s result, or any ShardedTensors
    whose data is the parameter itself) by storage, or by name through
    ``params_by_name`` (``dict(model.named_parameters())``; needed when storage does not
    tell parameters apart, e.g. several empty shards sharing one address). The result is
    ``{"state": {param key: {name: piece or value}}, "param_groups": [...], "_params":
    <non-persistent {param key: param}>}``; state tensors are the live ones, so ``load``
    restores them in place. A parameter with state but no matching model entry, or a state
    tensor of another shape than the parameter's, raises.

    A trainable parameter without state (a fresh optimizer: Adam creates its state lazily)
    first gets it, zeroed, by :func:`init_optimizer_state`, as PyTorch DCP's
    ``get_optimizer_state_dict`` does: a template never lacks state that a load should fill.
    """
    init_optimizer_state(optimizer)
    geometry = _match_params(optimizer, model_sharded_state_dict, params_by_name)
    rank = _group_rank()
    state: dict[str, dict[str, Any]] = {}
    params: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.param_groups):
        keys: list[str] = []
        for pi, p in enumerate(group["params"]):
            geo = geometry.get(id(p))
            per_param = optimizer.state.get(p) or {}
            if geo is None:
                if per_param:
                    raise KeyError(
                        f"optimizer parameter {pi} of group {gi} (shape {tuple(p.shape)}) has state "
                        "but no entry in the model's state dict: pass that model's state_dict() "
                        "(plain, DTensor or sharded), or params_by_name=dict(model.named_parameters())"
                    )
                keys.append("")
                continue
            keys.append(geo.key)
            params[geo.key] = p
            if per_param:
                state[geo.key] = {
                    name: _state_entry(f"{prefix}state.{name}.{geo.key}", value, geo, rank)
                    for name, value in per_param.items()
                }
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
    return {"state": state, "param_groups": groups, PARAMS_KEY: LocalNonPersistentObject(params)}


def _state_entry(key: str, value: Any, geo: _Geometry, rank: int) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    local = _local(value)
    if local.ndim and tuple(local.shape) == tuple(geo.local.shape):
        pieces = geo.pieces(key, local)
        return pieces[0] if len(pieces) == 1 else pieces
    if local.numel() == 1:
        shape = tuple(local.shape)
        return ShardedTensor.from_global_offset(
            key, local, shape, (0,) * len(shape), replica_id=0 if geo.owns_origin() else rank + 1
        )
    raise ValueError(
        f"{key}: state of shape {tuple(local.shape)} is neither a scalar nor shaped like the "
        f"parameter's local shard {tuple(geo.local.shape)}; it cannot be resharded"
    )


def flat_optimizer_sharded_state_dict(
    flat_state: Mapping[str, Sequence[tuple[str, slice, torch.Tensor]]],
    model_sharded_state_dict: Any,
    *,
    prefix: str = "optimizer.",
    replica_id: ReplicaId | Mapping[str, ReplicaId] = 0,
    scalar_state: Mapping[str, torch.Tensor] | None = None,
    param_groups: Any = None,
) -> dict[str, Any]:
    """Flat-buffer (ZeRO-1) optimizer state, under the same keys as the per-parameter form.

    ``flat_state`` maps a state name (``exp_avg``...) to this rank's entries ``(param key,
    range within the flattened local chunk of that parameter, 1-D view of the buffer)``;
    each becomes a ``flattened_range`` piece with the parameter's geometry from the model's
    sharded state dict (which must hold it as one non-flat ShardedTensor). ``replica_id``
    (per param key when a mapping) tells replicas apart when ranks outside the data-parallel
    group hold the same ranges. ``scalar_state`` (``{"step": tensor}``) gives every parameter
    of this rank that one-element state under the per-parameter keys, saved by the rank
    holding the parameter's first element, so flat and per-parameter checkpoints load into
    each other; on load those tensors are filled in place. ``param_groups`` is common state.
    """
    by_key: dict[str, ShardedTensor | None] = {}  # None: several or flat pieces
    for _, leaf in _walk(model_sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            usable = leaf.key not in by_key and leaf.flattened_range is None
            by_key[leaf.key] = leaf if usable else None
    state: dict[str, dict[str, Any]] = {}
    first: set[str] = set()  # param keys whose first element this rank holds as main
    for name, entries in flat_state.items():
        for param_key, flat_range, view in entries:
            st = by_key.get(param_key)
            if st is None:
                raise KeyError(
                    f"{param_key!r}: the model's sharded state dict must hold it as exactly one "
                    "non-flat ShardedTensor on this rank"
                )
            rid = replica_id[param_key] if isinstance(replica_id, Mapping) else replica_id
            piece = replace(
                st,
                key=f"{prefix}state.{name}.{param_key}",
                data=view,
                dtype=view.dtype,
                flattened_range=flat_range,
                replica_id=rid,
            )
            slot = state.setdefault(param_key, {})
            if name in slot:
                previous = slot[name]
                slot[name] = [*(previous if isinstance(previous, list) else [previous]), piece]
            else:
                slot[name] = piece
            if is_main_replica(rid) and not any(st.global_offset) and not flat_range.start:
                first.add(param_key)
    rank = _group_rank()
    for name, value in (scalar_state or {}).items():
        shape = tuple(value.shape)
        for param_key, slot in state.items():
            slot[name] = ShardedTensor.from_global_offset(
                f"{prefix}state.{name}.{param_key}",
                value,
                shape,
                (0,) * len(shape),
                replica_id=0 if param_key in first else rank + 1,
            )
    out: dict[str, Any] = {"state": state}
    if param_groups is not None:
        out["param_groups"] = param_groups
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the (lazily built) state of every trainable parameter that has none, zeroed.

    Takes one step with zero gradients and ``lr = 0`` for those parameters only (others get
    no gradient during it), then zeroes the new state; gradients and learning rates are put
    back. Values are placeholders for ``load`` to overwrite, as in torch.distributed.checkpoint.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return
    fresh = {id(p) for p in missing}
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p) if id(p) in fresh else None
            for g in optimizer.param_groups:
                if isinstance(g.get("lr"), torch.Tensor):
                    g["lr"] = torch.zeros_like(g["lr"])
                elif "lr" in g:
                    g["lr"] = 0.0
            optimizer.step()
            for p in missing:
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        _local(value).zero_()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr


def load_optimizer_state(optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]) -> None:
    """Finish a load of :func:`optimizer_sharded_state_dict`'s template into ``optimizer``.

    ``loaded`` is that template's part of what ``shardsafe.load`` or
    ``CheckpointManager.restore`` returned (restore keeps the ShardedTensors, filled in place).
    State tensors were filled in place by the load; this copies any that were not (a state
    replaced since the template was built), sets non-tensor state, and restores the
    ``param_groups`` hyperparameters by position, the learning rate included (the parameters
    stay the optimizer's own). A parameter the checkpoint holds state for but the optimizer
    has none raises :class:`IncompatibleRequestError` rather than staying without state.
    """
    params = loaded.get(PARAMS_KEY) if isinstance(loaded, Mapping) else None
    if isinstance(params, LocalNonPersistentObject):  # what restore() returns
        params = params.unwrap()
    if not isinstance(params, Mapping):
        raise IncompatibleRequestError(
            "load_optimizer_state needs the optimizer's part of what shardsafe.load(...) or "
            "CheckpointManager.restore(...) returned for a template holding "
            f"optimizer_sharded_state_dict(...) (got {type(loaded).__name__} without "
            f"{PARAMS_KEY!r}); or put OptimizerState(optimizer, model) in the state dict, which "
            "restore and load finish by themselves"
        )
    saved_state = loaded.get("state") or {}
    empty = [k for k, p in params.items() if k in saved_state and not optimizer.state.get(p)]
    if empty:
        raise IncompatibleRequestError(
            f"the checkpoint holds optimizer state for {len(empty)} parameters the optimizer has "
            f"no state for ({empty[:4]}): the load template was built before that state existed "
            "or from another optimizer; build it with optimizer_sharded_state_dict(optimizer, "
            "...) of this optimizer (it creates the state), or use OptimizerState(optimizer, "
            "model) in the state dict"
        )
    with torch.no_grad():
        for key, p in params.items():
            saved = saved_state.get(key)
            if not isinstance(saved, Mapping):
                continue
            current = optimizer.state[p]
            for name, value in saved.items():
                if isinstance(value, list):  # several pieces, filled in place
                    continue
                if isinstance(value, ShardedTensor):  # restore() keeps the filled piece
                    if value.data is None:
                        continue
                    value = value.data
                now = current.get(name)
                if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor):
                    target = _local(now)
                    if _fingerprint(target) != _fingerprint(value):
                        target.copy_(value.reshape(target.shape))
                elif isinstance(value, torch.Tensor) and is_dtensor(p) and value.ndim:
                    from torch.distributed.tensor import DTensor

                    current[name] = DTensor.from_local(
                        value,
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                        run_check=False,
                    )
                else:
                    current[name] = value
    groups = loaded.get("param_groups")
    if groups is None:
        return
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}"
        )
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        for k, v in saved_group.items():
            if k != "params":
                group[k] = v


class OptimizerState:
    """A ``torch.optim`` optimizer as a Stateful entry of a state dict, its state in
    parameter space: put it in what ``shardsafe.save``/``load`` or a
    :class:`~shardsafe.CheckpointManager` get, and it saves and restores in any layout.

    ``state_dict()`` is :func:`optimizer_sharded_state_dict` of the optimizer against the
    model's state dict (creating a fresh optimizer's state first); ``load_state_dict`` is
    :func:`load_optimizer_state`: moments and ``step`` (filled in place), non-tensor state and
    the param groups with their learning rate. ``model`` is the model (its ``state_dict()`` is
    taken each time: plain, DDP, FSDP2 or tensor-parallel DTensors) or a (sharded) state dict of
    it, such as the ``to_sharded_state_dict(model.state_dict())`` saved beside; use the same
    kind when saving and loading. ``params_by_name`` and ``prefix`` are
    :func:`optimizer_sharded_state_dict`'s (two optimizers in one state dict need two prefixes).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: Any,
        *,
        params_by_name: Mapping[str, torch.Tensor] | None = None,
        prefix: str = "optimizer.",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValidationError(
                f"OptimizerState needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.model = model
        self.params_by_name = params_by_name
        self.prefix = prefix

    def _model_state_dict(self) -> Any:
        if isinstance(self.model, (Mapping, list)):
            return self.model
        state_dict = getattr(self.model, "state_dict", None)
        if not callable(state_dict):
            raise ValidationError(
                "OptimizerState's model must be a module or a state dict, got "
                f"{type(self.model).__name__}"
            )
        return state_dict()

    def state_dict(self) -> dict[str, Any]:
        return optimizer_sharded_state_dict(
            self.optimizer,
            self._model_state_dict(),
            params_by_name=self.params_by_name,
            prefix=self.prefix,
        )

    def load_state_dict(self, loaded: Mapping[str, Any]) -> None:
        load_optimizer_state(self.optimizer, loaded)

    def __repr__(self) -> str:
        return f"OptimizerState({type(self.optimizer).__name__}, prefix={self.prefix!r})"
