"""The direct-I/O policy of ``direct_io="auto"``: measured once per file system on this
machine's disk, remembered in a cache file, applied to saves and loads; loads never write."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import directio
from shardsafe.directio import DirectIO, PageResidency, aligned_empty
from shardsafe.io_policy import (
    PROBE_PREFIX,
    DeviceProbe,
    Measurement,
    Policy,
    decide,
    file_system_key,
    measure,
)
from shardsafe.storage import LocalStorage

SMALL = 1 << 20  # a probe of 1 MiB: enough to exercise it, not to judge a disk


@pytest.mark.parametrize(
    ("m", "policy"),
    [
        (Measurement(1, True, 1.0, 2.0, 1.0, 2.0), Policy(True, True)),
        (Measurement(1, True, 2.0, 1.0, 2.0, 1.0), Policy(False, False)),
        (Measurement(1, True, 1.0, 1.0, 1.0, 1.0), Policy(True, False)),  # ties
        (Measurement(1, True, 0.5, 1.0, 3.0, 1.0), Policy(True, False)),
        (Measurement(1, False), Policy(False, False)),  # O_DIRECT refused
    ],
)
def test_decide(m, policy):
    assert decide(m) == policy


def test_a_real_measurement_leaves_no_probe_file(tmp_path):
    m = measure(str(tmp_path), SMALL, repeat=2)
    assert m.nbytes == SMALL
    if m.direct:
        assert min(m.write_direct, m.write_buffered, m.read_direct, m.read_buffered) > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith(PROBE_PREFIX)]


def test_measured_once_per_file_system_and_remembered_in_the_cache_file(tmp_path):
    cache = tmp_path / "cache" / "direct_io.json"
    work = tmp_path / "work"
    work.mkdir()
    probe = DeviceProbe(str(cache), SMALL)
    first = probe.policy(str(work))
    assert probe.measurements == 1
    assert probe.policy(str(tmp_path)) == first and probe.measurements == 1  # same file system
    doc = json.loads(cache.read_text())
    key, mount = file_system_key(str(work))
    assert str(os.major(os.stat(work).st_dev)) in key and doc[key]["mount"] == mount
    assert decide(Measurement(**doc[key]["measurement"])) == first
    assert doc[key]["policy"] == asdict(first)
    later = DeviceProbe(str(cache), SMALL)  # another Saver or process: reads the file
    assert later.policy(str(work)) == first and later.measurements == 0


def test_the_cache_file_decides_and_a_bad_one_is_measured_again(tmp_path):
    cache = tmp_path / "direct_io.json"
    key, _ = file_system_key(str(tmp_path))
    slow_direct = Measurement(SMALL, True, 2.0, 1.0, 2.0, 1.0)
    cache.write_text(json.dumps({key: {"measurement": asdict(slow_direct)}}))
    assert DeviceProbe(str(cache)).policy(str(tmp_path)) == Policy(False, False)
    fast_direct = Measurement(SMALL, True, 1.0, 2.0, 1.0, 2.0)
    cache.write_text(json.dumps({key: {"measurement": asdict(fast_direct)}}))
    assert DeviceProbe(str(cache)).policy(str(tmp_path)) == Policy(True, True)
    for bad in ("{not json", json.dumps({key: {"measurement": {"nbytes": "x"}}})):
        cache.write_text(bad)
        probe = DeviceProbe(str(cache), SMALL)
        probe.policy(str(tmp_path))
        assert probe.measurements == 1
        assert key in json.loads(cache.read_text())


def test_a_load_never_measures(tmp_path):
    cache = tmp_path / "cache.json"
    probe = DeviceProbe(str(cache), SMALL)
    assert probe.policy(str(tmp_path), may_measure=False) == Policy(False, False)
    assert probe.measurements == 0 and not cache.exists()


def _preset(tmp_path: Path, direct_faster: bool) -> DeviceProbe:
    cache = tmp_path / f"cache-{direct_faster}.json"
    key, _ = file_system_key(str(tmp_path))
    fast, slow = 1.0, 2.0
    m = (
        Measurement(SMALL, True, fast, slow, fast, slow)
        if direct_faster
        else Measurement(SMALL, True, slow, fast, slow, fast)
    )
    cache.write_text(json.dumps({key: {"measurement": asdict(m)}}))
    return DeviceProbe(str(cache))


@pytest.mark.parametrize("direct_faster", [True, False])
def test_auto_follows_the_measurement(tmp_path, direct_faster):
    storage = LocalStorage(str(tmp_path))
    arena = aligned_empty(1 << 20)
    staged = [("w", memoryview(arena))]
    dio = DirectIO("auto", _preset(tmp_path, direct_faster))
    assert dio.wants(storage, staged) is direct_faster
    assert dio.reads(storage) is direct_faster
    assert not dio.wants(storage, [("w", memoryview(bytearray(1 << 20)))])  # unaligned: never
    assert DirectIO("always", _preset(tmp_path, False)).wants(storage, staged)
    assert not DirectIO("never", _preset(tmp_path, True)).reads(storage)


@pytest.mark.parametrize("direct_faster", [True, False])
def test_an_async_save_on_a_file_system_where_direct_io_is_slower_stays_cached(
    tmp_path, direct_faster
):
    """What the policy is for: written through the page cache where O_DIRECT does not pay,
    so the reload right after reads from memory."""
    saver = shardsafe.Saver(direct_io="auto")
    saver.direct_io = DirectIO("auto", _preset(tmp_path, direct_faster))
    w = torch.randn(512, 1024)
    sd = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", w)}
    saver.async_save(sd, tmp_path / "ck").result(timeout=60)
    saver.close()
    data = tmp_path / "ck" / "data"
    cached = 0
    for name in os.listdir(data):
        fd = os.open(data / name, os.O_RDONLY)
        resident = PageResidency(fd)
        got = resident.resident_pages()
        resident.close()
        os.close(fd)
        if got is None:
            pytest.skip("mincore is not available here")
        cached += got[0]
    if direct_faster:
        assert cached < 16  # the large item went to the device, not to cache pages
    else:
        assert cached >= (512 * 1024 * 4) // os.sysconf("SC_PAGE_SIZE")
    out = shardsafe.load(
        {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(512, 1024))},
        tmp_path / "ck",
    )
    assert torch.equal(out["w"], w)


def test_the_default_cache_file_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSAFE_CACHE_DIR", str(tmp_path / "c"))
    assert DeviceProbe().cache_path == str(tmp_path / "c" / "direct_io.json")
    monkeypatch.delenv("SHARDSAFE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert DeviceProbe().cache_path == str(tmp_path / "x" / "shardsafe" / "direct_io.json")
    assert directio.DirectIO("never").probe.cache_path.startswith(str(tmp_path / "x"))
