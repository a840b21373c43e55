"""Reading DCP / Megatron torch_dist checkpoints written by real torch.distributed.checkpoint."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardsafe.convert import (
    DcpSource,
    HfSource,
    TorchFileSource,
    UnsafePickleError,
    UnsupportedFormatError,
    detect_format,
    export_dcp,
    export_hf,
    export_torch,
    is_dcp_checkpoint,
    open_source,
)
from shardsafe.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingKeyError,
)

pytestmark = pytest.mark.timeout(120)  # the module's checkpoint is saved by two processes


def _full_state() -> dict[str, torch.Tensor]:
    """What both ranks hold globally; every rank computes the same values."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model.w": torch.randn(8, 6, generator=g),  # Shard(0), even
        "model.u": torch.randn(5, 7, generator=g),  # Shard(1), uneven: 4 + 3 columns
        "model.b": torch.arange(10).to(torch.bfloat16),  # Shard(0)
        "model.idx": torch.arange(9).reshape(3, 3),  # Shard(0), uneven: 2 + 1 rows
        "model.rep": torch.ones(3) * 2.5,  # replicated plain tensor
        "model.scalar": torch.tensor(3.0),
    }


def _save_rank(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full_state()
    state = {
        "model": {
            "w": distribute_tensor(full["model.w"], mesh, [Shard(0)]),
            "u": distribute_tensor(full["model.u"], mesh, [Shard(1)]),
            "b": distribute_tensor(full["model.b"], mesh, [Shard(0)]),
            "idx": distribute_tensor(full["model.idx"], mesh, [Shard(0)]),
            "rep": full["model.rep"],
            "scalar": full["model.scalar"],
        },
        "step": 7,
        "extra": {"name": "run-1", "lst": [1, 2.5]},
    }
    dcp.save(state, checkpoint_id=path)


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_ranks(_save_rank, 2, str(path), timeout=100)
    return path


@pytest.fixture
def ckpt_copy(dcp_ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(dcp_ckpt, dst)
    return dst


def _trusted_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # written by this test itself


def _write_metadata(path: Path, metadata: object) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_two_rank_checkpoint_consolidates_exactly(dcp_ckpt: Path) -> None:
    assert is_dcp_checkpoint(dcp_ckpt) and detect_format(dcp_ckpt) == "dcp"
    files = sorted(p.name for p in dcp_ckpt.iterdir())
    assert ".metadata" in files and "__0_0.distcp" in files and "__1_0.distcp" in files
    chunks = {
        k: len(v.chunks)
        for k, v in _trusted_metadata(dcp_ckpt).state_dict_metadata.items()
        if hasattr(v, "chunks")
    }
    assert (
        chunks["model.w"] == chunks["model.u"] == chunks["model.idx"] == 2
        and chunks["model.rep"] == 1
    )
    source = DcpSource(dcp_ckpt)
    expected = _full_state()
    assert sorted(source.tensor_keys()) == sorted(expected)
    for key, tensor in expected.items():
        assert source.tensor_meta(key) == (tuple(tensor.shape), tensor.dtype)
        got = source.read_tensor(key)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    # DCP flattened the nested common state and recorded the paths: it comes back nested
    assert source.common() == {"step": 7, "extra": {"name": "run-1", "lst": [1, 2.5]}}
    with pytest.raises(MissingKeyError, match="object"):
        source.read_tensor("step")
    with pytest.raises(MissingKeyError, match="not in the checkpoint"):
        source.tensor_meta("nope")


def test_dcp_to_torch_and_hf_exact(dcp_ckpt: Path, tmp_path: Path) -> None:
    source = DcpSource(dcp_ckpt)
    expected = _full_state()
    out = export_torch(source, tmp_path / "model.pt")
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == {*expected, "step", "extra.name", "extra.lst"}
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    assert loaded["step"] == 7 and loaded["extra.lst"] == [1, 2.5]

    export_hf(source, tmp_path / "hf", max_shard_size="200B")
    hf = HfSource(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert sorted(hf.tensor_keys()) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(hf.read_tensor(key), tensor), key

    export_hf(source, tmp_path / "sub", prefix="model", rename=[(r"^w$", "weight")])
    sub = HfSource(tmp_path / "sub")
    assert sorted(sub.tensor_keys()) == ["b", "idx", "rep", "scalar", "u", "weight"]
    assert torch.equal(sub.read_tensor("weight"), expected["model.w"])


def test_torch_to_dcp_to_torch_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "layer.0.weight": torch.randn(16, 8, generator=g),
        "layer.0.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "layer.1.mask": torch.rand(4, 4, generator=g) > 0.5,
        "empty": torch.zeros(0, 5),
        "count": torch.tensor(5, dtype=torch.int32),
        "meta": {"iteration": 12, "lr": 3e-4, "name": "x"},
    }
    torch.save(state, tmp_path / "in.pt")
    export_dcp(TorchFileSource(tmp_path / "in.pt"), tmp_path / "dcp")

    # torch's own loader reads the result.
    target = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    target.update({"meta.iteration": 0, "meta.lr": 0.0, "meta.name": ""})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key], value), key
    assert (target["meta.iteration"], target["meta.lr"], target["meta.name"]) == (12, 3e-4, "x")

    export_torch(DcpSource(tmp_path / "dcp"), tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    assert back["meta.iteration"] == 12 and back["meta.name"] == "x"

    with pytest.raises(CheckpointError, match="overwrite"):
        export_dcp(TorchFileSource(tmp_path / "in.pt"), tmp_path / "dcp")
    export_dcp(TorchFileSource(tmp_path / "out.pt"), tmp_path / "dcp", overwrite=True)
    assert torch.equal(
        DcpSource(tmp_path / "dcp").read_tensor("layer.0.weight"), state["layer.0.weight"]
    )


class _Marker:
    """Unpickling this would create a file: the proof that a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def test_malicious_metadata_is_refused_without_running(ckpt_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    metadata = _trusted_metadata(ckpt_copy)
    metadata.planner_data = _Marker(str(marker))
    _write_metadata(ckpt_copy, metadata)
    with pytest.raises(UnsafePickleError) as info:
        DcpSource(ckpt_copy)
    message = str(info.value)
    assert f"{os.system.__module__}.system" in message
    assert "trust=True" in message and "--trust" in message and ".metadata" in message
    assert isinstance(info.value, CorruptCheckpointError)
    assert not marker.exists()


def test_metadata_with_foreign_class_is_refused(ckpt_copy: Path) -> None:
    metadata = _trusted_metadata(ckpt_copy)
    metadata.planner_data = argparse.Namespace(x=1)  # harmless, but not DCP's
    _write_metadata(ckpt_copy, metadata)
    with pytest.raises(UnsafePickleError, match=r"argparse\.Namespace"):
        DcpSource(ckpt_copy)
    assert DcpSource(ckpt_copy, trust=True).read_tensor("model.rep").sum() == 7.5


def test_trust_reads_legit_checkpoint(dcp_ckpt: Path) -> None:
    source = DcpSource(dcp_ckpt, trust=True)
    assert torch.equal(source.read_tensor("model.w"), _full_state()["model.w"])
    assert source.common()["step"] == 7


def test_malicious_object_item_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.ones(2), "evil": _Marker(str(marker))},
            checkpoint_id=str(tmp_path / "c"),
            no_dist=True,
        )
    source = DcpSource(tmp_path / "c")  # metadata is clean; the object is only decoded on demand
    assert torch.equal(source.read_tensor("w"), torch.ones(2))
    with pytest.raises(UnsafePickleError, match=r"system") as info:
        source.common()
    assert "object 'evil'" in str(info.value) and "__0_" in str(info.value)
    assert not marker.exists()
    with pytest.raises(UnsafePickleError):
        export_torch(source, tmp_path / "out.pt")
    assert not marker.exists()


def _megatronize(path: Path, common: dict[str, object]) -> None:
    """Make a DCP checkpoint look like Megatron-Core's torch_dist: metadata.json, common.pt and a
    metadata object of Megatron's own (marker) class carrying every rank's save plan."""
    metadata = _trusted_metadata(path)
    name = "megatron.core.dist_checkpointing.strategies.torch"
    fake = types.ModuleType(name)

    class MCoreMetadata(Metadata):
        pass

    MCoreMetadata.__module__, MCoreMetadata.__qualname__ = name, "MCoreMetadata"
    setattr(fake, "MCoreMetadata", MCoreMetadata)  # noqa: B010 - a module built at run time
    parts = name.split(".")
    chain = [".".join(parts[: i + 1]) for i in range(len(parts))]
    saved = {k: sys.modules.get(k) for k in chain}
    for k in chain[:-1]:
        sys.modules[k] = types.ModuleType(k)
    sys.modules[name] = fake
    try:
        mcore = MCoreMetadata(**vars(metadata))
        item = WriteItem(
            index=MetadataIndex("model.w", (0, 0)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 6])),
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([8, 6]),
            ),
        )
        mcore.all_local_plans = [
            SavePlan([item], storage_data=_StoragePrefix("__0_"), planner_data={})
        ]
        _write_metadata(path, mcore)
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
    (path / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    torch.save(common, path / "common.pt")


def test_megatron_torch_dist_layout(ckpt_copy: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(lr=1e-4, hidden_size=64, params_dtype=torch.bfloat16)
    before = {m for m in sys.modules if m.startswith("megatron")}  # real megatron-core, if imported
    _megatronize(ckpt_copy, {"args": args, "iteration": 100, "checkpoint_version": 3.0})
    assert {m for m in sys.modules if m.startswith("megatron")} == before  # stand-ins removed
    source = DcpSource(ckpt_copy)
    assert (
        source.megatron_config is not None
        and source.megatron_config["sharded_backend"] == "torch_dist"
    )
    for key, tensor in _full_state().items():
        assert torch.equal(source.read_tensor(key), tensor), key
    common = source.common()
    assert common["iteration"] == 100 and common["args"].lr == 1e-4 and common["step"] == 7

    out = torch.load(export_torch(source, tmp_path / "m.pt"), weights_only=True)
    assert (
        out["args.lr"] == 1e-4
        and out["args.params_dtype"] == torch.bfloat16
        and out["iteration"] == 100
    )


def test_megatron_integrity_manifest(ckpt_copy: Path) -> None:
    import hashlib

    assert DcpSource(ckpt_copy).verify_integrity() == []  # no manifest: nothing to check
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt_copy.iterdir()}
    (ckpt_copy / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))
    assert DcpSource(ckpt_copy).verify_integrity() == []
    victim = ckpt_copy / "__1_0.distcp"
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    (ckpt_copy / "__0_0.distcp").unlink()
    assert DcpSource(ckpt_copy).verify_integrity() == [
        "__0_0.distcp: missing",
        "__1_0.distcp: SHA-256 mismatch",
    ]


def test_megatron_unsafe_common_is_refused(ckpt_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _megatronize(ckpt_copy, {"evil": _Marker(str(marker))})
    source = DcpSource(ckpt_copy)
    # Tensors need no common.pt.
    assert torch.equal(source.read_tensor("model.rep"), torch.ones(3) * 2.5)
    with pytest.raises(UnsafePickleError, match=r"common\.pt"):
        source.common()
    assert not marker.exists()


def test_other_megatron_backends_are_rejected(ckpt_copy: Path) -> None:
    (ckpt_copy / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(UnsupportedFormatError, match="zarr"):
        DcpSource(ckpt_copy)
    (ckpt_copy / ".metadata").unlink()  # zarr checkpoints have none
    assert detect_format(ckpt_copy) == "dcp"
    with pytest.raises(UnsupportedFormatError, match="sharded_backend 'zarr'"):
        open_source(ckpt_copy)


def _storage_of(metadata: Metadata, fqn: str) -> list[MetadataIndex]:
    return [index for index in metadata.storage_data if index.fqn == fqn]


def test_missing_data_file(ckpt_copy: Path) -> None:
    metadata = _trusted_metadata(ckpt_copy)
    relative = metadata.storage_data[_storage_of(metadata, "model.w")[0]].relative_path
    (ckpt_copy / relative).unlink()
    source = DcpSource(ckpt_copy)
    with pytest.raises(CorruptCheckpointError) as info:
        source.read_tensor("model.w")
    assert (
        relative in str(info.value)
        and "model.w" in str(info.value)
        and "missing" in str(info.value)
    )


def test_truncated_data_file(ckpt_copy: Path) -> None:
    metadata = _trusted_metadata(ckpt_copy)
    infos = [metadata.storage_data[i] for i in metadata.storage_data]
    last = max(infos, key=lambda s: (s.relative_path, s.offset))
    victim = ckpt_copy / last.relative_path
    victim.write_bytes(victim.read_bytes()[: last.offset + last.length // 2])
    key = next(i.fqn for i, s in metadata.storage_data.items() if s is last)
    source = DcpSource(ckpt_copy)
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        source.read_tensor(key) if key in source.tensor_keys() else source.common()
    assert last.relative_path in str(info.value) and key in str(info.value)


def test_damaged_record_and_metadata(ckpt_copy: Path) -> None:
    metadata = _trusted_metadata(ckpt_copy)
    info = metadata.storage_data[_storage_of(metadata, "model.rep")[0]]
    with open(ckpt_copy / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"garbage!")
    with pytest.raises(CorruptCheckpointError, match=r"model\.rep"):
        DcpSource(ckpt_copy).read_tensor("model.rep")

    (ckpt_copy / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        DcpSource(ckpt_copy)


def test_chunk_gaps_and_escaping_paths(ckpt_copy: Path) -> None:
    metadata = _trusted_metadata(ckpt_copy)
    metadata.state_dict_metadata["model.w"].chunks.pop()
    index = _storage_of(metadata, "model.rep")[0]
    old = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo("../outside.distcp", old.offset, old.length)
    _write_metadata(ckpt_copy, metadata)
    source = DcpSource(ckpt_copy)
    with pytest.raises(CorruptCheckpointError, match=r"cover 24 of 48 elements; index \(4, 0\)"):
        source.read_tensor("model.w")
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint"):
        source.read_tensor("model.rep")
    assert torch.equal(source.read_tensor("model.u"), _full_state()["model.u"])


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        DcpSource(tmp_path / "absent")
    with pytest.raises(UnsupportedFormatError):
        DcpSource(tmp_path)
    assert not is_dcp_checkpoint(tmp_path)


def test_rank_local_metadata_files(tmp_path: Path) -> None:
    """Saves without collectives leave one ``__{rank}.metadata`` per rank and no ``.metadata``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(4.0), "n": 3}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    (tmp_path / "c" / ".metadata").rename(tmp_path / "c" / "__0.metadata")
    source = DcpSource(tmp_path / "c")
    assert detect_format(tmp_path / "c") == "dcp"
    assert torch.equal(source.read_tensor("a"), torch.arange(4.0)) and source.common() == {"n": 3}


class _Xor(io.RawIOBase):
    """A byte stream transform standing in for compression: XOR with a constant."""

    def __init__(self, inner: Any, write: bool) -> None:
        super().__init__()
        self.inner, self.is_writer = inner, write

    def readable(self) -> bool:
        return not self.is_writer

    def writable(self) -> bool:
        return self.is_writer

    def write(self, data: Any) -> int:
        raw = bytes(data)
        self.inner.write(bytes(b ^ 0x5A for b in raw))
        return len(raw)

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = bytes(b ^ 0x5A for b in data)
        return len(data)


def _xor_extension() -> type:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class XorExtension(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test.xor"

        @staticmethod
        def from_descriptor(version: str) -> XorExtension:
            return XorExtension()

        def get_descriptor(self) -> str:
            return "test.xor/1"

        def transform_to(self, output: Any) -> Any:
            return _Xor(output, write=True)

        def transform_from(self, input: Any) -> Any:
            return _Xor(input, write=False)

    return XorExtension


def test_stream_transforms(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    extension = _xor_extension()
    state = {"w": torch.randn(6, 4), "n": 5}
    writer = FileSystemWriter(str(tmp_path / "c"), _extensions=[extension()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    with pytest.raises(CorruptCheckpointError, match=r"test\.xor/1"):
        DcpSource(tmp_path / "c").read_tensor("w")
    registry = ExtensionRegistry()
    registry.register(extension)
    source = DcpSource(tmp_path / "c", extension_registry=registry)
    assert torch.equal(source.read_tensor("w"), state["w"]) and source.common() == {"n": 5}


def _damaged_checkpoint(path: Path) -> None:
    """A committed shardsafe checkpoint whose second tensor fails its checksum."""
    import shardsafe

    shardsafe.save({"a": torch.arange(4096.0), "b": torch.ones(4096), "step": 1}, path)
    reader = shardsafe.CheckpointReader(path)
    extent = reader.manifest.tensors["b"].pieces[0].extent
    data = path / extent.file
    raw = bytearray(data.read_bytes())
    raw[extent.byte_offset + 10] ^= 0xFF
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("fmt", ["dcp", "megatron", "hf"])
def test_export_of_a_damaged_source_fails_in_one_line_and_writes_nothing(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's writer wrapped the reader's error in a CheckpointException (a BaseException, so
    it escaped as a traceback) after writing the files of the tensors before it."""
    import shardsafe
    from shardsafe.cli import main

    _damaged_checkpoint(tmp_path / "bad")
    code = main(["convert", str(tmp_path / "bad"), str(tmp_path / "out"), "--to", fmt])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert code == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith("error: ") and "checksum" in errors[0], err
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # no half export, no staging left behind
    # over an existing export with --overwrite: the old export stays whole
    shardsafe.save({"a": torch.zeros(3), "b": torch.zeros(3)}, tmp_path / "good")
    assert main(["convert", str(tmp_path / "good"), str(tmp_path / "out"), "--to", fmt]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    code = main(
        ["convert", str(tmp_path / "bad"), str(tmp_path / "out"), "--to", fmt, "--overwrite"]
    )
    assert code == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["bad", "good", "out"]
    assert torch.equal(
        shardsafe.convert.open_source(tmp_path / "out").read_tensor("a"), torch.zeros(3)
    )


def test_export_over_an_older_export_replaces_only_its_own_files(tmp_path: Path) -> None:
    """Published from the staging directory: stale data files of the old export go, files that
    are not the format's stay, and the result reads back exactly."""
    import shardsafe
    from shardsafe.convert.megatron_export import export_megatron

    shardsafe.save({f"t{i}": torch.full((8,), float(i)) for i in range(6)}, tmp_path / "six")
    shardsafe.save({"t0": torch.full((2,), 7.0)}, tmp_path / "one")
    for fmt, export in (("dcp", export_dcp), ("megatron", export_megatron)):
        out = tmp_path / fmt
        export(shardsafe.CheckpointReader(tmp_path / "six"), out)
        (out / "README.md").write_text("mine")
        export(shardsafe.CheckpointReader(tmp_path / "one"), out, overwrite=True)
        source = DcpSource(out)
        assert source.tensor_keys() == ["t0"] and torch.equal(
            source.read_tensor("t0"), torch.full((2,), 7.0)
        )
        assert (out / "README.md").read_text() == "mine"
        assert len([p for p in out.iterdir() if p.suffix == ".distcp"]) == 1, sorted(
            os.listdir(out)
        )
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--rename", r"w => \9", "invalid group reference 9"),
        ("--rename", r"(w) => \g<name>", "unknown group name"),
        ("--max-shard-size", "9" * 400, "cannot read"),
        ("--max-shard-size", "99999999999TB", "beyond any disk"),
    ],
)
def test_bad_rename_and_shard_size_are_one_line_errors(
    tmp_path: Path, flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import shardsafe
    from shardsafe.cli import main

    shardsafe.save({"w": torch.ones(3)}, tmp_path / "c")
    code = main(["convert", str(tmp_path / "c"), str(tmp_path / "o"), "--to", "hf", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and says in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_export_into_a_link_to_an_empty_directory_fills_the_directory(tmp_path: Path) -> None:
    import shardsafe

    shardsafe.save({"t": torch.arange(5.0)}, tmp_path / "c")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    export_dcp(shardsafe.CheckpointReader(tmp_path / "c"), tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and is_dcp_checkpoint(tmp_path / "real")
    assert torch.equal(DcpSource(tmp_path / "real").read_tensor("t"), torch.arange(5.0))
