"""Bad input across ranks: every rank raises the same error, naming the key and the ranks; no hang.

All scenarios run in one spawn of two gloo ranks (a spawn costs seconds); each rank records
what every step raised, and the tests below check the records.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

import shardsafe
from shardsafe import (
    CheckpointError,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
)

ST = ShardedTensor
WORLD = 2
FULL = torch.arange(32.0).reshape(8, 4)


def _rows(rank: int, world: int = WORLD, data: torch.Tensor | None = None) -> ST:
    """Rank ``rank``'s block of rows of FULL (or of ``data``'s shape)."""
    n = FULL.shape[0] // world
    piece = FULL[rank * n : (rank + 1) * n].clone() if data is None else data
    return ST.from_rank_offsets("w", piece, (0, rank, world))


def _raising_build(key, data, replica_id, flattened_range):
    raise RuntimeError(f"build of {key} failed here")


def _merge(sub):
    return sub


def _record(fn) -> dict | None:
    try:
        fn()
    except Exception as e:
        return {
            "type": type(e).__name__,
            "checkpoint_error": isinstance(e, CheckpointError),
            "message": str(e),
        }
    return None


# Each builder gives this rank's state dict for one failing save.
def _sd_two_mains(rank):
    return {"w": ST.from_rank_offsets("w", torch.ones(4))}


def _sd_overlap(rank):
    if rank == 0:
        return {"w": ST.from_global_offset("w", torch.zeros(3, 4), (4, 4), (0, 0))}
    return {"w": ST.from_global_offset("w", torch.zeros(2, 4), (4, 4), (2, 0))}


def _sd_gap(rank):
    if rank == 0:
        return {"w": ST.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2))}
    return {"x": ST.from_rank_offsets("x", torch.zeros(2))}


def _sd_shape(rank):
    return {"w": ST.from_global_offset("w", torch.zeros(2, 4), (4 + 2 * rank, 4), (2 * rank, 0))}


def _sd_dtype(rank):
    dtype = torch.float32 if rank == 0 else torch.bfloat16
    return {"w": ST.from_rank_offsets("w", torch.zeros(2, 4, dtype=dtype), (0, rank, 2))}


def _sd_grid_incomplete(rank):
    return {"rng": ShardedObject("rng", {"seed": rank}, (3,), (rank,))}


def _sd_grid_disagrees(rank):
    return {"rng": ShardedObject("rng", {"seed": rank}, (2 + rank,), (rank,))}


def _sd_object_two_mains(rank):
    return {"rng": ShardedObject("rng", {"seed": rank}, (1,), (0,))}


def _sd_r1_lock_object(rank):
    data = threading.Lock() if rank == 1 else {"seed": 0}
    return {"w": _rows(rank), "state": ShardedObject("state", data, (WORLD,), (rank,))}


def _sd_r1_lambda_object(rank):
    data = (lambda: 1) if rank == 1 else {"seed": 0}
    return {"w": _rows(rank), "state": ShardedObject("state", data, (WORLD,), (rank,))}


def _sd_r1_unsupported_dtype(rank):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental" in torch
        data = torch.zeros(4, 4, dtype=torch.complex32) if rank == 1 else FULL[:4].clone()
    return {"w": ST.from_rank_offsets("w", data, (0, rank, WORLD))}


def _sd_r1_no_data(rank):
    st = _rows(rank)
    if rank == 1:
        st.data = None
    return {"w": st}


def _sd_r1_factory(rank):
    if rank == 1:
        return {
            "w": _rows(rank),
            "f": ShardedTensorFactory("fused", torch.zeros(2), _raising_build, _merge),
        }
    return {"w": _rows(rank)}


def _sd_both_differ(rank):
    if rank == 0:
        return {"w": ST("w", None, torch.float32, (4, 4), (8, 4), (0, 0))}
    return _sd_r1_unsupported_dtype(rank)


def _sd_r1_dtype_changed(rank):
    st = _rows(rank)
    if rank == 1:
        st.data = st.data.double()  # replaced after construction: no longer matches st.dtype
    return {"w": st}


INVALID = {
    "two_mains": _sd_two_mains,
    "overlap": _sd_overlap,
    "gap": _sd_gap,
    "shape": _sd_shape,
    "dtype": _sd_dtype,
    "grid_incomplete": _sd_grid_incomplete,
    "grid_disagrees": _sd_grid_disagrees,
    "object_two_mains": _sd_object_two_mains,
}
ONE_RANK = {
    "r1_lock_object": _sd_r1_lock_object,
    "r1_lambda_object": _sd_r1_lambda_object,
    "r1_unsupported_dtype": _sd_r1_unsupported_dtype,
    "r1_no_data": _sd_r1_no_data,
    "r1_factory": _sd_r1_factory,
    "both_differ": _sd_both_differ,
}


def _good_sd(rank, scale: float = 1.0):
    return {
        "w": _rows(rank, data=FULL[rank * 4 : (rank + 1) * 4].clone() * scale),
        "b": ST.from_rank_offsets("b", torch.arange(4), replica_id=rank),  # replicated
        "rng": ShardedObject("rng", {"seed": rank}, (WORLD,), (rank,)),
        "step": 5,
    }


def _listing(base: str) -> list[str]:
    """What the parent directory holds once every rank is done with the last step."""
    dist.barrier()
    names = sorted(os.listdir(base))
    dist.barrier()
    return names


def _scenarios(rank: int, world: int, base: str) -> dict:
    rec: dict[str, dict | None] = {}
    listings: dict[str, list[str]] = {}
    ck = os.path.join(base, "ck")

    # -- invalid sharding and one-rank failures: all into the same path
    for name, build in {**INVALID, **ONE_RANK}.items():
        sd = build(rank)
        rec[name] = _record(lambda sd=sd: shardsafe.save(sd, ck))
        listings[name] = _listing(base)

    # -- a data dtype changed after construction on rank 1 only (separate path)
    sd = _sd_r1_dtype_changed(rank)
    rec["r1_dtype_changed"] = _record(lambda: shardsafe.save(sd, os.path.join(base, "ck_dtype")))
    listings["r1_dtype_changed"] = _listing(base)
    if rank == 0:  # only there if a regression let the save commit
        shutil.rmtree(os.path.join(base, "ck_dtype"), ignore_errors=True)

    # -- a save lock held by a live process
    lock = os.path.join(base, ".ck.shardsafe-lock")
    if rank == 0:
        with open(lock, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()} {time.time():.0f}")
    dist.barrier()
    rec["lock"] = _record(lambda: shardsafe.save(_good_sd(rank), ck))
    listings["lock"] = _listing(base)
    if rank == 0:
        os.remove(lock)
    dist.barrier()

    # -- the same processes, the same path: a correct save now works
    shardsafe.save(_good_sd(rank), ck)
    listings["recovered"] = _listing(base)
    # load in another layout: rank r takes column block r
    dest = torch.zeros(8, 2)
    out = shardsafe.load({"w": ST.from_rank_offsets("w", dest, (1, rank, world))}, ck)
    loaded_ok = torch.equal(out["w"], FULL[:, rank * 2 : (rank + 1) * 2]) and out["step"] == 5
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    group_ok = total.item() == world

    # -- existing path without / with overwrite
    rec["exists"] = _record(lambda: shardsafe.save(_good_sd(rank, 2.0), ck))
    listings["exists"] = _listing(base)
    still = shardsafe.load({"w": _rows(rank, data=torch.zeros(4, 4))}, ck)["w"]
    untouched = torch.equal(still, FULL[rank * 4 : (rank + 1) * 4])
    shardsafe.save(_good_sd(rank, 2.0), ck, overwrite=True)
    listings["overwritten"] = _listing(base)
    new = shardsafe.load({"w": _rows(rank, data=torch.zeros(4, 4))}, ck)["w"]
    replaced = torch.equal(new, 2.0 * FULL[rank * 4 : (rank + 1) * 4])

    # -- load-side problems on one rank only
    def template(rank, key="w", shape=(8, 4)):
        return {
            "w": ST.from_global_offset(key, torch.zeros(4, 4), shape, (4 * rank, 0)),
            "b": ST.from_rank_offsets("b", torch.zeros(4, dtype=torch.int64), replica_id=rank),
            "rng": ShardedObject("rng", None, (WORLD,), (rank,)),
        }

    rec["load_r1_missing"] = _record(
        lambda: shardsafe.load(template(rank, "ww" if rank == 1 else "w"), ck)
    )
    rec["load_r1_shape"] = _record(
        lambda: shardsafe.load(template(rank, shape=(8, 6) if rank == 1 else (8, 4)), ck)
    )
    rec["load_r1_dtype"] = _record(
        lambda: shardsafe.load(
            {
                "w": ST.from_global_offset(
                    "w",
                    torch.zeros(4, 4, dtype=torch.float64 if rank else torch.float32),
                    (8, 4),
                    (4 * rank, 0),
                )
            },
            ck,
        )
    )
    # strict: the checkpoint's keys are w, b, rng/shard_0_2, rng/shard_1_2; missing is judged over all ranks
    split = {k: v for k, v in template(rank).items() if k != ("b" if rank == 0 else "w")}
    rec["load_raise_all_split"] = _record(
        lambda: shardsafe.load(split, ck, strict=StrictHandling.RAISE_ALL)
    )
    no_b = {k: v for k, v in template(rank).items() if k != "b"}
    rec["load_raise_all_missing"] = _record(
        lambda: shardsafe.load(no_b, ck, strict=StrictHandling.RAISE_ALL)
    )
    extra = {**no_b, "c": ST.from_rank_offsets("c", torch.zeros(2))} if rank == 1 else no_b
    _, missing, unexpected = shardsafe.load(extra, ck, strict=StrictHandling.RETURN_ALL)
    returned = {"missing": sorted(missing), "unexpected": sorted(unexpected)}

    # a flipped byte in the file rank 1 reads
    if rank == 0:
        m = shardsafe.CheckpointReader(ck).manifest
        (piece,) = [p for p in m.tensors["w"].pieces if p.offset == (4, 0)]
        victim = os.path.join(ck, piece.extent.file)
        with open(victim, "r+b") as f:
            f.seek(piece.extent.byte_offset + 3)
            byte = f.read(1)
            f.seek(piece.extent.byte_offset + 3)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    rec["load_r1_corrupt"] = _record(
        lambda: shardsafe.load({"w": _rows(rank, data=torch.zeros(4, 4))}, ck)
    )
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "records": rec,
        "listings": listings,
        "loaded_ok": loaded_ok,
        "group_ok": group_ok and total.item() == world,
        "untouched": untouched,
        "replaced": replaced,
        "returned": returned,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("errors_mp")
    started = time.monotonic()
    out = run_ranks(_scenarios, WORLD, str(base), timeout=90)
    assert time.monotonic() - started < 90
    return out


def _same_everywhere(results, name: str) -> dict:
    recs = [r["records"][name] for r in results]
    assert all(rec is not None for rec in recs), f"{name}: some rank did not raise: {recs}"
    assert len({rec["type"] for rec in recs}) == 1, recs
    assert len({rec["message"] for rec in recs}) == 1, recs
    assert recs[0]["checkpoint_error"], recs[0]
    return recs[0]


def _check_names(msg: str, names: list[str]) -> None:
    for part in names:
        assert part in msg, (part, msg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "names"),
    [
        ("two_mains", ["'w'", "main replica", "ranks 0, 1", "non-zero replica ids"]),
        ("overlap", ["'w'", "overlaps", "(rank 0)", "(rank 1)", "(0, 0)", "(2, 0)", "replica_id"]),
        ("gap", ["'w'", "8 of 16", "index (2, 0)", "some rank is missing its piece"]),
        (
            "shape",
            ["'w'", "disagree", "rank 0 declare float32 [4, 4]", "rank 1 declare float32 [6, 4]"],
        ),
        ("dtype", ["'w'", "disagree", "rank 0 declare float32", "rank 1 declare bfloat16"]),
        (
            "grid_incomplete",
            ["'rng'", "2 of the 3 cells", "every cell of the grid needs one main replica"],
        ),
        ("grid_disagrees", ["'rng'", "disagree", "rank 0 use [2]", "rank 1 use [3]"]),
        (
            "object_two_mains",
            ["'rng/shard_0_1'", "ranks 0, 1", "exactly one holder must be the main replica"],
        ),
    ],
)
def test_invalid_sharding_raises_the_same_validation_error_on_every_rank(results, name, names):
    rec = _same_everywhere(results, name)
    assert rec["type"] == "ValidationError"
    _check_names(rec["message"], names)
    for r in results:  # nothing at the target, no temporary sibling, no lock
        assert r["listings"][name] == [], r["listings"][name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "kind", "names"),
    [
        (
            "r1_lock_object",
            "ValidationError",
            ["cannot store", "_thread.lock", "on rank 1 during save"],
        ),
        (
            "r1_lambda_object",
            "ValidationError",
            ["cannot store", "function", "on rank 1 during save"],
        ),
        (
            "r1_unsupported_dtype",
            "CheckpointError",
            ["complex32", "cannot be checkpointed", "on rank 1 during save planning"],
        ),
        (
            "r1_no_data",
            "ValidationError",
            ["'w'", "without data", "on rank 1 during save planning"],
        ),
        (
            "r1_factory",
            "CheckpointError",
            ["build of fused failed here", "on rank 1 during save planning"],
        ),
    ],
)
def test_failure_on_one_rank_raises_on_every_rank(results, name, kind, names):
    rec = _same_everywhere(results, name)
    assert rec["type"] == kind
    _check_names(rec["message"], names)
    assert "rank 0" not in rec["message"]
    for r in results:
        assert r["listings"][name] == [], r["listings"][name]


@pytest.mark.timeout(120)
def test_data_dtype_changed_on_one_rank_raises_on_every_rank(results):
    rec = _same_everywhere(results, "r1_dtype_changed")
    assert rec["type"] == "ValidationError"
    _check_names(
        rec["message"],
        ["w: data dtype torch.float64", "declared dtype torch.float32", "on rank 1 during save"],
    )
    for r in results:
        assert r["listings"]["r1_dtype_changed"] == []


@pytest.mark.timeout(120)
def test_lock_existing_path_overwrite_and_recovery(results):
    rec = _same_everywhere(results, "lock")
    assert rec["type"] == "CheckpointExistsError"
    _check_names(
        rec["message"], ["another save", ".ck.shardsafe-lock", "delete that lock file", "rank 0"]
    )
    for r in results:
        assert r["listings"]["lock"] == [".ck.shardsafe-lock"]  # a live lock is left alone
        # after every failure above, the same processes saved into the same path
        assert r["listings"]["recovered"] == ["ck"]
        assert r["loaded_ok"] and r["group_ok"]
    rec = _same_everywhere(results, "exists")
    assert rec["type"] == "CheckpointExistsError"
    _check_names(rec["message"], ["ck already exists", "overwrite=True"])
    for r in results:
        assert r["listings"]["exists"] == ["ck"] and r["untouched"]
        assert r["listings"]["overwritten"] == ["ck"] and r["replaced"]


@pytest.mark.timeout(120)
def test_load_problem_on_one_rank_raises_on_every_rank(results):
    rec = _same_everywhere(results, "load_r1_missing")
    assert rec["type"] == "MissingKeyError"
    _check_names(
        rec["message"], ["['ww']", "closest stored keys to 'ww': ['w']", "on rank 1 during load"]
    )

    rec = _same_everywhere(results, "load_r1_shape")
    assert rec["type"] == "IncompatibleRequestError"
    _check_names(
        rec["message"],
        ["'w'", "[8, 4]", "[8, 6]", "allow_shape_mismatch=True", "on rank 1 during load"],
    )

    rec = _same_everywhere(results, "load_r1_dtype")
    assert rec["type"] == "IncompatibleRequestError"
    _check_names(
        rec["message"],
        ["'w'", "float32", "torch.float64", "allow_shape_mismatch", "on rank 1 during load"],
    )

    rec = _same_everywhere(results, "load_r1_corrupt")
    assert rec["type"] == "CorruptCheckpointError"
    _check_names(
        rec["message"],
        ["tensor 'w'", "checksum mismatch", "data/rank-00001-00.bin", "on rank 1 during load"],
    )


@pytest.mark.timeout(120)
def test_strict_handling_judges_missing_keys_over_all_ranks(results):
    for r in results:
        assert r["records"]["load_raise_all_split"] is None  # every key requested by some rank
    rec = _same_everywhere(results, "load_raise_all_missing")
    assert rec["type"] == "MissingKeyError"
    _check_names(rec["message"], ["requested by no rank", "['b']", "strict="])
    by_rank = {r["rank"]: r["returned"] for r in results}
    for returned in by_rank.values():
        assert returned["missing"] == ["b"]
    assert by_rank[1]["unexpected"] == ["c"]
    assert set(by_rank[0]["unexpected"]) <= {"c"}


@pytest.mark.timeout(120)
def test_different_failures_on_several_ranks_name_each_rank(results):
    rec = _same_everywhere(results, "both_differ")
    assert rec["type"] == "DistributedError"
    _check_names(
        rec["message"],
        [
            "save planning failed on ranks 0, 1",
            "rank 0: ValidationError: 'w': a ShardedTensor without data",
            "rank 1: ",
            "TypeError",
            "tensors of dtype torch.complex32",
        ],
    )
    for r in results:
        assert r["listings"]["both_differ"] == []
