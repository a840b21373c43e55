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
* resume (``load()``, step -1) falls back to the next-newest committed step when a step proves
  damaged (a checksum, a truncated or missing file: on every failing rank), with a warning
  naming the step skipped and why; the fallback is a full load of every state the damaged one
  could have written into, so nothing of the damaged step stays. Anything else (a file the OS
  would not read, a dead rank, a state that does not fit) is raised, as is the damage of a step
  asked for by number (``load_step=N``). A step skipped so is replaced by this run's save of
  that step (kept, for inspection, until then);
* a save killed midway leaves a hidden work directory (and its lease), never a step: the
  coordinator removes such remains when the manager starts (once their lease has expired: a
  save in flight elsewhere is left alone), as :class:`shardsafe.CheckpointManager` does;
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

import logging
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
from .directory import CheckpointDirectory
from .dist import agree, get_comm
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedError,
    is_damaged_checkpoint,
)
from .format import MANIFEST_NAME

__all__ = ["ShardsafeCheckpointManager"]

log = logging.getLogger("shardsafe")

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
        self._replace: set[int] = set()  # steps a resume skipped as damaged: saved over
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
        if not self.load_only and get_comm().is_coordinator and filesystem.isdir(self.folder):
            _Steps(self.folder).clean()  # what saves killed midway left

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
        step = _STEP.fullmatch(os.path.basename(checkpoint_id.rstrip("/")))
        # only a step this manager's resume proved damaged is replaced (intact until the new
        # save commits); any other committed step is refused, as a second save into it would be
        writer.overwrite = step is not None and int(step.group(1)) in self._replace
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
        # the manifest is read by every rank: a failure anywhere is raised everywhere (a rank
        # that went on into dcp.load alone would wait for the others)
        reader = agree(get_comm(), lambda: Reader(checkpoint_id), f"opening {checkpoint_id}")
        try:
            dcp.load(state_dict, storage_reader=reader)
        except CheckpointException as e:
            raise _load_cause(e, checkpoint_id) from e
        if MODEL in self.states:  # torchtitan flattens the model's state into the top level
            self.states[MODEL].load_state_dict(state_dict)

    def _load(self, step: int = -1) -> bool:
        """torchtitan's load; a resume (step -1) falls back past damaged steps (module doc)."""
        if step != -1:  # a step asked for by number is that step or an error
            return bool(super()._load(step))
        comm = get_comm()
        listed = _committed_steps(self.folder) if comm.is_coordinator else None
        candidates = [int(s) for s, _ in reversed(comm.broadcast(listed) or [])]
        if not candidates:  # a fresh start, or torchtitan's initial load
            return bool(super()._load(step))
        failures: list[str] = []
        for index, candidate in enumerate(candidates):
            path = self._create_checkpoint_id(candidate)
            if candidate == 0 and failures:
                failures.append(
                    f"{path}: torchtitan's model-only seed checkpoint, not a fallback for a full "
                    "resume (the failed loads may have written into the optimizer's state); "
                    "to start from it, run again with checkpoint.load_step=0"
                )
                break
            try:
                loaded = bool(super()._load(candidate))
            except CheckpointError as e:
                if not is_damaged_checkpoint(e):
                    raise  # only proven damage moves on (an unreadable file is no proof)
                failures.append(f"{path}: {e}")
                later = candidates[index + 1 :]
                log.warning(
                    "torchtitan resume: %s is damaged (%s); %s",
                    path,
                    e,
                    f"loading step {later[0]} instead"
                    if later
                    else "no older committed step is left",
                )
                continue
            if failures:
                self._replace.update(candidates[:index])
                log.warning(
                    "torchtitan resume: resumed from %s, not the newest committed step %s: %s",
                    path,
                    candidates[0],
                    "; ".join(failures),
                )
            return loaded
        raise CorruptCheckpointError(
            f"no committed step under {self.folder} could be loaded: "
            + "; ".join(failures)
            + " (the files are kept; `shardsafe verify <step>` shows what is wrong)"
        )

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


class _Steps(CheckpointDirectory):
    """torchtitan's ``step-N`` names, to clean up after saves that never committed: their hidden
    work directories and expired leases only. A visible ``step-N`` without our manifest is never
    a leftover here: it may be torchtitan's own DCP folder or its HF export."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, pointer="latest")  # torchtitan writes no pointer

    def owns(self, name: str) -> bool:
        return _STEP.fullmatch(name) is not None

    def order(self, name: str) -> Any:
        return int(name.removeprefix("step-"))

    def claims_uncommitted(self, name: str) -> bool:
        return False


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


def _load_cause(e: CheckpointException, path: str) -> BaseException:
    """The error behind a failed ``dcp.load``, the same on every rank (DCP gathers them): the
    ranks' common :class:`CheckpointError`; when they failed differently, a
    :class:`DistributedError` naming each (damage only if every one is); when no rank's is
    ours, DCP's exception itself."""
    causes = {
        rank: failure[0] if isinstance(failure, tuple) else failure
        for rank, failure in e.failures.items()
    }
    ours = [c for c in causes.values() if isinstance(c, CheckpointError)]
    if not ours:
        return e
    if len(ours) == len(causes) and len({type(c) for c in ours}) == 1:
        return ours[0]
    return DistributedError(
        f"loading {path} failed on ranks {sorted(causes)}: "
        + "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, c in sorted(causes.items())),
        {r: str(c) for r, c in causes.items()},
        {r: type(c).__name__ for r, c in causes.items()},
    )


def _cause(e: CheckpointException) -> BaseException:
    """The first rank's :class:`CheckpointError` behind DCP's wrapper (the same on every rank:
    DCP gathers the failures), else DCP's exception itself."""
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return e
