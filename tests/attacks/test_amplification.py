"""Class 11: a foreign file cannot describe more than its bytes on disk.

- Stride-0 tensors: ``torch.save(torch.zeros(1).expand(n))`` stores 4 bytes and loads as
  ``n`` elements, which converting, comparing or reassembling then makes real (2.4 KB gave
  1.36 GB of memory and a 1 GiB output; ``diff`` of such a file with itself took 65 s and
  11 GB). A stored tensor may not describe more bytes than its storage holds, the distinct
  storages together hold at most the archive's storage records, and all tensors counted
  where they appear at most 8 times that (``codec.check_loaded_tree``).
- DCP ``.metadata`` amplification: N keys referring to one metadata object with C chunks
  cost N x C to index (126 KB took 13.5 s and 913 MiB). The chunks listed over all keys are
  bounded by the file's size (``dcp.read_metadata``), and no two items may share the bytes
  of one record (N keys over one record would read it N times).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from .foreign import FOREIGN, make_dcp, torch_bytes
from .harness import assert_cli_refused, assert_refused, run_calls

pytestmark = pytest.mark.timeout(300)
N = 1 << 28
"""Elements claimed: 1 GiB of float32."""


def _one_chunk_dcp(path: Path, record: bytes, numel: int) -> None:
    """``w`` becomes one chunk of ``numel`` elements stored in ``record``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    make_dcp(path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    entry = meta.state_dict_metadata["w"]
    entry.size = torch.Size([numel])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))]
    for index in [i for i in meta.storage_data if i.fqn == "w"]:
        del meta.storage_data[index]
    (path / "__w.distcp").write_bytes(record)
    meta.storage_data[MetadataIndex("w", torch.Size([0]))] = _StorageInfo(
        "__w.distcp", 0, len(record)
    )
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_stride_zero_tensors_are_refused(tmp_path: Path) -> None:
    expanded = torch_bytes({"w": torch.zeros(1).expand(N)})
    assert len(expanded) < 4 << 10
    (tmp_path / "e.pt").write_bytes(expanded)
    _one_chunk_dcp(tmp_path / "dcp", torch_bytes(torch.zeros(1).expand(N)), N)
    # overlapping rows: N elements viewed in about 1 MiB of storage
    rows, cols = 1024, N // 1024
    (tmp_path / "o.pt").write_bytes(
        torch_bytes({"w": torch.zeros(rows + cols).as_strided((rows, cols), (1, 1))})
    )
    pt, o, dcp = (str(tmp_path / n) for n in ("e.pt", "o.pt", "dcp"))
    code = (
        FOREIGN
        + f"""
for label, path in (("pt", {pt!r}), ("overlapping", {o!r}), ("dcp", {dcp!r})):
    read_foreign(path, label + ": ")
cli("diff", "diff", {pt!r}, {pt!r})
cli("inspect", "inspect", {pt!r})
cli("convert", "convert", {pt!r}, {str(tmp_path / "out")!r}, "--to", "shardsafe")
cli("convert dcp", "convert", {dcp!r}, {str(tmp_path / "out.pt")!r}, "--to", "torch")
"""
    )
    results = run_calls(code, tmp_path / "outside")
    assert_refused(results[:3], 3, match="storage holds")
    assert len(results) == 7
    for r in results[3:]:
        assert_cli_refused(r)
        assert "storage holds" in r["message"], r
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()


def test_tensors_shared_beyond_the_bound_are_refused(tmp_path: Path) -> None:
    """Nine references to one stored tensor describe nine times its bytes: refused; a tensor
    tied in four places (T5's embeddings) and views of one storage load."""
    import shardsafe.convert as convert
    from shardsafe import CorruptCheckpointError

    big = torch.arange(1 << 18, dtype=torch.float32)
    torch.save({f"k{i}": big for i in range(9)}, tmp_path / "nine.pt")
    with pytest.raises(CorruptCheckpointError, match="8 times"):
        convert.open_source(tmp_path / "nine.pt")
    qkv = torch.arange(3000.0)
    q, k, v = qkv.split(1000)
    torch.save({"a": big, "b": big, "c": big, "d": big, "q": q, "k": k, "v": v}, tmp_path / "ok.pt")
    source = convert.open_source(tmp_path / "ok.pt")
    assert torch.equal(source.read_tensor("d"), big) and torch.equal(source.read_tensor("v"), v)


def test_shared_dcp_metadata_is_bounded(tmp_path: Path) -> None:
    """3,000 keys sharing one entry of 20,000 chunks (one storage entry each): 60 M chunk
    visits from about 200 KB; and 200 keys over one record."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = make_dcp(tmp_path / "chunks")
    meta = pickle.loads((path / ".metadata").read_bytes())
    entry = meta.state_dict_metadata["w"]
    entry.chunks = [entry.chunks[0]] * 20_000
    info = next(v for i, v in meta.storage_data.items() if i.fqn == "w")
    for i in range(3000):
        meta.state_dict_metadata[f"k{i}"] = entry
        meta.storage_data[MetadataIndex(f"k{i}", entry.chunks[0].offsets)] = info
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    assert (path / ".metadata").stat().st_size < 256 << 10

    shared = make_dcp(tmp_path / "shared")
    meta = pickle.loads((shared / ".metadata").read_bytes())
    entry = meta.state_dict_metadata["w"]
    info = next(v for i, v in meta.storage_data.items() if i.fqn == "w")
    for i in range(200):
        meta.state_dict_metadata[f"k{i}"] = entry
        meta.storage_data[MetadataIndex(f"k{i}", entry.chunks[0].offsets)] = _StorageInfo(
            info.relative_path, info.offset, info.length
        )
    (shared / ".metadata").write_bytes(pickle.dumps(meta))
    code = (
        FOREIGN
        + f"""
read_foreign({str(path)!r}, "chunks: ")
read_foreign({str(shared)!r}, "shared: ")
from shardsafe.convert.dcp import read_metadata
attempt("read_metadata", lambda: read_metadata({str(path)!r}))
"""
    )
    results = run_calls(code, tmp_path / "outside")
    assert_refused([results[0], results[2]], 2, match="chunks over its keys")
    assert_refused([results[1]], 1, match="share bytes")
