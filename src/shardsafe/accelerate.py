"""Hugging Face accelerate's ``save_state``/``load_state`` as one shardsafe checkpoint:
``shardsafe.accelerate.save_state(accelerator, path)`` in place of ``accelerator.save_state(path)``.

What ``Accelerator.save_state`` saves, the same way on every distributed type it supports here
(one process, DDP / multi-CPU, FSDP and FSDP2): each prepared model and optimizer through
``torch.distributed.checkpoint.state_dict`` (canonical parameter names, no ``module.`` prefix;
under FSDP2 the DTensor shards, each rank writing its own, where accelerate hard-codes DCP's
``FileSystemWriter``), each scheduler's ``state_dict()``, the step counter, the gradient scaler,
the objects registered with ``register_for_checkpointing``, the sampler state of dataloaders
with accelerate's seedable sampler and the state of stateful dataloaders (per rank), and every
rank's RNG states (torch, CUDA, Python, numpy; per rank). One Saver commit: per-block
checksums, an atomic publish, every rank's error agreed. ``load_state`` reads it back into any
layout (another world size, FSDP2 <-> DDP), verifying every block; damage raises a
:class:`~shardsafe.CheckpointError` before any object is changed.

Not covered (raises): DeepSpeed and Megatron-LM (their engines write their own checkpoints),
XLA. ``accelerator.register_save_state_pre_hook`` hooks are not called: they receive accelerate's
file layout.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .errors import IncompatibleRequestError, ValidationError
from .integrations.rng import RngPolicy, apply_rng_state, rng_load_template, rng_sharded_state_dict
from .loading import load, load_content_metadata
from .saver import AsyncSaveHandle, Saver, SaveStats
from .sharding import ShardedObject, detached_copy

__all__ = ["WRITER", "load_state", "save_state"]

WRITER = "shardsafe.accelerate"  # content_metadata["writer"] of the checkpoints written here
_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "XLA")


def save_state(
    accelerator: Any,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    saver: Saver | None = None,
    async_save: bool = False,
) -> SaveStats | AsyncSaveHandle:
    """Save what ``accelerator.save_state`` saves into the shardsafe checkpoint ``path``; every
    rank calls it. ``async_save=True`` returns the Saver's handle once staged (pass a ``saver``
    you keep, and wait for the handle before the next save)."""
    _check_supported(accelerator)
    state = _state(accelerator)
    state["rng"] = rng_sharded_state_dict("rng")["rng"]
    content = {"writer": WRITER, **_counts(accelerator)}
    if saver is None:
        if async_save:
            raise ValidationError(
                "async_save=True needs a saver= you keep (its handle writes in the background)"
            )
        with contextlib.closing(Saver()) as own:
            return own.save(state, path, overwrite=overwrite, content_metadata=content)
    if async_save:
        return saver.async_save(state, path, overwrite=overwrite, content_metadata=content)
    return saver.save(state, path, overwrite=overwrite, content_metadata=content)


def load_state(
    accelerator: Any,
    path: str | os.PathLike[str],
    *,
    rng: RngPolicy | str = RngPolicy.AUTO,
) -> None:
    """Restore what :func:`save_state` saved into the accelerator's prepared objects; every rank
    calls it. The checkpoint must hold the same number of models, optimizers, schedulers,
    registered objects and dataloaders. ``rng``: see :class:`shardsafe.integrations.rng.RngPolicy`
    (``auto``: exact with the same world size, re-derived otherwise)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _check_supported(accelerator)
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
    # copies: load fills a template in place, and the live state must stay as it is until
    # every block was read and verified
    template = detached_copy(_state(accelerator))
    template.update(rng_load_template(path, "rng", rng))
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
