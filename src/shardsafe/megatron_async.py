"""Megatron-Core's ``AsyncRequest`` for a shardsafe async save (``--async-save`` in Megatron-LM).

Megatron-Core runs a request's ``async_fn`` in another process: a child forked for each save
(``TemporalAsyncCaller``) or one persistent worker started with ``spawn``
(``PersistentAsyncCaller``, which receives the request pickled, ``finalize_fns`` emptied).
When every rank's ``async_fn`` has returned (an all-reduce of "still running" flags), each
rank runs the request's ``finalize_fns`` in the training process; Megatron-LM appends its own
(the tracker file naming the newest iteration) after the ones the request came with.

A shardsafe async save writes and commits in threads of the training process, which no other
process can wait on. So the request is built around the save's handle:

* ``async_fn`` (:func:`await_marker`) waits until a file exists in the host's temporary
  directory, which a forked child and a spawned worker both see. The file is made empty under
  another name before the save starts, and the handle's done-callback renames it into place
  when the save is done, committed or failed (a rename needs no space, so the signal cannot
  fail for a full disk). Its path and the training process's id are the only arguments, so the
  request pickles. ``async_fn`` also returns once the training process is gone (the waiting
  process, its child, was re-parented: no waiting process outlives the job), or once neither
  file is there (a cleaner emptied the temporary directory: the signal cannot come, and the
  finalize function waits for the save itself);
* the first of ``finalize_fns`` is the handle's ``result()``: it raises the save's error (the
  same on every rank, also Megatron's ``CheckpointingException``) before any finalize function
  Megatron-LM added runs, so no tracker file ever names an iteration that did not commit; it
  removes the marker either way. The marker's name holds the host and the training process's
  id: a request removes the markers that training processes of this host which are gone left
  behind (killed mid-save, or before their finalize functions ran).

``AsyncRequest.execute_sync()`` (Megatron's synchronous fallback) works too: ``async_fn``
waits in the training process while the save's threads finish.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ValidationError
from .saver import AsyncSaveHandle

POLL = 0.02
"""Seconds between two looks of ``async_fn`` for the marker."""


def _pending(marker: str) -> str:
    return marker + ".pending"


def _prefix() -> str:
    """The start of this host's markers' names; the training process's id follows."""
    return f"shardsafe-async-{socket.gethostname().replace(os.sep, '_')}-"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        pass
    return False


def remove_stale_markers(directory: str) -> None:
    """Remove the markers (and pending files) in ``directory`` whose training process, on this
    host, is gone. A process id used again since keeps its file (an empty file, harmless)."""
    prefix = _prefix()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
            if pid.isdigit() and int(pid) != os.getpid() and _gone(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


def await_marker(marker: str, trainer_pid: int) -> None:
    """Return once ``marker`` exists, or once it cannot come: its pending file is gone too
    (something cleared the temporary directory; the finalize function still waits for the
    save and raises its error), or the training process ``trainer_pid`` is gone (this
    process, its child, was re-parented)."""
    while not os.path.exists(marker):
        if not os.path.exists(_pending(marker)) and not os.path.exists(marker):
            return  # renamed in between, or removed: either way nothing more will come
        if os.getpid() != trainer_pid and os.getppid() != trainer_pid:
            return
        time.sleep(POLL)


def _finalize(
    handle: AsyncSaveHandle, marker: str, as_theirs: Callable[[CheckpointError], Exception]
) -> None:
    try:
        handle.result()
    except CheckpointError as e:
        raise as_theirs(e).with_traceback(e.__traceback__) from e.__cause__
    finally:
        for path in (marker, _pending(marker)):
            Path(path).unlink(missing_ok=True)


def async_request(
    start: Callable[[], AsyncSaveHandle], as_theirs: Callable[[CheckpointError], Exception]
) -> Any:
    """Megatron-Core's ``AsyncRequest`` for the save ``start()`` begins: its ``async_fn`` ends
    when the save is done, its first finalize function raises the save's error. Nothing is
    saved when the request cannot be made (no megatron-core, no temporary directory).
    ``as_theirs`` makes the save's error also Megatron's exception class."""
    try:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    except Exception as e:
        raise ValidationError(
            "async_sharded_save=True returns Megatron-Core's AsyncRequest, and megatron-core is "
            f"not importable here ({type(e).__name__}: {e}); nothing was saved. Install "
            "megatron-core, or call shardsafe.async_save (its handle commits by itself)"
        ) from None
    directory = tempfile.gettempdir()
    remove_stale_markers(directory)
    marker = os.path.join(directory, f"{_prefix()}{os.getpid()}-{uuid.uuid4().hex}")
    pending = Path(_pending(marker))
    try:  # made now, renamed when done: a rename needs no space, so the signal cannot fail
        pending.touch(exist_ok=False)
    except OSError as e:
        raise CheckpointError(
            f"cannot create {pending}, which is to tell Megatron's async worker when the save "
            f"is done ({e}); nothing was saved. Free or fix the temporary directory "
            "(TMPDIR), or save synchronously"
        ) from e
    try:
        handle = start()
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    handle.add_done_callback(lambda _: os.replace(pending, marker))
    return AsyncRequest(
        await_marker,
        (marker, os.getpid()),
        [functools.partial(_finalize, handle, marker, as_theirs)],
    )
