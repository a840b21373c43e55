"""Fuzzing the read side with hypothesis: a damaged or hostile checkpoint only ever raises
a :class:`CheckpointError`, finishes quickly, runs no code from the checkpoint and opens no
file outside the checkpoint directory.

A real checkpoint is saved once; every example copies it, then mutates its manifest (random
JSON at random places, truncation, huge numbers, wrong types, escaping file names, deep
nesting, hostile encoded values) or its data files (flipped bytes, truncation, extension),
and runs every reader on it: ``load`` (in the saved layout and resharded), ``load_metadata``,
``CheckpointReader.read_tensor``/``read_object``/``common`` and ``verify``.

The checkpoint's common state holds two pickles whose ``__reduce__`` would create a marker
file: stored as plain bytes they are harmless, and mutations re-tag them as ``$torch_save``
(or point other tags at them). The marker must never appear.
"""

from __future__ import annotations

import argparse
import builtins
import copy
import io
import json
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe import CheckpointError, CheckpointReader, ShardedObject, ShardedTensor
from shardsafe.format import DIGEST_FIELD, seal

ST = ShardedTensor
CALL_BUDGET = 10.0  # seconds one reader call may take on this tiny checkpoint (a hang fails)
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
SENTINEL = "@SENTINEL@"  # replaced by the absolute path of a file outside the checkpoint


# --------------------------------------------------------------------------- the hostile payload


def touch_marker(path: str) -> str:
    """What the payload runs when unpickled by anything that executes pickles."""
    with open(path, "w") as f:
        f.write("code from the checkpoint ran")
    return "pwned"


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], str], tuple[str]]:
        return (touch_marker, (self.marker,))


def torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- the checkpoint


W = torch.arange(128, dtype=torch.float32).reshape(8, 16)


def state(marker: str) -> dict[str, Any]:
    flat = W[4:].reshape(-1)
    return {
        "w.top": ST.from_rank_offsets("w", W[:4].clone(), (0, 0, 2)),
        "w.bottom": [
            ST.from_rank_offsets_flat(
                "w", flat[a:b].clone(), (4, 16), (0, 1, 2), flattened_range=slice(a, b)
            )
            for a, b in ((0, 37), (37, 64))
        ],
        "i": ST.from_rank_offsets("i", torch.arange(10)),
        "h": ST.from_rank_offsets("h", torch.ones(3, 3, dtype=torch.bfloat16)),
        "rng": ShardedObject(
            "rng", {"seed": 1, "state": torch.arange(4, dtype=torch.uint8)}, (1,), (0,)
        ),
        "step": 3,
        "lr": 0.5,
        "t": torch.arange(5),
        "arr": np.arange(3, dtype=np.int16),
        "nested": {"a": [1, 2, (3, 4)], "ns": argparse.Namespace(x=1), "dt": torch.float16},
        "payload_pickle": pickle.dumps(Payload(marker), protocol=2),
        "payload_torch": torch_saved(Payload(marker)),
    }


def template() -> dict[str, Any]:
    return {
        "w": ST.from_rank_offsets("w", torch.zeros(8, 16)),
        "i": ST.from_rank_offsets("i", torch.zeros(10, dtype=torch.int64)),
        "h": ST.from_rank_offsets("h", torch.zeros(3, 3, dtype=torch.bfloat16)),
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }


def flat_template() -> dict[str, Any]:
    """Another layout: a flat range of ``w`` crossing the stored pieces, a column block of ``h``."""
    return {
        "w": ST.from_rank_offsets_flat(
            "w", torch.zeros(90), (8, 16), flattened_range=slice(20, 110)
        ),
        "h": ST.from_rank_offsets("h", torch.zeros(3, 1, dtype=torch.bfloat16), (1, 2, 3)),
    }


class Env:
    """The saved checkpoint, its manifest, and where examples run."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.marker = base / "marker"
        self.sentinel = base / "sentinel.bin"
        self.sentinel.write_bytes(bytes(range(256)) * 64)
        self.original = base / "original"
        saver = shardsafe.Saver(block_bytes=64, files_per_rank=2)
        saver.save(state(str(self.marker)), self.original)
        saver.close()
        self.manifest = json.loads((self.original / "manifest.json").read_bytes())
        self.work = base / "work"
        self.blob_ids = sorted(self.manifest["blobs"])
        self.data_files = sorted(self.manifest["files"])

    def fresh(self) -> Path:
        """A pristine copy of the checkpoint to mutate."""
        if self.work.exists():
            shutil.rmtree(self.work)
        shutil.copytree(self.original, self.work)
        return self.work

    def write_manifest(self, manifest: Any) -> None:
        """``manifest`` re-sealed (see ``manifests.py``), so the parser is what is fuzzed."""
        if isinstance(manifest, dict):
            manifest = {k: v for k, v in manifest.items() if k != DIGEST_FIELD}
        text = json.dumps(manifest, allow_nan=True).replace(SENTINEL, str(self.sentinel))
        raw = text.encode()
        self.write_raw(seal(raw) if isinstance(manifest, dict) and manifest else raw)

    def write_raw(self, raw: bytes) -> None:
        raw = raw.replace(SENTINEL.encode(), str(self.sentinel).encode())
        (self.work / "manifest.json").write_bytes(raw)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return Env(tmp_path_factory.mktemp("fuzz"))


def test_the_payloads_are_live(env: Env) -> None:
    """The marker test means something: an executing unpickler does run the payloads."""
    sd = state(str(env.marker))
    for run in (
        lambda: pickle.loads(sd["payload_pickle"]),
        lambda: torch.load(io.BytesIO(sd["payload_torch"]), weights_only=False),
    ):
        assert run() == "pwned" and env.marker.exists()
        env.marker.unlink()
    # stored as bytes, the payloads come back as bytes
    common = shardsafe.load_common_state_dict(env.original)
    assert common["payload_pickle"] == sd["payload_pickle"] and not env.marker.exists()


# --------------------------------------------------------------------------- watching every reader


@contextmanager
def opened_paths() -> Iterator[list[str]]:
    """Every path this process opens (``open`` and ``os.open``, any thread) while inside."""
    seen: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *args, **kwargs)

    def spy_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(os.path.realpath(os.fsdecode(path)))
        return real_os_open(path, *args, **kwargs)

    builtins.open, os.open = spy_open, spy_os_open
    try:
        yield seen
    finally:
        builtins.open, os.open = real_open, real_os_open


def read_everything(path: Path) -> None:
    reader = CheckpointReader(path)
    for key in list(reader.manifest.tensors)[:8]:
        _only_checkpoint_errors(lambda key=key: reader.read_tensor(key))
    for ukey in list(reader.manifest.objects)[:4]:
        _only_checkpoint_errors(lambda ukey=ukey: reader.read_object(ukey))
    _only_checkpoint_errors(reader.common)
    report = reader.verify()
    assert isinstance(report.problems, list)


def _only_checkpoint_errors(fn: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        fn()
    except CheckpointError:
        pass
    elapsed = time.monotonic() - started
    assert elapsed < CALL_BUDGET, f"a reader call took {elapsed:.1f} s"


READERS: list[Callable[[Path], Any]] = [
    lambda p: shardsafe.load(template(), p),
    lambda p: shardsafe.load(flat_template(), p),
    shardsafe.load_metadata,
    read_everything,
]


def exercise(env: Env) -> None:
    """Every reader on the work copy: CheckpointErrors only, in time, no file outside, no code run."""
    inside = os.path.realpath(env.work) + os.sep
    with opened_paths() as seen:
        for read in READERS:
            _only_checkpoint_errors(lambda read=read: read(env.work))
    outside = [p for p in seen if not p.startswith(inside) and not _policy_file(p)]
    assert outside == [], f"opened outside the checkpoint: {outside}"
    assert not env.marker.exists(), "code from the checkpoint ran"


def _policy_file(path: str) -> bool:
    """The two files a load reads that are not the checkpoint's (SECURITY.md): the direct-I/O
    decision of this host's file system and the mount table naming that file system."""
    cache = os.path.join(os.environ["SHARDSAFE_CACHE_DIR"], "direct_io.json")
    return path == cache or re.fullmatch(r"/proc/(self|\d+)/mountinfo", path) is not None


# --------------------------------------------------------------------------- strategies


SPECIAL_STRINGS = [
    SENTINEL,
    "../sentinel.bin",
    "../../sentinel.bin",
    "data/../sentinel.bin",
    "data/../../sentinel.bin",
    "data/./../../sentinel.bin",
    "data//../../sentinel.bin",
    "data\\..\\..\\sentinel.bin",
    "data/%2e%2e/sentinel.bin",
    "data/rank-00000-00.bin\x00/../../sentinel.bin",
    "data/.hidden",
    "data/",
    "data/rank-00000-00.bin",
    "data/rank-00000-01.bin",
    "manifest.json",
    "",
    "\x00",
    "float32",
    "bfloat16",
    "float128",
    "object",
    "V1000000000",
    "<f8",
    "cuda:7",
    "meta",
    "xxh3_64",
    "shardsafe",
    "c.0",
    "c.1",
    "c.999",
    "$tensor",
    "$torch_save",
    "nan",
    "inf",
]
HUGE = [2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63), 10**300]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE)
    | st.integers(min_value=0, max_value=300)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(SPECIAL_STRINGS)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(SPECIAL_STRINGS), inner, max_size=5)
    ),
    max_leaves=25,
)


def tree_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON tree, the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += tree_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += tree_paths(v, (*prefix, i))
    return out


def get_at(node: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        node = node[p]
    return node


def mutate_tree(data: st.DataObject, doc: Any, values: st.SearchStrategy[Any]) -> Any:
    """Replace, delete or add one value at a random position of ``doc``."""
    path = data.draw(st.sampled_from(tree_paths(doc)), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "insert"]), label="op")
    value = data.draw(values, label="value")
    if not path:
        return value if op == "replace" else doc
    parent, last = get_at(doc, path[:-1]), path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    else:
        target = parent[last]
        if isinstance(target, dict):
            target[data.draw(st.text(max_size=8) | st.sampled_from(SPECIAL_STRINGS))] = value
        elif isinstance(target, list):
            target.insert(data.draw(st.integers(0, len(target))), value)
        else:
            parent[last] = [target, value]
    return doc


TAGS = [
    "$tensor",
    "$ndarray",
    "$npscalar",
    "$bytes",
    "$torch_save",
    "$dtype",
    "$device",
    "$size",
    "$namespace",
    "$dict",
    "$tuple",
    "$float",
    "$sharded",
    "$pickle",
    "$",
    "tensor",
]


def encoded_values(blob_ids: list[str]) -> st.SearchStrategy[Any]:
    """Encoded common-state nodes, mostly well-formed, with wrong sizes, types and blob ids."""
    ids = st.sampled_from([*blob_ids, "c.999", "", SENTINEL, "../c.0"]) | st.text(max_size=6)
    dtypes = st.sampled_from(
        [
            "float32",
            "int64",
            "uint8",
            "bfloat16",
            "bool",
            "float128",
            "<f4",
            "|u1",
            "V8",
            "O",
            "S5",
            "U3",
            "M8[s]",
            "f4,",
            "(",
            "[('a'",
        ]
    )
    shapes = st.lists(st.integers(0, 40) | st.sampled_from(HUGE), max_size=4) | json_scalars
    body = st.fixed_dictionaries(
        {"dtype": dtypes | json_scalars, "shape": shapes, "blob": ids},
        optional={"type": st.text(max_size=10), "value": json_scalars},
    )
    leaf = json_scalars | st.builds(
        lambda t, b: {t: b}, st.sampled_from(TAGS), body | ids | json_scalars
    )
    return st.recursive(
        leaf,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.builds(lambda t, b: {t: b}, st.sampled_from(TAGS), inner)
            | st.builds(
                lambda kv: {"$dict": kv}, st.lists(st.tuples(inner, inner).map(list), max_size=3)
            )
        ),
        max_leaves=12,
    )


def retag(node: Any, data: st.DataObject, tags: list[str]) -> Any:
    """Swap some encoded tags (``$bytes`` -> ``$torch_save``, ...), keeping the bodies."""
    if isinstance(node, list):
        return [retag(v, data, tags) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        ((tag, body),) = node.items()
        if data.draw(st.booleans(), label=f"retag {tag}"):
            tag = data.draw(st.sampled_from(tags), label="new tag")
        return {tag: retag(body, data, tags)}
    return node


# --------------------------------------------------------------------------- manifest fuzzing


@SETTINGS
@given(data=st.data())
def test_mutated_manifest_values(env: Env, data: st.DataObject) -> None:
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        doc = mutate_tree(data, doc, json_values)
    env.write_manifest(doc)
    exercise(env)


@SETTINGS
@given(data=st.data())
def test_escaping_file_names_never_open_anything_outside(env: Env, data: st.DataObject) -> None:
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    names = st.sampled_from(SPECIAL_STRINGS[:12])
    bad = data.draw(names, label="name")
    victim = data.draw(st.sampled_from(env.data_files), label="victim")
    where = data.draw(st.sampled_from(["files", "pieces", "blobs", "both"]), label="where")
    if where in ("files", "both"):
        doc["files"][bad] = doc["files"].pop(victim)
    if where in ("pieces", "blobs", "both"):
        extents = [p for t in doc["tensors"].values() for p in t["pieces"]]
        if where != "pieces":
            extents += list(doc["blobs"].values())
        for extent in extents:
            if extent["file"] == victim or data.draw(st.booleans()):
                extent["file"] = bad
    env.write_manifest(doc)
    exercise(env)


@SETTINGS
@given(data=st.data())
def test_truncated_or_garbled_manifest_text(env: Env, data: st.DataObject) -> None:
    env.fresh()
    raw = json.dumps(env.manifest).encode()
    kind = data.draw(
        st.sampled_from(["truncate", "splice", "digits", "deep", "garbage"]), label="kind"
    )
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "splice":
        at = data.draw(st.integers(0, len(raw)))
        raw = (
            raw[:at] + data.draw(st.binary(max_size=20)) + raw[at + data.draw(st.integers(0, 20)) :]
        )
    elif kind == "digits":  # a number too long to convert, or with huge exponents
        text = raw.decode()
        spots = [i for i, c in enumerate(text) if c.isdigit() and not text[i - 1].isalnum()]
        at = data.draw(st.sampled_from(spots))
        repl = data.draw(st.sampled_from(["9" * 5000, "1e999999", "-0", "1" * 4300, "123.5e-400"]))
        raw = (text[:at] + repl + text[at + 1 :]).encode()
    elif kind == "deep":  # nesting deeper than any parser's stack, as the whole file
        depth = data.draw(st.sampled_from([500, 1000, 5000, 100_000]))
        opener = data.draw(st.sampled_from(["[", '{"a":']))
        raw = (opener * depth).encode() + (b"]" if opener == "[" else b"}") * depth
    else:
        raw = data.draw(st.binary(max_size=200))
    env.write_raw(raw)
    exercise(env)


def _nested(kind: str, depth: int) -> str:
    """JSON text of an encoded value nested ``depth`` deep."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    if kind == "tuple":
        return '{"$tuple":[' * depth + "1" + "]}" * depth
    if kind == "dict":
        return '{"$dict":[["k",' * depth + "1" + "]]}" * depth
    return '{"$namespace":{"$dict":[["k",' * depth + "1" + "]]}}" * depth


def stack_room() -> int:
    """How many more Python frames fit under the recursion limit here."""
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return sys.getrecursionlimit() - depth


@SETTINGS
@given(
    kind=st.sampled_from(["list", "tuple", "dict", "namespace"]),
    fraction=st.sampled_from([0.02, 0.2, 0.35, 0.45, 0.6, 0.75, 0.9, 0.97, 1.5, 50.0]),
    where=st.sampled_from(["common", "object", "user_metadata", "user_metadata_encoded"]),
)
def test_deeply_nested_encoded_values(env: Env, kind: str, fraction: float, where: str) -> None:
    """Nesting around the stack's limit: deep enough for the decoder, not for the JSON parser."""
    depth = max(1, int(stack_room() * fraction))
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    if where == "common":
        doc["common"] = "@NEST@"
    elif where == "object":
        next(iter(doc["objects"].values()))["value"] = "@NEST@"
    elif where == "user_metadata":
        doc["user_metadata"] = {"content_metadata": "@NEST@"}
    else:
        doc["user_metadata"] = {"content_metadata_encoded": "@NEST@"}
    env.write_raw(json.dumps(doc).replace('"@NEST@"', _nested(kind, depth)).encode())
    exercise(env)


# --------------------------------------------------------------------------- encoded values and pickles


@SETTINGS
@given(data=st.data())
def test_hostile_encoded_values_run_no_code(env: Env, data: st.DataObject) -> None:
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    choice = data.draw(st.sampled_from(["retag", "generate", "splice"]), label="choice")
    tags = ["$torch_save", "$tensor", "$ndarray", "$bytes", "$npscalar", "$namespace", "$unknown"]
    if choice == "retag":  # the stored pickles (and everything else) under other tags
        doc["common"] = retag(doc["common"], data, tags)
        for entry in doc["objects"].values():
            entry["value"] = retag(entry["value"], data, tags)
    else:
        value = data.draw(encoded_values(env.blob_ids), label="encoded")
        if choice == "generate":
            doc["common"] = value
        else:
            doc = mutate_tree_under(data, doc, "common", value)
    env.write_manifest(doc)
    exercise(env)


def mutate_tree_under(
    data: st.DataObject, doc: dict[str, Any], top: str, value: Any
) -> dict[str, Any]:
    """Put ``value`` at a random position inside ``doc[top]``."""
    paths = tree_paths(doc[top], (top,))
    path = data.draw(st.sampled_from(paths), label="at")
    if len(path) == 1:
        doc[top] = value
    else:
        get_at(doc, path[:-1])[path[-1]] = value
    return doc


def test_stored_pickles_retagged_are_refused(env: Env) -> None:
    """The direct attack: each payload blob presented as a ``$torch_save`` object."""
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    pairs = doc["common"]["$dict"]
    payload_blobs = [v["$bytes"] for k, v in pairs if k in ("payload_pickle", "payload_torch")]
    assert len(payload_blobs) == 2
    for blob in payload_blobs:
        doc["common"] = {"$torch_save": {"type": "builtins.dict", "blob": blob}}
        env.write_manifest(doc)
        with pytest.raises(shardsafe.CorruptCheckpointError, match=r"refused|cannot read"):
            shardsafe.load_common_state_dict(env.work)
        assert not env.marker.exists()
        exercise(env)


HOSTILE_NODES = [
    {"$npscalar": {"dtype": "V8", "value": 2**30}},  # np.void(n) allocates n bytes
    {"$npscalar": {"dtype": "O", "value": [1, 2]}},
    {"$npscalar": {"dtype": "f4,", "value": 1}},  # numpy's dtype parser: ValueError
    {"$npscalar": {"dtype": "[('a'", "value": 1}},  # ... and SyntaxError
    {"$ndarray": {"dtype": "(", "shape": [1], "blob": "c.0"}},
    {"$ndarray": {"dtype": "<f8", "shape": [2**40], "blob": "c.0"}},
    {"$tensor": {"dtype": "float32", "shape": [2**40, 2**40], "blob": "c.0"}},
    {"$tensor": {"dtype": "float32", "shape": [0, 2**70], "blob": "c.0"}},
    {"$tensor": {"dtype": "float32", "shape": [3], "blob": "c.0"}},  # wrong size
    {"$bytes": "c.999"},
    {"$device": "cuda:999999999999999999999"},
    {"$float": "1e999"},
    {"$namespace": {"$dict": [[1, 2]]}},
    {"$dict": [[[1], 2]]},  # unhashable key
    {"$torch_save": {"type": "x", "blob": "c.0"}},  # not a pickle at all
    {"$torch_save": {"type": "x"}},
    {"$unknown": 1},
    {"$tensor": 1, "$bytes": "c.0"},
]


@pytest.mark.parametrize("node", HOSTILE_NODES, ids=[json.dumps(n)[:40] for n in HOSTILE_NODES])
def test_hostile_encoded_value_is_a_corrupt_checkpoint(env: Env, node: dict[str, Any]) -> None:
    env.fresh()
    doc = copy.deepcopy(env.manifest)
    doc["common"] = {"$dict": [["x", node]]}
    env.write_manifest(doc)
    started = time.monotonic()
    with pytest.raises(shardsafe.CorruptCheckpointError, match=r"manifest\.json"):
        CheckpointReader(env.work).common()
    assert time.monotonic() - started < CALL_BUDGET
    exercise(env)


# --------------------------------------------------------------------------- data files


@SETTINGS
@given(data=st.data())
def test_mutated_data_files(env: Env, data: st.DataObject) -> None:
    env.fresh()
    name = data.draw(st.sampled_from(env.data_files), label="file")
    path = env.work / name
    raw = bytearray(path.read_bytes())
    kind = data.draw(
        st.sampled_from(["flip", "truncate", "extend", "replace", "delete", "empty"]), label="kind"
    )
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=5000))
    elif kind == "replace":
        raw = bytearray(data.draw(st.binary(min_size=len(raw), max_size=len(raw))))
    elif kind == "empty":
        raw = bytearray()
    if kind == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    exercise(env)
    if kind in ("truncate", "delete", "empty"):  # missing bytes are always reported
        assert not CheckpointReader(env.work).verify().ok


@pytest.mark.timeout(60)
def test_data_file_replaced_by_a_link_to_a_file_outside(env: Env) -> None:
    """A symbolic link in the checkpoint directory does not lead the reader outside it."""
    env.fresh()
    victim = env.work / env.data_files[0]
    victim.unlink()
    victim.symlink_to(env.sentinel)
    exercise(env)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="outside"):
        shardsafe.load(template(), env.work)


def test_checkpoint_reached_through_a_link_loads(env: Env) -> None:
    """Links are refused only when they lead outside: the checkpoint itself may be one."""
    env.fresh()
    alias = env.base / "alias"
    if alias.is_symlink():
        alias.unlink()
    alias.symlink_to(env.work, target_is_directory=True)
    out = shardsafe.load(template(), alias)
    assert torch.equal(out["w"], W) and out["step"] == 3
    assert CheckpointReader(alias).verify().ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["manifest", "data"])
def test_fifo_in_place_of_a_file_does_not_block(env: Env, which: str) -> None:
    """A named pipe has no writer: opening it for reading would wait forever."""
    env.fresh()
    victim = env.work / ("manifest.json" if which == "manifest" else env.data_files[0])
    victim.unlink()
    os.mkfifo(victim)
    started = time.monotonic()
    exercise(env)
    with pytest.raises(shardsafe.CheckpointError):
        shardsafe.load(template(), env.work)
    assert time.monotonic() - started < CALL_BUDGET


@pytest.mark.timeout(60)
def test_sizes_claimed_beyond_the_files_allocate_nothing(env: Env) -> None:
    """A manifest claiming a 1 TB tensor and a 1 TB blob in a small file: every reader refuses
    before allocating for them (the claims are checked against the files' real sizes)."""
    env.fresh()
    (name, other), huge = env.data_files[:2], 10**12
    block = 64 << 20  # the largest block_bytes allowed
    sums = ["0" * 16] * -(-huge // block)
    extent = {"file": name, "byte_offset": 0, "nbytes": huge, "checksums": sums}
    doc = copy.deepcopy(env.manifest)
    doc["checksum"]["block_bytes"] = block
    doc["files"] = {name: {"nbytes": huge, "rank": 0}, other: {"nbytes": huge, "rank": 0}}
    piece = {"offset": [0], "shape": [huge], "flat": None, **extent}
    doc["tensors"] = {"big": {"dtype": "uint8", "shape": [huge], "pieces": [piece]}}
    doc["objects"] = {}
    doc["blobs"] = {"c.0": dict(extent, file=other)}
    doc["common"] = {"$bytes": "c.0"}
    env.write_manifest(doc)
    reader = CheckpointReader(env.work)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="truncated"):
        reader.read_tensor("big")
    with pytest.raises(shardsafe.CorruptCheckpointError, match="truncated"):
        reader.common()
    report = reader.verify()
    assert not report.ok and all("truncated" in p for p in report.problems), report.problems
    small = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(shardsafe.IncompatibleRequestError, match="global shape"):
        shardsafe.load({"big": ST.from_rank_offsets("big", small)}, env.work)
    overlap = ST.from_rank_offsets("big", small, allow_shape_mismatch=True)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="truncated"):
        shardsafe.load({"big": overlap}, env.work)
    exercise(env)
