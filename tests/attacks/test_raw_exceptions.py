"""Class 8: odd values raise a CheckpointError naming the file, never a raw exception.

DCP metadata built from allowed classes with odd values, encoded values with absurd
shapes or devices, safetensors headers and indexes, ``torch.save`` files, and the CLI on
damaged checkpoints: each hostile input below raised a raw exception (or printed a
traceback) before, and now raises a ``CheckpointError`` subclass, or exits 1/2 with one line.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from manifests import sealed

from .foreign import FOREIGN, make_dcp, make_hf, torch_bytes
from .harness import (
    READERS,
    assert_cli_refused,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(300)
DEEP = 100_000


def _deep_list_pickle(placeholder: bytes, data: bytes, depth: int) -> bytes:
    """Replace the protocol-2 string ``placeholder`` in ``data`` by a list nested ``depth`` deep."""
    opcode = b"X" + struct.pack("<I", len(placeholder)) + placeholder
    assert opcode in data
    return data.replace(opcode, b"]" * depth + b"a" * (depth - 1), 1)


def _mutate_metadata(path: Path, change: Callable[[Any], None]) -> None:
    meta = pickle.loads((path / ".metadata").read_bytes())
    change(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta, protocol=2))


def _index(meta: Any, fqn: str) -> Any:
    return next(i for i in meta.storage_data if i.fqn == fqn)


def _set_info(meta: Any, fqn: str, **fields: Any) -> None:
    index = _index(meta, fqn)
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], **fields)


def _odd_index_offset(meta: Any) -> None:
    index = _index(meta, "w")
    info = meta.storage_data.pop(index)
    odd = copy.copy(index)
    object.__setattr__(odd, "offset", 5)
    meta.storage_data[odd] = info


def _sizes(
    value: list[Any], chunks: list[tuple[list[Any], list[Any]]] | None = None
) -> Callable[[Any], None]:
    def change(meta: Any) -> None:
        entry = meta.state_dict_metadata["w"]
        entry.size = value
        if chunks is not None:
            info = meta.storage_data[_index(meta, "w")]
            meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != "w"}
            entry.chunks = []
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

            for offsets, sizes in chunks:
                entry.chunks.append(ChunkStorageMetadata(offsets, sizes))
                meta.storage_data[MetadataIndex("w", torch.Size(offsets))] = info

    return change


def _int_key(meta: Any) -> None:
    meta.state_dict_metadata[7] = meta.state_dict_metadata.pop("n")


DCP_CASES: dict[str, Callable[[Any], None]] = {
    "index offset=5": _odd_index_offset,
    "size inf": _sizes([float("inf"), 6]),
    "offset inf": lambda m: setattr(
        m.state_dict_metadata["w"].chunks[0], "offsets", [float("inf"), 0]
    ),
    "NUL in path": lambda m: _set_info(m, "w", relative_path="__0_0\0.distcp"),
    "non-descriptor transform": lambda m: _set_info(m, "n", transform_descriptors=[5]),
    "sizes [2**40, 1]": _sizes([2**40, 1], [([0, 0], [2**39, 1]), ([2**39, 0], [2**39, 1])]),
    "sizes [-1]": _sizes([-1], [([0], [-1])]),
    "int key": _int_key,
    "length inf": lambda m: _set_info(m, "w", length=float("inf")),
}


def test_dcp_metadata_with_odd_values(tmp_path: Path) -> None:
    roots = []
    for i, change in enumerate(DCP_CASES.values()):
        root = make_dcp(tmp_path / f"dcp{i}")
        _mutate_metadata(root, change)
        roots.append(root)
    deep = make_dcp(tmp_path / "deep")
    meta = pickle.loads((deep / ".metadata").read_bytes())
    meta.state_dict_metadata["w"].properties.dtype = "PLACEHOLDER"
    raw = _deep_list_pickle(b"PLACEHOLDER", pickle.dumps(meta, protocol=2), DEEP)
    (deep / ".metadata").write_bytes(raw)
    roots.append(deep)
    code = FOREIGN + "".join(f"read_foreign({str(r)!r}, {r.name + ': '!r})\n" for r in roots)
    assert_refused(run_calls(code, tmp_path / "outside"), len(roots))


ENCODED: dict[str, Any] = {
    "$tensor [0, 2**62, 2**62]": {
        "$tensor": {"dtype": "float32", "shape": [0, 2**62, 2**62], "blob": "B"}
    },
    "$tensor [2**61, 2**61]": {"$tensor": {"dtype": "uint8", "shape": [2**61, 2**61], "blob": "B"}},
    "$ndarray [0, 10**20]": {"$ndarray": {"dtype": "<f4", "shape": [0, 10**20], "blob": "B"}},
    "$ndarray [0]*100": {"$ndarray": {"dtype": "<f4", "shape": [0] * 100, "blob": "B"}},
    "$ndarray [0]*40": {"$ndarray": {"dtype": "<f4", "shape": [0] * 40, "blob": "B"}},
    "$device 10**30": {"$device": 10**30},
    "$device -1": {"$device": "cpu:-5"},
    "$dtype list": {"$dtype": ["float32"]},
    "$npscalar str": {"$npscalar": {"dtype": "<f4", "value": "x"}},
    "$namespace": {"$namespace": [1]},
}


def test_encoded_values_with_odd_values(tmp_path: Path) -> None:
    roots = []
    for i, value in enumerate(ENCODED.values()):
        root = tmp_path / f"c{i}"
        doc = save_small(root)
        blob = next(iter(doc["blobs"]))
        doc["common"] = json.loads(json.dumps(value).replace('"B"', json.dumps(blob)))
        write_manifest(root, doc)
        roots.append(root)
    code = READERS + "".join(
        f"attempt({label!r}, lambda: shardsafe.load_common_state_dict({str(r)!r}))\n"
        for label, r in zip(ENCODED, roots, strict=True)
    )
    assert_refused(run_calls(code, tmp_path / "outside"), len(roots))


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_safetensors_and_torch_files_with_odd_values(tmp_path: Path) -> None:
    files: list[Path] = []

    def add(name: str) -> Path:
        files.append(tmp_path / name)
        return files[-1]

    _safetensors(add("deep.safetensors"), b"[" * DEEP + b"]" * DEEP)
    _safetensors(add("deep-object.safetensors"), b'{"a":' * 5000 + b"1" + b"}" * 5000)
    _safetensors(
        add("negative.safetensors"),
        json.dumps({"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}).encode(),
        bytes(16),
    )
    _safetensors(
        add("float-shape.safetensors"),
        json.dumps({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}).encode(),
        bytes(4),
    )
    _safetensors(
        add("huge-offsets.safetensors"),
        json.dumps({"a": {"dtype": "U8", "shape": [10**30], "data_offsets": [0, 10**30]}}).encode(),
    )
    _safetensors(
        add("metadata-list.safetensors"),
        json.dumps(
            {"__metadata__": [1], "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
        ).encode(),
        b"x",
    )
    hf = make_hf(tmp_path / "hf-deep-index")
    (hf / "model.safetensors.index.json").write_text("[" * DEEP + "]" * DEEP)
    files.append(hf)
    hf = make_hf(tmp_path / "hf-nul")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["a"] = "model\0.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    files.append(hf)
    hf = make_hf(tmp_path / "hf-list")
    index["weight_map"] = {"a": ["x"]}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    files.append(hf)
    # torch.save files
    zipped = torch_bytes({"a": torch.ones(2)})
    add("not-a-zip.pt").write_bytes(b"junk" + zipped[-22:])  # is_zipfile accepts, ZipFile rejects
    add("meta.pt").write_bytes(torch_bytes({"a": torch.empty(10**12, device="meta")}))
    add("sparse.pt").write_bytes(torch_bytes({"a": torch.eye(3).to_sparse()}))
    add("quantized.pt").write_bytes(
        torch_bytes({"a": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)})
    )
    add("nested.pt").write_bytes(
        torch_bytes({"a": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])})
    )
    raw = torch_bytes({"a": "PLACEHOLDER"})
    add("deep-pkl.pt").write_bytes(_rezip_pickle(raw, 50_000))
    code = FOREIGN + "".join(f"read_foreign({str(f)!r}, {f.name + ': '!r})\n" for f in files)
    assert_refused(run_calls(code, tmp_path / "outside"), len(files))


def _rezip_pickle(archive: bytes, depth: int) -> bytes:
    """``archive`` with its data.pkl's placeholder string replaced by a deeply nested list."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                marker = b"PLACEHOLDER"
                for opcode in (
                    b"X" + struct.pack("<I", len(marker)) + marker,
                    b"\x8c" + bytes([len(marker)]) + marker,
                ):
                    if opcode in data:
                        data = data.replace(opcode, b"]" * depth + b"a" * (depth - 1), 1)
                        break
                else:
                    raise AssertionError("placeholder not found")
            dst.writestr(info.filename, data)
    return out.getvalue()


def test_cli_on_damaged_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "root"
    good = root / "step-100"
    save_small(good)
    huge = root / "step-200"
    doc = save_small(huge)
    doc["files"][next(iter(doc["files"]))]["nbytes"] = 10**400
    (huge / "manifest.json").write_bytes(sealed(doc))
    surrogate = root / "step-300"
    doc = save_small(surrogate)
    doc["tensors"]["w\udcff"] = doc["tensors"].pop("w")
    (surrogate / "manifest.json").write_bytes(sealed(doc))
    loop = root / ".step-400.tmp-1"
    (loop / "data").mkdir(parents=True)
    (loop / "data" / "a.bin").symlink_to(loop / "data" / "b.bin")
    (loop / "data" / "b.bin").symlink_to(loop / "data" / "a.bin")
    fifo = root / "step-500"
    save_small(fifo)
    (fifo / "manifest.json").unlink()
    import os

    os.mkfifo(fifo / "manifest.json")
    code = f"""
cli("verify", "verify", {str(huge)!r})
cli("inspect", "inspect", {str(huge)!r})
"""
    results = run_calls(code, tmp_path / "outside")
    for r in results:
        assert_cli_refused(r)
    # a valid checkpoint whose key holds a lone surrogate: printed escaped, to a real stdout
    proc = run_cli("inspect", str(surrogate))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "w\\udcff" in proc.stdout, proc.stdout
    proc = run_cli("ls", str(root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "step-100" in proc.stdout and "committed" in proc.stdout, proc.stdout
    for name in ("step-200", "step-500"):
        line = next(line for line in proc.stdout.splitlines() if line.endswith(name))
        assert "corrupt" in line, proc.stdout
