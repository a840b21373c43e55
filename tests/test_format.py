"""Format v1 conformance: the JSON Schema, the FORMAT.md reference reader, golden bytes,
and FORMAT.md against the code, so that the spec and the implementation cannot drift."""

from __future__ import annotations

import argparse
import collections
import copy
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import xxhash

import shardsafe
from shardsafe import (
    CheckpointReader,
    CorruptCheckpointError,
    ShardedObject,
    ShardedTensor,
    codec,
    location,
)
from shardsafe.checksum import ALGORITHM, DEFAULT_BLOCK_BYTES
from shardsafe.dtypes import dtype_name, itemsize, supported_dtypes
from shardsafe.engine import LARGE_ALIGN, LARGE_ITEM, SMALL_ALIGN
from shardsafe.format import _FILE_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest

ROOT = Path(__file__).resolve().parents[1]
FORMAT_MD = ROOT / "FORMAT.md"
GOLDEN = Path(__file__).resolve().parent / "golden"
READER_HEADING = "Reading a tensor with only json and numpy"
CODEC_TAG = re.compile(r'"(\$[a-z_]+)"')


def _load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_shardsafe_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_golden = _load_module(GOLDEN / "make_golden.py")


def load_schema() -> dict[str, Any]:
    text = (resources.files("shardsafe") / "schema" / "manifest.schema.json").read_text()
    return json.loads(text)


def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load_schema())


def read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST_NAME).read_bytes())


def schema_errors(manifest: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator().iter_errors(manifest)]


# --------------------------------------------------------------------------- checkpoints


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads included), or 0/1 for bool."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = int(np.prod(shape, dtype=np.int64))
    bits = torch.randint(0, 256, (n * itemsize(dtype),), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).reshape(shape)


def flat_pieces(
    key: str,
    full: torch.Tensor,
    cuts: list[int],
    rank_offsets: tuple[tuple[int, int, int], ...] = (),
) -> list[ShardedTensor]:
    """``full`` (one box) saved as the flat ranges between consecutive ``cuts``."""
    flat = full.reshape(-1)
    return [
        ShardedTensor.from_rank_offsets_flat(
            key, flat[a:b].clone(), tuple(full.shape), *rank_offsets, flattened_range=slice(a, b)
        )
        for a, b in pairwise(cuts)
    ]


def rich_state_dict() -> dict[str, Any]:
    """Every dtype, several kinds of pieces, objects and a common state using every tag."""
    gen = torch.Generator().manual_seed(1234)
    sd: dict[str, Any] = {}
    for dt in supported_dtypes():
        key = f"dtype.{dtype_name(dt)}"
        sd[key] = ShardedTensor.from_rank_offsets(key, random_tensor(dt, (3, 5), gen))
    # one 3-d box as three flat ranges whose ends are not row-aligned
    sd["flat3d"] = flat_pieces(
        "flat3d", random_tensor(torch.float32, (4, 5, 6), gen), [0, 7, 61, 120]
    )
    # rows 0-1 of a bfloat16 tensor as a box, rows 2-3 as two flat ranges of the second box
    bf = random_tensor(torch.bfloat16, (4, 3, 4), gen)
    sd["mixed.box"] = ShardedTensor.from_rank_offsets("mixed", bf[:2].clone(), (0, 0, 2))
    sd["mixed.flat"] = flat_pieces("mixed", bf[2:], [0, 5, 24], rank_offsets=((0, 1, 2),))
    # columns 4-7 of a [3, 8] tensor as two flat ranges: a box not contiguous in the tensor
    cols = random_tensor(torch.int64, (3, 8), gen)
    sd["cols.box"] = ShardedTensor.from_rank_offsets("cols", cols[:, :4].clone(), (1, 0, 2))
    sd["cols.flat"] = flat_pieces("cols", cols[:, 4:], [0, 5, 12], rank_offsets=((1, 1, 2),))
    grid = random_tensor(torch.int32, (4, 6), gen)
    sd["grid"] = [
        ShardedTensor.from_rank_offsets(
            "grid", grid[2 * r : 2 * r + 2, 3 * c : 3 * c + 3].clone(), (0, r, 2), (1, c, 2)
        )
        for r in range(2)
        for c in range(2)
    ]
    layers = random_tensor(torch.float16, (2, 7), gen)
    sd["layers"] = [
        ShardedTensor.from_rank_offsets("layers", layers[i].clone(), (0, i, 2), prepend_axis_num=1)
        for i in range(2)
    ]
    sd["scalar"] = ShardedTensor.from_rank_offsets("scalar", torch.tensor(2.5, dtype=torch.float64))
    sd["scalar.flat"] = ShardedTensor.from_rank_offsets_flat(
        "scalar.flat", torch.tensor([7], dtype=torch.int64), (), flattened_range=slice(0, 1)
    )
    sd["empty"] = ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3))
    # items of 64 KiB or more are 4 KiB-aligned
    sd["big"] = ShardedTensor.from_rank_offsets("big", random_tensor(torch.float32, (20000,), gen))
    sd["big.u8"] = ShardedTensor.from_rank_offsets(
        "big.u8", random_tensor(torch.uint8, (70001,), gen)
    )
    sd["rng"] = [
        ShardedObject(
            "rng",
            {"seed": i, "state": torch.arange(4, dtype=torch.uint8) + i, "raw": bytes([i])},
            (2,),
            (i,),
        )
        for i in range(2)
    ]
    sd["solo"] = ShardedObject("solo", (None, 1.5, [1, 2]), (), ())
    sd["common"] = {
        "step": 7,
        "lr": 0.25,
        "nan": float("nan"),
        "neg_inf": float("-inf"),
        "none": None,
        "flag": True,
        1: "int key",
        (1, "a"): "tuple key",
        None: "none key",
        "nested": {"t": (1, [2, {"x": b"bytes"}]), "empty": {}, "empty_t": ()},
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bools": np.array([True, False]),
        "tensor": torch.arange(3, dtype=torch.bfloat16),
        "np_float": np.float32(1.5),
        "np_int": np.int64(-3),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "args": argparse.Namespace(a=1, b="x"),
        "ordered": collections.OrderedDict(z=1, a=2),
        "complex": 1 + 2j,  # no tag of its own: stored with torch.save
        "with_sharded": [1, ShardedTensor.from_rank_offsets("in_list", torch.ones(2)), 3],
    }
    return sd


#: Saver settings; None: ``shardsafe.save`` with its defaults.
SAVES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "small-blocks-3-files": {"block_bytes": 1000, "files_per_rank": 3},
}


@pytest.fixture(scope="module", params=sorted(SAVES))
def rich_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"rich-{request.param}") / "ckpt"
    settings = SAVES[request.param]
    if settings is None:
        shardsafe.save(rich_state_dict(), path)
        return path
    saver = shardsafe.Saver(**settings)
    try:
        saver.save(rich_state_dict(), path, content_metadata={"n": [1, 2], "note": "x"})
    finally:
        saver.close()
    return path


@pytest.fixture(scope="module")
def golden_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("golden") / "ckpt"
    make_golden.save_golden(path)
    return path


# --------------------------------------------------------------------------- (a) schema


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_real_manifests_validate(rich_ckpt: Path) -> None:
    text = (rich_ckpt / MANIFEST_NAME).read_text()
    assert set(CODEC_TAG.findall(text)) == set(CODEC_TAG.findall(inspect.getsource(codec))), (
        "the checkpoint under test should use every value tag"
    )
    assert schema_errors(json.loads(text)) == []


def test_golden_manifest_validates(golden_ckpt: Path) -> None:
    assert schema_errors(read_manifest(golden_ckpt)) == []


def test_rich_checkpoint_round_trips(rich_ckpt: Path) -> None:
    """The manifest under test describes a checkpoint that reads back what was saved."""
    reader = CheckpointReader(rich_ckpt)
    assert reader.verify().ok
    common = reader.common()["common"]
    assert common[1] == "int key" and common[(1, "a")] == "tuple key" and common[None] == "none key"
    assert common["nested"] == {"t": (1, [2, {"x": b"bytes"}]), "empty": {}, "empty_t": ()}
    assert np.isnan(common["nan"]) and common["neg_inf"] == float("-inf")
    assert np.array_equal(common["array"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(common["args"], argparse.Namespace) and common["args"].b == "x"
    assert common["with_sharded"] == [1, None, 3]
    assert common["complex"] == 1 + 2j
    assert reader.read_object("rng/shard_1_2")["raw"] == b"\x01"
    assert reader.read_object("solo/shard__") == (None, 1.5, [1, 2])


def _rename_file(manifest: dict[str, Any], new: str) -> None:
    old = next(iter(manifest["files"]))
    manifest["files"][new] = manifest["files"].pop(old)
    extents = [p for t in manifest["tensors"].values() for p in t["pieces"]]
    for e in [*extents, *manifest["blobs"].values()]:
        if e["file"] == old:
            e["file"] = new


def _first_piece(manifest: dict[str, Any]) -> dict[str, Any]:
    return next(iter(manifest["tensors"].values()))["pieces"][0]


Mutation = Callable[[dict[str, Any]], None]

REFUSED_BY_BOTH: dict[str, Mutation] = {
    "version 2": lambda m: m.update(version=2),
    "other format": lambda m: m.update(format="safetensors"),
    "other checksum algorithm": lambda m: m["checksum"].update(algorithm="crc32"),
    "zero block size": lambda m: m["checksum"].update(block_bytes=0),
    "file name with ..": lambda m: _rename_file(m, "data/../../etc/passwd"),
    "absolute file name": lambda m: _rename_file(m, "/etc/passwd"),
    "hidden file name": lambda m: _rename_file(m, "data/.rank-00000-00.bin"),
    "file name in a subdirectory": lambda m: _rename_file(m, "data/sub/rank-00000-00.bin"),
    "file name outside data/": lambda m: _rename_file(m, "rank-00000-00.bin"),
    "unknown dtype": lambda m: next(iter(m["tensors"].values())).update(dtype="float128"),
    "flat of three": lambda m: _first_piece(m).update(flat=[0, 1, 2]),
    "negative offset": lambda m: _first_piece(m).update(offset=[-1]),
    "missing tensors": lambda m: m.pop("tensors"),
    "missing files": lambda m: m.pop("files"),
}

REFUSED_BY_SCHEMA: dict[str, Mutation] = {
    "non-hex checksum": lambda m: _first_piece(m).update(checksums=["XYZ"]),
    "unknown value tag": lambda m: m.update(common={"$pickle": "c.0"}),
    "two-key tagged value": lambda m: m.update(common={"$dict": [], "$tuple": []}),
    "dict entry not a pair": lambda m: m.update(common={"$dict": [["a"]]}),
    "unknown top-level field": lambda m: m.update(extra=1),
    "unknown piece field": lambda m: _first_piece(m).update(stride=[1]),
}


def _mutated(golden_ckpt: Path, mutate: Mutation) -> dict[str, Any]:
    manifest = copy.deepcopy(read_manifest(golden_ckpt))
    mutate(manifest)
    return manifest


@pytest.mark.parametrize("case", sorted(REFUSED_BY_BOTH))
def test_schema_and_parser_refuse(golden_ckpt: Path, case: str) -> None:
    manifest = _mutated(golden_ckpt, REFUSED_BY_BOTH[case])
    assert schema_errors(manifest)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(manifest)


@pytest.mark.parametrize("case", sorted(REFUSED_BY_SCHEMA))
def test_schema_refuses(golden_ckpt: Path, case: str) -> None:
    assert schema_errors(_mutated(golden_ckpt, REFUSED_BY_SCHEMA[case]))


SUBTLE_REFUSALS: dict[str, Mutation] = {
    "file name with a trailing newline": lambda m: _rename_file(m, "data/rank-00000-00.bin\n"),
    "true as the version": lambda m: m.update(version=True),
}


@pytest.mark.parametrize("case", sorted(SUBTLE_REFUSALS))
def test_schema_and_parser_refuse_subtle_cases(golden_ckpt: Path, case: str) -> None:
    manifest = _mutated(golden_ckpt, SUBTLE_REFUSALS[case])
    assert schema_errors(manifest)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(manifest)


def test_data_files_follow_the_layout_rules(rich_ckpt: Path) -> None:
    """Alignment, zero padding, sizes and block checksums, recomputed independently."""
    manifest = read_manifest(rich_ckpt)
    block = manifest["checksum"]["block_bytes"]
    extents: dict[str, list[dict[str, Any]]] = {name: [] for name in manifest["files"]}
    for tensor in manifest["tensors"].values():
        for piece in tensor["pieces"]:
            extents[piece["file"]].append(piece)
    for blob in manifest["blobs"].values():
        extents[blob["file"]].append(blob)
    assert sorted(os.listdir(rich_ckpt)) == ["data", MANIFEST_NAME]
    assert sorted(f"data/{n}" for n in os.listdir(rich_ckpt / "data")) == sorted(manifest["files"])
    assert os.listdir(rich_ckpt.parent) == [rich_ckpt.name]  # no tmp, old or lock sibling
    for name, items in extents.items():
        raw = (rich_ckpt / name).read_bytes()
        assert len(raw) == manifest["files"][name]["nbytes"]
        pos = 0
        for e in sorted(items, key=lambda e: (e["byte_offset"], e["nbytes"])):
            align = 4096 if e["nbytes"] >= 65536 else 64
            start = pos + (-pos) % align
            assert e["byte_offset"] == start, (name, e)
            assert raw[pos:start] == bytes(start - pos)
            data = raw[start : start + e["nbytes"]]
            expected = [
                xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, len(data), block)
            ]
            assert e["checksums"] == expected
            pos = start + e["nbytes"]
        assert pos == len(raw)


# --------------------------------------------------------------------------- (b) reference reader


def reference_reader_source() -> str:
    """The python code block under the reference-reader heading of FORMAT.md."""
    text = FORMAT_MD.read_text()
    match = re.search(rf"^##+ {re.escape(READER_HEADING)}\n(.*?)(?=^##? )", text, re.S | re.M)
    assert match, f"FORMAT.md has no section {READER_HEADING!r}"
    blocks = re.findall(r"^```python\n(.*?)^```", match.group(1), re.S | re.M)
    assert len(blocks) == 1, "the section must hold exactly one python code block"
    return blocks[0]


DRIVER = """
import json as _json
import sys as _sys

_ckpt, _out = _sys.argv[1], _sys.argv[2]
with open(f"{_ckpt}/manifest.json", "rb") as _f:
    _keys = sorted(_json.load(_f)["tensors"])
_arrays = [read_tensor(_ckpt, _k) for _k in _keys]
_forbidden = sorted(m for m in ("torch", "shardsafe", "xxhash") if m in _sys.modules)
if _forbidden:
    raise SystemExit(f"the reference reader imported {_forbidden}")
np.savez(_out, *_arrays)
with open(_out + ".keys.json", "w") as _f:
    _json.dump(_keys, _f)
"""


def as_raw_numpy(t: torch.Tensor) -> np.ndarray:
    """What the reference reader returns: bfloat16 and float8 as their raw bits."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    elif t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t = t.view(torch.uint8)
    return t.numpy()


def run_reference_reader(ckpt: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    script = tmp_path / "reference_reader.py"
    script.write_text(reference_reader_source() + DRIVER)
    out = tmp_path / "tensors.npz"
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(ckpt), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    keys = json.loads(Path(f"{out}.keys.json").read_text())
    with np.load(out) as npz:
        return {k: npz[f"arr_{i}"] for i, k in enumerate(keys)}


def assert_reference_reader_matches(ckpt: Path, tmp_path: Path) -> None:
    got = run_reference_reader(ckpt, tmp_path)
    reader = CheckpointReader(ckpt)
    assert sorted(got) == sorted(reader.tensor_keys())
    for key, array in got.items():
        expected = as_raw_numpy(reader.read_tensor(key))
        assert array.dtype == expected.dtype, key
        assert array.shape == expected.shape, key
        assert array.tobytes() == expected.tobytes(), key


def test_reference_reader_reproduces_every_tensor(rich_ckpt: Path, tmp_path: Path) -> None:
    assert_reference_reader_matches(rich_ckpt, tmp_path)


def test_reference_reader_reads_the_golden_checkpoint(tmp_path: Path) -> None:
    assert_reference_reader_matches(GOLDEN / "v1", tmp_path)


# --------------------------------------------------------------------------- (c) golden bytes


def assert_matches_golden(ckpt: Path) -> None:
    """The manifest, less its volatile fields, and every data file equal the pinned ones."""
    raw = (ckpt / MANIFEST_NAME).read_bytes()
    # the manifest is written as compact JSON, so comparing values and key order pins its bytes
    assert raw == json.dumps(json.loads(raw), separators=(",", ":"), allow_nan=False).encode()
    created = json.loads(raw)["created"]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z", created)
    assert json.loads(raw)["library_version"] == shardsafe.__version__
    stable = make_golden.stable_manifest(raw)
    pinned = json.loads((GOLDEN / "v1" / MANIFEST_NAME).read_text())
    assert stable == pinned
    assert json.dumps(stable) == json.dumps(pinned), "same fields, different order"
    names = sorted(f"data/{n}" for n in os.listdir(GOLDEN / "v1" / "data"))
    assert sorted(stable["files"]) == names
    assert sorted(f"data/{n}" for n in os.listdir(ckpt / "data")) == names
    for name in names:
        assert (ckpt / name).read_bytes() == (GOLDEN / "v1" / name).read_bytes(), name


def test_golden_bytes_are_pinned(golden_ckpt: Path) -> None:
    assert_matches_golden(golden_ckpt)


def test_manifest_digest_follows_format_md(golden_ckpt: Path) -> None:
    """The file ends with its digest, the xxh3_64 of the bytes before that member plus "}",
    so it covers every other byte; FORMAT.md's snippet checks it the same way."""
    raw = (golden_ckpt / MANIFEST_NAME).read_bytes()
    head, tail = raw.rsplit(b',"manifest_digest":"', 1)
    assert re.fullmatch(rb'[0-9a-f]{16}"\}', tail)
    assert xxhash.xxh3_64_hexdigest(head + b"}") == tail[:16].decode()
    assert Manifest.loads(raw).digest == tail[:16].decode()
    body = json.dumps(Manifest.loads(raw).to_json(), separators=(",", ":")).encode()
    assert head + b"}" == body  # what the digest covers: the manifest without it
    text = FORMAT_MD.read_text()
    snippet = re.search(r"```python\n(import json, re, xxhash\n.*?)```", text, re.S)
    assert snippet is not None
    code = snippet.group(1).replace('"ckpt/manifest.json"', repr(str(golden_ckpt / MANIFEST_NAME)))
    exec(code, {})
    (golden_ckpt / MANIFEST_NAME).write_bytes(raw.replace(b'["step",7]', b'["step",8]'))
    try:
        with pytest.raises(AssertionError):
            exec(code, {})
    finally:
        (golden_ckpt / MANIFEST_NAME).write_bytes(raw)


def test_async_save_writes_the_golden_bytes(tmp_path: Path) -> None:
    make_golden.save_golden(tmp_path / "ckpt", asynchronous=True)
    assert_matches_golden(tmp_path / "ckpt")


def test_golden_checkpoint_still_reads() -> None:
    """Today's reader reads the pinned v1 checkpoint into the values it was saved from."""
    reader = CheckpointReader(GOLDEN / "v1")
    assert reader.manifest.digest is None  # pinned as written before manifests had a digest
    assert reader.verify().ok
    sd = make_golden.golden_state_dict()
    assert torch.equal(reader.read_tensor("matrix"), sd["matrix"].data)
    split = torch.cat([sd["split.0"].data, sd["split.1"].data]).reshape(3, 4)
    assert torch.equal(reader.read_tensor("split"), split)
    assert torch.equal(reader.read_tensor("half"), sd["half"].data)
    assert reader.read_object("obj/shard_0_1") == {"a": 1}
    assert reader.common() == {"step": 7}


# --------------------------------------------------------------------------- (d) spec vs code


def _unmentioned(text: str, names: set[str]) -> set[str]:
    return {n for n in names if f"`{n}`" not in text}


def test_format_md_names_every_manifest_field(rich_ckpt: Path) -> None:
    manifest = Manifest.loads((rich_ckpt / MANIFEST_NAME).read_bytes()).to_json()
    text = FORMAT_MD.read_text()
    assert _unmentioned(text, set(manifest)) == set(), (
        "top-level manifest keys missing from FORMAT.md"
    )
    tensor = next(iter(manifest["tensors"].values()))
    nested = {
        *manifest["checksum"],
        *next(iter(manifest["files"].values())),
        *tensor,
        *tensor["pieces"][0],
        *next(iter(manifest["objects"].values())),
        *next(iter(manifest["blobs"].values())),
    }
    assert _unmentioned(text, nested) == set(), "manifest fields missing from FORMAT.md"
    assert load_schema()["required"] == list(manifest), (
        "schema's required fields differ from to_json()"
    )


def test_format_md_and_schema_name_every_dtype() -> None:
    names = {dtype_name(d) for d in supported_dtypes()}
    assert _unmentioned(FORMAT_MD.read_text(), names) == set()
    assert names <= set(load_schema()["$defs"]["dtype"]["enum"])


def test_format_md_and_schema_name_every_codec_tag() -> None:
    tags = set(CODEC_TAG.findall(inspect.getsource(codec)))
    assert {"$dict", "$tuple", "$tensor", "$torch_save"} <= tags
    assert _unmentioned(FORMAT_MD.read_text(), tags) == set()
    schema_tags = load_schema()["$defs"]["tagged"]["propertyNames"]["enum"]
    assert set(schema_tags) == tags
    assert set(load_schema()["$defs"]["tagged"]["properties"]) == tags


def test_format_md_states_the_constants() -> None:
    text = FORMAT_MD.read_text()
    assert text.startswith(f"# shardsafe checkpoint format, version {FORMAT_VERSION}\n")
    assert f"`{_FILE_NAME.pattern}`" in text
    assert load_schema()["$defs"]["file_name"]["pattern"] == _FILE_NAME.pattern
    for mark in (location.TMP_MARK, location.OLD_MARK, location.LOCK_SUFFIX):
        assert mark in text, mark
    for number in (SMALL_ALIGN, LARGE_ALIGN, LARGE_ITEM, DEFAULT_BLOCK_BYTES):
        assert re.search(rf"\b{number}\b", text), number
    assert f'"{ALGORITHM}"' in text
    assert "## Appendix: PyTorch DCP and Megatron-Core torch_dist layout" in text
