"""Small real checkpoints in the foreign formats, for attacks to damage."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_dcp(path: Path, *, megatron: bool = False) -> Path:
    """A DCP checkpoint of one sharded-looking tensor and one object; with ``megatron``,
    Megatron-Core's ``metadata.json`` and ``common.pt`` too."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(48.0).reshape(8, 6), "n": 3}, checkpoint_id=str(path), no_dist=True)
    if megatron:
        (path / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
        )
        torch.save({"args": {"lr": 0.1}, "iteration": 7}, path / "common.pt")
    return path


def make_hf(path: Path) -> Path:
    """A Hugging Face folder: two safetensors shards and their index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"a": torch.arange(6.0)}, str(path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3, 2)}, str(path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 48},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


FOREIGN = """
def read_foreign(path, label="", trust=False):
    from shardsafe.convert import open_source
    def run():
        source = open_source(path, trust=trust)
        for key in source.tensor_keys():
            source.read_tensor(key)
        source.common()
    attempt(f"{label}read", run)
"""
"""Driver code: ``read_foreign(path)`` opens any foreign format and reads all of it."""


def deflated(archive: bytes, *, inflate_to: int = 0) -> bytes:
    """``archive`` (a torch.save zip) with every record deflated; with ``inflate_to``, its
    first storage record replaced by that many zero bytes (a decompression bomb)."""
    import io
    import zipfile

    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(archive)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        bombed = False
        for info in src.infolist():
            name = info.filename
            if inflate_to and not bombed and "/data/" in name and not name.endswith(".pkl"):
                bombed = True
                with dst.open(name, "w", force_zip64=True) as f:
                    chunk = bytes(1 << 20)
                    for _ in range(inflate_to >> 20):
                        f.write(chunk)
            else:
                dst.writestr(name, src.read(info))
    return out.getvalue()


def torch_bytes(value: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def retarget_dcp_object(path: Path, key: str, file_name: str, data: bytes) -> None:
    """Point the DCP object item ``key`` at ``data``, written as ``file_name`` (test-side,
    trusted unpickling of the metadata the test wrote itself)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta = pickle.loads((path / ".metadata").read_bytes())
    (path / file_name).write_bytes(data)
    for index in list(meta.storage_data):
        if index.fqn == key:
            meta.storage_data[index] = _StorageInfo(file_name, 0, len(data))
    (path / ".metadata").write_bytes(pickle.dumps(meta))
