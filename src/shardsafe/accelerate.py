"""Hugging Face accelerate's ``save_state``/``load_state`` as one shardsafe checkpoint:
``shardsafe.accelerate.save_state(accelerator, path)`` in place of ``accelerator.save_state(path)``.

What ``Accelerator.save_state`` saves, the same way on every distributed type it supports here
(tested: one process, DDP / multi-CPU, and FSDP2 models sharded with ``fully_shard``; FSDP1 and
accelerate's own FSDP2 wrapping take the same code path but need an accelerator to run): each prepared model and optimizer through
``torch.distributed.checkpoint.state_dict`` (canonical parameter names, no ``module.`` prefix;
under FSDP2 the DTensor shards, each rank writing its own, where accelerate hard-codes DCP's
``FileSystemWriter``), each scheduler's ``state_dict()``, the step counter, the gradient scaler,
the objects registered with ``register_for_checkpointing``, the sampler state of dataloaders
with accelerate's seedable sampler and the state of stateful dataloaders (per rank), and every
rank's RNG states (torch, CUDA, Python, numpy; per rank). One Saver commit: per-block
checksums, an atomic publish, every rank's error agreed. ``load_state`` reads it back into
another world size or sharding (tensors are resharded by their global geometry), verifying every block; damage raises a
:class:`~shardsafe.CheckpointError` before any object is changed.

Pass a :class:`~shardsafe.CheckpointManager` in place of the path to keep numbered steps
(``save_state(accelerator, manager, step=completed_steps)``; its retention applies), and
``load_state(accelerator, manager)`` resumes from the newest committed one and returns its step
(where the loop goes on, with ``accelerator.skip_first_batches`` inside an epoch): after a
crash, a save that was cut off is never taken, and a step found damaged falls back to the
newest older intact one, as :meth:`~shardsafe.CheckpointManager.restore` does. The step is the
caller's count: ``accelerator.step`` restarts at 0 with every pass over a prepared dataloader.

Not covered (raises): DeepSpeed and Megatron-LM (their engines write their own checkpoints),
XLA. ``accelerator.register_save_state_pre_hook`` hooks are not called: they receive accelerate's
file layout.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from .directory import step_name
from .dist import get_comm, outcome, raise_for
from .errors import IncompatibleRequestError, ValidationError
from .integrations.rng import RngPolicy, apply_rng_state, rng_load_template, rng_sharded_state_dict
from .loading import load, load_content_metadata
from .saver import AsyncSaveHandle, Saver, SaveStats
from .sharding import ShardedObject, detached_copy

if TYPE_CHECKING:  # the manager is a layer above this one: used, never imported
    from .manager import CheckpointManager

__all__ = ["WRITER", "load_state", "save_state"]

WRITER = "shardsafe.accelerate"  # content_metadata["writer"] of the checkpoints written here
_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "XLA")


def save_state(
    accelerator: Any,
    path: str | os.PathLike[str] | CheckpointManager,
    *,
    step: int | None = None,
    overwrite: bool = False,
    saver: Saver | None = None,
    async_save: bool = False,
) -> SaveStats | AsyncSaveHandle | None:
    """Save what ``accelerator.save_state`` saves into the shardsafe checkpoint ``path``; every
    rank calls it. ``async_save=True`` returns the Saver's handle once staged (pass a ``saver``
    you keep, and wait for the handle before the next save).

    ``path`` may be a :class:`~shardsafe.CheckpointManager`: the state is saved as its step
    ``step`` (required: the run's own count of optimizer steps, since ``accelerator.step``
    restarts with every epoch), returning what ``manager.save`` returns (a handle with its
    default ``async_save``); ``overwrite``, ``saver`` and ``async_save`` are then the manager's
    own settings."""
    _check_supported(accelerator)
    manager, where = _split(path)
    if manager is None and step is not None:
        raise ValidationError(
            f"step={step} names a step of a CheckpointManager; pass the manager in place of "
            f"the path {path!r}, or leave step out"
        )
    if manager is not None and (overwrite or saver is not None or async_save):
        raise ValidationError(
            "overwrite=, saver= and async_save= apply to a path; a CheckpointManager saves "
            "with its own Saver (set async_save= on the manager; a step saved again replaces it)"
        )
    if manager is not None and step is None:
        raise ValidationError(
            f"saving into the CheckpointManager of {manager.root} needs step= (the run's count "
            "of completed steps; accelerator.step restarts at 0 with every epoch)"
        )
    state = _state(accelerator)
    state["rng"] = rng_sharded_state_dict("rng")["rng"]
    content = {"writer": WRITER, **_counts(accelerator)}
    if manager is not None:
        assert step is not None
        return manager.save(step, state, content_metadata=content)
    assert where is not None
    if saver is None:
        if async_save:
            raise ValidationError(
                "async_save=True needs a saver= you keep (its handle writes in the background)"
            )
        with contextlib.closing(Saver()) as own:
            return own.save(state, where, overwrite=overwrite, content_metadata=content)
    if async_save:
        return saver.async_save(state, where, overwrite=overwrite, content_metadata=content)
    return saver.save(state, where, overwrite=overwrite, content_metadata=content)


def load_state(
    accelerator: Any,
    path: str | os.PathLike[str] | CheckpointManager,
    *,
    rng: RngPolicy | str = RngPolicy.AUTO,
    step: int | None = None,
    fallback: bool = True,
) -> int | None:
    """Restore what :func:`save_state` saved into the accelerator's prepared objects; every rank
    calls it. The checkpoint must hold the same number of models, optimizers, schedulers,
    registered objects and dataloaders. ``rng``: see :class:`shardsafe.integrations.rng.RngPolicy`
    (``auto``: exact with the same world size, re-derived otherwise).

    ``path`` may be a :class:`~shardsafe.CheckpointManager`: its step ``step``, by default the
    newest committed one, falling back to the newest older intact step when that one is damaged
    (``fallback=False`` raises instead). Returns the step loaded (None for a path). Raises
    :class:`~shardsafe.CheckpointNotFoundError` when the manager has no committed step."""
    _check_supported(accelerator)
    manager, where = _split(path)
    if manager is None:
        if step is not None:
            raise ValidationError(
                f"step={step} names a step of a CheckpointManager; pass the manager in place "
                f"of the path {path!r}, or leave step out"
            )
        assert where is not None
        _load_into(accelerator, os.fspath(where), rng)
        return None
    name = None if step is None else step_name(step)
    manager.restore_with(lambda p: _load_into(accelerator, p, rng), name, fallback=fallback)
    return manager.restored_step


def _load_into(accelerator: Any, path: str, rng: RngPolicy | str) -> None:
    """Load ``path`` (collective); the live objects change only after every block verified."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # checks that read only the manifest run on each rank: every rank raises together (so that
    # a manager falls back together) instead of some entering the load while others left
    rng_entry, error = outcome(lambda: _check_checkpoint(accelerator, path, rng))
    raise_for(get_comm(None).all_gather(error), "load_state")
    assert rng_entry is not None
    # copies: load fills a template in place, and the live state must stay as it is until
    # every block was read and verified
    template = detached_copy(_state(accelerator))
    template.update(rng_entry)
    loaded = load(template, path)
    # everything was read and verified; only now are the live objects changed
    for model, sd in zip(accelerator._models, loaded["models"], strict=True):
        set_model_state_dict(model, sd)
    for i, opt in enumerate(accelerator._optimizers):
        set_optimizer_state_dict(_model_of(accelerator, i), _inner(opt), loaded["optimizers"][i])
    for sched, sd in zip(accelerator._schedulers, loaded["schedulers"], strict=True):
        sched.load_state_dict(sd)
    for obj, sd in zip(accelerator._custom_objects, loaded["custom"], strict=True):
        obj.load_state_dict(sd)
    for dl, sd in zip(accelerator._dataloaders, loaded["dataloaders"], strict=True):
        _load_dataloader(dl, sd)
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(loaded["scaler"])
    accelerator.step = int(loaded["step"])
    apply_rng_state(loaded.get("rng"), rng)


def _check_checkpoint(accelerator: Any, path: str, rng: RngPolicy | str) -> dict[str, Any]:
    """Refuse a checkpoint of another writer or of other objects; the RNG template entry."""
    content = load_content_metadata(path) or {}
    if content.get("writer") != WRITER:
        raise IncompatibleRequestError(
            f"{path}: not written by shardsafe.accelerate.save_state (content_metadata "
            f"{content!r}); load it with shardsafe.load"
        )
    counts = _counts(accelerator)
    differ = {k: (content.get(k), n) for k, n in counts.items() if content.get(k) != n}
    if differ:
        raise IncompatibleRequestError(
            f"{path}: saved with a different set of prepared objects: "
            + ", ".join(f"{k}: {saved} saved, {n} here" for k, (saved, n) in differ.items())
        )
    return rng_load_template(path, "rng", rng)


def _split(
    path: str | os.PathLike[str] | CheckpointManager,
) -> tuple[CheckpointManager | None, str | os.PathLike[str] | None]:
    """(the manager, None) or (None, the path)."""
    if isinstance(path, (str, os.PathLike)):
        return None, path
    if callable(getattr(path, "restore_with", None)) and callable(getattr(path, "save", None)):
        # accelerate's ranks are the default group's, and the manager's restore_with reads
        # its persistent root only: a local tier's newer steps would be passed over
        if getattr(path, "process_group", None) is not None:
            raise ValidationError(
                f"the CheckpointManager of {path.root} has a process_group: accelerate runs "
                "every rank of the default group; create the manager without one"
            )
        if getattr(path, "_local", None) is not None:
            raise ValidationError(
                f"the CheckpointManager of {path.root} has a local_root: shardsafe.accelerate "
                "saves to and resumes from the persistent root only; create it without local_root"
            )
        return path, None
    raise ValidationError(
        f"expected a checkpoint path or a shardsafe.CheckpointManager, got {type(path).__name__}"
    )


# -- the state --------------------------------------------------------------------------------


def _state(accelerator: Any) -> dict[str, Any]:
    """The state dict of everything save_state covers (also the load template)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {
        "models": [get_model_state_dict(m) for m in accelerator._models],
        "optimizers": [
            get_optimizer_state_dict(_model_of(accelerator, i), _inner(opt))
            for i, opt in enumerate(accelerator._optimizers)
        ],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "dataloaders": [_dataloader_state(dl, n) for n, dl in enumerate(accelerator._dataloaders)],
        "step": int(accelerator.step),
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler.state_dict()
    return state


def _counts(accelerator: Any) -> dict[str, int]:
    return {
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "custom": len(accelerator._custom_objects),
        "dataloaders": len(accelerator._dataloaders),
        "scaler": int(accelerator.scaler is not None),
    }


def _model_of(accelerator: Any, i: int) -> Any:
    """The model optimizer ``i`` steps: the i-th prepared one, or the only one."""
    models = accelerator._models
    if len(models) == 1:
        return models[0]
    if len(models) == len(accelerator._optimizers):
        return models[i]
    raise ValidationError(
        f"{len(models)} prepared models and {len(accelerator._optimizers)} optimizers: cannot "
        f"tell which model optimizer {i} belongs to; prepare one model per optimizer"
    )


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dataloader_state(dl: Any, n: int) -> dict[str, Any]:
    """The seedable sampler's position (same on every rank) and a stateful dataloader's state
    (one per rank)."""
    from accelerate.data_loader import SeedableRandomSampler

    out: dict[str, Any] = {}
    get_sampler = getattr(dl, "get_sampler", None)
    sampler = get_sampler() if get_sampler is not None else None
    if isinstance(sampler, SeedableRandomSampler):
        out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(dl, "use_stateful_dataloader", False):
        rank, world = _rank_world()
        key = f"dataloaders.{n}.state"
        out["state"] = ShardedObject(key, dl.state_dict(), (world,), (rank,))
    return out


def _load_dataloader(dl: Any, saved: dict[str, Any]) -> None:
    if "sampler" in saved:
        sampler = dl.get_sampler()
        sampler.epoch = int(saved["sampler"]["epoch"])
        sampler.initial_seed = int(saved["sampler"]["initial_seed"])
    if "state" in saved:
        dl.load_state_dict(saved["state"])


def _check_supported(accelerator: Any) -> None:
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise ValidationError(
            f"shardsafe.accelerate does not save {kind} runs: their engines write their own "
            "checkpoints; use accelerator.save_state"
        )
