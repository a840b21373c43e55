"""Host staging buffers, allocated once and reused across saves.

An async save copies every piece it must write into host memory before it returns; the
training loop may then change its tensors. Buffers live in arenas that grow only when a
save needs more than any earlier one, so repeated saves of the same structure allocate
nothing. GPU tensors go to page-locked ("pinned") memory through a side CUDA stream; the
training stream is made to wait for those copies on the GPU, so the CPU returns without
waiting.

CPU tensors go to a plain arena. A save that stages a few MiB of them (at most
``inline_bytes``) copies them on the calling thread: torch's ``copy_`` runs on its intra-op
thread pool, whose threads sleep while the training leaves the host idle (a GPU computes, or
the step waits), and waking them can cost more than such a copy (on the gVisor VM of the
README's figures 2-6 ms against 0.5 ms for 4 MiB, about even at 16 MiB:
``benchmarks/staging_copy.py``; on bare metal tens of microseconds, so the cost of the other
way is at most a few hundred microseconds per save). Bigger stages take the pool: its
wake-up is paid once per stage call, and its threads copy faster than one.

A non-contiguous device view is gathered in slabs (:func:`copy_in_slabs`): each slab of at
most ``slab_bytes`` is made contiguous on the device and copied to its place in the arena, so
staging never needs a device copy of a whole tensor on top of the training's own memory.

The pinned arena (:class:`PinnedArena`) is one anonymous memory map of exactly the bytes
needed (rounded up to a page), page-locked in place in chunks of ``chunk_bytes`` with
``cudaHostRegister`` by a background thread, and unlocked on :meth:`StagingPool.release`.
torch's caching host allocator would round a request up to a power of two (a 2.07 GiB
share pinned 4 GiB) and lock it all inside the first save; here pinned bytes are the
share, and locking, which runs at a few GB/s, can be done ahead with
:meth:`StagingPool.prepare`. A copy into a chunk waits for that chunk only, so a save that
finds the arena still being locked overlaps its copies with the rest of the locking. A
device copy never spans two chunks (:func:`chunk_spans`): each lands in memory that one
registration covers. The page-locking itself sits behind :class:`Pinning`, so the chunking,
the background thread and the accounting run on machines without a GPU too.

One pool may serve several Savers (a :class:`~shardsafe.manager.CheckpointManager` gives its
persistent and its local tier the same one), so that their saves together stage no more host
memory than one of them would. A save takes the pool with :meth:`StagingPool.hold` before it
stages and gives it back once its staged bytes are written (:class:`StagingHold`); another
save that needs the pool meanwhile waits for that write, for at most its timeout. The hold
covers one rank's own writes only, never an exchange with other ranks, so a waiting save
always sees it end.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .codec import array_view, tensor_bytes
from .errors import StagingError

_ALIGN = 64
_PAGE = mmap.PAGESIZE
_LARGE = 64 << 10
#: device memory a non-contiguous view may take while it is staged (one slab at a time)
SLAB_BYTES = 64 << 20
#: bytes page-locked by one ``cudaHostRegister`` call; copies wait for their chunk only
PIN_CHUNK_BYTES = 256 << 20
#: A stage call whose CPU sources hold at most this many bytes copies them on the calling
#: thread; a larger one through torch's intra-op thread pool (see :meth:`StagingPool.stage`).
INLINE_COPY_BYTES = 16 << 20


def _aligned(n: int) -> int:
    """Room for ``n`` bytes such that the next item starts page-aligned.

    Every item starts on a page boundary, as large items do in the data file, so the
    writer can hand the staged bytes to direct I/O without another copy.
    """
    return -(-n // _PAGE) * _PAGE if n >= _LARGE else -(-n // _ALIGN) * _ALIGN


def staged_bytes(sizes: Sequence[int]) -> int:
    """Pure: arena bytes that items of ``sizes`` take, laid out as :meth:`StagingPool.stage`
    lays them out."""
    return sum(_aligned(s) for s in sizes)


def chunk_spans(offset: int, length: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Pure: the bytes ``[offset, offset + length)`` of an arena cut at its chunk boundaries.

    Returns ``(chunk index, start, stop)`` with ``start``/``stop`` relative to ``offset``, so
    each part of a copy lands inside one page-locked registration.
    """
    out = []
    pos = offset
    end = offset + length
    while pos < end:
        chunk = pos // chunk_bytes
        stop = min(end, (chunk + 1) * chunk_bytes)
        out.append((chunk, pos - offset, stop - offset))
        pos = stop
    return out


class Pinning(Protocol):
    """How host memory is page-locked in place: the one seam between the arena's logic and
    the CUDA driver."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class CudaHostRegister:
    """Page-locks memory in place with ``cudaHostRegister`` (portable to every device's
    context): exactly the bytes asked for."""

    _PORTABLE = 1  # cudaHostRegisterPortable

    def register(self, address: int, nbytes: int) -> None:
        torch.cuda.check_error(
            torch.cuda.cudart().cudaHostRegister(address, nbytes, self._PORTABLE)
        )

    def unregister(self, address: int) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))


class PinnedArena:
    """``nbytes`` of host memory, page-locked chunk by chunk by a background thread.

    The memory is an anonymous map of ``nbytes`` rounded up to a page; chunk ``k`` covers
    ``[k * chunk_bytes, (k + 1) * chunk_bytes)``. :meth:`wait_chunk` blocks until a chunk is
    locked (or raises what locking raised); :meth:`release` stops the thread, unlocks what
    was locked and drops the memory (freed once no staged view refers to it any more).
    """

    def __init__(self, nbytes: int, pinning: Pinning, chunk_bytes: int = PIN_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0 or chunk_bytes % _PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {_PAGE}: {chunk_bytes}")
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self.mapped_bytes = max(-(-nbytes // _PAGE) * _PAGE, _PAGE)
        self._pinning = pinning
        try:
            # private, as memory from malloc is: page-locked in place, never shared on fork
            self._map: mmap.mmap | None = mmap.mmap(
                -1, self.mapped_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        except OSError as e:
            raise StagingError(
                f"cannot map {self.mapped_bytes} bytes of host memory to stage a save: {e}; "
                "set max_staging_bytes to stage in smaller waves"
            ) from None
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.chunks = [
            (off, min(chunk_bytes, self.mapped_bytes - off))
            for off in range(0, self.mapped_bytes, chunk_bytes)
        ]
        self.pinned_bytes = 0  # bytes locked now
        self._locked = 0  # chunks locked, in order
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._lock_all, name="shardsafe-pin", daemon=True)
        self._thread.start()

    def _lock_all(self) -> None:
        for off, size in self.chunks:
            with self._cond:
                if self._stop:
                    return
            try:
                self._pinning.register(self.address + off, size)
            except BaseException as e:
                with self._cond:
                    self._error = StagingError(
                        f"cannot page-lock {size} bytes of host staging memory "
                        f"({self.pinned_bytes} of {self.mapped_bytes} locked so far): {e}; set "
                        "max_staging_bytes to stage in smaller waves, or free host memory"
                    )
                    self._cond.notify_all()
                return
            with self._cond:
                self._locked += 1
                self.pinned_bytes += size
                self._cond.notify_all()

    def wait_chunk(self, index: int) -> None:
        """Block until chunk ``index`` is page-locked."""
        with self._cond:
            while self._locked <= index and self._error is None:
                self._cond.wait()
            if self._locked <= index:
                assert self._error is not None
                raise self._error

    def wait(self) -> None:
        """Block until every chunk is page-locked."""
        self.wait_chunk(len(self.chunks) - 1)

    @property
    def ready(self) -> bool:
        with self._cond:
            return self._locked == len(self.chunks)

    def release(self) -> None:
        """Stop locking, unlock every locked chunk, drop this arena's reference to the memory."""
        with self._cond:
            self._stop = True
        self._thread.join()
        try:
            for off, size in self.chunks[: self._locked]:
                self._pinning.unregister(self.address + off)
                self.pinned_bytes -= size
        finally:
            self._locked = 0
            # the map itself is unmapped when the last staged view of it is gone
            del self.tensor
            self._map = None


def wait_for_copies(items: Sequence[StagedItem]) -> None:
    """Wait until the device copies queued for ``items`` have landed in their arena (a copy
    that failed lands nowhere): staged bytes let go unused must not be written into after the
    pool is let go, since the next stage may replace (unlock and unmap) the arena."""
    for item in items:
        with contextlib.suppress(Exception):
            item.ready()


@dataclass
class StagedItem:
    """A staged copy: the bytes to write, and the CUDA event to wait for before reading them."""

    data: memoryview
    event: object | None = None

    def ready(self) -> memoryview:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        return self.data


class StagingHold:
    """One save's exclusive use of a :class:`StagingPool`, from its first staged byte until
    the last one is written; :meth:`release` (idempotent) lets the next save stage."""

    def __init__(self, pool: StagingPool, holder: str) -> None:
        self.pool = pool
        self.holder = holder  # what holds it, for the error of a save that waited too long
        self.released = False

    def release(self) -> None:
        self.pool._give_back(self)


class StagingPool:
    """Reusable host arenas: one plain (CPU sources), one pinned (CUDA sources).

    ``pin_devices`` names the device types staged through the pinned arena and ``pinning``
    how it is page-locked (``cudaHostRegister`` by default); both exist so the pinned
    arena's logic can run where there is no GPU. Savers that share a pool take turns
    through :meth:`hold`; ``peak_bytes`` is the most host memory it ever held at once.
    """

    def __init__(
        self,
        slab_bytes: int = SLAB_BYTES,
        *,
        chunk_bytes: int = PIN_CHUNK_BYTES,
        pinning: Pinning | None = None,
        pin_devices: Collection[str] = ("cuda",),
        inline_bytes: int = INLINE_COPY_BYTES,
    ) -> None:
        self.slab_bytes = slab_bytes
        self.inline_bytes = inline_bytes
        self.chunk_bytes = chunk_bytes
        self.pinning: Pinning = pinning if pinning is not None else CudaHostRegister()
        self.pin_devices = frozenset(pin_devices)
        self._arenas: dict[bool, torch.Tensor] = {}  # the plain arena, under False
        self._pinned: PinnedArena | None = None
        self._lock = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0
        self.peak_bytes = 0  # the most allocated_bytes ever were
        self._streams: dict[int, torch.cuda.Stream] = {}
        # the save whose staged bytes are in use, the saves waiting for it, and a prepare()
        # that came while it held the pool (applied when it lets go)
        self._turn = threading.Condition()
        self._holder: StagingHold | None = None
        self.waiting = 0
        self._deferred = 0
        self._prepare_error: StagingError | None = None

    # -- taking turns ------------------------------------------------------------------------
    @property
    def holder(self) -> str | None:
        """What holds the pool now (its staged bytes are not written yet), or None."""
        with self._turn:
            return self._holder.holder if self._holder is not None else None

    def hold(self, holder: str, timeout: float | None = None) -> StagingHold:
        """Take the pool for the save ``holder`` describes, waiting while another save's staged
        bytes are still being written; raises :class:`StagingError` naming that save after
        ``timeout`` seconds. Release the hold once everything staged under it is written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._turn:
            self.waiting += 1
            try:
                while self._holder is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise StagingError(
                            f"{holder} waited {timeout:g} s for the host staging memory it "
                            f"shares with {self._holder.holder}, whose staged bytes are still "
                            "being written; nothing was staged. That write is stuck or slow: "
                            "check its storage, or give the Saver a longer timeout"
                        )
                    self._turn.wait(left)
            finally:
                self.waiting -= 1
            self._holder = StagingHold(self, holder)
            return self._holder

    def _give_back(self, hold: StagingHold) -> None:
        with self._turn:
            if hold.released:
                return
            hold.released = True
            if self._holder is hold:
                self._holder = None
                if self._deferred:
                    nbytes, self._deferred = self._deferred, 0
                    try:
                        with self._lock:
                            self._pinned_arena(nbytes)
                    except StagingError as e:  # raised by wait_prepared; a save maps again
                        self._prepare_error = e
            self._turn.notify_all()

    def _wait_idle(self, timeout: float | None, why: str) -> None:
        """Under ``self._turn``: wait until no save holds the pool."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._holder is not None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StagingError(
                    f"{why}: waited {timeout:g} s for {self._holder.holder}, whose staged bytes "
                    "are still being written"
                )
            self._turn.wait(left)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked now."""
        arena = self._pinned
        return arena.pinned_bytes if arena is not None else 0

    @property
    def pins(self) -> bool:
        """Whether this pool page-locks at all (not with the default pinning and no GPU)."""
        return not (isinstance(self.pinning, CudaHostRegister) and not torch.cuda.is_available())

    def prepare(self, nbytes: int) -> PinnedArena | None:
        """Start page-locking a pinned arena of at least ``nbytes`` in the background, if the
        one held is smaller; returns at once. A save that comes before the locking finished
        waits only for the chunks its copies reach. Without a GPU there is nothing to lock
        (with the default pinning): nothing happens. While a save holds the pool its arena
        is never replaced under it: the bigger one is made when that save lets go (None is
        returned then)."""
        if not self.pins:
            return None
        with self._turn:
            arena = self._pinned
            if self._holder is not None and nbytes > 0 and (arena is None or arena.nbytes < nbytes):
                self._deferred = max(self._deferred, nbytes)
                return None
            with self._lock:
                return self._pinned_arena(nbytes) if nbytes > 0 else self._pinned

    def wait_prepared(self, timeout: float | None = None) -> None:
        """Block until the pinned arena (if any) is page-locked; raises what locking raised.
        An arena :meth:`prepare` deferred is waited for too (for at most ``timeout`` s)."""
        with self._turn:
            if self._deferred:
                self._wait_idle(timeout, "preparing the pinned staging memory")
            error, self._prepare_error = self._prepare_error, None
            arena = self._pinned
        if error is not None:
            raise error
        if arena is not None:
            arena.wait()

    def _pinned_arena(self, nbytes: int) -> PinnedArena:
        arena = self._pinned
        if arena is None or arena.nbytes < nbytes:
            if arena is not None:  # dropped before the bigger one is mapped: no peak of both
                self._pinned = None
                self.allocated_bytes -= arena.nbytes
                arena.release()
            arena = self._pinned = PinnedArena(nbytes, self.pinning, self.chunk_bytes)
            self.allocations += 1
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return arena

    def _plain_arena(self, nbytes: int) -> torch.Tensor:
        arena = self._arenas.get(False)
        if arena is None or arena.numel() < nbytes:
            if arena is not None:  # dropped before the bigger one is allocated: no peak of both
                self.allocated_bytes -= arena.numel()
                del self._arenas[False], arena
            raw = torch.empty(max(nbytes, 1) + _PAGE, dtype=torch.uint8)
            start = -raw.data_ptr() % _PAGE  # page-aligned start (see _aligned)
            arena = raw[start : start + max(nbytes, 1)]
            self._arenas[False] = arena
            self.allocations += 1
            self.allocated_bytes += arena.numel()
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return arena

    def stage(
        self, tensors: Sequence[torch.Tensor], hold: StagingHold | None = None
    ) -> list[StagedItem]:
        """Copy ``tensors`` into the arenas; returns their staged bytes in order. While the
        pool is held, only under that ``hold``: anything else would overwrite bytes that a
        save has still to write."""
        with self._turn:
            if self._holder is not None and hold is not self._holder:
                raise StagingError(
                    f"the host staging memory is in use by {self._holder.holder} until its "
                    "staged bytes are written: take StagingPool.hold() before staging into it"
                )
        with self._lock:
            sizes = [t.numel() * t.element_size() for t in tensors]
            pinned = [t.device.type in self.pin_devices for t in tensors]
            need = {
                p: staged_bytes([s for s, q in zip(sizes, pinned, strict=True) if q == p])
                for p in (False, True)
            }
            plain = self._plain_arena(need[False]) if not all(pinned) else None
            on_cpu = sum(
                size for t, size in zip(tensors, sizes, strict=True) if t.device.type == "cpu"
            )
            copy_plain = _copy_inline if on_cpu <= self.inline_bytes else _copy_bytes
            arena = self._pinned_arena(need[True]) if any(pinned) else None
            offsets = {False: 0, True: 0}
            out: list[StagedItem] = []
            try:
                for t, size, is_pinned in zip(tensors, sizes, pinned, strict=True):
                    start = offsets[is_pinned]
                    offsets[is_pinned] += _aligned(size)
                    if is_pinned:
                        assert arena is not None
                        out.append(self._stage_pinned(t, arena, start, size))
                    else:
                        assert plain is not None
                        dst = plain[start : start + size]
                        if size:
                            copy_in_slabs(t.detach(), dst, self.slab_bytes, copy_plain)
                        out.append(StagedItem(array_view(dst.numpy())))
            except BaseException:
                wait_for_copies(out)  # before the failed save lets the pool go
                raise
            return out

    def _stage_pinned(
        self, t: torch.Tensor, arena: PinnedArena, start: int, size: int
    ) -> StagedItem:
        dst = arena.tensor[start : start + size]
        copy = pinned_copy(arena)
        if t.device.type != "cuda":
            if size:
                copy_in_slabs(t.detach(), dst, self.slab_bytes, copy)
            return StagedItem(array_view(dst.numpy()))
        device = t.device
        stream = self._streams.get(device.index or 0)
        if stream is None:
            stream = self._streams[device.index or 0] = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)  # copy what the training stream has produced so far
        # Slab temporaries are allocated on the side stream, so the caching allocator hands
        # a freed slab's memory to the next slab only after the copies queued before it.
        with torch.cuda.stream(stream):
            if t.numel():
                copy_in_slabs(t.detach(), dst, self.slab_bytes, copy)
            event = torch.cuda.Event()
            event.record(stream)
        main.wait_stream(stream)  # later training kernels cannot overwrite before the copy is done
        t.record_stream(stream)  # nor can its memory be reused from another stream before then
        return StagedItem(array_view(dst.numpy()), event)

    def release(self) -> None:
        """Free the arenas (the next save allocates again) and unlock the pinned memory, once
        no save holds the pool."""
        with self._turn:
            self._wait_idle(None, "releasing the host staging memory")
            self._deferred = 0
            with self._lock:
                arena, self._pinned = self._pinned, None
                self._arenas.clear()
                self.allocated_bytes = 0
                if arena is not None:
                    arena.release()


def slabs(
    shape: Sequence[int], itemsize: int, max_bytes: int
) -> list[tuple[tuple[int | slice, ...], int, int]]:
    """Pure: the C-order tensor of ``shape`` cut into slabs of at most ``max_bytes``.

    Returns ``(index, byte offset, byte length)`` per slab: ``tensor[index]`` holds the bytes
    ``[offset, offset + length)`` of the tensor's C-order layout. Slabs are runs of whole
    sub-tensors along the outermost axis that fits; a bound smaller than one element still
    moves one element at a time.
    """
    out: list[tuple[tuple[int | slice, ...], int, int]] = []
    limit = max(max_bytes, itemsize, 1)

    def cut(prefix: tuple[int, ...], dims: Sequence[int], offset: int) -> None:
        if not dims:
            out.append((prefix, offset, itemsize))
            return
        inner = itemsize * math.prod(dims[1:])
        if inner == 0 or dims[0] == 0:
            return
        if inner > limit:  # one step along this axis is still too big: go one axis deeper
            for i in range(dims[0]):
                cut((*prefix, i), dims[1:], offset + i * inner)
            return
        step = limit // inner
        for start in range(0, dims[0], step):
            stop = min(dims[0], start + step)
            out.append(
                ((*prefix, slice(start, stop)), offset + start * inner, (stop - start) * inner)
            )

    cut((), tuple(shape), 0)
    return out


SlabCopy = Callable[[torch.Tensor, torch.Tensor], None]


def copy_in_slabs(src: torch.Tensor, dst: torch.Tensor, max_bytes: int, copy: SlabCopy) -> None:
    """Copy ``src``'s C-order bytes into the uint8 tensor ``dst`` (``src.nbytes`` long).

    A contiguous source goes in one copy; a non-contiguous one slab by slab (see
    :func:`slabs`), ``copy(dst_part, src_part)`` moving each, so a copy that needs a
    contiguous temporary never needs more than ``max_bytes`` of it.
    """
    if src.is_contiguous() or src.numel() <= 1:
        if src.numel():
            copy(dst, src)
        return
    for index, offset, length in slabs(src.shape, src.element_size(), max_bytes):
        copy(dst[offset : offset + length], src[index])


def pinned_copy(arena: PinnedArena) -> SlabCopy:
    """The slab copy into ``arena``: each contiguous run of the source (a device slab made
    contiguous there, at most one slab of temporary memory) goes to its place cut at the
    arena's chunk boundaries, each part once its chunk is page-locked; from a device, as
    asynchronous copies on the current stream."""

    def copy(part: torch.Tensor, src: torch.Tensor) -> None:
        flat = _flat_bytes(src.resolve_conj().resolve_neg().contiguous())
        first = part.data_ptr() - arena.address
        for chunk, lo, hi in chunk_spans(first, part.numel(), arena.chunk_bytes):
            arena.wait_chunk(chunk)
            part[lo:hi].copy_(flat[lo:hi], non_blocking=flat.is_cuda)

    return copy


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-d uint8 view (a one-element view may keep any
    stride, which ``reshape(-1).view(uint8)`` refuses)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _copy_inline(dst: torch.Tensor, t: torch.Tensor) -> None:
    """:func:`_copy_bytes` on the calling thread for a contiguous CPU source (numpy's copy,
    which lets go of the GIL); anything else through :func:`_copy_bytes`."""
    src = t.detach().resolve_conj().resolve_neg()  # a lazily conjugated/negated view: its values
    if src.device.type == "cpu" and src.is_contiguous():
        try:
            np.copyto(dst.numpy(), _flat_bytes(src).numpy())
            return
        except (RuntimeError, TypeError):  # a view numpy cannot take: torch's copy below
            pass
    _copy_bytes(dst, src)


def _copy_bytes(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``t``'s C-order bytes into the uint8 slice ``dst``.

    ``torch.copy_`` runs on the intra-op thread pool and without the GIL; a non-contiguous
    source is gathered in the same pass, without a contiguous temporary.
    """
    src = t.detach().resolve_conj().resolve_neg()  # a lazily conjugated/negated view: its values
    try:
        if src.is_contiguous():
            dst.copy_(_flat_bytes(src))
        else:
            dst.view(src.dtype).view(src.shape).copy_(src)  # strided gather, no temporary
    except RuntimeError:  # a dtype torch cannot reinterpret as bytes
        dst.numpy()[:] = tensor_bytes(src)
