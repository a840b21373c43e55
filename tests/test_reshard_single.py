"""Any random save partition -> any random load partition gives back the exact tensor."""

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from partitions import expected, random_partition

import shardsafe

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool]


def make_full(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


@given(
    shapes=st.lists(
        st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3
    ),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from(DTYPES),
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_random_partitions_round_trip(tmp_path_factory, shapes, seed, dtype):
    rng = random.Random(seed)
    path = tmp_path_factory.mktemp("ck") / "c"
    fulls = {f"t{i}": make_full(shape, dtype, seed + i) for i, shape in enumerate(shapes)}
    save_sd = {}
    for key, full in fulls.items():
        for j, piece in enumerate(random_partition(key, full, rng)):
            save_sd[f"{key}.{j}"] = piece
    shardsafe.save(save_sd, path)
    load_sd = {}
    for key, full in fulls.items():
        for j, piece in enumerate(random_partition(key, full, rng, replicas=0.3, with_data=False)):
            load_sd[f"{key}.{j}"] = piece
    out = shardsafe.load(load_sd, path)
    for name, piece in load_sd.items():
        want = expected(fulls[piece.key], piece)
        assert torch.equal(out[name], want), name
        assert out[name] is piece.data  # filled in place
    reader = shardsafe.CheckpointReader(path)
    for key, full in fulls.items():
        assert torch.equal(reader.read_tensor(key), full)
    assert reader.verify().ok


def test_small_buffer_forces_strided_chunked_reads(tmp_path):
    full = torch.randn(64, 48)
    save_sd = {
        f"p{r}": shardsafe.ShardedTensor.from_rank_offsets(
            "w", full[:, r * 12 : (r + 1) * 12].clone(), (1, r, 4)
        )
        for r in range(4)
    }
    shardsafe.Saver(block_bytes=256).save(save_sd, tmp_path / "c")
    dest = torch.zeros(32, 48)
    shardsafe.load(
        {"w": shardsafe.ShardedTensor.from_rank_offsets("w", dest, (0, 1, 2))},
        tmp_path / "c",
        max_buffer_bytes=100,
    )
    assert torch.equal(dest, full[32:])


def test_factories_nonpersistent_and_common_state(tmp_path):
    def build(key, data, replica_id, flattened_range):
        a, b = data.chunk(2)
        return {
            "a": shardsafe.ShardedTensor.from_rank_offsets(f"{key}.a", a),
            "b": shardsafe.ShardedTensor.from_rank_offsets(f"{key}.b", b),
        }

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    fused = torch.arange(8.0).reshape(4, 2)
    sd = {
        "fused": shardsafe.ShardedTensorFactory("glu", fused, build, merge),
        "local": shardsafe.LocalNonPersistentObject("not saved"),
        "common": {"step": 4, 1: (2.5, None), "nan": float("nan"), "list": [1, "x", b"raw"]},
    }
    shardsafe.save(sd, tmp_path / "c")
    assert set(shardsafe.load_metadata(tmp_path / "c")) == {"glu.a", "glu.b"}
    template = {
        "fused": shardsafe.ShardedTensorFactory("glu", torch.zeros(4, 2), build, merge),
        "local": shardsafe.LocalNonPersistentObject("fresh"),
    }
    out = shardsafe.load(template, tmp_path / "c")
    assert torch.equal(out["fused"], fused)
    assert out["local"] == "fresh"
    assert (
        out["common"]["step"] == 4
        and out["common"][1] == (2.5, None)
        and out["common"]["list"] == [1, "x", b"raw"]
    )
    assert out["common"]["nan"] != out["common"]["nan"]


def test_prepended_axes_stack_layers_and_regroup(tmp_path):
    layers = torch.randn(4, 6, 8)
    # saved by "2 pipeline stages": each holds 2 layers, one ShardedTensor per layer
    sd = {
        f"l{i}": shardsafe.ShardedTensor.from_rank_offsets(
            "layers.w", layers[i].clone(), (0, i, 4), prepend_axis_num=1
        )
        for i in range(4)
    }
    shardsafe.save(sd, tmp_path / "c")
    assert shardsafe.load_metadata(tmp_path / "c")["layers.w"].global_shape == (4, 6, 8)
    # loaded as 4 stages x TP2 on the last axis
    template = {
        f"l{i}.{t}": shardsafe.ShardedTensor.from_rank_offsets(
            "layers.w", torch.zeros(6, 4), (0, i, 4), (2, t, 2), prepend_axis_num=1
        )
        for i in range(4)
        for t in range(2)
    }
    out = shardsafe.load(template, tmp_path / "c")
    for i in range(4):
        for t in range(2):
            assert torch.equal(out[f"l{i}.{t}"], layers[i, :, t * 4 : (t + 1) * 4])
