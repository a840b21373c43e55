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
