"""Real Megatron-Core GPT models and optimizers, saved and resharded by shardsafe.save/load.

The state dicts are the ones Megatron-Core builds (``model.sharded_state_dict()``,
``optimizer.sharded_state_dict(model_sd)``), handed to shardsafe with no wrapper call. Every
layout change is checked exactly against the TP1/PP1 tensors consolidated from the saving
ranks' live parameters and Adam moments (see ``megatron_models.consolidate``).
"""

from __future__ import annotations

import pytest
import torch
from megatron_models import (
    adam_state,
    consolidate,
    dist_adam_state,
    gpt,
    named_params,
    train_step,
    with_optimizer,
)
from rank_pool import RankPool

import shardsafe

pytestmark = pytest.mark.timeout(600)

LAYERS = 2


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def _coords() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }


def _report(model, opt, distributed: bool) -> dict:
    out = {**_coords(), "params": named_params(model)}
    out["adam"] = dist_adam_state(opt, model) if distributed else adam_state(opt, model)
    return out


def save_gpt(rank, world, path, tp, pp, distributed=False, sharding_type=None):
    model = gpt(tp, pp, seed=1234, layers=LAYERS)
    ddp, opt = with_optimizer(model, distributed)
    train_step(ddp, opt, seed=5)
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type} if sharding_type else None
    sd = {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata),
        "iteration": 7,
    }
    shardsafe.save(sd, path)
    return _report(model, opt, distributed)


def load_gpt(rank, world, path, tp, pp, distributed=False, sharding_type=None):
    model = gpt(tp, pp, seed=99, layers=LAYERS)
    ddp, opt = with_optimizer(model, distributed)
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type} if sharding_type else None
    template = {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
    }
    out = shardsafe.load(template, path)
    model.load_state_dict(out["model"])
    opt.load_state_dict(out["optimizer"])
    report = _report(model, opt, distributed)
    report["iteration"] = out["iteration"]
    return report


def _full(parts: list[dict], field: str, sub: str | None = None) -> dict[str, torch.Tensor]:
    main = [p for p in parts if p["dp"] == 0]
    tensors = [
        {
            "tp": p["tp"],
            "pp": p["pp"],
            "tensors": {n: (v[sub] if sub else v) for n, v in p[field].items()},
        }
        for p in main
    ]
    return consolidate(tensors, LAYERS // (1 + max(p["pp"] for p in parts)))


def _assert_same(saved: list[dict], loaded: list[dict]) -> None:
    want, got = _full(saved, "params"), _full(loaded, "params")
    assert sorted(want) == sorted(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for moment in ("exp_avg", "exp_avg_sq"):
        want, got = _full(saved, "adam", moment), _full(loaded, "adam", moment)
        assert sorted(want) == sorted(got)
        for name in want:
            assert torch.equal(want[name], got[name]), (moment, name)
            assert want[name].abs().sum() > 0, (moment, name)
    assert all(p["iteration"] == 7 for p in loaded)


@pytest.mark.parametrize(
    "src,dst",
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1))],
    ids=["tp2-to-tp1", "tp1-to-tp2", "pp2-to-pp1"],
)
def test_gpt_and_adam_reshard_exactly(pool, tmp_path, src, dst):
    path = str(tmp_path / "ckpt")
    saved = pool.run(save_gpt, path, *src)
    loaded = pool.run(load_gpt, path, *dst)
    _assert_same(saved, loaded)
