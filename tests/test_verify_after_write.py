"""``verify_after_write``: a data file that reaches the disk differently from what was handed to
the write is noticed by reading it back, written once more, and fails the save if it differs
again (a device corrupting data)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from faultinject import patch_corrupting_writes

import shardsafe
from shardsafe import CheckpointManager, CorruptCheckpointError, Saver, ShardedTensor


def _state() -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(4096, dtype=torch.float32)),
        "step": 3,
    }


def _template() -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4096))}


@pytest.mark.parametrize("use_async", [False, True])
def test_one_corrupted_write_is_rewritten(
    tmp_path: Path, use_async: bool, caplog: pytest.LogCaptureFixture
) -> None:
    undo = patch_corrupting_writes(1)
    try:
        saver = Saver(verify_after_write=True, files_per_rank=1)
        with caplog.at_level(logging.WARNING, logger="shardsafe"):
            if use_async:
                saver.async_save(_state(), tmp_path / "c").result(timeout=60)
            else:
                saver.save(_state(), tmp_path / "c")
        saver.close()
    finally:
        undo()
    assert "read back differently" in caplog.text and "writing it again" in caplog.text
    out = shardsafe.load(_template(), tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32))
    assert shardsafe.CheckpointReader(tmp_path / "c").verify().ok


def test_a_device_that_keeps_corrupting_fails_the_save(tmp_path: Path) -> None:
    undo = patch_corrupting_writes(2)
    try:
        saver = Saver(verify_after_write=True, files_per_rank=1)
        with pytest.raises(CorruptCheckpointError, match="twice") as info:
            saver.save(_state(), tmp_path / "c")
        saver.close()
    finally:
        undo()
    assert "rank 0 on " in str(info.value)
    assert not (tmp_path / "c").exists()  # nothing committed


def test_without_verification_the_corruption_is_found_only_at_load(tmp_path: Path) -> None:
    undo = patch_corrupting_writes(1)
    try:
        Saver(files_per_rank=1).save(_state(), tmp_path / "c")
    finally:
        undo()
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        shardsafe.load(_template(), tmp_path / "c")


def test_the_manager_passes_the_option_on(tmp_path: Path) -> None:
    undo = patch_corrupting_writes(1)
    try:
        with CheckpointManager(tmp_path, async_save=False, verify_after_write=True) as manager:
            manager.save(1, _state())
    finally:
        undo()
    out = shardsafe.load(_template(), tmp_path / "step_000000001")
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32))
