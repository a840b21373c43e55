"""Class 3: an archive cannot inflate beyond the bytes on disk.

A 1 MiB ``torch.save`` archive whose storage record is deflated inflates to 1 GiB when
``torch.load`` reads it. ``torch.save`` never compresses, so every archive read with the
restricted loader (our ``$torch_save`` blobs, DCP object records, Megatron's ``common.pt``,
plain ``.pt`` files) is checked first (``codec.check_torch_archive``): a deflated record,
or records claiming more bytes than the archive holds, is refused before ``torch.load``.
DCP records decoded through stream transforms may grow at most ``MAX_INFLATION`` times.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash

from .foreign import FOREIGN, deflated, make_dcp, retarget_dcp_object, torch_bytes
from .harness import (
    N_READERS,
    READERS,
    assert_cli_refuses,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(300)
GIB = 1 << 30


def _blob_checkpoint(path: Path, blob: bytes) -> None:
    doc = save_small(path)
    (path / "data" / "bomb.bin").write_bytes(blob)
    block = doc["checksum"]["block_bytes"]
    doc["files"]["data/bomb.bin"] = {"nbytes": len(blob), "rank": 0}
    doc["blobs"]["c.bomb"] = {
        "file": "data/bomb.bin",
        "byte_offset": 0,
        "nbytes": len(blob),
        "checksums": [
            xxhash.xxh3_64_hexdigest(blob[i : i + block]) for i in range(0, len(blob), block)
        ],
    }
    doc["common"] = {"$torch_save": {"type": "builtins.dict", "blob": "c.bomb"}}
    write_manifest(path, doc)


def test_deflated_archives_are_refused_everywhere(tmp_path: Path) -> None:
    bomb = deflated(torch_bytes({"x": torch.zeros(4)}), inflate_to=GIB)
    assert len(bomb) < 2 << 20
    _blob_checkpoint(tmp_path / "ours", bomb)
    make_dcp(tmp_path / "dcp")
    retarget_dcp_object(tmp_path / "dcp", "n", "__bomb.distcp", bomb)
    make_dcp(tmp_path / "mcore", megatron=True)
    (tmp_path / "mcore" / "common.pt").write_bytes(bomb)
    (tmp_path / "bomb.pt").write_bytes(bomb)
    code = (
        READERS
        + FOREIGN
        + f"""
every_reader({str(tmp_path / "ours")!r}, "ours: ")
for label in ("dcp", "mcore", "bomb.pt"):
    read_foreign({str(tmp_path)!r} + "/" + label, label + ": ")
"""
    )
    results = run_calls(code, tmp_path / "outside")
    ours = {r["name"]: r for r in results[:N_READERS]}
    # readers that never decode the common state have nothing to refuse
    for name in ("ours: load_metadata", "ours: load_content_metadata", "ours: read_tensor"):
        assert ours.pop(name)["outcome"] == "ok", ours[name]
    # verify re-reads bytes and never unpickles: the bomb's checksums match, so it reports
    # nothing about it (the harness turns a clean report into an error for other attacks)
    assert "verify says OK" in ours.pop("ours: verify")["message"]
    assert_refused(list(ours.values()), N_READERS - 4, match="compressed")
    assert_refused(results[N_READERS:], 3, match="compressed")
    assert_cli_refuses(
        run_cli("convert", str(tmp_path / "bomb.pt"), str(tmp_path / "o"), "--to", "shardsafe")
    )


def test_records_claiming_more_than_the_archive_are_refused(tmp_path: Path) -> None:
    """A stored (not deflated) record whose declared size exceeds the archive: refused."""
    import io
    import zipfile

    from shardsafe import CorruptCheckpointError
    from shardsafe.codec import check_torch_archive

    raw = torch_bytes({"x": torch.zeros(4)})
    with pytest.raises(CorruptCheckpointError, match="more than"):
        check_torch_archive(io.BytesIO(raw), 10, "test")
    check_torch_archive(io.BytesIO(raw), len(raw), "test")
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


def test_stream_transforms_inflate_at_most_64_times(tmp_path: Path) -> None:
    """A DCP record decoded through a stream transform (here a zlib one registered by the
    test) stops being read past 64 times its stored bytes."""
    import io
    import zlib

    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    from shardsafe import CorruptCheckpointError
    from shardsafe.convert import DcpSource

    class Zlib(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test-zlib"

        @staticmethod
        def from_descriptor(version: str) -> Zlib:
            return Zlib()

        def get_descriptor(self) -> str:
            return "test-zlib/1"

        def transform_to(self, output):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def transform_from(self, input):  # type: ignore[no-untyped-def]
            return io.BytesIO(zlib.decompress(input.read()))

    registry = ExtensionRegistry()
    registry.register(Zlib)
    for label, value, refused in (
        ("bomb", torch.zeros(64 << 20, dtype=torch.uint8), True),
        ("fine", torch.arange(100), False),
    ):
        path = make_dcp(tmp_path / label)
        record = zlib.compress(torch_bytes(value), 9)
        retarget_dcp_object(path, "n", "__z.distcp", record)
        import pickle

        meta = pickle.loads((path / ".metadata").read_bytes())
        for index, info in meta.storage_data.items():
            if index.fqn == "n":
                info.transform_descriptors = ["test-zlib/1"]
        (path / ".metadata").write_bytes(pickle.dumps(meta))
        source = DcpSource(path, extension_registry=registry)
        if refused:
            with pytest.raises(CorruptCheckpointError, match="64 times"):
                source.common()
        else:
            assert torch.equal(source.common()["n"], value)
