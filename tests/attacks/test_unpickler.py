"""Class 9: the restricted unpicklers admit nothing outside their allow-lists.

- ``EXT1/2/4`` opcodes take objects from the process-wide ``copyreg`` extension cache
  without calling ``find_class``: once anything in the process has resolved an
  extension, a DCP ``.metadata`` could reach it. Every pickle read by the metadata
  unpickler is scanned for these opcodes first (``codec.scan_pickle``).
- Importing ``torch.distributed.tensor`` adds ``DTensor``, ``DeviceMesh``, ``DTensorSpec``,
  ``TensorMeta``, ``Shard``, ``Replicate``, ``Partial``, ``_StridedShard`` and
  ``ShardOrderEntry`` to what every ``torch.load(weights_only=True)`` admits. Archives
  naming anything under ``torch.distributed`` are refused by our restricted loads,
  whatever the process imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from .foreign import FOREIGN, make_dcp, torch_bytes
from .harness import READERS, assert_refused, run_calls, save_small, write_manifest

pytestmark = pytest.mark.timeout(240)
CODE = 4242


def _ext_pickle(marker: Path) -> bytes:
    """``os.mkdir(marker)`` through extension code ``CODE``: no GLOBAL opcode at all."""
    name = str(marker).encode()
    return (
        b"\x80\x02"  # PROTO 2
        + b"\x83"
        + CODE.to_bytes(2, "little")  # EXT2: the callable from the extension cache
        + b"X"
        + len(name).to_bytes(4, "little")
        + name  # BINUNICODE
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )


def test_ext_opcodes_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = _ext_pickle(marker)
    make_dcp(tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(payload)
    code = (
        FOREIGN
        + f"""
import copyreg, pickle
copyreg.add_extension("os", "mkdir", {CODE})
pickle.loads({_ext_pickle(tmp_path / "warmup")!r})  # fills copyreg's cache, as any use would
import os
assert os.path.isdir({str(tmp_path / "warmup")!r})
read_foreign({str(tmp_path / "dcp")!r}, "dcp: ")
from shardsafe.convert.safe_pickle import load_metadata_pickle
attempt("direct", lambda: load_metadata_pickle({payload!r}, "test"))
"""
    )
    results = run_calls(code, tmp_path / "outside")
    assert_refused(results, 2, match="EXT2")
    assert not marker.exists(), "the extension's callable ran"


def _blob_checkpoint(path: Path, blob: bytes) -> None:
    doc = save_small(path)
    (path / "data" / "p.bin").write_bytes(blob)
    doc["files"]["data/p.bin"] = {"nbytes": len(blob), "rank": 0}
    block = doc["checksum"]["block_bytes"]
    doc["blobs"]["c.p"] = {
        "file": "data/p.bin",
        "byte_offset": 0,
        "nbytes": len(blob),
        "checksums": [
            xxhash.xxh3_64_hexdigest(blob[i : i + block]) for i in range(0, len(blob), block)
        ],
    }
    doc["common"] = {"$torch_save": {"type": "builtins.dict", "blob": "c.p"}}
    write_manifest(path, doc)


def test_torch_distributed_classes_are_refused(tmp_path: Path) -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard

    payload = torch_bytes({"placements": [Shard(0), Replicate()]})
    _blob_checkpoint(tmp_path / "ours", payload)
    (tmp_path / "p.pt").write_bytes(payload)
    make_dcp(tmp_path / "mcore", megatron=True)
    (tmp_path / "mcore" / "common.pt").write_bytes(payload)
    code = (
        READERS
        + FOREIGN
        + f"""
import io, torch, torch.distributed.tensor
# the import made these loadable for any weights-only torch.load in this process ...
torch.load(io.BytesIO({payload!r}), weights_only=True)
# ... but not for ours
attempt("ours: common", lambda: shardsafe.load_common_state_dict({str(tmp_path / "ours")!r}))
read_foreign({str(tmp_path / "p.pt")!r}, "pt: ")
read_foreign({str(tmp_path / "mcore")!r}, "mcore: ")
"""
    )
    results = run_calls(code, tmp_path / "outside")
    assert_refused(results, 3, match="torch.distributed")
