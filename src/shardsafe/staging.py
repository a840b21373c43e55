"""Host staging buffers, allocated once and reused across saves.

An async save copies every piece it must write into host memory before it returns; the
training loop may then change its tensors. Buffers live in an arena that grows only when a
save needs more than any earlier one, so repeated saves of the same structure allocate
nothing. GPU tensors go to pinned memory through a side CUDA stream; the training stream
is made to wait for those copies on the GPU, so the CPU returns without waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codec import array_view, tensor_bytes

_ALIGN = 64
_PAGE = 4096
_LARGE = 64 << 10


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

    def __init__(self) -> None:
        self._arenas: dict[bool, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _arena(self, pinned: bool, nbytes: int) -> torch.Tensor:
        arena = self._arenas.get(pinned)
        if arena is None or arena.numel() < nbytes:
            if arena is not None:
                self.allocated_bytes -= arena.numel()
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
                        _copy_bytes(dst, t)
                    out.append(StagedItem(array_view(dst.numpy())))
            return out

    def _stage_cuda(self, t: torch.Tensor, dst: torch.Tensor) -> StagedItem:
        device = t.device
        stream = self._streams.get(device.index or 0)
        if stream is None:
            stream = self._streams[device.index or 0] = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)  # copy what the training stream has produced so far
        with torch.cuda.stream(stream):
            src = t.detach().contiguous()
            if src.numel():
                dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        main.wait_stream(stream)  # later training kernels cannot overwrite before the copy is done
        src.record_stream(stream)
        return StagedItem(array_view(dst.numpy()), event)

    def release(self) -> None:
        """Free the arenas (the next save allocates again)."""
        with self._lock:
            self._arenas.clear()
            self.allocated_bytes = 0


def _copy_bytes(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``t``'s C-order bytes into the uint8 slice ``dst``.

    ``torch.copy_`` runs on the intra-op thread pool and without the GIL; a non-contiguous
    source is gathered in the same pass, without a contiguous temporary.
    """
    src = t.detach()
    try:
        if src.is_contiguous():
            dst.copy_(src.reshape(-1).view(torch.uint8))
        else:
            dst.view(src.dtype).view(src.shape).copy_(src)
    except RuntimeError:  # a dtype torch cannot reinterpret as bytes
        dst.numpy()[:] = tensor_bytes(src)
