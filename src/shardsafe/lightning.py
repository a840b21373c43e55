"""PyTorch Lightning (``pytorch_lightning`` 2.x) saving through shardsafe:
``Trainer(plugins=[shardsafe.lightning.CheckpointIO()])`` is the whole change.

Lightning hands its ``CheckpointIO`` one dict per checkpoint (``state_dict``, ``optimizer_states``,
``lr_schedulers``, ``loops``, ``callbacks``, hyper-parameters...). The plugin saves that dict
with a :class:`~shardsafe.Saver` as a shardsafe checkpoint directory at Lightning's path: every
tensor is a stored tensor with per-block checksums, everything else is common state in the safe
codec (a value it cannot store is refused with its key, never dropped), and the manifest is
published atomically. ``load_checkpoint`` reads it back with :func:`shardsafe.load`: every block
verified, no pickle run; damage raises a :class:`~shardsafe.CheckpointError`, so
``trainer.fit(ckpt_path=...)`` never resumes from garbage.

Strategies: single device and DDP (``ddp``, ``ddp_spawn``...), where Lightning calls the plugin on
global rank 0 to save (one process writes the replicated state, through a process group of that
rank alone) and on every rank to load. Lightning's FSDP and ModelParallel strategies bypass
``CheckpointIO`` for their sharded saves (they call DCP themselves): for ModelParallel (FSDP2 /
tensor parallel through ``configure_model``), ``Trainer(strategy=shardsafe.lightning.
ModelParallelStrategy(...))`` saves the whole checkpoint, each rank writing its own DTensor
shards; for FSDP (FSDP1), ``Trainer(strategy=shardsafe.lightning.FSDPStrategy(...))`` does the
same with FSDP1's sharded state (torch ``ShardedTensor`` s).

Resuming after a crash: a save replaces nothing until it commits (it writes into a hidden
``.<name>.shardsafe-tmp-*`` directory beside Lightning's path and renames it into place), so a
process killed in the middle of a save leaves the previous checkpoints as they were. Lightning's
``ckpt_path="last"`` (with ``ModelCheckpoint(save_last=True)``) then finds the last committed
``last.ckpt``; :func:`newest_checkpoint` finds the most recently committed checkpoint of any name.
A path holding no committed checkpoint (a half-written directory copied there, say) is never
loaded: the resume raises a :class:`~shardsafe.CheckpointError` naming it.

``ModelCheckpoint(save_top_k=...)`` deletes through :meth:`CheckpointIO.remove_checkpoint`, which
deletes only a committed shardsafe checkpoint this plugin wrote (its manifest says so) and raises
for anything else: a stranger's file or directory is never deleted.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from functools import partial
from typing import Any

import torch

try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
    from pytorch_lightning.strategies import FSDPStrategy as _FSDPStrategy
    from pytorch_lightning.strategies import ModelParallelStrategy as _ModelParallelStrategy
    from pytorch_lightning.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardsafe.lightning needs PyTorch Lightning 2.x: pip install pytorch-lightning"
    ) from e

from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from .format import MANIFEST_NAME
from .lease import lease_state
from .loading import load, load_content_metadata
from .location import OLD_MARK, locate
from .saver import AsyncSaveHandle, Saver
from .sharding import ShardedTensor, ShardedTensorFactory, detached_copy

__all__ = [
    "WRITER",
    "CheckpointIO",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "newest_checkpoint",
]

WRITER = "shardsafe.lightning"  # content_metadata["writer"] of the checkpoints this plugin writes
_MODULE_METADATA = "shardsafe.lightning/state_dict._metadata"  # where state_dict._metadata rides


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's ``CheckpointIO`` writing and reading shardsafe checkpoints.

    ``async_save=True`` returns once the state is staged in host memory and writes in the
    background (one save in flight; the next save, a load, a removal and ``teardown`` wait for
    it and raise its error). ``options`` are :class:`shardsafe.Saver`'s (``files_per_rank``,
    ``verify_after_write``, ``direct_io``...). Lightning's ``AsyncCheckpointIO`` wrapper works too,
    but then a removal does not wait for a save in flight.
    """

    def __init__(self, *, async_save: bool = False, **options: Any) -> None:
        self.async_save = async_save
        self.options = options
        self._saver: Saver | None = None
        self._group: Any = None
        self._inflight: AsyncSaveHandle | None = None

    # -- Lightning's CheckpointIO --------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{path}: shardsafe.lightning.CheckpointIO takes no storage_options (got "
                f"{storage_options!r}); pass Saver options to CheckpointIO(...)"
            )
        self.wait()
        path = os.fspath(path)
        overwrite = _ours(path, "overwrite")  # Lightning re-saves e.g. last.ckpt in place
        state = dict(checkpoint)
        module_state = state.get("state_dict")
        meta = getattr(module_state, "_metadata", None)
        if meta is not None:  # the module versions load_state_dict consults
            state[_MODULE_METADATA] = {k: dict(v) for k, v in meta.items()}
        saver = self._get_saver()
        content = {"writer": WRITER, "lightning_keys": sorted(map(str, checkpoint))}
        if self.async_save:
            self._inflight = saver.async_save(
                state, path, overwrite=overwrite, content_metadata=content
            )
        else:
            saver.save(state, path, overwrite=overwrite, content_metadata=content)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict as Lightning saved it (``weights_only`` is moot: nothing is
        unpickled). ``map_location``: None (CPU), a device or a device name."""
        self.wait()
        path = os.fspath(path)
        if not os.path.isdir(path) and os.path.exists(path):
            raise CheckpointNotFoundError(
                f"{path} is a file, not a shardsafe checkpoint directory; resume from a "
                "checkpoint written by shardsafe.lightning.CheckpointIO, or convert this one "
                "with `shardsafe convert`"
            )
        state = load({}, path, process_group=self._get_group())
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: holds no Lightning checkpoint (its state is no dict)")
        meta = state.pop(_MODULE_METADATA, None)
        if isinstance(state.get("state_dict"), dict):
            module_state = OrderedDict(state["state_dict"])
            if meta is not None:
                module_state._metadata = meta  # type: ignore[attr-defined]
            state["state_dict"] = module_state
        if map_location is not None:
            state = _to_device(state, map_location, path)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint this plugin wrote (manifest first, so an interruption leaves a
        recognisable leftover); raise for anything else at ``path``."""
        self.wait()
        path = os.fspath(path)
        if not os.path.lexists(path):
            return  # as Lightning's own CheckpointIO: nothing there, nothing to delete
        _ours(path, "delete")
        loc = locate(path)
        if lease_state(loc.parent, loc.lock_name) == "held":
            raise CheckpointExistsError(
                f"{path}: a save into it holds its lease; not deleted (retry once it finished)"
            )
        loc.parent.remove_tree(loc.join("manifest.json"))
        loc.parent.remove_tree(loc.name)

    def teardown(self) -> None:
        """Wait for the save in flight (raising its error), then free the Saver."""
        try:
            self.wait()
        finally:
            if self._saver is not None:
                self._saver.close()
                self._saver = None

    # -- ours ------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the async save in flight, raising its :class:`CheckpointError`."""
        handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.result()

    def _get_group(self) -> Any:
        """None in one process; else a process group of this rank alone: Lightning calls a
        CheckpointIO from global rank 0 to save and from each rank to load."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            rank = dist.get_rank()
            self._group = dist.new_group([rank], use_local_synchronization=True)
        return self._group

    def _get_saver(self) -> Saver:
        if self._saver is None:
            self._saver = Saver(self._get_group(), **self.options)
        return self._saver


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose distributed checkpoints are shardsafe ones.

    Every rank saves with one :class:`~shardsafe.Saver` commit over the default group: the
    module's and optimizers' DTensor shards (each rank writes its own; replicas once) and
    Lightning's other state as common state, which must be equal on every rank (a difference is
    an error naming the value and ranks). Loading reads into the current mesh, every block
    verified before the module or optimizers change.
    Arguments are Lightning's, plus ``saver_options`` for the :class:`~shardsafe.Saver`. With
    ``save_distributed_checkpoint=False`` Lightning gathers a full checkpoint and saves it
    through the ``CheckpointIO`` (pass :class:`CheckpointIO` as a plugin for that).
    """

    def __init__(self, *args: Any, saver_options: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._saver_options = dict(saver_options or {})
        self._shardsafe_saver: Saver | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"{filepath}: shardsafe's ModelParallelStrategy takes no storage_options"
            )
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        overwrite = _ours(path, "overwrite")
        if self._shardsafe_saver is None:
            self._shardsafe_saver = Saver(**self._saver_options)
        content = {"writer": WRITER, "lightning_keys": sorted(map(str, checkpoint))}
        self._shardsafe_saver.save(checkpoint, path, overwrite=overwrite, content_metadata=content)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        return _load_distributed(self, path, detached_copy)

    def teardown(self) -> None:
        try:
            if self._shardsafe_saver is not None:
                self._shardsafe_saver.close()
                self._shardsafe_saver = None
        finally:
            super().teardown()


class FSDPStrategy(_FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) whose sharded checkpoints are shardsafe ones.

    Lightning saves FSDP1's sharded state by calling DCP itself (and pickles the rest into a
    ``meta.pt`` beside it), bypassing ``CheckpointIO``; here every rank saves with one
    :class:`~shardsafe.Saver` commit over the default group instead: the module's and
    optimizers' shards (FSDP1's ``SHARDED_STATE_DICT`` gives torch ``ShardedTensor`` s; each rank
    writes its own local shard at its global offset) and Lightning's other state as common
    state, equal on every rank. Loading fills fresh copies of those shards, every block
    verified, before the module and optimizers load them through FSDP.

    ``state_dict_type`` is ``"sharded"`` (the default here); ``"full"`` is refused, since
    Lightning's full-state resume reads a single ``torch.save`` file only. On CPU (gloo) the
    module is wrapped with ``device_id=cpu``: Lightning passes ``device_id=None`` there, which
    torch's FSDP refuses ("FSDP needs a non-CPU accelerator device"). Arguments are
    Lightning's (by keyword), plus ``saver_options`` for the :class:`~shardsafe.Saver`.
    """

    def __init__(
        self,
        *,
        state_dict_type: str = "sharded",
        saver_options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if state_dict_type != "sharded":
            raise ValueError(
                f"shardsafe.lightning.FSDPStrategy saves sharded checkpoints only (got "
                f"state_dict_type={state_dict_type!r}): Lightning's full-state resume reads a "
                "single torch.save file"
            )
        super().__init__(state_dict_type="sharded", **kw)
        self._saver_options = dict(saver_options or {})
        self._shardsafe_saver: Saver | None = None

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if self.root_device.type == "cpu" and not any(isinstance(m, FSDP) for m in model.modules()):
            policy = self.kwargs.pop("auto_wrap_policy", None)  # applied here, not again
            model = FSDP(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **({} if policy is None else {"auto_wrap_policy": policy}),
                **self.kwargs,
            )
        return super()._setup_model(model)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{filepath}: shardsafe's FSDPStrategy takes no storage_options")
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        overwrite = _ours(path, "overwrite")
        if self._shardsafe_saver is None:
            self._shardsafe_saver = Saver(**self._saver_options)
        content = {"writer": WRITER, "lightning_keys": sorted(map(str, checkpoint))}
        self._shardsafe_saver.save(
            _torch_sharded_aware(checkpoint), path, overwrite=overwrite, content_metadata=content
        )

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # the local shards of FSDP1's ShardedTensors are copies already; plain tensors are copied
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        return _load_distributed(self, path, lambda sd: _torch_sharded_aware(sd, copy=True))

    def teardown(self) -> None:
        try:
            if self._shardsafe_saver is not None:
                self._shardsafe_saver.close()
                self._shardsafe_saver = None
        finally:
            super().teardown()


def _load_distributed(strategy: Any, path: str, prepare: Any) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into the strategy's module and optimizers, through
    ``torch.distributed.checkpoint.state_dict`` (FSDP1, FSDP2, TP alike): ``prepare`` turns
    their state dicts into a template of copies, so the live module and optimizers change only
    after every block was read and verified; the rest of the checkpoint is returned."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not _ours(path, "load"):
        raise CheckpointNotFoundError(f"{path}: no checkpoint there")
    assert strategy.model is not None and strategy.lightning_module is not None
    fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
    template: dict[str, Any] = {"state_dict": get_model_state_dict(strategy.model)}
    if fitting and strategy.optimizers:  # a fresh optimizer's state is created here
        template["optimizer_states"] = [
            get_optimizer_state_dict(strategy.model, opt) for opt in strategy.optimizers
        ]
    state = load(prepare(template), path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds no Lightning checkpoint (its state is no dict)")
    strict = strategy.lightning_module.strict_loading
    set_model_state_dict(
        strategy.model, state.pop("state_dict"), options=StateDictOptions(strict=strict)
    )
    optimizer_states = state.pop("optimizer_states", None)
    if fitting and strategy.optimizers:
        if not isinstance(optimizer_states, list) or len(optimizer_states) != len(
            strategy.optimizers
        ):
            raise CheckpointError(
                f"{path}: holds no state for the {len(strategy.optimizers)} optimizers here"
            )
        for opt, sd in zip(strategy.optimizers, optimizer_states, strict=True):
            set_optimizer_state_dict(strategy.model, opt, sd)
    return state


def _torch_sharded_aware(tree: Any, path: tuple[str, ...] = (), copy: bool = False) -> Any:
    """``tree`` with each torch ``ShardedTensor`` (FSDP1's sharded state) replaced by a factory
    of this rank's local shards, each a shardsafe ShardedTensor at its global offset (none on a
    rank FSDP gave no rows); on load the factory gives back the torch ``ShardedTensor``, its
    local shards filled in place. Other leaves are left as they are (plain tensors are copied
    with ``copy``)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

    if isinstance(tree, TorchShardedTensor):
        return ShardedTensorFactory(".".join(path), tree, _local_shards, partial(_itself, tree))
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone() if copy else tree
    if isinstance(tree, dict):
        items = ((k, _torch_sharded_aware(v, (*path, str(k)), copy)) for k, v in tree.items())
        return OrderedDict(items) if isinstance(tree, OrderedDict) else dict(items)
    if isinstance(tree, list):
        return [_torch_sharded_aware(v, (*path, str(i)), copy) for i, v in enumerate(tree)]
    return tree


def _itself(st: Any, _loaded: Any) -> Any:
    """``ShardedTensorFactory.merge_fn``: the torch ShardedTensor, its local shards filled."""
    return st


def _local_shards(key: str, st: Any, _replica: Any, _flat: Any) -> Any:
    """``ShardedTensorFactory.build_fn``: the local shards of the torch ShardedTensor ``st``
    (one ShardedTensor when there is one, as FSDP1 gives)."""
    shape = tuple(int(n) for n in st.size())
    pieces = [
        ShardedTensor.from_global_offset(
            key, shard.tensor.detach(), shape, tuple(shard.metadata.shard_offsets)
        )
        for shard in st.local_shards()
    ]
    return pieces[0] if len(pieces) == 1 else pieces


def newest_checkpoint(dirpath: str | os.PathLike[str]) -> str | None:
    """The checkpoint this plugin committed most recently in ``dirpath`` (a ``ModelCheckpoint``'s
    ``dirpath``), for ``trainer.fit(model, ckpt_path=newest_checkpoint(dirpath))`` after a crash;
    None when it holds none (or does not exist), so a first run starts from scratch.

    Only committed checkpoints count (a manifest published by this plugin): the hidden work
    directory of a save that was killed, a directory without a manifest and a stranger's files
    are passed over. A checkpoint an overwrite moved aside and was killed before replacing
    (possible only where the file system cannot exchange two directories) counts, at its
    hidden path. Order is commit time (the manifest's modification time), not the step, so
    that a run resumed on purpose from an older checkpoint goes on from its own newest save.
    A checkpoint whose manifest cannot be read raises its :class:`CheckpointError` (move it away
    to resume from an older one): damage is never skipped without a word.
    """
    root = os.fspath(dirpath)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    found: list[tuple[int, str]] = []
    for name in names:
        if name.startswith(".") and not _moved_aside(root, name):
            continue  # a save's work directory or lease, a replaced checkpoint's leftover
        path = os.path.join(root, name)
        try:
            committed = os.stat(os.path.join(path, MANIFEST_NAME)).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            continue  # a file, or a directory holding no committed checkpoint
        content = load_content_metadata(path)
        if content and content.get("writer") == WRITER:
            found.append((committed, name))
    return os.path.join(root, max(found)[1]) if found else None


def _moved_aside(root: str, name: str) -> bool:
    """``.<base>.shardsafe-old-*`` while ``<base>`` holds no committed checkpoint: an overwrite
    killed between its two renames (file systems that cannot exchange two directories), and
    the complete checkpoint that was at ``<base>`` is this one."""
    if OLD_MARK not in name:
        return False
    base = name[1 : name.index(OLD_MARK)]
    return not os.path.exists(os.path.join(root, base, MANIFEST_NAME))


def _ours(path: str, what: str) -> bool:
    """False when nothing is at ``path``; True for a checkpoint this plugin wrote; else raise,
    naming what is there (a save never replaces it, a removal never deletes it)."""
    if not os.path.lexists(path):
        return False
    try:
        content = load_content_metadata(path)
    except CheckpointError as e:
        raise CheckpointExistsError(
            f"{path}: not a checkpoint written by shardsafe.lightning.CheckpointIO ({e}); "
            f"refusing to {what} it: move it away or choose another dirpath"
        ) from None
    if not content or content.get("writer") != WRITER:
        raise CheckpointExistsError(
            f"{path}: a shardsafe checkpoint not written by shardsafe.lightning.CheckpointIO "
            f"(content_metadata {content!r}); refusing to {what} it"
        )
    return True


def _to_device(tree: Any, where: Any, path: str) -> Any:
    if callable(where) or isinstance(where, dict):
        raise TypeError(
            f"{path}: shardsafe.lightning loads onto a device given by name or torch.device, "
            f"not {type(where).__name__}"
        )
    device = torch.device(where)
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, OrderedDict):
        out = OrderedDict((k, _to_device(v, device, path)) for k, v in tree.items())
        if hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(tree, dict):
        return {k: _to_device(v, device, path) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v, device, path) for v in tree]
    return tree
