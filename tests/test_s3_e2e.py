"""End to end on a real S3 API (a local moto server): save, load and reshard on ``s3://``
URLs from one process and from two ranks, async saves, verify (also through the CLI), the
CheckpointManager on an ``s3://`` root, and a rank killed in the middle of a multipart
upload. Object stores have no atomic rename, so there the commit is ``manifest.json``,
written last: these tests check that it only appears after every data object.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import RankFailure, run_ranks
from faultinject import kill_self, patch_data_writes
from s3server import S3Server
from stepstate import StepState

import shardsafe
from shardsafe import (
    CheckpointNotFoundError,
    CheckpointReader,
    Saver,
    ShardedObject,
    ShardedTensor,
)
from shardsafe.cli import main as cli_main
from shardsafe.manager import CheckpointManager
from shardsafe.storage.fsspec import FsspecStorage

ST = ShardedTensor
WORLD = 2
ROWS, COLS = 64, 256
TIMEOUT = 6.0  # Saver timeout of the save that loses a rank
SLACK = 20.0


STATE = StepState(ROWS, COLS, WORLD)
full_w = STATE.full_w
rank_state = STATE.rank_state
whole_state = STATE.whole_state
whole_template = STATE.whole_template
assert_holds_step = STATE.assert_holds_step


def manifest_spy(seen: list[list[str]]) -> Callable[[FsspecStorage, str, bytes], None]:
    """``FsspecStorage.write_bytes`` that, for each manifest, records the objects already under
    its checkpoint prefix (listed fresh from the server) just before the manifest goes up."""
    original = FsspecStorage.write_bytes

    def write_bytes(self: FsspecStorage, rel: str, data: bytes) -> None:
        if rel.endswith("manifest.json"):
            prefix = self.path(rel.rsplit("/", 1)[0])
            seen.append(sorted(p[len(prefix) + 1 :] for p in self.fs.find(prefix, refresh=True)))
        original(self, rel, data)

    return write_bytes


def object_times(server: S3Server, url: str) -> dict[str, float]:
    """Key (relative to ``url``) -> LastModified, from the server."""
    prefix = url.split("/", 3)[3] + "/"
    pages = (
        server.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=server.bucket, Prefix=prefix)
    )
    return {
        o["Key"][len(prefix) :]: o["LastModified"].timestamp()
        for page in pages
        for o in page.get("Contents", [])
    }


def assert_manifest_written_last(seen: list[str], server: S3Server, url: str) -> None:
    manifest = json.loads(FsspecStorage(url).read_bytes("manifest.json"))
    data = set(manifest["files"])
    assert data and data <= set(seen), (sorted(data), seen)  # every data object was up before
    assert "manifest.json" not in seen
    times = object_times(server, url)
    assert set(times) == data | {"manifest.json"}  # nothing else under the prefix
    assert all(times["manifest.json"] >= times[name] for name in data), times


# --------------------------------------------------------------------------- one process


@pytest.mark.timeout(90)
def test_single_process_save_load_reshard_verify(
    s3_server: S3Server, s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3_bucket_url}/ck"
    seen: list[list[str]] = []
    monkeypatch.setattr(FsspecStorage, "write_bytes", manifest_spy(seen))
    saver = Saver(block_bytes=4096, files_per_rank=2)
    stats = saver.save(whole_state(1), url)
    assert stats.total_bytes > ROWS * COLS * 4 and len(seen) == 1
    assert_manifest_written_last(seen[0], s3_server, url)

    # load whole, and resharded: a column block and a flat range crossing rows
    assert_holds_step(shardsafe.load(whole_template(), url), 1)
    cols = shardsafe.load(
        {"w": ST.from_rank_offsets("w", torch.zeros(ROWS, COLS // 4), (1, 3, 4))}, url
    )
    assert torch.equal(cols["w"], full_w(1)[:, 3 * COLS // 4 :])
    flat = shardsafe.load(
        {
            "w": ST.from_rank_offsets_flat(
                "w", torch.zeros(1000), (ROWS, COLS), flattened_range=slice(300, 1300)
            )
        },
        url,
    )
    assert torch.equal(flat["w"], full_w(1).reshape(-1)[300:1300])
    reader = CheckpointReader(url)
    assert torch.equal(reader.read_tensor("w"), full_w(1))
    assert set(shardsafe.load_metadata(url)) == {"w", "b", "rng/shard_0_2", "rng/shard_1_2"}
    report = reader.verify()
    assert report.ok and report.bytes_checked > ROWS * COLS * 4

    # an async save on S3
    handle = saver.async_save(whole_state(2), f"{s3_bucket_url}/ck_async")
    assert handle.result(timeout=60).total_bytes > 0
    assert_holds_step(shardsafe.load(whole_template(), f"{s3_bucket_url}/ck_async"), 2)
    assert len(seen) == 2
    assert_manifest_written_last(seen[1], s3_server, f"{s3_bucket_url}/ck_async")
    saver.close()

    # the CLI reaches the server through the environment
    proc = subprocess.run(
        [sys.executable, "-m", "shardsafe", "verify", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OK {url}")
    # a flipped byte in a data object: verify reports it, the CLI exits 1, load refuses
    piece = json.loads(FsspecStorage(url).read_bytes("manifest.json"))["tensors"]["w"]["pieces"][0]
    key = f"{url.split('/', 3)[3]}/{piece['file']}"
    client = s3_server.client()
    body = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    body[piece["byte_offset"] + 5] ^= 0x40
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
    assert cli_main(["verify", url]) == 1
    assert any("checksum mismatch" in p for p in CheckpointReader(url).verify().problems)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="checksum mismatch"):
        shardsafe.load(whole_template(), url)


# --------------------------------------------------------------------------- two ranks


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    seen: list[list[str]] = []
    FsspecStorage.write_bytes = manifest_spy(seen)  # type: ignore[method-assign]
    shardsafe.save(rank_state(rank, 1), f"{root}/tp2")
    handle = shardsafe.async_save(rank_state(rank, 2), f"{root}/tp2_async")
    handle.result(timeout=60)
    # load flattened: each rank a flat range of the whole tensor, crossing the stored row split
    n, cut = ROWS * COLS, ROWS * COLS // 2 + 100
    lo, hi = (0, cut) if rank == 0 else (cut, n)
    out: dict[str, Any] = {"seen": seen}
    for name, step in (("tp2", 1), ("tp2_async", 2)):
        got = shardsafe.load(
            {
                "w": ST.from_rank_offsets_flat(
                    "w", torch.zeros(hi - lo), (ROWS, COLS), flattened_range=slice(lo, hi)
                ),
                "rng": ShardedObject("rng", None, (WORLD,), (1 - rank,)),  # the other rank's
            },
            f"{root}/{name}",
        )
        out[name] = bool(torch.equal(got["w"], full_w(step).reshape(-1)[lo:hi])) and got["rng"] == {
            "seed": 1 - rank,
            "step": step,
        }
    return out


@pytest.mark.timeout(120)
def test_two_ranks_save_async_save_and_reshard(s3_server: S3Server, s3_bucket_url: str) -> None:
    out = run_ranks(_two_ranks, WORLD, s3_bucket_url, timeout=100)
    for r in out:
        assert r["tp2"] and r["tp2_async"]
    # the coordinator wrote both manifests, each after every rank's data objects were up
    seen = out[0]["seen"]
    assert len(seen) == 2 and out[1]["seen"] == []
    assert_manifest_written_last(seen[0], s3_server, f"{s3_bucket_url}/tp2")
    assert_manifest_written_last(seen[1], s3_server, f"{s3_bucket_url}/tp2_async")
    ranks = {
        json.loads(FsspecStorage(f"{s3_bucket_url}/tp2").read_bytes("manifest.json"))["files"][f][
            "rank"
        ]
        for f in seen[0]
    }
    assert ranks == {0, 1}
    # saved by two ranks, loaded whole by one process
    for name, step in (("tp2", 1), ("tp2_async", 2)):
        assert_holds_step(shardsafe.load(whole_template(), f"{s3_bucket_url}/{name}"), step)
        assert CheckpointReader(f"{s3_bucket_url}/{name}").verify().ok


# --------------------------------------------------------------------------- a rank killed mid-upload


PART = 5 << 20  # S3's smallest multipart part
BIG_ROWS = 2048  # 8 MiB of float32 per rank: uploaded in parts


def big_state(rank: int) -> dict[str, Any]:
    w = torch.full((BIG_ROWS, 1024), float(rank))
    return {"w": ST.from_rank_offsets("w", w, (0, rank, WORLD))}


def _killed_mid_upload(rank: int, world: int, root: str, out: str) -> None:
    import s3fs

    s3fs.S3FileSystem.default_block_size = PART  # multipart uploads start after 5 MiB
    manager = CheckpointManager(root, async_save=False)
    manager.save(1, rank_state(rank, 1))
    manager.close()
    if rank == 1:  # dies after 6 MiB of its 8 MiB data file: one part is up, the upload open
        patch_data_writes(6 << 20, kill_self)
    saver = Saver(timeout=TIMEOUT, dead_after=3.0)  # the killed rank named by 3 s of silence
    started = time.monotonic()
    try:
        saver.save(big_state(rank), manager.checkpoint_path(2))
        error: dict[str, Any] | None = None
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e)}
    report = {"error": error, "seconds": time.monotonic() - started}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def open_uploads(server: S3Server, prefix: str) -> list[dict[str, Any]]:
    reply = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return list(reply.get("Uploads", []))


@pytest.mark.timeout(150)
def test_rank_killed_mid_upload_commits_nothing(
    s3_server: S3Server, s3_bucket_url: str, tmp_path: Path
) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_mid_upload, WORLD, s3_bucket_url, str(tmp_path), timeout=120)
    assert info.value.errors == {1: "process exited with code -9"}, info.value.errors
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["error"] is not None and report["error"]["type"] == "DistributedError", report
    assert "rank 1" in report["error"]["message"]
    assert report["seconds"] < TIMEOUT + SLACK, report

    prefix = s3_bucket_url.split("/", 3)[3]
    step2 = f"{s3_bucket_url}/step_000000002"
    uploads = open_uploads(s3_server, f"{prefix}/step_000000002/")
    assert uploads, "rank 1 died before its multipart upload started"  # it did die mid-upload
    # nothing committed: no manifest, no visible object of the save, and load refuses
    storage = FsspecStorage(s3_bucket_url)
    assert not storage.exists("step_000000002/manifest.json")
    assert storage.list_dir("step_000000002") == []
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load(whole_template(), step2)
    for upload in uploads:  # what a bucket lifecycle rule would reclaim
        s3_server.client().abort_multipart_upload(
            Bucket=s3_server.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
        )

    # the manager on the s3:// root: step 1 is intact and latest; saving goes on, with retention
    manager = CheckpointManager(s3_bucket_url, keep_last=1, async_save=True)
    assert manager.steps() == [1] and manager.latest_step() == 1
    assert_holds_step(manager.restore(whole_template()), 1)
    assert CheckpointReader(f"{s3_bucket_url}/step_000000001").verify().ok
    manager.save(2, whole_state(2)).result(timeout=60)
    assert manager.steps() == [2] and manager.latest_step() == 2
    assert_holds_step(manager.restore(whole_template()), 2)
    manager.close()
    assert sorted(storage.list_dir("")) == ["latest", "step_000000002"]


@pytest.mark.timeout(120)
def test_command_line_takes_s3_paths(s3_bucket_url: str, tmp_path: Path, capsys: Any) -> None:
    """ls, inspect, diff, convert (both directions, every target format) on s3:// paths."""
    for step in (1, 2):
        shardsafe.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0) * step), "step": step},
            f"{s3_bucket_url}/run/step_{step:09d}",
        )
    assert cli_main(["ls", f"{s3_bucket_url}/run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "committed")]
    assert cli_main(["inspect", f"{s3_bucket_url}/run/step_000000001", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["key"] == "w"
    one, two = f"{s3_bucket_url}/run/step_000000001", f"{s3_bucket_url}/run/step_000000002"
    assert cli_main(["diff", one, one]) == 0 and cli_main(["diff", one, two]) == 1
    for fmt in ("torch", "hf", "dcp"):
        assert cli_main(["convert", one, f"{s3_bucket_url}/out/{fmt}", "--to", fmt]) == 0
    storage = FsspecStorage(f"{s3_bucket_url}/out")
    assert storage.exists("torch") and storage.list_dir("hf") == ["model.safetensors"]
    assert ".metadata" in storage.list_dir("dcp")
    local = tmp_path / "model.pt"
    local.write_bytes(storage.read_bytes("torch"))
    assert torch.equal(torch.load(local, weights_only=True)["w"], torch.arange(6.0))
    assert cli_main(["convert", str(local), f"{s3_bucket_url}/out/back", "--to", "shardsafe"]) == 0
    assert cli_main(["diff", one, f"{s3_bucket_url}/out/back"]) == 0
    assert cli_main(["convert", one, f"{s3_bucket_url}/out/hf", "--to", "hf"]) == 2  # exists
    # --overwrite replaces an export of the same kind only, and keeps what is not its own
    # (an HF export, like on a file system, adds its files beside others and replaces only its own)
    storage.write_bytes("hf/config.json", b"{}")
    storage.write_bytes("mine/notes.txt", b"keep me")
    for fmt, dst in (("dcp", "hf"), ("torch", "mine"), ("dcp", "mine"), ("torch", "hf")):
        args = ["convert", two, f"{s3_bucket_url}/out/{dst}", "--to", fmt, "--overwrite"]
        assert cli_main(args) == 2, (fmt, dst)
    assert storage.read_bytes("mine/notes.txt") == b"keep me"
    assert sorted(storage.list_dir("hf")) == ["config.json", "model.safetensors"]
    for fmt in ("hf", "dcp", "torch"):
        args = ["convert", two, f"{s3_bucket_url}/out/{fmt}", "--to", fmt, "--overwrite"]
        assert cli_main(args) == 0, fmt
    assert sorted(storage.list_dir("hf")) == ["config.json", "model.safetensors"]
    local.write_bytes(storage.read_bytes("torch"))
    assert torch.equal(torch.load(local, weights_only=True)["w"], torch.arange(6.0) * 2)
    assert not list(Path(".").glob("s3:*"))  # nothing written to a local "s3:" directory
