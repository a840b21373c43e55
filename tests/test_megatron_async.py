"""Megatron-LM's ``--async-save``: ``megatron_api.save(..., async_sharded_save=True)`` returns
Megatron-Core's ``AsyncRequest``, driven here by megatron-core's own ``AsyncCallsQueue``.

Two gloo ranks. Megatron's queue names CUDA in a few calls (a device synchronise, the
all-reduce's tensor device); :func:`megatron_models.cpu_as_cuda` points them at the CPU, as the
other Megatron tests do. Its persistent worker sets a CUDA device first thing, so the
persistent queue runs only where CUDA does; on CPU the request is checked to pickle (that
queue sends it pickled) and its ``async_fn`` to run in a spawned process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing import mapping as mcore
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron_models import cpu_as_cuda

import shardsafe
from shardsafe import megatron_api

pytestmark = pytest.mark.timeout(300)


def _state(rank: int, world: int, step: int, bad: bool = False) -> dict[str, Any]:
    w = torch.arange(8, dtype=torch.float32) + 100 * step + 10 * rank
    sd: dict[str, Any] = {
        "w": mcore.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "iteration": step,
    }
    if bad:  # cannot be stored: fails in the background, after save returned
        sd["bad"] = mcore.ShardedObject("bad", lambda: None, (1,), (0,), replica_id=rank)
    return sd


def _tracker(root: Path, step: int) -> Any:
    """What Megatron-LM appends to the request: the tracker file naming the newest iteration.
    It records whether the checkpoint was committed when it ran."""

    def finalize() -> None:
        committed = (root / f"iter_{step}" / "manifest.json").is_file()
        (root / "tracker.txt").write_text(f"{step} committed={committed}")

    return finalize


def _may_fork() -> None:
    """The test's rank processes are daemons (so that a failed test leaves none behind), and
    multiprocessing lets no daemon start a child; Megatron's queue forks one per save."""
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def _train_with_async_saves(rank: int, world: int, base: str) -> list[str]:
    """Megatron-LM's loop: save asynchronously, go on training, finalize what is done."""
    root = Path(base)
    _may_fork()
    seen = []
    with cpu_as_cuda():
        queue = AsyncCallsQueue(persistent=False)
        for step in (1, 2):
            if rank == 0:
                (root / f"iter_{step}").mkdir()
            torch.distributed.barrier()
            request = megatron_api.save(
                _state(rank, world, step), str(root / f"iter_{step}"), async_sharded_save=True
            )
            assert isinstance(request, AsyncRequest), type(request)
            if rank == 0:
                request.add_finalize_fn(_tracker(root, step))
            queue.schedule_async_request(request)
            x = torch.randn(64, 64)  # the training step the save does not hold up
            for _ in range(10):
                x = torch.tanh(x @ x.T / 64)
            queue.maybe_finalize_async_calls(blocking=False)
            queue.maybe_finalize_async_calls(blocking=True)  # Megatron-LM's before the next save
            if rank == 0:
                seen.append((root / "tracker.txt").read_text())
        queue.close()
    for step in (1, 2):
        target = {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(8), (0, rank, world))}
        loaded = megatron_api.load(target, str(root / f"iter_{step}"))
        assert torch.equal(loaded["w"], _state(rank, world, step)["w"].data), step
        assert loaded["iteration"] == step
    return seen


def test_megatron_async_calls_queue_commits_before_its_finalize_fns(tmp_path: Path) -> None:
    results = run_ranks(_train_with_async_saves, 2, str(tmp_path), timeout=240)
    assert results[0] == ["1 committed=True", "2 committed=True"]


def _failing_async_save(rank: int, world: int, base: str) -> str:
    root = Path(base)
    _may_fork()
    with cpu_as_cuda():
        queue = AsyncCallsQueue(persistent=False)
        request = megatron_api.save(
            _state(rank, world, 1, bad=True), str(root / "iter_1"), async_sharded_save=True
        )
        request.add_finalize_fn(_tracker(root, 1))
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except CheckpointingException as e:
            assert isinstance(e, shardsafe.CheckpointError), type(e).__mro__
            return str(e)
    raise AssertionError("the failed save reached Megatron-LM's finalize function")


def test_a_failed_async_save_raises_before_megatrons_finalize_fns(tmp_path: Path) -> None:
    errors = run_ranks(_failing_async_save, 2, str(tmp_path), timeout=240)
    assert all("function" in e for e in errors), errors  # the same error on every rank
    assert not (tmp_path / "tracker.txt").exists()
    assert not (tmp_path / "iter_1").exists()


def test_execute_sync_saves_and_finalizes(tmp_path: Path) -> None:
    """Megatron's synchronous fallback: the request run in the calling process."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        request = megatron_api.save(
            _state(0, 1, 3), str(tmp_path / "iter_3"), async_sharded_save=True
        )
        request.add_finalize_fn(_tracker(tmp_path, 3))
        request.execute_sync()
    finally:
        torch.distributed.destroy_process_group()
    assert (tmp_path / "tracker.txt").read_text() == "3 committed=True"


def test_markers_left_by_a_dead_training_process_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training process killed mid-save leaves its pending marker in the temporary
    directory; the next request on the host removes it, and keeps a live process's."""
    import subprocess
    import sys
    import tempfile

    from shardsafe.megatron_async import _prefix

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f"{_prefix()}{int(dead.stdout)}-0123abcd.pending"
    stale_done = tmp_path / f"{_prefix()}{int(dead.stdout)}-4567ef01"
    live = tmp_path / f"{_prefix()}{os.getppid()}-89abcdef.pending"
    other = tmp_path / "shardsafe-async-otherhost-1-00.pending"  # another host's: not ours
    for f in (stale, stale_done, live, other):
        f.touch()
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        request = megatron_api.save(
            _state(0, 1, 5), str(tmp_path / "iter_5"), async_sharded_save=True
        )
        request.execute_sync()
    finally:
        torch.distributed.destroy_process_group()
    assert not stale.exists() and not stale_done.exists()
    assert live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.glob("shardsafe-async-*")) == sorted(
        [live.name, other.name]
    )  # this request's own marker removed by its finalize function


def _run_async_fn(request_bytes: bytes) -> None:
    request = pickle.loads(request_bytes)
    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)


def test_the_request_pickles_for_the_persistent_worker(tmp_path: Path) -> None:
    """The persistent worker gets the request pickled without its finalize functions, in a
    spawned process: its ``async_fn`` must end there once the save is done."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        request = megatron_api.save(
            _state(0, 1, 4), str(tmp_path / "iter_4"), async_sharded_save=True
        )
        sent = pickle.dumps(request._replace(finalize_fns=[]))
        worker = multiprocessing.get_context("spawn").Process(target=_run_async_fn, args=(sent,))
        worker.start()
        worker.join(120)
        assert worker.exitcode == 0, worker.exitcode
        for fn in request.finalize_fns:
            fn()
    finally:
        torch.distributed.destroy_process_group()
    assert (tmp_path / "iter_4" / "manifest.json").is_file()


def test_a_waiting_child_ends_with_the_training_process(tmp_path: Path) -> None:
    """A child forked to wait for a save that never ends (the training process died) does not
    outlive the training process."""
    from shardsafe.megatron_async import await_marker

    ctx = multiprocessing.get_context("fork")
    ready = tmp_path / "child.pid"

    def trainer() -> None:  # forks the waiting child as Megatron does, then dies
        child = ctx.Process(target=await_marker, args=(str(tmp_path / "never"), os.getpid()))
        child.start()
        ready.write_text(str(child.pid))
        os._exit(9)

    p = ctx.Process(target=trainer)
    p.start()
    p.join(30)
    pid = int(ready.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the waiting child outlived the training process")


def test_a_marker_that_cannot_come_is_not_awaited(tmp_path: Path) -> None:
    """Neither the marker nor its pending file is there (a cleaner emptied the temporary
    directory while the save ran, so the done-callback's rename failed): ``async_fn`` returns
    (the finalize function then waits for the save itself) instead of waiting forever."""
    from shardsafe.megatron_async import await_marker

    done = threading.Event()
    waiter = threading.Thread(
        target=lambda: (await_marker(str(tmp_path / "gone"), os.getpid()), done.set()), daemon=True
    )
    waiter.start()
    assert done.wait(10), "async_fn waits for a marker that can no longer come"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: gone, or a zombie nobody reaped yet (an orphan's new parent, PID 1
    of a container, may never reap it), counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_no_megatron_no_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without megatron-core there is no AsyncRequest to return: refused, nothing saved."""
    import sys

    monkeypatch.setitem(
        sys.modules, "megatron.core.dist_checkpointing.strategies.async_utils", None
    )
    with pytest.raises(shardsafe.ValidationError, match="nothing was saved"):
        megatron_api.save(_state(0, 1, 5), str(tmp_path / "iter_5"), async_sharded_save=True)
    assert not (tmp_path / "iter_5").exists()
