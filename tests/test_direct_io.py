"""Direct I/O in the engine: the same bytes as buffered writes, reads right whether the file is
cached, partly cached or not at all, and fallbacks where O_DIRECT is refused."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe import directio
from shardsafe.directio import (
    CacheAwareReader,
    DirectIO,
    aligned_empty,
    direct_io_mode,
    open_data_file,
    wants_direct,
)
from shardsafe.engine import DataReader, write_data_file
from shardsafe.storage.local import LocalStorage

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _items(rng: random.Random, arena: np.ndarray) -> list[tuple[str, memoryview]]:
    """Items of awkward sizes, some page-aligned (like staged ones), some not."""
    out = []
    pos = 0
    for i in range(12):
        n = rng.choice([0, 1, 63, 4095, 4096, 70_000, 1 << 20, (3 << 20) + 17])
        if rng.random() < 0.5:
            pos = -(-pos // 4096) * 4096
        else:
            pos += rng.randint(1, 100)
        if pos + n > len(arena):
            break
        out.append((f"i{i}", memoryview(arena[pos : pos + n])))
        pos += n
    return out


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", range(6))
def test_direct_and_buffered_files_are_identical(tmp_path, seed):
    rng = random.Random(seed)
    arena = aligned_empty(24 << 20)
    arena[:] = np.frombuffer(rng.randbytes(len(arena)), dtype=np.uint8)
    items = _items(rng, arena)
    storage = LocalStorage(str(tmp_path))
    with open_data_file(storage, "direct.bin", direct=True) as f:
        # tmpfs refuses O_DIRECT and gets a buffered file: the comparison below still holds
        assert not isinstance(f, directio.DirectWriter) or f.direct
    os.remove(tmp_path / "direct.bin")
    got = {}
    for mode in ("never", "always"):
        got[mode] = write_data_file(
            storage, f"data/{mode}.bin", items, 1 << 20, direct_io=DirectIO(mode)
        )
    (ext_b, size_b), (ext_d, size_d) = got["never"], got["always"]
    assert size_b == size_d == os.path.getsize(tmp_path / "data/always.bin")
    assert {k: (e.byte_offset, e.nbytes, e.checksums) for k, e in ext_b.items()} == {
        k: (e.byte_offset, e.nbytes, e.checksums) for k, e in ext_d.items()
    }
    assert (tmp_path / "data/never.bin").read_bytes() == (tmp_path / "data/always.bin").read_bytes()


def test_auto_mode_uses_direct_io_only_for_page_aligned_sources(tmp_path):
    storage = LocalStorage(str(tmp_path))
    arena = aligned_empty(2 << 20)
    unaligned = arena[64:]  # what a tensor's memory usually looks like
    staged = [("a", memoryview(arena[: 1 << 20])), ("s", memoryview(b"x" * 10))]
    plain = [("a", memoryview(unaligned))]
    tiny = [("s", memoryview(b"tiny"))]
    assert wants_direct(storage, staged, "auto")
    assert not wants_direct(storage, plain, "auto")
    assert not wants_direct(storage, tiny, "auto")
    assert all(wants_direct(storage, items, "always") for items in (staged, plain, tiny))
    assert not any(wants_direct(storage, items, "never") for items in (staged, plain, tiny))


def test_the_mode_is_read_when_a_saver_or_load_is_made_and_an_option_overrides_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDSAFE_DIRECT_IO", "never")
    saver = shardsafe.Saver()
    reader = DataReader(LocalStorage(str(tmp_path)), 1 << 20)
    assert saver.direct_io.mode == reader.direct_io.mode == "never"
    monkeypatch.setenv("SHARDSAFE_DIRECT_IO", "on")
    assert shardsafe.Saver().direct_io.mode == "always"  # the environment of the moment
    assert saver.direct_io.mode == "never"  # a Saver keeps what it was made with
    assert shardsafe.Saver(direct_io="auto").direct_io.mode == "auto"
    assert DataReader(LocalStorage(str(tmp_path)), 1 << 20, direct_io="Never").direct_io.mode == (
        "never"
    )
    monkeypatch.setenv("SHARDSAFE_DIRECT_IO", "sometimes")
    assert direct_io_mode() == "auto"  # an unknown value in the environment: the default
    with pytest.raises(shardsafe.ValidationError, match="direct_io='sometimes'"):
        shardsafe.Saver(direct_io="sometimes")
    with pytest.raises(shardsafe.ValidationError, match="direct_io"):
        shardsafe.load({}, tmp_path / "absent", direct_io="fast")
    saver.close()


def test_reads_bypass_the_cache_only_through_a_storage_that_offers_it(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * 8192)
    local = LocalStorage(str(tmp_path))
    auto = DataReader(local, 4096, direct_io="always")
    never = DataReader(local, 4096, direct_io="never")
    try:
        assert isinstance(auto._reader("f.bin", "x"), CacheAwareReader)
        assert not isinstance(never._reader("f.bin", "x"), CacheAwareReader)
    finally:
        auto.close()
        never.close()

    class Remote(LocalStorage):
        direct_io = False  # e.g. an object store: no descriptors to hand out

        def open_file(self, rel: str) -> object:
            raise AssertionError("open_file asked of a storage without direct I/O")

    remote = DataReader(Remote(str(tmp_path)), 4096, direct_io="always")
    try:
        out = bytearray(8192)
        remote._reader("f.bin", "x").read_into(0, memoryview(out))
        assert bytes(out) == b"x" * 8192
    finally:
        remote.close()
    with pytest.raises(NotImplementedError, match="no direct I/O"):
        shardsafe.storage.Storage.open_file(local, "f.bin")


def test_a_saver_owns_its_bounce_buffers_and_close_frees_them(tmp_path):
    """Direct writes of unaligned bytes go through bounce buffers of the Saver's pool, kept
    for the next save and freed by close; a Saver with direct I/O off never makes one."""
    sd = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.randn(600, 700))}
    always = shardsafe.Saver(direct_io="always")
    never = shardsafe.Saver(direct_io="never")
    try:
        always.save(sd, tmp_path / "a")  # the common state goes through a bounce buffer
        never.save(sd, tmp_path / "n")
        if always.direct_io.pool.held == 0:
            pytest.skip("the file system refused O_DIRECT: no bounce buffer was needed")
        assert never.direct_io.pool.held == 0
    finally:
        always.close()
        never.close()
    assert always.direct_io.pool.held == 0
    for name in ("a", "n"):
        assert shardsafe.CheckpointReader(tmp_path / name).verify().ok


def test_cache_aware_reads_cold_partly_cached_and_cached(tmp_path):
    rng = random.Random(1)
    data = rng.randbytes((9 << 20) + 1234)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    storage = LocalStorage(str(tmp_path))
    cases = [(0, 4 << 20), (1, (2 << 20) + 5), (4095, 3 << 20), (len(data) - (1 << 20), 1 << 20)]
    for state in ("cold", "partly", "cached"):
        _evict(str(path))
        if state == "partly":
            with open(path, "rb") as f:
                f.seek(3 << 20)
                f.read(2 << 20)
        elif state == "cached":
            path.read_bytes()
        reader = CacheAwareReader(storage.open_file("f.bin"))
        try:
            for offset, n in cases:
                for dst_shift in (0, 7, 4096):
                    out = aligned_empty(n + dst_shift)[dst_shift:]
                    reader.read_into(offset, memoryview(out))
                    assert out.tobytes() == data[offset : offset + n], (state, offset, n, dst_shift)
            with pytest.raises(EOFError, match="file ends after"):
                reader.read_into(len(data) - (1 << 20), memoryview(bytearray(2 << 20)))
            if state == "cold" and reader._direct:
                # read with O_DIRECT: the bytes did not go through the page cache
                resident = directio.PageResidency(reader.fd)
                assert resident.cached_prefix(0, 4 << 20) == 0
                resident.close()
        finally:
            reader.close()


def test_direct_io_is_refused_on_tmpfs_and_falls_back(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    import tempfile

    root = tempfile.mkdtemp(dir=shm)
    try:
        storage = LocalStorage(root)
        arena = aligned_empty(1 << 20)
        arena[:] = 3
        ext, size = write_data_file(storage, "data/x.bin", [("a", memoryview(arena))], 1 << 20)
        assert size == 1 << 20
        reader = DataReader(storage, 1 << 20)
        try:
            out = bytearray(size)
            reader._read(ext["a"], 0, memoryview(out), "x")
            assert bytes(out) == bytes(arena)
        finally:
            reader.close()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_async_save_loads_back_cold(tmp_path):
    """Written as the measured policy says (direct or buffered), read back cold."""
    saver = shardsafe.Saver()
    w = torch.randn(1000, 300)
    b = torch.randn(5)
    sd = {
        "w": shardsafe.ShardedTensor.from_rank_offsets("w", w.clone()),
        "b": shardsafe.ShardedTensor.from_rank_offsets("b", b.clone()),
    }
    saver.async_save(sd, tmp_path / "ck").result(timeout=60)
    saver.close()
    for name in os.listdir(tmp_path / "ck" / "data"):
        _evict(str(tmp_path / "ck" / "data" / name))
    out = shardsafe.load(
        {
            "w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(1000, 300)),
            "b": shardsafe.ShardedTensor.from_rank_offsets("b", torch.zeros(5)),
        },
        tmp_path / "ck",
    )
    assert torch.equal(out["w"], w) and torch.equal(out["b"], b)
    assert shardsafe.CheckpointReader(tmp_path / "ck").verify().ok


def test_no_direct_io_on_a_ram_disk_in_any_mode(tmp_path, monkeypatch):
    """A local root on tmpfs (the node-local tier in host memory): its files are page-cache
    pages, so no mode opens them with O_DIRECT and auto measures nothing there (recent kernels
    accept O_DIRECT on tmpfs, so only the policy keeps it away)."""
    from shardsafe.io_policy import DeviceProbe, Policy, in_memory

    if not os.path.isdir("/dev/shm") or not in_memory("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    import tempfile

    root = tempfile.mkdtemp(dir="/dev/shm")
    try:
        storage = LocalStorage(root)

        def refused(*args, **kwargs):
            raise AssertionError("O_DIRECT tried on a RAM disk")

        monkeypatch.setattr(directio, "_open_direct", refused)
        arena = aligned_empty(2 << 20)
        arena[:] = 5
        for mode in ("auto", "always"):
            probe = DeviceProbe(cache_path=str(tmp_path / f"{mode}.json"))
            dio = DirectIO(mode, probe)
            assert dio.policy(storage, writing=True) == Policy(False, False)
            assert not dio.wants(storage, [("a", memoryview(arena))])
            assert not dio.reads(storage)
            write_data_file(
                storage, f"data/{mode}.bin", [("a", memoryview(arena))], 1 << 20, direct_io=dio
            )
            write_data_file(
                storage,
                f"data/{mode}-streamed.bin",
                iter([("a", memoryview(arena))]),
                1 << 20,
                direct_io=dio,
            )
            assert probe.measurements == 0 and not (tmp_path / f"{mode}.json").exists()
            assert os.path.getsize(os.path.join(root, f"data/{mode}.bin")) >= 2 << 20
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
