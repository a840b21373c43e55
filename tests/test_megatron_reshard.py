"""Real Megatron-Core GPT models and optimizers, saved and resharded by shardsafe.save/load.

The state dicts are the ones Megatron-Core builds (``model.sharded_state_dict()``,
``optimizer.sharded_state_dict(model_sd)``), handed to shardsafe with no wrapper call. Every
layout change is checked exactly against the TP1/PP1 tensors consolidated from the saving
ranks' live parameters and Adam moments (see ``megatron_models.consolidate``).
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks
from megatron_models import (
    adam_state,
    consolidate,
    cpu_as_cuda,
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
    with cpu_as_cuda():
        sd = {
            "model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata),
            "iteration": 7,
        }
    shardsafe.save(sd, path)
    return _report(model, opt, distributed)


def load_gpt(rank, world, path, tp, pp, distributed=False, sharding_type=None):
    model = gpt(tp, pp, seed=99, layers=LAYERS)
    _, opt = with_optimizer(model, distributed)
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type} if sharding_type else None
    with cpu_as_cuda():
        if distributed:  # Megatron's own preparation of a fresh DistributedOptimizer for a load
            for sub in opt.chained_optimizers:
                sub._init_optimizer_states_with_dummy_values()
        template = {
            "model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
        }
    out = shardsafe.load(template, path)
    model.load_state_dict(out["model"])
    if sharding_type == "fully_reshardable":
        # Megatron-Core 0.16.1 cannot apply this format with torch's Adam (no Apex/TE): its
        # load_parameter_state_from_fully_reshardable drops "step", which
        # _set_main_param_and_optimizer_states then requires. Check what load returned instead,
        # per parameter in the order Megatron numbers them (buffer.param_index_map).
        report = {**_coords(), "params": named_params(model)}
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for b in opt.chained_optimizers[0].buffers for p in b.param_index_map]
        report["model_space"] = {
            order[i]: {k: v.detach().clone() for k, v in st.items()}
            for i, st in out["optimizer"]["param_state"].items()
        }
        report["iteration"] = out["iteration"]
        return report
    # fp32 main params are views of the parameters here (no bf16 copy): copy without autograd
    with cpu_as_cuda(), torch.no_grad():
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


def _full_dist(parts: list[dict], moment: str) -> dict[str, torch.Tensor]:
    """TP1/PP1 tensors of a DistributedOptimizer's ``moment`` from every DP rank's flat ranges."""
    flat: dict[tuple[int, int, str], torch.Tensor] = {}
    for p in parts:
        for name, st in p["adam"].items():
            shape = p["params"][name].shape
            buf = flat.setdefault(
                (p["tp"], p["pp"], name), torch.full(shape, float("nan")).view(-1)
            )
            start, end = st["range"]
            buf[start:end] = st[moment]
    per_rank: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for (tp, pp, name), buf in flat.items():
        assert not buf.isnan().any(), (moment, name)  # every element held by some DP rank
        per_rank.setdefault((tp, pp), {})[name] = buf.view(parts[0]["params"][name].shape)
    pps = 1 + max(p["pp"] for p in parts)
    return consolidate(
        [{"tp": tp, "pp": pp, "tensors": t} for (tp, pp), t in per_rank.items()], LAYERS // pps
    )


@pytest.mark.parametrize(
    "fmt,src,dst",
    [("fully_reshardable", (1, 1), (2, 1)), ("dp_reshardable", (1, 1), (1, 1))],
    ids=["fully_reshardable-dp2-to-tp2", "dp_reshardable-dp2"],
)
def test_distributed_optimizer_formats(pool, tmp_path, fmt, src, dst):
    path = str(tmp_path / "ckpt")
    saved = pool.run(save_gpt, path, *src, True, fmt)
    loaded = pool.run(load_gpt, path, *dst, True, fmt)
    want, got = _full(saved, "params"), _full(loaded, "params")
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for moment in ("param", "exp_avg", "exp_avg_sq"):
        want = _full_dist(saved, moment)
        if fmt == "fully_reshardable":
            got = _full(loaded, "model_space", moment)
        else:
            got = _full_dist(loaded, moment)
        assert sorted(want) == sorted(got)
        for name in want:
            assert torch.equal(want[name], got[name]), (moment, name)
    assert all(p["iteration"] == 7 for p in loaded)


def megatron_save_model(rank, world, path, tp, pp):
    from megatron.core import dist_checkpointing

    model = gpt(tp, pp, seed=1234, layers=LAYERS)
    with cpu_as_cuda():  # Megatron's save synchronizes CUDA streams
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 3}, path)
    return {**_coords(), "params": named_params(model)}


def load_model(rank, world, path, tp, pp, by_megatron):
    model = gpt(tp, pp, seed=99, layers=LAYERS)
    template = {"model": model.sharded_state_dict()}
    if by_megatron:
        from megatron.core import dist_checkpointing

        with cpu_as_cuda():
            out = dist_checkpointing.load(template, path)
    else:
        out = shardsafe.load(template, path)
    model.load_state_dict(out["model"])
    return {**_coords(), "params": named_params(model), "iteration": out["iteration"]}


def _assert_same_params(saved: list[dict], loaded: list[dict]) -> None:
    want, got = _full(saved, "params"), _full(loaded, "params")
    assert sorted(want) == sorted(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_megatron_torch_dist_checkpoint_loads_into_another_layout(pool, tmp_path):
    path = tmp_path / "iter_0000003"
    path.mkdir()  # Megatron's save expects the directory
    saved = pool.run(megatron_save_model, str(path), 2, 1)
    assert (path / "metadata.json").is_file() and (path / ".metadata").is_file()
    loaded = pool.run(load_model, str(path), 1, 2, False)  # TP2 -> PP2, read by shardsafe.load
    _assert_same_params(saved, loaded)
    assert all(p["iteration"] == 3 for p in loaded)


def test_convert_to_megatron_is_read_by_megatron_core(pool, tmp_path):
    src, dst = tmp_path / "ckpt", tmp_path / "megatron"
    saved = pool.run(save_gpt, str(src), 1, 2)
    out = subprocess.run(
        [sys.executable, "-m", "shardsafe", "convert", str(src), str(dst), "--to", "megatron"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    loaded = pool.run(load_model, str(dst), 2, 1, True)  # PP2 -> TP2, read by Megatron-Core
    _assert_same_params(saved, loaded)
    assert all(p["iteration"] == 7 for p in loaded)


class _OnePiece:
    """One rank's piece of a tensor, described Megatron-style by a class shardsafe does not know."""

    def __init__(self, rank):
        self.key, self.global_shape, self.global_offset = "w", (4,), (2 * rank,)
        self.data = torch.full((2,), float(rank))


def save_unknown_sharded(rank, world, path):
    try:
        shardsafe.save({"model": {"w": _OnePiece(rank)}, "step": 1}, path)
    except shardsafe.ValidationError as e:
        return str(e)
    return None


def test_unknown_sharded_object_is_refused_on_every_rank(pool, tmp_path):
    path = tmp_path / "ckpt"
    messages = pool.run(save_unknown_sharded, str(path))
    for m in messages:
        assert m is not None and "state_dict['model']['w']" in m and "_OnePiece" in m
    assert not path.exists()


TOKENS = [[3, 17, 42, 5, 60, 1, 9, 33], [7, 7, 12, 50, 2, 40, 21, 0]]


def save_gpt_with_logits(rank, world, path):
    model = gpt(1, 1, seed=1234, layers=LAYERS)
    shardsafe.save({"model": model.sharded_state_dict()}, path)
    model.eval()
    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
    from megatron.core.tensor_parallel import random as mp_random

    # No dropout in eval: the CUDA RNG tracker the layers enter is never drawn from, and it
    # cannot be seeded without CUDA; the rotary embedding allocates on CUDA (mapped to CPU).
    mp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with torch.no_grad(), cpu_as_cuda():
        logits = model(tokens, positions, causal[None, None])
    return logits.detach().clone()


def test_megatron_gpt_to_hugging_face_llama_logits_match(pool, tmp_path):
    transformers = pytest.importorskip("transformers")
    src, dst = tmp_path / "ckpt", tmp_path / "hf"
    logits = pool.run(save_gpt_with_logits, str(src))[0]
    cmd = [sys.executable, "-m", "shardsafe", "convert", str(src), str(dst), "--to", "hf"]
    cmd += ["--map", "megatron-gpt", "--heads", "4", "--query-groups", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    hf = transformers.LlamaForCausalLM.from_pretrained(str(dst), torch_dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(TOKENS)).logits
    assert hf_logits.shape == logits.shape
    assert (hf_logits - logits).abs().max().item() <= 1e-4


def _load_gpt_bytes(*args):
    """load_gpt's report as bytes: a process that exits cannot share tensor storage by fd."""
    return pickle.dumps(load_gpt(*args))


def test_distributed_optimizer_dp_reshardable_across_dp_sizes(pool, tmp_path):
    """dp_reshardable reshards along DP only: saved by 2 DP ranks, loaded by 1 process."""
    path = str(tmp_path / "ckpt")
    saved = pool.run(save_gpt, path, 1, 1, True, "dp_reshardable")
    loaded = [
        pickle.loads(r)
        for r in run_ranks(_load_gpt_bytes, 1, path, 1, 1, True, "dp_reshardable", timeout=300)
    ]
    _assert_same_params(saved, loaded)
    for moment in ("param", "exp_avg", "exp_avg_sq"):
        want, got = _full_dist(saved, moment), _full_dist(loaded, moment)
        assert sorted(want) == sorted(got)
        for name in want:
            assert torch.equal(want[name], got[name]), (moment, name)
