"""Hugging Face accelerate runs saving and resuming through ``shardsafe.accelerate``.

accelerate itself runs: ``Accelerator.prepare`` (DDP over two gloo ranks on CPU),
``accumulate``, ``backward``, its wrapped optimizer, scheduler and dataloader, and
``register_for_checkpointing``; each generation is a fresh set of processes.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_ranks

pytest.importorskip("accelerate")

import shardsafe
import shardsafe.accelerate
from shardsafe.cli import main as cli_main


class Counter:
    """An object registered for checkpointing: counts the samples seen."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = int(sd["seen"])


def _run(rank: int, world: int, path_in: str | None, path_out: str | None, epochs: int) -> Any:
    """One generation: prepare, (load), train ``epochs`` epochs, (save); the state it ends with."""
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    acc = Accelerator(cpu=True)
    assert acc.num_processes == world
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 4, generator=g)
    dl = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x[:, :2].sin()), batch_size=4, shuffle=False
    )
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    # every rank's generators differ (dropout masks): only a per-rank restore reproduces them
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    if path_in:
        try:
            shardsafe.accelerate.load_state(acc, path_in)
        except shardsafe.CheckpointError as e:
            unchanged = torch.equal(get_model_state_dict(model)["0.weight"], _fresh_first_weight())
            return {"error": type(e).__name__, "model_unchanged": unchanged}
    for _ in range(epochs):
        for xb, yb in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            counter.seen += len(xb)
    if path_out:
        shardsafe.accelerate.save_state(acc, path_out)
    return _np(
        {
            "model": get_model_state_dict(model),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "step": acc.step,
            "seen": counter.seen,
            "rng": (torch.rand(3), random.random(), float(np.random.rand())),
        }
    )


def _np(tree: Any) -> Any:
    """Tensors as numpy copies: what crosses the result queue must outlive the rank."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().numpy()
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_np(v) for v in tree)
    return tree


def _fresh_first_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 8).weight.detach()


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def flip_a_byte(ckpt: Path) -> None:
    data_file = next(p for p in sorted((ckpt / "data").iterdir()) if p.stat().st_size > 0)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))


@pytest.mark.timeout(900)
def test_ddp_two_ranks_resume_in_fresh_processes_is_exact(tmp_path: Path) -> None:
    want = run_ranks(_run, 2, None, None, 2, timeout=400)
    first = tmp_path / "epoch1"
    run_ranks(_run, 2, None, str(first), 1, timeout=400)
    assert cli_main(["verify", str(first)]) == 0
    reader = shardsafe.CheckpointReader(first)
    assert "models.0.0.weight" in reader.tensor_keys()
    assert "optimizers.0.state.0.weight.exp_avg" in reader.tensor_keys()
    got = run_ranks(_run, 2, str(first), None, 1, timeout=400)
    for rank in range(2):
        assert got[rank]["step"] == want[rank]["step"]
        assert got[rank]["seen"] == want[rank]["seen"] == 24
        assert_same(got[rank], want[rank], f"rank {rank}")
    assert not np.array_equal(got[0]["rng"][0], got[1]["rng"][0])  # the ranks' own streams

    damaged = tmp_path / "damaged"
    shutil.copytree(first, damaged)
    flip_a_byte(damaged)
    failed = run_ranks(_run, 2, str(damaged), None, 1, timeout=400)
    for rank in range(2):
        assert failed[rank] == {"error": "CorruptCheckpointError", "model_unchanged": True}


def test_load_refuses_a_checkpoint_with_other_objects(tmp_path: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 3))
    shardsafe.save({"w": torch.ones(2)}, tmp_path / "plain")
    with pytest.raises(shardsafe.IncompatibleRequestError, match="not written by"):
        shardsafe.accelerate.load_state(acc, tmp_path / "plain")
    shardsafe.accelerate.save_state(acc, tmp_path / "one")
    acc._models.append(model)
    with pytest.raises(shardsafe.IncompatibleRequestError, match="models: 1 saved, 2 here"):
        shardsafe.accelerate.load_state(acc, tmp_path / "one")
