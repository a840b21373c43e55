"""Structure-aware fuzzing of the foreign readers: DCP (Megatron ``torch_dist`` included),
Hugging Face safetensors files and folders, and ``torch.save`` files.

Each example builds a small real checkpoint, then damages it where the format has
structure: DCP metadata fields set to hostile values (through the real dataclasses),
safetensors headers and indexes rebuilt from random entries, ``torch.save`` archives with
bytes of their pickle or records changed. Every reader then opens and reads all of it and
must (1) raise nothing but a ``CheckpointError`` subclass, (2) open nothing outside the
checkpoint (the ``open`` spy of ``test_fuzz``), and (3) finish within :data:`CALL_BUDGET`
seconds with its peak memory growing by less than :data:`MEMORY_BUDGET`. The budget is
fixed (``max_examples`` per format) so CI time stays constant.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import resource
import shutil
import struct
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from attacks.foreign import make_dcp, make_hf, torch_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import opened_paths

from shardsafe import CheckpointError
from shardsafe.convert import open_source

CALL_BUDGET = 10.0
MEMORY_BUDGET = 256 << 20
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
pytestmark = pytest.mark.timeout(300)

HOSTILE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 5, 2**62, 2**63, 10**30, float("inf"), float("nan"), 1.5]),
    st.text(max_size=20),
    st.sampled_from(["", "\0", "../x", "/etc/passwd", "__0_0.distcp", "a/../../b"]),
    st.none(),
    st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=5),
    st.just(torch.Size([2**40, 2**40])),
)


def read_all(path: Path) -> None:
    """Open ``path`` in any foreign format and read everything: only CheckpointErrors, in time,
    within memory, nothing outside opened."""
    inside = str(path.resolve())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    started = time.monotonic()
    with opened_paths() as seen:
        try:
            source = open_source(path)
            for key in source.tensor_keys():
                source.read_tensor(key)
            source.common()
        except CheckpointError:
            pass
    elapsed = time.monotonic() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert elapsed < CALL_BUDGET, f"took {elapsed:.1f} s"
    assert grown < MEMORY_BUDGET, f"peak memory grew by {grown >> 20} MiB"
    outside = [p for p in seen if not p.startswith(inside) and p.startswith(str(path.parent))]
    assert outside == [], outside


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("foreign")
    make_dcp(base / "dcp", megatron=True)
    make_hf(base / "hf")
    (base / "file.pt").write_bytes(torch_bytes({"w": torch.arange(12.0), "n": 3, "s": "x"}))
    return base


def _fresh(pristine: Path, name: str) -> Path:
    work = pristine / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    src = pristine / name
    if src.is_dir():
        shutil.copytree(src, work / name)
    else:
        shutil.copy(src, work / name)
    return work / name


def _objects(meta: Any) -> list[Any]:
    """Every dataclass instance reachable in DCP metadata (entries, chunks, indexes, infos)."""
    out: list[Any] = []
    for entry in meta.state_dict_metadata.values():
        out.append(entry)
        chunks = getattr(entry, "chunks", None)
        out.extend(chunks if isinstance(chunks, list) else [])
        out.append(getattr(entry, "properties", None))
    for index, info in meta.storage_data.items():
        out += [index, info]
    return [o for o in out if dataclasses.is_dataclass(o) and dataclasses.fields(o)]


@SETTINGS
@given(data=st.data())
def test_dcp_metadata_fields(pristine: Path, data: st.DataObject) -> None:
    path = _fresh(pristine, "dcp")
    meta = pickle.loads((path / ".metadata").read_bytes())  # our own file: trusted here
    for _ in range(data.draw(st.integers(1, 3))):
        objects = _objects(meta)
        obj = data.draw(st.sampled_from(objects))
        fields = [f.name for f in dataclasses.fields(obj)]
        name = data.draw(st.sampled_from(fields))
        object.__setattr__(obj, name, data.draw(HOSTILE))
    try:
        raw = pickle.dumps(meta, protocol=2)
    except Exception:
        return
    (path / ".metadata").write_bytes(raw)
    read_all(path)


@SETTINGS
@given(data=st.data())
def test_dcp_files_damaged(pristine: Path, data: st.DataObject) -> None:
    path = _fresh(pristine, "dcp")
    name = data.draw(st.sampled_from([".metadata", "__0_0.distcp", "common.pt", "metadata.json"]))
    raw = bytearray((path / name).read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    (path / name).write_bytes(bytes(raw[: cut if data.draw(st.booleans()) else len(raw)]))
    read_all(path)


ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X", 5]),
        "shape": st.lists(st.integers(-(2**65), 2**65) | st.integers(0, 8), max_size=4),
        "data_offsets": st.lists(st.integers(-(2**65), 2**65) | st.integers(0, 64), max_size=3),
    }
)


@SETTINGS
@given(
    header=st.dictionaries(
        st.text(max_size=8),
        ENTRY | HOSTILE.map(lambda v: v if not isinstance(v, torch.Size) else list(v)),
        max_size=4,
    ),
    body=st.binary(max_size=256),
    declared=st.none() | st.integers(0, 2**64 - 1),
)
def test_safetensors_headers(
    pristine: Path, header: dict, body: bytes, declared: int | None
) -> None:
    path = _fresh(pristine, "hf") / "model-00001-of-00002.safetensors"
    text = json.dumps(header, allow_nan=True).encode()
    length = len(text) if declared is None else declared
    path.write_bytes(struct.pack("<Q", length) + text + body)
    read_all(path.parent)


@SETTINGS
@given(
    weight_map=st.dictionaries(
        st.sampled_from(["a", "b", "c"]) | st.text(max_size=5),
        st.sampled_from(
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "../hf/x",
                "\0",
                "",
                ".",
                "missing.safetensors",
            ]
        )
        | HOSTILE.filter(lambda v: not isinstance(v, torch.Size)),
        max_size=4,
    ),
    wrap=st.booleans(),
)
def test_safetensors_indexes(pristine: Path, weight_map: dict, wrap: bool) -> None:
    path = _fresh(pristine, "hf")
    index: Any = {"metadata": {}, "weight_map": weight_map} if wrap else weight_map
    (path / "model.safetensors.index.json").write_text(json.dumps(index, allow_nan=True))
    read_all(path)


@SETTINGS
@given(data=st.data())
def test_torch_save_archives(pristine: Path, data: st.DataObject) -> None:
    path = _fresh(pristine, "file.pt")
    with zipfile.ZipFile(path) as zf:
        records = {i.filename: zf.read(i) for i in zf.infolist()}
    name = data.draw(st.sampled_from(sorted(records)))
    raw = bytearray(records[name])
    for _ in range(data.draw(st.integers(1, 6))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    records[name] = bytes(
        raw[: data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else raw
    )
    method = data.draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as zf:
        for n, content in records.items():
            zf.writestr(n, content)
    path.write_bytes(out.getvalue())
    read_all(path)
