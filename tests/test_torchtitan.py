"""torchtitan's own ``CheckpointManager.save``/``load`` over shardsafe checkpoints.

torchtitan 0.3.0's trainer does not run on a CPU-only torch (it calls ``torch.cuda.set_device``),
so these tests drive its checkpoint manager the way the trainer does, with its real state objects:
an FSDP2 model in its ``ModelWrapper``, its ``OptimizersContainer`` and
``LRSchedulersContainer``, its ``ParallelAwareDataloader`` and a ``train_state``; 2 gloo ranks,
each generation in fresh processes; resumed state exact against an uninterrupted run. The first
generation is SIGKILLed (every rank) in the middle of a later save; a resume falls back past a
step with a flipped byte.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import RankFailure, run_ranks

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (make test-frameworks installs it)"
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLD = 2


class _Tokens(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A rank's stream of batches: which ones it read is the dataloader's state."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(100 + self.rank)
        for _ in range(64):
            yield torch.randn(4, generator=g)


class _TrainState:
    """The trainer's own ``train_state`` (``step``, ``ntokens_seen``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


def _setup(rank: int, world: int, seed: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.05})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=20
    )
    loader = ParallelAwareDataloader(_Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    return {
        "model": model,
        "optimizers": optimizers,
        "schedulers": schedulers,
        "loader": loader,
        "it": None,
        "train_state": _TrainState(),
    }


def _manager(
    parts: dict[str, Any],
    root: str,
    async_mode: str,
    sd_adapter: Any = None,
    stock: bool = False,
    **config: Any,
) -> Any:
    """Built from its config, as torchtitan's trainer builds ``config.checkpoint`` (``stock``:
    torchtitan's own manager, DCP's FileSystemWriter)."""
    from torchtitan.components.checkpoint import CheckpointManager

    from shardsafe.torchtitan_checkpoint import ShardsafeCheckpointManager

    cfg = (CheckpointManager if stock else ShardsafeCheckpointManager).Config(
        enable=True, folder="ckpt", interval=2, keep_latest_k=2, async_mode=async_mode, **config
    )
    return cfg.build(
        dataloader=parts["loader"],
        model_parts=[parts["model"]],
        optimizers=parts["optimizers"],
        lr_schedulers=parts["schedulers"],
        states={"train_state": parts["train_state"]},
        sd_adapter=sd_adapter,
        base_folder=root,
    )


def _train(parts: dict[str, Any], steps: int, manager: Any = None) -> None:
    """The trainer's loop: step, then ``checkpointer.save(step)``."""
    if parts["it"] is None:
        parts["it"] = iter(parts["loader"])
    ts = parts["train_state"]
    for _ in range(steps):
        ts.step += 1
        batch = next(parts["it"])
        ts.ntokens_seen += batch.numel()
        loss = parts["model"](batch).square().mean()
        loss.backward()
        parts["optimizers"].step()
        parts["optimizers"].zero_grad()
        parts["schedulers"].step()
        if manager is not None:
            manager.save(ts.step, last_step=False)


def _digest(parts: dict[str, Any], next_batch: bool = True) -> dict[str, Any]:
    """Everything a resume must restore, as plain tensors: weights, optimizer state, lr, the
    step, and (``next_batch``: taken from the loader) the data the loader gives next."""
    from torch.distributed.tensor import DTensor

    def plain(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v.full_tensor().clone()
        return v.clone() if isinstance(v, torch.Tensor) else v

    out = {
        "model": {k: plain(v) for k, v in parts["model"].state_dict().items()},
        "optim": {k: plain(v) for k, v in parts["optimizers"].state_dict().items()},
        "lr": [s.get_last_lr() for s in parts["schedulers"].schedulers],
        "train_state": parts["train_state"].state_dict(),
    }
    if next_batch:
        if parts["it"] is None:
            parts["it"] = iter(parts["loader"])
        out["next_batch"] = next(parts["it"]).clone()
    return out


def _bytes(digest: dict[str, Any]) -> bytes:
    """Tensors leave a rank as bytes (a queue would share their memory with a dead process)."""
    buf = io.BytesIO()
    torch.save(digest, buf)
    return buf.getvalue()


def _unbytes(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw), weights_only=True)


def _uninterrupted(rank: int, world: int, steps: int) -> bytes:
    parts = _setup(rank, world, seed=0)
    _train(parts, steps)
    return _bytes(_digest(parts))


def _uninterrupted_at(rank: int, world: int, middle: int, steps: int) -> bytes:
    """The state after ``middle`` steps (no batch taken) and after ``steps``."""
    parts = _setup(rank, world, seed=0)
    _train(parts, middle)
    at_middle = _digest(parts, next_batch=False)
    _train(parts, steps - middle)
    return _bytes({"middle": at_middle, "end": _digest(parts)})


def _killed_generation(rank: int, world: int, root: str, async_mode: str) -> None:
    """Trains and saves steps 2, 4, 6, then every rank is SIGKILLed 16 bytes into the data of
    step 8's save."""
    from faultinject import kill_every_rank, patch_data_writes

    Path(root, f"pid-{rank}").write_text(str(os.getpid()))
    parts = _setup(rank, world, seed=0)
    manager = _manager(parts, root, async_mode)
    assert manager.load() is False  # a fresh start
    _train(parts, 6, manager)
    manager.maybe_wait_for_saving()  # step 6 committed
    patch_data_writes(16, lambda: kill_every_rank(root, world))
    _train(parts, 2, manager)
    manager.maybe_wait_for_saving()
    raise AssertionError("the save of step 8 was not killed")


def _first_generation(
    rank: int, world: int, root: str, async_mode: str, steps: int, stock: bool = False
) -> None:
    parts = _setup(rank, world, seed=0)
    manager = _manager(parts, root, async_mode, stock=stock)
    try:
        assert manager.load() is False  # a fresh start
        _train(parts, steps, manager)
        manager.maybe_wait_for_saving()
    finally:
        manager.close()


def _resume(rank: int, world: int, root: str, steps: int) -> bytes:
    parts = _setup(rank, world, seed=1)  # different weights: only the load makes them equal
    manager = _manager(parts, root, "disabled")
    try:
        assert manager.load() is True
        _train(parts, steps, manager)
        manager.maybe_wait_for_saving()
        return _bytes(_digest(parts))
    finally:
        manager.close()


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _visible(ckpt: Path) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if not n.startswith("."))


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_torchtitan_killed_mid_save_resumes_exactly(tmp_path: Path, async_mode: str) -> None:
    """Generation 1 is SIGKILLed (every rank) in the middle of step 8's save; generation 2
    resumes the newest committed step, 6, and ends equal to an uninterrupted run."""
    from shardsafe.cli import main
    from shardsafe.torchtitan_checkpoint import _committed_steps

    expected = [_unbytes(r) for r in run_ranks(_uninterrupted, WORLD, 8, timeout=240)]
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_generation, WORLD, str(tmp_path), async_mode, timeout=240)
    assert sorted(info.value.errors) == list(range(WORLD))
    assert all("exited with code -9" in e for e in info.value.errors.values()), info.value
    ckpt = tmp_path / "ckpt"
    # interval 2 saved steps 2, 4, 6 (keep_latest_k=2 deletes the older ones, in the background);
    # step 8's save left its half-written work directory, not a step
    assert [s for s, _ in _committed_steps(str(ckpt))][-1] == 6
    assert "step-8" not in os.listdir(ckpt)
    assert any(n.startswith(".step-8") for n in os.listdir(ckpt)), os.listdir(ckpt)
    assert main(["verify", str(ckpt / "step-6")]) == 0  # a shardsafe checkpoint
    got = [_unbytes(r) for r in run_ranks(_resume, WORLD, str(tmp_path), 2, timeout=240)]
    for rank in range(WORLD):
        _assert_same(got[rank], expected[rank], f"rank {rank}")
    # the killed save's remains went when generation 2's manager started
    assert sorted(os.listdir(ckpt)) == ["step-6", "step-8"]
    assert main(["verify", str(ckpt / "step-8")]) == 0


def test_resume_from_a_folder_torchtitans_own_manager_wrote(tmp_path: Path) -> None:
    expected = [_unbytes(r) for r in run_ranks(_uninterrupted, WORLD, 8, timeout=240)]
    run_ranks(_first_generation, WORLD, str(tmp_path), "disabled", 6, True, timeout=240)
    assert (tmp_path / "ckpt" / "step-6" / ".metadata").is_file()  # DCP's own format
    got = [_unbytes(r) for r in run_ranks(_resume, WORLD, str(tmp_path), 2, timeout=240)]
    for rank in range(WORLD):
        _assert_same(got[rank], expected[rank], f"rank {rank}")
    assert (tmp_path / "ckpt" / "step-8" / "manifest.json").is_file()  # ours from then on


def _flip_a_byte(ckpt: Path) -> None:
    """A byte of the first layer's weights (rank 1's piece), where the manifest says it is."""
    piece = json.loads((ckpt / "manifest.json").read_text())["tensors"]["0.weight"]["pieces"][-1]
    data = ckpt / piece["file"]
    raw = bytearray(data.read_bytes())
    raw[piece["byte_offset"] + 5] ^= 0x40
    data.write_bytes(bytes(raw))


class _Seen(logging.Handler):
    """The warnings shardsafe logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _warnings() -> Iterator[list[str]]:
    seen = _Seen()
    logger = logging.getLogger("shardsafe")
    logger.addHandler(seen)
    try:
        yield seen.messages
    finally:
        logger.removeHandler(seen)


def _resume_past_damage(rank: int, world: int, root: str, steps: int) -> bytes:
    """Step 6 asked for by number raises; a resume loads step 4, with a warning."""
    import shardsafe

    parts = _setup(rank, world, seed=1)
    manager = _manager(parts, root, "disabled")
    try:
        with pytest.raises(shardsafe.CorruptCheckpointError):
            manager.load(step=6)  # load_step=6: that step or an error
        with _warnings() as seen:
            assert manager.load() is True
        loaded = _digest(parts, next_batch=False)
        _train(parts, steps, manager)  # saves step 6 again, over the damaged one
        manager.maybe_wait_for_saving()
        return _bytes({"loaded": loaded, "end": _digest(parts), "warnings": seen})
    finally:
        manager.close()


def _resume_expecting_error(rank: int, world: int, root: str) -> tuple[str, str]:
    import shardsafe

    parts = _setup(rank, world, seed=1)
    manager = _manager(parts, root, "disabled")
    try:
        with pytest.raises(shardsafe.CheckpointError) as info:
            manager.load()
        return type(info.value).__name__, str(info.value)
    finally:
        manager.close()


def test_resume_falls_back_past_a_damaged_step(tmp_path: Path) -> None:
    """A flipped byte in the newest step: the resume loads the step before it, exactly (none
    of what the damaged step's load wrote stays), says so, and saves over the damaged step;
    every step damaged: it raises, naming each."""
    from shardsafe.cli import main

    expected = [_unbytes(r) for r in run_ranks(_uninterrupted_at, WORLD, 4, 8, timeout=240)]
    run_ranks(_first_generation, WORLD, str(tmp_path), "disabled", 6, timeout=240)
    ckpt = tmp_path / "ckpt"
    _flip_a_byte(ckpt / "step-6")
    got = [
        _unbytes(r) for r in run_ranks(_resume_past_damage, WORLD, str(tmp_path), 4, timeout=240)
    ]
    for rank in range(WORLD):
        _assert_same(got[rank]["loaded"], expected[rank]["middle"], f"rank {rank} loaded")
        _assert_same(got[rank]["end"], expected[rank]["end"], f"rank {rank} end")
        skipped = [m for m in got[rank]["warnings"] if "step-6 is damaged" in m]
        assert skipped and "checksum" in skipped[0] and "loading step 4" in skipped[0]
        assert any("resumed from" in m and "step-4" in m for m in got[rank]["warnings"])
    assert _visible(ckpt) == ["step-6", "step-8"]
    assert main(["verify", str(ckpt / "step-6")]) == 0  # replaced by the resumed run's save

    # an intact step 0 stands for torchtitan's seed checkpoint: model only, so no fallback for
    # a full resume whose failed loads wrote into the optimizer's state
    shutil.copytree(ckpt / "step-8", ckpt / "step-0")
    _flip_a_byte(ckpt / "step-6")
    _flip_a_byte(ckpt / "step-8")
    for name, message in run_ranks(_resume_expecting_error, WORLD, str(tmp_path), timeout=240):
        assert name == "CorruptCheckpointError"
        assert "step-8" in message and "step-6" in message, message
        assert "load_step=0" in message, message


def test_leftovers_of_an_unfinished_save_are_not_steps(tmp_path: Path) -> None:
    run_ranks(_first_generation, WORLD, str(tmp_path), "disabled", 2, timeout=240)
    # what a save killed mid-write leaves: a hidden work directory with the next step's number
    (tmp_path / "ckpt" / ".step-4.tmp-dead").mkdir()
    (tmp_path / "ckpt" / ".step-4.tmp-dead" / "manifest.json").write_text("{}")
    got = [_unbytes(r) for r in run_ranks(_resume, WORLD, str(tmp_path), 0, timeout=240)]
    assert [g["train_state"]["step"] for g in got] == [2, 2]


def _hf_names(key: str) -> str:
    return f"model.layers.{key}"


def _export(rank: int, world: int, root: str, in_hf: bool) -> bytes:
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    class Adapter(BaseStateDictAdapter):
        """Native names to HF names, one safetensors file (no index mapping)."""

        def __init__(self) -> None:
            self.hf_assets_path = None
            self.fqn_to_index_mapping = None

        def to_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
            return {_hf_names(k): v for k, v in sd.items()}

        def from_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
            return {k.removeprefix("model.layers."): v for k, v in sd.items()}

        def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
            raise NotImplementedError

    parts = _setup(rank, world, seed=0)
    manager = _manager(
        parts,
        root,
        "disabled",
        last_save_in_hf=in_hf,
        export_dtype="bfloat16",
        sd_adapter=Adapter(),
    )
    try:
        _train(parts, 2, manager)
        parts["train_state"].step = 3
        _train(parts, 1)
        assert manager.save(4, last_step=True) is True
        return _bytes(_digest(parts)["model"])
    finally:
        manager.close()


@pytest.mark.parametrize("in_hf", [True, False])
def test_the_last_save_exports_the_model(tmp_path: Path, in_hf: bool) -> None:
    import shardsafe
    from shardsafe.cli import main

    model = _unbytes(run_ranks(_export, WORLD, str(tmp_path), in_hf, timeout=240)[0])
    last = tmp_path / "ckpt" / "step-4"
    if in_hf:  # torchtitan's HF export: safetensors, names by the adapter, export dtype
        from safetensors.torch import load_file

        got = load_file(str(last / "model-00001-of-00001.safetensors"))
        assert not (last / "manifest.json").exists()
    else:  # model only, export dtype, a shardsafe checkpoint
        assert main(["verify", str(last)]) == 0
        reader = shardsafe.CheckpointReader(str(last))
        got = {_hf_names(k): reader.read_tensor(k) for k in reader.manifest.tensors}
    assert set(got) == {_hf_names(k) for k in model}
    for k, v in model.items():
        assert got[_hf_names(k)].dtype == torch.bfloat16
        assert torch.equal(got[_hf_names(k)], v.to(torch.bfloat16)), k
    # a resume finds the newest committed shardsafe step: not an HF export
    from shardsafe.torchtitan_checkpoint import _committed_steps

    steps = [step for step, _ in _committed_steps(str(tmp_path / "ckpt"))]
    assert steps == ([2] if in_hf else [2, 4])


def _save_over(rank: int, world: int, root: str, async_mode: str) -> str:
    import shardsafe

    parts = _setup(rank, world, seed=0)
    manager = _manager(parts, root, async_mode)
    try:
        with pytest.raises(shardsafe.CheckpointError) as info:
            _train(parts, 2, manager)  # a sync save raises here
            manager.maybe_wait_for_saving()  # an async one here
        return type(info.value).__name__
    finally:
        manager.save_future = None
        manager.close()


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_save_raises_our_error(tmp_path: Path, async_mode: str) -> None:
    """Saving a step that is already committed (a run restarted without resuming): DCP's
    ``CheckpointException`` gives way to the CheckpointError, in the save or its wait."""
    from shardsafe.cli import main

    run_ranks(_first_generation, WORLD, str(tmp_path), "disabled", 2, timeout=240)
    got = run_ranks(_save_over, WORLD, str(tmp_path), async_mode, timeout=240)
    assert got == ["CheckpointExistsError"] * WORLD
    assert (
        main(["verify", str(tmp_path / "ckpt" / "step-2")]) == 0
    )  # the committed step is untouched
