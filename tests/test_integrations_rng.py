"""Per-rank RNG states: exact restore on the same layout, deterministic re-derivation when
the world size changed, and the explicit policies."""

import random
import warnings

import numpy as np
import pytest
import torch
from distributed import run_ranks

import shardsafe
from shardsafe.errors import IncompatibleRequestError
from shardsafe.integrations import (
    RngPolicy,
    apply_rng_state,
    restore_rng,
    rng_load_template,
    rng_sharded_state_dict,
)


def draws():
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_same_layout_restores_exactly(tmp_path):
    seed_all(1)
    draws()  # move away from the seeded start
    shardsafe.save({"model": {"x": 1}, **rng_sharded_state_dict()}, tmp_path / "c")
    expected = draws()
    seed_all(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact restore says nothing
        assert restore_rng(tmp_path / "c") is RngPolicy.KEEP
    assert draws() == expected
    # the same through one load of the whole state
    seed_all(3)
    template = {"model": {}, **rng_load_template(tmp_path / "c")}
    loaded = shardsafe.load(template, tmp_path / "c")
    assert loaded["model"] == {"x": 1}
    assert apply_rng_state(loaded["rng"], RngPolicy.KEEP) is RngPolicy.KEEP
    assert draws() == expected


def test_missing_state_and_drop(tmp_path):
    shardsafe.save({"x": 1}, tmp_path / "c")
    with pytest.warns(UserWarning, match="no RNG state"):
        assert restore_rng(tmp_path / "c") is RngPolicy.DROP
    with pytest.raises(shardsafe.MissingKeyError):
        restore_rng(tmp_path / "c", policy=RngPolicy.KEEP)


def _ranks(rank, world, path):
    seed_all(10 + rank)
    shardsafe.save(rng_sharded_state_dict(), path)
    saved = draws()
    out = {"saved": saved}
    seed_all(99)
    assert restore_rng(path) is RngPolicy.KEEP
    out["restored"] = draws()
    seed_all(99)
    loaded = shardsafe.load(rng_load_template(path), path)
    apply_rng_state(loaded["rng"])
    out["via_load"] = draws()
    assert restore_rng(path, policy="rederive") is RngPolicy.REDERIVE
    out["rederived"] = draws()
    return out


@pytest.mark.timeout(90)
def test_two_ranks_then_one(tmp_path):
    path = tmp_path / "c"
    results = run_ranks(_ranks, 2, str(path), timeout=80)
    for r in results:
        assert r["restored"] == r["saved"] and r["via_load"] == r["saved"]
    assert results[0]["saved"] != results[1]["saved"]
    assert results[0]["rederived"] != results[1]["rederived"]  # ranks still differ

    # 2 -> 1 rank: re-derived with a warning, deterministically, never an error.
    seed_all(5)
    with pytest.warns(UserWarning, match="re-deriving"):
        assert restore_rng(path) is RngPolicy.REDERIVE
    first = draws()
    with pytest.warns(UserWarning, match="re-deriving"):
        restore_rng(path)
    assert draws() == first
    assert first not in (results[0]["saved"], results[1]["saved"])
    # re-deriving from rank 0's state on rank 0 gives what rank 0 re-derived on 2 ranks
    restore_rng(shardsafe.CheckpointReader(path), policy=RngPolicy.REDERIVE)
    assert draws() == results[0]["rederived"]

    # the template route picks the rank-0 cell of the 2-rank grid
    template = rng_load_template(path)
    assert template["rng"].global_shape == (2,) and template["rng"].global_offset == (0,)
    loaded = shardsafe.load(template, path)
    with pytest.warns(UserWarning, match="re-deriving"):
        assert apply_rng_state(loaded["rng"]) is RngPolicy.REDERIVE
    assert draws() == first

    with pytest.raises(IncompatibleRequestError, match=r"RngPolicy\.KEEP"):
        restore_rng(path, policy=RngPolicy.KEEP)

    seed_all(7)
    expected = draws()
    seed_all(7)
    with pytest.warns(UserWarning, match="DROP"):
        assert restore_rng(path, policy=RngPolicy.DROP) is RngPolicy.DROP
    assert draws() == expected
