"""Megatron-Core's own mapping classes and dist_checkpointing entry points, one process.

The state dicts here are built with ``megatron.core.dist_checkpointing.mapping`` (the classes
a Megatron-Core model builds), so every field is checked to keep Megatron's meaning through
``shardsafe.save``/``load``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from megatron.core.dist_checkpointing import mapping as mcore

import shardsafe
from shardsafe import ValidationError


def _split_build(key, data, replica_id, flattened_range):
    a, b = data.chunk(2)
    return {
        "a": mcore.ShardedTensor.from_rank_offsets(f"{key}.a", a, replica_id=replica_id),
        "b": mcore.ShardedTensor.from_rank_offsets(f"{key}.b", b, replica_id=replica_id),
    }


def _split_merge(loaded):
    return torch.cat([loaded["a"], loaded["b"]])


def _state(seed: int, extra: object = "kept") -> dict:
    g = torch.Generator().manual_seed(seed)
    layers = torch.randn(2, 3, 4, generator=g)
    fused = torch.randn(6, 2, generator=g)
    return {
        "layers": [
            # layer i of a stack of 2: a prepended layer axis, as Megatron stacks decoder layers
            mcore.ShardedTensor.from_rank_offsets(
                "decoder.layers.w", layers[i], (0, i, 2), replica_id=(0, 0, 0), prepend_axis_num=1
            )
            for i in range(2)
        ],
        "fused": mcore.ShardedTensorFactory(
            "fused", fused, _split_build, _split_merge, replica_id=(0, 0, 0)
        ),
        "rng": mcore.ShardedObject("rng", {"seed": seed}, (1,), (0,), replica_id=0),
        "local": mcore.LocalNonpersistentObject(extra),
        "iteration": seed,
    }


def test_megatron_entities_keep_their_meaning(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _state(1)
    layers = [t.data.clone() for t in saved["layers"]]
    fused = saved["fused"].data.clone()
    shardsafe.save(saved, path)

    tensors = shardsafe.load_tensors_metadata(path)
    assert sorted(tensors) == ["decoder.layers.w", "fused.a", "fused.b"]
    assert tensors["decoder.layers.w"].global_shape == (2, 3, 4)
    assert tensors["fused.a"].data is None and tensors["fused.a"].dtype == torch.float32
    sharded = shardsafe.load_sharded_metadata(path)
    assert "rng/shard_0_1" in sharded and isinstance(
        sharded["rng/shard_0_1"], shardsafe.ShardedObject
    )
    assert "local" not in shardsafe.load_common_state_dict(path)  # never saved

    template = _state(2, extra="this run's value")
    out = shardsafe.load(template, path)
    for i in range(2):
        assert torch.equal(out["layers"][i], layers[i])
        assert template["layers"][i].data.data_ptr() == out["layers"][i].data_ptr()  # in place
    assert torch.equal(out["fused"], fused)  # built on save, merged on load
    assert out["rng"] == {"seed": 1}
    assert out["local"] == "this run's value"
    assert out["iteration"] == 1


def test_megatron_stored_shape_mismatch_needs_allow_shape_mismatch(tmp_path):
    path = str(tmp_path / "ckpt")
    shardsafe.save({"w": mcore.ShardedTensor.from_rank_offsets("emb", torch.ones(4, 2))}, path)
    bigger = mcore.ShardedTensor.from_rank_offsets("emb", torch.zeros(6, 2))
    with pytest.raises(shardsafe.CheckpointError, match="emb"):
        shardsafe.load({"w": bigger}, path)


def test_content_metadata_where_megatron_reads_it(tmp_path):
    path = str(tmp_path / "ckpt")
    meta = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}
    shardsafe.save(
        {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.ones(2))},
        path,
        content_metadata=meta,
    )
    assert shardsafe.load_content_metadata(path) == meta
    out = shardsafe.load({"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path)
    assert out["content_metadata"] == meta
    assert shardsafe.load_content_metadata(preloaded_state_dict=out) == meta
    with pytest.raises(ValidationError, match="checkpoint_dir or preloaded_state_dict"):
        shardsafe.load_content_metadata()


def test_save_into_an_existing_empty_directory(tmp_path):
    path = tmp_path / "iter_0000100"
    path.mkdir()
    shardsafe.save({"w": mcore.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, str(path))
    assert torch.equal(shardsafe.load_plain_tensors(str(path))["w"], torch.arange(4.0))


def test_apply_factories_and_merges_as_megatron():
    sd = {
        "f": shardsafe.ShardedTensorFactory("f", torch.arange(4.0), _our_build, _split_merge),
        "n": [shardsafe.ShardedTensorFactory("g", torch.arange(2.0), _our_build, _split_merge)],
    }
    template = dict(sd, n=list(sd["n"]))
    assert shardsafe.apply_factories(sd) is None  # in place, like Megatron
    assert sorted(sd["f"]) == ["a", "b"] and sd["f"]["a"].key == "f.a"
    assert sd["n"][0]["b"].key == "g.b"
    loaded = {
        "f": {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([2.0, 3.0])},
        "n": [{"a": torch.tensor([0.0]), "b": torch.tensor([1.0])}],
    }
    merged = shardsafe.apply_factory_merges(loaded, template)
    assert merged is loaded and torch.equal(loaded["f"], torch.arange(4.0))
    assert torch.equal(loaded["n"][0], torch.arange(2.0))
    with pytest.raises(ValidationError, match=r"state_dict\['x'\]|'x'"):
        shardsafe.apply_factory_merges({}, {"x": template["f"]})


def _our_build(key, data, replica_id, flattened_range):
    a, b = data.chunk(2)
    return {
        "a": shardsafe.ShardedTensor.from_rank_offsets(f"{key}.a", a),
        "b": shardsafe.ShardedTensor.from_rank_offsets(f"{key}.b", b),
    }


class _Shardish:
    """Something a framework might put in a state dict: one rank's piece, described Megatron-style."""

    def __init__(self):
        self.key = "w"
        self.global_shape = (4,)
        self.global_offset = (2,)
        self.data = torch.ones(2)


@pytest.mark.parametrize(
    "value,type_name",
    [
        (_Shardish(), "_Shardish"),
        ((1, mcore.ShardedTensor.from_rank_offsets("t", torch.ones(2))), "ShardedTensor"),
        ((shardsafe.ShardedTensor.from_rank_offsets("t", torch.ones(2)),), "ShardedTensor"),
        ({1, 2, frozenset([_Shardish()])}, "_Shardish"),
    ],
    ids=["attrs", "megatron-in-tuple", "ours-in-tuple", "nested-set"],
)
def test_sharded_looking_values_are_refused_at_save(tmp_path, value, type_name):
    path = tmp_path / "ckpt"
    with pytest.raises(ValidationError) as err:
        shardsafe.save({"model": {"w": torch.ones(2), "odd": value}}, str(path))
    assert "state_dict['model']['odd']" in str(err.value) and type_name in str(err.value)
    assert not (path.exists() and os.listdir(path)), "nothing may be written"


def test_import_shardsafe_does_not_import_megatron():
    code = "import sys, shardsafe; print(any(m.startswith('megatron') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_megatron_directory_round_trip_in_one_process(tmp_path):
    """convert --to megatron, then shardsafe.load reads that torch_dist directory back, with
    factories, objects and stacked layers; keys it lacks are named."""
    from shardsafe.convert import open_source
    from shardsafe.convert.megatron_export import export_megatron

    src, dst = str(tmp_path / "ckpt"), tmp_path / "megatron"
    saved = _state(3)
    layers = [t.data.clone() for t in saved["layers"]]
    fused = saved["fused"].data.clone()
    shardsafe.save(saved, src)
    export_megatron(open_source(src), dst)
    assert sorted(p.name for p in dst.iterdir() if not p.name.startswith("__")) == [
        ".metadata",
        "common.pt",
        "metadata.json",
    ]
    out = shardsafe.load(_state(4, extra="mine"), str(dst))
    for i in range(2):
        assert torch.equal(out["layers"][i], layers[i])
    assert torch.equal(out["fused"], fused)
    assert out["rng"] == {"seed": 3} and out["local"] == "mine" and out["iteration"] == 3
    extra = {"w": mcore.ShardedTensor.from_rank_offsets("not.there", torch.zeros(2))}
    with pytest.raises(shardsafe.MissingKeyError, match=r"not\.there"):
        shardsafe.load(extra, str(dst), strict="raise_unexpected")
    wrong = {"w": mcore.ShardedTensor.from_rank_offsets("fused.a", torch.zeros(5, 2))}
    with pytest.raises(shardsafe.CheckpointError, match=r"fused\.a"):
        shardsafe.load(wrong, str(dst))


def test_megatron_lm_common_state_with_args_loads(tmp_path):
    """Megatron-LM's common.pt holds ``args`` (an argparse.Namespace): load returns it, no code runs."""
    import argparse

    from shardsafe.convert import open_source
    from shardsafe.convert.megatron_export import export_megatron

    src, dst = str(tmp_path / "ckpt"), tmp_path / "megatron"
    shardsafe.save({"w": mcore.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, src)
    export_megatron(open_source(src), dst)
    torch.save({"args": argparse.Namespace(lr=0.1), "iteration": 5}, dst / "common.pt")
    out = shardsafe.load(
        {"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, str(dst)
    )
    assert out["args"].lr == 0.1 and out["iteration"] == 5
    assert torch.equal(out["w"], torch.arange(4.0))


def test_the_plugin_points_are_objects_that_list_what_is_registered(tmp_path):
    from shardsafe.integrations.megatron import is_torch_dist_dir, megatron_aware
    from shardsafe.loading import FOREIGN_LOADERS
    from shardsafe.sharding import STATE_DICT_ADAPTERS

    assert megatron_aware in STATE_DICT_ADAPTERS.registered  # registered by `import shardsafe`
    assert any(detect is is_torch_dist_dir for detect, _ in FOREIGN_LOADERS.registered)

    class Boxed:  # a framework's leaf type
        def __init__(self, t):
            self.t = t

    def unbox(tree):
        if isinstance(tree, dict):
            return {k: unbox(v) for k, v in tree.items()}
        return (
            shardsafe.ShardedTensor.from_rank_offsets("w", tree.t)
            if isinstance(tree, Boxed)
            else tree
        )

    w = torch.randn(4, 3)
    shardsafe.register_state_dict_adapter(unbox)
    try:
        assert STATE_DICT_ADAPTERS.registered[-1] is unbox
        shardsafe.save({"w": Boxed(w)}, tmp_path / "ck")
    finally:
        STATE_DICT_ADAPTERS.unregister(unbox)
    assert unbox not in STATE_DICT_ADAPTERS.registered
    assert torch.equal(shardsafe.CheckpointReader(tmp_path / "ck").read_tensor("w"), w)
