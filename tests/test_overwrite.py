"""Overwriting a checkpoint: at every instant the old or the new one is there and complete,
clean-up never deletes a complete checkpoint, and only checkpoints are ever replaced.

The sweep forks the coordinator of an overwrite save and SIGKILLs it at its k-th storage
mutation (write, rename, exchange, delete, ...), for every k until the save completes; after
each kill the checkpoint must load completely as the old or the new generation, before and
after the directory's clean-up.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointExistsError, ShardedTensor
from shardsafe.cli import main as cli_main
from shardsafe.directory import StepDirectory
from shardsafe.format import MANIFEST_NAME, Manifest
from shardsafe.location import LOCK_SUFFIX, TMP_MARK
from shardsafe.storage import storage_for
from shardsafe.storage.base import Storage

NAME = "step_000000001"
MUTATIONS = (
    "write_bytes",
    "open_write",
    "rename",
    "exchange",
    "remove_tree",
    "make_dir",
    "sync_dir",
    "create_exclusive",
)


def state(generation: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((64, 32), float(generation)), replica_id=0
        ),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((7,), float(generation))),
        "gen": generation,
    }


def generation(path: str) -> int:
    """The generation the checkpoint at ``path`` holds, checking every byte of it."""
    out = {"w": torch.zeros(64, 32), "b": torch.zeros(7)}
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", out["w"]),
        "b": ShardedTensor.from_rank_offsets("b", out["b"]),
        "gen": None,
    }
    loaded = shardsafe.load(sd, path)
    gen = int(loaded["gen"])
    assert torch.equal(out["w"], torch.full((64, 32), float(gen)))
    assert torch.equal(out["b"], torch.full((7,), float(gen)))
    return gen


def _killed_save(path: str, gen: int, kill_at: int, exchange: bool) -> None:
    """In a forked child: SIGKILL this process at its ``kill_at``-th storage mutation."""
    count = [0]
    for cls in {type(storage_for(os.path.dirname(path) if "://" not in path else path))}:
        for name in MUTATIONS:
            orig = getattr(cls, name)

            def wrapped(self: Storage, *a: Any, _orig: Any = orig, **k: Any) -> Any:
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return _orig(self, *a, **k)

            setattr(cls, name, wrapped)
        if not exchange:
            cls.exchange = lambda self, a, b: False  # type: ignore[method-assign]
    shardsafe.save(state(gen), path, overwrite=True)
    os._exit(0)


def sweep(root: str, exchange: bool) -> int:
    """Kill an overwrite save at every mutation in turn; return how many kill points there were."""
    path = f"{root}/{NAME}"
    shardsafe.save(state(0), path)
    directory = StepDirectory(root)
    ctx = multiprocessing.get_context("fork")
    kill_at = 0
    while True:
        kill_at += 1
        assert kill_at < 200, "the save never completed"
        before = generation(path)
        child = ctx.Process(target=_killed_save, args=(path, kill_at, kill_at, exchange))
        child.start()
        child.join(120)
        assert child.exitcode is not None, "the save hung"
        completed = child.exitcode == 0
        if exchange or not directory.storage.atomic_rename:
            # an atomic swap (or the manifest PUT) is the commit: no instant without a checkpoint
            assert generation(path) in (before, kill_at), f"kill point {kill_at}"
        directory.clean()
        after = generation(path)
        assert after in (before, kill_at), f"kill point {kill_at}"
        assert directory.committed() == [NAME]
        assert directory.leftovers() == [], f"kill point {kill_at}"
        if completed:
            assert after == kill_at
            return kill_at


@pytest.mark.timeout(600)
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_sigkill_sweep_over_an_overwrite_keeps_old_or_new(tmp_path: Path, exchange: bool) -> None:
    points = sweep(str(tmp_path), exchange)
    assert points > 8  # the sweep really walked through the save
    assert sorted(os.listdir(tmp_path)) == [NAME]


@pytest.mark.timeout(600)
def test_sigkill_sweep_over_an_overwrite_on_s3(s3_bucket_url: str) -> None:
    points = sweep(s3_bucket_url, exchange=True)
    assert points > 4
    directory = StepDirectory(s3_bucket_url)
    files = {f"data/{n}" for n in directory.storage.list_dir(f"{NAME}/data")}
    manifest = Manifest.loads(directory.storage.read_bytes(f"{NAME}/{MANIFEST_NAME}"))
    assert files == set(manifest.files)  # the replaced checkpoints' files are gone
    assert directory.storage.list_dir("") == [NAME]


def test_clean_restores_a_checkpoint_left_beside_its_name(tmp_path: Path) -> None:
    """A crash between the two renames of the fallback leaves both copies beside an empty
    name: the new one is renamed into place, the old one removed, nothing complete is lost."""
    path = tmp_path / NAME
    shardsafe.save(state(1), str(path))
    os.rename(path, tmp_path / f".{NAME}{TMP_MARK}0123456789abcdef")
    directory = StepDirectory(tmp_path)
    assert directory.leftovers() == []  # never listed: it holds a complete manifest
    directory.clean()
    assert generation(str(path)) == 1


def test_overwrite_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    (outdir / "train.log").write_text("precious")
    with pytest.raises(
        CheckpointExistsError, match=r"holding train\.log but not a shardsafe checkpoint"
    ):
        shardsafe.save(state(1), str(outdir), overwrite=True)
    assert (outdir / "train.log").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["outdir"]  # no work directory, no lease left

    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(CheckpointExistsError, match="is a file but not a shardsafe checkpoint"):
        shardsafe.save(state(1), str(afile), overwrite=True)
    assert afile.read_text() == "x"

    empty = tmp_path / "empty"
    empty.mkdir()
    shardsafe.save(state(2), str(empty), overwrite=True)  # nothing in it to lose
    assert generation(str(empty)) == 2
    shardsafe.save(state(3), str(empty), overwrite=True)  # a checkpoint: replaced
    assert generation(str(empty)) == 3
    assert not any(LOCK_SUFFIX in n or TMP_MARK in n for n in os.listdir(tmp_path))


def test_convert_overwrite_refuses_what_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(3)}, src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.yaml").write_text("lr: 1")
    rc = cli_main(["convert", str(src), str(dst), "--to", "shardsafe", "--overwrite"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "not a shardsafe checkpoint" in err and "config.yaml" in err
    assert (dst / "config.yaml").read_text() == "lr: 1"
    dst2 = tmp_path / "dst2"
    assert cli_main(["convert", str(src), str(dst2), "--to", "shardsafe"]) == 0
    assert cli_main(["convert", str(src), str(dst2), "--to", "shardsafe", "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "dst2", "src.pt"]


def test_overwrite_on_s3_refuses_what_is_not_a_checkpoint(s3_bucket_url: str) -> None:
    storage = storage_for(s3_bucket_url)
    storage.write_bytes("outdir/notes.txt", b"precious")
    with pytest.raises(CheckpointExistsError, match="not a shardsafe checkpoint"):
        shardsafe.save(state(1), f"{s3_bucket_url}/outdir", overwrite=True)
    assert storage.read_bytes("outdir/notes.txt") == b"precious"
    assert storage.list_dir("") == ["outdir"]
