import torch
from distributed import run_ranks

import shardsafe


def _save_tp(rank, world, path):
    t = torch.arange(16.0).reshape(4, 4)[rank * 2 : rank * 2 + 2].clone()
    shardsafe.save(
        {"w": shardsafe.ShardedTensor.from_rank_offsets("w", t, (0, rank, world)), "step": 3}, path
    )
    return True


def test_two_ranks_save_one_loads(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_save_tp, 2, path, timeout=60)
    out = shardsafe.load(
        {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, path
    )
    assert torch.equal(out["w"], torch.arange(16.0).reshape(4, 4))
    assert out["step"] == 3
