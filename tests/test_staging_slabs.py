"""Staging a non-contiguous view in slabs: bounded temporaries, exact bytes, every shape."""

import mmap

import pytest
import torch

from shardsafe.staging import (
    PinnedArena,
    StagingPool,
    _copy_bytes,
    copy_in_slabs,
    pinned_copy,
    slabs,
)


class NoPinning:
    """Page-locking left out: the pinned arena's copies without a GPU."""

    def register(self, address: int, nbytes: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass


def _device_slab_copy():
    """The copy the CUDA path runs, into a pinned arena whose chunks are one page each; the
    destination starts 100 bytes before a chunk boundary, so copies are cut there."""
    arena = PinnedArena(8 * mmap.PAGESIZE, NoPinning(), chunk_bytes=mmap.PAGESIZE)
    arena.wait()
    return arena, pinned_copy(arena)


def _c_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _views() -> dict[str, torch.Tensor]:
    base = torch.arange(6 * 10 * 7, dtype=torch.float32).reshape(6, 10, 7)
    return {
        "transposed": base.transpose(0, 2),
        "permuted": base.permute(1, 2, 0),
        "sliced": base[1:5, ::3, 2:],
        "column": base[:, :, 3],
        "stepped": base.flip(0)[::2],
        "zero_d": base[2, 3, 4],
        "empty": base[:, 4:4],
        "size_one_dims": base[2:3, :, 1:2].transpose(0, 1),
        "expanded": torch.arange(5.0).reshape(5, 1).expand(5, 9),
        "int64": torch.arange(60, dtype=torch.int64).reshape(6, 10).t(),
        "bfloat16": torch.arange(60, dtype=torch.bfloat16).reshape(6, 10)[:, ::2],
        "bool": (torch.arange(60).reshape(6, 10) % 3 == 0).t(),
        "complex": torch.complex(torch.arange(40.0), -torch.arange(40.0)).reshape(8, 5).t(),
    }


@pytest.mark.parametrize("bound", [1, 3, 28, 100, 280, 1 << 20])
@pytest.mark.parametrize("name", sorted(_views()))
def test_slabs_cover_every_byte_once_within_the_bound(name, bound):
    t = _views()[name]
    itemsize = t.element_size()
    pieces = slabs(t.shape, itemsize, bound)
    position = 0
    for index, offset, length in pieces:
        assert offset == position  # in C order, without gaps or overlaps
        assert length == t[index].numel() * itemsize
        assert length <= max(bound, itemsize)
        position += length
    assert position == t.numel() * itemsize


@pytest.mark.parametrize("bound", [1, 3, 28, 100, 280, 1 << 20])
@pytest.mark.parametrize("name", sorted(_views()))
def test_device_slab_copy_on_cpu_is_exact_and_bounded(name, bound):
    """The function the CUDA path runs, on CPU: each slab made contiguous, then copied."""
    t = _views()[name]
    temporaries = []
    arena, copy = _device_slab_copy()

    def device_style(dst, src):
        temporaries.append(src.numel() * src.element_size() if not src.is_contiguous() else 0)
        copy(dst, src)

    start = mmap.PAGESIZE - 100
    dst = arena.tensor[start : start + t.numel() * t.element_size()]
    dst.fill_(0xAB)
    copy_in_slabs(t, dst, bound, device_style)
    assert dst.numpy().tobytes() == _c_bytes(t)
    arena.release()
    assert max(temporaries, default=0) <= max(bound, t.element_size())


def test_contiguous_sources_go_in_one_copy_without_temporaries():
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    calls = []
    dst = torch.empty(4000, dtype=torch.uint8)
    copy_in_slabs(t, dst, 16, lambda d, s: calls.append(s.is_contiguous()) or _copy_bytes(d, s))
    assert calls == [True] and dst.numpy().tobytes() == _c_bytes(t)


def test_big_transposed_tensor_is_cut_into_slabs_of_the_bound():
    t = torch.randn(512, 384).t()  # 768 KiB, non-contiguous
    sizes = []

    arena = PinnedArena(t.numel() * 4, NoPinning(), chunk_bytes=mmap.PAGESIZE)
    copy = pinned_copy(arena)

    def record(dst, src):
        sizes.append(src.numel() * 4)
        copy(dst, src)

    dst = arena.tensor[: t.numel() * 4]
    copy_in_slabs(t, dst, 64 << 10, record)
    assert dst.numpy().tobytes() == _c_bytes(t)
    assert sizes == [64 << 10] * 12  # 32 rows of 2 KiB per slab


def _contiguous() -> list[torch.Tensor]:
    """What a state hands staging whole: parameters, odd dtypes, lazily conjugated views."""
    c = torch.complex(torch.arange(12.0), torch.arange(12.0) + 0.5)
    return [
        torch.nn.Parameter(torch.randn(7, 5), requires_grad=True),
        torch.arange(33, dtype=torch.bfloat16),
        torch.arange(10, dtype=torch.float32).to(torch.float8_e4m3fn),
        torch.arange(9) % 2 == 0,
        c,
        c.conj(),  # a conjugate bit: its bytes are the conjugate's
        torch._neg_view(torch.arange(6.0)),
        torch.tensor(3.5),
        torch.empty(0),
    ]


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30])  # through torch's pool / on this thread
def test_pool_stages_whole_tensors_exactly_either_way(inline_bytes):
    pool = StagingPool(inline_bytes=inline_bytes)
    tensors = _contiguous()
    staged = pool.stage(tensors)
    assert [bytes(i.ready()) for i in staged] == [
        _c_bytes(t.resolve_conj().resolve_neg()) for t in tensors
    ]


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30])
@pytest.mark.parametrize("slab_bytes", [8, 1 << 20])
def test_pool_stages_cpu_views_through_the_slab_code(slab_bytes, inline_bytes):
    pool = StagingPool(slab_bytes=slab_bytes, inline_bytes=inline_bytes)
    views = list(_views().values())
    staged = pool.stage(views)
    for t, item in zip(views, staged, strict=True):
        assert bytes(item.ready()) == _c_bytes(t)
    again = pool.stage(views)  # reused arena, same bytes
    assert pool.allocations == 1
    assert [bytes(i.ready()) for i in again] == [_c_bytes(t) for t in views]
    pool.release()
    assert pool.allocated_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_views_are_staged_exactly_with_one_slab_of_device_memory():
    base = torch.randn(64, 1024, 257, device="cuda")  # 64 MiB
    views = [base.transpose(0, 2), base[:, ::2], base[3], base[:, :, 5], base[:0]]
    expected = [_c_bytes(t.cpu()) for t in views]  # before the peak is reset: `.cpu()` of a
    # strided view makes a contiguous device temporary of its own
    pool = StagingPool(slab_bytes=1 << 20, chunk_bytes=1 << 20)  # copies cut at chunk ends
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    staged = pool.stage(views)
    got = [bytes(item.ready()) for item in staged]
    assert torch.cuda.max_memory_allocated() - before <= 2 << 20
    assert got == expected
    share = sum(t.numel() * t.element_size() for t in views)
    pool.wait_prepared()
    assert share <= pool.pinned_bytes <= 1.05 * share  # page-locked in place, not 2**k
    pool.release()
