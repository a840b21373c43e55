"""Hugging Face accelerate runs saving and resuming through ``shardsafe.accelerate``.

accelerate itself runs: ``Accelerator.prepare`` (DDP over two gloo ranks on CPU),
``accumulate``, ``backward``, its wrapped optimizer, scheduler and dataloader,
``skip_first_batches`` for a resume in the middle of an epoch, and
``register_for_checkpointing``. Each generation is a fresh set of processes; a generation is
ended by SIGKILL of every rank, after a committed save or in the middle of one, and the next
resumes from the newest committed step of a ``CheckpointManager``.

FSDP2: accelerate enables FSDP only on an accelerator (``AcceleratorState.__init__`` switches
``distributed_type`` to FSDP only inside its ``MULTI_GPU``... branch; with ``cpu=True`` an
``fsdp_plugin`` is dropped and the model wrapped in DDP). The FSDP2 test therefore runs
accelerate's loop over a model the user ``fully_shard``-ed on two gloo ranks, accelerate
itself seeing one process (no DDP wrap).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import RankFailure, run_ranks
from faultinject import patch_data_writes
from torch.distributed.tensor import DTensor

pytest.importorskip("accelerate")

import shardsafe
import shardsafe.accelerate
from shardsafe.cli import main as cli_main

PER_EPOCH = 3  # batches per rank and epoch (24 samples, batches of 4, two ranks)
EPOCHS = 2
EVERY = 2  # a checkpoint every EVERY steps


class Counter:
    """An object registered for checkpointing: counts the samples seen."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = int(sd["seen"])


class Run:
    """One rank's accelerate objects, prepared the way a training script prepares them."""

    def __init__(self, rank: int, world: int, fsdp: bool = False) -> None:
        from accelerate import Accelerator

        if fsdp:
            # accelerate sees one process (it wraps a multi-CPU model in DDP, which refuses
            # DTensor parameters); the two ranks are torch.distributed's, the sharding the user's
            self.acc = Accelerator(cpu=True)
            assert self.acc.num_processes == 1 and not self.acc.use_distributed
        else:
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
            )
            self.acc = Accelerator(cpu=True)
            assert self.acc.num_processes == world
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        g = torch.Generator().manual_seed(5)
        x = torch.randn(24, 4, generator=g)
        y = x[:, :2].sin()
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            x, y = x[rank::world], y[rank::world]  # each rank its own samples
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
        # its own generator: every iterator a DataLoader starts draws a seed from it (from the
        # global one without it), and a resume inside an epoch starts one iterator more
        dl = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y),
            batch_size=4,
            shuffle=False,
            generator=torch.Generator().manual_seed(7),
        )
        self.model, self.opt, self.sched, self.dl = self.acc.prepare(model, opt, sched, dl)
        assert len(self.dl) == PER_EPOCH
        self.done = 0  # optimizer steps completed (accelerator.step restarts every epoch)
        self.counter = Counter()
        self.acc.register_for_checkpointing(self.counter)
        # every rank's generators differ (dropout masks): only a per-rank restore reproduces them
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        # the job's processes, for a kill of all of them at once
        pids: list[Any] = [None] * world
        torch.distributed.all_gather_object(pids, os.getpid())
        self.pids = [int(p) for p in pids]

    def kill_job(self) -> None:
        """SIGKILL every rank, this one last: no finally, no atexit, like a scheduler's kill."""
        for pid in self.pids:
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def train(
        self,
        manager: shardsafe.CheckpointManager | None = None,
        *,
        kill_after: int | None = None,
        kill_in_save: int | None = None,
    ) -> None:
        """accelerate's loop from ``acc.step`` to the end, saving every EVERY steps."""
        acc = self.acc
        start = self.done
        for epoch in range(start // PER_EPOCH, EPOCHS):
            skip = start % PER_EPOCH if epoch == start // PER_EPOCH else 0
            for xb, yb in acc.skip_first_batches(self.dl, skip) if skip else self.dl:
                with acc.accumulate(self.model):
                    loss = torch.nn.functional.mse_loss(self.model(xb), yb)
                    acc.backward(loss)
                    self.opt.step()
                    self.sched.step()
                    self.opt.zero_grad()
                self.counter.seen += len(xb)
                self.done += 1
                if manager is not None and self.done % EVERY == 0:
                    if self.done == kill_in_save:  # the job dies while its data files are written
                        patch_data_writes(16, self.kill_job)
                    shardsafe.accelerate.save_state(acc, manager, step=self.done)
                if self.done == kill_after and manager is not None:
                    manager.wait()  # the previous save committed (rank 0: pointer written)
                    if torch.distributed.get_rank() == 0:
                        self.kill_job()
        if manager is not None:
            manager.close()  # waits for the last save

    def state(self) -> dict[str, Any]:
        """What an exact resume must reproduce (draws from the generators: call it last)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return _np(
            {
                "model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.opt.optimizer),
                "scheduler": self.sched.state_dict(),
                "step": self.acc.step,
                "done": self.done,
                "seen": self.counter.seen,
                "rng": (torch.rand(3), random.random(), float(np.random.rand())),
            }
        )


def _generation(
    rank: int,
    world: int,
    root: str | None,
    resume_at: int | None,
    kill_after: int | None,
    kill_in_save: int | None,
    fsdp: bool,
) -> Any:
    """One generation: prepare, resume from the newest committed step (checking it is
    ``resume_at``), train to the end or until killed, saving into the manager at ``root``."""
    run = Run(rank, world, fsdp)
    manager = shardsafe.CheckpointManager(root) if root else None
    if manager is not None and resume_at is not None:
        run.done = shardsafe.accelerate.load_state(run.acc, manager) or 0
        assert run.done == resume_at
    run.train(manager, kill_after=kill_after, kill_in_save=kill_in_save)
    return run.state()


def _resume_then_damage(rank: int, world: int, root: str) -> Any:
    """Resume the killed run from its newest committed step and finish it; then damage that
    last step: loading it by path raises and changes nothing, the manager falls back to the
    step before, and training on from there ends where the uninterrupted run ended."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    run = Run(rank, world)
    manager = shardsafe.CheckpointManager(root)
    run.done = shardsafe.accelerate.load_state(run.acc, manager) or 0
    assert run.done == 4
    run.train(manager)
    resumed = run.state()

    newest = Path(manager.checkpoint_path(EPOCHS * PER_EPOCH))
    if rank == 0:
        flip_a_byte(newest)
    torch.distributed.barrier()
    before = _np(get_model_state_dict(run.model))
    try:
        shardsafe.accelerate.load_state(run.acc, newest)
        error = None
    except shardsafe.CheckpointError as e:
        error = type(e).__name__
    unchanged = _same(before, _np(get_model_state_dict(run.model)))
    manager = shardsafe.CheckpointManager(root)
    fell_back_to = run.done = shardsafe.accelerate.load_state(run.acc, manager) or 0
    run.train()
    return {
        "resumed": resumed,
        "error": error,
        "unchanged": unchanged,
        "fell_back_to": fell_back_to,
        "after_fallback": run.state(),
    }


def _np(tree: Any) -> Any:
    """Tensors as numpy copies: what crosses the result queue must outlive the rank."""
    if isinstance(tree, DTensor):
        return _np(tree.to_local())  # this rank's shard
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().numpy()
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_np(v) for v in tree)
    return tree


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


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def _killed(fn: Any, *args: Any) -> None:
    """Run a generation that must end with every rank SIGKILLed."""
    with pytest.raises(RankFailure) as failed:
        run_ranks(fn, 2, *args, timeout=400)
    assert failed.value.errors == {r: f"process exited with code {-signal.SIGKILL}" for r in (0, 1)}


def _committed(root: Path) -> list[int]:
    return shardsafe.CheckpointManager(root, read_only=True).steps()


def _leftovers(root: Path) -> list[str]:
    """Entries of ``root`` that are neither a committed step nor the pointer."""
    steps = {
        Path(shardsafe.CheckpointManager(root, read_only=True).checkpoint_path(s)).name
        for s in _committed(root)
    }
    return sorted(n for n in os.listdir(root) if n not in steps and n != "latest")


@pytest.mark.timeout(900)
def test_ddp_two_ranks_killed_twice_resume_exact(tmp_path: Path) -> None:
    end = EPOCHS * PER_EPOCH
    want = run_ranks(_generation, 2, None, None, None, None, False, timeout=400)
    root = tmp_path / "run"
    # killed after step 5 (the middle of an epoch), step 4 committed
    _killed(_generation, str(root), None, 5, None, False)
    assert _committed(root) == [2, 4]
    assert cli_main(["verify", _step_path(root, 4)]) == 0
    reader = shardsafe.CheckpointReader(_step_path(root, 4))
    assert "models.0.0.weight" in reader.tensor_keys()
    assert "optimizers.0.state.0.weight.exp_avg" in reader.tensor_keys()
    # resumed from step 4, killed while step 6's data files were written
    _killed(_generation, str(root), 4, None, end, False)
    assert _committed(root) == [2, 4]
    assert _leftovers(root), "the save cut off left nothing behind"
    # resumed from step 4 again (never the half-written 6), to the end
    got = run_ranks(_resume_then_damage, 2, str(root), timeout=400)
    for rank in range(2):
        assert got[rank]["resumed"]["done"] == want[rank]["done"] == end
        assert got[rank]["resumed"]["seen"] == want[rank]["seen"] == 24
        assert_same(got[rank]["resumed"], want[rank], f"rank {rank}")
        assert got[rank]["error"] == "CorruptCheckpointError"
        assert got[rank]["unchanged"]
        assert got[rank]["fell_back_to"] == 4
        assert_same(got[rank]["after_fallback"], want[rank], f"rank {rank} after the fallback")
    assert not np.array_equal(want[0]["rng"][0], want[1]["rng"][0])  # the ranks' own streams


def _step_path(root: Path, step: int) -> str:
    return shardsafe.CheckpointManager(root, read_only=True).checkpoint_path(step)


@pytest.mark.timeout(600)
def test_fsdp2_two_ranks_killed_in_a_save_resume_exact(tmp_path: Path) -> None:
    end = EPOCHS * PER_EPOCH
    want = run_ranks(_generation, 2, None, None, None, None, True, timeout=400)
    root = tmp_path / "run"
    _killed(_generation, str(root), None, None, 4, True)
    assert _committed(root) == [2]
    assert _leftovers(root)
    assert cli_main(["verify", _step_path(root, 2)]) == 0
    reader = shardsafe.CheckpointReader(_step_path(root, 2))
    # the weight and its Adam moment stored as two row shards, one file of each rank
    for key in ("models.0.0.weight", "optimizers.0.state.0.weight.exp_avg"):
        entry = reader.manifest.tensors[key]
        assert entry.shape == (8, 4)
        assert sorted(p.offset for p in entry.pieces) == [(0, 0), (4, 0)]
        files = {reader.manifest.files[p.extent.file].rank for p in entry.pieces}
        assert files == {0, 1}, key
    got = run_ranks(_generation, 2, str(root), 2, None, None, True, timeout=400)
    for rank in range(2):
        assert got[rank]["done"] == want[rank]["done"] == end
        assert_same(got[rank], want[rank], f"rank {rank}")


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


def test_a_manager_needs_a_step_and_its_own_settings(tmp_path: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 3))
    manager = shardsafe.CheckpointManager(tmp_path / "run", async_save=False)
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.accelerate.load_state(acc, manager)
    with pytest.raises(shardsafe.ValidationError, match="needs step="):
        shardsafe.accelerate.save_state(acc, manager)
    with pytest.raises(shardsafe.ValidationError, match="own Saver"):
        shardsafe.accelerate.save_state(acc, manager, step=1, overwrite=True)
    with pytest.raises(shardsafe.ValidationError, match="names a step"):
        shardsafe.accelerate.save_state(acc, tmp_path / "plain", step=1)
    with pytest.raises(shardsafe.ValidationError, match="names a step"):
        shardsafe.accelerate.load_state(acc, tmp_path / "plain", step=1)
    with pytest.raises(shardsafe.ValidationError, match="a checkpoint path or"):
        shardsafe.accelerate.load_state(acc, 3)
    local = shardsafe.CheckpointManager(tmp_path / "tiered", local_root=tmp_path / "local")
    with pytest.raises(shardsafe.ValidationError, match="local_root"):
        shardsafe.accelerate.save_state(acc, local, step=1)
    local.close()

    with torch.no_grad():
        model.weight.fill_(1.0)
    shardsafe.accelerate.save_state(acc, manager, step=3)
    with torch.no_grad():
        model.weight.fill_(2.0)
    shardsafe.accelerate.save_state(acc, manager, step=5)
    assert manager.steps() == [3, 5]
    assert shardsafe.accelerate.load_state(acc, manager, step=3) == 3
    assert torch.equal(model.weight, torch.ones(3, 3))
    assert shardsafe.accelerate.load_state(acc, manager) == 5
    assert torch.equal(model.weight, torch.full((3, 3), 2.0))
    manager.close()
