"""torchtitan's checkpoint manager, writing and reading shardsafe checkpoints.

:class:`ShardsafeCheckpointManager` is torchtitan's own DCP ``CheckpointManager`` (0.3.0) with
its storage swapped: selected in the trainer's config by its ``Config`` (``checkpoint=
ShardsafeCheckpointManager.Config(...)``, every field torchtitan's), it keeps torchtitan's
policy (``interval``, ``keep_latest_k``, ``async_mode``, ``load_step``, ``exclude_from_loading``,
the model-only last save and its HF export) and its state objects (``ModelWrapper``,
``OptimizersContainer``, ``LRSchedulersContainer``, the dataloader, ``train_state``), and runs
``dcp.save``/``dcp.async_save``/``dcp.load`` through :class:`shardsafe.dcp.Writer` and
:class:`shardsafe.dcp.Reader`: each step is an ordinary shardsafe checkpoint, committed by our
protocol and verified on load. What differs from torchtitan's, and why:

* resume finds the newest *committed* ``step-N`` (our manifest, or DCP's ``.metadata`` for a
  folder torchtitan's own manager wrote); a save in flight or a crashed one's leftover
  (``.step-N.tmp-*``) never counts;
* ``keep_latest_k`` keeps the k newest committed steps and deletes older ones manifest first, so
  an interrupted deletion leaves a leftover, never a torn checkpoint that looks committed;
* a failed save or load raises the :class:`~shardsafe.CheckpointError` behind DCP's
  ``CheckpointException`` (a flipped byte is a ``CorruptCheckpointError``), never loads garbage;
* ``async_with_pinned_mem`` stages into the Writer's reused arena (pinned for CUDA tensors) and
  writes from a background thread, not DCP's separate process: our commit runs on the ranks'
  process group, which a child process does not hold.

The HF export (``last_save_in_hf``) and loads from HF safetensors stay torchtitan's (DCP's
HuggingFace storage): they are exports and imports, not shardsafe checkpoints.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer.base import MODEL, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

from .dcp import Reader, Writer
from .errors import CheckpointError
from .format import MANIFEST_NAME

__all__ = ["ShardsafeCheckpointManager"]

_STEP = re.compile(r"step-(\d+)")
_DCP_METADATA = ".metadata"


class ShardsafeCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` over shardsafe checkpoints (see the module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint config; selecting it selects this manager."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self._writers: dict[Any, Writer] = {}
        self._in_flight: tuple[int, str] | None = None  # the async save not yet committed
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # the Writer is the stager; torchtitan's DefaultStager (DCP's separate process,
            # which cannot run our commit) is never made: it also refuses to exist without CUDA
            self.stager = _WriterStages()
        me = cast(Any, self)  # torchtitan's attributes, made by its __init__
        if me.purge_thread is not None:  # torchtitan's purge loop, with our deletion
            me.purge_queue.put(None)
            me.purge_thread.join()
            me.purge_queue = queue.Queue()
            me.purge_thread = threading.Thread(
                target=purge_thread, args=(me.purge_queue, _remove_checkpoint), daemon=True
            )
            me.purge_thread.start()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            for writer in getattr(self, "_writers", {}).values():
                writer.close()
            self._writers = {}

    # -- save ----------------------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """One step through :class:`shardsafe.dcp.Writer` (the HF export stays DCP's)."""
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        pg = None if async_mode == AsyncMode.DISABLED else self.pg
        writer = self._writers.get(pg)
        if writer is None:
            writer = self._writers[pg] = Writer(checkpoint_id, process_group=pg)
        ret: Future[Any] | AsyncSaveResponse | None = None
        try:
            if async_mode == AsyncMode.DISABLED:
                dcp.save(
                    state_dict,
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                )
            else:
                fut: Any = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                    process_group=pg,
                )
                ret = fut
                step = _STEP.fullmatch(os.path.basename(checkpoint_id.rstrip("/")))
                if step is not None:
                    self._in_flight = (int(step.group(1)), checkpoint_id)
                if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                    staged: Future[None] = Future()  # staged already: the Writer stages in line
                    staged.set_result(None)
                    ret = AsyncSaveResponse(staging_completion=staged, upload_completion=fut)
        except CheckpointException as e:
            raise _cause(e) from e
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection

            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _wait_for_saving(self) -> None:
        try:
            super()._wait_for_saving()
        except CheckpointException as e:
            self.save_future = None
            raise _cause(e) from e
        finally:
            self._in_flight = None

    # -- load ----------------------------------------------------------------------------------
    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """A shardsafe checkpoint through :class:`shardsafe.dcp.Reader`, every block verified; a
        directory DCP's own writer made (no manifest, a ``.metadata``) and HF safetensors are
        left to torchtitan's load."""
        if from_hf or _is_dcp_dir(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        try:
            dcp.load(state_dict, storage_reader=Reader(checkpoint_id))
        except CheckpointException as e:
            raise _cause(e) from e
        if MODEL in self.states:  # torchtitan flattens the model's state into the top level
            self.states[MODEL].load_state_dict(state_dict)

    # -- the folder ----------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed ``step-N``: our manifest (or DCP's ``.metadata``) in a directory
        named exactly so; leftovers of saves in flight or crashed are not steps."""
        steps = [step for step, _ in _committed_steps(folder or self.folder)]
        return max(steps) if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        """Keep the ``keep_latest_k`` newest steps, counting an async save in flight as
        torchtitan does (which is why it requires k >= 2); delete only committed ones."""
        if self._should_purge():
            steps = _committed_steps(self.folder)
            if self._in_flight is not None and self._in_flight not in steps:
                steps = sorted([*steps, self._in_flight])
            for step in steps[: -self.keep_latest_k]:
                if step != self._in_flight:
                    self.purge_queue.put(step[1])


class _WriterStages:
    """Where torchtitan keeps its pinned-memory stager: ours is the Writer itself."""

    def close(self) -> None:
        """The Writers' arenas are freed by the manager's close."""


def _committed_steps(folder: str) -> list[tuple[int, str]]:
    """(step, path) of the committed ``step-N`` directories in ``folder``, oldest first."""
    if not filesystem.isdir(folder):
        return []
    found = []
    for name in filesystem.listdir(folder):
        m = _STEP.fullmatch(name)
        if m is None:
            continue
        path = filesystem.join(folder, name)
        if filesystem.isfile(filesystem.join(path, MANIFEST_NAME)) or filesystem.isfile(
            filesystem.join(path, _DCP_METADATA)
        ):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _is_dcp_dir(path: str) -> bool:
    return not filesystem.isfile(filesystem.join(path, MANIFEST_NAME)) and filesystem.isfile(
        filesystem.join(path, _DCP_METADATA)
    )


def _remove_checkpoint(path: str) -> None:
    """Uncommit first (the manifest), then delete the rest."""
    manifest = filesystem.join(path, MANIFEST_NAME)
    if filesystem.isfile(manifest):
        if filesystem.is_remote(path):
            from fsspec.core import url_to_fs

            fs, where = url_to_fs(manifest)
            fs.rm(where)
        else:
            os.remove(manifest)
    filesystem.rmtree(path)


def _cause(e: CheckpointException) -> BaseException:
    """The first rank's :class:`CheckpointError` behind DCP's wrapper (the same on every rank:
    DCP gathers the failures), else DCP's exception itself."""
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return e
