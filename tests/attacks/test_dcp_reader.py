"""``shardsafe.dcp.Reader`` on hostile shardsafe checkpoints: DCP's planner never sees a byte
the Reader did not check, and every refusal is a ``CheckpointError`` (inside DCP's own
``CheckpointException`` when it comes from ``read_data``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checksum import block_checksums

from .harness import assert_refused, run_calls

pytestmark = pytest.mark.timeout(240)

LOAD = """
def dcp_load(path):
    import torch, torch.distributed.checkpoint as dcp, warnings
    from torch.distributed.checkpoint.api import CheckpointException
    from shardsafe.dcp import Reader
    warnings.simplefilter("ignore")
    def run():
        try:
            dcp.load({"w": torch.zeros(64, 64), "step": 0}, storage_reader=Reader(path))
        except CheckpointException as e:  # the first rank's error inside DCP's wrapper
            failure = next(iter(e.failures.values()))
            raise (failure[0] if isinstance(failure, tuple) else failure) from None
    attempt(path, run)
"""


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, ("touch pwned",))


def _checkpoint(path: Path) -> Path:
    shardsafe.save({"w": torch.arange(4096.0).reshape(64, 64), "step": 3}, path)
    return path


def _edit_manifest(path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_reader_refuses_hostile_checkpoints(tmp_path: Path) -> None:
    cases = []
    # a flipped byte in the data
    flipped = _checkpoint(tmp_path / "flipped")
    data = sorted((flipped / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x40
    data.write_bytes(bytes(raw))
    cases.append(flipped)

    # a piece whose extent runs past the end of its file
    def far(m):  # type: ignore[no-untyped-def]
        piece = m["tensors"]["w"]["pieces"][0]
        piece["byte_offset"] = 1 << 40

    cases.append(_edit_manifest(_checkpoint(tmp_path / "far"), far))

    # a tensor claiming a shape its pieces do not cover (DCP would plan reads of nothing)
    def hollow(m):  # type: ignore[no-untyped-def]
        m["tensors"]["w"]["shape"] = [128, 64]

    cases.append(_edit_manifest(_checkpoint(tmp_path / "hollow"), hollow))

    # the manifest is not JSON
    garbled = _checkpoint(tmp_path / "garbled")
    (garbled / "manifest.json").write_bytes(b"{\x00not json")
    cases.append(garbled)

    # a pickle that runs code, stored as a checksummed blob of the common state: refused
    # by the restricted decoder, never handed to DCP's planner (which would unpickle it)
    evil = _checkpoint(tmp_path / "evil")
    buf = io.BytesIO()
    torch.save(_Evil(), buf)
    blob = buf.getvalue()
    (evil / "data" / "rank-00000-09.bin").write_bytes(blob)

    def hide(m):  # type: ignore[no-untyped-def]
        m["files"]["data/rank-00000-09.bin"] = {"nbytes": len(blob), "rank": 0}
        m["blobs"]["c.9"] = {
            "file": "data/rank-00000-09.bin",
            "byte_offset": 0,
            "nbytes": len(blob),
            "checksums": block_checksums(blob, m["checksum"]["block_bytes"]),
        }
        m["common"]["$dict"].append(["evil", {"$torch_save": {"type": "x.Evil", "blob": "c.9"}}])

    cases.append(_edit_manifest(evil, hide))

    code = LOAD + "".join(f"dcp_load({str(p)!r})\n" for p in cases)
    results = run_calls(code, tmp_path / "outside")
    assert_refused(results, len(cases))
    assert not (tmp_path / "pwned").exists()
