"""A Megatron-Core run SIGKILLed in the middle of a save resumes in another layout, exactly.

Generation 1 (2 gloo ranks, TP2) trains a GPTModel with Megatron's DDP, optimizer and
learning-rate schedule, saves iteration 2 through ``shardsafe.megatron_api`` (the one line
``from shardsafe import megatron_api as dist_checkpointing``), trains on and is SIGKILLed,
every rank, while writing iteration 4. Generation 2, in fresh processes under TP1 x PP2, is
refused the half-written iteration 4, resumes from the tracker's iteration 2 and trains to the
end: weights, Adam moments and steps, learning rate and schedule equal an uninterrupted TP2 run
bit for bit. The loop is in ``megatron_resume``; ``test_megatron_019`` runs the same journey
against megatron-core 0.19.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import RankFailure, run_ranks
from megatron_models import consolidate
from megatron_resume import (
    KILLED,
    LAYERS,
    SAVED,
    TOTAL,
    TRACKER,
    generation_1,
    iter_dir,
    load_damaged,
    resume,
    uninterrupted,
)
from rank_pool import RankPool

from shardsafe.cli import main as cli_main

pytestmark = pytest.mark.timeout(400)

FIRST = (2, 1)  # TP2
SECOND = (1, 2)  # TP1 x PP2


def full(parts: list[dict], pick) -> dict[str, torch.Tensor]:
    """TP1/PP1 tensors from every rank's report (``pick`` chooses the tensors of a report)."""
    pps = 1 + max(p["pp"] for p in parts)
    return consolidate(
        [{"tp": p["tp"], "pp": p["pp"], "tensors": pick(p)} for p in parts], LAYERS // pps
    )


def assert_same_run(got: list[dict], want: list[dict]) -> None:
    """Weights, Adam moments and steps, learning rate and schedule: equal, bit for bit."""
    picks = {"params": lambda p: p["params"]}
    for field in ("exp_avg", "exp_avg_sq"):
        picks[field] = lambda p, f=field: {n: st[f] for n, st in p["adam"].items()}
    for what, pick in picks.items():
        a, b = full(got, pick), full(want, pick)
        assert sorted(a) == sorted(b), what
        for name in b:
            assert a[name].shape == b[name].shape, (what, name)
            assert torch.equal(a[name], b[name]), (what, name)
    for run in (got, want):  # Adam's step count, per parameter
        steps = {float(st["step"]) for p in run for st in p["adam"].values()}
        assert steps == {float(TOTAL)}, steps
    assert {p["iteration"] for p in got} == {p["iteration"] for p in want} == {TOTAL}
    assert {p["num_steps"] for p in got} == {p["num_steps"] for p in want} == {TOTAL}
    assert {tuple(p["lr"]) for p in got} == {tuple(p["lr"]) for p in want}


def flip_a_model_byte(path: Path) -> str:
    """Flip one byte of a model weight's stored bytes; the key it belongs to."""
    tensors = json.loads((path / "manifest.json").read_text())["tensors"]
    key = next(k for k in sorted(tensors) if k.endswith("linear_qkv.weight"))
    piece = tensors[key]["pieces"][0]
    with open(path / piece["file"], "r+b") as f:
        f.seek(piece["byte_offset"] + 5)
        byte = f.read(1)
        f.seek(piece["byte_offset"] + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    return key


def test_killed_mid_save_resumes_in_another_layout_exactly(tmp_path: Path) -> None:
    run_journey(tmp_path)


def run_journey(tmp_path: Path) -> None:
    """The whole journey (also run against megatron-core 0.19 by ``test_megatron_019``)."""
    root = tmp_path / "run"
    root.mkdir()
    with pytest.raises(RankFailure) as killed:
        run_ranks(generation_1, 2, str(root), *FIRST, 1 << 10, timeout=300)
    assert killed.value.errors == {r: "process exited with code -9" for r in range(2)}
    assert (root / TRACKER).read_text() == str(SAVED)
    half, saved = Path(iter_dir(str(root), KILLED)), Path(iter_dir(str(root), SAVED))
    assert half.is_dir() and not (half / "manifest.json").exists()

    pool = RankPool(2)  # generation 2: fresh processes
    try:
        resumed = pool.run(resume, str(root), *SECOND, timeout=300)
        for r in resumed:
            refused = r["refused"]
            assert refused["raised"] is not None, "the half-written save was loaded"
            assert refused["error"] == {"checkpoint_error": True, "checkpointing_exception": True}
            assert str(half) in refused["message"], refused["message"]
            assert refused["untouched"]
            assert r["resumed_at"] == SAVED
        assert (root / TRACKER).read_text() == str(TOTAL)
        assert cli_main(["verify", str(half)]) == 0  # saved again where the killed save was
        want = pool.run(uninterrupted, *FIRST, timeout=300)
        assert_same_run(resumed, want)

        assert cli_main(["verify", str(saved)]) == 0  # `shardsafe verify`
        key = flip_a_model_byte(saved)
        assert cli_main(["verify", str(saved)]) == 1
        damaged = pool.run(load_damaged, str(saved), *SECOND, timeout=300)
    finally:
        pool.close()
    for d in damaged:
        assert d["raised"] is not None, "a checkpoint with a flipped byte was loaded"
        assert d["error"] == {"checkpoint_error": True, "checkpointing_exception": True}, d
    assert any(
        d["raised"] == "CorruptCheckpointError"
        and key in d["message"]
        and "checksum" in d["message"]
        for d in damaged
    ), damaged
