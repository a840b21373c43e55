"""Write the pinned format-v1 checkpoint under ``tests/golden/v1``.

Re-run this ONLY for a deliberate change of the on-disk format (which also bumps the
format version in FORMAT.md and ``shardsafe.format.FORMAT_VERSION``, keeping the old
golden directory so the new reader is still tested against it). ``tests/test_format.py``
saves :func:`golden_state_dict` again and fails on any byte that differs from these files.

The stored ``manifest.json`` is the manifest a save writes, minus ``created``,
``library_version`` (which change with every save) and ``manifest_digest`` (which covers
them), re-indented for reading; the data file is byte for byte what the save wrote. The
directory is itself a readable checkpoint: one without a manifest digest, as shardsafe wrote
them before it sealed manifests, which is how readers are tested on those.

    .venv/bin/python tests/golden/make_golden.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe import ShardedObject, ShardedTensor

GOLDEN_DIR = Path(__file__).resolve().parent / "v1"
#: Small blocks, so that pieces carry several checksums and the last block is short.
BLOCK_BYTES = 16
#: One data file, whatever the default of the day.
FILES_PER_RANK = 1
#: Fields that differ between two saves of the same state dict.
VOLATILE_FIELDS = ("created", "library_version", "manifest_digest")


def golden_state_dict() -> dict[str, Any]:
    """A tiny, fully deterministic state dict touching each kind of stored item."""
    split = torch.arange(-6, 6, dtype=torch.int16)  # the int16 tensor [3, 4], flattened
    return {
        "matrix": ShardedTensor.from_rank_offsets(
            "matrix", torch.tensor([[1.0, -2.0, 0.5], [3.25, 0.0, -0.0]], dtype=torch.float32)
        ),
        # one [3, 4] int16 tensor stored as two flat ranges of its row-major flattening
        "split.0": ShardedTensor.from_rank_offsets_flat(
            "split", split[:5].clone(), (3, 4), flattened_range=slice(0, 5)
        ),
        "split.1": ShardedTensor.from_rank_offsets_flat(
            "split", split[5:].clone(), (3, 4), flattened_range=slice(5, 12)
        ),
        "half": ShardedTensor.from_rank_offsets(
            "half", torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
        ),
        "obj": ShardedObject("obj", {"a": 1}, (1,), (0,)),
        "step": 7,
    }


def save_golden(path: Path, asynchronous: bool = False) -> None:
    """Save :func:`golden_state_dict` into ``path`` (single process)."""
    saver = shardsafe.Saver(files_per_rank=FILES_PER_RANK, block_bytes=BLOCK_BYTES)
    try:
        if asynchronous:
            saver.async_save(golden_state_dict(), path).result()
        else:
            saver.save(golden_state_dict(), path)
    finally:
        saver.close()


def stable_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest without its volatile fields (key order kept)."""
    manifest = json.loads(raw)
    for name in VOLATILE_FIELDS:
        del manifest[name]
    return manifest


def readable_json(manifest: dict[str, Any]) -> str:
    """One line per top-level field, and one per entry of the tables (files, tensors, ...)."""

    def dumps(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "))

    lines = []
    for key, value in manifest.items():
        if key in ("files", "tensors", "objects", "blobs") and value:
            entries = [f"    {dumps(k)}: {dumps(v)}" for k, v in value.items()]
            lines.append(f"  {dumps(key)}: {{\n" + ",\n".join(entries) + "\n  }")
        else:
            lines.append(f"  {dumps(key)}: {dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        save_golden(ckpt)
        manifest = stable_manifest((ckpt / "manifest.json").read_bytes())
        if GOLDEN_DIR.exists():
            shutil.rmtree(GOLDEN_DIR)
        (GOLDEN_DIR / "data").mkdir(parents=True)
        (GOLDEN_DIR / "manifest.json").write_text(readable_json(manifest))
        for name in manifest["files"]:
            shutil.copyfile(ckpt / name, GOLDEN_DIR / name)
    print(f"wrote {GOLDEN_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
