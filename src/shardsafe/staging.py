"""Host staging buffers, allocated once and reused across saves.

An async save copies every piece it must write into host memory before it returns; the
training loop may then change its tensors. Buffers live in an arena that grows only when a
save needs more than any earlier one, so repeated saves of the same structure allocate
nothing. GPU tensors go to pinned memory through a side CUDA stream; the training stream
is made to wait for those copies on the GPU, so the CPU returns without waiting.

A non-contiguous device view is gathered in slabs (:func:`copy_in_slabs`): each slab of at
most ``slab_bytes`` is made contiguous on the device and copied to its place in the arena, so
staging never needs a device copy of a whole tensor on top of the training's own memory.

Cost of the pinned arena: the first save that stages device tensors pins as many bytes as its
largest wave (the whole share without ``max_staging_bytes``) inside the blocking window, through
torch's caching host allocator, which rounds a request up to a power of two below its rounding
threshold. Later saves of no more bytes reuse it; :meth:`StagingPool.release` frees it and
empties that allocator's cache so the memory goes back to the system.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .codec import array_view, tensor_bytes

_ALIGN = 64
_PAGE = 4096
_LARGE = 64 << 10
#: device memory a non-contiguous view may take while it is staged (one slab at a time)
SLAB_BYTES = 64 << 20


def _aligned(n: int) -> int:
    """Room for ``n`` bytes such that the next item starts page-aligned.

    Every item starts on a page boundary, as large items do in the data file, so the
    writer can hand the staged bytes to direct I/O without another copy.
    """
    return -(-n // _PAGE) * _PAGE if n >= _LARGE else -(-n // _ALIGN) * _ALIGN


@dataclass
class StagedItem:
    """A staged copy: the bytes to write, and the CUDA event to wait for before reading them."""

    data: memoryview
    event: object | None = None

    def ready(self) -> memoryview:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        return self.data


class StagingPool:
    """Reusable host arenas: one plain (CPU sources), one pinned (CUDA sources)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self._arenas: dict[bool, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _arena(self, pinned: bool, nbytes: int) -> torch.Tensor:
        arena = self._arenas.get(pinned)
        if arena is None or arena.numel() < nbytes:
            if arena is not None:  # dropped before the bigger one is allocated: no peak of both
                self.allocated_bytes -= arena.numel()
                del self._arenas[pinned], arena
                if pinned:
                    _empty_host_cache()
            raw = torch.empty(max(nbytes, 1) + _PAGE, dtype=torch.uint8, pin_memory=pinned)
            start = -raw.data_ptr() % _PAGE  # page-aligned start (see _aligned)
            arena = raw[start : start + max(nbytes, 1)]
            self._arenas[pinned] = arena
            self.allocations += 1
            self.allocated_bytes += arena.numel()
        return arena

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[StagedItem]:
        """Copy ``tensors`` into the arenas; returns their staged bytes in order."""
        with self._lock:
            sizes = [t.numel() * t.element_size() for t in tensors]
            cuda = [t.device.type == "cuda" for t in tensors]
            need = {
                p: sum(_aligned(s) for s, c in zip(sizes, cuda, strict=True) if c == p)
                for p in (False, True)
            }
            arenas = {
                p: self._arena(p, need[p])
                for p in (False, True)
                if need[p] or any(c == p for c in cuda)
            }
            offsets = {False: 0, True: 0}
            out: list[StagedItem] = []
            for t, size, is_cuda in zip(tensors, sizes, cuda, strict=True):
                start = offsets[is_cuda]
                offsets[is_cuda] += _aligned(size)
                dst = arenas[is_cuda][start : start + size]
                if is_cuda:
                    out.append(self._stage_cuda(t, dst))
                else:
                    if size:
                        copy_in_slabs(t.detach(), dst, self.slab_bytes, _copy_bytes)
                    out.append(StagedItem(array_view(dst.numpy())))
            return out

    def _stage_cuda(self, t: torch.Tensor, dst: torch.Tensor) -> StagedItem:
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
                copy_in_slabs(t.detach(), dst, self.slab_bytes, _copy_device_slab)
            event = torch.cuda.Event()
            event.record(stream)
        main.wait_stream(stream)  # later training kernels cannot overwrite before the copy is done
        t.record_stream(stream)  # nor can its memory be reused from another stream before then
        return StagedItem(array_view(dst.numpy()), event)

    def release(self) -> None:
        """Free the arenas (the next save allocates again) and return the pinned memory to the
        system: torch's caching host allocator keeps freed pinned blocks otherwise."""
        with self._lock:
            pinned = True in self._arenas
            self._arenas.clear()
            self.allocated_bytes = 0
            if pinned:
                _empty_host_cache()


def _empty_host_cache() -> None:
    """Give the pinned blocks torch's caching host allocator keeps (ours, now unreferenced)
    back to the system."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if callable(empty) and torch.cuda.is_initialized():
        empty()


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


def _copy_device_slab(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One slab of a device tensor into pinned memory: contiguous on the device (at most one
    slab of temporary memory), then one asynchronous copy to the host."""
    dst.copy_(_flat_bytes(src.contiguous()), non_blocking=True)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-d uint8 view (a one-element view may keep any
    stride, which ``reshape(-1).view(uint8)`` refuses)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _copy_bytes(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``t``'s C-order bytes into the uint8 slice ``dst``.

    ``torch.copy_`` runs on the intra-op thread pool and without the GIL; a non-contiguous
    source is gathered in the same pass, without a contiguous temporary.
    """
    src = t.detach()
    try:
        if src.is_contiguous():
            dst.copy_(_flat_bytes(src))
        else:
            dst.view(src.dtype).view(src.shape).copy_(src)  # strided gather, no temporary
    except RuntimeError:  # a dtype torch cannot reinterpret as bytes
        dst.numpy()[:] = tensor_bytes(src)
