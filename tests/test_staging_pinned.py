"""The pinned staging arena without a GPU: exact page-locked bytes in chunks, locked ahead in
a background thread, copies that wait for their chunk only and never span two, unlocking on
release, and ``Saver.prepare``. The CUDA driver call is the only thing replaced: a recorder
stands in for ``cudaHostRegister``; the memory, the thread and the copies are real."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import torch

import shardsafe
from shardsafe import ShardedTensor, StagingError
from shardsafe.staging import PinnedArena, StagingPool, chunk_spans, pinned_copy, staged_bytes

PAGE = mmap.PAGESIZE


class Recorder:
    """Page-locking as recorded calls; ``gates[k]``, if given, holds chunk ``k`` back until
    set; ``fail_at`` makes that call fail as the driver would."""

    def __init__(self, gates: list[threading.Event] | None = None, fail_at: int | None = None):
        self.gates = gates
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        k = len(self.registered)
        if self.gates is not None:
            assert self.gates[k].wait(60)
        if k == self.fail_at:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.mark.parametrize("chunk", [1, 3, 8])
@pytest.mark.parametrize(("offset", "length"), [(0, 0), (0, 1), (5, 100), (0, 24), (7, 17)])
def test_chunk_spans_cover_each_byte_once_inside_one_chunk(chunk, offset, length):
    spans = chunk_spans(offset, length, chunk)
    position = 0
    for index, start, stop in spans:
        assert start == position and start < stop
        assert (offset + start) // chunk == index == (offset + stop - 1) // chunk
        position = stop
    assert position == length


def test_arena_locks_exactly_its_pages_in_chunks_and_unlocks_them_all():
    nbytes = 5 * (1 << 20) + 123  # an odd share: locked to the next page, not to 8 MiB
    pinning = Recorder()
    arena = PinnedArena(nbytes, pinning, chunk_bytes=1 << 20)
    arena.wait()
    assert arena.ready
    rounded = -(-nbytes // PAGE) * PAGE
    assert arena.pinned_bytes == rounded <= 1.05 * nbytes
    assert [n for _, n in pinning.registered] == [1 << 20] * 5 + [rounded - (5 << 20)]
    starts = [a for a, _ in pinning.registered]
    assert starts == [arena.address + k * (1 << 20) for k in range(6)]
    arena.release()
    assert sorted(pinning.unregistered) == starts and arena.pinned_bytes == 0


def test_copies_wait_for_their_own_chunk_only():
    gates = [threading.Event() for _ in range(3)]
    pinning = Recorder(gates)
    arena = PinnedArena(3 * PAGE, pinning, chunk_bytes=PAGE)
    src = torch.arange(3 * PAGE // 4, dtype=torch.float32)  # the whole arena
    expected = src.view(torch.uint8)
    copy = pinned_copy(arena)
    thread = threading.Thread(target=copy, args=(arena.tensor, src))
    thread.start()
    gates[0].set()  # chunk 0 locked: its bytes arrive; chunk 1's cannot before it is locked
    wait_until(lambda: torch.equal(arena.tensor[:PAGE], expected[:PAGE]), "chunk 0 not copied")
    assert not arena.tensor[PAGE:].any()
    gates[1].set()
    gates[2].set()
    thread.join(60)
    assert torch.equal(arena.tensor, expected)
    arena.release()


def test_a_failed_lock_is_a_staging_error_and_what_was_locked_is_unlocked():
    pinning = Recorder(fail_at=1)
    pool = StagingPool(chunk_bytes=PAGE, pinning=pinning, pin_devices=("cpu",))
    with pytest.raises(StagingError, match="page-lock"):
        pool.stage([torch.zeros(3 * PAGE, dtype=torch.uint8)])
    pool.release()
    assert pinning.unregistered == [pinning.registered[0][0]] and pool.pinned_bytes == 0


def test_release_during_locking_stops_and_unlocks_what_was_locked():
    gates = [threading.Event() for _ in range(4)]
    pinning = Recorder(gates)
    pool = StagingPool(chunk_bytes=PAGE, pinning=pinning, pin_devices=("cpu",))
    pool.prepare(4 * PAGE)
    gates[0].set()
    wait_until(lambda: pool.pinned_bytes == PAGE, "chunk 0 not locked")
    releasing = threading.Thread(target=pool.release)
    releasing.start()
    gates[1].set()  # the chunk being locked when release came finishes; no later one starts
    releasing.join(60)
    assert not releasing.is_alive()
    assert len(pinning.registered) in (1, 2)
    assert sorted(pinning.unregistered) == sorted(a for a, _ in pinning.registered)
    assert pool.pinned_bytes == 0 and pool.allocated_bytes == 0


def test_prepared_arena_is_used_by_the_save_and_a_bigger_one_replaces_it():
    pinning = Recorder()
    pool = StagingPool(chunk_bytes=1 << 16, pinning=pinning, pin_devices=("cpu",))
    tensors = [torch.randn(1000, 33), torch.arange(70000, dtype=torch.int64)[::3], torch.ones(0)]
    share = staged_bytes([t.numel() * t.element_size() for t in tensors])
    pool.prepare(share)
    pool.wait_prepared()
    locked = list(pinning.registered)
    staged = pool.stage(tensors)
    for t, item in zip(tensors, staged, strict=True):
        assert bytes(item.ready()) == t.contiguous().numpy().tobytes()
    assert pool.allocations == 1 and pinning.registered == locked  # nothing locked again
    bigger = [torch.randn(600, 1000)]
    staged = pool.stage(bigger)
    assert bytes(staged[0].ready()) == bigger[0].numpy().tobytes()
    old = [a for a, _ in locked]
    assert pinning.unregistered == old  # the smaller arena was unlocked before the bigger
    assert pool.allocations == 2
    pool.wait_prepared()
    assert pool.pinned_bytes == -(-600 * 1000 * 4 // PAGE) * PAGE
    pool.release()
    assert sorted(pinning.unregistered) == sorted(a for a, _ in pinning.registered)


def _state(scale: float) -> dict:
    st = ShardedTensor.from_rank_offsets
    return {
        "w": st("w", torch.arange(40000.0).reshape(200, 200) * scale),
        "b": st("b", torch.full((3000,), scale)),
        "step": 7,
    }


def test_saver_prepare_locks_the_share_ahead_and_the_save_reuses_it(tmp_path):
    pinning = Recorder()
    saver = shardsafe.Saver()
    saver.staging = StagingPool(chunk_bytes=1 << 16, pinning=pinning, pin_devices=("cpu",))
    state = _state(1.0)
    need = saver.prepare(state, wait=True)
    assert need == staged_bytes([200 * 200 * 4, 3000 * 4])
    assert saver.staging.pinned_bytes == -(-need // PAGE) * PAGE <= 1.05 * need
    locked = list(pinning.registered)
    handle = saver.async_save(state, tmp_path / "a")
    state["w"].data.mul_(-1)  # the training changes the state right after the call
    handle.result()
    assert saver.staging.allocations == 1 and pinning.registered == locked
    out = shardsafe.load(_state(0.0), tmp_path / "a")
    assert torch.equal(out["w"].data, torch.arange(40000.0).reshape(200, 200))
    assert saver.prepare(state) == need  # the cached plan's share: the same arena
    assert saver.staging.allocations == 1
    saver.close()
    assert sorted(pinning.unregistered) == sorted(a for a, _ in locked)


def test_saver_prepare_sizes_the_largest_wave_under_a_budget():
    saver = shardsafe.Saver(max_staging_bytes=200 * 200 * 4)
    saver.staging = StagingPool(pinning=Recorder(), pin_devices=("cpu",))
    assert saver.prepare(_state(1.0)) == staged_bytes([200 * 200 * 4])
    assert saver.prepare(nbytes=123) == 123  # smaller than what is held: nothing changes
    assert saver.staging.allocations == 1
    saver.close()
    plain = shardsafe.Saver()  # a CPU state has nothing to page-lock
    assert plain.prepare(_state(1.0)) == 0 and plain.staging.allocations == 0
    plain.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what happens without a GPU")
def test_without_a_gpu_prepare_locks_nothing():
    saver = shardsafe.Saver()
    assert saver.prepare(nbytes=1 << 20, wait=True) == 0
    assert saver.staging.allocations == 0 and saver.staging.pinned_bytes == 0
    saver.close()


def test_prepare_needs_a_state_or_a_size():
    saver = shardsafe.Saver()
    with pytest.raises(shardsafe.ValidationError, match="prepare"):
        saver.prepare()
    saver.close()
