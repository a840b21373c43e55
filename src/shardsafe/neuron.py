"""One-call checkpointing with NeuronX Distributed's API: ``save_checkpoint``/``load_checkpoint``.

    save_checkpoint("ckpts", "step_100", model=model, optimizer=opt, scheduler=sched,
                    user_content={"step": 100}, async_save=True, num_kept_ckpts=3)
    user_content = load_checkpoint("ckpts", model=model, optimizer=opt, scheduler=sched)

Each tag is a shardsafe checkpoint ``checkpoint_dir/<tag>``; the file ``checkpoint_dir/newest``
names the last committed tag (written atomically after the commit), and ``tag=None`` loads it.

Plain modules and optimizers (a single process, or DDP where every rank holds the same
values) are saved as fully replicated ShardedTensors with ``replica_id`` = rank, so the
ranks share the writing and any number of ranks can load the result. Model tensors are
keyed ``model.<name>``; optimizer state ``optimizer.state.<param name>.<field>`` (by index
when the parameters cannot be named); param groups, the scheduler and ``user_content`` are
common state. DTensor entries (FSDP2, tensor parallel) go through
``shardsafe.integrations.dtensor.to_sharded_state_dict`` under the same keys, so FSDP2, DDP
and single-process runs load each other's checkpoints; on load, an optimizer over DTensor
parameters gets its state created (``integrations.optimizer.init_optimizer_state``) and
filled in place.

Tags are ordered naturally (``step_9`` before ``step_10``), except that the tag ``newest``
names is always the newest: that order decides which tags ``num_kept_ckpts`` deletes.
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch

from .directory import CheckpointDirectory
from .dist import get_comm, outcome, raise_for
from .errors import CheckpointError, ValidationError, call_each
from .loading import StrictHandling, load
from .manager import CheckpointManager
from .reader import CheckpointReader
from .saver import AsyncSaveHandle, SaveStats
from .sharding import ShardedTensor

NEWEST = "newest"
_NATURAL = re.compile(r"(\d+)")


class TagDirectory(CheckpointDirectory):
    """Checkpoints named by free-form tags, with the pointer ``newest``."""

    def __init__(self, root: str | os.PathLike[str], pointer: str = NEWEST) -> None:
        super().__init__(root, pointer)

    def owns(self, name: str) -> bool:
        return bool(name) and not name.startswith(".") and name != self.pointer

    def order(self, name: str) -> Any:
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in _NATURAL.split(name) if p]

    def claims_uncommitted(self, name: str) -> bool:
        # On file systems a save writes into a hidden directory, so a visible directory without
        # a manifest is someone else's data. On object stores a save writes in place.
        return not self.storage.atomic_rename and self.storage.exists(f"{name}/data")

    def newest_last(self, names: list[str]) -> list[str]:
        """``names`` in tag order, with the pointer's tag moved to the end."""
        pointed = self.read_pointer()
        return [n for n in names if n != pointed] + [n for n in names if n == pointed]


class TagManager(CheckpointManager):
    """A :class:`CheckpointManager` over tags; ``keep_last`` keeps the newest N tags."""

    _dir: TagDirectory

    def _make_directory(self, root: str | os.PathLike[str]) -> CheckpointDirectory:
        return TagDirectory(root)

    def _doomed(self, committed: list[str], latest: str) -> list[str]:
        if self.keep_last is None:
            return []
        ordered = [n for n in self._dir.newest_last(committed) if n != latest] + [latest]
        return ordered[: -self.keep_last]

    def tag_path(self, tag: str) -> str:
        return self._dir.path(_check_tag(tag))

    def save_tag(self, tag: str, state: Any) -> AsyncSaveHandle | SaveStats:
        return self._save_named(_check_tag(tag), state)

    def resolve_tag(self, tag: str | None) -> str:
        """Collective when ``tag`` is None: the newest committed tag, the same on every rank."""
        return self._resolve(None if tag is None else _check_tag(tag))

    def tags(self) -> list[str]:
        return self._dir.newest_last(self._dir.committed())


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or "/" in tag or "\\" in tag or tag.startswith("."):
        raise ValueError(f"a checkpoint tag must be a plain, non-hidden name, got {tag!r}")
    if tag == NEWEST:
        raise ValueError(f"{NEWEST!r} is reserved for the pointer to the newest checkpoint")
    return tag


# -- one manager per (directory, process group), so async saves and retention carry over -----
class NeuronCheckpoints:
    """The state of ``save_checkpoint``/``load_checkpoint``: one manager per (directory,
    process group), so that an async save in flight and retention carry over between calls.

    The module-level functions use :data:`DEFAULT` (closed at exit, and by
    ``shardsafe.release()``); hold your own to choose its lifetime, and ``close()`` it
    (``close_at_exit=True`` also closes it when the interpreter exits, once it was used).
    """

    def __init__(self, *, close_at_exit: bool = False) -> None:
        self._managers: dict[tuple[str, int], TagManager] = {}
        self._lock = threading.Lock()
        self._close_at_exit = close_at_exit
        self._at_exit_registered = False

    def manager(self, checkpoint_dir: str | os.PathLike[str], process_group: Any) -> TagManager:
        """The manager of ``checkpoint_dir`` for ``process_group`` (made on first use)."""
        probe = TagDirectory(checkpoint_dir)
        key = (probe.url, id(process_group) if process_group is not None else 0)
        with self._lock:
            manager = self._managers.get(key)
            if manager is None or manager._closed:
                manager = self._managers[key] = TagManager(
                    checkpoint_dir, async_save=False, process_group=process_group
                )
            if self._close_at_exit and not self._at_exit_registered:
                atexit.register(self.close)
                self._at_exit_registered = True
            return manager

    def __len__(self) -> int:
        with self._lock:
            return len(self._managers)

    def save_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        tag: str,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        user_content: Any = None,
        async_save: bool = False,
        num_kept_ckpts: int | None = None,
        process_group: Any = None,
        *,
        num_workers: int = 8,
        use_xser: bool = False,
        zero1_optimizer: bool = False,
        use_zero1_dcp: bool = False,
        avoid_saving_lower_precision_weights: bool = False,
    ) -> AsyncSaveHandle | SaveStats:
        """See the module-level :func:`save_checkpoint`."""
        _check_nxd_options(
            num_workers,
            use_xser,
            zero1_optimizer,
            use_zero1_dcp,
            avoid_saving_lower_precision_weights,
        )
        return _save_checkpoint(
            self.manager(checkpoint_dir, process_group),
            tag,
            model,
            optimizer,
            scheduler,
            user_content,
            async_save,
            num_kept_ckpts,
            process_group,
        )

    def load_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike[str],
        tag: str | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        process_group: Any = None,
        *,
        strict: bool = True,
        fallback: bool = True,
        num_workers: int = 8,
    ) -> Any:
        """See the module-level :func:`load_checkpoint`."""
        _check_num_workers(num_workers)
        return _load_checkpoint(
            self.manager(checkpoint_dir, process_group),
            tag,
            model,
            optimizer,
            scheduler,
            process_group,
            strict,
            fallback,
        )

    def close(self) -> None:
        """Wait for every async save in flight, then free the managers (their savers' memory,
        threads and connections); later calls make fresh ones."""
        with self._lock:
            managers = list(self._managers.values())
            self._managers.clear()
        call_each(m.close for m in managers)


DEFAULT = NeuronCheckpoints(close_at_exit=True)
"""What the module-level functions use; :func:`finalize_checkpoint` and ``shardsafe.release()``
close it, and so does the interpreter's exit."""


def finalize_checkpoint() -> None:
    """Wait for every async save in flight (called at exit; call it before tearing down the
    process group) and free the default managers."""
    DEFAULT.close()


def has_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """True when ``checkpoint_dir`` holds at least one committed checkpoint."""
    return bool(TagDirectory(checkpoint_dir).committed())


# -- building the sharded state dict of plain modules and optimizers ------------------------------
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """DDP's ``module.`` prefix would make the keys depend on the wrapper; save the inner module."""
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and isinstance(
        inner, torch.nn.Module
    ):
        return inner
    return model


def _is_dtensor(value: Any) -> bool:
    # No DTensor can exist before its module is imported, and importing it costs seconds.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return isinstance(dtensor, type) and isinstance(value, dtensor)


def _convert_dtensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """``{checkpoint key: DTensor}`` to ``{checkpoint key: sharded entry}`` via the DTensor integration."""
    try:
        module = importlib.import_module("shardsafe.integrations.dtensor")
    except ImportError as e:
        raise CheckpointError(
            f"the state holds DTensors ({sorted(tensors)[:3]}...); saving or loading them needs "
            f"shardsafe.integrations.dtensor.to_sharded_state_dict, which cannot be imported: {e}"
        ) from e
    convert = getattr(module, "to_sharded_state_dict", None)
    if not callable(convert):
        raise CheckpointError(
            "shardsafe.integrations.dtensor has no to_sharded_state_dict; DTensor state cannot be converted"
        )
    converted = convert(tensors)
    missing = [k for k in tensors if k not in converted]
    if missing:
        raise CheckpointError(
            f"shardsafe.integrations.dtensor.to_sharded_state_dict returned no entry for {missing[:3]}"
        )
    return {k: converted[k] for k in tensors}


def _plain(value: Any) -> Any:
    """Ordered/default dicts as plain dicts, so common state stays plain JSON where it can."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _replicated(key: str, tensor: torch.Tensor, rank: int) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, tensor.detach(), replica_id=rank)


def _model_state(model: torch.nn.Module, rank: int) -> dict[str, Any]:
    """The module's state dict with every tensor wrapped (views of the live tensors)."""
    return _model_state_and_dtensors(model, rank)[0]


def _model_state_and_dtensors(model: torch.nn.Module, rank: int) -> tuple[dict[str, Any], set[str]]:
    out: dict[str, Any] = {}
    dtensors: dict[str, Any] = {}
    for name, value in _unwrap(model).state_dict().items():
        if _is_dtensor(value):
            dtensors[f"model.{name}"] = value
            out[name] = None
        elif isinstance(value, torch.Tensor):
            out[name] = _replicated(f"model.{name}", value, rank)
        else:
            out[name] = _plain(value)
    if dtensors:
        converted = _convert_dtensors(dtensors)
        for key, entry in converted.items():
            out[key.removeprefix("model.")] = entry
    return out, {k.removeprefix("model.") for k in dtensors}


def _param_names(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> list[str] | None:
    """The name of each parameter in the optimizer's index order, or None if any is unnamed."""
    if model is None:
        return None
    by_id = {id(p): n for n, p in _unwrap(model).named_parameters()}
    names = [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if any(n is None for n in names) or len(set(names)) != len(names):
        return None
    return [str(n) for n in names]


def _state_key(pid: str, field: str) -> str:
    return f"optimizer.state.{pid}.{field}"


def _optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, rank: int
) -> dict[str, Any]:
    osd = optimizer.state_dict()
    names = _param_names(optimizer, model)
    state: dict[str, Any] = {}
    tensor_fields: dict[str, list[str]] = {}
    dtensors: dict[str, Any] = {}
    where: dict[str, tuple[str, str]] = {}
    for index, fields in osd["state"].items():
        pid = names[index] if names is not None else str(index)
        entry: dict[str, Any] = {}
        for field, value in fields.items():
            key = _state_key(pid, field)
            if _is_dtensor(value):
                dtensors[key] = value
                where[key] = (pid, field)
                entry[field] = None
            elif isinstance(value, torch.Tensor):
                entry[field] = _replicated(key, value, rank)
            else:
                entry[field] = _plain(value)
                continue
            tensor_fields.setdefault(pid, []).append(field)
        state[pid] = entry
    if dtensors:
        for key, converted in _convert_dtensors(dtensors).items():
            pid, field = where[key]
            state[pid][field] = converted
    return {
        "state": state,
        "param_groups": _plain(osd["param_groups"]),
        "param_names": names,
        "tensor_fields": tensor_fields,
    }


def _optimizer_template(
    saved: Mapping[str, Any], reader: CheckpointReader, rank: int
) -> dict[str, Any]:
    """Fresh tensors of the stored shapes: an optimizer that has not stepped has no state to fill."""
    state: dict[str, Any] = {}
    for pid, fields in saved.get("tensor_fields", {}).items():
        entry = state.setdefault(pid, {})
        for field in fields:
            key = _state_key(pid, field)
            shape, dtype = reader.tensor_meta(key)
            entry[field] = _replicated(key, torch.empty(shape, dtype=dtype), rank)
    return {"state": state}


def _optimizer_state_dict(
    loaded: Mapping[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> dict[str, Any]:
    """Back to ``optimizer.load_state_dict``'s form: state and param groups by this optimizer's indices."""
    saved_names = loaded.get("param_names")
    groups = [dict(g) for g in loaded["param_groups"]]
    if saved_names is None:
        return {
            "state": {int(pid): dict(v) for pid, v in loaded["state"].items()},
            "param_groups": groups,
        }
    names = _param_names(optimizer, model)
    if names is None:
        raise CheckpointError(
            "the checkpoint keys optimizer state by parameter name; pass the model too, so that "
            "the optimizer's parameters can be named"
        )
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in saved_names if n not in index]
    if unknown:
        raise CheckpointError(
            f"the checkpoint has optimizer state for parameters this model lacks: {unknown[:5]}"
        )
    for g in groups:
        g["params"] = [index[saved_names[i]] for i in g["params"]]
    return {
        "state": {index[pid]: dict(v) for pid, v in loaded["state"].items()},
        "param_groups": groups,
    }


def _has_dtensor_params(optimizer: torch.optim.Optimizer) -> bool:
    return any(_is_dtensor(p) for group in optimizer.param_groups for p in group["params"])


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create lazily built state (Adam's moments) so that it can be filled in place."""
    try:
        module = importlib.import_module("shardsafe.integrations.optimizer")
    except ImportError as e:
        raise CheckpointError(
            "loading the state of an optimizer over DTensor parameters needs "
            f"shardsafe.integrations.optimizer.init_optimizer_state, which cannot be imported: {e}"
        ) from e
    module.init_optimizer_state(optimizer)


def _keep_live_dtensors(osd: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Put the optimizer's own DTensor state (filled in place) where ``load`` returned its
    local shard, so that ``load_state_dict`` keeps the placements."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, fields in osd["state"].items():
        live = optimizer.state.get(params[index], {})
        for field in fields:
            if _is_dtensor(live.get(field)):
                fields[field] = live[field]


# -- the API ----------------------------------------------------------------------------------
def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    user_content: Any = None,
    async_save: bool = False,
    num_kept_ckpts: int | None = None,
    process_group: Any = None,
    *,
    num_workers: int = 8,
    use_xser: bool = False,
    zero1_optimizer: bool = False,
    use_zero1_dcp: bool = False,
    avoid_saving_lower_precision_weights: bool = False,
) -> AsyncSaveHandle | SaveStats:
    """Save ``checkpoint_dir/tag``; every rank of ``process_group`` calls it.

    With ``async_save`` it returns once the state is staged in host memory (a later call,
    ``load_checkpoint`` or :func:`finalize_checkpoint` waits for it). ``num_kept_ckpts``
    (None or -1: all) deletes the oldest committed tags beyond that many, after the commit.

    NeuronX Distributed's other keywords are accepted (:func:`_check_nxd_options` says what
    each does here): ``num_workers`` (a positive int), ``use_xser`` and
    ``avoid_saving_lower_precision_weights`` change nothing; ``zero1_optimizer`` and
    ``use_zero1_dcp`` set to True are refused.
    """
    return DEFAULT.save_checkpoint(
        checkpoint_dir,
        tag,
        model,
        optimizer,
        scheduler,
        user_content,
        async_save,
        num_kept_ckpts,
        process_group,
        num_workers=num_workers,
        use_xser=use_xser,
        zero1_optimizer=zero1_optimizer,
        use_zero1_dcp=use_zero1_dcp,
        avoid_saving_lower_precision_weights=avoid_saving_lower_precision_weights,
    )


def _check_num_workers(num_workers: int) -> None:
    """NxD's ``num_workers`` bounds how many ranks of a host write (or read) at once, to cap
    host memory. Here every rank writes its own share from a staging pool bounded by the
    Saver's ``max_staging_bytes``, so it has no effect; it must still be a positive int."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValidationError(f"num_workers must be a positive int, got {num_workers!r}")


def _check_nxd_options(
    num_workers: int,
    use_xser: bool,
    zero1_optimizer: bool,
    use_zero1_dcp: bool,
    avoid_saving_lower_precision_weights: bool,
) -> None:
    """What NxD's keywords mean here. ``use_xser`` (torch-xla's one-file-per-tensor format):
    the format is always shardsafe's, whose tensors are already stored one piece at a time.
    ``avoid_saving_lower_precision_weights``: the model's weights are saved anyway (a load
    fills the model from them; nothing is lost). ``zero1_optimizer``/``use_zero1_dcp``
    describe per-rank ZeRO-1 optimizer partitions, which this API does not save: it stores
    optimizer state in parameter space, the same on every rank; refused rather than saved
    wrongly (an FSDP2/DTensor optimizer, or ShardedTensors with ``flattened_range`` through
    ``shardsafe.save``, store sharded optimizer state)."""
    _check_num_workers(num_workers)
    for name, value in (
        ("use_xser", use_xser),
        ("avoid_saving_lower_precision_weights", avoid_saving_lower_precision_weights),
    ):
        if not isinstance(value, bool):
            raise ValidationError(f"{name} must be a bool, got {value!r}")
    for name, value in (("zero1_optimizer", zero1_optimizer), ("use_zero1_dcp", use_zero1_dcp)):
        if value:
            raise ValidationError(
                f"{name}=True: shardsafe.neuron stores optimizer state in parameter space, the "
                "same on every rank, not per-rank ZeRO-1 partitions; save a ZeRO-1 optimizer's "
                "state as ShardedTensors with flattened_range through shardsafe.save, or use "
                "FSDP2 (DTensor) state, which this API saves"
            )


def _save_checkpoint(
    manager: TagManager,
    tag: str,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    user_content: Any,
    async_save: bool,
    num_kept_ckpts: int | None,
    process_group: Any,
) -> AsyncSaveHandle | SaveStats:
    rank = get_comm(process_group).rank
    state: dict[str, Any] = {}
    if model is not None:
        state["model"] = _model_state(model, rank)
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(optimizer, model, rank)
    if scheduler is not None:
        state["scheduler"] = _plain(scheduler.state_dict())
    if user_content is not None:
        state["user_content"] = user_content
    if num_kept_ckpts is not None and num_kept_ckpts != -1 and num_kept_ckpts < 1:
        raise ValueError(f"num_kept_ckpts must be positive, -1 or None, got {num_kept_ckpts}")
    manager.keep_last = None if num_kept_ckpts in (None, -1) else num_kept_ckpts
    manager.async_save = async_save
    return manager.save_tag(tag, state)


def load_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    process_group: Any = None,
    *,
    strict: bool = True,
    fallback: bool = True,
    num_workers: int = 8,
) -> Any:
    """Load ``checkpoint_dir/tag`` (default: the newest committed) into the given objects,
    in place; returns the saved ``user_content`` (None if there was none). ``num_workers``
    (NxD's) has no effect: see :func:`_check_num_workers`.

    Every rank of ``process_group`` calls it; any number of ranks can load what any number
    saved. ``strict`` applies to the model's keys, as in ``Module.load_state_dict``. Without a
    ``tag``, a newest checkpoint that turns out corrupt or incomplete is marked and the newest
    older intact one is loaded instead on every rank (``fallback=False`` raises instead), as
    :meth:`CheckpointManager.restore` does.
    """
    return DEFAULT.load_checkpoint(
        checkpoint_dir,
        tag,
        model,
        optimizer,
        scheduler,
        process_group,
        strict=strict,
        fallback=fallback,
        num_workers=num_workers,
    )


def _load_checkpoint(
    manager: TagManager,
    tag: str | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    process_group: Any,
    strict: bool,
    fallback: bool,
) -> Any:
    comm = get_comm(process_group)

    def load_into(path: str) -> Any:
        # Reading the common state is local: gather its outcome so that a damaged file on one
        # rank fails (and falls back) on every rank instead of leaving the others in `load`.
        prepared, err = outcome(lambda: _template(path, model, optimizer, scheduler, comm.rank))
        raise_for(comm.all_gather(err), "load_checkpoint")
        assert prepared is not None
        template, in_place, sharded_optimizer = prepared
        loaded = load(
            template,
            path,
            process_group=process_group,
            strict=StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED,
        )
        if model is not None:
            values = {k: v for k, v in loaded["model"].items() if k not in in_place}
            _unwrap(model).load_state_dict(values, strict=strict and not in_place)
        if optimizer is not None:
            osd = _optimizer_state_dict(loaded["optimizer"], optimizer, model)
            if sharded_optimizer:
                _keep_live_dtensors(osd, optimizer)
            optimizer.load_state_dict(osd)
        if scheduler is not None:
            scheduler.load_state_dict(loaded["scheduler"])
        return loaded.get("user_content")

    return manager.restore_with(
        load_into, None if tag is None else _check_tag(tag), fallback=fallback
    )


def _template(
    path: str,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    rank: int,
) -> tuple[dict[str, Any], set[str], bool]:
    """What this rank asks ``load`` for: (template, DTensor keys filled in place, whether the
    optimizer is over DTensors)."""
    reader = CheckpointReader(path)
    common = reader.common()
    common = common if isinstance(common, dict) else {}
    for what, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None and what not in common:
            raise CheckpointError(f"{path} holds no {what} state")
    template: dict[str, Any] = {}
    in_place: set[str] = set()  # DTensor entries: filled in place, not through load_state_dict
    if model is not None:
        template["model"], in_place = _model_state_and_dtensors(model, rank)
    sharded_optimizer = optimizer is not None and _has_dtensor_params(optimizer)
    if optimizer is not None:
        if sharded_optimizer:
            # DTensor state cannot be made up from the manifest: create the optimizer's own
            # (placed like its parameters) and fill it in place.
            _init_optimizer_state(optimizer)
            template["optimizer"] = {"state": _optimizer_state(optimizer, model, rank)["state"]}
        else:
            template["optimizer"] = _optimizer_template(common["optimizer"], reader, rank)
    return template, in_place, sharded_optimizer


__all__ = [
    "DEFAULT",
    "NEWEST",
    "NeuronCheckpoints",
    "TagDirectory",
    "TagManager",
    "finalize_checkpoint",
    "has_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
