"""Every bad input to the core, in one process: the exception type and what its message names.

Messages must name the key, the file and the ranks involved and say what to do; each error
type also subclasses the built-in exception it means.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from manifests import sealed

import shardsafe
import shardsafe.codec
from shardsafe import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReader,
    CorruptCheckpointError,
    DistributedError,
    IncompatibleRequestError,
    IncompleteCheckpointError,
    MissingKeyError,
    ShardedObject,
    ShardedTensor,
    StrictHandling,
    ValidationError,
)
from shardsafe.cli import main as cli_main
from shardsafe.errors import UnsafeObjectError
from shardsafe.storage.local import LocalStorage

ST = ShardedTensor
DATA = "data/rank-00000-00.bin"
W = torch.arange(16.0).reshape(4, 4)
B = torch.arange(8, dtype=torch.int64)


def _full_sd() -> dict:
    return {
        "w": ST.from_rank_offsets("w", W.clone()),
        "b": ST.from_rank_offsets("b", B.clone()),
        "rng": ShardedObject("rng", {"seed": 1}, (1,), (0,)),
        "step": 7,
    }


def _template() -> dict:
    return {
        "w": ST.from_rank_offsets("w", torch.zeros(4, 4)),
        "b": ST.from_rank_offsets("b", torch.zeros(8, dtype=torch.int64)),
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ck"
    shardsafe.save(_full_sd(), path)
    return path


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, obj) -> None:
    (path / "manifest.json").write_bytes(sealed(obj))


def _piece(path, key: str) -> dict:
    return _manifest(path)["tensors"][key]["pieces"][0]


def _flip_byte(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _siblings(parent) -> list[str]:
    return sorted(os.listdir(parent))


# --------------------------------------------------------------------------- exception tree


def test_error_types_subclass_the_builtins_they_mean():
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(IncompleteCheckpointError, CheckpointNotFoundError)
    assert issubclass(CheckpointExistsError, FileExistsError)
    assert issubclass(CorruptCheckpointError, ValueError)
    assert issubclass(ValidationError, ValueError)
    assert issubclass(IncompatibleRequestError, ValueError)
    assert issubclass(MissingKeyError, KeyError)
    assert issubclass(MissingKeyError, IncompatibleRequestError)
    for cls in (
        CheckpointNotFoundError,
        CheckpointExistsError,
        CorruptCheckpointError,
        ValidationError,
        MissingKeyError,
    ):
        assert issubclass(cls, CheckpointError)
    # the built-in bases must not mangle the message (no errno tuple, no repr quotes)
    assert str(MissingKeyError("no key 'x'")) == "no key 'x'"
    assert str(CheckpointNotFoundError("no checkpoint at /p")) == "no checkpoint at /p"
    assert str(CheckpointExistsError("/p exists")) == "/p exists"


# --------------------------------------------------------------------------- ShardedTensor construction


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (
            lambda: ST.from_rank_offsets("w.bad", torch.zeros(2, 4), (2, 0, 2)),
            ["axis 2", "out of range"],
        ),
        (
            lambda: ST.from_rank_offsets("w.bad", torch.zeros(2, 4), (0, 0, 2), (0, 1, 2)),
            ["axis 0", "repeated"],
        ),
        (lambda: ST.from_rank_offsets("w.bad", torch.zeros(2, 4), (0, 2, 2)), ["rank 2", "[0, 2)"]),
        (lambda: ST.from_rank_offsets("w.bad", torch.zeros(2, 4), (0, -1, 2)), ["rank -1"]),
        (
            lambda: ST.from_rank_offsets("w.bad", torch.zeros(2, 4), (0, 1)),
            ["(axis, rank_on_axis, fragments_on_axis)"],
        ),
        (
            lambda: ST.from_rank_offsets_flat(
                "w.bad", torch.zeros(5), (2, 4), (0, 0, 2), flattened_range=slice(0, 4)
            ),
            ["flattened data", "4 elements", "(5,)"],
        ),
        (
            lambda: ST.from_rank_offsets_flat(
                "w.bad", torch.zeros(20), (2, 4), flattened_range=slice(0, 20)
            ),
            ["flattened_range", "8 elements"],
        ),
        (
            lambda: ST.from_rank_offsets_flat(
                "w.bad", torch.zeros(2), (2, 4), flattened_range=slice(0, 4, 2)
            ),
            ["step-1"],
        ),
        (
            lambda: ST.from_rank_offsets_flat(
                "w.bad", torch.zeros(2, 2), (2, 4), flattened_range=slice(0, 4)
            ),
            ["flattened data must be 1-D"],
        ),
        (
            lambda: ST("w.bad", torch.zeros(3, 4), torch.float32, (2, 4), (4, 4), (0, 0)),
            ["data shape (3, 4)", "local_shape (2, 4)"],
        ),
        (
            lambda: ST("w.bad", torch.zeros(2, 4), torch.float16, (2, 4), (4, 4), (0, 0)),
            ["torch.float32", "torch.float16"],
        ),
        (
            lambda: ST.from_global_offset("w.bad", torch.zeros(3, 4), (4, 4), (2, 0)),
            ["outside the global shape (4, 4)", "(2, 0)"],
        ),
        (
            lambda: ST.from_global_offset("w.bad", torch.zeros(3, 4), (4, 4), (0,)),
            ["global_offset (0,)"],
        ),
        (
            lambda: ST.from_global_offset("w.bad", torch.zeros(3, 4), (4, 4, 1), (0, 0, 0)),
            ["global_shape (4, 4, 1)"],
        ),
        (
            lambda: ShardedObject("obj.bad", 1, (2,), (2,)),
            ["global_offset (2,)", "global_shape (2,)"],
        ),
    ],
    ids=[
        "axis-out-of-range",
        "axis-repeated",
        "rank-too-big",
        "rank-negative",
        "offset-not-a-triple",
        "flat-data-size",
        "flat-range-outside-box",
        "flat-range-step",
        "flat-data-not-1d",
        "shape-vs-local-shape",
        "data-dtype-vs-dtype",
        "box-outside-global",
        "offset-rank",
        "shape-rank",
        "object-cell-outside-grid",
    ],
)
def test_construction_errors_name_the_key(make, names):
    with pytest.raises(ValidationError) as info:
        make()
    msg = str(info.value)
    assert "w.bad" in msg or "obj.bad" in msg
    for part in names:
        assert part in msg, (part, msg)


def test_empty_key_refused():
    with pytest.raises(ValidationError, match="non-empty string"):
        ST.from_rank_offsets("", torch.zeros(2))
    with pytest.raises(ValidationError, match="non-empty string"):
        ShardedObject("", 1, (1,), (0,))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ST.from_rank_offsets("w.bad", torch.zeros(4), flattened_range=slice(0, 2)),
        lambda: ST.from_global_offset(
            "w.bad", torch.zeros(4), (8,), (0,), flattened_range=slice(0, 4)
        ),
    ],
    ids=["from_rank_offsets", "from_global_offset"],
)
def test_flattened_range_misuse_is_a_validation_error(make):
    with pytest.raises(ValidationError, match=r"w\.bad"):
        make()


# --------------------------------------------------------------------------- save-side validation


def _assert_nothing_written(tmp_path):
    assert _siblings(tmp_path) == [], "a failed save left files behind"


@pytest.mark.parametrize(
    ("sd", "names"),
    [
        (
            {
                "a": ST.from_rank_offsets("w", torch.zeros(4)),
                "b": ST.from_rank_offsets("w", torch.zeros(4)),
            },
            ["'w'", "main replica", "rank 0", "replica_id"],
        ),
        (
            {
                "a": ST.from_global_offset("w", torch.zeros(3, 4), (4, 4), (0, 0)),
                "b": ST.from_global_offset("w", torch.zeros(2, 4), (4, 4), (2, 0)),
            },
            ["'w'", "overlaps", "(0, 0)", "(2, 0)", "rank 0", "exactly one piece"],
        ),
        (
            {"a": ST.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2))},
            ["'w'", "8 of 16", "index (2, 0)", "missing its piece"],
        ),
        (
            {
                "a": ST.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2)),
                "b": ST.from_global_offset("w", torch.zeros(2, 4), (6, 4), (2, 0)),
            },
            ["'w'", "disagree", "[4, 4]", "[6, 4]"],
        ),
        (
            {
                "a": ST.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2)),
                "b": ST.from_rank_offsets("w", torch.zeros(2, 4, dtype=torch.float16), (0, 1, 2)),
            },
            ["'w'", "disagree", "float32", "float16"],
        ),
        (
            {"a": ST.from_rank_offsets("w", torch.zeros(4), replica_id=1)},
            ["'w'", "no main replica", "rank 0"],
        ),
        (
            {"o": ShardedObject("rng", 1, (3,), (0,)), "p": ShardedObject("rng", 2, (3,), (1,))},
            ["'rng'", "2 of the 3 cells", "main replica"],
        ),
        (
            {"o": ShardedObject("rng", 1, (2,), (0,)), "p": ShardedObject("rng", 2, (3,), (1,))},
            ["'rng'", "disagree", "[2]", "[3]"],
        ),
        (
            {"o": ShardedObject("rng", 1, (1,), (0,)), "p": ShardedObject("rng", 2, (1,), (0,))},
            ["'rng/shard_0_1'", "rank 0", "main replica"],
        ),
        (
            {"w": ST("w", None, torch.float32, (4,), (4,), (0,))},
            ["'w'", "without data"],
        ),
    ],
    ids=[
        "two-mains",
        "boxes-overlap",
        "gap",
        "shape-disagrees",
        "dtype-disagrees",
        "no-main",
        "object-grid-incomplete",
        "object-grid-disagrees",
        "object-two-mains",
        "no-data",
    ],
)
def test_invalid_sharding_refused_before_writing(tmp_path, sd, names):
    with pytest.raises(ValidationError) as info:
        shardsafe.save(sd, tmp_path / "ck")
    msg = str(info.value)
    for part in names:
        assert part in msg, (part, msg)
    _assert_nothing_written(tmp_path)
    # the same path takes a correct save afterwards
    shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(4))}, tmp_path / "ck")
    assert torch.equal(CheckpointReader(tmp_path / "ck").read_tensor("w"), torch.ones(4))
    assert _siblings(tmp_path) == ["ck"]


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        ({"lock": threading.Lock()}, ["_thread.lock", "cannot store"]),
        ({"fn": lambda: 1}, ["function", "cannot store"]),
    ],
    ids=["lock", "lambda"],
)
def test_unpicklable_common_state_refused_and_cleaned_up(tmp_path, bad, names):
    with pytest.raises(CheckpointError) as info:
        shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(4)), **bad}, tmp_path / "ck")
    for part in names:
        assert part in str(info.value), (part, str(info.value))
    _assert_nothing_written(tmp_path)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_refused(tmp_path):
    with pytest.raises(CheckpointError) as info:
        shardsafe.save(
            {"w": ST.from_rank_offsets("w", torch.zeros(4, dtype=torch.complex32))}, tmp_path / "ck"
        )
    assert "complex32" in str(info.value) and "supported" in str(info.value)
    _assert_nothing_written(tmp_path)


def test_data_replaced_after_construction_is_validated_on_save(tmp_path):
    st = ST.from_rank_offsets("w", torch.zeros(4, 4))
    st.data = st.data.double()
    with pytest.raises(ValidationError) as info:
        shardsafe.save({"w": st}, tmp_path / "ck")
    msg = str(info.value)
    assert "w: data dtype torch.float64" in msg and "declared dtype torch.float32" in msg
    st.data = torch.zeros(3, 4)
    with pytest.raises(
        ValidationError, match=r"w: data shape \(3, 4\) differs from local_shape \(4, 4\)"
    ):
        shardsafe.save({"w": st}, tmp_path / "ck")
    _assert_nothing_written(tmp_path)


def test_distributed_error_names_each_failing_rank_once():
    from shardsafe.dist import error_record, raise_for

    records = [
        error_record(ValidationError("'w': no data")),
        None,
        error_record(TypeError("bad dtype")),
    ]
    with pytest.raises(DistributedError) as info:
        raise_for(records, "save planning")
    msg = str(info.value)
    assert "save planning failed on ranks 0, 2" in msg and "rank 1" not in msg
    assert "rank 0: ValidationError: 'w': no data" in msg
    assert "rank 2: TypeError: bad dtype" in msg and "TypeError: TypeError" not in msg
    assert set(info.value.rank_errors) == {0, 2}


# --------------------------------------------------------------------------- existing target, overwrite, locks


def test_existing_path_refused_without_overwrite(ckpt):
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointExistsError) as info:
        shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(4, 4))}, ckpt)
    assert isinstance(info.value, FileExistsError)
    msg = str(info.value)
    assert str(ckpt) in msg and "overwrite=True" in msg
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert _siblings(ckpt.parent) == ["ck"]
    assert torch.equal(shardsafe.load(_template(), ckpt)["w"], W)


def test_overwrite_replaces_and_leaves_no_siblings(ckpt):
    shardsafe.save(
        {"w": ST.from_rank_offsets("w", torch.ones(2, 2)), "step": 8}, ckpt, overwrite=True
    )
    assert _siblings(ckpt.parent) == ["ck"]
    reader = CheckpointReader(ckpt)
    assert reader.tensor_keys() == ["w"] and reader.object_keys() == []
    assert torch.equal(reader.read_tensor("w"), torch.ones(2, 2))
    assert reader.common() == {"step": 8}
    assert reader.verify().ok


def test_overwrite_into_missing_path_is_a_plain_save(tmp_path):
    shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ck", overwrite=True)
    assert _siblings(tmp_path) == ["ck"]


def _lock(tmp_path):
    return tmp_path / ".ck.shardsafe-lock"


@pytest.mark.parametrize("host", ["self", "otherhost"])
def test_lock_of_a_live_or_foreign_save_refused(tmp_path, host):
    lock = _lock(tmp_path)
    hostname = socket.gethostname() if host == "self" else "some-other-host.invalid"
    lock.write_text(f"{hostname} {os.getpid()} {time.time():.0f}")
    stop = threading.Event()

    def renew() -> None:  # a save on another host shows it is alive by renewing its lease
        while not stop.wait(0.5):
            fresh = tmp_path / "renewed-lock"  # replaced whole, as a save renews a lease
            fresh.write_text(f"{hostname} {os.getpid()} {time.time():.0f}")
            os.replace(fresh, lock)

    renewing = threading.Thread(target=renew)
    if host == "otherhost":
        renewing.start()
    try:
        with pytest.raises(CheckpointExistsError) as info:
            shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ck")
    finally:
        stop.set()
        if renewing.is_alive():
            renewing.join()
    msg = str(info.value)
    assert str(lock) in msg and "another save" in msg and "delete that lock file" in msg
    assert lock.exists(), "the lock of a running save must not be removed"
    assert _siblings(tmp_path) == [".ck.shardsafe-lock"]


def test_stale_lock_of_a_dead_process_broken(tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()
    _lock(tmp_path).write_text(f"{socket.gethostname()} {proc.pid} 0")
    shardsafe.save({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ck")
    assert _siblings(tmp_path) == ["ck"]
    assert torch.equal(CheckpointReader(tmp_path / "ck").read_tensor("w"), torch.ones(2))


# --------------------------------------------------------------------------- finding the checkpoint


def test_path_does_not_exist(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as info:
        shardsafe.load(_template(), tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert not isinstance(info.value, IncompleteCheckpointError)
    assert f"no checkpoint at {tmp_path / 'nope'}" in str(info.value)
    for fn in (shardsafe.load_metadata, CheckpointReader, shardsafe.load_content_metadata):
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
            fn(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        shardsafe.load_metadata(tmp_path / "f")


def test_directory_without_manifest(ckpt, tmp_path):
    (ckpt / "manifest.json").unlink()
    with pytest.raises(IncompleteCheckpointError) as info:
        shardsafe.load(_template(), ckpt)
    msg = str(info.value)
    assert (
        str(ckpt) in msg
        and "manifest.json" in msg
        and "never committed" in msg
        and "earlier checkpoint" in msg
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError) as info2:
        shardsafe.load_metadata(empty)
    assert not isinstance(info2.value, IncompleteCheckpointError)
    assert "not a shardsafe checkpoint" in str(info2.value) and "manifest.json" in str(info2.value)


def test_uncommitted_sibling_left_by_a_crash(tmp_path):
    shardsafe.save(_full_sd(), tmp_path / "done")
    os.rename(tmp_path / "done", tmp_path / ".ck.shardsafe-tmp-0123456789ab")
    with pytest.raises(IncompleteCheckpointError) as info:
        shardsafe.load(_template(), tmp_path / "ck")
    msg = str(info.value)
    assert (
        ".ck.shardsafe-tmp-0123456789ab" in msg
        and "uncommitted save" in msg
        and "earlier checkpoint" in msg
    )
    # a crashed save's leftovers do not block a new save into the same name
    shardsafe.save(_full_sd(), tmp_path / "ck")
    assert torch.equal(shardsafe.load(_template(), tmp_path / "ck")["w"], W)


# --------------------------------------------------------------------------- malformed manifests


@pytest.mark.parametrize(
    ("mutate", "names"),
    [
        (lambda m: b"{not json", ["is not valid JSON", "corrupt"]),
        (lambda m: b"", ["is not valid JSON"]),
        (lambda m: b"\xff\xfe", ["is not valid JSON"]),
        (lambda m: b"[1, 2]", ["not a JSON object"]),
        (lambda m: {**m, "format": "torch_dist"}, ["format is 'torch_dist'", "'shardsafe'"]),
        (lambda m: {k: v for k, v in m.items() if k != "format"}, ["format is None"]),
        (lambda m: {**m, "version": 2}, ["format version 2", "upgrade shardsafe"]),
        (lambda m: {**m, "version": "1"}, ["format version '1'"]),
        (lambda m: {k: v for k, v in m.items() if k != "tensors"}, ["missing field 'tensors'"]),
        (
            lambda m: {**m, "checksum": {"algorithm": "md5", "block_bytes": 4}},
            ["unknown algorithm 'md5'"],
        ),
        (lambda m: {**m, "world_size": -1}, ["'world_size'", "non-negative"]),
        (
            lambda m: {**m, "tensors": {"w": {**m["tensors"]["w"], "dtype": "float128"}}},
            ["unknown dtype 'float128'", "tensor 'w'"],
        ),
        (
            lambda m: {**m, "tensors": {"w": {**m["tensors"]["w"], "shape": [3, 4]}}},
            ["tensor 'w' piece 0", "does not fit"],
        ),
        (
            lambda m: {
                **m,
                "tensors": {
                    "w": {
                        **m["tensors"]["w"],
                        "pieces": [
                            {**m["tensors"]["w"]["pieces"][0], "nbytes": 8, "checksums": ["0"]}
                        ],
                    }
                },
            },
            ["tensor 'w' piece 0", "holds 8 bytes", "need 64"],
        ),
        (
            lambda m: {
                **m,
                "tensors": {
                    "w": {
                        **m["tensors"]["w"],
                        "pieces": [{**m["tensors"]["w"]["pieces"][0], "byte_offset": 10**9}],
                    }
                },
            },
            ["tensor 'w' piece 0", "beyond the end of data/rank-00000-00.bin"],
        ),
        (
            lambda m: {
                **m,
                "tensors": {
                    "w": {
                        **m["tensors"]["w"],
                        "pieces": [{**m["tensors"]["w"]["pieces"][0], "file": "data/other.bin"}],
                    }
                },
            },
            ["tensor 'w' piece 0", "data/other.bin", "files table does not list"],
        ),
    ],
    ids=[
        "not-json",
        "empty",
        "not-utf8",
        "not-an-object",
        "wrong-format",
        "no-format",
        "future-version",
        "version-as-string",
        "missing-field",
        "unknown-checksum",
        "negative-world",
        "unknown-dtype",
        "box-outside-shape",
        "extent-size",
        "extent-beyond-file",
        "extent-unlisted-file",
    ],
)
def test_malformed_manifest_is_corrupt(ckpt, mutate, names):
    new = mutate(_manifest(ckpt))
    (ckpt / "manifest.json").write_bytes(new if isinstance(new, bytes) else sealed(new))
    for fn in (
        lambda: shardsafe.load(_template(), ckpt),
        lambda: shardsafe.load_metadata(ckpt),
        lambda: CheckpointReader(ckpt),
    ):
        with pytest.raises(CorruptCheckpointError) as info:
            fn()
        msg = str(info.value)
        assert str(ckpt / "manifest.json") in msg, msg
        for part in names:
            assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        "../secret.bin",
        "/etc/passwd",
        "data/../../secret.bin",
        "data/x/../../../secret.bin",
        "data/.hidden",
        "data\\..\\secret.bin",
    ],
)
@pytest.mark.parametrize("where", ["files", "extent"])
def test_data_file_name_escaping_the_directory_refused(ckpt, tmp_path, monkeypatch, bad, where):
    (tmp_path / "secret.bin").write_bytes(bytes(4096))
    m = _manifest(ckpt)
    if where == "files":
        m["files"][bad] = m["files"][DATA]
    else:
        m["files"] = {bad: m["files"][DATA]}
        for t in m["tensors"].values():
            for p in t["pieces"]:
                p["file"] = bad
        for b in m["blobs"].values():
            b["file"] = bad
    _write_manifest(ckpt, m)

    touched: list[str] = []
    for name in ("read_bytes", "read_into", "open_read", "size", "exists"):
        original = getattr(LocalStorage, name)

        def spy(self, rel, *args, _original=original, **kw):
            touched.append(os.path.normpath(self.path(rel)))
            return _original(self, rel, *args, **kw)

        monkeypatch.setattr(LocalStorage, name, spy)
    for fn in (lambda: shardsafe.load(_template(), ckpt), lambda: CheckpointReader(ckpt).verify()):
        with pytest.raises(CorruptCheckpointError) as info:
            fn()
        msg = str(info.value)
        assert "is not allowed" in msg and "tampered" in msg and str(ckpt / "manifest.json") in msg
        assert bad[:100] in msg or repr(bad)[1:-1] in msg
    outside = [p for p in touched if not p.startswith(str(ckpt) + os.sep)]
    assert outside == [], f"read outside the checkpoint: {outside}"
    assert touched and all(p == str(ckpt / "manifest.json") for p in touched), touched


# --------------------------------------------------------------------------- damaged data files


def test_flipped_byte_is_a_checksum_mismatch_naming_key_and_file(ckpt):
    p = _piece(ckpt, "w")
    _flip_byte(ckpt / p["file"], p["byte_offset"] + 5)
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load(_template(), ckpt)
    msg = str(info.value)
    assert "tensor 'w'" in msg and "checksum mismatch" in msg and DATA in msg
    assert "restore this checkpoint" in msg or "earlier one" in msg
    # other keys still load; the damaged one fails through every API
    out = shardsafe.load({"b": ST.from_rank_offsets("b", torch.zeros(8, dtype=torch.int64))}, ckpt)
    assert torch.equal(out["b"], B)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w'.*checksum mismatch"):
        CheckpointReader(ckpt).read_tensor("w")
    report = CheckpointReader(ckpt).verify()
    assert not report.ok and any(
        "tensor 'w'" in p and "checksum mismatch" in p for p in report.problems
    )


def test_flipped_byte_in_a_common_state_blob(tmp_path):
    path = tmp_path / "ck"
    # a tensor kept in common state (CoordinatorObject) is stored as a blob
    shardsafe.save({"t": shardsafe.CoordinatorObject(torch.arange(4)), "step": 1}, path)
    ((blob_id, extent),) = _manifest(path)["blobs"].items()
    _flip_byte(path / extent["file"], extent["byte_offset"])
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load({}, path)
    msg = str(info.value)
    assert f"blob {blob_id!r}" in msg and "checksum mismatch" in msg and extent["file"] in msg
    assert "common state" in msg or "restore" in msg


def test_truncated_data_file(ckpt):
    p = _piece(ckpt, "w")
    os.truncate(ckpt / DATA, p["byte_offset"] + 10)
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load(_template(), ckpt)
    msg = str(info.value)
    assert "tensor 'w'" in msg and "truncated" in msg and DATA in msg
    assert "earlier" in msg or "restore" in msg
    report = CheckpointReader(ckpt).verify()
    assert any(DATA in q and "truncated" in q for q in report.problems)


def test_deleted_data_file(ckpt):
    (ckpt / DATA).unlink()
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load(_template(), ckpt)
    msg = str(info.value)
    assert DATA in msg and "missing" in msg and "tensor 'w'" in msg
    assert "earlier" in msg or "restore" in msg
    assert any(DATA in q and "missing" in q for q in CheckpointReader(ckpt).verify().problems)
    # a request that touches no data file still works
    assert shardsafe.load({"rng": ShardedObject("rng", None, (1,), (0,))}, ckpt)["rng"] == {
        "seed": 1
    }


# --------------------------------------------------------------------------- unsafe pickles


def _touch(path):
    """What a malicious pickle would run on load."""
    with open(path, "w") as f:
        f.write("pwned")
    return "pwned"


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


class Custom:
    def __init__(self, value: int) -> None:
        self.value = value


def test_non_allowlisted_class_refused_without_running_its_code(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    path = tmp_path / "ck"
    state = {"w": ST.from_rank_offsets("w", torch.ones(2)), "evil": Evil(str(marker))}
    with pytest.raises(UnsafeObjectError, match=r"Evil.*loading it back would be refused"):
        shardsafe.save(state, path)  # refused at save, without running its code either
    assert not marker.exists() and not path.exists()
    # a checkpoint written by something that does not check (another writer, an attacker)
    monkeypatch.setattr(shardsafe.codec, "check_loads_back", lambda data, name: None)
    shardsafe.save(state, path)
    monkeypatch.undo()
    assert not marker.exists()
    for fn in (
        lambda: shardsafe.load({"w": ST.from_rank_offsets("w", torch.zeros(2))}, path),
        lambda: shardsafe.load_common_state_dict(path),
        lambda: shardsafe.load_plain_tensors(path),
    ):
        with pytest.raises(CorruptCheckpointError) as info:
            fn()
        assert isinstance(info.value, UnsafeObjectError)
        msg = str(info.value)
        assert f"{__name__}.Evil" in msg and "refused" in msg and "common state" in msg
        assert f"add_safe_globals([{__name__}._touch])" in msg and "trust" in msg
        assert not marker.exists(), "the checkpoint's pickle code ran"
    # verify re-reads bytes only; it never unpickles
    assert CheckpointReader(path).verify().ok and not marker.exists()


def test_non_allowlisted_class_loads_once_allowed(tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(UnsafeObjectError, match=rf"add_safe_globals\(\[{__name__}.Custom\]\)"):
        shardsafe.save({"obj": ShardedObject("cfg", Custom(5), (1,), (0,))}, path)
    with torch.serialization.safe_globals([Custom]):  # allowed when saving, as when loading
        shardsafe.save({"obj": ShardedObject("cfg", Custom(5), (1,), (0,))}, path)
    with pytest.raises(CorruptCheckpointError) as info:
        shardsafe.load({"obj": ShardedObject("cfg", None, (1,), (0,))}, path)
    msg = str(info.value)
    assert f"{__name__}.Custom" in msg and "object 'cfg/shard_0_1'" in msg
    assert f"add_safe_globals([{__name__}.Custom])" in msg
    with torch.serialization.safe_globals([Custom]):
        out = shardsafe.load({"obj": ShardedObject("cfg", None, (1,), (0,))}, path)
    assert isinstance(out["obj"], Custom) and out["obj"].value == 5


# --------------------------------------------------------------------------- requests that do not fit


def test_missing_key_with_close_match(ckpt):
    with pytest.raises(MissingKeyError) as info:
        shardsafe.load({"w": ST.from_rank_offsets("ww", torch.zeros(4, 4))}, ckpt)
    assert isinstance(info.value, KeyError)
    msg = str(info.value)
    assert (
        "['ww']" in msg
        and "closest stored keys to 'ww': ['w']" in msg
        and "strict='log_unexpected'" in msg
    )
    with pytest.raises(MissingKeyError, match=r"rng/shard_0_2"):
        shardsafe.load({"o": ShardedObject("rng", None, (2,), (0,))}, ckpt)
    with pytest.raises(MissingKeyError, match="no tensor 'nope'"):
        CheckpointReader(ckpt).read_tensor("nope")
    with pytest.raises(MissingKeyError, match="no object 'nope'"):
        CheckpointReader(ckpt).read_object("nope")


def test_shape_mismatch(ckpt):
    with pytest.raises(IncompatibleRequestError) as info:
        shardsafe.load({"w": ST.from_rank_offsets("w", torch.zeros(4, 6))}, ckpt)
    msg = str(info.value)
    assert (
        "'w'" in msg and "[4, 4]" in msg and "[4, 6]" in msg and "allow_shape_mismatch=True" in msg
    )
    # a piece of a differently sized tensor is refused too, even when the piece itself fits
    with pytest.raises(IncompatibleRequestError, match=r"'w'.*\[6, 4\].*allow_shape_mismatch"):
        shardsafe.load({"w": ST.from_global_offset("w", torch.zeros(2, 4), (6, 4), (0, 0))}, ckpt)


def test_allow_shape_mismatch_loads_the_overlap_and_zero_fills(ckpt):
    bigger = torch.full((6, 5), 7.0)
    out = shardsafe.load({"w": ST.from_rank_offsets("w", bigger, allow_shape_mismatch=True)}, ckpt)
    assert out["w"] is bigger
    want = torch.zeros(6, 5)
    want[:4, :4] = W
    assert torch.equal(bigger, want)
    # without a destination tensor the buffer is allocated zero-filled
    piece = ST.from_global_offset("w", torch.empty(3, 3), (6, 6), (3, 3), allow_shape_mismatch=True)
    piece.data = None
    got = shardsafe.load({"w": piece}, ckpt)["w"]
    want = torch.zeros(3, 3)
    want[0, 0] = W[3, 3]
    assert torch.equal(got, want)
    smaller = shardsafe.load(
        {"w": ST.from_rank_offsets("w", torch.zeros(2, 3), allow_shape_mismatch=True)}, ckpt
    )["w"]
    assert torch.equal(smaller, W[:2, :3])
    with pytest.raises(IncompatibleRequestError, match=r"'w'.*2 axes.*3"):
        shardsafe.load(
            {"w": ST.from_rank_offsets("w", torch.zeros(4, 4, 1), allow_shape_mismatch=True)}, ckpt
        )


def test_dtype_mismatch(ckpt):
    with pytest.raises(IncompatibleRequestError) as info:
        shardsafe.load(
            {"w": ST.from_rank_offsets("w", torch.zeros(4, 4, dtype=torch.float64))}, ckpt
        )
    msg = str(info.value)
    assert (
        "'w'" in msg
        and "float32" in msg
        and "torch.float64" in msg
        and "allow_shape_mismatch=True" in msg
    )
    out = shardsafe.load(
        {
            "w": ST.from_rank_offsets(
                "w", torch.zeros(4, 4, dtype=torch.float64), allow_shape_mismatch=True
            )
        },
        ckpt,
    )
    assert out["w"].dtype == torch.float64 and torch.equal(out["w"], W.double())


# --------------------------------------------------------------------------- strict handling


def _request_a_and_c():
    """Checkpoint holds w, b, rng: requesting w and 'c' leaves b and rng missing and c unexpected."""
    return {
        "w": ST.from_rank_offsets("w", torch.zeros(4, 4)),
        "c": ST.from_rank_offsets("c", torch.zeros(2)),
    }


MISSING = {"b", "rng/shard_0_1"}


@pytest.mark.parametrize(
    "mode",
    [
        StrictHandling.ASSUME_OK_UNEXPECTED,
        StrictHandling.RAISE_UNEXPECTED,
        StrictHandling.RAISE_ALL,
    ],
)
def test_strict_raise_on_unexpected(ckpt, mode):
    with pytest.raises(MissingKeyError, match=r"\['c'\]"):
        shardsafe.load(_request_a_and_c(), ckpt, strict=mode)


def test_strict_raise_all_on_missing(ckpt):
    with pytest.raises(MissingKeyError) as info:
        shardsafe.load(
            {"w": ST.from_rank_offsets("w", torch.zeros(4, 4))}, ckpt, strict="raise_all"
        )
    msg = str(info.value)
    assert (
        "requested by no rank" in msg
        and "'b'" in msg
        and "'rng/shard_0_1'" in msg
        and str(ckpt) in msg
    )
    assert "strict=" in msg  # says how to accept it
    # the default and RAISE_UNEXPECTED accept missing keys
    for mode in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED):
        assert torch.equal(
            shardsafe.load({"w": ST.from_rank_offsets("w", torch.zeros(4, 4))}, ckpt, strict=mode)[
                "w"
            ],
            W,
        )
    # everything requested: nothing to complain about
    out = shardsafe.load(_template(), ckpt, strict=StrictHandling.RAISE_ALL)
    assert torch.equal(out["w"], W) and out["rng"] == {"seed": 1} and out["step"] == 7


@pytest.mark.parametrize(
    ("mode", "logged"),
    [
        (StrictHandling.LOG_UNEXPECTED, {"unexpected"}),
        (StrictHandling.LOG_ALL, {"unexpected", "missing"}),
        (StrictHandling.IGNORE_ALL, set()),
        (StrictHandling.RETURN_UNEXPECTED, set()),
        (StrictHandling.RETURN_ALL, set()),
    ],
)
def test_strict_log_return_ignore(ckpt, caplog, mode, logged):
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        res = shardsafe.load(_request_a_and_c(), ckpt, strict=mode.value)
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert ("['c']" in text) == ("unexpected" in logged), text
    assert ("requested by no rank" in text and "'b'" in text) == ("missing" in logged), text
    if mode == StrictHandling.RETURN_ALL:
        sd, missing, unexpected = res
        assert missing == MISSING and unexpected == {"c"}
    elif mode == StrictHandling.RETURN_UNEXPECTED:
        sd, missing, unexpected = res
        assert missing == set() and unexpected == {"c"}
    else:
        sd = res
    assert torch.equal(sd["w"], W)
    assert "c" not in sd and sd["step"] == 7


def test_strict_unknown_mode():
    with pytest.raises(ValueError, match="bogus"):
        shardsafe.load({}, "/nonexistent", strict="bogus")


# --------------------------------------------------------------------------- command line


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardsafe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_cli_verify_and_inspect_exit_codes(ckpt, tmp_path):
    flipped = _copy(ckpt, tmp_path / "flipped")
    p = _piece(flipped, "w")
    _flip_byte(flipped / DATA, p["byte_offset"])
    truncated = _copy(ckpt, tmp_path / "truncated")
    os.truncate(truncated / DATA, p["byte_offset"] + 3)
    missing = _copy(ckpt, tmp_path / "missing")
    (missing / DATA).unlink()
    (tmp_path / "plain").mkdir()
    # run the real entry point as subprocesses, concurrently (each imports torch)
    procs = {
        "ok": _cli("verify", str(ckpt)),
        "flipped": _cli("verify", str(flipped)),
        "inspect": _cli("inspect", str(tmp_path / "plain")),
    }
    results = {name: (proc.wait(timeout=120), *proc.communicate()) for name, proc in procs.items()}

    rc, out, err = results["ok"]
    assert rc == 0, err
    assert out.startswith("OK ") and str(ckpt) in out and "2 tensors, 1 object," in out

    rc, out, err = results["flipped"]
    assert rc == 1, (out, err)
    assert "FAILED" in err and "tensor 'w'" in err and "checksum mismatch" in err and DATA in err

    rc, out, err = results["inspect"]
    assert rc == 2, (out, err)
    assert (
        "error:" in err
        and "not a checkpoint directory" in err
        and "manifest.json" in err
        and "Traceback" not in err
    )


def test_cli_messages_in_process(ckpt, tmp_path, capsys):
    p = _piece(ckpt, "w")
    truncated = _copy(ckpt, tmp_path / "truncated")
    os.truncate(truncated / DATA, p["byte_offset"] + 3)
    assert cli_main(["verify", str(truncated)]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and DATA in err and "truncated" in err

    missing = _copy(ckpt, tmp_path / "missing")
    (missing / DATA).unlink()
    assert cli_main(["verify", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and f"{DATA}: missing" in err

    bad = _copy(ckpt, tmp_path / "bad")
    (bad / "manifest.json").write_text("{")
    assert cli_main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not valid JSON" in err

    assert cli_main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and ("no checkpoint at" in err or "no such file or directory" in err)
