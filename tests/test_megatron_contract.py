"""Megatron-Core's own contract, through shardsafe's Megatron-named entry points
(``shardsafe.megatron_api``), compared with megatron-core itself where it runs on CPU.

Megatron's tests use 8 ranks in TP2xPP4 layouts; on a two-core machine these use 4 gloo ranks
(TP2xPP2: rank = pp * 2 + tp); ``SHARDSAFE_MEGATRON_RANKS=8`` runs them as TP2xPP4. The
directory is created by the caller, as Megatron expects.
"""

from __future__ import annotations

import json
import os
import warnings
from importlib import resources

import pytest
import torch
from megatron.core.dist_checkpointing import mapping as mcore
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron_models import cpu_as_cuda
from rank_pool import RankPool

import shardsafe
from shardsafe import megatron_api

pytestmark = pytest.mark.timeout(600)

WORLD = int(os.environ.get("SHARDSAFE_MEGATRON_RANKS", "4"))  # TP2 x PP(WORLD / 2)
PP = WORLD // 2
ALL_MODES = [m.value for m in shardsafe.StrictHandling]


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    yield p
    p.close()


def _tp_pp(rank: int) -> tuple[int, int]:
    return rank % 2, rank // 2


def _layer(rank: int, template: bool = False) -> dict:
    """Megatron's habit: a layer weight split over TP, a stack of layers over PP, replicated
    optimizer-like state, and a per-rank RNG object."""
    tp, pp = _tp_pp(rank)
    full = torch.arange(PP * 4 * 3, dtype=torch.float32).reshape(PP, 4, 3)
    piece = full[pp, 2 * tp : 2 * tp + 2]
    data = torch.zeros_like(piece) if template else piece.clone()
    return {
        "w": mcore.ShardedTensor.from_rank_offsets(
            "decoder.w", data, (0, pp, PP), (1, tp, 2), prepend_axis_num=1, replica_id=(0, 0, 0)
        ),
        "rng": mcore.ShardedObject(
            "rng", None if template else {"rank": rank}, (WORLD,), (rank,), replica_id=0
        ),
    }


# --------------------------------------------------------------------------- common state


def save_differing_common(rank, world, ours_path, megatron_path):
    from megatron.core import dist_checkpointing

    def sd():  # Megatron's save rewrites the entities it is given: a fresh dict each time
        return {**_layer(rank), "rank": rank, "iteration": 3, "bias": torch.full((2,), float(rank))}

    try:
        shardsafe.save(sd(), ours_path + "-strict")
        refused = None
    except shardsafe.ValidationError as e:
        refused = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron_api.save(sd(), ours_path)
    with cpu_as_cuda():
        dist_checkpointing.save(sd(), megatron_path)

    def without_rank(common):  # Megatron's hook: it sees the common state only
        assert "w" not in common and "rng" not in common and common["iteration"] == 3
        return {k: v for k, v in common.items() if k != "rank"}

    with warnings.catch_warnings(record=True) as shaped:
        warnings.simplefilter("always")
        megatron_api.save(
            sd(), ours_path + "-pre", preprocess_common_before_consistancy_check=without_rank
        )
    (message,) = [str(w.message) for w in shaped if "rank 0's" in str(w.message)]
    assert "state_dict['bias']" in message and "state_dict['rank']" not in message
    return refused, [str(w.message) for w in caught]


def test_differing_common_state_keeps_rank_0s_as_megatron_does(pool, tmp_path):
    from megatron.core import dist_checkpointing

    ours, theirs = tmp_path / "ours", tmp_path / "megatron"
    ours.mkdir()
    theirs.mkdir()
    results = pool.run(save_differing_common, str(ours), str(theirs), timeout=300)
    for refused, warned in results:
        # shardsafe.save keeps its own rule: refused on every rank, naming the values
        assert refused is not None and "state_dict['rank']" in refused
        # the Megatron-named save warns on every rank, naming each value and the ranks
        (message,) = [w for w in warned if "rank 0's" in w]
        others = ", ".join(f"rank {r}" for r in range(1, WORLD))
        assert f"state_dict['rank'] ({others})" in message
        assert "state_dict['bias']" in message and "iteration" not in message
    assert not (tmp_path / "ours-strict").exists()
    with cpu_as_cuda():
        megatron_common = dist_checkpointing.load_common_state_dict(str(theirs))
    ours_common = megatron_api.load_common_state_dict(str(ours))
    assert megatron_common["rank"] == ours_common["rank"] == 0
    assert megatron_api.load_common_state_dict(str(tmp_path / "ours-pre"))["rank"] == 0
    assert torch.equal(ours_common["bias"], torch.zeros(2))
    assert torch.equal(megatron_common["bias"], torch.zeros(2))


# --------------------------------------------------------------------------- errors


def test_errors_are_megatrons_checkpointing_exception_too(tmp_path):
    from megatron.core import dist_checkpointing

    missing = str(tmp_path / "absent")
    with pytest.raises(CheckpointingException):  # Megatron's own behaviour
        dist_checkpointing.load({}, missing)
    with pytest.raises(CheckpointingException) as err:
        megatron_api.load({}, missing)
    assert isinstance(err.value, shardsafe.CheckpointNotFoundError)
    assert isinstance(err.value, FileNotFoundError) and missing in str(err.value)

    path = tmp_path / "ckpt"
    path.mkdir()
    megatron_api.save({"w": mcore.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(path))
    bigger = {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(6))}
    with pytest.raises(CheckpointingException) as err:
        megatron_api.load(bigger, str(path))
    assert isinstance(err.value, shardsafe.IncompatibleRequestError) and "'w'" in str(err.value)
    for call in (
        lambda: megatron_api.load_tensors_metadata(missing),
        lambda: megatron_api.load_common_state_dict(missing),
        lambda: megatron_api.load_content_metadata(missing),
    ):
        with pytest.raises(CheckpointingException):
            call()
    # our own API keeps our classes alone
    with pytest.raises(shardsafe.CheckpointNotFoundError) as plain:
        shardsafe.load({}, missing)
    assert not isinstance(plain.value, CheckpointingException)


# --------------------------------------------------------------------------- JSON-lossy values

ODD = {
    "sharding": ("dp_reshardable", 2),
    6: None,
    "nested": {1: [(), (1, 2.5)], (0, 1): "tuple key"},
    "nan": float("inf"),
}


def test_content_metadata_and_common_state_come_back_exactly(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    sd = {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.ones(2)), "common": dict(ODD)}
    megatron_api.save(sd, str(path), content_metadata=dict(ODD))
    assert megatron_api.load_content_metadata(str(path)) == ODD
    assert shardsafe.load_content_metadata(str(path)) == ODD
    out = megatron_api.load(
        {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(path)
    )
    assert out["content_metadata"] == ODD and out["common"] == ODD
    assert type(out["content_metadata"]["sharding"]) is tuple
    assert megatron_api.load_content_metadata(preloaded_state_dict=out) == ODD

    # the manifest: tagged values where JSON would lose them, valid against the schema
    jsonschema = pytest.importorskip("jsonschema")
    manifest = json.loads((path / "manifest.json").read_text())
    assert "content_metadata" not in manifest["user_metadata"]
    assert "$tuple" in json.dumps(manifest["user_metadata"]["content_metadata_encoded"])
    schema = json.loads((resources.files("shardsafe") / "schema/manifest.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(manifest)

    # plain JSON is stored as before (older readers and checkpoints read the same field)
    plain = tmp_path / "plain"
    shardsafe.save(sd, str(plain), content_metadata={"a": [1, 2], "b": {"c": None}})
    assert json.loads((plain / "manifest.json").read_text())["user_metadata"] == {
        "content_metadata": {"a": [1, 2], "b": {"c": None}}
    }
    assert shardsafe.load_content_metadata(str(plain)) == {"a": [1, 2], "b": {"c": None}}

    # what the manifest cannot hold is refused at save, before anything is written
    refused = tmp_path / "refused"
    with pytest.raises(shardsafe.ValidationError, match="content_metadata"):
        shardsafe.save(sd, str(refused), content_metadata={"t": torch.ones(1)})
    assert not refused.exists()


# --------------------------------------------------------------------------- zero-size pieces


def _uneven(rank: int, cls, template: bool = False):
    """A 1-D tensor of 2 elements split over the ranks: ranks 2 and above get nothing."""
    a, b = min(rank, 2), min(rank + 1, 2)
    data = torch.zeros(b - a) if template else torch.arange(2.0)[a:b].clone()
    if cls is mcore.ShardedTensor:
        return cls("u", data, data.dtype, (b - a,), (2,), (a,), None)
    return cls.from_global_offset("u", data, (2,), (a,))


def zero_size_pieces(rank, world, ours_path, megatron_path):
    from megatron.core import dist_checkpointing

    with cpu_as_cuda():
        dist_checkpointing.save({"u": _uneven(rank, mcore.ShardedTensor)}, megatron_path)
        theirs = dist_checkpointing.load(
            {"u": _uneven(rank, mcore.ShardedTensor, True)}, megatron_path
        )
    shardsafe.save({"u": _uneven(rank, shardsafe.ShardedTensor)}, ours_path)
    ours = shardsafe.load({"u": _uneven(rank, shardsafe.ShardedTensor, True)}, ours_path)
    return theirs["u"].tolist(), ours["u"].tolist()


def test_zero_size_pieces_held_by_several_ranks(pool, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "megatron"
    theirs.mkdir()
    results = pool.run(zero_size_pieces, str(ours), str(theirs), timeout=300)
    want = [[0.0], [1.0]] + [[]] * (WORLD - 2)
    assert [r[0] for r in results] == want  # Megatron saves and loads them
    assert [r[1] for r in results] == want
    assert torch.equal(shardsafe.CheckpointReader(ours).read_tensor("u"), torch.arange(2.0))


# --------------------------------------------------------------------------- another layout


def _stage(rank: int, layers: list[int], template: bool = False) -> dict:
    """What a pipeline stage holding ``layers`` builds: each layer's SwiGLU weight as the two
    ShardedTensors its factory makes (a list), and Adam state per local parameter id (a dict of
    ShardedTensors), every tensor split over the ranks."""

    def piece(key: str) -> mcore.ShardedTensor:
        data = torch.zeros(2) if template else torch.full((2,), float(rank))
        return mcore.ShardedTensor.from_rank_offsets(key, data, (0, rank, WORLD))

    return {
        "model": {
            f"decoder.layers.{n}.mlp.linear_fc1.weight": [
                piece(f"fc1.{n}.gate"),
                piece(f"fc1.{n}.up"),
            ]
            for n in layers
        },
        "optimizer": {
            "state": {i: {"exp_avg": piece(f"exp_avg.{n}")} for i, n in enumerate(layers)}
        },
        "iteration": 3,
    }


def load_as_another_stage(rank, world, ours_path, megatron_path):
    from megatron.core import dist_checkpointing

    with cpu_as_cuda():
        dist_checkpointing.save(_stage(rank, [0, 1]), megatron_path)
    megatron_api.save(_stage(rank, [0, 1]), ours_path)
    out = {}
    for name, call, path in (
        ("megatron", dist_checkpointing.load, megatron_path),
        ("ours", megatron_api.load, ours_path),
    ):
        with cpu_as_cuda():
            out[name] = _summary(call(_stage(rank, [1], template=True), path))
    return out


def test_a_stage_of_another_layout_gets_its_own_entries_only(pool, tmp_path):
    """Saved with layers 0 and 1 per rank, loaded by ranks that hold layer 1 alone (as a PP
    stage does): neither the other layer's list of pieces nor the other parameter id's Adam
    state comes back, as with Megatron (a torch optimizer would take that id as its own)."""
    ours, theirs = tmp_path / "ours", tmp_path / "megatron"
    ours.mkdir()
    theirs.mkdir()
    for rank, out in enumerate(pool.run(load_as_another_stage, str(ours), str(theirs))):
        assert out["ours"] == out["megatron"], (rank, out)
        got = out["ours"]["sd"]
        assert list(got["model"]) == ["decoder.layers.1.mlp.linear_fc1.weight"]
        assert got["model"]["decoder.layers.1.mlp.linear_fc1.weight"] == [[float(rank)] * 2] * 2
        assert list(got["optimizer"]["state"]) == ["0"] and got["iteration"] == 3


# --------------------------------------------------------------------------- strict modes


def _strict_request(rank: int) -> dict:
    """What rank ``rank`` asks for: its layer piece and RNG object (stored), a key of its own
    that no checkpoint holds (unexpected on every rank, as a collective load needs), and not
    ``opt`` (stored, requested by no rank: missing)."""
    sd = _layer(rank, template=True)
    sd["extra"] = {"x": mcore.ShardedTensor.from_rank_offsets(f"extra.{rank}", torch.zeros(2))}
    sd["items"] = [mcore.ShardedTensor.from_rank_offsets(f"gone.{rank}", torch.zeros(1))]
    return sd


def _summary(out) -> dict:
    """A comparable picture of what a load returned (or raised)."""

    def picture(node):
        if isinstance(node, dict):
            return {str(k): picture(v) for k, v in sorted(node.items(), key=lambda kv: str(kv[0]))}
        if isinstance(node, list):
            return [picture(v) for v in node]
        if isinstance(node, torch.Tensor):
            return node.tolist()
        return node

    if isinstance(out, tuple):
        sd, missing, unexpected = out
        return {"sd": picture(sd), "missing": sorted(missing), "unexpected": sorted(unexpected)}
    return {"sd": picture(out)}


def strict_modes(rank, world, ours_path, megatron_path, modes):
    import logging

    from megatron.core import dist_checkpointing

    def saved():  # Megatron's save rewrites the entities it is given: a fresh dict each time
        return {
            **_layer(rank),
            "opt": mcore.ShardedTensor.from_rank_offsets("opt", torch.ones(2), replica_id=rank),
        }

    with cpu_as_cuda():
        dist_checkpointing.save(saved(), megatron_path)
    megatron_api.save(saved(), ours_path)
    logging.getLogger().setLevel(logging.WARNING)
    report = {}
    for mode in modes:
        row = {}
        for name, call, path in (
            ("megatron", dist_checkpointing.load, megatron_path),
            ("ours", megatron_api.load, ours_path),
            ("ours-on-megatron-dir", megatron_api.load, megatron_path),
        ):
            try:
                with cpu_as_cuda():
                    row[name] = _summary(call(_strict_request(rank), path, strict=mode))
            except Exception as e:  # the classes differ by name; both are Megatron's exception
                row[name] = {"raised": isinstance(e, CheckpointingException)}
            torch.distributed.barrier()
        report[mode] = row
    return report


def test_every_strict_mode_behaves_as_in_megatron(pool, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "megatron"
    ours.mkdir()
    theirs.mkdir()
    modes = [m for m in ALL_MODES if m != "assume_ok_unexpected"]
    reports = pool.run(strict_modes, str(ours), str(theirs), modes, timeout=500)
    for rank, report in enumerate(reports):
        for mode in modes:
            row = report[mode]
            assert row["ours"] == row["megatron"], (rank, mode, row)
            assert row["ours-on-megatron-dir"] == row["megatron"], (rank, mode, row)
        # what the comparison covers
        assert report["raise_all"]["megatron"] == {"raised": True}
        assert report["raise_unexpected"]["megatron"] == {"raised": True}
        assert report["return_all"]["ours"]["missing"] == ["opt"]
        assert report["return_all"]["ours"]["unexpected"] == [f"extra.{rank}", f"gone.{rank}"]
        assert report["return_unexpected"]["ours"]["missing"] == []
        loaded = report["ignore_all"]["ours"]["sd"]
        assert "extra" not in loaded and "items" not in loaded and loaded["rng"] == {"rank": rank}
        tp, pp = _tp_pp(rank)
        want = torch.arange(PP * 12.0).reshape(PP, 4, 3)[pp, 2 * tp : 2 * tp + 2].tolist()
        assert loaded["w"] == want


def assume_ok(rank, world, ours_path):
    try:
        megatron_api.load(_strict_request(rank), ours_path)
    except CheckpointingException as e:
        return type(e).__name__, str(e)
    return None


def test_assume_ok_unexpected_raises_a_checkpointing_exception(pool, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    pool.run(_save_layer, str(path), timeout=300)
    for rank, result in enumerate(pool.run(assume_ok, str(path), timeout=300)):
        # each rank names its own keys, so the ranks' errors differ: one DistributedError
        assert result is not None and result[0] == "DistributedError", result
        assert "MissingKeyError" in result[1] and f"extra.{rank}" in result[1]


def raise_unexpected_on_one_rank(rank, world, path):
    request = _layer(rank, template=True)
    if rank == 1:
        request["extra"] = mcore.ShardedTensor.from_rank_offsets("extra", torch.zeros(1))
    try:
        megatron_api.load(request, path, strict="raise_unexpected")
    except CheckpointingException as e:
        return str(e)
    return None


def test_raise_modes_raise_on_every_rank(pool, tmp_path):
    """Megatron raises only where the key is unexpected (the other ranks then wait in the load);
    the Megatron-named load raises on every rank, naming the ranks."""
    path = tmp_path / "ckpt"
    path.mkdir()
    pool.run(_save_layer, str(path), timeout=300)
    messages = pool.run(raise_unexpected_on_one_rank, str(path), timeout=300)
    assert all(m is not None and "rank 1 request" in m for m in messages), messages
    assert "'extra'" in messages[1]


def _save_layer(rank, world, path):
    megatron_api.save(_layer(rank), path)


def test_strict_flag_is_checked_like_megatron(tmp_path):
    with pytest.raises(ValueError, match="strict") as err:
        megatron_api.load({}, str(tmp_path), strict="sometimes")
    assert isinstance(err.value, CheckpointingException)
