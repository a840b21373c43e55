"""Class 10: a pickle's shared references cannot make walking its value cost more than its bytes.

A pickle's memo lets a later reference (``BINGET``) name an object built earlier. Forty
nested lists, each holding the next one twice, take about 1.5 KB and have 2**40 paths:
loading builds them in microseconds, but everything that walks nested state path by path
(flattening a ``.pt`` into keys, restoring the common state into a template, ``inspect``
printing it, ``diff`` comparing it) would run for days. Every value loaded from an untrusted
pickle is measured once with a visited set (``codec.check_loaded_tree``): the total length of
its paths must stay within 64 steps per pickle byte (plus 4 Mi), and a container holding
itself is refused. Shared small values, as Megatron's ``argparse.Namespace`` has them
(repeated strings and tuples), pass.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import xxhash

from .foreign import FOREIGN, make_dcp, retarget_dcp_object, torch_bytes
from .harness import (
    assert_cli_refused,
    assert_cli_refuses,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
    write_manifest,
)

pytestmark = pytest.mark.timeout(300)
LEVELS = 40


def _dag() -> list[object]:
    """2**LEVELS paths in LEVELS lists."""
    node: list[object] = []
    for _ in range(LEVELS):
        node = [node, node]
    return node


def _cycle() -> list[object]:
    node: list[object] = []
    node.append(node)
    return node


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
    doc["common"] = {
        "$dict": [["state", {"$torch_save": {"type": "builtins.list", "blob": "c.p"}}]]
    }
    write_manifest(path, doc)


@pytest.mark.parametrize("shape", ["dag", "cycle"])
def test_shared_references_are_refused_everywhere(tmp_path: Path, shape: str) -> None:
    import torch

    value = _dag() if shape == "dag" else _cycle()
    payload = torch_bytes({"state": value, "w": torch.ones(2)})
    assert len(payload) < 4 << 10
    _blob_checkpoint(tmp_path / "ours", payload)
    make_dcp(tmp_path / "dcp")
    retarget_dcp_object(tmp_path / "dcp", "n", "__p.distcp", payload)
    make_dcp(tmp_path / "mcore", megatron=True)
    (tmp_path / "mcore" / "common.pt").write_bytes(payload)
    (tmp_path / "p.pt").write_bytes(payload)
    ours, pt = str(tmp_path / "ours"), str(tmp_path / "p.pt")
    code = (
        FOREIGN
        + f"""
import torch
st = shardsafe.ShardedTensor.from_rank_offsets
attempt("ours: load", lambda: shardsafe.load({{"w": st("w", torch.zeros(8, 8)), "state": None}}, {ours!r}))
attempt("ours: load_common_state_dict", lambda: shardsafe.load_common_state_dict({ours!r}))
attempt("ours: common", lambda: shardsafe.CheckpointReader({ours!r}).common())
for label in ("dcp", "mcore", "p.pt"):
    read_foreign({str(tmp_path)!r} + "/" + label, label + ": ")
cli("inspect ours", "inspect", {ours!r})
cli("inspect pt", "inspect", {pt!r})
cli("diff pt", "diff", {pt!r}, {pt!r})
cli("convert pt", "convert", {pt!r}, {str(tmp_path / "out")!r}, "--to", "shardsafe")
cli("convert mcore", "convert", {str(tmp_path / "mcore")!r}, {str(tmp_path / "out2")!r}, "--to", "torch")
"""
    )
    results = run_calls(code, tmp_path / "outside", timeout=200)
    calls = [r for r in results if not r["name"].startswith(("inspect", "diff", "convert"))]
    match = "walking it" if shape == "dag" else "contains itself"
    assert_refused(calls, 6, match=match)
    commands = [r for r in results if r not in calls]
    assert len(commands) == 5
    inspect_ours = commands.pop(0)  # prints the manifest, the common state marked unreadable
    assert inspect_ours["outcome"] == "exit 0", inspect_ours
    assert "<unreadable: " in inspect_ours["stdout"]
    assert inspect_ours["seconds"] < 20
    for r in commands:
        assert_cli_refused(r)
        assert match in r["message"], r
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
    if shape == "dag":  # the real command, in its own process
        assert_cli_refuses(run_cli("inspect", pt))


def test_shared_small_values_still_load(tmp_path: Path) -> None:
    """Megatron keeps its ``argparse.Namespace`` in ``common.pt``: pickling it shares every
    repeated string and tuple. Such a file (2,000 arguments, one tuple and a few strings
    referenced by all) loads, and so does a list of one tensor referenced 8 times."""
    import torch

    import shardsafe
    from shardsafe.convert import DcpSource

    shared = (1, 2, "fp16")
    args = argparse.Namespace(
        **{f"arg_{i}": shared if i % 2 else "bf16" for i in range(2000)},
        layers=[shared] * 64,
    )
    path = make_dcp(tmp_path / "mcore", megatron=True)
    tied = torch.arange(1000.0)
    torch.save({"args": args, "iteration": 7, "tied": [tied] * 8}, path / "common.pt")
    common = DcpSource(path).common()
    assert vars(common["args"]) == vars(args)
    assert len(common["tied"]) == 8 and torch.equal(common["tied"][7], tied)
    # and in our own format, through a $torch_save blob (a set is pickled)
    name = "a repeated string, stored once"
    table = {(i, name, shared) for i in range(2000)}
    sd = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "table": table}
    shardsafe.save(sd, tmp_path / "ours")
    manifest = (tmp_path / "ours" / "manifest.json").read_text()
    assert "$torch_save" in manifest
    assert shardsafe.load_common_state_dict(tmp_path / "ours")["table"] == table
