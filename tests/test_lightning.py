"""PyTorch Lightning saving and resuming through ``shardsafe.lightning.CheckpointIO``.

Lightning itself runs: its ``Trainer.fit`` loop, its ``ModelCheckpoint`` (saving, and deleting
with ``save_top_k``) and its ``ckpt_path`` resume; two ranks through Lightning's ``ddp`` strategy
(its subprocess launcher, gloo on CPU) in fresh processes per generation, under a hard timeout.
The first generation is SIGKILLed (every process at once) in the middle of a save, after
earlier checkpoints committed; the next resumes from the newest committed one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import lightning_job  # noqa: E402
from lightning_job import Tiny, data  # noqa: E402

import shardsafe  # noqa: E402
import shardsafe.lightning  # noqa: E402
from shardsafe.cli import main as cli_main  # noqa: E402

JOB = Path(lightning_job.__file__)
SRC = Path(shardsafe.__file__).resolve().parent.parent


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run_job(root: Path, out: Path, *args: str, timeout: float = 400, killed: bool = False) -> int:
    """One generation in fresh processes (Lightning relaunches the script for rank 1), in a
    process group of its own; ``killed``: it must end SIGKILLed (``--kill-in-save``)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{JOB.parent}", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "--root", str(root), "--out", str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher's rank 1 too
        proc.communicate()
        pytest.fail(f"Lightning run {args} did not finish in {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, 9)  # a rank that outlived the launcher
        except ProcessLookupError:
            pass
    if killed:
        if proc.returncode != -9:
            pytest.fail(
                f"Lightning run {args} was not killed:\n{log.decode(errors='replace')[-4000:]}"
            )
        return proc.returncode
    if proc.returncode not in (0, 3):
        pytest.fail(f"Lightning run {args} failed:\n{log.decode(errors='replace')[-4000:]}")
    return proc.returncode


def checkpoints(root: Path) -> list[str]:
    """The names Lightning sees (hidden ones are a save's work directory and lease)."""
    return sorted(n for n in os.listdir(root / "ckpts") if not n.startswith("."))


def half_written(root: Path, name: str) -> Path:
    """The work directory a killed save of ``name`` left: data begun, no manifest."""
    (work,) = (root / "ckpts").glob(f".{name}.shardsafe-tmp-*")
    assert not (work / "manifest.json").exists()
    assert any(p.stat().st_size for p in (work / "data").iterdir())
    assert not (root / "ckpts" / name).exists()
    return work


def flip_a_byte(ckpt: Path) -> None:
    data_file = next(p for p in sorted((ckpt / "data").iterdir()) if p.stat().st_size > 0)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))


@pytest.mark.frameworks  # make test-frameworks: ~50 s of Lightning's own DDP launcher
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ddp_two_ranks_resume_in_a_fresh_process_is_exact(tmp_path: Path) -> None:
    ref, gen = tmp_path / "ref", tmp_path / "gen"
    assert run_job(ref, ref / "out.pt", "--devices", "2", "--epochs", "3") == 0

    # generation 1: save_top_k=1 deletes epoch 0's checkpoint through the plugin, then every
    # process is SIGKILLed while rank 0 writes epoch 2's: its work directory is left half-written
    args = ["--devices", "2", "--epochs", "3", "--checkpoints", "--kill-in-save", "2"]
    run_job(gen, gen / "g1.pt", *args, killed=True)
    assert checkpoints(gen) == ["epoch=1-step=8.ckpt"]
    work = half_written(gen, "epoch=2-step=12.ckpt")
    first = gen / "ckpts" / "epoch=1-step=8.ckpt"
    assert shardsafe.lightning.newest_checkpoint(gen / "ckpts") == str(first)
    # pointed at the half-written save, the resume raises naming it and loads nothing
    with pytest.raises(shardsafe.CheckpointError, match=re.escape(work.name)):
        shardsafe.lightning.CheckpointIO().load_checkpoint(work)
    assert (first / "manifest.json").is_file()
    assert cli_main(["verify", str(first)]) == 0
    saved = shardsafe.load_common_state_dict(first)
    assert saved["epoch"] == 1 and saved["global_step"] == 8 and "loops" in saved

    # generation 2, fresh processes: Lightning resumes from the newest committed checkpoint
    # and trains the third epoch again, saving it over the dead save's lease
    args = ["--devices", "2", "--epochs", "3", "--checkpoints", "--resume", "newest"]
    assert run_job(gen, gen / "g2.pt", *args) == 0
    want = torch.load(ref / "out.pt", weights_only=True)
    got = torch.load(gen / "g2.pt", weights_only=True)
    assert got["global_step"] == want["global_step"] == 12
    assert_same(got["model"], want["model"], "model")
    assert_same(got["optimizer"], want["optimizer"], "optimizer")
    assert_same(got["scheduler"], want["scheduler"], "scheduler")
    # Lightning keeps the checkpoint a run resumed from (save_top_k deletes only older others)
    assert checkpoints(gen) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]

    # a flipped byte: Lightning's resume raises the CheckpointError on the ranks, nothing loads
    last = gen / "ckpts" / "epoch=2-step=12.ckpt"
    assert cli_main(["verify", str(last)]) == 0
    flip_a_byte(last)
    assert cli_main(["verify", str(last)]) != 0
    args = ["--devices", "2", "--epochs", "4", "--resume", str(last)]
    assert run_job(gen, gen / "g3.pt", *args) == 3
    failure = json.loads((gen / "g3.pt.json").read_text())
    assert failure["checkpoint_error"], failure
    assert failure["error"] == "CorruptCheckpointError", failure
    assert not (gen / "g3.pt").exists()


@pytest.mark.frameworks  # make test-frameworks: each runs ~60 s of Lightning
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_model_parallel_fsdp2_two_ranks_saves_its_shards_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    ref, gen = tmp_path / "ref", tmp_path / "gen"
    mp = ("--devices", "2", "--model-parallel", "--epochs", "2", "--checkpoints", "--save-last")
    assert run_job(ref, ref / "out.pt", "--devices", "2", "--model-parallel", "--epochs", "2") == 0
    # generation 1: epoch 0 saved (and last.ckpt); killed while the ranks write epoch 1's shards
    run_job(gen, gen / "g1.pt", *mp, "--kill-in-save", "1", killed=True)
    assert checkpoints(gen) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    half_written(gen, "epoch=1-step=8.ckpt")
    first, last = gen / "ckpts" / "epoch=0-step=4.ckpt", gen / "ckpts" / "last.ckpt"
    assert cli_main(["verify", str(first)]) == 0
    reader = shardsafe.CheckpointReader(first)
    # each rank wrote its own half of the FSDP2 shards: two pieces per sharded tensor
    assert len(reader.manifest.tensors["state_dict.net.0.weight"].pieces) == 2
    assert len(reader.manifest.tensors["optimizer_states.0.state.net.0.weight.exp_avg"].pieces) == 2
    assert not (first / "meta.pt").exists()  # no pickled side file
    assert shardsafe.lightning.newest_checkpoint(gen / "ckpts") == str(last)

    # generation 2: Lightning's own ckpt_path="last" takes the committed last.ckpt (epoch 0)
    assert run_job(gen, gen / "g2.pt", *mp, "--resume", "last") == 0
    want = torch.load(ref / "out.pt", weights_only=True)
    got = torch.load(gen / "g2.pt", weights_only=True)
    assert got["global_step"] == want["global_step"] == 8
    assert_same(got["model"], want["model"], "model")
    assert_same(got["optimizer"], want["optimizer"], "optimizer")
    assert_same(got["scheduler"], want["scheduler"], "scheduler")
    assert shardsafe.load_common_state_dict(last)["global_step"] == 8

    flip_a_byte(last)
    assert run_job(gen, gen / "g3.pt", *mp, "--resume", "last") == 3
    failure = json.loads((gen / "g3.pt.json").read_text())
    assert failure["error"] == "CorruptCheckpointError", failure


@pytest.mark.frameworks  # make test-frameworks: each runs ~60 s of Lightning
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp1_two_ranks_killed_in_a_save_resumes_exactly_from_the_newest(tmp_path: Path) -> None:
    ref, gen = tmp_path / "ref", tmp_path / "gen"
    fsdp = ("--devices", "2", "--fsdp1", "--epochs", "2", "--checkpoints")
    assert run_job(ref, ref / "out.pt", "--devices", "2", "--fsdp1", "--epochs", "2") == 0
    # generation 1: epoch 0 committed; killed while the ranks write epoch 1's shards
    run_job(gen, gen / "g1.pt", *fsdp, "--kill-in-save", "1", killed=True)
    assert checkpoints(gen) == ["epoch=0-step=4.ckpt"]
    half_written(gen, "epoch=1-step=8.ckpt")
    first = gen / "ckpts" / "epoch=0-step=4.ckpt"
    assert cli_main(["verify", str(first)]) == 0
    reader = shardsafe.CheckpointReader(first)
    # FSDP1's ShardedTensors: each rank wrote its own rows at their global offset
    assert len(reader.manifest.tensors["state_dict.net.0.weight"].pieces) == 2
    assert len(reader.manifest.tensors["optimizer_states.0.state.net.0.weight.exp_avg"].pieces) == 2
    assert not (first / "meta.pt").exists()  # no pickled side file

    assert run_job(gen, gen / "g2.pt", *fsdp, "--resume", "newest") == 0
    want = torch.load(ref / "out.pt", weights_only=True)
    got = torch.load(gen / "g2.pt", weights_only=True)
    assert got["global_step"] == want["global_step"] == 8
    assert_same(got["model"], want["model"], "model")
    assert_same(got["optimizer"], want["optimizer"], "optimizer")
    assert_same(got["scheduler"], want["scheduler"], "scheduler")

    last = gen / "ckpts" / "epoch=1-step=8.ckpt"
    flip_a_byte(last)
    assert run_job(gen, gen / "g3.pt", *fsdp, "--resume", "newest") == 3
    failure = json.loads((gen / "g3.pt.json").read_text())
    assert failure["error"] == "CorruptCheckpointError", failure


def test_fsdp1_strategy_refuses_full_state_dicts() -> None:
    with pytest.raises(ValueError, match="sharded checkpoints only"):
        shardsafe.lightning.FSDPStrategy(state_dict_type="full")


# -- in this process, one device ---------------------------------------------------------------


def fit(root: Path, epochs: int, resume: str | None = None, **plugin: Any) -> dict[str, Any]:
    torch.manual_seed(1)
    model = Tiny()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        plugins=[shardsafe.lightning.CheckpointIO(**plugin)],
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=root / "ckpts", every_n_epochs=1, save_top_k=1, save_last=True
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, data(), ckpt_path=resume)
    return {
        "model": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "step": trainer.global_step,
    }


@pytest.mark.timeout(600)
def test_async_save_resume_is_exact_and_last_is_replaced(tmp_path: Path) -> None:
    want = fit(tmp_path / "ref", 3)
    fit(tmp_path / "run", 2, async_save=True)
    # save_last re-saves last.ckpt in place (an overwrite of our own checkpoint); top-1 keeps one
    assert checkpoints(tmp_path / "run") == ["epoch=1-step=16.ckpt", "last.ckpt"]
    last = tmp_path / "run" / "ckpts" / "last.ckpt"
    assert cli_main(["verify", str(last)]) == 0
    got = fit(tmp_path / "run", 3, resume=str(last))
    assert got["step"] == want["step"] == 24
    assert_same(got, want)


def test_remove_and_overwrite_refuse_what_the_plugin_did_not_write(tmp_path: Path) -> None:
    io = shardsafe.lightning.CheckpointIO()
    stranger = tmp_path / "epoch=0-step=1.ckpt"
    torch.save({"state_dict": {}}, stranger)
    with pytest.raises(shardsafe.CheckpointExistsError, match="refusing to delete"):
        io.remove_checkpoint(stranger)
    with pytest.raises(shardsafe.CheckpointExistsError, match="refusing to overwrite"):
        io.save_checkpoint({"epoch": 0}, stranger)
    assert stranger.is_file()

    other = tmp_path / "other.ckpt"  # a shardsafe checkpoint, written by someone else
    shardsafe.save({"w": torch.ones(2)}, other)
    with pytest.raises(shardsafe.CheckpointExistsError, match="not written by"):
        io.remove_checkpoint(other)
    assert (other / "manifest.json").is_file()

    a_dir = tmp_path / "notes.ckpt"
    a_dir.mkdir()
    (a_dir / "keep.txt").write_text("x")
    with pytest.raises(shardsafe.CheckpointExistsError):
        io.remove_checkpoint(a_dir)
    assert (a_dir / "keep.txt").is_file()

    ours = tmp_path / "ours.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}, ours)
    back = io.load_checkpoint(ours)
    assert back["epoch"] == 2 and torch.equal(back["state_dict"]["w"], torch.arange(3.0))
    io.remove_checkpoint(ours)
    assert not ours.exists()
    io.remove_checkpoint(ours)  # gone already: nothing to delete, as Lightning's own does
    io.teardown()


class Opaque:
    """A value the safe codec cannot store (a class nothing allow-lists)."""


class KeepsAnObject(pl.Callback):
    def state_dict(self) -> dict[str, Any]:
        return {"thing": Opaque()}


def test_state_the_codec_cannot_store_fails_the_save_by_name(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        plugins=[shardsafe.lightning.CheckpointIO()],
        callbacks=[
            KeepsAnObject(),
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(shardsafe.CheckpointError, match="Opaque"):
        trainer.fit(Tiny(), data())
    assert not any((tmp_path / "ckpts").glob("*/manifest.json"))


def test_a_file_checkpoint_is_refused_on_load(tmp_path: Path) -> None:
    stranger = tmp_path / "torch.ckpt"
    torch.save({"state_dict": {}}, stranger)
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="not a shardsafe checkpoint"):
        shardsafe.lightning.CheckpointIO().load_checkpoint(stranger)


def test_newest_checkpoint_is_the_last_committed_one_and_never_a_leftover(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    assert shardsafe.lightning.newest_checkpoint(ckpts) is None  # a first run: no directory yet
    io = shardsafe.lightning.CheckpointIO()
    io.save_checkpoint({"global_step": 9, "w": torch.ones(2)}, ckpts / "epoch=8-step=9.ckpt")
    io.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, ckpts / "epoch=2-step=3.ckpt")
    older = ckpts / "epoch=2-step=3.ckpt"  # committed last: a run resumed from an older one
    assert shardsafe.lightning.newest_checkpoint(ckpts) == str(older)

    # after it, what a newest checkpoint must never be: a save's remains (hidden, or a copy
    # without its manifest), a stranger's file or shardsafe checkpoint
    (ckpts / ".epoch=3-step=4.ckpt.shardsafe-tmp-0123abcd" / "data").mkdir(parents=True)
    torn = ckpts / "epoch=3-step=4.ckpt"
    (torn / "data").mkdir(parents=True)
    (torn / "data" / "rank-00000-00.bin").write_bytes(b"\0" * 64)
    torch.save({"state_dict": {}}, ckpts / "torch.ckpt")
    shardsafe.save({"w": torch.ones(2)}, ckpts / "other.ckpt")
    assert shardsafe.lightning.newest_checkpoint(ckpts) == str(older)
    with pytest.raises(shardsafe.CheckpointError, match=re.escape("epoch=3-step=4.ckpt")):
        io.load_checkpoint(torn)

    io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, ckpts / "last.ckpt")
    assert shardsafe.lightning.newest_checkpoint(ckpts) == str(ckpts / "last.ckpt")
    # an overwrite that cannot exchange directories, killed between its two renames: the
    # complete checkpoint lies aside under a hidden name, and nothing is at last.ckpt
    aside = ckpts / ".last.ckpt.shardsafe-old-0123abcd"
    (ckpts / "last.ckpt").rename(aside)
    assert shardsafe.lightning.newest_checkpoint(ckpts) == str(aside)
    assert io.load_checkpoint(aside)["global_step"] == 4
    (ckpts / "last.ckpt").mkdir()  # the new one half-moved in: the old one still counts
    assert shardsafe.lightning.newest_checkpoint(ckpts) == str(aside)
    aside.rename(ckpts / "last.ckpt.tmp")
    (ckpts / "last.ckpt").rmdir()
    (ckpts / "last.ckpt.tmp").rename(ckpts / "last.ckpt")
    (ckpts / "last.ckpt" / "manifest.json").write_text("{")  # damage is raised, not skipped
    with pytest.raises(shardsafe.CheckpointError, match=re.escape("last.ckpt")):
        shardsafe.lightning.newest_checkpoint(ckpts)
    io.teardown()
