"""shardsafe against megatron-core 0.19 itself, both directions, on gloo CPU ranks.

megatron-core 0.19 needs Python >= 3.12 and keeps its common state inside the DCP files (the
ShardedObject ``common_state/shard_0_1``) instead of ``common.pt``. The training journey of
``test_megatron_resume`` (killed mid-save, resumed in another layout) runs here too. These run in the
second venv the Makefile builds (``make test-megatron019``, part of ``make test``); in the main
venv (megatron-core 0.16.1) the module is skipped, saying so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

mcore = pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from packaging.version import Version  # noqa: E402

if Version(mcore.__version__) < Version("0.19"):
    pytest.skip(
        f"megatron-core {mcore.__version__} here; these tests need 0.19 (Python >= 3.12): "
        "run `make test-megatron019`",
        allow_module_level=True,
    )

from megatron_models import cpu_as_cuda  # noqa: E402
from rank_pool import RankPool  # noqa: E402
from test_megatron_resume import run_journey  # noqa: E402

import shardsafe  # noqa: E402
from shardsafe import megatron_api  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROWS, COLS = 4, 3
COMMON = {
    "iteration": 5,
    "args": argparse.Namespace(lr=0.1, tensor_model_parallel_size=2),
    "layout": {6: None, "shape": (2, 3), "nan": float("nan")},
}


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _megatron_sd(rank: int, world: int, template: bool = False) -> dict:
    from megatron.core.dist_checkpointing import mapping as m

    rows = ROWS // world
    piece = torch.zeros(rows, COLS) if template else _full()[rank * rows : (rank + 1) * rows]
    return {
        "model": {"w": m.ShardedTensor.from_rank_offsets("w", piece.clone(), (0, rank, world))},
        "rng": m.ShardedObject("rng", None if template else {"rank": rank}, (world,), (rank,)),
    }


def _same_common(got: dict) -> None:
    assert got["iteration"] == 5 and got["args"].lr == 0.1
    layout = got["layout"]
    assert set(layout) == {6, "shape", "nan"} and layout[6] is None
    assert layout["shape"] == (2, 3) and type(layout["shape"]) is tuple
    assert layout["nan"] != layout["nan"]


def megatron_saves(rank, world, path):
    from megatron.core import dist_checkpointing

    with cpu_as_cuda():  # Megatron's save synchronizes CUDA streams
        dist_checkpointing.save(
            {**_megatron_sd(rank, world), **COMMON}, path, content_metadata={"fmt": (1, 2)}
        )


def test_torch_dist_written_by_megatron_019_loads_and_converts(tmp_path):
    path = tmp_path / "iter_0000005"
    path.mkdir()  # Megatron's contract: the caller creates the directory
    pool = RankPool(2)
    try:
        pool.run(megatron_saves, str(path), timeout=300)
    finally:
        pool.close()
    names = sorted(os.listdir(path))
    assert "common.pt" not in names and "metadata.json" in names  # 0.19's own layout

    # shardsafe.load, in one process (TP2 -> TP1), common state from common_state/shard_0_1
    out = shardsafe.load(
        {
            "w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS)),
            "rng": [shardsafe.ShardedObject("rng", None, (2,), (r,)) for r in range(2)],
        },
        str(path),
    )
    assert torch.equal(out["w"], _full())
    assert out["rng"] == [{"rank": 0}, {"rank": 1}]
    _same_common(out)
    assert out["content_metadata"] == {"fmt": (1, 2)}
    # and through the Megatron-named entry points
    assert megatron_api.load_common_state_dict(str(path))["iteration"] == 5

    # convert to shardsafe: the common state is the run's, not an object called common_state
    dst = tmp_path / "converted"
    cmd = [sys.executable, "-m", "shardsafe", "convert", str(path), str(dst), "--to", "shardsafe"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reader = shardsafe.CheckpointReader(dst)
    assert torch.equal(reader.read_tensor("w"), _full())
    assert "common_state/shard_0_1" not in shardsafe.load_sharded_metadata(dst)
    _same_common(reader.common())


def shardsafe_saves(rank, world, path):
    shardsafe.save({**_megatron_sd(rank, world), **COMMON}, path, content_metadata={"fmt": 1})


def megatron_loads(rank, world, path):
    from megatron.core import dist_checkpointing

    with cpu_as_cuda():
        out = dist_checkpointing.load(_megatron_sd(rank, world, template=True), path)
        common = dist_checkpointing.load_common_state_dict(path)
    return out["model"]["w"].clone(), out["rng"], common["iteration"], out["content_metadata"]


def test_convert_to_megatron_is_read_by_megatron_019(tmp_path):
    src, dst = tmp_path / "ckpt", tmp_path / "iter_0000005"
    pool = RankPool(2)
    try:
        pool.run(shardsafe_saves, str(src), timeout=300)
        cmd = [sys.executable, "-m", "shardsafe", "convert", str(src), str(dst), "--to", "megatron"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        results = pool.run(megatron_loads, str(dst), timeout=300)
    finally:
        pool.close()
    for rank, (w, rng, iteration, content) in enumerate(results):
        assert torch.equal(w, _full()[2 * rank : 2 * rank + 2])
        assert rng == {"rank": rank} and iteration == 5 and content == {"fmt": 1}


def test_megatron_named_errors_are_megatron_019_exceptions(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with pytest.raises(CheckpointingException) as err:
        megatron_api.load({}, str(tmp_path / "absent"))
    assert isinstance(err.value, shardsafe.CheckpointNotFoundError)


def test_killed_mid_save_resumes_in_another_layout_exactly(tmp_path):
    """test_megatron_resume's journey on megatron-core 0.19: a TP2 run trained with its DDP,
    optimizer and schedule, saving through ``megatron_api``, SIGKILLed (every rank) in the middle
    of a save; a TP1 x PP2 run in fresh processes is refused the half-written directory,
    resumes from the tracker's iteration and equals an uninterrupted run bit for bit; the
    checkpoint verifies, and a flipped byte raises 0.19's ``CheckpointingException``."""
    run_journey(tmp_path)
